#include "runtime/model/moe_block.h"

#include "kernels/ops.h"

namespace t3d::runtime {

namespace k = t3d::kernels;

k::Exec router_exec(const k::Exec& exec) {
  k::Exec fp32 = exec;
  if (k::gemm_kind_is_bf16(exec.gemm)) fp32.gemm = k::GemmKind::kOneDnnF32;
  return fp32;
}

k::RouterShape router_shape(const ModelConfig& config, int64_t rows) {
  k::RouterShape r;
  r.N = rows;
  r.E = config.n_experts;
  r.K = config.experts_per_token;
  r.score = config.router_score;
  r.normalize = config.router_norm_topk;
  r.scale = static_cast<float>(config.router_scale);
  return r;
}

void route(const k::Exec& exec, float* scores, int32_t* chosen, float* gates, const float* x,
           const float* router, const float* bias, const k::RouterShape& r, int64_t C) {
  k::linear_forward(router_exec(exec), scores, x, router, r.N, C, r.E);  // the logits
  k::moe_route_forward(exec, scores, chosen, gates, scores, bias, r);
}

}  // namespace t3d::runtime
