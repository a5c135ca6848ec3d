// The schedule, the clip coefficient and the decay set against the formulas of
// docs/training-math.md, written out here again. tests/use/torch_train_step.sh checks whole steps
// end to end, but a clip epsilon of 1e-6 is below what a few trained steps can resolve: these pin
// the pieces exactly, the long schedule of a real recipe included.
#include <gtest/gtest.h>

#include <cmath>

#include "runtime/model/model_spec.h"
#include "runtime/train/training_math.h"

using namespace t3d::runtime;

namespace {

TrainConfig schedule(double lr, double min_lr, int64_t warmup, int64_t steps) {
  TrainConfig t;
  t.lr = lr, t.min_lr = min_lr, t.warmup_steps = warmup, t.steps = steps;
  return t;
}

}  // namespace

TEST(TrainingMath, LearningRateOfTheFirstAndLastStepsIsThePagesFormula) {
  // recipes/tiny.toml: lr 3e-3, min_lr 3e-4, 10 warm-up steps of 200; s counts from 0.
  const TrainConfig t = schedule(3e-3, 3e-4, 10, 200);
  for (int64_t s = 0; s < 10; ++s) EXPECT_DOUBLE_EQ(learning_rate(t, s), 3e-3 * (s + 1) / 10);
  for (int64_t s : {10, 11, 12, 100, 198, 199}) {
    const double p = (s - 10) / 190.0;  // the cosine spans steps − warmup_steps = 190 steps
    EXPECT_DOUBLE_EQ(learning_rate(t, s), 3e-4 + 0.5 * 2.7e-3 * (1 + std::cos(M_PI * p))) << s;
  }
  EXPECT_DOUBLE_EQ(learning_rate(t, 0), 3e-4);                  // the first step already moves
  EXPECT_DOUBLE_EQ(learning_rate(t, 9), learning_rate(t, 10));  // both at the peak
  EXPECT_GT(learning_rate(t, 199), 3e-4 + 1e-7);  // the last step taken is above min_lr
  EXPECT_DOUBLE_EQ(learning_rate(t, 200), 3e-4);  // the step after it would have min_lr
  EXPECT_DOUBLE_EQ(learning_rate(t, 500), 3e-4);  // and later ones too (progress clamped at 1)
}

TEST(TrainingMath, LearningRateWithoutWarmupOrWithoutCosine) {
  const TrainConfig none = schedule(1e-3, 1e-4, 0, 5);  // cosine from step 0 over 5 steps
  for (int64_t s = 0; s < 5; ++s)
    EXPECT_DOUBLE_EQ(learning_rate(none, s), 1e-4 + 0.5 * 9e-4 * (1 + std::cos(M_PI * s / 5.0)));
  const TrainConfig only = schedule(1e-3, 1e-4, 4, 4);  // all warm-up
  for (int64_t s = 0; s < 4; ++s) EXPECT_DOUBLE_EQ(learning_rate(only, s), 1e-3 * (s + 1) / 4);
}

// train.lr_decay and train.decay_steps: the page's table and its example (recipes/tiny.toml's
// lr with a 40-step linear decay), the stable phase, and constant.
TEST(TrainingMath, LearningRateDecayShapesAndTheStablePhase) {
  TrainConfig t = schedule(3e-3, 3e-4, 10, 200);
  t.lr_decay = LrDecay::kLinear, t.decay_steps = 40;
  for (int64_t s : {10, 100, 159, 160}) EXPECT_EQ(learning_rate(t, s), 3e-3) << s;  // stable
  for (int64_t s = 160; s < 200; ++s)
    EXPECT_DOUBLE_EQ(learning_rate(t, s), 3e-4 + 2.7e-3 * (1.0 - (s - 160) / 40.0)) << s;
  EXPECT_NEAR(learning_rate(t, 170), 2.325e-3, 1e-15);  // the page's example
  EXPECT_NEAR(learning_rate(t, 199), 3.675e-4, 1e-15);
  EXPECT_DOUBLE_EQ(learning_rate(t, 200), 3e-4);
  t.lr_decay = LrDecay::kSqrt;
  for (int64_t s = 160; s < 200; ++s)
    EXPECT_DOUBLE_EQ(learning_rate(t, s), 3e-4 + 2.7e-3 * (1.0 - std::sqrt((s - 160) / 40.0))) << s;
  t.lr_decay = LrDecay::kCosine;
  for (int64_t s = 160; s < 200; ++s)
    EXPECT_DOUBLE_EQ(learning_rate(t, s),
                     3e-4 + 0.5 * 2.7e-3 * (1.0 + std::cos(M_PI * (s - 160) / 40.0)))
        << s;
  // decay_steps = 0 is the default schedule, bit for bit, whatever the shape's name.
  TrainConfig whole = schedule(3e-3, 3e-4, 10, 200), spelled = whole;
  spelled.decay_steps = 190;  // = steps − warmup_steps: the same as 0
  for (int64_t s = 0; s < 210; ++s) EXPECT_EQ(learning_rate(whole, s), learning_rate(spelled, s));
  whole.lr_decay = LrDecay::kLinear;
  for (int64_t s = 10; s < 200; ++s)
    EXPECT_DOUBLE_EQ(learning_rate(whole, s), 3e-4 + 2.7e-3 * (1.0 - (s - 10) / 190.0)) << s;
  // constant: the warm-up, then lr.
  whole.lr_decay = LrDecay::kConstant;
  EXPECT_DOUBLE_EQ(learning_rate(whole, 4), 3e-3 * 5 / 10);
  for (int64_t s : {10, 150, 199, 400}) EXPECT_EQ(learning_rate(whole, s), 3e-3);
}

TEST(TrainingMath, ClipCoefficientIsClipOverNormAboveTheClipWithoutEpsilon) {
  EXPECT_EQ(clip_coefficient(1.0, 2.0), 0.5f);
  EXPECT_EQ(clip_coefficient(0.4, 1.7), static_cast<float>(0.4 / 1.7));
  EXPECT_EQ(clip_coefficient(1.0, 1.0), 1.0f);    // equal: not clipped
  EXPECT_EQ(clip_coefficient(1.0, 0.999), 1.0f);  // below: never scaled up
  EXPECT_EQ(clip_coefficient(0.0, 1e9), 1.0f);    // grad_clip = 0: off
  // No epsilon: torch's clip_grad_norm_ (clip / (norm + 1e-6)) would give 1/3 here.
  EXPECT_EQ(clip_coefficient(1e-6, 2e-6), 0.5f);
}

TEST(TrainingMath, WeightDecayAppliesToEveryTensorButTheRmsNormWeights) {
  for (bool tied : {false, true}) {
    ModelConfig m;
    m.n_layers = 2, m.n_kv_heads = m.n_heads, m.ffn_dim = 64, m.tie_embeddings = tied;
    int decayed = 0, norms = 0;
    for (const ParamInfo& p : param_table(m, {{0, 2, true, true}})) {
      const bool norm = p.name.find("norm") != std::string::npos;
      EXPECT_EQ(p.decay, !norm) << p.name;
      EXPECT_EQ(norm, p.global_shape.size() == 1) << p.name;
      decayed += p.decay, norms += norm;
    }
    EXPECT_EQ(norms, 2 * 2 + 1);  // input_layernorm, post_attention_layernorm; model.norm
    EXPECT_EQ(decayed, 1 + 7 * 2 + (tied ? 0 : 1));  // embedding, q k v o gate up down, LM head
  }
}
