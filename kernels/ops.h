// Forward and backward operators of a LLaMA-style transformer, fp32, row-major. The ops that take
// an Exec (kernels/exec.h) run on its backend, on pointers of its memory: the CPU (this folder) or
// an NVIDIA GPU (kernels/cuda/, where every op here has a twin; docs/gpu.md); the others are the
// CPU's until the runtime hands them an Exec too.
//
// Accumulation contract (the same for every op below):
//   - parameter gradients are ACCUMULATED:   dweight += ...  (micro-batches add up; the caller
//     zeroes the gradient region once per step),
//   - activation gradients are WRITTEN:      dinp = ...      (no stale values can leak in),
//   - the residual stream is ACCUMULATED:    x += f(x)       (add_inplace, or linear_forward
//     with Out::kAccumulate for the projection that feeds it).
// Backward of a residual add is the identity: the caller adds a branch's dinp into the residual
// gradient with add_inplace.
//
// Shapes are in comments on every pointer: B batch, T sequence, C model dim, V vocab (or this
// rank's vocab slice), F feed-forward dim, N = B*T rows, H query heads, Hkv key/value heads,
// D head dim. Pointers never alias unless a comment says so.
//
// Threading: a rank with one thread runs every op serially. A rank with several
// (threads_per_rank > 1) runs its GEMMs (kernels/gemm.h), attention (over batch x heads, kv heads
// for the backward) and the large element-wise ops (RMSNorm, RoPE, SwiGLU, AdamW, residual adds)
// on one OpenMP pool of that many threads; each iteration writes its own outputs, so results of
// the non-GEMM ops are bit-identical to one thread (kernels/threads.h). The row loops of
// attention, SwiGLU, RMSNorm and AdamW are compiled for SSE2, AVX2 and AVX-512 and picked at run
// time (kernels/simd_rows.h; T3D_SIMD=sse2|avx2|avx512 forces one).
//
// No op allocates: scratch memory comes from the caller (the arena).
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/exec.h"
#include "kernels/gemm.h"
#include "kernels/hash.h"
#include "kernels/precision.h"

namespace t3d::kernels {

// ---- element-wise helpers (ops_optim.cpp) -------------------------------------------------------

enum class Out { kWrite, kAccumulate };  // y = ... or y += ... (residual stream)

void zero(const Exec& exec, float* x, std::int64_t n);  // x (n) = 0
void add_inplace(const Exec& exec, float* x, const float* y,
                 std::int64_t n);  // x (n) += y (n): residual
void add(const Exec& exec, float* out, const float* x, const float* y,
         std::int64_t n);                                                   // out (n) = x + y
void copy(const Exec& exec, float* dst, const float* src, std::int64_t n);  // dst (n) = src (n)
// bf16 copies of arena data, rounded and widened as precision.h's float_to_bf16 / bf16_to_float
// (the same bits on every backend): out (n) = bf16(in (n)), out (n) = float(in (n)).
void float_to_bf16(const Exec& exec, bf16* out, const float* in, std::int64_t n);
void bf16_to_float(const Exec& exec, float* out, const bf16* in, std::int64_t n);
// One range of a cast over many (the weights' bf16 copy: a range a tensor).
struct Bf16Cast {
  bf16* out;
  const float* in;
  std::int64_t n;
};
// float_to_bf16 on each of `count` ranges: the bits of one call each (every element is rounded
// alone), on a GPU in a few launches for all instead of one a range.
void float_to_bf16_many(const Exec& exec, const Bf16Cast* casts, std::int64_t count);
// The named crossings between host memory and the Exec's memory, the only ones the runtime
// makes (data in, initial values, restore, snapshot staging, the step's scalars, MoE routing
// counts, the replay's hashes): a memcpy on the CPU, a copy ordered on the stream on a GPU. Both
// return when the host buffer may be reused (copy_from_host) or holds the bytes (copy_to_host).
// copy_from_host of at most kUnwaitedUploadBytes (a micro-batch's tokens, routing maps) makes
// the host wait for nothing: on a GPU the bytes go through the stream's pinned staging ring and
// the copy is enqueued from there; a larger one waits for the stream (initial values, restore).
inline constexpr std::size_t kUnwaitedUploadBytes = std::size_t{1} << 20;
void copy_from_host(const Exec& exec, void* dst, const void* host_src, std::size_t bytes);
void copy_to_host(const Exec& exec, void* host_dst, const void* src, std::size_t bytes);
// copy_to_host for many pieces, in the background of the compute: on a GPU each is started on
// the Exec's copy stream behind every op enqueued before it, so that ops enqueued after it run
// while it copies (a memcpy on the CPU, done on return). wait_for_copies(exec) waits (the host,
// from any thread) until every copy started so far is done, before which the host buffers must
// not be read; compute_after_copies(exec) makes the ops enqueued after it wait for them without
// waiting on the host: what an op that overwrites a copied source must be preceded by. With the
// device memory guarded (kernels/memory_guard.h) the CPU makes each copy at the starting
// thread's first of those after it (another thread's wait_for_copies waits for that), its host
// bytes NaN until then, as late as a GPU's copy stream may. Into
// pinned host memory (PinnedHostRegion) the GPU's copies run at the link's rate.
void copy_to_host_started(const Exec& exec, void* host_dst, const void* src, std::size_t bytes);
void wait_for_copies(const Exec& exec);
void compute_after_copies(const Exec& exec);
// How many calls this host thread has made that make it wait for the Exec's queued ops (on a
// GPU each drains the stream, and the device idles until the host enqueues again):
// copy_from_host of more than kUnwaitedUploadBytes, copy_to_host, wait_for_copies, and the ops
// that return a value of the Exec's memory to the host (hash_floats, count_nonfinite,
// sum_of_squares and _each, moe_aux_loss). Counted on every backend alike (the
// same call sites), so that CPU tests pin where a GPU's step waits; per thread, so that a
// snapshot's I/O thread waiting for its copies is not counted in the training thread's step.
std::int64_t host_waits();
void count_host_wait();  // what those ops call, once a call (kernels/ only)
// Streams into `h` (kernels/hash.h) the hash64_xxh3 of each 1 MiB piece of n floats of the
// Exec's memory, in order: the same value on either backend and any thread count. On the CPU the
// pieces are hashed in place over the rank's threads, on a GPU in device memory (eight threads
// a piece, one per XXH3 accumulator: kernels/xxh3_words.h), only their hashes crossing. The
// replay's hashes of gradients and parameters.
void hash_floats(const Exec& exec, Hash64Stream& h, const float* x, std::int64_t n);
// Toggles bit `bit` (0-31) of element x[i] (silent data corruption for the tests of replay,
// parallel/fault.h's flip): through the two crossings above, so one float travels each way and
// every backend runs it alike.
void flip_bit(const Exec& exec, float* x, std::int64_t i, int bit);
// Elements of x (n) that are NaN or infinite.
std::int64_t count_nonfinite(const Exec& exec, const float* x, std::int64_t n);
// *out = x[0] + x[1] + ... + x[n-1] in that order, in double, into a double of the Exec's memory
// without a wait (a micro-batch's per-row losses, kept there until the step reads its
// micro-batches' losses at once).
void sum_in_order_into(const Exec& exec, double* out, const float* x, std::int64_t n);
// sum of x^2 over a range, accumulated in double. Global-norm clipping: each rank sums its
// ranges, the caller all-reduces the partial sums, then passes min(1, max/norm) to adamw_step
// (AdamWConfig::grad_scale).
double sum_of_squares(const Exec& exec, const float* x, std::int64_t n);  // x (n)
// out[j] = sum_of_squares(exec, x[j], n[j]) for j < count (the same values), waited for once: on a
// GPU one crossing for all the ranges, not one each (the optimizer's pieces of a step's norm).
void sum_of_squares_each(const Exec& exec, double* out, const float* const* x,
                         const std::int64_t* n, std::int64_t count);

// ---- token embedding (ops_embedding.cpp) --------------------------------------------------------

// Rows of a vocab slice [vocab_start, vocab_end) (the whole vocab on one rank). Token ids outside
// the slice produce zero rows in forward and no gradient in backward: with a vocab-parallel
// embedding the owning rank supplies them and an all-reduce sums the rows.
void embedding_forward(const Exec& exec, float* out,  // out (N, C)
                       const std::int32_t* tokens,    // tokens (N)
                       const float* wte,              // wte (vocab_end - vocab_start, C)
                       std::int64_t N, std::int64_t C, std::int64_t vocab_start,
                       std::int64_t vocab_end);
void embedding_backward(const Exec& exec, float* dwte,  // dwte (vocab_end - vocab_start, C) +=
                        const float* dout,              // dout (N, C)
                        const std::int32_t* tokens,     // tokens (N)
                        std::int64_t N, std::int64_t C, std::int64_t vocab_start,
                        std::int64_t vocab_end);
// UserError naming the first token id outside [0, vocab_size) (bad tokenizer or data file).
void check_token_ids(const std::int32_t* tokens, std::int64_t N, std::int64_t vocab_size);

// ---- RMSNorm (ops_norm.cpp) ---------------------------------------------------------------------

// out = inp / sqrt(mean(inp^2) + eps) * weight; saves rstd = 1 / sqrt(mean(inp^2) + eps). With
// out16, out rounded to bf16 there too (precision.h's rounding, while the row is at hand): the
// copy a bf16 GEMM reads (LinearInput's Copy::kFilled), without a pass of its own over out.
void rmsnorm_forward(const Exec& exec, float* out,  // out (N, C)
                     float* rstd,                   // rstd (N)
                     const float* inp,              // inp (N, C)
                     const float* weight,           // weight (C)
                     std::int64_t N, std::int64_t C, float eps,
                     bf16* out16 = nullptr);  // out16 (N, C) or null
void rmsnorm_backward(const Exec& exec,
                      float* dinp,          // dinp (N, C) = or += (mode: into the residual's)
                      float* dweight,       // dweight (C) +=
                      const float* dout,    // dout (N, C)
                      const float* inp,     // inp (N, C)
                      const float* weight,  // weight (C)
                      const float* rstd,    // rstd (N) from forward
                      std::int64_t N, std::int64_t C, Out mode = Out::kWrite);

// ---- rotary position embedding (ops_rope.cpp) ---------------------------------------------------

// Hugging Face LLaMA convention ("rotate half"): for i < D/2 the pair is (x[i], x[i + D/2]),
// rotated by angle pos · f_i, f_i = theta^(-2i/D) unless scaled (transformers' rope_scaling):
//   kLinear: f_i / factor;
//   kLlama3 (Llama 3.1+): with wavelength w_i = 2π / f_i, L = original_context,
//     w_i > L / low_freq_factor:  f_i / factor              (long wavelengths slowed down)
//     w_i < L / high_freq_factor: f_i                       (short ones kept)
//     otherwise, s = (L / w_i − low_freq_factor) / (high_freq_factor − low_freq_factor):
//                                  (1 − s) · f_i / factor + s · f_i.
struct RopeScaling {
  enum class Kind { kNone, kLinear, kLlama3 };
  Kind kind = Kind::kNone;
  double factor = 1.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  double original_context = 8192.0;
};
// The frequencies f_i above (i < D/2), in double. UserError on a factor that is not positive, or
// (kLlama3) a high_freq_factor not above low_freq_factor.
void rope_frequencies(double* freq, std::int64_t D, double theta, const RopeScaling& scaling);
// Computed once per run into a host table (the caller copies it where its Exec needs it):
void rope_table(float* table,  // table (max_pos, D): [cos(angle_0..D/2-1) | sin(angle_0..D/2-1)]
                std::int64_t max_pos, std::int64_t D, double theta,
                const RopeScaling& scaling = {});
// Position of row t is pos_offset + t (a later sequence chunk, or KV-cached decoding).
// In place is allowed (out == inp).
void rope_forward(const Exec& exec, float* out,  // out (B, T, n_heads * D)
                  const float* inp,              // inp (B, T, n_heads * D)
                  const float* table,            // table (max_pos, D), max_pos >= pos_offset + T
                  std::int64_t B, std::int64_t T, std::int64_t n_heads, std::int64_t D,
                  std::int64_t pos_offset);
// The rotation is orthogonal, so the gradient is the inverse rotation of dout. dinp == dout ok.
void rope_backward(const Exec& exec, float* dinp,  // dinp (B, T, n_heads * D) =
                   const float* dout,              // dout (B, T, n_heads * D)
                   const float* table,             // table (max_pos, D)
                   std::int64_t B, std::int64_t T, std::int64_t n_heads, std::int64_t D,
                   std::int64_t pos_offset);

// ---- causal grouped-query attention (ops_attention.cpp) -----------------------------------------

struct AttentionShape {
  std::int64_t B = 0, T = 0;
  std::int64_t n_heads = 0;     // H query heads
  std::int64_t n_kv_heads = 0;  // Hkv; H % Hkv == 0, query head h reads kv head h / (H / Hkv)
  std::int64_t head_dim = 0;    // D
  std::int64_t tile = 64;       // query and key tile length; memory is O(tile^2), not O(T^2)
  // Context parallelism: the T query rows are positions [q_pos, q_pos + T) of a sequence whose
  // keys and values hold kv_len rows per batch (0: T), key row j at position j. The causal mask
  // compares these absolute positions.
  std::int64_t q_pos = 0;
  std::int64_t kv_len = 0;
  std::int64_t keys() const { return kv_len > 0 ? kv_len : T; }
};

// Floats of scratch the forward/backward need; independent of T (that is the point of tiling).
// The bf16 tiles also keep per-thread library buffers outside the arena: one head's k and v
// packed, 8·keys·D bytes, plus a few tiles (kernels/attention_bf16.h).
std::int64_t attention_scratch_floats(const AttentionShape& s);

// out = softmax(q k^T / sqrt(D) + causal mask) v per head, computed tile by tile with an online
// softmax. Saves only out and the per-row logsumexp of the scaled scores. `kind` is the linear
// layers' GEMM kind: the tile products run in fp32 (OpenBLAS), or, when `kind` is a bf16 kind and
// the CPU has AVX512-BF16, with bf16 operands and fp32 sums (kernels/attention_bf16.h); forward
// and backward of one micro-batch must be given the same kind.
void attention_forward(const Exec& exec,
                       float* out,      // out (B, T, H * D)
                       float* lse,      // lse (B, H, T)
                       const float* q,  // q (B, T, H * D)   (after RoPE)
                       const float* k,  // k (B, keys, Hkv * D) (after RoPE)
                       const float* v,  // v (B, keys, Hkv * D)
                       float* scratch,  // scratch (attention_scratch_floats)
                       const AttentionShape& s);
// Recomputes the scores tile by tile from q, k and lse (flash-attention 2 backward).
void attention_backward(const Exec& exec,
                        float* dq,          // dq (B, T, H * D) =
                        float* dk,          // dk (B, keys, Hkv * D) =
                        float* dv,          // dv (B, keys, Hkv * D) =
                        const float* dout,  // dout (B, T, H * D)
                        const float* q,     // q (B, T, H * D)
                        const float* k,     // k (B, keys, Hkv * D)
                        const float* v,     // v (B, keys, Hkv * D)
                        const float* out,   // out (B, T, H * D) from forward
                        const float* lse,   // lse (B, H, T) from forward
                        float* scratch,     // scratch (attention_scratch_floats)
                        const AttentionShape& s);

// ---- linear and SwiGLU (ops_mlp.cpp) ------------------------------------------------------------

// y = x W^T with W stored [out, in] row-major (Hugging Face layout). No bias (LLaMA has none).
// Every linear op runs the GEMM kind its caller gives (kernels/gemm.h): nothing here is global, so
// two models of one process may run different kinds.
void linear_forward(const Exec& exec,
                    float* y,        // y (N, out) = or +=
                    const float* x,  // x (N, in)
                    const float* w,  // w (out, in)
                    std::int64_t N, std::int64_t in, std::int64_t out, Out mode = Out::kWrite);
// A linear layers' input that several of their GEMMs read (x for q, k and v; dy for the input and
// the weight gradient), prepared for GEMMs of `kind`: with a bf16 kind it is rounded to bf16 once,
// here, instead of once per GEMM (the same bits); the linear ops given a LinearInput run its kind.
// The caller keeps the floats unchanged while it lives.
// The rounded copy comes from a pool of library memory outside the arena (like the GEMMs' own
// workspace, kernels/gemm.h: per thread on the CPU, the stream's device memory on a GPU), grown to
// the largest use and reused; or it is the caller's own copy (a bf16-stored activation, which the
// backward then reads without rounding).
class LinearInput {
 public:
  LinearInput(const Exec& exec, const float* x, std::int64_t rows,
              std::int64_t cols);  // x (rows, cols)
  // With the caller's bf16 copy of x (rows × cols, packed; nullptr: as the constructor above).
  // kFill rounds x into it, whatever the GEMM kind, so that the copy always holds x; kFilled
  // takes it as holding x rounded already (the same bits rounding gives: with bf16 GEMMs the
  // floats at x are then not read and may be stale).
  enum class Copy { kFill, kFilled };
  LinearInput(const Exec& exec, const float* x, bf16* copy, Copy how, std::int64_t rows,
              std::int64_t cols);
  ~LinearInput();
  LinearInput(const LinearInput&) = delete;
  LinearInput& operator=(const LinearInput&) = delete;
  GemmKind kind() const { return exec_.gemm; }
  const Exec& exec() const { return exec_; }
  const float* data() const { return x_; }
  // nullptr unless the GEMMs are bf16
  const bf16* rounded() const { return rounded_; }
  std::int64_t rows() const { return rows_; }
  std::int64_t cols() const { return cols_; }

 private:
  Exec exec_;
  const float* x_;
  std::int64_t rows_, cols_;
  const bf16* rounded_ = nullptr;
  int buffer_ = -1;  // its buffer in the pool
};
void linear_forward(float* y, const LinearInput& x, const float* w, std::int64_t out,
                    Out mode = Out::kWrite);  // x (N, in) as above
// y (N, out) = residual (N, out) + x · wᵀ, y ≠ residual: a block's residual add (x + attn(x)) in
// the GEMM, the values of linear_forward into scratch and add(y, residual, scratch). On a GPU one
// cuBLASLt call whose epilogue reads the residual (no pass of its own over the product); on a CPU
// the GEMM writes y and the residual is added to it.
void linear_forward_residual(float* y, const float* residual, const LinearInput& x, const float* w,
                             std::int64_t out);
// The backward is split in two so that zero-bubble pipeline schedules can run the input
// gradient (B) now and the weight gradient (W) later.
void linear_backward_input(const Exec& exec,
                           float* dx,        // dx (N, in) =
                           const float* dy,  // dy (N, out)
                           const float* w,   // w (out, in)
                           std::int64_t N, std::int64_t in, std::int64_t out);
void linear_backward_weight(const Exec& exec,
                            float* dw,        // dw (out, in) +=
                            const float* dy,  // dy (N, out)
                            const float* x,   // x (N, in)
                            std::int64_t N, std::int64_t in, std::int64_t out);
void linear_backward_input(float* dx, const LinearInput& dy, const float* w, std::int64_t in,
                           Out mode = Out::kWrite);  // dx = or += dy · w
void linear_backward_weight(float* dw, const LinearInput& dy,
                            const LinearInput& x);  // dy and x of one kind

// h = silu(gate) * up, silu(x) = x * sigmoid(x). gate and up are the two projection outputs.
void swiglu_forward(const Exec& exec, float* h,       // h (N, F)
                    const float* gate,                // gate (N, F)
                    const float* up,                  // up (N, F)
                    std::int64_t n);                  // n = N * F
void swiglu_backward(const Exec& exec, float* dgate,  // dgate (N, F) =
                     float* dup,                      // dup (N, F) =
                     const float* dh,                 // dh (N, F)
                     const float* gate,               // gate (N, F)
                     const float* up,                 // up (N, F)
                     std::int64_t n);
// The same two with bf16 copies, for bf16 GEMMs over bf16-stored activations, in one pass each
// (the values are those of swiglu_forward / swiglu_backward, rounded as float_to_bf16 rounds):
// forward writes h, gate and up rounded (h for down_proj's GEMMs, gate and up for the backward);
// backward reads gate and up from those copies and writes dgate and dup rounded (for GEMMs).
void swiglu_forward_bf16(const Exec& exec, bf16* h16, bf16* gate16, bf16* up16, const float* gate,
                         const float* up, std::int64_t n);
void swiglu_backward_bf16(const Exec& exec, bf16* dgate16, bf16* dup16, const float* dh,
                          const bf16* gate16, const bf16* up16, std::int64_t n);

// ---- softmax cross-entropy (ops_loss.cpp) -------------------------------------------------------

// Targets equal to kIgnoreIndex (Hugging Face's -100) contribute no loss and no gradient.
inline constexpr std::int32_t kIgnoreIndex = -100;

// Fused loss and gradient for the whole vocabulary on one rank: losses[i] = -log softmax(i)[t_i],
// and logits are overwritten with dlogits = (softmax - onehot(t)) * grad_scale (for a mean loss,
// grad_scale = 1 / number of non-ignored targets).
void cross_entropy_fused(const Exec& exec, float* logits,  // logits (N, V) in, dlogits (N, V) out
                         float* losses,                    // losses (N)
                         const std::int32_t* targets,      // targets (N)
                         std::int64_t N, std::int64_t V, float grad_scale);

// The same, in pieces, for a vocab-parallel LM head where this rank holds columns
// [vocab_start, vocab_start + V) of the logits:
//   1. ce_local_max            -> all-reduce MAX   -> row_max
//   2. ce_local_sum_exp(row_max) -> all-reduce SUM -> sum_exp
//   3. ce_local_target_logit   -> all-reduce SUM   -> target_logit (zero on ranks not owning it)
//   4. ce_loss_and_grad(row_max, sum_exp, target_logit) on every rank.
void ce_local_max(const Exec& exec, float* row_max,  // row_max (N)
                  const float* logits,               // logits (N, V)
                  std::int64_t N, std::int64_t V);
void ce_local_sum_exp(const Exec& exec,
                      float* sum_exp,        // sum_exp (N): sum_j exp(logit_j - row_max)
                      const float* logits,   // logits (N, V)
                      const float* row_max,  // row_max (N), global
                      std::int64_t N, std::int64_t V);
void ce_local_target_logit(const Exec& exec, float* target_logit,  // target_logit (N)
                           const float* logits,                    // logits (N, V)
                           const std::int32_t* targets,            // targets (N), global ids
                           std::int64_t N, std::int64_t V, std::int64_t vocab_start);
void ce_loss_and_grad(const Exec& exec, float* logits,  // logits (N, V) in, dlogits (N, V) out
                      float* losses,                    // losses (N)
                      const std::int32_t* targets,      // targets (N), global ids
                      const float* row_max,             // row_max (N), global
                      const float* sum_exp,             // sum_exp (N), global
                      const float* target_logit,        // target_logit (N), global
                      std::int64_t N, std::int64_t V, std::int64_t vocab_start, float grad_scale);

// ---- optimizer (ops_optim.cpp) ------------------------------------------------------------------

struct AdamWConfig {
  float lr = 3e-4f;
  float beta1 = 0.9f;
  float beta2 = 0.95f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;  // decoupled: p -= lr * wd * p
  float grad_scale = 1.0f;    // g = grads * grad_scale (clipping), rounded to fp32 before use
};

// One AdamW step over a flat range, same order of operations as torch.optim.AdamW:
//   g = grads · grad_scale (the bits a separate scaling pass would store);
//   p -= lr * wd * p;  m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2;
//   p -= lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)
// `step` is t, counted from 1. No-decay parameters (norms): call again on their range with
// weight_decay = 0.
void adamw_step(const Exec& exec, float* params,  // params (n)
                const float* grads,               // grads (n)
                float* m,                         // m (n), first moment
                float* v,                         // v (n), second moment
                std::int64_t n, const AdamWConfig& cfg, std::int64_t step);

// One range of an AdamW step over many (the optimizer's pieces, each with its settings).
struct AdamWTensor {
  float* params;
  const float* grads;
  float* m;
  float* v;
  std::int64_t n;
  AdamWConfig cfg;
};
// adamw_step on each of `count` ranges at `step`: the bits of one call each (every element is its
// own update), on a GPU in a few launches for all instead of one a range.
void adamw_step_many(const Exec& exec, const AdamWTensor* tensors, std::int64_t count,
                     std::int64_t step);

}  // namespace t3d::kernels
