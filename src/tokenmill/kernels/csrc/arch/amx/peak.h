// The AMX peaks of ops/peak.h: kAmxTiles accumulator tiles of 16 x 16 sums, each a round taking one tdpbf16ps (32
// bf16 products a sum) or tdpbusd (64 u8 x s8 products a sum) of the same two operand tiles, which stay in their
// registers. Four independent accumulators keep the unit busy through an instruction's latency, as the linears'
// 2 x 2 passes (amx_bf16.h, amx_int8.h) do.
#pragma once

#include <cstdint>
#include <cstring>

#include "arch/amx/tiles.h"
#include "arch/isa.h"

namespace tmk {

constexpr int kAmxTiles = 4;

// tiles 0-3: the sums (16 rows of 64 bytes); 4: A; 5: B (both 16 rows of 64 bytes)
__attribute__((target("amx-tile"))) inline void amx_configure_peak() {
  TileConfig c;
  for (int t = 0; t < kAmxTiles + 2; ++t) c.rows[t] = 16, c.colsb[t] = 64;
  asm volatile("" : : "r"(&c) : "memory");  // the config's stores kept: see amx_configure, amx_bf16.h
  _tile_loadconfig(&c);
}

// The tiles configured, the accumulators zeroed and both operand tiles loaded from `operand` (16 rows of 64 bytes)
__attribute__((target("amx-tile"))) inline void amx_peak_start(const void* operand) {
  amx_configure_peak();
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_loadd(4, operand, 64);
  _tile_loadd(5, operand, 64);
}

// The sum of every element of the four accumulator tiles (float32 or int32), then the tiles released
template <typename T>
__attribute__((target("amx-tile"))) inline double amx_peak_sums() {
  alignas(64) T out[kAmxTiles][16][16];
  _tile_stored(0, out[0], 64);
  _tile_stored(1, out[1], 64);
  _tile_stored(2, out[2], 64);
  _tile_stored(3, out[3], 64);
  _tile_release();
  double total = 0;
  for (const auto& tile : out)
    for (const auto& row : tile)
      for (T x : row) total += (double)x;
  return total;
}

// `iters` rounds of tdpbf16ps into each accumulator, every product `value` (as bf16) squared
__attribute__((target("amx-tile,amx-bf16"))) inline double amx_peak_bf16(int64_t iters, float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  alignas(64) uint16_t operand[16][32];
  for (auto& row : operand)
    for (auto& x : row) x = (uint16_t)(bits >> 16);
  amx_peak_start(operand);
  for (int64_t i = 0; i < iters; ++i) {
    _tile_dpbf16ps(0, 4, 5);
    _tile_dpbf16ps(1, 4, 5);
    _tile_dpbf16ps(2, 4, 5);
    _tile_dpbf16ps(3, 4, 5);
  }
  return amx_peak_sums<float>();
}

// `iters` rounds of tdpbusd into each accumulator, every product `value` (u8) times `value` (s8). The int32 sums wrap
// past 2^31, in a long probe: only the tests' short runs read them.
__attribute__((target("amx-tile,amx-int8"))) inline double amx_peak_int8(int64_t iters, int8_t value) {
  alignas(64) int8_t operand[16][64];
  std::memset(operand, value, sizeof(operand));
  amx_peak_start(operand);
  for (int64_t i = 0; i < iters; ++i) {
    _tile_dpbusd(0, 4, 5);
    _tile_dpbusd(1, 4, 5);
    _tile_dpbusd(2, 4, 5);
    _tile_dpbusd(3, 4, 5);
  }
  return amx_peak_sums<int32_t>();
}

}  // namespace tmk
