// The idle-expert rule (runtime/model/expert_idle.h): a MoE layer is flagged once its experts
// were idle in kIdleExpertSteps consecutive steps, reported once per streak, and a step in which
// every expert got tokens starts the count anew.
#include <gtest/gtest.h>

#include "runtime/model/expert_idle.h"

namespace t3d::runtime {
namespace {

TEST(IdleExpertWatch, FlagsALayerAfterItsStreakOnce) {
  IdleExpertWatch watch;
  const std::vector<int64_t> layers = {1, 3};
  // Layer 1: idle experts from step 1 on. Layer 3: idle from step 2, busy at step 10, idle again.
  std::vector<std::vector<IdleExpertWatch::Flag>> reported;
  for (int64_t step = 1; step <= 40; ++step) {
    const double idle3 = step >= 2 && step != 10 ? 2.0 : 0.0;
    reported.push_back(watch.step(step, layers, {1.0, idle3}));
  }
  for (int64_t step = 1; step <= 40; ++step) {
    const auto& r = reported[static_cast<size_t>(step - 1)];
    if (step == kIdleExpertSteps) {  // layer 1, steps 1..20
      ASSERT_EQ(r.size(), 1u);
      EXPECT_EQ(r[0].layer, 1);
      EXPECT_EQ(r[0].since_step, 1);
      EXPECT_EQ(r[0].steps, kIdleExpertSteps);
    } else if (step == 10 + kIdleExpertSteps) {  // layer 3, steps 11..30
      ASSERT_EQ(r.size(), 1u);
      EXPECT_EQ(r[0].layer, 3);
      EXPECT_EQ(r[0].since_step, 11);
    } else {
      EXPECT_TRUE(r.empty()) << "step " << step;
    }
  }
  const auto flagged = watch.flagged();
  ASSERT_EQ(flagged.size(), 2u);
  EXPECT_EQ(flagged[0].steps, 40);
  EXPECT_EQ(flagged[1].steps, 30);
  const std::string text = IdleExpertWatch::describe(flagged);
  EXPECT_NE(text.find("MoE layers 1 (40 steps since step 1), 3 (30 steps since step 11)"),
            std::string::npos)
      << text;
  // A busy step clears a layer's flag.
  watch.step(41, layers, {0.0, 1.0});
  ASSERT_EQ(watch.flagged().size(), 1u);
  EXPECT_EQ(watch.flagged()[0].layer, 3);
}

TEST(IdleExpertWatch, FieldNamesNameTheLayer) {
  EXPECT_EQ(imbalance_field(7), "expert_imbalance_layer_7");
  EXPECT_EQ(idle_field(0), "idle_experts_layer_0");
}

}  // namespace
}  // namespace t3d::runtime
