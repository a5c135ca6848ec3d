// Rounding fp32 -> bf16 with the AVX512-BF16 conversion instruction, for the inputs of bf16 GEMMs
// (kernels/gemm.cpp). Internal to kernels/.
//
// Round to nearest even, like kernels/precision.h's float_to_bf16, with two differences the
// instruction makes: fp32 denormals (|x| < 2^-126) become a zero of the same sign, and a NaN
// becomes a quiet NaN whose payload may differ. Neither matters for a GEMM input (such values
// add nothing, or NaN, to a sum); bf16 storage and communication keep float_to_bf16's exact bits.
// Several times faster than the integer emulation, which is what the GEMMs' rounding cost.
#pragma once

#include <cstdint>

namespace t3d::kernels::detail {

// Whether this CPU has the instruction (AVX-512 F/BW/VL and AVX512-BF16).
bool bf16_round_supported();

// out (n) = in (n) rounded as above. Only where bf16_round_supported().
void round_bf16_avx512(std::uint16_t* out, const float* in, std::int64_t n);

}  // namespace t3d::kernels::detail
