#include "kernels/ops_decode.h"

#include <cmath>

#include "kernels/check.h"
#include "kernels/cuda/cuda_ops.h"

namespace t3d::kernels {

void attention_decode(const Exec& exec, float* out, const float* q, const float* k_cache,
                      const float* v_cache, float* scores, std::int64_t n, std::int64_t H,
                      std::int64_t Hkv, std::int64_t D) {
  T3D_ON_GPU(exec,
             cuda::attention_decode(*exec.stream, out, q, k_cache, v_cache, scores, n, H, Hkv, D));
  T3D_ASSERT(n > 0 && H > 0 && Hkv > 0 && H % Hkv == 0 && D > 0, "n ", n, " H ", H, " Hkv ", Hkv,
             " D ", D);
  const std::int64_t kv_row = Hkv * D, group = H / Hkv;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  for (std::int64_t h = 0; h < H; ++h) {
    const float* qh = q + h * D;              // (D)
    const std::int64_t kv = (h / group) * D;  // column of this head's kv head in the cache
    float max = -INFINITY;
    for (std::int64_t j = 0; j < n; ++j) {
      const float* kj = k_cache + j * kv_row + kv;  // (D)
      float s = 0.0f;
      for (std::int64_t d = 0; d < D; ++d) s += qh[d] * kj[d];
      scores[j] = s * scale;
      max = scores[j] > max ? scores[j] : max;
    }
    // Sum in double: a long context adds thousands of small terms.
    double sum = 0.0;
    for (std::int64_t j = 0; j < n; ++j) sum += scores[j] = std::exp(scores[j] - max);
    const float inv = static_cast<float>(1.0 / sum);
    float* oh = out + h * D;  // (D)
    for (std::int64_t d = 0; d < D; ++d) oh[d] = 0.0f;
    for (std::int64_t j = 0; j < n; ++j) {
      const float p = scores[j] * inv;
      const float* vj = v_cache + j * kv_row + kv;  // (D)
      for (std::int64_t d = 0; d < D; ++d) oh[d] += p * vj[d];
    }
  }
}

}  // namespace t3d::kernels
