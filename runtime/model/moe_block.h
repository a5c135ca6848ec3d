// The parts of a mixture-of-experts block that training (runtime/model/model_moe.cpp) and the
// decoder (runtime/use/generate.cpp) share, so that both compute one block (docs/moe.md): the
// router's shape and precision, the router forward, and the shared experts (a SwiGLU MLP,
// kernels/ops_swiglu.h).
#pragma once

#include <cstdint>

#include "kernels/exec.h"
#include "kernels/ops_moe.h"
#include "kernels/ops_swiglu.h"
#include "runtime/recipe/recipe.h"

namespace t3d::runtime {

// The router runs in fp32 whatever the GEMM kind: with bf16 GEMMs, oneDNN's fp32.
kernels::Exec router_exec(const kernels::Exec& exec);
// The router of `config` over `rows` tokens.
kernels::RouterShape router_shape(const ModelConfig& config, int64_t rows);

// The router forward over r.N rows: the logits x (N, C) · router^T (router_exec) into scores,
// then the scores, the K chosen experts and their gates (kernels::moe_route_forward); `bias` (E)
// or nullptr shifts the selection.
void route(const kernels::Exec& exec, float* scores, int32_t* chosen, float* gates, const float* x,
           const float* router, const float* bias, const kernels::RouterShape& r, int64_t C);

}  // namespace t3d::runtime
