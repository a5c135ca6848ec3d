// fp32 -> bf16 with the AVX512-BF16 conversion instruction: exactly kernels/precision.h's
// float_to_bf16 bits (round to nearest even, NaN quiet; the denormals the instruction would flush
// to zero are redone in integers), several times faster than the integer emulation alone.
// precision.h's array conversion uses it where the CPU has it. Internal to kernels/.
#pragma once

#include <cstdint>

namespace t3d::kernels::detail {

// Whether this CPU has the instruction (AVX-512 F/BW/VL and AVX512-BF16).
bool bf16_round_supported();

// out (n) = float_to_bf16(in (n)). Only where bf16_round_supported().
void round_bf16_avx512(std::uint16_t* out, const float* in, std::int64_t n);

}  // namespace t3d::kernels::detail
