// Paged attention's two products in float32 arithmetic, on key blocks stored d-major
// ([d][BS]) and value blocks row-major ([BS][d]), bf16 converted as it is read: the tiles
// attention.cpp uses wherever bf16_pairs.h does not apply.
#pragma once

#include "common.h"

namespace pagedserve_cpu {

// Queries whose values a shared block's rows accumulate at once: one on AVX2, whose 16
// vector registers two queries' accumulators would overflow; three with AVX-512's 32.
#if defined(__AVX512F__)
constexpr int kSharedValueTile = 3;
#else
constexpr int kSharedValueTile = 1;
#endif

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

template <typename T, int64_t BS, int64_t D, typename N>
void block_scores(const T* kblock, const float* qf, int64_t nq, float* scores,
                  const N* next_k) {
  // 6 queries: their 12 accumulators, two key vectors and a broadcast fill AVX2's 16 vector
  // registers (prefill attention 1.13-1.18x against tiles of 4, bit-identical).
  int64_t q = 0;
  for (; q + 6 <= nq; q += 6) {
    scores_tile<T, BS, D, 6>(kblock, qf + q * D, scores + q * BS, next_k);
    next_k = nullptr;  // the first tile fetched it
  }
  if (nq - q >= 4) {
    scores_tile<T, BS, D, 4>(kblock, qf + q * D, scores + q * BS, next_k);
    next_k = nullptr;
    q += 4;
  }
  switch (nq - q) {
    case 3: return scores_tile<T, BS, D, 3>(kblock, qf + q * D, scores + q * BS, next_k);
    case 2: return scores_tile<T, BS, D, 2>(kblock, qf + q * D, scores + q * BS, next_k);
    case 1: return scores_tile<T, BS, D, 1>(kblock, qf + q * D, scores + q * BS, next_k);
    default: return;
  }
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
      case 4: values_tile<T, BS, D, 4>(vblock, p, correction + q, n[q], acc + q * D, nv); break;
      case 3: values_tile<T, BS, D, 3>(vblock, p, correction + q, n[q], acc + q * D, nv); break;
      case 2: values_tile<T, BS, D, 2>(vblock, p, correction + q, n[q], acc + q * D, nv); break;
      default: values_tile<T, BS, D, 1>(vblock, p, correction + q, n[q], acc + q * D, nv);
    }
    nv = nullptr;
    q += tile;
  }
}

}  // namespace pagedserve_cpu
