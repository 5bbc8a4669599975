// Paged attention's two products in float32 arithmetic, on key blocks stored d-major
// ([d][BS]) and value blocks row-major ([BS][d]), bf16 converted as it is read: the tiles
// attention.cpp uses wherever bf16_pairs.h does not apply.
#pragma once

#include "common.h"

namespace pagedserve_cpu {

// scores[q][t] = q . key_t for NQ queries and the BS tokens of one block, the NQ
// accumulators interleaved so that their FMA chains overlap. Tokens past the context are
// computed too, from whatever the slot holds, and ignored by the caller.
// While it works, it prefetches slice j of D of the next key block (next_k, if any).
template <typename T, int64_t BS, int64_t D, int NQ, typename N>
void scores_tile(const T* __restrict kblock, const float* __restrict qf,
                 float* __restrict scores, const N* next_k) {
  float s[NQ][BS] = {};
  for (int64_t j = 0; j < D; ++j) {
    if (next_k != nullptr) prefetch_slice<N, D * BS>(next_k, j, D);
    const T* krow = kblock + j * BS;
    for (int q = 0; q < NQ; ++q) {
      const float qj = qf[q * D + j];
#pragma omp simd
      for (int64_t t = 0; t < BS; ++t) s[q][t] += qj * to_f(krow[t]);
    }
  }
  std::copy_n(&s[0][0], NQ * BS, scores);
}

// acc[q] = acc[q] * correction[q] + sum_t p[q][t] * value_t over the first n tokens, for NQ
// queries at once (interleaved accumulators, as above). Each value row is converted to
// float once, in registers, for all NQ queries. Token t prefetches slice t of BS of the
// next value block (next_v, if any).
template <typename T, int64_t BS, int64_t D, int NQ, typename N>
void values_tile(const T* __restrict vblock, const float* __restrict probs,
                 const float* __restrict correction, int64_t n, float* __restrict acc,
                 const N* next_v) {
  float a[NQ][D];
  for (int q = 0; q < NQ; ++q) {
#pragma omp simd
    for (int64_t j = 0; j < D; ++j) a[q][j] = acc[q * D + j] * correction[q];
  }
  for (int64_t t = 0; t < n; ++t) {
    if (next_v != nullptr) prefetch_slice<N, D * BS>(next_v, t, BS);
    for (int q = 0; q < NQ; ++q) {
      const float p = probs[q * BS + t];
#pragma omp simd
      for (int64_t j = 0; j < D; ++j) a[q][j] += p * to_f(vblock[t * D + j]);
    }
  }
  std::copy_n(&a[0][0], NQ * D, acc);
  for (int64_t t = n; next_v != nullptr && t < BS; ++t) prefetch_slice<N, D * BS>(next_v, t, BS);
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// AVX2 forms of the two tiles for float32 blocks, in intrinsics so that the accumulators
// stay in registers and go straight to their destination (GCC's forms above zeroed and
// copied stack arrays with rep stos/movs, a quarter of their time). Each output is the
// same chain of FMAs as above. The next block's prefetches are spread over all passes, as
// above over the one loop. Scores: NQ queries x up to 16 tokens per pass.
template <int64_t BS, int64_t D, int NQ, typename N>
void scores_tile_avx2(const float* __restrict kblock, const float* __restrict qf,
                      float* __restrict scores, const N* next_k) {
  constexpr int TV = BS >= 16 ? 2 : 1;  // token vectors per pass
  constexpr int64_t kPasses = BS / (8 * TV);
  for (int64_t t0 = 0, pass = 0; t0 < BS; t0 += 8 * TV, ++pass) {
    __m256 s[NQ][TV];
    _Pragma("GCC unroll 8") for (int q = 0; q < NQ; ++q)
      _Pragma("GCC unroll 2") for (int v = 0; v < TV; ++v) s[q][v] = _mm256_setzero_ps();
    for (int64_t j = 0; j < D; ++j) {
      if (next_k != nullptr) prefetch_slice<N, D * BS>(next_k, pass * D + j, kPasses * D);
      __m256 k[TV];
      _Pragma("GCC unroll 2") for (int v = 0; v < TV; ++v)
        k[v] = _mm256_loadu_ps(kblock + j * BS + t0 + 8 * v);
      _Pragma("GCC unroll 8") for (int q = 0; q < NQ; ++q) {
        const __m256 qj = _mm256_broadcast_ss(qf + q * D + j);
        _Pragma("GCC unroll 2") for (int v = 0; v < TV; ++v)
          s[q][v] = _mm256_fmadd_ps(qj, k[v], s[q][v]);
      }
    }
    _Pragma("GCC unroll 8") for (int q = 0; q < NQ; ++q)
      _Pragma("GCC unroll 2") for (int v = 0; v < TV; ++v)
        _mm256_storeu_ps(scores + q * BS + t0 + 8 * v, s[q][v]);
  }
}

// Values: NQ queries x 16 of D per pass (NQ x 2 accumulators, two value vectors and a
// broadcast fit 16 registers up to NQ = 6).
template <int64_t BS, int64_t D, int NQ, typename N>
void values_tile_avx2(const float* __restrict vblock, const float* __restrict probs,
                      const float* __restrict correction, int64_t n, float* __restrict acc,
                      const N* next_v) {
  constexpr int DV = D >= 16 ? 2 : 1;  // vectors of D per pass
  constexpr int64_t kPasses = D / (8 * DV);
  for (int64_t d0 = 0, pass = 0; d0 < D; d0 += 8 * DV, ++pass) {
    __m256 a[NQ][DV];
    _Pragma("GCC unroll 8") for (int q = 0; q < NQ; ++q) {
      const __m256 c = _mm256_broadcast_ss(correction + q);
      _Pragma("GCC unroll 2") for (int v = 0; v < DV; ++v)
        a[q][v] = _mm256_mul_ps(_mm256_loadu_ps(acc + q * D + d0 + 8 * v), c);
    }
    for (int64_t t = 0; t < n; ++t) {
      if (next_v != nullptr) prefetch_slice<N, D * BS>(next_v, pass * BS + t, kPasses * BS);
      __m256 x[DV];
      _Pragma("GCC unroll 2") for (int v = 0; v < DV; ++v)
        x[v] = _mm256_loadu_ps(vblock + t * D + d0 + 8 * v);
      _Pragma("GCC unroll 8") for (int q = 0; q < NQ; ++q) {
        const __m256 p = _mm256_broadcast_ss(probs + q * BS + t);
        _Pragma("GCC unroll 2") for (int v = 0; v < DV; ++v)
          a[q][v] = _mm256_fmadd_ps(p, x[v], a[q][v]);
      }
    }
    _Pragma("GCC unroll 8") for (int q = 0; q < NQ; ++q)
      _Pragma("GCC unroll 2") for (int v = 0; v < DV; ++v)
        _mm256_storeu_ps(acc + q * D + d0 + 8 * v, a[q][v]);
    for (int64_t t = n; next_v != nullptr && t < BS; ++t)
      prefetch_slice<N, D * BS>(next_v, pass * BS + t, kPasses * BS);
  }
}

#define PAGEDSERVE_AVX2_TILES 1
#endif

// The tile for T: the AVX2 forms for float32 where they are built, else the generic ones.
template <typename T, int64_t BS, int64_t D, int NQ, typename N>
void scores_of(const T* kblock, const float* qf, float* scores, const N* next_k) {
#ifdef PAGEDSERVE_AVX2_TILES
  if constexpr (std::is_same_v<T, float>)
    return scores_tile_avx2<BS, D, NQ>(kblock, qf, scores, next_k);
  else
#endif
    return scores_tile<T, BS, D, NQ>(kblock, qf, scores, next_k);
}
template <typename T, int64_t BS, int64_t D, int NQ, typename N>
void values_of(const T* vblock, const float* probs, const float* correction, int64_t n,
               float* acc, const N* next_v) {
#ifdef PAGEDSERVE_AVX2_TILES
  if constexpr (std::is_same_v<T, float>)
    return values_tile_avx2<BS, D, NQ>(vblock, probs, correction, n, acc, next_v);
  else
#endif
    return values_tile<T, BS, D, NQ>(vblock, probs, correction, n, acc, next_v);
}

// Queries whose values a block's rows accumulate at once: a lone row's (bf16 rows are
// converted once for up to four), a shared block's (float32). The AVX2 tiles take six; the
// generic ones hold a query's whole d in registers, so three with AVX-512's 32, else one.
#ifdef PAGEDSERVE_AVX2_TILES
template <typename T>
constexpr int kLoneValueTile = std::is_same_v<T, float> ? 6 : 4;
constexpr int kSharedValueTile = 6;
#else
template <typename T>
constexpr int kLoneValueTile = 4;
#if defined(__AVX512F__)
constexpr int kSharedValueTile = 3;
#else
constexpr int kSharedValueTile = 1;
#endif
#endif

template <typename T, int64_t BS, int64_t D, typename N>
void block_scores(const T* kblock, const float* qf, int64_t nq, float* scores,
                  const N* next_k) {
  // 6 queries: their 12 accumulators, two key vectors and a broadcast fill AVX2's 16 vector
  // registers (prefill attention 1.13-1.18x against tiles of 4, bit-identical).
  int64_t q = 0;
  for (; q + 6 <= nq; q += 6) {
    scores_of<T, BS, D, 6>(kblock, qf + q * D, scores + q * BS, next_k);
    next_k = nullptr;  // the first tile fetched it
  }
  if (nq - q >= 4) {
    scores_of<T, BS, D, 4>(kblock, qf + q * D, scores + q * BS, next_k);
    next_k = nullptr;
    q += 4;
  }
  switch (nq - q) {
    case 3: return scores_of<T, BS, D, 3>(kblock, qf + q * D, scores + q * BS, next_k);
    case 2: return scores_of<T, BS, D, 2>(kblock, qf + q * D, scores + q * BS, next_k);
    case 1: return scores_of<T, BS, D, 1>(kblock, qf + q * D, scores + q * BS, next_k);
    default: return;
  }
}

// Queries qlo..qhi-1, query q over its first n[q] tokens of the block, in tiles of up to
// MaxTile queries that read the same number of tokens.
template <typename T, int64_t BS, int64_t D, int MaxTile, typename N>
void block_values(const T* vblock, const float* probs, const float* correction,
                  const int64_t* n, int64_t qlo, int64_t qhi, float* acc, const N* nv) {
  for (int64_t q = qlo; q < qhi;) {
    int64_t tile = 1;
    while (tile < MaxTile && q + tile < qhi && n[q + tile] == n[q]) ++tile;
    const float* p = probs + q * BS;
    switch (tile) {
      case 6: values_of<T, BS, D, 6>(vblock, p, correction + q, n[q], acc + q * D, nv); break;
      case 5: values_of<T, BS, D, 5>(vblock, p, correction + q, n[q], acc + q * D, nv); break;
      case 4: values_of<T, BS, D, 4>(vblock, p, correction + q, n[q], acc + q * D, nv); break;
      case 3: values_of<T, BS, D, 3>(vblock, p, correction + q, n[q], acc + q * D, nv); break;
      case 2: values_of<T, BS, D, 2>(vblock, p, correction + q, n[q], acc + q * D, nv); break;
      default: values_of<T, BS, D, 1>(vblock, p, correction + q, n[q], acc + q * D, nv);
    }
    nv = nullptr;
    q += tile;
  }
}

}  // namespace pagedserve_cpu
