// Cross-entropy (fused and vocab-parallel pieces), AdamW, gradient-norm pieces, bf16 conversion.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <thread>
#include <utility>
#include <vector>

#include "kernels/arena.h"
#include "kernels/blas.h"
#include "kernels/check.h"
#include "kernels/device.h"
#include "kernels/hash.h"
#include "kernels/ops.h"
#include "kernels/precision.h"
#include "kernels/xxh3_words.h"
#include "reference.h"

namespace t3d::kernels {
namespace {

using ref::Vec;

constexpr int kN = 5, kV = 11;
const std::vector<std::int32_t> kTargets = {3, 0, kIgnoreIndex, 10, 7};

// Tolerance: losses 1e-5 relative; gradients 1e-4 relative + 1e-6 absolute.
// The scalars the step reads back and the plain copy, against loops written here.
TEST(StepScalars, CountSumAndCopyAreTheirDefinitions) {
  auto x = ref::random_floats(1001, 50, -3, 3);
  x[7] = std::numeric_limits<float>::quiet_NaN();
  x[500] = std::numeric_limits<float>::infinity();
  x[1000] = -std::numeric_limits<float>::infinity();
  EXPECT_EQ(count_nonfinite(kCpu, x.data(), 1001), 3);
  EXPECT_EQ(count_nonfinite(kCpu, x.data(), 7), 0);
  double s = 0.0;  // in index order, in double: a reordered sum would differ in the last bits
  for (int i = 0; i < 500; ++i) s += x[i + 8];
  double got = -1;  // sum_in_order_into's double of the Exec's memory: host memory here
  sum_in_order_into(kCpu, &got, x.data() + 8, 500);
  EXPECT_EQ(std::memcmp(&got, &s, sizeof s), 0);
  sum_in_order_into(kCpu, &got, x.data(), 0);
  EXPECT_EQ(got, 0.0) << "an empty sum";
  std::vector<float> y(1001, 0.0f);
  copy(kCpu, y.data(), x.data() + 8, 400);
  EXPECT_EQ(std::memcmp(y.data(), x.data() + 8, 400 * sizeof(float)), 0);
  EXPECT_EQ(y[400], 0.0f);
}

// flip_bit toggles exactly the one bit of the one element, and twice restores the bits.
TEST(StepScalars, FlipBitTogglesOneBitOfOneElement) {
  auto x = ref::random_floats(64, 52, -3, 3);
  const auto before = x;
  flip_bit(kCpu, x.data(), 17, 22);
  for (int i = 0; i < 64; ++i) {
    std::uint32_t a = 0, b = 0;
    std::memcpy(&a, &before[i], 4);
    std::memcpy(&b, &x[i], 4);
    ASSERT_EQ(a ^ b, i == 17 ? (1u << 22) : 0u) << i;
  }
  EXPECT_TRUE(std::isfinite(x[17]));
  EXPECT_NE(x[17], before[17]);
  flip_bit(kCpu, x.data(), 17, 22);
  EXPECT_EQ(std::memcmp(x.data(), before.data(), x.size() * sizeof(float)), 0);
  flip_bit(kCpu, x.data(), 0, 31);  // the sign
  EXPECT_EQ(x[0], -before[0]);
  EXPECT_THROW(flip_bit(kCpu, x.data(), 0, 32), InternalError);
}

// The casts with an Exec are precision.h's rounding and widening; the host crossings move the bytes
// and nothing around them; a Buffer grows zeroed and keeps its size when asked for less.
TEST(StepScalars, CastsCrossingsAndBuffersAreTheirDefinitions) {
  auto x = ref::random_floats(777, 51, -3, 3);
  x[3] = std::numeric_limits<float>::quiet_NaN();
  std::vector<bf16> h(777), want(777);
  for (int i = 0; i < 777; ++i) want[i] = float_to_bf16(x[i]);
  float_to_bf16(kCpu, h.data(), x.data(), 777);
  EXPECT_EQ(std::memcmp(h.data(), want.data(), h.size() * sizeof(bf16)), 0);
  std::vector<float> back(777);
  bf16_to_float(kCpu, back.data(), h.data(), 777);
  for (int i = 0; i < 777; ++i) {
    const float widened = bf16_to_float(h[i]);
    ASSERT_EQ(std::memcmp(&back[i], &widened, sizeof widened), 0) << i;
  }
  std::vector<float> y(10, -1.0f);
  copy_from_host(kCpu, y.data() + 1, x.data(), 8 * sizeof(float));
  copy_to_host(kCpu, y.data() + 9, x.data() + 8, sizeof(float));
  EXPECT_EQ(y[0], -1.0f);
  EXPECT_EQ(std::memcmp(y.data() + 1, x.data(), 8 * sizeof(float)), 0);
  EXPECT_EQ(y[9], x[8]);
  {
    const PinnedHostRegion pinned(kCpu, y.data(), y.size() * sizeof(float));  // nothing on a CPU
    copy_to_host_started(kCpu, y.data() + 2, x.data() + 100, 3 * sizeof(float));
    wait_for_copies(kCpu);
  }
  EXPECT_EQ(std::memcmp(y.data() + 2, x.data() + 100, 3 * sizeof(float)), 0);
  EXPECT_EQ(y[0], -1.0f);
  Buffer buffer;
  EXPECT_EQ(buffer.bytes(), 0u);
  buffer.reserve(kCpu, 100, "test");
  ASSERT_NE(buffer.as<char>(), nullptr);
  for (int i = 0; i < 100; ++i) ASSERT_EQ(buffer.as<char>()[i], 0);
  float* first = buffer.as<float>();
  buffer.reserve(kCpu, 40, "test");  // smaller: the same memory
  EXPECT_EQ(buffer.as<float>(), first);
  buffer.reserve(kCpu, 4000, "test");
  EXPECT_EQ(buffer.bytes(), 4000u);
  for (int i = 0; i < 1000; ++i) ASSERT_EQ(buffer.as<float>()[i], 0.0f);
  // A move takes the memory along (the executor's buffers live in growing vectors).
  buffer.as<float>()[7] = 7.0f;
  float* memory = buffer.as<float>();
  Buffer moved(std::move(buffer));
  EXPECT_EQ(buffer.bytes(), 0u);
  EXPECT_EQ(buffer.as<float>(), nullptr);
  EXPECT_EQ(moved.as<float>(), memory);
  EXPECT_EQ(moved.as<float>()[7], 7.0f);
  Buffer assigned;
  assigned.reserve(kCpu, 16, "test (replaced)");
  assigned = std::move(moved);
  EXPECT_EQ(assigned.as<float>(), memory);
  EXPECT_EQ(assigned.bytes(), 4000u);
  EXPECT_EQ(moved.as<float>(), nullptr);
}

// host_waits counts each call that makes the host wait for the Exec (once a call: the ranges of
// sum_of_squares_each are one wait), and no op that stays in the Exec's memory: neither a small
// upload (staged on a GPU) nor a sum kept there. Per thread.
TEST(StepScalars, HostWaitsCountTheCallsThatWaitOnce) {
  auto x = ref::random_floats(100, 52, -1, 1);
  std::vector<float> y(100);
  std::int64_t waits = host_waits();
  const auto waited = [&](const char* what) {
    const std::int64_t now = host_waits();
    EXPECT_EQ(now - waits, 1) << what;
    waits = now;
  };
  copy_from_host(kCpu, y.data(), x.data(), 10 * sizeof(float));
  EXPECT_EQ(host_waits(), waits) << "a small upload";
  std::vector<unsigned char> big(kUnwaitedUploadBytes + 1, 7), big_copy(big.size());
  copy_from_host(kCpu, big_copy.data(), big.data(), kUnwaitedUploadBytes);
  EXPECT_EQ(host_waits(), waits) << "an upload of kUnwaitedUploadBytes";
  copy_from_host(kCpu, big_copy.data(), big.data(), big.size());
  waited("copy_from_host of more than kUnwaitedUploadBytes");
  EXPECT_EQ(big_copy, big);
  double kept = 0;
  sum_in_order_into(kCpu, &kept, x.data(), 100);
  EXPECT_EQ(host_waits(), waits) << "sum_in_order_into";
  copy_to_host(kCpu, y.data(), x.data(), 10 * sizeof(float));
  waited("copy_to_host");
  sum_of_squares(kCpu, x.data(), 100);
  waited("sum_of_squares");
  const float* ranges[3] = {x.data(), x.data() + 10, x.data() + 50};
  const std::int64_t sizes[3] = {10, 40, 50};
  double sums[3];
  sum_of_squares_each(kCpu, sums, ranges, sizes, 3);
  waited("sum_of_squares_each");
  count_nonfinite(kCpu, x.data(), 100);
  waited("count_nonfinite");
  Hash64Stream h;
  hash_floats(kCpu, h, x.data(), 100);
  waited("hash_floats");
  copy_to_host_started(kCpu, y.data(), x.data(), 10 * sizeof(float));  // started: no wait
  EXPECT_EQ(host_waits(), waits);
  wait_for_copies(kCpu);
  waited("wait_for_copies");
  add(kCpu, y.data(), x.data(), x.data(), 100);
  zero(kCpu, y.data(), 100);
  copy(kCpu, y.data(), x.data(), 100);
  EXPECT_EQ(host_waits(), waits) << "ops within the Exec's memory";
  std::thread([] { wait_for_copies(kCpu); }).join();
  EXPECT_EQ(host_waits(), waits) << "another thread's wait";
}

// hash64_xxh3 is XXH3's 64-bit hash with seed 0: xxHash's published value of the empty input, and
// the value of "abc" that Debian's libxxhash.so gives (the inlined header must agree with it).
TEST(StepScalars, Hash64Xxh3IsXxh3) {
  EXPECT_EQ(hash64_xxh3("", 0), 0x2D06800538D394C2ull);
  EXPECT_EQ(hash64_xxh3("abc", 3), 0x78AF5F94892F3950ull);
  EXPECT_NE(hash64_xxh3("abd", 3), hash64_xxh3("abc", 3));
}

// The GPU's XXH3 (kernels/xxh3_words.h, plain arithmetic) equals libxxhash's on every length path:
// 0, 4-16, 17-128, 129-240 bytes, and longer ones around the 1 KiB blocks and 64-byte stripes, up
// to a whole 1 MiB piece.
TEST(StepScalars, Xxh3WordsIsLibxxhash) {
  const unsigned char secret[] = T3D_XXH3_SECRET;
  static_assert(sizeof secret == xxh3::kSecretBytes);
  std::vector<std::uint32_t> w(std::size_t{1} << 18);
  std::uint64_t state = 5;
  for (auto& x : w) x = static_cast<std::uint32_t>(state = splitmix64(state));
  std::vector<std::int64_t> lengths;
  for (std::int64_t n = 0; n <= 300; ++n) lengths.push_back(n);
  for (std::int64_t n : {511, 512, 513, 767, 1023, 1024, 1025, 4096 + 17, 65536, 262143, 262144})
    lengths.push_back(n);
  const bool avx2 = detect_cpu_features().avx2;
  for (std::int64_t n : lengths) {
    const std::size_t bytes = 4 * static_cast<std::size_t>(n);
    const std::uint64_t want = xxh3::hash_words(w.data(), n, secret);
    ASSERT_EQ(hash64_xxh3_baseline(w.data(), bytes), want) << n << " words (SSE2 build)";
    if (avx2) ASSERT_EQ(hash64_xxh3_avx2(w.data(), bytes), want) << n << " words (AVX2)";
    ASSERT_EQ(hash64_xxh3(w.data(), bytes), want) << n << " words";
  }
}

// hash_floats is its definition (hash64_xxh3 of each 1 MiB piece, streamed in order), whatever the
// rank's threads, and a flipped bit anywhere changes it.
TEST(StepScalars, HashFloatsStreamsThePiecesHashesInOrder) {
  const std::int64_t n = (std::int64_t{1} << 18) * 3 + 1000;  // three whole pieces and a part
  auto x = ref::random_floats(static_cast<int>(n), 61, -3, 3);
  Hash64Stream want;
  for (std::int64_t at = 0; at < n; at += std::int64_t{1} << 18) {
    const std::uint64_t piece = hash64_xxh3(
        x.data() + at, sizeof(float) * std::min<std::int64_t>(std::int64_t{1} << 18, n - at));
    want.update(&piece, sizeof piece);
  }
  const int threads = blas_threads();
  for (int t : {1, 2}) {
    set_blas_threads(t);
    Hash64Stream got;
    hash_floats(kCpu, got, x.data(), n);
    EXPECT_EQ(got.value(), want.value()) << t << " thread(s)";
  }
  set_blas_threads(threads);
  std::uint32_t word;
  std::memcpy(&word, &x[n - 7], sizeof word);
  word ^= 1u << 3;
  std::memcpy(&x[n - 7], &word, sizeof word);
  Hash64Stream flipped;
  hash_floats(kCpu, flipped, x.data(), n);
  EXPECT_NE(flipped.value(), want.value());
}

TEST(kernels_cross_entropy, FusedLossAndGradient) {
  auto logits = ref::random_floats(kN * kV, 70, -4, 4);
  const Vec ld = ref::to_double(logits);
  const float grad_scale = 1.0f / 4;  // 4 non-ignored targets: mean loss
  std::vector<float> losses(kN, 99.0f);
  cross_entropy_fused(kCpu, logits.data(), losses.data(), kTargets.data(), kN, kV, grad_scale);
  ref::expect_close(losses, ref::cross_entropy(ld, kTargets, kN, kV), 1e-5, 1e-6, "losses");
  // dlogits = d(grad_scale * sum(losses)) / dlogits; the ignored row is all zeros.
  const Vec r(kN, grad_scale);
  ref::expect_close(
      logits,
      ref::numeric_grad([&](const Vec& x) { return ref::cross_entropy(x, kTargets, kN, kV); }, ld,
                        r),
      1e-4, 1e-6, "dlogits");
}

TEST(kernels_cross_entropy, StableForLargeLogits) {
  std::vector<float> logits = {1000.0f, 0.0f, -1000.0f};
  const std::int32_t t = 1;
  float loss = 0;
  cross_entropy_fused(kCpu, logits.data(), &loss, &t, 1, 3, 1.0f);
  EXPECT_FLOAT_EQ(loss, 1000.0f);
  EXPECT_FLOAT_EQ(logits[0], 1.0f);
  EXPECT_FLOAT_EQ(logits[1], -1.0f);
  EXPECT_EQ(logits[2], 0.0f);
}

TEST(kernels_cross_entropy, OutOfRangeTargetIsUserError) {
  std::vector<float> logits(4, 0.0f);
  const std::int32_t t = 4;
  float loss;
  EXPECT_THROW(cross_entropy_fused(kCpu, logits.data(), &loss, &t, 1, 4, 1.0f), UserError);
}

// Two "ranks" holding vocab columns [0, 6) and [6, 11): the pieces plus hand-made all-reduces
// must give the fused result (loss on every rank, gradient columns on their owners).
TEST(kernels_cross_entropy, VocabParallelPiecesComposeToFused) {
  const auto logits = ref::random_floats(kN * kV, 71, -4, 4);
  const float grad_scale = 0.25f;
  std::vector<float> fused = logits, fused_loss(kN);
  cross_entropy_fused(kCpu, fused.data(), fused_loss.data(), kTargets.data(), kN, kV, grad_scale);

  const int split = 6, widths[2] = {split, kV - split}, starts[2] = {0, split};
  std::vector<float> shard[2];
  for (int r = 0; r < 2; ++r)
    for (int i = 0; i < kN; ++i)
      shard[r].insert(shard[r].end(), logits.begin() + i * kV + starts[r],
                      logits.begin() + i * kV + starts[r] + widths[r]);
  std::vector<float> part[2] = {std::vector<float>(kN), std::vector<float>(kN)};
  std::vector<float> row_max(kN), sum_exp(kN, 0.0f), target(kN, 0.0f);
  for (int r = 0; r < 2; ++r) ce_local_max(kCpu, part[r].data(), shard[r].data(), kN, widths[r]);
  for (int i = 0; i < kN; ++i) row_max[i] = std::max(part[0][i], part[1][i]);  // all-reduce MAX
  for (int r = 0; r < 2; ++r) {
    ce_local_sum_exp(kCpu, part[r].data(), shard[r].data(), row_max.data(), kN, widths[r]);
    for (int i = 0; i < kN; ++i) sum_exp[i] += part[r][i];  // all-reduce SUM
  }
  for (int r = 0; r < 2; ++r) {
    ce_local_target_logit(kCpu, part[r].data(), shard[r].data(), kTargets.data(), kN, widths[r],
                          starts[r]);
    for (int i = 0; i < kN; ++i) target[i] += part[r][i];  // all-reduce SUM
  }
  for (int r = 0; r < 2; ++r) {
    std::vector<float> loss(kN);
    ce_loss_and_grad(kCpu, shard[r].data(), loss.data(), kTargets.data(), row_max.data(),
                     sum_exp.data(), target.data(), kN, widths[r], starts[r], grad_scale);
    ref::expect_close(loss, Vec(fused_loss.begin(), fused_loss.end()), 1e-6, 1e-6, "loss");
    for (int i = 0; i < kN; ++i)
      for (int j = 0; j < widths[r]; ++j)
        EXPECT_NEAR(shard[r][i * widths[r] + j], fused[i * kV + starts[r] + j], 1e-7)
            << "rank " << r << " row " << i << " col " << j;
  }
}

// AdamW against the formula written out by hand in double, several steps, with weight decay.
TEST(kernels_adamw, MatchesHandDerivedStepsWithDecoupledDecay) {
  const int n = 37, steps = 5;
  AdamWConfig cfg{1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f};
  auto p = ref::random_floats(n, 80);
  std::vector<float> m(n, 0.0f), v(n, 0.0f);
  Vec pe = ref::to_double(p), me(n, 0.0), ve(n, 0.0);
  for (int t = 1; t <= steps; ++t) {
    const auto g = ref::random_floats(n, 81 + t);
    adamw_step(kCpu, p.data(), g.data(), m.data(), v.data(), n, cfg, t);
    for (int i = 0; i < n; ++i) {
      pe[i] *= 1.0 - 1e-2 * 0.1;  // decoupled decay, applied before the update (as torch)
      me[i] = 0.9 * me[i] + 0.1 * g[i];
      ve[i] = 0.95 * ve[i] + 0.05 * (double)g[i] * g[i];
      const double mhat = me[i] / (1 - std::pow(0.9, t)), vhat = ve[i] / (1 - std::pow(0.95, t));
      pe[i] -= 1e-2 * mhat / (std::sqrt(vhat) + 1e-8);
    }
    ref::expect_close(p, pe, 1e-5, 1e-6, "params");
    ref::expect_close(m, me, 1e-5, 1e-7, "m");
    ref::expect_close(v, ve, 1e-5, 1e-8, "v");
  }
}

// adamw_step_many: each range the bits of its own adamw_step call (its own settings), empty ones
// untouched.
TEST(kernels_adamw, ManyRangesAreOneCallEach) {
  const std::int64_t sizes[] = {1003, 0, 17, 4096};
  std::vector<std::vector<float>> p, g, m, v;
  for (std::int64_t n : sizes) {
    p.push_back(ref::random_floats(n, 40 + n));
    g.push_back(ref::random_floats(n, 50 + n));
    m.push_back(ref::random_floats(n, 60 + n, -1e-3f, 1e-3f));
    v.push_back(ref::random_floats(n, 70 + n, 0.0f, 1e-4f));
  }
  auto p1 = p, m1 = m, v1 = v;
  std::vector<AdamWTensor> tensors;
  for (std::size_t j = 0; j < p.size(); ++j) {
    AdamWConfig cfg{1e-3f * (j + 1), 0.9f, 0.95f, 1e-8f, j % 2 ? 0.0f : 0.1f, 0.5f + j};
    tensors.push_back({p[j].data(), g[j].data(), m[j].data(), v[j].data(), sizes[j], cfg});
    adamw_step(kCpu, p1[j].data(), g[j].data(), m1[j].data(), v1[j].data(), sizes[j], cfg, 3);
  }
  adamw_step_many(kCpu, tensors.data(), static_cast<std::int64_t>(tensors.size()), 3);
  EXPECT_EQ(p, p1);
  EXPECT_EQ(m, m1);
  EXPECT_EQ(v, v1);
}

TEST(kernels_adamw, FirstStepMovesEachParameterByLrAgainstTheGradientSign) {
  // Bias correction makes step 1 exactly p -= lr * g / (|g| + eps): a classic sanity check.
  std::vector<float> p = {1.0f, 1.0f, 1.0f}, g = {0.5f, -2.0f, 1e-3f}, m(3, 0), v(3, 0);
  adamw_step(kCpu, p.data(), g.data(), m.data(), v.data(), 3, {0.1f, 0.9f, 0.999f, 1e-8f, 0.0f}, 1);
  EXPECT_NEAR(p[0], 0.9f, 1e-6);
  EXPECT_NEAR(p[1], 1.1f, 1e-6);
  EXPECT_NEAR(p[2], 0.9f, 1e-5);
  EXPECT_THROW(adamw_step(kCpu, p.data(), g.data(), m.data(), v.data(), 3, {}, 0), InternalError);
}

TEST(kernels_grad_clip, SumOfSquaresOverRanges) {
  const int n = 1003;  // not a multiple of the 4-way unrolling
  auto g = ref::random_floats(n, 90);
  double expected = 0;
  for (float x : g) expected += (double)x * x;
  EXPECT_NEAR(sum_of_squares(kCpu, g.data(), n), expected, 1e-12 * expected);
  // Partial sums over two ranges add up (what an all-reduce of per-rank partials relies on).
  EXPECT_NEAR(sum_of_squares(kCpu, g.data(), 500) + sum_of_squares(kCpu, g.data() + 500, n - 500),
              expected, 1e-12 * expected);
  // sum_of_squares_each: each range's value as sum_of_squares gives it, an empty range 0.
  const float* ranges[3] = {g.data(), g.data() + 500, g.data() + 7};
  const std::int64_t sizes[3] = {500, n - 500, 0};
  double each[3] = {-1, -1, -1};
  sum_of_squares_each(kCpu, each, ranges, sizes, 3);
  EXPECT_EQ(each[0], sum_of_squares(kCpu, g.data(), 500));
  EXPECT_EQ(each[1], sum_of_squares(kCpu, g.data() + 500, n - 500));
  EXPECT_EQ(each[2], 0.0);
}

// Clipping folded into AdamW (grad_scale) updates exactly as the gradients scaled beforehand.
TEST(kernels_grad_clip, AdamWGradScaleIsScalingTheGradientsFirst) {
  const int n = 1003;
  const auto g = ref::random_floats(n, 91), p0 = ref::random_floats(n, 92);
  const double norm = std::sqrt(sum_of_squares(kCpu, g.data(), n)), max_norm = 1.0;
  const auto factor = static_cast<float>(max_norm / norm);
  std::vector<float> scaled(g);
  for (auto& x : scaled) x *= factor;
  std::vector<float> p_first(p0), m_first(n, 0.1f), v_first(n, 0.01f);
  adamw_step(kCpu, p_first.data(), scaled.data(), m_first.data(), v_first.data(), n,
             {1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f}, 2);
  std::vector<float> p(p0), m(n, 0.1f), v(n, 0.01f);
  adamw_step(kCpu, p.data(), g.data(), m.data(), v.data(), n,
             {1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f, factor}, 2);
  EXPECT_EQ(p, p_first);
  EXPECT_EQ(m, m_first);
  EXPECT_EQ(v, v_first);
  EXPECT_NEAR(std::sqrt(sum_of_squares(kCpu, scaled.data(), n)), max_norm, 1e-6);
  EXPECT_NE(p, p0);
}

std::uint32_t bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float from_bits(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

TEST(kernels_bf16, RoundsToNearestEven) {
  EXPECT_EQ(float_to_bf16(1.0f), 0x3F80);
  EXPECT_EQ(float_to_bf16(from_bits(0x3F808000)), 0x3F80);  // tie, even below
  EXPECT_EQ(float_to_bf16(from_bits(0x3F818000)), 0x3F82);  // tie, even above
  EXPECT_EQ(float_to_bf16(from_bits(0x3F808001)), 0x3F81);  // just above the tie
  EXPECT_EQ(float_to_bf16(from_bits(0x3F807FFF)), 0x3F80);  // just below
  EXPECT_EQ(float_to_bf16(-2.0f), 0xC000);
  EXPECT_EQ(float_to_bf16(std::numeric_limits<float>::infinity()), 0x7F80);
  EXPECT_EQ(float_to_bf16(std::numeric_limits<float>::max()), 0x7F80);  // overflows to inf
  const bf16 nan = float_to_bf16(from_bits(0x7FFFFFFF));  // would round into inf without care
  EXPECT_TRUE(std::isnan(bf16_to_float(nan)));
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(from_bits(0x7F800001)))));  // sNaN payload
}

TEST(kernels_bf16, ArrayConversionRoundTripsAndIsWithinHalfUlp) {
  const auto x = ref::random_floats(257, 95, -100, 100);
  std::vector<bf16> h(x.size());
  std::vector<float> back(x.size());
  float_to_bf16(h.data(), x.data(), (std::int64_t)x.size());
  bf16_to_float(back.data(), h.data(), (std::int64_t)x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    // bf16 keeps 8 significant bits: rounding error <= half an ulp <= 2^-8 relative.
    EXPECT_LE(std::abs(back[i] - x[i]), std::abs(x[i]) * (1.0f / 256)) << i;
    EXPECT_EQ(float_to_bf16(back[i]), h[i]) << i;  // bf16 values convert exactly
    EXPECT_EQ(bits(back[i]) & 0xFFFF, 0u);
  }
}

}  // namespace
}  // namespace t3d::kernels
