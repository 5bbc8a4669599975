// The online softmax of paged attention (attention.cpp), one block of scores at a time:
// each query's block maximum, the correction of what was accumulated, and the
// exponentials. Vector forms where the build has them (AVX-512: 16 tokens a vector, a
// partial block under a mask; AVX2: full blocks only), each with the same operations in the
// same order as the scalar loop, so every form gives the same bits.
#pragma once

#include "common.h"

namespace pagedserve_cpu {

#ifdef PAGEDSERVE_EXP16
// The lanes of a 16-token vector that hold one of the block's remaining live tokens.
inline __mmask16 first_lanes(int live) {
  return live >= 16 ? __mmask16{0xffff} : live > 0 ? __mmask16((1u << live) - 1) : __mmask16{0};
}
#endif

// The largest of a block's first n scores. n is an int, not int64_t: the masks then compare
// 8 lanes per AVX2 vector, not 4 and a repacking shuffle.
template <int64_t BS>
float block_max(const float* __restrict sg, int n) {
#ifdef PAGEDSERVE_EXP16
  if constexpr (BS % 16 == 0) {  // AVX-512: a full block, or a partial one under a mask
    __m512 v = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int t = 0; t < BS; t += 16) {
      const __mmask16 live = first_lanes(n - t);
      v = _mm512_mask_max_ps(v, live, v, _mm512_maskz_loadu_ps(live, sg + t));
    }
    return _mm512_reduce_max_ps(v);
  }
#endif
#ifdef PAGEDSERVE_EXP8
  if (n == BS) {  // a full block: no masks
    __m256 v = _mm256_loadu_ps(sg);
    for (int t = 8; t < BS; t += 8) v = _mm256_max_ps(v, _mm256_loadu_ps(sg + t));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
  }
#endif
  float best = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : best)
  for (int t = 0; t < BS; ++t)
    best = std::max(best, t < n ? sg[t] : -std::numeric_limits<float>::infinity());
  return best;
}

// Scores become exp(score - max) (0 past the first n), and the normalizer lanes are
// rescaled by c and take them.
template <int64_t BS>
void exp_block(float* __restrict sg, int n, float max, float c, float* __restrict lanes) {
#ifdef PAGEDSERVE_EXP16
  if constexpr (BS % 16 == 0) {  // past n: p = 0 (the masked lanes of the exp are dropped)
    const __m512 m16 = _mm512_set1_ps(max), c16 = _mm512_set1_ps(c);
    for (int t = 0; t < BS; t += 16) {
      const __m512 p = _mm512_maskz_mov_ps(
          first_lanes(n - t), fast_exp16(_mm512_sub_ps(_mm512_loadu_ps(sg + t), m16)));
      _mm512_storeu_ps(sg + t, p);
      _mm512_storeu_ps(lanes + t, _mm512_fmadd_ps(_mm512_loadu_ps(lanes + t), c16, p));
    }
    return;
  }
#endif
#ifdef PAGEDSERVE_EXP8
  if (n == BS) {
    const __m256 m8 = _mm256_set1_ps(max), c8 = _mm256_set1_ps(c);
    for (int t = 0; t < BS; t += 8) {
      const __m256 p = fast_exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + t), m8));
      _mm256_storeu_ps(sg + t, p);
      _mm256_storeu_ps(lanes + t, _mm256_fmadd_ps(_mm256_loadu_ps(lanes + t), c8, p));
    }
    return;
  }
#endif
#pragma omp simd
  for (int t = 0; t < BS; ++t) {
    const float p = t < n ? fast_exp(sg[t] - max) : 0.f;
    sg[t] = p;
    lanes[t] = lanes[t] * c + p;
  }
}

// Online softmax over one block for queries 0..nq-1, query q over its first live[q] tokens:
// scores become probabilities relative to the new running max m[q], and what was
// accumulated is rescaled by correction[q] when the max grows. The normalizer is kept per
// token slot (lanes, summed once at the end): a horizontal sum per block was a chain of BS
// dependent adds, a third of this step's time. The vector forms above give the same bits
// as the scalar loops: GCC made the masked loops ~150 instructions per query and 16 tokens,
// 27% of prefill attention's time; AVX2 forms for full blocks took it to 19%, and AVX-512
// forms (16 lanes, partial blocks under masks) made prefill attention 1.05-1.11x faster
// again on a Zen 5 EPYC (docs/performance-zen5.md).
template <int64_t BS>
void softmax_block(float* __restrict scores, const int64_t* __restrict live, int64_t nq,
                   float* __restrict m, float* __restrict lanes,
                   float* __restrict correction) {
  static_assert(BS % 8 == 0, "the AVX2 forms take 8 tokens a vector");
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (int64_t q = 0; q < nq; ++q) {
    const float new_max = std::max(m[q], block_max<BS>(scores + q * BS, live[q]));
    // The max rarely moves; from -inf (the first block) the correction is exactly 0.
    correction[q] = new_max == m[q] ? 1.f : m[q] == kNegInf ? 0.f : std::exp(m[q] - new_max);
    m[q] = new_max;
  }
  for (int64_t q = 0; q < nq; ++q)
    exp_block<BS>(scores + q * BS, live[q], m[q], correction[q], lanes + q * BS);
}

// The sum of a query's normalizer lanes, in one fixed order.
template <int64_t BS>
float lane_sum(const float* lanes) {
  float sum = 0.f;
  for (int t = 0; t < BS; ++t) sum += lanes[t];
  return sum;
}

}  // namespace pagedserve_cpu
