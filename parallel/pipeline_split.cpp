#include "parallel/pipeline_split.h"

#include <algorithm>
#include <limits>

#include "kernels/check.h"

namespace t3d::parallel {

double head_cost_in_layers(int64_t vocab, int64_t dim, int64_t ffn_dim) {
  return static_cast<double>(vocab) * dim / (4.0 * dim * dim + 3.0 * dim * ffn_dim);
}

std::vector<LayerRange> split_layers(int64_t n_layers, int64_t chunks, double head_cost,
                                     const std::vector<int64_t>& split) {
  T3D_ASSERT(chunks >= 1 && n_layers >= chunks, n_layers, " layers over ", chunks, " chunks");
  std::vector<int64_t> starts = {0};
  if (!split.empty()) {
    T3D_ASSERT(static_cast<int64_t>(split.size()) == chunks - 1, "split size");
    starts.insert(starts.end(), split.begin(), split.end());
  } else {
    // best[k][i]: smallest possible largest cost when the first i layers form k chunks.
    const double inf = std::numeric_limits<double>::infinity();
    std::vector<std::vector<double>> best(chunks + 1, std::vector<double>(n_layers + 1, inf));
    std::vector<std::vector<int64_t>> cut(chunks + 1, std::vector<int64_t>(n_layers + 1, 0));
    best[0][0] = 0;
    for (int64_t k = 1; k <= chunks; ++k)
      for (int64_t i = k; i <= n_layers; ++i)
        for (int64_t j = k - 1; j < i; ++j) {
          const double cost = (i - j) + (k == chunks && i == n_layers ? head_cost : 0.0);
          const double worst = std::max(best[k - 1][j], cost);
          // Ties go to the later cut: earlier stages get more layers, the head-carrying last fewer.
          if (worst <= best[k][i]) best[k][i] = worst, cut[k][i] = j;
        }
    std::vector<int64_t> rev;
    for (int64_t k = chunks, i = n_layers; k > 1; --k) rev.push_back(i = cut[k][i]);
    starts.insert(starts.end(), rev.rbegin(), rev.rend());
  }
  std::vector<LayerRange> out(chunks);
  for (int64_t k = 0; k < chunks; ++k) {
    out[k].begin = starts[k];
    out[k].end = k + 1 < chunks ? starts[k + 1] : n_layers;
    out[k].first = k == 0;
    out[k].last = k == chunks - 1;
    T3D_ASSERT(out[k].size() >= 1, "empty pipeline chunk ", k);
  }
  return out;
}

std::vector<LayerRange> layers_of_stage(const std::vector<LayerRange>& split,
                                        const std::vector<int>& chunk_stage, int64_t stage) {
  T3D_ASSERT(split.size() == chunk_stage.size(), "a split of ", split.size(),
             " chunks for a placement of ", chunk_stage.size());
  std::vector<LayerRange> out;
  for (size_t k = 0; k < split.size(); ++k)
    if (chunk_stage[k] == stage) out.push_back(split[k]);
  return out;
}

}  // namespace t3d::parallel
