#include "parallel/grad_reducer.h"

#include <cstring>

#include "kernels/check.h"
#include "parallel/fault.h"
#include "parallel/trace.h"

namespace t3d::parallel {

GradReducer::GradReducer(const Comm& dp, int zero_stage, std::vector<FloatRange> buckets)
    : dp_(dp), zero_(zero_stage), buckets_(std::move(buckets)) {
  T3D_ASSERT(zero_ >= 0 && zero_ <= 2, "ZeRO stage ", zero_, " is not implemented");
  const int n = dp_.size(), me = dp_.rank();
  for (const auto& b : buckets_) {
    std::vector<int> counts(n), displs(n);
    for (int d = 0; d < n; ++d) {
      const int64_t lo = b.size() * d / n, hi = b.size() * (d + 1) / n;
      displs[d] = static_cast<int>(lo);
      counts[d] = static_cast<int>(hi - lo);
    }
    partition_.push_back({b.begin + displs[me], b.begin + displs[me] + counts[me]});
    counts_.push_back(std::move(counts));
    displs_.push_back(std::move(displs));
  }
  requests_.assign(buckets_.size(), MPI_REQUEST_NULL);
  started_.assign(buckets_.size(), 0);
}

GradReducer::~GradReducer() {
  for (auto& r : requests_)
    if (r != MPI_REQUEST_NULL) MPI_Request_free(&r);
}

int64_t GradReducer::owned_floats() const {
  int64_t n = 0;
  for (const auto& r : owned()) n += r.size();
  return n;
}

void GradReducer::ready(int b, float* grads) {
  T3D_ASSERT(!started_.at(b), "bucket ", b, " made ready twice in one step");
  started_[b] = 1;
  if (dp_.size() == 1) return;
  // Through the same test-only fault switch and trace spans as Comm's own collectives.
  if (fault::skip_operation(dp_.name(), dp_.world_ranks()[dp_.rank()])) return;
  trace::Span span(zero_ < 2 ? "all_reduce (gradient bucket)" : "reduce_scatter (gradient bucket)",
                   "comm");
  span.arg("group", dp_.name()).arg("bytes", buckets_[b].size() * 4).arg("bucket", b);
  float* data = grads + buckets_[b].begin;
  dp_.count_bytes(static_cast<uint64_t>(buckets_[b].size()) * sizeof(float));
  if (zero_ < 2) {
    T3D_MPI(MPI_Iallreduce(MPI_IN_PLACE, data, static_cast<int>(buckets_[b].size()), MPI_FLOAT,
                           MPI_SUM, dp_.handle(), &requests_[b]));
  } else {
    // In place: the input is the whole bucket; this rank's reduced slice lands at its start.
    T3D_MPI(MPI_Ireduce_scatter(MPI_IN_PLACE, data, counts_[b].data(), MPI_FLOAT, MPI_SUM,
                                dp_.handle(), &requests_[b]));
  }
}

void GradReducer::progress() {
  for (auto& r : requests_) {
    if (r == MPI_REQUEST_NULL) continue;
    int done = 0;
    T3D_MPI(MPI_Test(&r, &done, MPI_STATUS_IGNORE));
  }
}

void GradReducer::finish(float* grads) {
  for (size_t b = 0; b < buckets_.size(); ++b) {
    T3D_ASSERT(started_[b], "bucket ", b, " was never made ready: a layer's gradients are missing");
    started_[b] = 0;
    if (requests_[b] == MPI_REQUEST_NULL) continue;
    dp_.wait(requests_[b], zero_ < 2 ? "gradient all_reduce" : "gradient reduce_scatter");
    if (zero_ == 2) {
      float* bucket = grads + buckets_[b].begin;
      std::memmove(bucket + displs_[b][dp_.rank()], bucket,
                   sizeof(float) * static_cast<size_t>(counts_[b][dp_.rank()]));
    }
  }
}

void GradReducer::gather_params(float* params) {
  if (zero_ == 0 || dp_.size() == 1) return;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    dp_.count_bytes(static_cast<uint64_t>(counts_[b][dp_.rank()]) * sizeof(float));
    T3D_MPI(MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_FLOAT, params + buckets_[b].begin,
                            counts_[b].data(), displs_[b].data(), MPI_FLOAT, dp_.handle(),
                            &requests_[b]));
  }
  for (auto& r : requests_) dp_.wait(r, "parameter all_gather (ZeRO)");
}

}  // namespace t3d::parallel
