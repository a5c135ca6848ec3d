// Mixture-of-experts operators (kernels/ops_moe.h). The experts' GEMMs are the linear ops of
// ops_mlp.cpp on each expert's contiguous block of permuted rows: that loop over experts is the
// grouped GEMM on a CPU. Row loops are split over the rank's threads with each row computed alone,
// so their results do not depend on the thread count (kernels/threads.h).
#include "kernels/ops_moe.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels/check.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/gemm.h"
#include "kernels/moe_math.h"
#include "kernels/ops.h"
#include "kernels/threads.h"

namespace t3d::kernels {
namespace {

// Each of the n slots' expert, checked against E once here: fn(slot, expert) in slot order. The
// one pass that counts slots per expert (moe_permute, moe_count, moe_aux_loss).
template <class Fn>
void for_each_slot(const std::int32_t* chosen, std::int64_t n, std::int64_t E, Fn&& fn) {
  for (std::int64_t i = 0; i < n; ++i) {
    T3D_ASSERT(chosen[i] >= 0 && chosen[i] < E, "slot ", i, " routed to expert ", chosen[i], " of ",
               E);
    fn(i, chosen[i]);
  }
}

void check_router(const RouterShape& r) {
  T3D_ASSERT(r.E > 0 && r.K > 0 && r.K <= r.E, "router with E = ", r.E, ", K = ", r.K);
}

// Runs row(t) for every token t of a router op on the CPU (the rows split over the threads; each
// row reads and writes only its own E scores and K choices), after checking the shape.
template <class Row>
void for_each_router_row(const RouterShape& r, Row row) {
  check_router(r);
  detail::split_rows(r.N, r.E, [&](std::int64_t lo, std::int64_t hi) {
    for (std::int64_t t = lo; t < hi; ++t) row(t);
  });
}

}  // namespace

void moe_route_forward(const Exec& exec, float* scores, std::int32_t* chosen, float* gates,
                       const float* logits, const float* bias, const RouterShape& r) {
  T3D_ON_GPU(exec, cuda::moe_route_forward(*exec.stream, scores, chosen, gates, logits, bias, r));
  const std::int64_t E = r.E, K = r.K;
  const bool softmax = r.score == RouterScore::kSoftmax;
  for_each_router_row(r, [&](std::int64_t t) {
    detail::moe_route_row(scores + t * E, chosen + t * K, gates + t * K, logits + t * E, bias, E, K,
                          softmax, r.normalize, r.scale);
  });
}

// The arithmetic is detail::moe_route_backward_row's (kernels/moe_math.h).
void moe_route_backward(const Exec& exec, float* dlogits, const float* dgates,
                        const float* dscores_extra, const float* scores, const std::int32_t* chosen,
                        const RouterShape& r) {
  T3D_ON_GPU(exec, cuda::moe_route_backward(*exec.stream, dlogits, dgates, dscores_extra, scores,
                                            chosen, r));
  const std::int64_t E = r.E, K = r.K;
  const bool softmax = r.score == RouterScore::kSoftmax;
  for_each_router_row(r, [&](std::int64_t t) {
    detail::moe_route_backward_row(dlogits + t * E, dgates + t * K,
                                   dscores_extra ? dscores_extra + t * E : nullptr, scores + t * E,
                                   chosen + t * K, E, K, softmax, r.normalize, r.scale);
  });
}

std::int64_t moe_capacity(double factor, std::int64_t N, std::int64_t E, std::int64_t K) {
  if (factor <= 0) return 0;
  const double share = factor * static_cast<double>(N * K) / static_cast<double>(E);
  return std::max<std::int64_t>(1, static_cast<std::int64_t>(std::ceil(share)));
}

// Counting sort without scratch: the first pass counts each expert's slots into offsets[e + 1]
// and leaves in row_of_slot[i] the slot's ordinal among its expert's slots (slot order); the
// counts clamped to the capacity and summed give the starts; a slot whose ordinal reaches the
// capacity drops, the others land at their expert's start plus their ordinal.
std::int64_t moe_permute(std::int64_t* offsets, std::int32_t* row_of_slot,
                         std::int32_t* slot_of_row, const std::int32_t* chosen, std::int64_t N,
                         std::int64_t E, std::int64_t K, std::int64_t capacity) {
  const std::int64_t S = N * K;
  const std::int64_t limit = capacity > 0 ? capacity : S;
  for (std::int64_t e = 0; e <= E; ++e) offsets[e] = 0;
  for_each_slot(chosen, S, E, [&](std::int64_t i, std::int32_t e) {
    row_of_slot[i] = static_cast<std::int32_t>(offsets[e + 1]++);
  });
  for (std::int64_t e = 0; e < E; ++e)
    offsets[e + 1] = offsets[e] + std::min(offsets[e + 1], limit);
  std::int64_t dropped = 0;
  for (std::int64_t i = 0; i < S; ++i) {
    const std::int64_t ordinal = row_of_slot[i];
    if (ordinal >= limit) {
      row_of_slot[i] = -1;
      ++dropped;
      continue;
    }
    const std::int64_t row = offsets[chosen[i]] + ordinal;
    row_of_slot[i] = static_cast<std::int32_t>(row);
    slot_of_row[row] = static_cast<std::int32_t>(i);
  }
  return dropped;
}

namespace {
template <class T>
void gather_rows(T* rows, const T* x, const std::int32_t* slot_of_row, std::int64_t S,
                 std::int64_t K, std::int64_t C) {
  detail::split_rows(S, C, [&](std::int64_t lo, std::int64_t hi) {
    for (std::int64_t r = lo; r < hi; ++r)
      std::memcpy(rows + r * C, x + (slot_of_row[r] / K) * C, sizeof(T) * static_cast<size_t>(C));
  });
}
}  // namespace

void moe_gather(const Exec& exec, float* rows, const float* x, const std::int32_t* slot_of_row,
                std::int64_t S, std::int64_t K, std::int64_t C) {
  T3D_ON_GPU(exec, cuda::moe_gather(*exec.stream, rows, x, slot_of_row, S, K, C));
  gather_rows(rows, x, slot_of_row, S, K, C);
}

void moe_gather(const Exec& exec, bf16* rows, const bf16* x, const std::int32_t* slot_of_row,
                std::int64_t S, std::int64_t K, std::int64_t C) {
  T3D_ON_GPU(exec, cuda::moe_gather(*exec.stream, rows, x, slot_of_row, S, K, C));
  gather_rows(rows, x, slot_of_row, S, K, C);
}

// Per token, the K slots' products are summed j-outer over the row (in chunks of a stack row
// when adding to y), so that the inner loops run over c and vectorize: each element is still
// the first kept product, plus the next, and so on for j ascending, then written or added.
void moe_combine(const Exec& exec, float* y, const float* rows, const float* w,
                 const std::int32_t* row_of_slot, std::int64_t N, std::int64_t K, std::int64_t C,
                 Out mode) {
  T3D_ON_GPU(exec, cuda::moe_combine(*exec.stream, y, rows, w, row_of_slot, N, K, C, mode));
  detail::split_rows(N, K * C, [&](std::int64_t lo, std::int64_t hi) {
    constexpr std::int64_t kChunk = 512;
    float sum[kChunk];
    for (std::int64_t t = lo; t < hi; ++t) {
      const std::int32_t* slots = row_of_slot + t * K;
      for (std::int64_t c0 = 0; c0 < C; c0 += kChunk) {
        const std::int64_t n = std::min(kChunk, C - c0);
        float* yt = y + t * C + c0;
        // The sum of the K products first, then written or added: the same bits whatever the
        // mode, for the part the combine computes. Written: summed in y's row itself.
        float* acc = mode == Out::kAccumulate ? sum : yt;
        bool started = false;
        for (std::int64_t j = 0; j < K; ++j) {
          const std::int32_t row = slots[j];
          if (row < 0) continue;  // a dropped slot; the first kept product starts the sum
          const float* v = rows + row * C + c0;
          if (w) {
            const float g = w[t * K + j];
            if (started)
              for (std::int64_t c = 0; c < n; ++c) acc[c] = acc[c] + g * v[c];
            else
              for (std::int64_t c = 0; c < n; ++c) acc[c] = g * v[c];
          } else {
            if (started)
              for (std::int64_t c = 0; c < n; ++c) acc[c] = acc[c] + v[c];
            else
              for (std::int64_t c = 0; c < n; ++c) acc[c] = v[c];
          }
          started = true;
        }
        if (!started)  // every slot dropped: the sum is +0
          for (std::int64_t c = 0; c < n; ++c) acc[c] = 0.0f;
        if (mode == Out::kAccumulate)
          for (std::int64_t c = 0; c < n; ++c) yt[c] = yt[c] + acc[c];
      }
    }
  });
}

void moe_gather_slots(const Exec& exec, float* by_row, const float* by_slot,
                      const std::int32_t* slot_of_row, std::int64_t rows) {
  T3D_ON_GPU(exec, cuda::moe_gather_slots(*exec.stream, by_row, by_slot, slot_of_row, rows));
  for (std::int64_t r = 0; r < rows; ++r) by_row[r] = by_slot[slot_of_row[r]];
}

void moe_scatter_slots(const Exec& exec, float* by_slot, const float* by_row,
                       const std::int32_t* slot_of_row, std::int64_t rows) {
  T3D_ON_GPU(exec, cuda::moe_scatter_slots(*exec.stream, by_slot, by_row, slot_of_row, rows));
  for (std::int64_t r = 0; r < rows; ++r) by_slot[slot_of_row[r]] = by_row[r];
}

namespace {

// The row bucket of the experts' M-row GEMMs (for_each_expert), after refusing copies the GEMM
// kind cannot use. On a GPU each expert's exact rows: cuBLAS takes any row count, and the bucket
// only spares the CPU's JIT'd kernels a shape per count (kernels/gemm.h).
std::int64_t experts_bucket(const Exec& exec, const ExpertCopies& c) {
  const GemmKind kind = exec.gemm;
  T3D_ASSERT(!c.fused() || (gemm_kind_is_bf16(kind) && c.gate && c.up),
             "the experts' fused bf16 SwiGLU needs bf16 GEMMs and all three copies");
  T3D_ASSERT(!c.xs || gemm_kind_is_bf16(kind), "rounded expert rows need bf16 GEMMs");
  return exec.on_gpu() ? 1 : gemm_row_bucket(kind);
}

// The rows' gate gradients on the CPU: dgates[slot_of_row[r]] = Σ_f U[r, f] · h[r, f] in double,
// each row's sum sequential over f and rounded once (four rows' sums side by side: independent
// chains, each in its own order); then U and the row's dys scaled by its gate. `hv(r, f)` reads h.
template <class H>
void gate_grads_rows(const ExpertGating& gating, float* dh, float* dys, std::int64_t S,
                     std::int64_t C, std::int64_t Fe, H&& hv) {
  using detail::moe_gate_term;
  detail::split_rows(S, C + 2 * Fe, [&](std::int64_t lo, std::int64_t hi) {
    constexpr std::int64_t kRows = 4;
    for (std::int64_t r0 = lo; r0 < hi; r0 += kRows) {
      const std::int64_t nr = std::min(kRows, hi - r0);
      double dot[kRows] = {0.0, 0.0, 0.0, 0.0};
      if (nr == kRows) {
        const float *u0 = dh + r0 * Fe, *u1 = u0 + Fe, *u2 = u1 + Fe, *u3 = u2 + Fe;
        double d0 = 0.0, d1 = 0.0, d2 = 0.0, d3 = 0.0;
        for (std::int64_t f = 0; f < Fe; ++f) {
          d0 += moe_gate_term(u0[f], hv(r0, f));
          d1 += moe_gate_term(u1[f], hv(r0 + 1, f));
          d2 += moe_gate_term(u2[f], hv(r0 + 2, f));
          d3 += moe_gate_term(u3[f], hv(r0 + 3, f));
        }
        dot[0] = d0, dot[1] = d1, dot[2] = d2, dot[3] = d3;
      } else {
        for (std::int64_t i = 0; i < nr; ++i) {
          const float* u = dh + (r0 + i) * Fe;
          double d = 0.0;
          for (std::int64_t f = 0; f < Fe; ++f) d += moe_gate_term(u[f], hv(r0 + i, f));
          dot[i] = d;
        }
      }
      for (std::int64_t i = 0; i < nr; ++i) {
        const std::int64_t r = r0 + i;
        const std::int32_t slot = gating.slot_of_row[r];
        gating.dgates[slot] = static_cast<float>(dot[i]);
        const float g = gating.gates[slot];
        float* u = dh + r * Fe;
        for (std::int64_t f = 0; f < Fe; ++f) u[f] *= g;
        float* dy = dys + r * C;
        for (std::int64_t c = 0; c < C; ++c) dy[c] *= g;
      }
    }
  });
}

// gate_grads_rows on either backend over the S rows, h read from its bf16 copy h16 when there is
// one (the fused SwiGLU), else from its floats.
void gate_grads_and_scale(const Exec& exec, const ExpertGating& gating, float* dh, float* dys,
                          const float* h, const bf16* h16, std::int64_t S, std::int64_t C,
                          std::int64_t Fe) {
  T3D_ON_GPU(exec, cuda::moe_gate_grads(*exec.stream, gating, dh, dys, h, h16, S, C, Fe));
  if (h16)
    gate_grads_rows(gating, dh, dys, S, C, Fe,
                    [&](std::int64_t r, std::int64_t f) { return bf16_to_float(h16[r * Fe + f]); });
  else
    gate_grads_rows(gating, dh, dys, S, C, Fe,
                    [&](std::int64_t r, std::int64_t f) { return h[r * Fe + f]; });
}

// A caller's rounded copy from row offset i on, or null. LinearInput takes its copy non-const for
// Copy::kFill; the experts only pass copies as kFilled, which are never written.
bf16* copy_at(const bf16* p, std::int64_t i) { return p ? const_cast<bf16*>(p) + i : nullptr; }

}  // namespace

void moe_experts_forward(const Exec& exec, float* y, const ExpertActs& acts, const float* xs,
                         const ExpertWeights& w, const std::int64_t* offsets, const ExpertShape& s,
                         const ExpertCopies& copies) {
  using Copy = LinearInput::Copy;
  const std::int64_t C = s.C, Fe = s.Fe, S = offsets[s.E], bucket = experts_bucket(exec, copies);
  for_each_expert(offsets, s.E, bucket, [&](std::int64_t e, std::int64_t lo, std::int64_t n) {
    // Read by two GEMMs: rounded once (bf16), or already.
    bf16* xs16 = copy_at(copies.xs, lo * C);
    const LinearInput x(exec, xs + lo * C, xs16, xs16 ? Copy::kFilled : Copy::kFill, n, C);
    linear_forward(acts.gate + lo * Fe, x, w.gate + e * Fe * C, Fe);
    linear_forward(acts.up + lo * Fe, x, w.up + e * Fe * C, Fe);
  });
  // Every row belongs to an expert, so one pass over all S rows is each expert's SwiGLU.
  swiglu_act_forward(exec, acts, copies.swiglu(), S * Fe);
  // y (rows, C) = h (rows, Fe) · wd[e]^T; fused, h is read from its copy.
  for_each_expert(offsets, s.E, bucket, [&](std::int64_t e, std::int64_t lo, std::int64_t n) {
    const LinearInput hx(exec, acts.h + lo * Fe, copy_at(copies.h, lo * Fe), Copy::kFilled, n, Fe);
    linear_forward(y + lo * C, hx, w.down + e * C * Fe, C);
  });
}

// Per row r of expert e with gate g (the forward's output row is g · h wd[e]^T):
//   U = dys · wd[e]                      (into dh)
//   dgates[slot] = U · h                 (double accumulation, rounded once)
//   dys *= g, dh *= g                    (the gradients of h wd[e]^T's output and of h)
//   dwd[e] += dys^T h;  swiglu backward → dgate, dup;
//   dxs = dgate wg[e] + dup wu[e];  dwg[e] += dgate^T xs;  dwu[e] += dup^T xs.
void moe_experts_backward_input(const Exec& exec, float* dxs, const ExpertGating& gating,
                                const ExpertActGrads& d, float* dys, const ExpertActs& acts,
                                const ExpertWeights& w, const std::int64_t* offsets,
                                const ExpertShape& s, const ExpertCopies& copies) {
  using Copy = LinearInput::Copy;
  const std::int64_t C = s.C, Fe = s.Fe, S = offsets[s.E], bucket = experts_bucket(exec, copies);
  for_each_expert(offsets, s.E, bucket, [&](std::int64_t e, std::int64_t lo, std::int64_t n) {
    linear_backward_input(exec, d.dh + lo * Fe, dys + lo * C, w.down + e * C * Fe, n, Fe, C);
  });
  // Fused, h exists only as its copy.
  gate_grads_and_scale(exec, gating, d.dh, dys, acts.h, copies.fused() ? copies.h : nullptr, S, C,
                       Fe);
  swiglu_act_backward(exec, d.dgate, d.dup, d.dh, acts, copies.swiglu(), S * Fe);
  // dxs = dgate wg[e] (written), then += dup wu[e]; fused, both are read from their copies.
  bf16* dgate16 = dgate_copy(d.dgate, copies.swiglu());
  bf16* dup16 = dgate_copy(d.dup, copies.swiglu());
  for_each_expert(offsets, s.E, bucket, [&](std::int64_t e, std::int64_t lo, std::int64_t n) {
    const LinearInput dg(exec, d.dgate + lo * Fe, copy_at(dgate16, lo * Fe), Copy::kFilled, n, Fe);
    const LinearInput du(exec, d.dup + lo * Fe, copy_at(dup16, lo * Fe), Copy::kFilled, n, Fe);
    linear_backward_input(dxs + lo * C, dg, w.gate + e * Fe * C, C);
    linear_backward_input(dxs + lo * C, du, w.up + e * Fe * C, C, Out::kAccumulate);
  });
}

void moe_experts_backward_weight(const Exec& exec, const ExpertGrads& g, const float* dys,
                                 const ExpertActGrads& d, const float* xs, const float* h,
                                 const std::int64_t* offsets, const ExpertShape& s,
                                 const ExpertCopies& copies) {
  experts_bucket(exec, copies);  // the copies' check: the weight gradients take exact rows
  const std::int64_t C = s.C, Fe = s.Fe;
  bf16* dgate16 = dgate_copy(d.dgate, copies.swiglu());
  bf16* dup16 = dgate_copy(d.dup, copies.swiglu());
  // Expert e's weight-gradient parts, rows [part(e, p), part(e, p + 1)): the (expert, part)
  // blocks in order, each its exact rows (bucket 1); block i is expert i / parts's.
  const std::int64_t parts = s.part_offsets ? s.parts : 1;
  const std::int64_t* blocks = s.part_offsets ? s.part_offsets : offsets;
  using Copy = LinearInput::Copy;
  for_each_expert(blocks, s.E * parts, 1, [&](std::int64_t b, std::int64_t r0, std::int64_t rows) {
    // dwd[e] (C, Fe) += dys^T (C, rows) · h (rows, Fe)
    const LinearInput dy(exec, dys + r0 * C, rows, C);
    const LinearInput hx(exec, h + r0 * Fe, copy_at(copies.h, r0 * Fe), Copy::kFilled, rows, Fe);
    linear_backward_weight(g.down + b / parts * C * Fe, dy, hx);
  });
  for_each_expert(blocks, s.E * parts, 1, [&](std::int64_t b, std::int64_t q0, std::int64_t n) {
    const std::int64_t e = b / parts;
    // Read by two GEMMs: rounded once (bf16), or already.
    bf16* xs16 = copy_at(copies.xs, q0 * C);
    const LinearInput x(exec, xs + q0 * C, xs16, xs16 ? Copy::kFilled : Copy::kFill, n, C);
    // dwg[e], dwu[e] (Fe, C) += dgate^T, dup^T (Fe, n) · x (n, C)
    const LinearInput dg(exec, d.dgate + q0 * Fe, copy_at(dgate16, q0 * Fe), Copy::kFilled, n, Fe);
    const LinearInput du(exec, d.dup + q0 * Fe, copy_at(dup16, q0 * Fe), Copy::kFilled, n, Fe);
    linear_backward_weight(g.gate + e * Fe * C, dg, x);
    linear_backward_weight(g.up + e * Fe * C, du, x);
  });
}

void moe_experts_backward(const Exec& exec, float* dxs, const ExpertGating& gating,
                          const ExpertGrads& g, const ExpertActGrads& d, float* dys,
                          const float* xs, const ExpertActs& acts, const ExpertWeights& w,
                          const std::int64_t* offsets, const ExpertShape& s,
                          const ExpertCopies& copies) {
  moe_experts_backward_input(exec, dxs, gating, d, dys, acts, w, offsets, s, copies);
  moe_experts_backward_weight(exec, g, dys, d, xs, acts.h, offsets, s, copies);
}

void moe_ep_offsets(std::int64_t* offsets, std::int64_t* block_offsets, const std::int32_t* counts,
                    std::int64_t P, std::int64_t El) {
  offsets[0] = block_offsets[0] = 0;
  for (std::int64_t j = 0; j < El; ++j) {
    offsets[j + 1] = offsets[j];
    for (std::int64_t s = 0; s < P; ++s) {
      offsets[j + 1] += counts[s * El + j];
      block_offsets[j * P + s + 1] = offsets[j + 1];
    }
  }
}

// Block copies of rows: kernels::copy on either backend (a device-to-device copy on a GPU); the
// counts and block offsets are host memory.
void moe_ep_reorder(const Exec& exec, float* dst, const float* src, const std::int32_t* counts,
                    const std::int64_t* block_offsets, std::int64_t P, std::int64_t El,
                    std::int64_t width, bool to_expert_major) {
  std::int64_t source_at = 0;  // rows before block (s, j) in source-major order
  for (std::int64_t s = 0; s < P; ++s)
    for (std::int64_t j = 0; j < El; ++j) {
      const std::int64_t expert_at = block_offsets[j * P + s], rows = counts[s * El + j];
      const std::int64_t from = (to_expert_major ? source_at : expert_at) * width;
      const std::int64_t to = (to_expert_major ? expert_at : source_at) * width;
      if (rows > 0) copy(exec, dst + to, src + from, rows * width);
      source_at += rows;
    }
}

void moe_count(double* counts, const std::int32_t* chosen, std::int64_t N, std::int64_t E,
               std::int64_t K) {
  for_each_slot(chosen, N * K, E, [&](std::int64_t, std::int32_t e) { counts[e] += 1.0; });
}

// Per sequence, with n_e the slots routed to e, f_e = n_e / (T K) and p the scores normalised
// over E (p = s / Σ s for sigmoid, with Σ that row's sum):
//   loss_b = E Σ_e f_e P_e = (E / T) Σ_t Σ_e f_e p[t, e];
//   d(weight loss_b)/ds[t, e] = weight (E / T) f_e                        (softmax: p = s)
//                             = weight (E / T) (f_e − Σ_e' f_e' p[t, e']) / Σ   (sigmoid).
// A token's part is detail::moe_aux_token (kernels/moe_math.h); the sums run over t, then b, in
// order. On a GPU the same order (cuda::moe_aux_loss), whose result crosses to the host.
namespace {

// moe_aux_loss, its value returned to the host (a wait on a GPU) or not.
double aux_loss(const Exec& exec, float* dscores, const float* scores, const std::int32_t* chosen,
                std::int64_t B, std::int64_t T, const RouterShape& r, float weight,
                bool value_to_host) {
  // f of one sequence on the stack (the CPU) or in shared memory (the GPU): the op allocates
  // nothing, so E has a ceiling (recipe validation holds every model to it).
  T3D_USER_CHECK(r.E <= kMaxExperts, "the MoE auxiliary loss supports up to ", kMaxExperts,
                 " experts, not ", r.E);
  T3D_ASSERT(B * T == r.N, "aux loss over ", B, " x ", T, " tokens, router of ", r.N);
  check_router(r);
  if (value_to_host) count_host_wait();
  T3D_ON_GPU(exec, cuda::moe_aux_loss(*exec.stream, dscores, scores, chosen, B, T, r, weight,
                                      value_to_host));
  const std::int64_t E = r.E, K = r.K;
  double f[kMaxExperts];
  const bool sigmoid = r.score == RouterScore::kSigmoid;
  double total = 0.0;
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t e = 0; e < E; ++e) f[e] = 0.0;
    for_each_slot(chosen + b * T * K, T * K, E, [&](std::int64_t, std::int32_t e) { f[e] += 1.0; });
    for (std::int64_t e = 0; e < E; ++e) f[e] /= static_cast<double>(T * K);
    const double coef = static_cast<double>(E) / static_cast<double>(T);
    const double w = weight * coef;
    double loss = 0.0;
    for (std::int64_t t = 0; t < T; ++t) {
      const std::int64_t row = (b * T + t) * E;
      loss +=
          detail::moe_aux_token(dscores ? dscores + row : nullptr, scores + row, f, E, sigmoid, w);
    }
    total += coef * loss;
  }
  return total;
}

}  // namespace

double moe_aux_loss(const Exec& exec, float* dscores, const float* scores,
                    const std::int32_t* chosen, std::int64_t B, std::int64_t T,
                    const RouterShape& r, float weight) {
  return aux_loss(exec, dscores, scores, chosen, B, T, r, weight, true);
}

void moe_aux_loss_backward(const Exec& exec, float* dscores, const float* scores,
                           const std::int32_t* chosen, std::int64_t B, std::int64_t T,
                           const RouterShape& r, float weight) {
  T3D_ASSERT(dscores, "moe_aux_loss_backward without dscores");
  aux_loss(exec, dscores, scores, chosen, B, T, r, weight, false);
}

void moe_bias_delta(float* delta, const double* counts, std::int64_t E, float rate) {
  double mean = 0.0;
  for (std::int64_t e = 0; e < E; ++e) mean += counts[e];
  mean /= static_cast<double>(E);
  for (std::int64_t e = 0; e < E; ++e) {
    const double diff = mean - counts[e];
    delta[e] = diff > 0 ? rate : diff < 0 ? -rate : 0.0f;
  }
}

}  // namespace t3d::kernels
