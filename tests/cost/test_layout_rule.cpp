// One rule of which layouts train (runtime/recipe layout_problem): recipe validation and the
// planner's invalid_reason ask the same function, so over a grid of layouts and model shapes the
// planner accepts a recipe's own layout exactly when the recipe validates, and otherwise names
// the same key with the same words.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "kernels/check.h"
#include "runtime/cost/planner.h"

namespace t3d::runtime {
namespace {

using parallel::ScheduleKind;

struct Shape {
  const char* name;
  std::string model;  // the [model] section, without n_layers
};

// Counts of the cases where the rules used to disagree (issue 39), so the grid keeps them.
struct Seen {
  int uneven_chunks = 0;   // accepted with n_layers % (pp·virtual_stages) != 0
  int interleaved_v1 = 0;  // accepted interleaved_1f1b with virtual_stages = 1
  int ep_over_dp_cp = 0;   // accepted with dp % ep != 0 (ep divides dp·cp)
  int experts_tp = 0;      // refused: the experts' width does not split over tp
};

TEST(LayoutRule, PlannerAcceptsExactlyWhatRecipeValidationAccepts) {
  const std::string base = "[model]\nvocab_size = 256\nseq_len = 32\n";
  const Shape shapes[] = {
      {"dense", base + "dim = 64\nn_heads = 4\n"},
      {"moe: 4 experts, 2 shared", base + "dim = 64\nn_heads = 4\nn_experts = 4\n"
                                          "n_shared_experts = 2\nmoe_ffn_dim = 32\n"},
      // moe_ffn_dim 1: tp = 2 cannot split the experts (the planner priced it and then hit the
      // model's assertion).
      {"moe: width 1", base + "dim = 64\nn_heads = 4\nn_experts = 4\nmoe_ffn_dim = 1\n"},
      // dim 24, moe_ffn_dim 2: tp = 2 leaves slices of 1·24 floats, not a multiple of 16.
      {"moe: misaligned slices", base + "dim = 24\nn_heads = 2\nn_experts = 2\nmoe_ffn_dim = 2\n"},
      {"moe: auxiliary loss", base + "dim = 64\nn_heads = 4\nn_experts = 4\n"
                                     "router_aux_coef = 0.01\ndense_layers = 1\n"},
  };
  // gpipe and zb_h1 obey the rule exactly as 1f1b does.
  const ScheduleKind schedules[] = {ScheduleKind::k1F1B, ScheduleKind::kInterleaved1F1B,
                                    ScheduleKind::kZBV};
  const std::pair<int64_t, int64_t> batches[] = {{1, 4}, {2, 4}, {3, 6}};  // micro, global
  Seen seen;
  int64_t cases = 0, accepted = 0;
  std::vector<std::string> mismatches;
  for (const Shape& shape : shapes)
    for (int64_t layers : {2, 3, 4, 5}) {
      const std::string model = shape.model + "n_layers = " + std::to_string(layers) + "\n";
      const Recipe model_only = parse_recipe(model, "model.toml");
      const ModelConfig& m = model_only.model;
      for (int64_t pp : {1, 2, 3})
        for (int64_t v : {1, 2})
          for (int64_t dp : {1, 2})
            for (int64_t cp : {1, 2})
              for (int64_t tp : {1, 2})
                for (int64_t ep : {1, 2, 4})
                  for (ScheduleKind kind : schedules)
                    for (auto [micro, global] : batches) {
                      const std::string toml =
                          model + "[parallel]\npp = " + std::to_string(pp) +
                          "\ndp = " + std::to_string(dp) + "\ncp = " + std::to_string(cp) +
                          "\ntp = " + std::to_string(tp) + "\nep = " + std::to_string(ep) +
                          "\nschedule = \"" + std::string(parallel::to_string(kind)) +
                          "\"\nvirtual_stages = " + std::to_string(v) +
                          "\nzero = 1\n[train]\nglobal_batch = " + std::to_string(global) +
                          "\nmicro_batches = " + std::to_string(micro) + "\n";
                      std::string error;
                      Recipe recipe;
                      try {
                        recipe = parse_recipe(toml, "r.toml");
                      } catch (const UserError& e) {
                        error = e.what();
                      }
                      Cluster cluster;
                      cluster.devices_per_node = pp * dp * cp * tp;
                      PlanProblem p = make_problem(model_only, cluster);
                      p.global_batch = global;
                      Layout l{dp, tp, pp, micro, kind, v, 1, 0, ep};
                      l.cp = cp;
                      const std::string why = invalid_reason(p, l);
                      ++cases;
                      const auto mismatch = [&](const std::string& what) {
                        mismatches.push_back(std::string(shape.name) + ", " +
                                             std::to_string(layers) + " layers, " + l.label() +
                                             ": " + what);
                      };
                      if (error.empty()) {
                        ++accepted;
                        if (!why.empty()) mismatch("the recipe trains, the planner says " + why);
                        const std::string own = layout_of_recipe(recipe, cluster).label();
                        if (own != l.label()) mismatch("the recipe's own layout is " + own);
                        seen.uneven_chunks += layers % (pp * v) != 0;
                        seen.interleaved_v1 += kind == ScheduleKind::kInterleaved1F1B && v == 1;
                        seen.ep_over_dp_cp += dp % ep != 0;
                        continue;
                      }
                      const size_t colon = why.find(": ");
                      if (why.empty() || colon == std::string::npos) {
                        mismatch("the recipe is refused (" + error + "), the planner accepts");
                        continue;
                      }
                      // "key: reason" from the planner, "`key`: reason" in the recipe's error.
                      const std::string named =
                          "`" + why.substr(0, colon) + "`: " + why.substr(colon + 2);
                      if (error.find(named) == std::string::npos)
                        mismatch("the recipe says " + error + ", the planner " + why);
                      seen.experts_tp += m.moe() && tp > 1 && why.rfind("parallel.tp:", 0) == 0 &&
                                         why.find("moe_ffn_dim") != std::string::npos;
                    }
    }
  std::string first;
  for (size_t i = 0; i < mismatches.size() && i < 10; ++i) first += "\n" + mismatches[i];
  EXPECT_TRUE(mismatches.empty()) << mismatches.size() << " of " << cases
                                  << " layouts disagree, e.g." << first;
  EXPECT_GT(accepted, 0);
  EXPECT_LT(accepted, cases);
  EXPECT_GT(seen.uneven_chunks, 0);
  EXPECT_GT(seen.interleaved_v1, 0);
  EXPECT_GT(seen.ep_over_dp_cp, 0);
  EXPECT_GT(seen.experts_tp, 0);
}

}  // namespace
}  // namespace t3d::runtime
