// The timed loops of kernels/peak.cpp, one translation unit per instruction set. Internal.
#pragma once

#include <cstdint>

namespace t3d::kernels::detail {

// Each runs `iterations` × (chains) dependent vector instructions and returns FLOPs done; the
// result is written to `sink` so the loop cannot be optimised away.
double fma_loop_avx512(std::int64_t iterations, float* sink);
double bf16_dot_loop_avx512(std::int64_t iterations, float* sink);
double fma_loop_avx2(std::int64_t iterations, float* sink);
// AMX: Linux's permission for the tile state first (false: not granted, no AMX here).
bool amx_tile_state_granted();
double bf16_tile_loop_amx(std::int64_t iterations, float* sink);

}  // namespace t3d::kernels::detail
