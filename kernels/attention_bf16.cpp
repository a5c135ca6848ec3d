// Baseline part of the bf16 attention tiles and GEMM input rounding: CPU checks and buffer layout
// (the AVX512-BF16 code is in attention_bf16_avx512.cpp and bf16_round_avx512.cpp).
#include "kernels/attention_bf16.h"

#include <algorithm>

#include "kernels/bf16_round.h"
#include "kernels/blas.h"
#include "kernels/gemm.h"

namespace t3d::kernels::detail {
namespace {

std::int64_t round16(std::int64_t n) { return (n + 15) / 16 * 16; }  // 64 bytes of words

struct Sizes {
  std::int64_t tile, key_tile, dp, ldk, kp2;  // dp: pairs of D; kp2: pairs of keys
};

// Key tiles span up to kMaxKeyTile keys, or the query tile if longer: a short sequence's rows
// are then one tile (one softmax pass, no rescaling, long sums per product); longer ones are
// streamed with the online softmax through S tiles that stay in L2 (64 x 256 floats: 64 KiB).
constexpr std::int64_t kMaxKeyTile = 256;

Sizes sizes_of(const AttentionShape& s) {
  const auto even = [](std::int64_t n) { return (n + 1) / 2 * 2; };
  const std::int64_t keys = s.keys();
  const std::int64_t key_tile = std::max(even(s.tile), std::min(even(s.q_pos + s.T), kMaxKeyTile));
  return {s.tile, key_tile, (s.head_dim + 1) / 2, round16(keys), (keys + 1) / 2};
}

}  // namespace

bool bf16_round_supported() {
  static const bool ok = [] {
    const CpuFeatures f = detect_cpu_features();
    return f.avx512f && f.avx512bw && f.avx512vl && cpu_has_bf16_dot();
  }();
  return ok;
}

bool bf16_attention_supported() {
  static const bool ok = bf16_round_supported() && detect_cpu_features().avx512dq;
  return ok;
}

std::int64_t bf16_attention_buffer_words(const AttentionShape& s) {
  const Sizes z = sizes_of(s);
  const std::int64_t D = s.head_dim, tq2 = (z.tile + 1) / 2;
  return 2 * round16(z.dp * z.ldk) + 2 * round16(z.kp2 * D)   // k, v: column and row pairs
         + 2 * round16(z.tile * z.dp) + 2 * round16(tq2 * D)  // q, dout tiles
         + round16(z.tile * (z.key_tile / 2)) + round16(tq2 * z.key_tile)  // P / dS in bf16
         + 2 * round16(z.tile * z.key_tile) + 2 * round16(z.tile);         // S, dP, m, l
}

Bf16AttentionBuffers bf16_attention_buffers(std::uint32_t* words, const AttentionShape& s) {
  const Sizes z = sizes_of(s);
  const std::int64_t D = s.head_dim, tq2 = (z.tile + 1) / 2;
  std::uint32_t* at = words;
  const auto take = [&](std::int64_t n) {
    std::uint32_t* p = at;
    at += round16(n);
    return p;
  };
  Bf16AttentionBuffers b;
  b.k_cols = take(z.dp * z.ldk);
  b.v_cols = take(z.dp * z.ldk);
  b.k_rows = take(z.kp2 * D);
  b.v_rows = take(z.kp2 * D);
  b.q_nat = take(z.tile * z.dp);
  b.do_nat = take(z.tile * z.dp);
  b.q_rows = take(tq2 * D);
  b.do_rows = take(tq2 * D);
  b.p_nat = take(z.tile * (z.key_tile / 2));
  b.p_rows = take(tq2 * z.key_tile);
  b.s = reinterpret_cast<float*>(take(z.tile * z.key_tile));
  b.dp = reinterpret_cast<float*>(take(z.tile * z.key_tile));
  b.m = reinterpret_cast<float*>(take(z.tile));
  b.l = reinterpret_cast<float*>(take(z.tile));
  b.key_tile = z.key_tile;
  b.ldk = z.ldk;
  return b;
}

}  // namespace t3d::kernels::detail
