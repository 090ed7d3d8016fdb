// Decode attention: one new token per sequence over its paged KV cache, for one (sequence, KV head, split of
// kSplit positions) at a time; a sequence's splits are then merged (flash-decoding). With one sequence, the splits
// are what the threads share: by KV head alone, a model with one or two KV heads kept one or two threads busy
// however long its context.
//
// The G = H / Hkv query heads of a KV head share every key and value read. Scores, softmax and the weighted sum
// of values are float32. Two paths:
// - the portable one (every ISA, float32 or bf16 caches): a run of positions within a block is widened to
//   float32 once, then each head passes over it (a dot product per position, a vector sum per head);
// - with AVX-512 BF16, for a bf16 cache (Dh a multiple of 32): 16 positions' keys are loaded as 16 rows of bf16
//   pairs and transposed in registers, so that one vdpbf16ps multiplies a pair of q's values (broadcast) with
//   that pair of the 16 keys and adds to the 16 positions' scores: no horizontal sums, no widening of keys, and
//   32 products per instruction. The keys' products are exact in float32 (bf16 x bf16), only their sums round
//   (in pairs). Values stay float32 FMAs (the probabilities are not rounded to bf16), all heads' sums held in
//   registers while the position's values are widened once.
// Zen 4, Qwen2.5-0.5B's shapes (14 heads over 2 KV heads of 64), bf16 cache from memory, 24 layers, 2 threads, the
// AVX-512 BF16 path against the portable one: 1 sequence at 2048 positions 5.2-5.6 -> 3.1-3.4 ms, at 512 1.12 ->
// 0.62-0.81 ms; 16 at 256 9.5 -> 6.2-6.7 ms. A 16-row int4 decode step at 128-176 positions: 37-43 -> 34-36 ms.
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

#include "simd.h"

namespace tmk {

// W lanes of a row of T (bfloat16 as uint16_t, or float) as floats
template <typename T>
inline vf load_row(const T* p) {
  if constexpr (sizeof(T) == 2) return load_bf16((const uint16_t*)p);
  else return load((const float*)p);
}

template <typename T>
inline float load_one(const T* p) {
  if constexpr (sizeof(T) == 2) {
    uint32_t bits = (uint32_t)*(const uint16_t*)p << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  } else {
    return *(const float*)p;
  }
}

// dot(a[0..Dh), row[0..Dh)) with a in float32 and the row in T
template <typename T>
inline float dot_row(const float* a, const T* row, int64_t Dh) {
  vf s = {};
  int64_t i = 0;
  for (; i + W <= Dh; i += W) s += load(a + i) * load_row(row + i);
  float r = hsum(s);
  for (; i < Dh; ++i) r += a[i] * load_one(row + i);
  return r;
}

// out[i] = dot(a[0..Dh), rows[i * stride ..]) for i < n (float32 rows): four rows at a time share a's loads and
// one shuffle tree for their sums
inline void dot_rows(const float* a, const float* rows, int64_t stride, int64_t n, int64_t Dh, float* out) {
  int64_t i = 0;
  if (Dh % W == 0)
    for (; i + 4 <= n; i += 4) {
      vf s[4] = {};
      for (int64_t d = 0; d < Dh; d += W) {
        const vf av = load(a + d);
        for (int r = 0; r < 4; ++r) s[r] += av * load(rows + (i + r) * stride + d);
      }
      hsum4(s[0], s[1], s[2], s[3], out + i);
    }
  for (; i < n; ++i) out[i] = dot_row(a, rows + i * stride, Dh);
}

// acc[0..NV W) += sum over i < n of p[i] * rows[i * stride ..]: the NV accumulators stay in registers across the
// rows (position by position, as one axpy per row would add them)
template <int NV>
inline void axpy_rows(float* acc, const float* p, const float* rows, int64_t stride, int64_t n) {
  vf a[NV];
  for (int v = 0; v < NV; ++v) a[v] = load(acc + v * W);
  for (int64_t i = 0; i < n; ++i) {
    const vf pv = splat(p[i]);
    for (int v = 0; v < NV; ++v) a[v] += pv * load(rows + i * stride + v * W);
  }
  for (int v = 0; v < NV; ++v) store(acc + v * W, a[v]);
}

// acc[0..Dh) += sum over i < n of p[i] * rows[i * stride + 0..Dh)
inline void axpy_run(float* acc, const float* p, const float* rows, int64_t stride, int64_t n, int64_t Dh) {
  int64_t d = 0;
  for (; d + 4 * W <= Dh; d += 4 * W) axpy_rows<4>(acc + d, p, rows + d, stride, n);
  for (; d + W <= Dh; d += W) axpy_rows<1>(acc + d, p, rows + d, stride, n);
  for (; d < Dh; ++d)
    for (int64_t i = 0; i < n; ++i) acc[d] += p[i] * rows[i * stride + d];
}

// n cache rows of Dh values (src, `stride` elements apart) as float32: a float cache in place; bf16 widened into
// buf [n, Dh] once, for all G query heads. Sets `stride` to the returned rows' stride.
template <typename T>
inline const float* float_rows(const T* src, int64_t n, int64_t& stride, int64_t Dh, float* buf) {
  if constexpr (sizeof(T) == 4) {
    return (const float*)src;
  } else {
    for (int64_t i = 0; i < n; ++i) {
      int64_t d = 0;
      for (; d + W <= Dh; d += W) store(buf + i * Dh + d, load_row(src + i * stride + d));
      for (; d < Dh; ++d) buf[i * Dh + d] = load_one(src + i * stride + d);
    }
    stride = Dh;
    return buf;
  }
}

// Positions per split. A sequence's context is cut into splits of this many positions (counted from the first
// position it attends to), each split's softmax and weighted sum of values taken on their own, then merged in split
// order (merge_splits). A fixed number, so that a sequence's result depends on its own length only: not on the batch
// around it, the number of threads, or which thread merges.
constexpr int64_t kSplit = 128;

// the splits of a sequence of `len` positions that attends to all of them, or with a window (> 0) to its last `window`
inline int64_t num_splits(int64_t len, int64_t window) {
  const int64_t n_ctx = window > 0 ? std::min(len, window) : len;
  return std::max<int64_t>(1, (n_ctx + kSplit - 1) / kSplit);
}

// B sequences' splits numbered in sequence order: sequence b's are [first[b], first[b + 1]) (first: B + 1 entries)
inline void split_offsets(const int64_t* len, int64_t B, int64_t window, std::vector<int64_t>& first) {
  first.resize(B + 1), first[0] = 0;
  for (int64_t b = 0; b < B; ++b) first[b + 1] = first[b] + num_splits(len[b], window);
}

// the sequence that split `split` belongs to, in split_offsets' numbering
inline int64_t split_owner(const std::vector<int64_t>& first, int64_t split) {
  return std::upper_bound(first.begin(), first.end(), split) - first.begin() - 1;
}

// floats of scratch attention_split needs for G query heads of Dh (blocks of block_size)
inline int64_t attention_scratch(int64_t G, int64_t Dh, int64_t block_size) {
  const int64_t n = kSplit;
  return G * (Dh + n) + std::max(std::min(block_size, n) * Dh, 2 * n + 1);
}

// scores [G, n] -> softmax along each row, in place; ml [G, 2]: each row's largest score and its sum of exponentials
// (the sum before the division)
inline void softmax_rows(float* scores, int64_t G, int64_t n, float* ml) {
  for (int64_t j = 0; j < G; ++j) {
    float* sc = scores + j * n;
    int64_t t = 0;
    vf top = splat(-INFINITY);
    for (; t + W <= n; t += W) {
      const vf v = load(sc + t);
      top = v > top ? v : top;
    }
    float mx = -INFINITY;
    for (int i = 0; i < W; ++i) mx = std::max(mx, top[i]);
    for (; t < n; ++t) mx = std::max(mx, sc[t]);
    vf sums = {};
    for (t = 0; t + W <= n; t += W) {
      const vf e = exp_neg(load(sc + t) - splat(mx));
      store(sc + t, e);
      sums += e;
    }
    float sum = hsum(sums);
    for (; t < n; ++t) sum += (sc[t] = std::exp(sc[t] - mx));
    ml[2 * j] = mx, ml[2 * j + 1] = sum;
    const vf inv = splat(1.0f / sum);
    for (t = 0; t + W <= n; t += W) store(sc + t, load(sc + t) * inv);
    for (; t < n; ++t) sc[t] *= inv[0];
  }
}

// A split's 2n cache rows (its keys, rows [0, n), then its values, [n, 2n)) asked for into L2 a fixed distance
// ahead of where the scores and sums read them: until(i) when the rows before i are about to be read. A context's
// blocks lie anywhere in the cache, where the hardware prefetcher does not follow them. Asked for all at once at the
// split's start, the rows had the core wait until the last request was on its way before any arithmetic began
// (Xeon, Qwen2.5-0.5B int4, one sequence, steps alternated with that build: 1.015-1.029x at 512 positions, 1.044x
// at 2000; 16 sequences 0.97-1.03x, noise).
constexpr int64_t kAskAhead = 32;  // positions

template <typename RowAt>
struct RowAsker {
  RowAt at;                 // at(i): row i's first element
  int64_t rows, bytes;      // 2n rows of `bytes` each
  int64_t asked = 0;
  void until(int64_t i) {
    const int64_t upto = std::min(i + kAskAhead, rows);
    for (; asked < upto; ++asked) prefetch_range_l2(at(asked), bytes);
  }
};
template <typename RowAt>
RowAsker(RowAt, int64_t, int64_t) -> RowAsker<RowAt>;

#if defined(__AVX512BF16__) && TM_W == 16
#define TM_ATTN_BF16 1

// r[i][j] <- r[j][i] for 16 rows of 16 32-bit lanes: pairs of rows interleaved, then pairs of pairs, then 128-bit
// lanes gathered (unpack, unpack, shuffle, shuffle)
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // u[i + c]: lane L holds column 4L + c of rows i..i+3
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i v0 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x44), v1 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xEE);
    const __m512i v2 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x44);
    const __m512i v3 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xEE);
    t[c] = _mm512_shuffle_i32x4(v0, v2, 0x88);  // column c
    t[4 + c] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
    t[8 + c] = _mm512_shuffle_i32x4(v1, v3, 0x88);
    t[12 + c] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// scores[j][0..m) = scale * q_j . key_i for GC heads (q rows Dh apart, bf16) and m <= 16 keys (bf16 rows)
template <int GC>
inline void key_scores(const uint16_t* q, const uint16_t* const* keys, int m, int64_t Dh, float scale, float* scores,
                       int64_t ld) {
  __m512 acc[GC];
  for (int j = 0; j < GC; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t c = 0; c < Dh; c += 32) {  // 32 values = 16 bf16 pairs: one zmm per key
    __m512i r[16];
    for (int i = 0; i < 16; ++i) r[i] = i < m ? _mm512_loadu_si512((const void*)(keys[i] + c)) : _mm512_setzero_si512();
    transpose16(r);  // r[p]: pair p of the 16 keys
    for (int p = 0; p < 16; ++p)
      for (int j = 0; j < GC; ++j) {
        uint32_t pair;
        std::memcpy(&pair, q + j * Dh + c + 2 * p, 4);
        acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)r[p], (__m512bh)_mm512_set1_epi32((int)pair));
      }
  }
  const __mmask16 valid = (__mmask16)((1u << m) - 1);
  for (int j = 0; j < GC; ++j) _mm512_mask_storeu_ps(scores + j * ld, valid, _mm512_mul_ps(acc[j], _mm512_set1_ps(scale)));
}

// acc[j][0..NV 16) += sum over i < n of p[j][i] * value_i[0..NV 16) for GC heads, the values bf16 rows: each
// value widened once for every head, the sums in registers
template <int GC, int NV>
inline void value_sums(const uint16_t* const* values, int64_t n, const float* p, int64_t ld, float* acc,
                       int64_t Dh) {
  __m512 a[GC][NV];
  for (int j = 0; j < GC; ++j)
    for (int v = 0; v < NV; ++v) a[j][v] = _mm512_loadu_ps(acc + j * Dh + 16 * v);
  for (int64_t i = 0; i < n; ++i) {
    __m512 x[NV];
    for (int v = 0; v < NV; ++v)
      x[v] = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(values[i] + 16 * v))), 16));
    for (int j = 0; j < GC; ++j) {
      const __m512 w = _mm512_set1_ps(p[j * ld + i]);
      for (int v = 0; v < NV; ++v) a[j][v] = _mm512_fmadd_ps(w, x[v], a[j][v]);
    }
  }
  for (int j = 0; j < GC; ++j)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(acc + j * Dh + 16 * v, a[j][v]);
}

// The AVX-512 BF16 path of attention_split (Dh % 32 == 0): keys at cache + row[t], values `vshift` elements
// further, for a split's n positions -> acc [G, Dh] and ml [G, 2]; scores: scratch [G, n]
inline void attention_bf16(const uint16_t* qh, const uint16_t* cache, const int64_t* row, int64_t vshift,
                           int64_t n, int64_t G, int64_t Dh, float scale, float* acc, float* ml, float* scores) {
  const uint16_t* rows[16];
  RowAsker ask{[&](int64_t i) { return cache + (i < n ? row[i] : row[i - n] + vshift); }, 2 * n, Dh * 2};
  for (int64_t t = 0; t < n; t += 16) {
    ask.until(t + 16);  // these 16 keys and kAskAhead more
    const int m = (int)std::min<int64_t>(16, n - t);
    for (int i = 0; i < m; ++i) rows[i] = cache + row[t + i];
    for (int64_t j = 0; j < G; j += 8)  // heads 8 at a time (8 sums + 16 keys in registers)
      with_rows<8>(std::min<int64_t>(8, G - j), [&](auto gc) {
        key_scores<decltype(gc)::value>(qh + j * Dh, rows, m, Dh, scale, scores + j * n + t, n);
      });
  }
  ask.until(n);  // the first values, while the softmax runs
  softmax_rows(scores, G, n, ml);
  std::fill(acc, acc + G * Dh, 0.f);
  for (int64_t t = 0; t < n; t += 16) {
    ask.until(n + t + 16);
    const int64_t m = std::min<int64_t>(16, n - t);
    for (int64_t j = 0; j < G; j += 7)  // heads 7 at a time: 7 x 4 sums in registers
      with_rows<7>(std::min<int64_t>(7, G - j), [&](auto gc) {
        constexpr int GC = decltype(gc)::value;
        const float* p = scores + j * n + t;
        for (int64_t d = 0; d < Dh;) {
          for (int64_t i = 0; i < m; ++i) rows[i] = cache + row[t + i] + vshift + d;
          if (d + 64 <= Dh) value_sums<GC, 4>(rows, m, p, n, acc + j * Dh + d, Dh), d += 64;
          else value_sums<GC, 1>(rows, m, p, n, acc + j * Dh + d, Dh), d += 16;
        }
      });
  }
}
#endif

// Positions [t0, t1) of a paged context run by run within a block: fn(slot, t, m) for each run of m positions from t,
// whose slots are slot .. slot + m - 1 (position t's slot is table[t / block_size] * block_size + t % block_size)
template <typename Fn>
inline void for_each_run(const int64_t* table, int64_t block_size, int64_t t0, int64_t t1, Fn&& fn) {
  for (int64_t t = t0; t < t1;) {
    const int64_t off = t % block_size, m = std::min(block_size - off, t1 - t);
    fn(table[t / block_size] * block_size + off, t, m);
    t += m;
  }
}

// Split s of one new token's attention over its paged context, for one (sequence b, KV head g): the G query heads'
// softmax over the split's positions and their weighted sum of values. cache: [2, slots, Hkv, Dh] for this layer
// (keys then values); q: [B, H, Dh]; table: the sequence's block ids; len: its context length. -> acc [G, Dh] (the
// sums, float32) and ml [G, 2] (each head's largest score and sum of exponentials over the split), for
// merge_splits. `scratch` holds attention_scratch(G, Dh, block_size) floats.
template <typename T>
inline void attention_split(const T* q, const T* cache, int64_t slots, const int64_t* table, int64_t len,
                            int64_t window, int64_t b, int64_t g, int64_t s, int64_t H, int64_t Hkv, int64_t Dh,
                            int64_t block_size, float scale, float* acc, float* ml, float* scratch) {
  const int64_t G = H / Hkv, kv_stride = Hkv * Dh;
  // positions [begin, len): the whole context, or with a window (> 0) its last `window` positions; this split's
  // are [t0, t1)
  const int64_t begin = window > 0 ? std::max<int64_t>(0, len - window) : 0;
  const int64_t t0 = begin + s * kSplit, t1 = std::min(len, t0 + kSplit), n = t1 - t0;
#if TM_ATTN_BF16
  if constexpr (sizeof(T) == 2) {
    if (Dh % 32 == 0) {
      // the slot of position t is table[t / block_size] * block_size + t % block_size
      int64_t* row = (int64_t*)(scratch + ((G * kSplit + 1) & ~int64_t{1}));  // [n]: keys' offsets
      for (int64_t t = t0, i = 0, block = t0 / block_size, off = t0 % block_size; t < t1; ++t, ++i) {
        row[i] = (table[block] * block_size + off) * kv_stride + g * Dh;
        if (++off == block_size) off = 0, ++block;
      }
      attention_bf16((const uint16_t*)q + (b * H + g * G) * Dh, (const uint16_t*)cache, row, slots * kv_stride, n, G,
                     Dh, scale, acc, ml, scratch);
      return;
    }
  }
#endif
  float* qv = scratch;            // [G, Dh]
  float* scores = qv + G * Dh;    // [G, n]
  float* run = scores + G * n;    // [<= block_size, Dh]: a run's keys or values as float32
  // this head's keys and values, asked for ahead of the runs that read them
  RowAsker ask{[&](int64_t i) {
                 const int64_t half = i >= n, t = t0 + i - half * n;
                 const int64_t slot = table[t / block_size] * block_size + t % block_size;
                 return cache + (half * slots + slot) * kv_stride + g * Dh;
               },
               2 * n, Dh * (int64_t)sizeof(T)};
  for (int64_t j = 0; j < G * Dh; ++j) qv[j] = load_one(q + (b * H + g * G) * Dh + j) * scale;
  for_each_run(table, block_size, t0, t1, [&](int64_t slot, int64_t t, int64_t m) {
    ask.until(t - t0 + m);  // this run's keys and kAskAhead more
    int64_t stride = kv_stride;
    const float* kb = float_rows(cache + slot * kv_stride + g * Dh, m, stride, Dh, run);
    for (int64_t j = 0; j < G; ++j) dot_rows(qv + j * Dh, kb, stride, m, Dh, scores + j * n + t - t0);
  });
  ask.until(n);
  softmax_rows(scores, G, n, ml);
  std::fill(acc, acc + G * Dh, 0.f);
  for_each_run(table, block_size, t0, t1, [&](int64_t slot, int64_t t, int64_t m) {
    ask.until(n + t - t0 + m);
    int64_t stride = kv_stride;
    const float* vb = float_rows(cache + (slots + slot) * kv_stride + g * Dh, m, stride, Dh, run);
    for (int64_t j = 0; j < G; ++j) axpy_run(acc + j * Dh, scores + j * n + t - t0, vb, stride, m, Dh);
  });
}

// A sequence's n splits of query heads [h0, h1) -> out (T [H, Dh], the sequence's row); acc [n, H, Dh] and
// ml [n, H, 2] as attention_split left them. Split s's sums weigh in with its share of the softmax's denominator,
// l_s e^(m_s - M) / L (M the largest score of all, L the sum of those terms), added in split order. One split
// weighs 1 exactly: its sums as they are.
template <typename T>
inline void merge_splits(const float* acc, const float* ml, int64_t n, int64_t H, int64_t h0, int64_t h1,
                         int64_t Dh, T* out) {
  thread_local std::vector<float> weight, sum;
  weight.resize(n), sum.resize(Dh);
  for (int64_t h = h0; h < h1; ++h) {
    float top = -INFINITY, total = 0.f;
    for (int64_t s = 0; s < n; ++s) top = std::max(top, ml[(s * H + h) * 2]);
    for (int64_t s = 0; s < n; ++s) {
      weight[s] = ml[(s * H + h) * 2 + 1] * std::exp(ml[(s * H + h) * 2] - top);
      total += weight[s];
    }
    const float* first = acc + h * Dh;
    const float* o = first;
    if (n > 1) {
      for (int64_t d = 0; d < Dh; ++d) sum[d] = first[d] * (weight[0] / total);
      for (int64_t s = 1; s < n; ++s) {
        const float w = weight[s] / total;
        const float* a = acc + (s * H + h) * Dh;
        for (int64_t d = 0; d < Dh; ++d) sum[d] += a[d] * w;
      }
      o = sum.data();
    }
    T* dst = out + h * Dh;
    for (int64_t d = 0; d < Dh; ++d) {
      if constexpr (sizeof(T) == 2) *(uint16_t*)(dst + d) = float_to_bf16(o[d]);
      else *(float*)(dst + d) = o[d];
    }
  }
}

}  // namespace tmk
