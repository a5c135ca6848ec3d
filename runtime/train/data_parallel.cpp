#include "runtime/train/data_parallel.h"

#include <algorithm>
#include <vector>

#include "kernels/check.h"

namespace t3d::runtime {

std::unique_ptr<parallel::GradReducer> attach_grad_reducer(Model& model, const parallel::Comm& dp,
                                                           int zero, double bucket_mb,
                                                           kernels::Arena& arena) {
  const int64_t bucket_floats = std::max<int64_t>(1, static_cast<int64_t>(bucket_mb * (1 << 18)));
  const auto units = model.grad_units();
  std::vector<parallel::FloatRange> ranges;
  for (const auto& u : units) ranges.push_back(u.range);
  std::vector<int> units_in;
  auto buckets = parallel::make_buckets(ranges, bucket_floats, &units_in);
  // [unit + 1] -> its bucket, and its offset from the bucket's start.
  std::vector<int> bucket_of(static_cast<size_t>(model.config().n_layers + 2), -1);
  std::vector<int64_t> unit_offset(bucket_of.size(), 0);
  size_t b = 0;
  for (const auto& u : units) {
    while (u.range.begin >= buckets[b].end) ++b;
    bucket_of[static_cast<size_t>(u.unit + 1)] = static_cast<int>(b);
    unit_offset[static_cast<size_t>(u.unit + 1)] = u.range.begin - buckets[b].begin;
  }
  T3D_ASSERT((zero >= 2) == (model.state().grads.data() == nullptr) &&
                 (zero == 3) == (model.state().params.data() == nullptr),
             "ZeRO ", zero, ": the model's gradient / parameter regions do not fit the stage");
  auto reducer = std::make_unique<parallel::GradReducer>(
      dp, zero, std::move(buckets), std::move(units_in), model.state().grads.data(), arena);
  parallel::GradReducer* red = reducer.get();
  red->set_before_reduce([&model, red](int bucket, float* data) {
    model.sum_replicated_grads(red->buckets()[bucket], data);  // sequence parallel only
  });
  model.set_grad_source([red, bucket_of, unit_offset](int64_t unit) {
    const auto u = static_cast<size_t>(unit + 1);
    return red->bucket_grads(bucket_of[u]) + unit_offset[u];
  });
  model.set_grad_hook(
      [red, bucket_of](int64_t unit) { red->unit_done(bucket_of[static_cast<size_t>(unit + 1)]); });
  if (zero == 3)
    model.set_weight_source([red, bucket_of, unit_offset](int64_t unit) {
      const auto u = static_cast<size_t>(unit + 1);
      return red->bucket_params(bucket_of[u]) + unit_offset[u];
    });
  return reducer;
}

}  // namespace t3d::runtime
