// Attention tiles with bf16 inputs and fp32 accumulation (AVX512-BF16 `vdpbf16ps`), for ranks
// whose linear layers run bf16 GEMMs (kernels/gemm.h). Internal to kernels/: ops_attention.cpp
// picks this path when the GEMM kind its caller gives is a bf16 one and the CPU has AVX512-BF16;
// everything else keeps the fp32 OpenBLAS tiles.
//
// Numerics: the same flash-attention-2 algorithm as the fp32 path, with every operand of the
// tile products (q, k, v, dout, P and dS) rounded to bf16 (round to nearest even; the hardware
// conversion, which also flushes denormals to zero) and every product summed in fp32. Softmax,
// the running max and sum, lse, rowsum(dO * O) and all outputs stay fp32. Results depend only on
// the inputs and the shape (one thread computes an item, in a fixed order), not on threads.
//
// The AVX-512 translation unit (attention_bf16_avx512.cpp) defines only these two functions; the
// buffers are allocated here in baseline code, so no AVX-512 copy of a library template can be
// merged into code that runs on other CPUs.
#pragma once

#include <cstdint>

#include "kernels/ops.h"

namespace t3d::kernels::detail {

// Per-thread work memory of one item, sized by bf16_attention_buffer_words (32-bit words).
struct Bf16AttentionBuffers {
  std::uint32_t* k_cols;   // (D/2, ldk) k as column pairs: [p][j] = (k[j][2p], k[j][2p+1])
  std::uint32_t* k_rows;   // (keys/2, D) k as row pairs:   [p][d] = (k[2p][d], k[2p+1][d])
  std::uint32_t* v_cols;   // (D/2, ldk) v as column pairs (backward: dP = dO v^T)
  std::uint32_t* v_rows;   // (keys/2, D) v as row pairs (forward: O += P v)
  std::uint32_t* q_nat;    // (tile, D/2) a query tile's bf16 rows
  std::uint32_t* q_rows;   // (tile/2, D) the same as row pairs (backward: dK += dS^T q)
  std::uint32_t* do_nat;   // (tile, D/2) dout tile rows
  std::uint32_t* do_rows;  // (tile/2, D) dout tile as row pairs (backward: dV += P^T dO)
  std::uint32_t* p_nat;    // (tile, key_tile/2) P or dS rows in bf16
  std::uint32_t* p_rows;   // (tile/2, key_tile) P or dS as row pairs
  float* s;                // (tile, key_tile) scores, then P
  float* dp;               // (tile, key_tile) dP, then dS
  float* m;                // (tile) running max; backward: rowsum(dO * O)
  float* l;                // (tile) running sum; forward, once the last key tile is in: 1 / sum
  std::int64_t key_tile;   // keys per key tile, even (key pairs never straddle tiles), >= tile
  std::int64_t ldk;        // keys rounded up to 16 (one vector of column pairs)
};

// 32-bit words of Bf16AttentionBuffers for this shape; grows with the keys (k and v of one head
// are packed once per item, O(keys * D)), not with keys^2.
std::int64_t bf16_attention_buffer_words(const AttentionShape& s);
// Carves the buffers out of `words` (bf16_attention_buffer_words of them, 64-byte aligned).
Bf16AttentionBuffers bf16_attention_buffers(std::uint32_t* words, const AttentionShape& s);

// Whether this CPU runs the bf16 tiles (AVX-512 F/BW/VL/DQ and AVX512-BF16).
bool bf16_attention_supported();

// One (batch, query head) of the forward; same contract as attention_forward's item.
void attention_forward_head_bf16(float* out, float* lse, const float* q, const float* k,
                                 const float* v, const Bf16AttentionBuffers& buf,
                                 const AttentionShape& s, std::int64_t b, std::int64_t h);
// One (batch, kv head) of the backward: the query heads of its group in order. Writes (=) the rows
// of dq of those heads and the rows of dk, dv of this kv head (all keys; rows no query reaches
// are 0).
void attention_backward_group_bf16(float* dq, float* dk, float* dv, const float* dout,
                                   const float* q, const float* k, const float* v, const float* out,
                                   const float* lse, const Bf16AttentionBuffers& buf,
                                   const AttentionShape& s, std::int64_t b, std::int64_t kvh);

}  // namespace t3d::kernels::detail
