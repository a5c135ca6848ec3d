// ShardedState on 2 data-parallel ranks, every ZeRO stage against ZeRO 0 (which keeps everything
// on every rank): what each rank owns, what it allocates against what it reports, initialisation
// and one AdamW step through its pieces.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cmath>
#include <vector>

#include "kernels/arena.h"
#include "parallel/comm.h"
#include "parallel/zero.h"
#include "runtime/model/model.h"
#include "runtime/train/sharded_state.h"
#include "tests/train/small_model.h"

namespace t3d::runtime {
namespace {

constexpr uint64_t kSeed = 7;
constexpr double kBucketMb = kSmallModelBucketMb;

// One rank's model and state under ZeRO `zero`, data-parallel over `dp`.
struct Rank {
  kernels::Arena arena{size_t{64} << 20};
  std::unique_ptr<Model> model;
  size_t model_bytes = 0;  // the arena after the model: its regions, activations, scratch
  std::unique_ptr<TrainingState> training;
  ShardedState* state = nullptr;  // the dense model's only group

  Rank(const parallel::Comm& dp, const parallel::Comm& tp, int zero) {
    ModelOptions o;
    const parallel::FullRegions full = parallel::full_regions(zero);
    o.param_region = full.params, o.grad_region = full.grads, o.with_optimizer = full.moments;
    model = std::make_unique<Model>(
        small_model(), std::vector<parallel::LayerRange>{{0, 3, true, true}}, tp, arena, o);
    model_bytes = arena.used();
    training = std::make_unique<TrainingState>(*model, dp, dp, zero, kBucketMb, arena);
    training->init(kSeed);
    state = &training->dense();
  }
};

// Gradients that depend only on the element's place in the region (the same on every rank).
float fake_grad(int64_t i) { return 0.01f * static_cast<float>((i * 37) % 101 - 50); }

class ShardedStateTest : public ::testing::Test {
 protected:
  parallel::Comm world = parallel::Comm::world(60.0);
  parallel::Comm alone = world.split(world.rank(), 0, "alone");
};

TEST_F(ShardedStateTest, EveryParameterIsOwnedByExactlyOneRank) {
  ASSERT_EQ(world.size(), 2);
  for (int zero : {0, 1, 2, 3}) {
    SCOPED_TRACE("ZeRO " + std::to_string(zero));
    Rank r(world, alone, zero);
    const auto floats = static_cast<size_t>(r.model->layout().total_floats());
    std::vector<int> owners(floats, 0);
    for (const auto& range : r.state->partition())
      for (int64_t i = range.begin; i < range.end; ++i) ++owners[static_cast<size_t>(i)];
    world.all_reduce(owners.data(), owners.size());
    for (const auto& u : r.model->grad_units())
      for (int64_t i = u.range.begin; i < u.range.end; ++i)
        ASSERT_EQ(owners[static_cast<size_t>(i)], 1) << "float " << i;
    // The optimizer updates everything with ZeRO 0, this rank's partition otherwise.
    int64_t owned = 0, part = 0;
    for (const auto& range : r.state->owned()) owned += range.size();
    for (const auto& range : r.state->partition()) part += range.size();
    if (zero == 0)
      EXPECT_GT(owned, part);
    else
      EXPECT_EQ(owned, part);
  }
}

TEST_F(ShardedStateTest, FootprintIsWhatItAllocates) {
  parallel::StateBytes unsharded;
  for (int zero : {0, 1, 2, 3}) {
    SCOPED_TRACE("ZeRO " + std::to_string(zero));
    Rank r(world, alone, zero);
    const auto& f = r.model->footprint();
    const parallel::StateBytes kept = r.state->footprint();
    // Beside the model's regions, the state allocated exactly its shards, buffers and moments.
    EXPECT_EQ(kept.total() - static_cast<double>(f.params + f.grads + f.optimizer),
              static_cast<double>(r.arena.used() - r.model_bytes));
    if (zero == 0) unsharded = kept;
    // The moments of half the region (uneven slices: within a bucket's rounding).
    if (zero >= 1) EXPECT_LT(kept.optimizer, 0.6 * unsharded.optimizer);
    EXPECT_EQ(f.grads == 0, zero >= 2);  // the gradient region is replaced by the shard
    EXPECT_EQ(f.params == 0, zero == 3);
  }
}

// Initialisation and one AdamW step give every stage ZeRO 0's parameters, element by element.
TEST_F(ShardedStateTest, EveryStageStepsLikeZeroZero) {
  Rank full(world, alone, 0);
  const float* init = full.model->state().params.data();
  const std::vector<float> initial(init, init + full.model->layout().total_floats());
  TrainConfig t;
  const auto fill_grads = [](ShardedState& s) {
    s.for_each_piece(s.owned(), [&](const ShardedState::Piece& p) {
      float* g = s.grads(p);
      for (int64_t k = 0; k < p.size(); ++k) g[k] = fake_grad(p.lo + k);
    });
  };
  fill_grads(*full.state);
  full.state->adamw_step(t, 1e-2, 1, 0.5f);
  const float* stepped = full.model->state().params.data();
  for (int zero : {1, 2, 3}) {
    SCOPED_TRACE("ZeRO " + std::to_string(zero));
    Rank r(world, alone, zero);
    const auto expect_params = [&](const float* want) {
      r.state->for_each_piece(r.state->owned(), [&](const ShardedState::Piece& p) {
        const float* got = r.state->params(p);
        for (int64_t k = 0; k < p.size(); ++k)
          ASSERT_EQ(got[k], want[p.lo + k]) << "float " << p.lo + k;
      });
    };
    expect_params(initial.data());
    fill_grads(*r.state);
    r.state->adamw_step(t, 1e-2, 1, 0.5f);
    expect_params(stepped);
    if (zero < 3) {  // the updated slices were gathered: every rank holds the whole region
      const float* region = r.model->state().params.data();
      for (int64_t i = 0; i < r.model->layout().total_floats(); ++i)
        ASSERT_EQ(region[i], stepped[i]) << "float " << i;
    } else {  // ZeRO 3: a bucket gathered for the model is the updated region
      const auto& bucket = r.state->reducer().buckets().front();
      const float* got = r.state->reducer().bucket_params(0);
      for (int64_t i = bucket.begin; i < bucket.end; ++i)
        ASSERT_EQ(got[i - bucket.begin], stepped[i]) << "float " << i;
    }
  }
}

}  // namespace
}  // namespace t3d::runtime
