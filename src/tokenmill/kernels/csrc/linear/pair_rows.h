// Pair-major rows: the bf16 activations as the pair tiles (linear/pair_tile.h) read them where many rows share a
// weight. The rows a tile takes (linear/dense.h: the rows in blocks, each block in tiles of even sizes) lie
// interleaved, PG k pairs at a time: for a tile of R rows, group g (pairs [g PG, g PG + PG)) of row m is the 32-bit
// words at first + g R PG + m PG, pair j of it at + j % PG. So one pointer and constant offsets reach every row's pair
// (rows ldxh apart took a register per row, and GCC moved them through vector registers at every pair), and each row
// writes whole 64-byte lines of its own (no two threads readying rows write the same line).
//
// Whoever readies the rows for a linear (the decode stack's prep, kernels.cpp's linear) writes them once for all the
// threads' chunks; linear_range (linear/linear.h) is told the rows are pair-major.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "core/simd.h"

namespace tmk {

constexpr int64_t PG = 16;  // pairs per group: 64 bytes of a row
// rows of one bf16 pair tile: with 16 lanes a row needs one accumulator and no widened weights. 16, not 12: a
// 16-row decode step in one tile reads each weight once, 16 vdpbf16ps per 64 bytes, which two cores can feed from
// memory; as two tiles of 8 the first waited on memory while the second ran from cache
constexpr int MT_PAIRS = W == 16 ? 16 : (W == 8 ? 6 : 2);

// the first row of tile t of `rows` rows in `tiles` tiles: sizes that differ by one at most. With tiles of 4 rows or
// more (8 and 16 lanes) no tile of a block of 2 rows or more then holds a lone row, which sums in another order
// (a row alone takes 4 sets of sums); nor with 4 lanes' tiles of 2 for an even count, as `--batch-invariant` pads them
constexpr int64_t tile_start(int64_t rows, int64_t tiles, int64_t t) { return t * rows / tiles; }

// rows per block of a K-wide product: ~384 KB of x, which stays in L2 while every panel of a thread's range passes
// over it (a long prompt's rows, all re-read from L3 for each panel, held the tiles back); `mt` rows per tile at most
inline int64_t row_block(int64_t K, int64_t bytes_per_k, int64_t mt) {
  return std::max<int64_t>(mt, (384 << 10) / (K * bytes_per_k) / mt * mt);
}

// a block of n rows in the fewest tiles of at most mt rows (of even sizes: 8 rows as 4 + 4, not 6 + 2)
constexpr int64_t tile_count(int64_t n, int64_t mt) { return (n + mt - 1) / mt; }

// 32-bit words per pair-major row of a K-wide product (whole groups)
constexpr int64_t pair_row_words(int64_t K) { return (K / 2 + PG - 1) / PG * PG; }

// Where row r of M pair-major rows lies: its tile's first word, the tile's rows, and r's index in it
struct PairSlot {
  int64_t first, rows, m;
};
inline PairSlot pair_slot(int64_t M, int64_t K, int64_t r) {
  const int64_t block = row_block(K, 2, MT_PAIRS), r0 = r / block * block, n = std::min(M, r0 + block) - r0;
  const int64_t tiles = tile_count(n, MT_PAIRS), i = r - r0;
  int64_t t = i * tiles / n;  // tile_start(n, tiles, t) <= i < tile_start(n, tiles, t + 1)
  while (tile_start(n, tiles, t + 1) <= i) ++t;
  while (tile_start(n, tiles, t) > i) --t;
  const int64_t m0 = tile_start(n, tiles, t);
  return {(r0 + m0) * pair_row_words(K), tile_start(n, tiles, t + 1) - m0, i - m0};
}

// Row r's k pairs [j0, j1) of `row` (bf16, K wide) -> their words in `words`, M rows pair-major
inline void write_pairs(const uint16_t* row, int64_t M, int64_t K, int64_t r, int32_t* words, int64_t j0 = 0,
                        int64_t j1 = -1) {
  if (j1 < 0) j1 = K / 2;
  const PairSlot s = pair_slot(M, K, r);
  int32_t* to = words + s.first + s.m * PG;  // group 0 of the row; group g at + g rows PG
  const int64_t stride = s.rows * PG;
  int64_t j = j0;
  for (; j < j1 && j % PG; ++j) std::memcpy(to + j / PG * stride + j % PG, row + 2 * j, 4);
  for (; j + PG <= j1; j += PG) std::memcpy(to + j / PG * stride, row + 2 * j, PG * 4);  // a whole line
  for (; j < j1; ++j) std::memcpy(to + j / PG * stride + j % PG, row + 2 * j, 4);
}

}  // namespace tmk
