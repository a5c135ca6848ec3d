// The AMX bf16 tile loop of kernels/peak.cpp (compiled with -mamx-tile -mamx-bf16; run only where
// detect_cpu_features().amx_bf16 and the OS granted the tile state, amx_tile_state_granted()).
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

#include "kernels/peak_loops.h"

namespace t3d::kernels::detail {

namespace {

// Palette 1's tile configuration: every tile 16 rows of 64 bytes (16 fp32 or 32 bf16).
struct alignas(64) TileConfig {
  std::uint8_t palette_id = 1, start_row = 0;
  std::uint8_t reserved[14] = {};
  std::uint16_t colsb[16] = {};
  std::uint8_t rows[16] = {};
};

}  // namespace

bool amx_tile_state_granted() {
  // Linux hands the AMX tile data state to a process only on request (ARCH_REQ_XCOMP_PERM for
  // XFEATURE_XTILEDATA); oneDNN asks the same before its AMX kernels.
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

double bf16_tile_loop_amx(std::int64_t iterations, float* sink) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
  alignas(64) std::uint16_t ab[16 * 32];
  for (auto& x : ab) x = 0x3a83;  // bf16 1e-3
  _tile_loadd(6, ab, 64);
  _tile_loadd(7, ab, 64);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_zero(4);
  _tile_zero(5);
  // Six independent accumulators hide the instruction's latency.
  for (std::int64_t it = 0; it < iterations; ++it) {
    _tile_dpbf16ps(0, 6, 7);
    _tile_dpbf16ps(1, 6, 7);
    _tile_dpbf16ps(2, 6, 7);
    _tile_dpbf16ps(3, 6, 7);
    _tile_dpbf16ps(4, 6, 7);
    _tile_dpbf16ps(5, 6, 7);
  }
  alignas(64) float c[16 * 16];
  _tile_stored(5, c, 64);
  _tile_release();
  *sink = c[17];
  return iterations * 6.0 * 16 * 16 * 32 * 2;  // a 16 x 16 fp32 tile += 16 x 32 by 32 x 16 bf16
}

}  // namespace t3d::kernels::detail
