// The shared experts' sigmoid gate of a Qwen2-MoE block (docs/moe.md, model.shared_expert_gate):
//
//   g[t]   = sigmoid(x[t] · w)                 x (N, C) the block's normalised input, w (C)
//   out[t] += g[t] · shared[t]                 shared (N, C) the shared experts' output
//
// and its backward, in three steps so that a caller may sum the per-row dot over tensor-parallel
// ranks between them (under tp, `shared` is each rank's partial sum of the shared experts'
// output; g is the same on every rank):
//
//   dg[t]      = dy[t] · shared[t]             shared_gate_backward_dot (partial under tp)
//   dz[t]      = dg[t] · g[t] · (1 − g[t])     shared_gate_backward (dg summed by then)
//   dshared[t] = g[t] · dy[t]
//   dx[t]     += dz[t] · w                     shared_gate_backward_input (one tp rank's)
//   dw        += Σ_t dz[t] · x[t]              shared_gate_backward_weight, over any row range
//
// fp32 in and out; every dot and the weight gradient's sum over rows are summed in double in an
// order fixed by the shapes (kernels/row_math.h gate_row_dot, gate_dweight), so the results do
// not depend on the thread count, and the CUDA twins (kernels/cuda/ops_gate.cu) give the CPU's
// bits. Accumulation contract as kernels/ops.h: out, dx, dw +=; g, dg, dz, dshared =.
#pragma once

#include <cstdint>

#include "kernels/exec.h"

namespace t3d::kernels {

// out (N, C) +=, g (N) = from x (N, C), w (C), shared (N, C).
void shared_gate_forward(const Exec& exec, float* out, float* g, const float* x, const float* w,
                         const float* shared, std::int64_t N, std::int64_t C);
// dg (N) = the per-row dot of dy (N, C) and shared (N, C).
void shared_gate_backward_dot(const Exec& exec, float* dg, const float* dy, const float* shared,
                              std::int64_t N, std::int64_t C);
// From dg (N), the whole dot: dz (N) = (may be dg itself), dshared (N, C) = g · dy.
void shared_gate_backward(const Exec& exec, float* dshared, float* dz, const float* dg,
                          const float* g, const float* dy, std::int64_t N, std::int64_t C);
// dx (N, C) += dz ⊗ w.
void shared_gate_backward_input(const Exec& exec, float* dx, const float* dz, const float* w,
                                std::int64_t N, std::int64_t C);
// dw (C) += Σ over `rows` rows of dz[t] · x[t] (x (rows, C)), in row order.
void shared_gate_backward_weight(const Exec& exec, float* dw, const float* dz, const float* x,
                                 std::int64_t rows, std::int64_t C);

}  // namespace t3d::kernels
