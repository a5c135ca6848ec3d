// The timed loops of kernels/peak.cpp, one translation unit per instruction set. Internal.
#pragma once

#include <cstdint>

namespace t3d::kernels::detail {

// Each runs `iterations` × (chains) dependent vector instructions and returns FLOPs done; the
// result is written to `sink` so the loop cannot be optimised away.
double fma_loop_avx512(std::int64_t iterations, float* sink);
double bf16_dot_loop_avx512(std::int64_t iterations, float* sink);
double fma_loop_avx2(std::int64_t iterations, float* sink);

}  // namespace t3d::kernels::detail
