// Mixture-of-experts operators (ops_moe.cpp): the router, the permutation of token slots by
// expert, the experts' SwiGLU FFNs as one grouped pass over the permuted rows, the combine, the
// sequence-wise auxiliary balance loss and the router-bias balancing rule. fp32, row-major, on
// either backend (kernels/exec.h); the same accumulation contract as ops.h (parameter gradients
// accumulate, activation gradients are written). Shapes: N tokens, C model dim, E experts, K
// experts per token (top-k), Fe one expert's FFN width on this rank (its tp slice), S = N·K token
// slots.
//
// Routing (docs/moe.md states the same math):
//   scores s (N, E) = softmax(logits) per row, or sigmoid(logits) (RouterScore);
//   chosen (N, K): the K experts with the largest s[t, e] + bias[e] (bias may be absent), in
//     descending order of that value, ties to the lower expert index: deterministic;
//   gates g (N, K) = s[t, chosen] (the bias never enters a gate), divided by their sum over K
//     when `normalize`, then times `scale`.
// A slot is (token t, rank j < K): slot t·K + j. The permutation orders the slots by expert,
// and inside an expert by slot index, so an expert's rows are contiguous and in token order.
//
// No op allocates: every buffer comes from the caller (on a GPU the auxiliary loss keeps its
// partial sums in the Stream's own buffer). The ops over the Exec's memory take the Exec first
// and run their CUDA twin on a GPU one (kernels/cuda/cuda_ops.h; their row arithmetic is written
// once, in kernels/moe_math.h). Those that take none read the routing on the host, so their
// pointers are host memory: the MoE block copies `chosen` to the host, permutes it there and
// copies the slot maps back (the one named crossing of the routing: moe_permute, moe_ep_offsets,
// moe_count), or are arithmetic on host values (moe_capacity, moe_bias_delta). The expert
// offsets the grouped pass and moe_ep_reorder take (offsets, part_offsets, counts,
// block_offsets) are those host values on either backend: the host loops over the experts and
// launches one GEMM each.
#pragma once

#include <cstdint>

#include "kernels/gemm.h"
#include "kernels/ops.h"  // Out
#include "kernels/ops_swiglu.h"

namespace t3d::kernels {

enum class RouterScore : uint8_t { kSoftmax, kSigmoid };

// The most experts a model may have, routed or shared (docs/recipe.md, "Limits"): recipe
// validation refuses more, and moe_aux_loss keeps one sequence's per-expert counts on the stack.
inline constexpr std::int64_t kMaxExperts = 1024;

struct RouterShape {
  std::int64_t N = 0, E = 0, K = 0;
  RouterScore score = RouterScore::kSoftmax;
  bool normalize = true;  // gates divided by their sum over the K chosen
  float scale = 1.0f;     // gates multiplied by this after normalising
};

// Router forward from the logits (N, E) (the caller's fp32 GEMM of the normalised input with
// the router weight). `bias` (E) or nullptr only shifts the selection.
void moe_route_forward(const Exec& exec,
                       float* scores,         // scores (N, E) =
                       std::int32_t* chosen,  // chosen (N, K) =
                       float* gates,          // gates (N, K) =
                       const float* logits,   // logits (N, E); may alias scores
                       const float* bias,     // bias (E) or nullptr
                       const RouterShape& r);
// Router backward: the gradient of the logits from that of the gates (the selection is a
// constant) plus `dscores_extra` (N, E) or nullptr, a gradient of the scores from elsewhere (the
// auxiliary loss), added before the score function's backward.
void moe_route_backward(const Exec& exec,
                        float* dlogits,              // dlogits (N, E) =
                        const float* dgates,         // dgates (N, K)
                        const float* dscores_extra,  // (N, E) or nullptr
                        const float* scores,         // scores (N, E) from forward
                        const std::int32_t* chosen,  // chosen (N, K) from forward
                        const RouterShape& r);

// Expert capacity (docs/moe.md): with factor c > 0 an expert takes at most ceil(c · N·K / E) of
// the N·K slots (at least 1); c = 0 returns 0, no limit (dropless).
std::int64_t moe_capacity(double factor, std::int64_t N, std::int64_t E, std::int64_t K);

// The permutation of the N·K slots by expert (a stable counting sort of `chosen`), keeping at most
// `capacity` rows per expert (0: all): slots are taken in slot order (token order, then the
// token's rank j), so an expert keeps its first `capacity` slots and the later ones drop.
// offsets (E + 1): expert e's rows are [offsets[e], offsets[e + 1]); offsets[E] = the kept rows
// (S = N·K when none drop); row_of_slot (N·K): the permuted row of slot t·K + j, -1 when it
// dropped; slot_of_row (offsets[E] used): its inverse. Returns the slots that dropped.
std::int64_t moe_permute(std::int64_t* offsets, std::int32_t* row_of_slot,
                         std::int32_t* slot_of_row, const std::int32_t* chosen, std::int64_t N,
                         std::int64_t E, std::int64_t K, std::int64_t capacity = 0);
// rows (S, C): row r = x[slot_of_row[r] / K] (the token of each permuted row); S = offsets[E].
void moe_gather(const Exec& exec, float* rows, const float* x, const std::int32_t* slot_of_row,
                std::int64_t S, std::int64_t K, std::int64_t C);
// The same of a bf16 copy of x: the gathered rows rounded, for bf16 GEMMs (ExpertCopies::xs).
void moe_gather(const Exec& exec, bf16* rows, const bf16* x, const std::int32_t* slot_of_row,
                std::int64_t S, std::int64_t K, std::int64_t C);
// The combine: y[t] = Σ_{j=0..K-1} w[t·K + j] · rows[row_of_slot[t·K + j]], j ascending, each
// product rounded to fp32 and added in that order (w = gates in forward; w = nullptr: weight 1,
// the backward's sum of the slots' input gradients). A dropped slot (row -1) adds nothing; a
// token whose K slots all dropped sums to 0. `mode`: y written, or that sum added to y.
void moe_combine(const Exec& exec, float* y, const float* rows, const float* w,
                 const std::int32_t* row_of_slot, std::int64_t N, std::int64_t K, std::int64_t C,
                 Out mode);

// One float per slot, moved between slot order and permuted-row order (r < rows, rows =
// offsets[E]): the gather writes by_row[r] = by_slot[slot_of_row[r]], the scatter writes
// by_slot[slot_of_row[r]] = by_row[r] (slots without a row are left as they are). Expert
// parallelism sends its rows' gates this way and takes their gradients back.
void moe_gather_slots(const Exec& exec, float* by_row, const float* by_slot,
                      const std::int32_t* slot_of_row, std::int64_t rows);
void moe_scatter_slots(const Exec& exec, float* by_slot, const float* by_row,
                       const std::int32_t* slot_of_row, std::int64_t rows);

// The routed experts' SwiGLU FFNs over the permuted rows, one GEMM per expert with rows (the
// grouped pass; experts with no rows are skipped). Expert e's weights: wg and wu (E, Fe, C),
// wd (E, C, Fe), each expert's matrix contiguous. `kind`: the GEMM kind (kernels/gemm.h).
struct ExpertShape {
  std::int64_t E = 0, C = 0, Fe = 0;
  // The backward's weight gradients in parts: expert e's rows split at part_offsets[e·parts + p]
  // (E·parts + 1 entries, within the expert's rows), one GEMM per part added in part order.
  // Expert parallelism takes each source rank's rows apart, so that the sum over the sources is
  // in the order, and with the rounding, of the data-parallel reduction without it. nullptr: one
  // GEMM per expert.
  std::int64_t parts = 1;
  const std::int64_t* part_offsets = nullptr;
};
// With bf16 GEMMs over bf16-stored activations, the experts' SwiGLU is the dense MLP's fused one
// (kernels/ops.h swiglu_forward_bf16 / _backward_bf16): the forward writes gate, up and h rounded
// into these copies, and h's floats are not written (the down GEMM reads the copy); the backward
// reads gate, up and h from the copies alone (their floats are not read) and writes dgate and dup
// rounded, in the first half of their fp32 buffers, where the GEMMs (and W) read them. The same
// bits as the fp32 activations rounded and stored, then decoded. All null (the default): the fp32
// activations, with any GEMM kind.
// `xs` (with or without the others): the rows' inputs already rounded (S, C), read by the gate
// and up GEMMs and the weight gradients instead of rounding xs per expert (its floats are then not
// read; bf16 GEMMs only). A bf16-stored block gathers them from its rounded copy of the input.
struct ExpertCopies {
  bf16 *gate = nullptr, *up = nullptr, *h = nullptr;  // (S, Fe) each, or all null
  const bf16* xs = nullptr;                           // (S, C) or null
  bool fused() const { return h != nullptr; }
  SwigluCopies swiglu() const { return {gate, up, h, fused()}; }  // the activation's copies
};
// Runs run(lo, n) over row ranges that cover an expert's rows [r0, r0 + rows) of the `end`
// rows, for the experts' M-row GEMMs (forward and input gradient): the rows rounded up to
// `bucket` (gemm_row_bucket) where that stays inside the `end` rows, else the rows rounded down
// to it and then the rest. So an expert's row count reaches the GEMM as one of about
// end / bucket + bucket shapes, not one per count. The extra rows are the next experts': read,
// and written with values those experts' own GEMMs overwrite, so the experts must run in
// ascending order, and every one of their M-row GEMMs writes (or first writes, then adds).
template <class Run>
void for_expert_rows(std::int64_t r0, std::int64_t rows, std::int64_t end, std::int64_t bucket,
                     Run&& run) {
  const std::int64_t padded = (rows + bucket - 1) / bucket * bucket;
  if (r0 + padded <= end) return run(r0, padded);
  const std::int64_t whole = rows / bucket * bucket;
  if (whole > 0) run(r0, whole);
  if (rows > whole) run(r0 + whole, rows - whole);
}

// The routed experts' weights, each projection's E matrices back to back (expert-major, as the
// grouped pass reads them): gate and up (E, Fe, C), down (E, C, Fe). ExpertGrads: their gradients
// (same shapes; the backward adds to them).
struct ExpertWeights {
  const float *gate = nullptr, *up = nullptr, *down = nullptr;
};
struct ExpertGrads {
  float *gate = nullptr, *up = nullptr, *down = nullptr;
};
// Per permuted row (S, Fe) each: the forward's activations (gate = xs · wg[e]^T, up = xs · wu[e]^T,
// h = silu(gate) · up, the SwiGLU of kernels/ops_swiglu.h), written by moe_experts_forward and read
// by the backward; and the backward's gradients of them (dh: scratch; dgate, dup: written by
// _input, read by _weight).
using ExpertActs = SwigluActs;
struct ExpertActGrads {
  float *dh = nullptr, *dgate = nullptr, *dup = nullptr;
};
// The rows' gates and their gradients, by slot: gates (N·K) the forward's, dgates (N·K) written
// by the backward; slot_of_row (S) the permutation's (moe_permute).
struct ExpertGating {
  const float* gates = nullptr;
  float* dgates = nullptr;
  const std::int32_t* slot_of_row = nullptr;
};

// Runs run(e, lo, n) over each expert e with rows (ascending; experts without rows skipped), for
// the row ranges for_expert_rows gives with `bucket` inside the offsets[E] rows (bucket 1: each
// expert's exact rows). The one loop over the grouped pass's experts.
template <class Run>
void for_each_expert(const std::int64_t* offsets, std::int64_t E, std::int64_t bucket, Run&& run) {
  for (std::int64_t e = 0; e < E; ++e) {
    const std::int64_t r0 = offsets[e], rows = offsets[e + 1] - r0;
    if (rows == 0) continue;
    for_expert_rows(r0, rows, offsets[E], bucket,
                    [&](std::int64_t lo, std::int64_t n) { run(e, lo, n); });
  }
}

// The experts' M-row GEMMs (forward, input gradient) may run over rows past an expert's own, up to
// S, which later experts then overwrite (gemm_row_bucket, kernels/gemm.h): what they write (y,
// gate, up; dh, dxs) must not overlap another of the buffers (a copy in the first half of its own
// buffer, as ExpertCopies describes, is not written).
void moe_experts_forward(const Exec& exec,
                         float* y,                     // y (S, C) = expert outputs per row
                         const ExpertActs& acts,       // gate, up, h (S, Fe) =
                         const float* xs,              // xs (S, C) permuted rows
                         const ExpertWeights& w,       //
                         const std::int64_t* offsets,  // offsets (E + 1) from moe_permute
                         const ExpertShape& s, const ExpertCopies& copies = {});
// Backward of the experts and the combine together, without the experts' outputs: with U the
// gradient of an expert's output rows before the gate (dys · wd[e], (rows, Fe)), a row's gate
// gradient is U · h (the dot of dy with the expert's output) and the gradient of its h is
// gate · U. Writes dxs and the gate gradients, accumulates the weight gradients.
//   dys (S, C): row r holds dy of the token of row r (moe_gather of dy); clobbered (scaled by
//     the rows' gates in place, for wd's gradient);
//   gating.dgates (N·K): by slot, dgates[slot_of_row[r]] = Σ_f U[r, f] · h[r, f] (this rank's
//     Fe: a partial sum under tp, which the caller all-reduces); a dropped slot's entry is not
//     written (its gradient is 0: the caller zeroes dgates when slots may drop);
//   d: scratch (S, Fe) each.
void moe_experts_backward(const Exec& exec,
                          float* dxs,                  // dxs (S, C) =
                          const ExpertGating& gating,  // dgates (N·K) =
                          const ExpertGrads& g,        // +=
                          const ExpertActGrads& d,     // scratch (S, Fe) each
                          float* dys,                  // dys (S, C), clobbered
                          const float* xs,             // xs (S, C) forward input
                          const ExpertActs& acts,      // (S, Fe) each, from the forward
                          const ExpertWeights& w, const std::int64_t* offsets, const ExpertShape& s,
                          const ExpertCopies& copies = {});

// The two halves of moe_experts_backward, for the zero-bubble schedules' B and W passes: the one
// then the other gives moe_experts_backward's bits. _input writes dxs and the gate gradients and
// leaves what _weight reads: in dys the rows' output gradients scaled by their gates (in place),
// in d.dgate and d.dup (S, Fe) the gradients of the experts' gate and up projections; d.dh is its
// scratch.
void moe_experts_backward_input(const Exec& exec,
                                float* dxs,                  // dxs (S, C) =
                                const ExpertGating& gating,  // dgates (N·K) =
                                const ExpertActGrads& d,     // dgate, dup (S, Fe) =; dh scratch
                                float* dys,              // dys (S, C), scaled by the gates in place
                                const ExpertActs& acts,  // (S, Fe) each, from the forward
                                const ExpertWeights& w, const std::int64_t* offsets,
                                const ExpertShape& s, const ExpertCopies& copies = {});
// The weight gradients (+=) from what _input left (dys gated, d.dgate, d.dup) and the forward's
// rows xs (S, C) and h (S, Fe), in ExpertShape's parts.
void moe_experts_backward_weight(const Exec& exec, const ExpertGrads& g, const float* dys,
                                 const ExpertActGrads& d, const float* xs, const float* h,
                                 const std::int64_t* offsets, const ExpertShape& s,
                                 const ExpertCopies& copies = {});

// Expert parallelism: P ranks hold El experts each, and a rank's experts receive counts[s·El + j]
// rows of source rank s for its local expert j (s < P, j < El). Source-major order (s, j, row) is
// how an all-to-all delivers them (each source's rows sorted by expert); expert-major order
// (j, s, row) is the grouped pass's.
// The local experts' row offsets (El + 1) in expert-major order, and those of their (expert,
// source) blocks (El·P + 1; ExpertShape::part_offsets).
void moe_ep_offsets(std::int64_t* offsets, std::int64_t* block_offsets, const std::int32_t* counts,
                    std::int64_t P, std::int64_t El);
// Copies rows of `width` floats from source-major to expert-major order (`to_expert_major`) or
// back; row order inside a (source, expert) block is kept. `block_offsets` from moe_ep_offsets.
void moe_ep_reorder(const Exec& exec, float* dst, const float* src, const std::int32_t* counts,
                    const std::int64_t* block_offsets, std::int64_t P, std::int64_t El,
                    std::int64_t width, bool to_expert_major);

// Tokens routed to each expert: counts[e] += number of slots with chosen == e (over N·K), the
// router's choices before any capacity drop (as the auxiliary loss's f).
void moe_count(double* counts, const std::int32_t* chosen, std::int64_t N, std::int64_t E,
               std::int64_t K);

// The sequence-wise auxiliary balance loss of B sequences of T tokens (N = B·T), Switch's form
// per sequence: with f[b, e] = (slots of sequence b routed to e) / (T·K) and
// P[b, e] = (1/T) Σ_t p[t, e], where p is the scores normalised over all E (softmax scores
// already are; sigmoid scores divided by their row sum), loss_b = E · Σ_e f[b, e] · P[b, e].
// Returns Σ_b loss_b (the caller weighs it: coefficient / sequences in the global batch), a host
// value: on a GPU the call waits for the stream (a crossing, as the step's scalars).
// E ≤ kMaxExperts (one sequence's f is kept on the stack, or in a GPU block's shared memory).
// With `dscores` (N, E) non-null, writes the gradient of weight · Σ_b loss_b with respect to the
// scores (f is a constant, as in Switch and DeepSeek-V3).
double moe_aux_loss(const Exec& exec, float* dscores, const float* scores,
                    const std::int32_t* chosen, std::int64_t B, std::int64_t T,
                    const RouterShape& r, float weight);
// moe_aux_loss's gradient alone (dscores non-null), the same bits, without its value: nothing
// crosses to the host, so on a GPU the call does not wait (the backward's use).
void moe_aux_loss_backward(const Exec& exec, float* dscores, const float* scores,
                           const std::int32_t* chosen, std::int64_t B, std::int64_t T,
                           const RouterShape& r, float weight);

// Auxiliary-loss-free balancing (DeepSeek-V3): the step of each bias, delta[e] = rate ·
// sign(mean − counts[e]), mean the average of counts over the E experts, sign(0) = 0. Taken once
// per optimizer step from the counts summed over the whole batch (runtime/train/router_balance.h
// applies it to the biases).
void moe_bias_delta(float* delta, const double* counts, std::int64_t E, float rate);

}  // namespace t3d::kernels
