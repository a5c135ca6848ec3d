// The mixture-of-experts ops on the GPU (kernels/ops_moe.h): the router's rows, the row moves, the
// combine, the experts' gate gradients and the auxiliary loss, each element through
// kernels/moe_math.h in the CPU's order (compiled with -fmad=false), so they give the CPU's bits;
// the router's scores differ by CUDA's expf only. The experts' GEMMs are not here: ops_moe.cpp
// runs them through the linear ops (cuBLAS, ops_linear.cu), one expert at a time.
//
// Deterministic: no floating-point atomics. A row's sums are one thread's loop; the auxiliary
// loss counts the routed slots with integer atomics (exact, so their order cannot show) and sums
// its terms in the CPU's order, one thread per sequence and then one thread over the sequences.
#include "kernels/cuda/cuda_internal.cuh"
#include "kernels/moe_math.h"

namespace t3d::kernels::cuda {
namespace {

__device__ inline std::int64_t first_index() {
  return blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x;
}
__device__ inline std::int64_t grid_stride() { return std::int64_t{gridDim.x} * blockDim.x; }

void check_router_shape(const RouterShape& r) {
  T3D_ASSERT(r.E > 0 && r.K > 0 && r.K <= r.E, "router with E = ", r.E, ", K = ", r.K);
}

// ---- the router: one thread per token -------------------------------------------------------

__global__ void route_forward_kernel(float* scores, std::int32_t* chosen, float* gates,
                                     const float* logits, const float* bias, RouterShape r) {
  const bool softmax = r.score == RouterScore::kSoftmax;
  for (std::int64_t t = first_index(); t < r.N; t += grid_stride())
    detail::moe_route_row(scores + t * r.E, chosen + t * r.K, gates + t * r.K, logits + t * r.E,
                          bias, r.E, r.K, softmax, r.normalize, r.scale);
}

__global__ void route_backward_kernel(float* dlogits, const float* dgates, const float* extra,
                                      const float* scores, const std::int32_t* chosen,
                                      RouterShape r) {
  const bool softmax = r.score == RouterScore::kSoftmax;
  for (std::int64_t t = first_index(); t < r.N; t += grid_stride())
    detail::moe_route_backward_row(dlogits + t * r.E, dgates + t * r.K,
                                   extra ? extra + t * r.E : nullptr, scores + t * r.E,
                                   chosen + t * r.K, r.E, r.K, softmax, r.normalize, r.scale);
}

// ---- row moves and the combine: one thread per element ----------------------------------------

template <class T>
__global__ void gather_kernel(T* rows, const T* x, const std::int32_t* slot_of_row, std::int64_t S,
                              std::int64_t K, std::int64_t C) {
  for (std::int64_t i = first_index(); i < S * C; i += grid_stride()) {
    const std::int64_t r = i / C, c = i % C;
    rows[i] = x[(slot_of_row[r] / K) * C + c];
  }
}

// y[t, c] = the first kept slot's product, plus the next, ... for j ascending (kernels/ops_moe.h),
// then written or added: the CPU's order, element by element.
__global__ void combine_kernel(float* y, const float* rows, const float* w,
                               const std::int32_t* row_of_slot, std::int64_t N, std::int64_t K,
                               std::int64_t C, bool accumulate) {
  for (std::int64_t i = first_index(); i < N * C; i += grid_stride()) {
    const std::int64_t t = i / C, c = i % C;
    float acc = 0.0f;  // every slot dropped: +0
    bool started = false;
    for (std::int64_t j = 0; j < K; ++j) {
      const std::int32_t row = row_of_slot[t * K + j];
      if (row < 0) continue;  // a dropped slot
      const float v = rows[row * C + c];
      const float p = w ? w[t * K + j] * v : v;
      acc = started ? acc + p : p;
      started = true;
    }
    y[i] = accumulate ? y[i] + acc : acc;
  }
}

__global__ void gather_slots_kernel(float* by_row, const float* by_slot,
                                    const std::int32_t* slot_of_row, std::int64_t rows) {
  for (std::int64_t r = first_index(); r < rows; r += grid_stride())
    by_row[r] = by_slot[slot_of_row[r]];
}

__global__ void scatter_slots_kernel(float* by_slot, const float* by_row,
                                     const std::int32_t* slot_of_row, std::int64_t rows) {
  for (std::int64_t r = first_index(); r < rows; r += grid_stride())
    by_slot[slot_of_row[r]] = by_row[r];
}

// ---- the experts' gate gradients --------------------------------------------------------------

// One thread per row: its double sum over f in order, rounded once (the CPU's chain per row).
__global__ void gate_dot_kernel(ExpertGating g, const float* dh, const float* h, const bf16* h16,
                                std::int64_t S, std::int64_t Fe) {
  for (std::int64_t r = first_index(); r < S; r += grid_stride()) {
    const float* u = dh + r * Fe;
    double d = 0.0;
    for (std::int64_t f = 0; f < Fe; ++f)
      d += detail::moe_gate_term(u[f], h16 ? detail::float_of(h16[r * Fe + f]) : h[r * Fe + f]);
    g.dgates[g.slot_of_row[r]] = static_cast<float>(d);
  }
}

// x (S, width) row r *= the gate of row r's slot. Runs after gate_dot_kernel, which reads dh
// unscaled.
__global__ void gate_scale_kernel(float* x, ExpertGating g, std::int64_t S, std::int64_t width) {
  for (std::int64_t i = first_index(); i < S * width; i += grid_stride())
    x[i] *= g.gates[g.slot_of_row[i / width]];
}

// ---- the auxiliary loss -------------------------------------------------------------------------

// One block per sequence b: its slots counted per expert (integer atomics in shared memory:
// exact), then f[b, e] = count / (T K) in double, the CPU's value. `chosen` comes from the router
// (every entry < E; the CPU asserts it): an entry outside [0, E) is not counted.
__global__ void aux_fractions_kernel(double* f, const std::int32_t* chosen, std::int64_t T,
                                     std::int64_t E, std::int64_t K) {
  __shared__ unsigned int counts[kMaxExperts];
  const std::int64_t b = blockIdx.x;
  for (std::int64_t e = threadIdx.x; e < E; e += blockDim.x) counts[e] = 0;
  __syncthreads();
  const std::int32_t* c = chosen + b * T * K;
  for (std::int64_t i = threadIdx.x; i < T * K; i += blockDim.x)
    if (c[i] >= 0 && c[i] < E) atomicAdd(&counts[c[i]], 1u);
  __syncthreads();
  for (std::int64_t e = threadIdx.x; e < E; e += blockDim.x)
    f[b * E + e] = static_cast<double>(counts[e]) / static_cast<double>(T * K);
}

// One thread per token t of the B·T: its term fp[t] and, with dscores, its gradient row.
__global__ void aux_tokens_kernel(double* fp, float* dscores, const float* scores, const double* f,
                                  std::int64_t N, std::int64_t T, std::int64_t E, bool sigmoid,
                                  double w) {
  for (std::int64_t t = first_index(); t < N; t += grid_stride())
    fp[t] = detail::moe_aux_token(dscores ? dscores + t * E : nullptr, scores + t * E,
                                  f + (t / T) * E, E, sigmoid, w);
}

// One block: thread b sums its sequence's terms over t in order, then thread 0 sums coef · loss_b
// over b in order (the CPU's loops).
__global__ void aux_total_kernel(double* total, double* loss, const double* fp, std::int64_t B,
                                 std::int64_t T, double coef) {
  for (std::int64_t b = threadIdx.x; b < B; b += blockDim.x) {
    double l = 0.0;
    for (std::int64_t t = 0; t < T; ++t) l += fp[b * T + t];
    loss[b] = l;
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  double sum = 0.0;
  for (std::int64_t b = 0; b < B; ++b) sum += coef * loss[b];
  *total = sum;
}

}  // namespace

void moe_route_forward(const Stream& s, float* scores, std::int32_t* chosen, float* gates,
                       const float* logits, const float* bias, const RouterShape& r) {
  check_router_shape(r);
  route_forward_kernel<<<grid_for(r.N), kBlock, 0, s.impl().stream>>>(scores, chosen, gates, logits,
                                                                      bias, r);
  T3D_CUDA_LAUNCHED();
}

void moe_route_backward(const Stream& s, float* dlogits, const float* dgates,
                        const float* dscores_extra, const float* scores, const std::int32_t* chosen,
                        const RouterShape& r) {
  check_router_shape(r);
  route_backward_kernel<<<grid_for(r.N), kBlock, 0, s.impl().stream>>>(
      dlogits, dgates, dscores_extra, scores, chosen, r);
  T3D_CUDA_LAUNCHED();
}

void moe_gather(const Stream& s, float* rows, const float* x, const std::int32_t* slot_of_row,
                std::int64_t S, std::int64_t K, std::int64_t C) {
  if (S * C == 0) return;
  gather_kernel<<<grid_for(S * C), kBlock, 0, s.impl().stream>>>(rows, x, slot_of_row, S, K, C);
  T3D_CUDA_LAUNCHED();
}

void moe_gather(const Stream& s, bf16* rows, const bf16* x, const std::int32_t* slot_of_row,
                std::int64_t S, std::int64_t K, std::int64_t C) {
  if (S * C == 0) return;
  gather_kernel<<<grid_for(S * C), kBlock, 0, s.impl().stream>>>(rows, x, slot_of_row, S, K, C);
  T3D_CUDA_LAUNCHED();
}

void moe_combine(const Stream& s, float* y, const float* rows, const float* w,
                 const std::int32_t* row_of_slot, std::int64_t N, std::int64_t K, std::int64_t C,
                 Out mode) {
  if (N * C == 0) return;
  combine_kernel<<<grid_for(N * C), kBlock, 0, s.impl().stream>>>(y, rows, w, row_of_slot, N, K, C,
                                                                  mode == Out::kAccumulate);
  T3D_CUDA_LAUNCHED();
}

void moe_gather_slots(const Stream& s, float* by_row, const float* by_slot,
                      const std::int32_t* slot_of_row, std::int64_t rows) {
  if (rows == 0) return;
  gather_slots_kernel<<<grid_for(rows), kBlock, 0, s.impl().stream>>>(by_row, by_slot, slot_of_row,
                                                                      rows);
  T3D_CUDA_LAUNCHED();
}

void moe_scatter_slots(const Stream& s, float* by_slot, const float* by_row,
                       const std::int32_t* slot_of_row, std::int64_t rows) {
  if (rows == 0) return;
  scatter_slots_kernel<<<grid_for(rows), kBlock, 0, s.impl().stream>>>(by_slot, by_row, slot_of_row,
                                                                       rows);
  T3D_CUDA_LAUNCHED();
}

void moe_gate_grads(const Stream& s, const ExpertGating& gating, float* dh, float* dys,
                    const float* h, const bf16* h16, std::int64_t S, std::int64_t C,
                    std::int64_t Fe) {
  if (S == 0) return;
  cudaStream_t st = s.impl().stream;
  gate_dot_kernel<<<grid_for(S), kBlock, 0, st>>>(gating, dh, h, h16, S, Fe);
  T3D_CUDA_LAUNCHED();
  gate_scale_kernel<<<grid_for(S * Fe), kBlock, 0, st>>>(dh, gating, S, Fe);
  T3D_CUDA_LAUNCHED();
  gate_scale_kernel<<<grid_for(S * C), kBlock, 0, st>>>(dys, gating, S, C);
  T3D_CUDA_LAUNCHED();
}

double moe_aux_loss(const Stream& s, float* dscores, const float* scores,
                    const std::int32_t* chosen, std::int64_t B, std::int64_t T,
                    const RouterShape& r, float weight, bool value_to_host) {
  check_router_shape(r);
  T3D_ASSERT(r.E <= kMaxExperts && B * T == r.N, "aux loss over ", B, " x ", T, " tokens of ", r.E,
             " experts, router of ", r.N);
  if (B == 0 || T == 0) return 0.0;
  const std::int64_t E = r.E, N = r.N;
  // The partial sums in the stream's buffer: f (B, E), the token terms (N), the sequences' losses
  // (B), the total.
  double* f =
      s.impl().moe_sums.at_least(s.impl().stream, static_cast<std::size_t>(B * E + N + B + 1));
  double* fp = f + B * E;
  double* loss = fp + N;
  double* total = loss + B;
  cudaStream_t st = s.impl().stream;
  aux_fractions_kernel<<<static_cast<unsigned>(B), kBlock, 0, st>>>(f, chosen, T, E, r.K);
  T3D_CUDA_LAUNCHED();
  const double coef = static_cast<double>(E) / static_cast<double>(T);
  aux_tokens_kernel<<<grid_for(N), kBlock, 0, st>>>(
      fp, dscores, scores, f, N, T, E, r.score == RouterScore::kSigmoid, weight * coef);
  T3D_CUDA_LAUNCHED();
  if (!value_to_host) return 0.0;  // the gradient alone: the sums are not needed
  aux_total_kernel<<<1, kBlock, 0, st>>>(total, loss, fp, B, T, coef);
  T3D_CUDA_LAUNCHED();
  // The crossing: the loss is a host value (the step's auxiliary loss), so the call waits.
  double host = 0.0;
  copy_to_host(s, &host, total, sizeof host);
  s.synchronize();
  return host;
}

}  // namespace t3d::kernels::cuda
