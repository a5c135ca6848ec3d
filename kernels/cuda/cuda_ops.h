// The CUDA backend of the kernel layer: the ops of kernels/ops.h and kernels/ops_moe.h on an
// NVIDIA GPU, on device pointers, each enqueued on a Stream. This header names no CUDA type, so
// host code that does not include the CUDA runtime can call it.
//
// Contracts are those of kernels/ops.h (shapes, accumulate vs write, ignore index, the vocab
// slice), and each op is tested against its CPU twin on a GPU (tests/kernels/test_cuda_ops.cpp,
// test_cuda_moe.cpp):
//   - bit for bit where both backends evaluate the same element arithmetic (kernels/row_math.h,
//     kernels/moe_math.h) in the same order: embedding, RMSNorm, RoPE, AdamW, the bf16 casts, the
//     MoE row moves, combine, router backward, gate gradients and auxiliary loss, and SwiGLU
//     against the CPU's SSE2 path (its AVX paths contract to FMAs);
//     (a NaN result is the GPU's canonical NaN, not an operand's payload);
//   - within fp32 rounding where the order of a sum differs: the GEMMs (cuBLAS), attention, the
//     cross-entropy and the router's scores (libm's exp against CUDA's expf), the sum of squares.
// Deterministic: no floating-point atomics; every reduction of these kernels has a fixed order
// that depends on the shapes only (not the GPU's SM count); cuBLAS runs on one stream with a fixed
// workspace, TF32 off and one recorded algorithm a shape, so two runs give the same bits (on one
// GPU model and library version: cuBLAS's own orders may differ across them, docs/gpu.md).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "kernels/cuda/gemm_table.h"
#include "kernels/device.h"
#include "kernels/ops.h"
#include "kernels/ops_moe.h"

namespace t3d::kernels::cuda {

// ---- devices ------------------------------------------------------------------------------------

struct DeviceInfo {
  int index = 0;
  std::string name;  // "NVIDIA H100 80GB HBM3"
  std::size_t total_bytes = 0;
  std::size_t free_bytes = 0;      // 0: not asked (visible_devices leaves it; free_bytes_on asks)
  int cc_major = 0, cc_minor = 0;  // compute capability
  int sm_count = 0;
  int driver_version = 0, runtime_version = 0;  // 13000 = CUDA 13.0
};

// The GPUs this process sees. Empty when there are none; `why` then says why (no driver, no
// device, CUDA_VISIBLE_DEVICES empty, a driver older than the runtime). Read from the devices'
// properties without making a context on any of them: with ranks seeing every GPU of a node, a
// context per rank on each GPU would take HBM from every rank (and fail under the
// EXCLUSIVE_PROCESS compute mode).
std::vector<DeviceInfo> visible_devices(std::string* why = nullptr);
// Free memory of GPU `index`, which becomes this host thread's current device (its context made):
// asked only of the GPU a rank uses.
std::size_t free_bytes_on(int index);
// "NVIDIA H100 80GB HBM3, 79.1 GiB (78.5 free), sm_90, 132 SMs, driver CUDA 13.0, runtime 13.0"
std::string describe(const DeviceInfo& d);
// The GPU of a rank: its node-local rank modulo the GPUs it sees, so ranks may share a GPU.
int device_for_local_rank(int local_rank, int visible_count);

// ---- streams and memory -------------------------------------------------------------------------

// The precision an Exec's GEMM kind asks for (kernels/exec.h).
inline GemmPrecision gemm_precision(const Exec& exec) {
  return gemm_kind_is_bf16(exec.gemm) ? GemmPrecision::kBf16 : GemmPrecision::kFp32;
}

// One CUDA stream on one device, with its cuBLAS handle and a fixed cuBLAS workspace (fixed
// algorithms and workspace are what make cuBLAS repeat its bits). Every op below is enqueued on
// the stream it is given and returns without waiting.
class Stream {
 public:
  explicit Stream(int device);
  ~Stream();
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  int device() const;
  void synchronize() const;  // waits for everything enqueued; throws the first CUDA error
  struct Impl;
  Impl& impl() const { return *impl_; }

 private:
  std::unique_ptr<Impl> impl_;
};

// An owned cudaMalloc'd block (never managed memory). Throws UserError naming `what`, the bytes
// asked and the bytes free when the device is out of memory.
class DeviceMemory {
 public:
  DeviceMemory() = default;
  DeviceMemory(std::size_t bytes, std::string_view what);
  ~DeviceMemory();
  DeviceMemory(DeviceMemory&& other) noexcept;
  DeviceMemory& operator=(DeviceMemory&& other) noexcept;
  void* data() const { return data_; }
  template <class T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  std::size_t bytes() const { return bytes_; }

 private:
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
};

// The device block behind an Arena of Memory::kDevice (kernels/arena.h): `bytes` on the current
// GPU, zeroed; UserError as DeviceMemory's. device_free gives it back.
void* device_alloc_zeroed(std::size_t bytes, std::string_view what);
void device_free(void* p) noexcept;
// Device memory in the order of stream `s` (kernels::Buffer on a GPU): made and zeroed there
// (cudaMallocAsync), for the work enqueued on `s` after it and for work of other streams ordered
// after that (every operation of the device communicator, and snapshot copies, start behind the
// stream's work so far); stream_free frees it behind the work enqueued on `s` before, where no
// other stream reads it any more. Neither synchronises the device, as cudaMalloc and cudaFree
// do: a buffer made mid-step must not wait on NCCL operations in flight, which wait on peers
// that may be waiting for this rank.
void* stream_alloc_zeroed(const Stream& s, std::size_t bytes, std::string_view what);
void stream_free(const Stream& s, void* p) noexcept;

// The named crossings between host and device memory, ordered on the stream. Host memory that is
// not pinned makes them synchronous (CUDA stages it).
void copy_to_device(const Stream& s, void* device_dst, const void* host_src, std::size_t bytes);
// kernels::copy_from_host of at most kUnwaitedUploadBytes: the bytes copied into a slot of the
// stream's pinned staging ring (waiting only for that slot's previous copy, kUploadSlots copies
// back: by then long run, a step making a few), the copy enqueued from there; the host buffer
// may be reused on return.
inline constexpr int kUploadSlots = 8;
void copy_to_device_staged(const Stream& s, void* device_dst, const void* host_src,
                           std::size_t bytes);
void copy_to_host(const Stream& s, void* host_dst, const void* device_src, std::size_t bytes);
// kernels::copy_to_host_started, wait_for_copies and compute_after_copies (ops.h): on the
// stream's copy stream, behind an event of the compute enqueued so far.
// A bf16 buffer of the stream's pool, of at least `elems` (grown, after the stream is done with
// it, where smaller), held until given back by its slot: LinearInput's rounded copy on a GPU
// (kernels/ops.h). A buffer given back may be taken again at once: its next user's ops are
// enqueued after its last user's on the one stream.
struct RoundedBuffer {
  bf16* data;
  int slot;
};
RoundedBuffer take_rounded_buffer(const Stream& s, std::size_t elems);
void give_rounded_buffer(const Stream& s, int slot) noexcept;
void copy_to_host_behind(const Stream& s, void* host_dst, const void* device_src,
                         std::size_t bytes);
void wait_for_copies_behind(const Stream& s);
void compute_after_copies_behind(const Stream& s);
// Page-locks host memory for every GPU's copies (cudaHostRegister, portable) / gives it back.
void host_register(void* p, std::size_t bytes);
void host_unregister(void* p) noexcept;

// ---- one GPU's rates (measure.cu): selfcheck's figures
// --------------------------------------------

// Device::measure_rates (kernels/device.h) on `s`'s GPU: the best of `rounds` timed runs on `s`
// (each round waited for): four linear_forwards in each precision (bf16: its input rounding
// included, as training runs it), then a copy each way. Allocates its buffers on the stream's GPU
// and gives them back.
Device::Rates measure_rates(const Stream& s, std::int64_t M, std::int64_t N, std::int64_t K,
                            std::size_t bytes, int rounds);

// ---- element-wise and reductions (ops_elementwise.cu) -------------------------------------------

void zero(const Stream& s, float* x, std::int64_t n);
void copy(const Stream& s, float* dst, const float* src, std::int64_t n);  // device to device
// kernels::count_nonfinite, waited for and read back (a step scalar).
std::int64_t count_nonfinite_to_host(const Stream& s, const float* x, std::int64_t n);
// kernels::sum_in_order_into (*out in device memory): one thread's loop (over chunks its block
// stages in shared memory), so it is the CPU's bits.
void sum_in_order(const Stream& s, double* out, const float* x, std::int64_t n);
// kernels::hash_floats's piece hashes: host_out[p] = XXH3 of floats [p·piece, (p + 1)·piece) of
// the n at x (kernels/xxh3_words.h), computed in device memory; waited for.
void hash_pieces_to_host(const Stream& s, std::uint64_t* host_out, const float* x, std::int64_t n,
                         std::int64_t piece);
void add(const Stream& s, float* out, const float* x, const float* y, std::int64_t n);
void add_inplace(const Stream& s, float* x, const float* y, std::int64_t n);
// *out (one double in device memory) = sum of x^2 in double, in a fixed order: kSumBlocks
// blocks each sum a strided share, then one block sums their results pairwise.
inline constexpr int kSumBlocks = 512;
void sum_of_squares(const Stream& s, double* out, const float* x, std::int64_t n);
// The same, waited for and copied to the host (a step scalar: kernels::sum_of_squares on a GPU).
double sum_of_squares_to_host(const Stream& s, const float* x, std::int64_t n);
// host_out[j] = sum_of_squares of x[j] (n[j] floats) for j < count (its bits), two launches per 64
// ranges into device memory, then one copy of all and one wait (kernels::sum_of_squares_each).
void sum_of_squares_each_to_host(const Stream& s, double* host_out, const float* const* x,
                                 const std::int64_t* n, std::int64_t count);
// kernels::adamw_step_many: the ranges in launches of up to 24 (multi_tensor.h), a block per
// chunk of 4096 elements, each element adamw_step's arithmetic (its bits).
void adamw_step_many(const Stream& s, const AdamWTensor* tensors, std::int64_t count,
                     std::int64_t step);
void adamw_step(const Stream& s, float* params, const float* grads, float* m, float* v,
                std::int64_t n, const AdamWConfig& cfg, std::int64_t step);
void float_to_bf16(const Stream& s, bf16* out, const float* in, std::int64_t n);
void bf16_to_float(const Stream& s, float* out, const bf16* in, std::int64_t n);
// kernels::float_to_bf16_many: the ranges in launches of up to 96 (multi_tensor.h), a block per
// chunk of 4096 elements, each element float_to_bf16's rounding (its bits).
void float_to_bf16_many(const Stream& s, const Bf16Cast* casts, std::int64_t count);

// ---- embedding, RMSNorm, RoPE, SwiGLU (ops_rows.cu) ---------------------------------------------

void embedding_forward(const Stream& s, float* out, const std::int32_t* tokens, const float* wte,
                       std::int64_t N, std::int64_t C, std::int64_t vocab_start,
                       std::int64_t vocab_end);
// dwte += in token order, one thread per column: the CPU's order, so the same bits.
void embedding_backward(const Stream& s, float* dwte, const float* dout, const std::int32_t* tokens,
                        std::int64_t N, std::int64_t C, std::int64_t vocab_start,
                        std::int64_t vocab_end);
void rmsnorm_forward(const Stream& s, float* out, float* rstd, const float* inp,
                     const float* weight, std::int64_t N, std::int64_t C, float eps,
                     bf16* out16 = nullptr);
void rmsnorm_backward(const Stream& s, float* dinp, float* dweight, const float* dout,
                      const float* inp, const float* weight, const float* rstd, std::int64_t N,
                      std::int64_t C, Out mode = Out::kWrite);
// table: the CPU's rope_table (kernels/ops.h), copied to the device once per run.
void rope_forward(const Stream& s, float* out, const float* inp, const float* table, std::int64_t B,
                  std::int64_t T, std::int64_t n_heads, std::int64_t D, std::int64_t pos_offset);
void rope_backward(const Stream& s, float* dinp, const float* dout, const float* table,
                   std::int64_t B, std::int64_t T, std::int64_t n_heads, std::int64_t D,
                   std::int64_t pos_offset);
void swiglu_forward(const Stream& s, float* h, const float* gate, const float* up, std::int64_t n);
void swiglu_backward(const Stream& s, float* dgate, float* dup, const float* dh, const float* gate,
                     const float* up, std::int64_t n);
void swiglu_forward_bf16(const Stream& s, bf16* h16, bf16* gate16, bf16* up16, const float* gate,
                         const float* up, std::int64_t n);
void swiglu_backward_bf16(const Stream& s, bf16* dgate16, bf16* dup16, const float* dh,
                          const bf16* gate16, const bf16* up16, std::int64_t n);

// ---- the shared experts' sigmoid gate (ops_gate.cu) -------------------------------------------

// As kernels/ops_gate.h, element by element through kernels/row_math.h in the CPU's order: the
// CPU's bits.
void shared_gate_forward(const Stream& s, float* out, float* g, const float* x, const float* w,
                         const float* shared, std::int64_t N, std::int64_t C);
void shared_gate_backward_dot(const Stream& s, float* dg, const float* dy, const float* shared,
                              std::int64_t N, std::int64_t C);
void shared_gate_backward(const Stream& s, float* dshared, float* dz, const float* dg,
                          const float* g, const float* dy, std::int64_t N, std::int64_t C);
void shared_gate_backward_input(const Stream& s, float* dx, const float* dz, const float* w,
                                std::int64_t N, std::int64_t C);
void shared_gate_backward_weight(const Stream& s, float* dw, const float* dz, const float* x,
                                 std::int64_t rows, std::int64_t C);

// ---- linear layers (ops_linear.cu): cuBLASLt ----------------------------------------------------

// The three GEMMs of kernels/ops.h's linear ops, W stored [out, in] row-major, each through
// cuBLASLt with the algorithm the stream's table gives its shape (kernels/cuda/gemm_table.h). With
// kBf16 the inputs are rounded to bf16 (nearest even, as the CPU rounds) into the stream's
// workspace first; an activation operand given with its rounded copy (`x16`, `dy16`: packed rows, a
// bf16-stored activation or LinearInput's copy) is read from that copy instead and its floats are
// not read; so is a weight given with its copy (`w16`: kernels/exec.h's WeightCopy). With
// `residual` (mode kWrite), y = residual + x w^T in one call (the epilogue's C, beta 1).
void linear_forward(const Stream& s, GemmPrecision p, float* y, const float* x, const float* w,
                    std::int64_t N, std::int64_t in, std::int64_t out, Out mode = Out::kWrite,
                    const bf16* x16 = nullptr, const bf16* w16 = nullptr,
                    const float* residual = nullptr);
void linear_backward_input(const Stream& s, GemmPrecision p, float* dx, const float* dy,
                           const float* w, std::int64_t N, std::int64_t in, std::int64_t out,
                           Out mode = Out::kWrite, const bf16* dy16 = nullptr,
                           const bf16* w16 = nullptr);
void linear_backward_weight(const Stream& s, GemmPrecision p, float* dw, const float* dy,
                            const float* x, std::int64_t N, std::int64_t in, std::int64_t out,
                            const bf16* dy16 = nullptr, const bf16* x16 = nullptr);

// The GEMMs a linear layer of N rows, in → out runs in precision p (forward, input gradient,
// weight gradient, and the forward with a residual: linear_forward_residual), as the ops above
// call them on operands aligned to `align` bytes: the shapes to tune for a model
// (runtime/machine/gemm_choice.h lists a model's layers).
std::array<GemmShape, 4> linear_gemm_shapes(GemmPrecision p, std::int64_t N, std::int64_t in,
                                            std::int64_t out, std::uint32_t align = kGemmAlignCap);
// "cuBLASLt 130100 on NVIDIA H200 (sm_90)": the library and GPU a table of this stream holds for.
std::string gemm_library(const Stream& s);
// The stream's table: the algorithms it was given or measured (a shape outside it runs cuBLASLt's
// first heuristic answer, which the table does not keep).
GemmTable gemm_table(const Stream& s);
// The shapes the stream holds cuBLASLt plans for: those its GEMMs ran (at most the last 2048).
std::vector<GemmShape> gemm_shapes_planned(const Stream& s);
// Installs `table` in place of the stream's. Refused (the stream's left as it is) when it was made
// for another library or GPU: returns why, else an empty string.
std::string use_gemm_table(const Stream& s, const GemmTable& table);
// For each shape: up to `candidates` of cuBLASLt's heuristic answers, each timed `rounds` times
// (scratch operands of the shape's extents, allocated here), the first answer replaced only by one
// that beats_clearly; installs the winners in the stream's table (source "measured") and returns
// it. Shapes already in the table are measured again.
GemmTable tune_gemms(const Stream& s, const std::vector<GemmShape>& shapes, int candidates = 8,
                     int rounds = 5);

// ---- cross-entropy (ops_loss.cu)
// -------------------------------------------------------------------

// As kernels/ops.h; the targets are checked on the host before the call (check_token_ids).
void cross_entropy_fused(const Stream& s, float* logits, float* losses, const std::int32_t* targets,
                         std::int64_t N, std::int64_t V, float grad_scale);
void ce_local_max(const Stream& s, float* row_max, const float* logits, std::int64_t N,
                  std::int64_t V);
void ce_local_sum_exp(const Stream& s, float* sum_exp, const float* logits, const float* row_max,
                      std::int64_t N, std::int64_t V);
void ce_local_target_logit(const Stream& s, float* target_logit, const float* logits,
                           const std::int32_t* targets, std::int64_t N, std::int64_t V,
                           std::int64_t vocab_start);
void ce_loss_and_grad(const Stream& s, float* logits, float* losses, const std::int32_t* targets,
                      const float* row_max, const float* sum_exp, const float* target_logit,
                      std::int64_t N, std::int64_t V, std::int64_t vocab_start, float grad_scale);

// ---- causal grouped-query attention (ops_attention.cu, ops_attention_bf16.cu)
// --------------------

// As kernels/ops.h (fp32, context-parallel positions included), with no T x T matrix in memory
// and no scratch: the forward streams over keys with an online softmax, the backward recomputes
// the probabilities from lse, computing dq per query row and dk, dv per key row (no atomics).
// Needs head_dim <= kMaxHeadDim. `tile` rows of queries and of keys a block (0: the GPU's, by
// attention_fp32_tile); the tile sets the online softmax's order, so one GPU model repeats its
// bits and another may differ in the last ones.
inline constexpr std::int64_t kMaxHeadDim = 256;
void attention_forward(const Stream& s, float* out, float* lse, const float* q, const float* k,
                       const float* v, const AttentionShape& shape, int tile = 0);
void attention_backward(const Stream& s, float* dq, float* dk, float* dv, const float* dout,
                        const float* q, const float* k, const float* v, const float* out,
                        const float* lse, const AttentionShape& shape, int tile = 0);
// The fp32 tiles' rows for a head dim on a GPU whose blocks may hold `smem_per_block` bytes of
// shared memory: 64 up to head dim 128 and 32 up to 256 where the backward's tiles fit (162 KiB
// and 137 KiB: A100, H100, H200), else 32 and 16 (73 KiB and 67 KiB: the 99 KiB of sm_86 and
// sm_89 GPUs). Host code; the attention kernels take 64 or 32 up to head dim 128, 32 or 16 above.
int attention_fp32_tile(std::int64_t head_dim, std::size_t smem_per_block);

// The same with bf16 tensor-core tiles (ops_attention_bf16*.cu), what the linear layers' bf16
// GEMM kinds take: q, k, v, dout, P and dS rounded to bf16 as they enter a tile product, fp32
// sums, softmax and outputs (the CPU's bf16 tiles' contract, kernels/attention_bf16.h; within
// bf16 rounding of them, not their bits). Head dims up to 128 (attention_bf16_tiles); a larger
// one runs the fp32 tiles above. Two runs give the same bits.
bool attention_bf16_tiles(const AttentionShape& shape);
void attention_forward_bf16(const Stream& s, float* out, float* lse, const float* q, const float* k,
                            const float* v, const AttentionShape& shape);
void attention_backward_bf16(const Stream& s, float* dq, float* dk, float* dv, const float* dout,
                             const float* q, const float* k, const float* v, const float* out,
                             const float* lse, const AttentionShape& shape);

// Decoding (kernels/ops_decode.h): one query row per head at position n - 1 against n cached
// keys and values: the forward above with B = 1, T = 1, q_pos = n - 1, kv_len = n. lse (H) is
// scratch.
void attention_decode(const Stream& s, float* out, const float* q, const float* k_cache,
                      const float* v_cache, float* lse, std::int64_t n, std::int64_t n_heads,
                      std::int64_t n_kv_heads, std::int64_t head_dim);

// ---- mixture of experts (ops_moe.cu)
// -------------------------------------------------------------

// As kernels/ops_moe.h, on device pointers. The router: one thread per token through
// kernels/moe_math.h's rows (the scores within 2 ulp of the CPU's: CUDA's expf; the rest the
// CPU's arithmetic on them; the backward the CPU's bits).
void moe_route_forward(const Stream& s, float* scores, std::int32_t* chosen, float* gates,
                       const float* logits, const float* bias, const RouterShape& r);
void moe_route_backward(const Stream& s, float* dlogits, const float* dgates,
                        const float* dscores_extra, const float* scores, const std::int32_t* chosen,
                        const RouterShape& r);
// Row moves and the combine (each output element's sum over j in the CPU's order): same bits.
void moe_gather(const Stream& s, float* rows, const float* x, const std::int32_t* slot_of_row,
                std::int64_t S, std::int64_t K, std::int64_t C);
void moe_gather(const Stream& s, bf16* rows, const bf16* x, const std::int32_t* slot_of_row,
                std::int64_t S, std::int64_t K, std::int64_t C);
void moe_combine(const Stream& s, float* y, const float* rows, const float* w,
                 const std::int32_t* row_of_slot, std::int64_t N, std::int64_t K, std::int64_t C,
                 Out mode);
void moe_gather_slots(const Stream& s, float* by_row, const float* by_slot,
                      const std::int32_t* slot_of_row, std::int64_t rows);
void moe_scatter_slots(const Stream& s, float* by_slot, const float* by_row,
                       const std::int32_t* slot_of_row, std::int64_t rows);
// The experts' backward between its GEMMs (kernels/ops_moe.cpp gate_grads_and_scale): per row r
// of the S, gating.dgates[slot_of_row[r]] = Σ_f dh[r, f] · h[r, f] (one thread's double sum over
// f in order: the CPU's bits), then dh's and dys's rows scaled by the row's gate. h is read from
// h16 (bf16) when it is given, else from h.
void moe_gate_grads(const Stream& s, const ExpertGating& gating, float* dh, float* dys,
                    const float* h, const bf16* h16, std::int64_t S, std::int64_t C,
                    std::int64_t Fe);
// kernels::moe_aux_loss: the per-sequence fractions (integer counts), each token's term and
// gradient (moe_math.h), and the sums over t then b in the CPU's order: the CPU's bits. With
// `value_to_host` waits for the stream and returns the loss on the host (the op's crossing);
// without, enqueues the gradient only and returns 0.
double moe_aux_loss(const Stream& s, float* dscores, const float* scores,
                    const std::int32_t* chosen, std::int64_t B, std::int64_t T,
                    const RouterShape& r, float weight, bool value_to_host);

}  // namespace t3d::kernels::cuda
