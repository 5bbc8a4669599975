// Paged attention's two products for bf16 queries and caches with AVX-512 BF16's dot
// product (vdpbf16ps): each instruction multiplies 16 pairs of bf16 values exactly and adds
// both products to 16 float32 sums, twice the work of a float32 FMA. Keys are paired along
// d (q . k), values along the tokens (p . v), so the probabilities are rounded to bf16 for
// the second product, as PyTorch's CPU flash attention rounds them. Compiled where the
// build target has AVX512_BF16, for block sizes that fill whole 512-bit vectors; elsewhere
// f32_tiles.h works in float32.
#pragma once

#include <cstring>

#include "common.h"

namespace pagedserve_cpu {

#if defined(__AVX512BF16__)
template <typename T, int64_t BS>
constexpr bool kPaired = std::is_same_v<T, bf16_bits> && BS % 16 == 0;
#else
template <typename T, int64_t BS>
constexpr bool kPaired = false;
// Declared only, so that attention.cpp's discarded `if constexpr` branches still parse.
template <int64_t Len, int64_t Elems, typename N>
void pair_rows(const bf16_bits* rows, int64_t n, uint32_t* pairs, const N* next);
template <int64_t BS, int64_t D>
void paired_scores(const uint32_t* pairs, const bf16_bits* q, int64_t nq, float scale,
                   float* scores, const bf16_bits* next);
template <int64_t BS, int64_t D>
void paired_values(const uint32_t* pairs, int64_t n, const float* probs,
                   const float* correction, int64_t nq, float* acc, bf16_bits* rounded,
                   const bf16_bits* next);
#endif

#if defined(__AVX512BF16__)
// Rows 2i and 2i + 1 of a block's first n rows of Len values, interleaved: pair (i, t)
// holds their values t, the operand layout of vdpbf16ps (zero for a row past n: a value
// slot past the context may be NaN). A key block [D][BS] becomes pairs along d, a value
// block [BS][D] pairs of tokens. While it works, it prefetches the first half of the next
// block of Elems values (next, if any); the product that reads the pairs fetches the second
// half. Spread over both, the loads overlap with all of a block's work: issued within the
// pairing alone, a decode step's attention took 1.22x as long (docs/performance-zen5.md).
template <int64_t Len, int64_t Elems, typename N>
void pair_rows(const bf16_bits* __restrict rows, int64_t n, uint32_t* __restrict pairs,
               const N* next) {
  const int64_t num_pairs = (n + 1) / 2;
  for (int64_t i = 0; i < num_pairs; ++i) {
    if (next != nullptr) prefetch_slice<N, Elems>(next, i, 2 * num_pairs);
    const bf16_bits* even = rows + 2 * i * Len;
    const bool odd_live = 2 * i + 1 < n;
    for (int64_t t = 0; t < Len; t += 16) {
      const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(even + t)));
      const __m512i hi = odd_live ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(even + Len + t))) : _mm512_setzero_si512();
      _mm512_storeu_si512(pairs + i * Len + t, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
  }
}

// scores[q][t] = scale * (q . key_t) for NQ queries (rows of D bf16, read as D/2 pairs) and
// the BS tokens of one paired block. Each query's sums run over the pairs in order, whatever
// the tile, so its scores do not depend on the queries it is computed with. Fetches the
// second half of the next key block (next, if any; pair_rows fetched the first).
template <int64_t BS, int64_t D, int NQ>
void paired_scores_tile(const uint32_t* __restrict pairs, const bf16_bits* __restrict q,
                        float scale, float* __restrict scores, const bf16_bits* next) {
  constexpr int V = BS / 16;
  __m512 s[NQ][V];
  for (int i = 0; i < NQ; ++i)
    for (int v = 0; v < V; ++v) s[i][v] = _mm512_setzero_ps();
  for (int64_t j = 0; j < D / 2; ++j) {
    if (next != nullptr) prefetch_slice<bf16_bits, D * BS>(next, D / 2 + j, D);
    for (int v = 0; v < V; ++v) {
      const __m512bh k = (__m512bh)_mm512_loadu_si512(pairs + j * BS + v * 16);
      for (int i = 0; i < NQ; ++i) {
        uint32_t qpair;
        std::memcpy(&qpair, q + i * D + 2 * j, sizeof(qpair));
        s[i][v] = _mm512_dpbf16_ps(s[i][v], (__m512bh)_mm512_set1_epi32(qpair), k);
      }
    }
  }
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int i = 0; i < NQ; ++i)
    for (int v = 0; v < V; ++v)
      _mm512_storeu_ps(scores + i * BS + v * 16, _mm512_mul_ps(s[i][v], vscale));
}

// The last n < Tile queries as one tile.
template <int64_t BS, int64_t D, int NQ>
void paired_scores_rest(const uint32_t* pairs, const bf16_bits* q, int64_t n, float scale,
                        float* scores, const bf16_bits* next) {
  if (n == NQ) return paired_scores_tile<BS, D, NQ>(pairs, q, scale, scores, next);
  if constexpr (NQ > 1) paired_scores_rest<BS, D, NQ - 1>(pairs, q, n, scale, scores, next);
}

// All nq queries against one paired block, in tiles whose accumulators fill at most 24 of
// AVX-512's 32 vector registers; the first tile prefetches (next).
template <int64_t BS, int64_t D>
void paired_scores(const uint32_t* pairs, const bf16_bits* q, int64_t nq, float scale,
                   float* scores, const bf16_bits* next) {
  constexpr int Tile = std::min<int>(12, 24 / (BS / 16));
  int64_t i = 0;
  for (; i + Tile <= nq; i += Tile, next = nullptr)
    paired_scores_tile<BS, D, Tile>(pairs, q + i * D, scale, scores + i * BS, next);
  if (i < nq) paired_scores_rest<BS, D, Tile - 1>(pairs, q + i * D, nq - i, scale,
                                                  scores + i * BS, next);
}

// acc[q] = acc[q] * correction[q] + sum over pairs t of (p[2t], p[2t + 1]) . pair row t, for
// NQ queries, the probabilities rounded to bf16 (pairs[t] as uint32 in memory order).
// Fetches the second half of the next value block (next, if any; pair_rows fetched the first).
template <int64_t BS, int64_t D, int NQ>
void paired_values_tile(const uint32_t* __restrict pairs, int64_t npairs,
                        const uint32_t* __restrict p, int64_t p_stride,
                        const float* __restrict correction, float* __restrict acc,
                        const bf16_bits* next) {
  constexpr int V = D / 16;
  __m512 a[NQ][V];
  for (int i = 0; i < NQ; ++i) {
    const __m512 c = _mm512_set1_ps(correction[i]);
    for (int v = 0; v < V; ++v) a[i][v] = _mm512_mul_ps(_mm512_loadu_ps(acc + i * D + v * 16), c);
  }
  for (int64_t t = 0; t < npairs; ++t) {
    if (next != nullptr) prefetch_slice<bf16_bits, D * BS>(next, npairs + t, 2 * npairs);
    for (int v = 0; v < V; ++v) {
      const __m512bh vals = (__m512bh)_mm512_loadu_si512(pairs + t * D + v * 16);
      for (int i = 0; i < NQ; ++i)
        a[i][v] = _mm512_dpbf16_ps(a[i][v], (__m512bh)_mm512_set1_epi32(p[i * p_stride + t]),
                                   vals);
    }
  }
  for (int i = 0; i < NQ; ++i)
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(acc + i * D + v * 16, a[i][v]);
}

template <int64_t BS, int64_t D, int NQ>
void paired_values_rest(const uint32_t* pairs, int64_t npairs, const uint32_t* p,
                        int64_t p_stride, const float* correction, float* acc, int64_t n,
                        const bf16_bits* next) {
  if (n == NQ)
    return paired_values_tile<BS, D, NQ>(pairs, npairs, p, p_stride, correction, acc, next);
  if constexpr (NQ > 1)
    paired_values_rest<BS, D, NQ - 1>(pairs, npairs, p, p_stride, correction, acc, n, next);
}

// nq queries' probabilities over the block's first n tokens (probs: [nq][BS], zero past
// each query's own count) times the paired value rows, into acc [nq][D]. rounded: room
// for nq * BS bf16 values. The first tile prefetches (next).
template <int64_t BS, int64_t D>
void paired_values(const uint32_t* pairs, int64_t n, const float* probs,
                   const float* correction, int64_t nq, float* acc, bf16_bits* rounded,
                   const bf16_bits* next) {
  constexpr int Tile = std::min<int>(8, 24 / (D / 16));
  constexpr int64_t Stride = BS / 2;  // pairs of probabilities per query
  // vcvtneps2bf16 rounds to nearest even as from_f does; it reads denormals as zero, but
  // a probability is 0 or fast_exp of at least -87, a normal float.
  for (int64_t i = 0; i < nq * BS; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(rounded + i),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(probs + i)));
  const auto* p = reinterpret_cast<const uint32_t*>(rounded);
  const int64_t npairs = (n + 1) / 2;
  int64_t i = 0;
  for (; i + Tile <= nq; i += Tile, next = nullptr)
    paired_values_tile<BS, D, Tile>(pairs, npairs, p + i * Stride, Stride, correction + i,
                                    acc + i * D, next);
  if (i < nq) paired_values_rest<BS, D, Tile - 1>(pairs, npairs, p + i * Stride, Stride,
                                                  correction + i, acc + i * D, nq - i, next);
}
#endif

}  // namespace pagedserve_cpu
