// The tile configuration of the kernels' AMX code (linear_amx.cc, attention_scores_amx.cc), palette
// 1: all eight tiles 16 rows of 64 bytes, what a tile of bfloat16 pairs or of float32 sums holds.
// Each thread loads it (_tile_loadconfig) before its tile instructions.
#pragma once

#include <cstdint>

namespace sssd::kernels::detail {

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};

inline constexpr TileConfig kTiles16x64{};

}  // namespace sssd::kernels::detail
