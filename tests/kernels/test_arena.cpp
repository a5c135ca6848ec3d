// Suite names carry a lowercase "kernels" so that `ctest -R kernels` selects them
// (t3d_add_gtest sets no TEST_PREFIX).
#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "kernels/arena.h"
#include "kernels/check.h"

namespace t3d::kernels {
namespace {

TEST(kernels_arena, AllocationsAre64ByteAlignedAndCounted) {
  Arena arena(1 << 20);
  EXPECT_EQ(arena.capacity(), 1u << 20);
  const auto* first = static_cast<const char*>(arena.alloc_bytes("t", 1));
  std::size_t offset = kAlignment;
  for (std::size_t bytes : {3u, 64u, 65u, 1000u}) {
    void* p = arena.alloc_bytes("t", bytes);
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(p) % kAlignment, 0u) << bytes;
    EXPECT_EQ(static_cast<const char*>(p), first + offset) << bytes;  // bump allocation
    offset += (bytes + kAlignment - 1) / kAlignment * kAlignment;
  }
  // 1, 3 and 64 bytes take one line each, 65 two, 1000 sixteen.
  EXPECT_EQ(arena.used(), (1 + 1 + 1 + 2 + 16) * kAlignment);
  EXPECT_EQ(arena.available(), arena.capacity() - arena.used());
}

TEST(kernels_arena, PeakFollowsUseAndResets) {
  Arena arena(1 << 20);
  arena.alloc_floats("parameters", 1000);
  arena.alloc_floats("act.a", 4096);
  EXPECT_EQ(arena.peak(), arena.used());
  EXPECT_EQ(arena.used(), (1000 * sizeof(float) + kAlignment - 1) / kAlignment * kAlignment +
                              4096 * sizeof(float));
  arena.reset_peak();
  EXPECT_EQ(arena.peak(), arena.used());
}

TEST(kernels_arena, OutOfMemoryNamesTensorBytesAndFix) {
  Arena arena(4096);
  arena.alloc_bytes("model.embed_tokens.weight", 3000);  // rounds to 3008
  try {
    arena.alloc_bytes("model.layers.0.mlp.up_proj.weight", 2000);
    FAIL() << "expected UserError";
  } catch (const UserError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("model.layers.0.mlp.up_proj.weight"), std::string::npos) << msg;
    EXPECT_NE(msg.find("2000 bytes"), std::string::npos) << msg;  // asked
    EXPECT_NE(msg.find("1088 bytes"), std::string::npos) << msg;  // left: 4096 - 3008
    EXPECT_NE(msg.find("hardware.hbm_gib"), std::string::npos) << msg;
    EXPECT_NE(msg.find("model.embed_tokens.weight"), std::string::npos) << msg;  // holder
  }
  EXPECT_EQ(arena.used(), 3008u);  // a failed allocation takes nothing
}

TEST(kernels_arena, LargeBudgetIsReservedNotCommitted) {
  // 64 GiB of address space on a 24 GiB machine: fine as long as it is not touched.
  Arena arena(std::size_t{64} << 30);
  float* p = arena.alloc_floats("x", 16);
  p[0] = 1.0f;
  EXPECT_EQ(p[0], 1.0f);
}

std::vector<TensorSpec> tiny_table() {
  return {{"model.embed_tokens.weight", {10, 4}},
          {"model.layers.0.input_layernorm.weight", {4}},
          {"model.layers.0.self_attn.q_proj.weight", {4, 4}},
          {"model.norm.weight", {4}}};
}

TEST(kernels_param_layout, OffsetsAreAlignedInTableOrder) {
  ParamLayout layout(tiny_table());
  ASSERT_EQ(layout.entries().size(), 4u);
  EXPECT_EQ(layout.at("model.embed_tokens.weight").offset, 0);
  EXPECT_EQ(layout.at("model.layers.0.input_layernorm.weight").offset, 48);  // 40 -> 48
  EXPECT_EQ(layout.at("model.layers.0.self_attn.q_proj.weight").offset, 64);
  EXPECT_EQ(layout.at("model.norm.weight").offset, 80);
  EXPECT_EQ(layout.total_floats(), 96);
  EXPECT_EQ(layout.total_params(), 40 + 4 + 16 + 4);
  for (const auto& e : layout.entries()) EXPECT_EQ(e.offset % kAlignmentFloats, 0);
}

TEST(kernels_param_layout, UnknownAndDuplicateNamesAreUserErrors) {
  ParamLayout layout(tiny_table());
  EXPECT_FALSE(layout.contains("lm_head.weight"));
  try {
    layout.at("lm_head.weight");
    FAIL();
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("lm_head.weight"), std::string::npos);
  }
  auto dup = tiny_table();
  dup.push_back(dup[0]);
  EXPECT_THROW(ParamLayout{dup}, UserError);
  EXPECT_THROW(ParamLayout({{"w", {3, 0}}}), UserError);
}

TEST(kernels_model_state, FourContiguousZeroedRegionsWithNamedViews) {
  ParamLayout layout(tiny_table());
  Arena arena(1 << 20);
  ModelState st = ModelState::allocate(arena, layout, /*with_optimizer=*/true);
  for (const Region* r : {&st.params, &st.grads, &st.adam_m, &st.adam_v}) {
    ASSERT_EQ(r->size(), 96);
    for (std::int64_t i = 0; i < r->size(); ++i) ASSERT_EQ(r->data()[i], 0.0f);
  }
  auto q = st.params.view("model.layers.0.self_attn.q_proj.weight");
  EXPECT_EQ(q.data, st.params.data() + 64);
  EXPECT_EQ(q.numel, 16);
  EXPECT_EQ(q.dim(0), 4);
  auto g = st.grads.view("model.layers.0.self_attn.q_proj.weight");
  EXPECT_EQ(g.data - st.grads.data(), q.data - st.params.data());
  EXPECT_EQ(arena.used(), 4 * 96 * sizeof(float));
  // Without optimizer state only two regions are taken.
  Arena small(1 << 20);
  ModelState inf = ModelState::allocate(small, layout, false);
  EXPECT_EQ(inf.adam_m.data(), nullptr);
  EXPECT_EQ(small.used(), 2 * 96 * sizeof(float));
}

}  // namespace
}  // namespace t3d::kernels
