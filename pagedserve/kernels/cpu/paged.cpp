// Paged-memory kernels: decode attention straight from the blocks, the K/V store by slot,
// and the per-sequence K/V gather for prefill. Same semantics as kernels/reference.py.
#include "common.h"

namespace pagedserve_cpu {

// ---- paged decode attention -------------------------------------------------------------
// One query per sequence; keys 0..context_len-1 through the block table. Work item =
// (cluster, KV head), where a cluster is a run of consecutive sequences that start with the
// same physical block (the samples of one request after a fork, or requests on one cached
// prefix), at most kMaxCluster long. A block that several of them share is loaded and
// converted once for all their query heads; a lone sequence is a cluster of one. Each
// query's arithmetic, and so its result, is the same whichever cluster it is in.
// Layout (checked by the caller): a key block of one head is stored d-major, [d][BS], so
// the scores of all BS tokens accumulate in one vector per query head with no horizontal
// sums; a value block is row-major, [BS][d], so the output accumulates along d.
constexpr int64_t kMaxCluster = 16;

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
  int64_t q = 0;
  for (; q + 4 <= nq; q += 4) {
    scores_tile<T, BS, D, 4>(kblock, qf + q * D, scores + q * BS, next_k);
    next_k = nullptr;  // the first tile fetched it
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

// Online softmax over one block for query q: scores become probabilities relative to the
// new running max, and what was accumulated is rescaled by correction when the max grows.
template <int64_t BS>
void softmax_step(float* __restrict sg, int64_t n, float& m, float& l, float& correction) {
  float block_max = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : block_max)
  for (int64_t t = 0; t < BS; ++t)
    block_max = std::max(block_max, t < n ? sg[t] : -std::numeric_limits<float>::infinity());
  const float new_max = std::max(m, block_max);
  correction = new_max == m ? 1.f : std::exp(m - new_max);  // the max rarely moves
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = 0; t < BS; ++t) {
    const float p = t < n ? fast_exp(sg[t] - new_max) : 0.f;
    sg[t] = p;
    sum += p;
  }
  l = l * correction + sum;
  m = new_max;
}

// The batch's sequences grouped into clusters (see above): each cluster's first row, then
// num_seqs.
std::vector<int64_t> cluster_starts(const int32_t* tables, int64_t stride, const int32_t* lens,
                                    int64_t num_seqs) {
  std::vector<int64_t> starts;
  for (int64_t b = 0; b < num_seqs; ++b) {
    const bool joins = !starts.empty() && b - starts.back() < kMaxCluster && lens[b] > 0 &&
                       lens[b - 1] > 0 && tables[b * stride] == tables[(b - 1) * stride];
    if (!joins) starts.push_back(b);
  }
  starts.push_back(num_seqs);
  return starts;
}

template <typename T, int64_t BS, int64_t D>
void decode_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 const at::Tensor& tables, const at::Tensor& lens, at::Tensor& out,
                 double scale) {
  const int64_t B = q.size(0), H = q.size(1);
  const int64_t Hkv = k_cache.size(2), group = H / Hkv;
  const T* qp = ptr<T>(q);
  const T* kp = ptr<T>(k_cache);
  const T* vp = ptr<T>(v_cache);
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  T* op = mut_ptr<T>(out);
  const int64_t qsB = q.stride(0), qsH = q.stride(1), tsB = tables.stride(0);
  const int64_t ksN = k_cache.stride(0), ksH = k_cache.stride(2);
  const int64_t vsN = v_cache.stride(0), vsH = v_cache.stride(2);
  const float fscale = static_cast<float>(scale);
  const std::vector<int64_t> starts = cluster_starts(tp, tsB, lp, B);
  const int64_t num_clusters = static_cast<int64_t>(starts.size()) - 1;

  at::parallel_for(0, num_clusters * Hkv, 1, [&](int64_t begin, int64_t end) {
    FlushDenormals ftz;
    const int64_t most = kMaxCluster * group;
    std::vector<float> qf(most * D), acc(most * D), kbuf(D * BS), vbuf(BS * D);
    std::vector<float> scores(most * BS), m(most), l(most), correction(most);
    std::vector<int64_t> live(most);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t c = item / Hkv, h = item % Hkv;
      const int64_t first = starts[c], rows = starts[c + 1] - first;
      int64_t max_ctx = 0;
      for (int64_t r = 0; r < rows; ++r) {
        max_ctx = std::max<int64_t>(max_ctx, lp[first + r]);
        for (int64_t g = 0; g < group; ++g) {
          const T* src = qp + (first + r) * qsB + (h * group + g) * qsH;
          float* dst = qf.data() + (r * group + g) * D;
          for (int64_t j = 0; j < D; ++j) dst[j] = to_f(src[j]) * fscale;
        }
      }
      std::fill_n(acc.begin(), rows * group * D, 0.f);
      std::fill_n(m.begin(), rows * group, -std::numeric_limits<float>::infinity());
      std::fill_n(l.begin(), rows * group, 0.f);
      auto block_of = [&](int64_t r, int64_t start) {
        return start < lp[first + r] ? tp[(first + r) * tsB + start / BS] : -1;
      };
      for (int64_t start = 0; start < max_ctx; start += BS) {
        for (int64_t r = 0; r < rows;) {
          const int64_t id = block_of(r, start);
          if (id < 0) { ++r; continue; }
          // Rows r..r_end-1 read this physical block: load it once for all of them.
          int64_t r_end = r + 1, n_max = 0;
          while (r_end < rows && block_of(r_end, start) == id) ++r_end;
          for (int64_t s = r; s < r_end; ++s) {
            const int64_t n = std::min(BS, lp[first + s] - start);
            n_max = std::max(n_max, n);
            for (int64_t g = 0; g < group; ++g) live[s * group + g] = n;
          }
          // Blocks are scattered: fetch the next run's block (or the first row's next block,
          // or the next item's first block) while working on this one.
          const int64_t next = r_end < rows ? block_of(r_end, start) : block_of(0, start + BS);
          const T* next_k = nullptr;
          const T* next_v = nullptr;
          if (next >= 0) {
            next_k = kp + next * ksN + h * ksH;
            next_v = vp + next * vsN + h * vsH;
          } else if (item + 1 < end && lp[starts[(item + 1) / Hkv]] > 0) {
            const int64_t c2 = (item + 1) / Hkv, h2 = (item + 1) % Hkv;
            const int64_t id2 = tp[starts[c2] * tsB];
            next_k = kp + id2 * ksN + h2 * ksH;
            next_v = vp + id2 * vsN + h2 * vsH;
          }
          // One row's queries convert the block in registers as they read it; a run shared
          // by several rows converts it once into kbuf / vbuf instead.
          const bool lone = r_end - r == 1;
          const T* kblock = kp + id * ksN + h * ksH;
          const T* vblock = vp + id * vsN + h * vsH;
          const int64_t qlo = r * group, qhi = r_end * group;
          float* sq = scores.data() + qlo * BS;
          if (lone) {
            block_scores<T, BS, D>(kblock, qf.data() + qlo * D, qhi - qlo, sq, next_k);
          } else {
            load_row(kblock, kbuf.data(), D * BS);
            block_scores<float, BS, D>(kbuf.data(), qf.data() + qlo * D, qhi - qlo, sq, next_k);
          }
          for (int64_t qi = qlo; qi < qhi; ++qi)
            softmax_step<BS>(scores.data() + qi * BS, live[qi], m[qi], l[qi], correction[qi]);
          if (lone) {
            block_values<T, BS, D, 4>(vblock, scores.data(), correction.data(), live.data(), qlo,
                                      qhi, acc.data(), next_v);
          } else {
            load_row(vblock, vbuf.data(), n_max * D);  // slots past the context may be NaN
            block_values<float, BS, D, 2>(vbuf.data(), scores.data(), correction.data(),
                                          live.data(), qlo, qhi, acc.data(), next_v);
          }
          r = r_end;
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t g = 0; g < group; ++g) {
          const int64_t qi = r * group + g;
          T* dst = op + ((first + r) * H + h * group + g) * D;
          const float inv = l[qi] > 0.f ? 1.f / l[qi] : 0.f;
          for (int64_t j = 0; j < D; ++j) dst[j] = from_f<T>(acc[qi * D + j] * inv);
        }
      }
    }
  });
}

// Instantiates decode_impl for the common head and block sizes.
template <typename T, int64_t D>
void decode_for_block_size(int64_t bs, const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& tables,
                           const at::Tensor& lens, at::Tensor& out, double scale) {
  switch (bs) {
    case 8: return decode_impl<T, 8, D>(q, k_cache, v_cache, tables, lens, out, scale);
    case 16: return decode_impl<T, 16, D>(q, k_cache, v_cache, tables, lens, out, scale);
    case 32: return decode_impl<T, 32, D>(q, k_cache, v_cache, tables, lens, out, scale);
    case 64: return decode_impl<T, 64, D>(q, k_cache, v_cache, tables, lens, out, scale);
    default: TORCH_CHECK(false, "block size must be 8, 16, 32 or 64");
  }
}

// The cache layout decode_impl reads: per head, key blocks [d][BS] and value blocks [BS][d].
bool decode_layout_ok(const at::Tensor& k_cache, const at::Tensor& v_cache) {
  const int64_t bs = k_cache.size(1), d = k_cache.size(3);
  return k_cache.stride(1) == 1 && k_cache.stride(3) == bs && v_cache.stride(1) == d &&
         v_cache.stride(3) == 1 && v_cache.sizes() == k_cache.sizes();
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4, "bad ranks");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() &&
                  v_cache.scalar_type() == q.scalar_type(),
              "q and the caches must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt,
              "block tables and context lengths must be int32");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "heads must be a multiple of KV heads");
  check_last_dim_contiguous(q, "q");
  TORCH_CHECK(decode_layout_ok(k_cache, v_cache),
              "caches must hold key blocks d-major and value blocks row-major per head");
  auto tables = block_tables.contiguous();
  auto lens = context_lens.contiguous();
  auto out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  dispatch(q.scalar_type(), "paged_decode_attention", [&](auto zero) {
    using T = decltype(zero);
    const int64_t bs = k_cache.size(1);
    switch (q.size(2)) {
      case 16: return decode_for_block_size<T, 16>(bs, q, k_cache, v_cache, tables, lens, out, scale);
      case 32: return decode_for_block_size<T, 32>(bs, q, k_cache, v_cache, tables, lens, out, scale);
      case 64: return decode_for_block_size<T, 64>(bs, q, k_cache, v_cache, tables, lens, out, scale);
      case 128: return decode_for_block_size<T, 128>(bs, q, k_cache, v_cache, tables, lens, out, scale);
      default: TORCH_CHECK(false, "head size must be 16, 32, 64 or 128");
    }
  });
  return out;
}

// ---- store K/V by slot ------------------------------------------------------------------
// Any cache strides (the key cache is d-major per block); slot -1 writes nothing. The
// destinations are cold and scattered (a d-major key row touches d / (64 / BS / sizeof(T))
// cache lines), so misses dominate: each token's lines are prefetched for writing a few
// tokens ahead, and tokens are split across threads, keys and values in one pass.
template <typename T>
struct RowStore {
  const at::Tensor& src;
  at::Tensor& cache;
  const T* from_base = ptr<T>(src);
  int64_t fT = src.stride(0), fH = src.stride(1);
  T* base = mut_ptr<T>(cache);
  int64_t bs = cache.size(1), sN = cache.stride(0), sT = cache.stride(1);
  int64_t sH = cache.stride(2), sD = cache.stride(3);
  int64_t heads = src.size(1), d = src.size(2);
  int64_t line = std::max<int64_t>(1, 64 / (sD * static_cast<int64_t>(sizeof(T))));

  T* slot_ptr(int64_t slot) const { return base + (slot / bs) * sN + (slot % bs) * sT; }
  void prefetch_slot(int64_t slot) const {
    T* to = slot_ptr(slot);
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t j = 0; j < d; j += line) __builtin_prefetch(to + h * sH + j * sD, 1);
  }
  void store(int64_t t, int64_t slot) const {
    T* to = slot_ptr(slot);
    for (int64_t h = 0; h < heads; ++h) {
      const T* from = from_base + t * fT + h * fH;
      for (int64_t j = 0; j < d; ++j) to[h * sH + j * sD] = from[j];
    }
  }
};

template <typename T>
void store_rows(const RowStore<T>& keys, const RowStore<T>& values, const int64_t* slots,
                int64_t num_tokens) {
  constexpr int64_t kAhead = 16;
  at::parallel_for(0, num_tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (t + kAhead < end && slots[t + kAhead] >= 0) {
        keys.prefetch_slot(slots[t + kAhead]);
        values.prefetch_slot(slots[t + kAhead]);
      }
      if (slots[t] < 0) continue;
      keys.store(t, slots[t]);
      values.store(t, slots[t]);
    }
  });
}

void store_kvcache(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache,
                   at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.scalar_type() == k_cache.scalar_type() &&
                  value.scalar_type() == v_cache.scalar_type() &&
                  key.scalar_type() == value.scalar_type(),
              "key/value and the caches must share a dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong, "slot_mapping must be int64");
  check_last_dim_contiguous(key, "key");
  check_last_dim_contiguous(value, "value");
  auto slots = slot_mapping.contiguous();
  dispatch(key.scalar_type(), "store_kvcache", [&](auto zero) {
    using T = decltype(zero);
    store_rows<T>(RowStore<T>{key, k_cache}, RowStore<T>{value, v_cache},
                  slots.data_ptr<int64_t>(), key.size(0));
  });
}

// ---- gather one sequence's K/V for prefill ----------------------------------------------
// [ctx] tokens through the block table -> contiguous [H_kv * group, ctx, d] keys and values,
// each KV head written once per query head that reads it (the layout PyTorch's fused CPU
// attention takes), in one pass over any cache layout.
template <typename T>
void gather_rows(const at::Tensor& cache, const int32_t* table, int64_t ctx, int64_t group,
                 at::Tensor& out) {
  const int64_t bs = cache.size(1), heads = cache.size(2), d = cache.size(3);
  const int64_t sN = cache.stride(0), sT = cache.stride(1), sH = cache.stride(2);
  const int64_t sD = cache.stride(3);
  const T* cp = ptr<T>(cache);
  T* op = mut_ptr<T>(out);
  at::parallel_for(0, heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t h = begin; h < end; ++h) {
      T* dst = op + h * group * ctx * d;
      for (int64_t t = 0; t < ctx; ++t) {
        const T* src = cp + table[t / bs] * sN + (t % bs) * sT + h * sH;
        for (int64_t j = 0; j < d; ++j) dst[t * d + j] = src[j * sD];
      }
      for (int64_t g = 1; g < group; ++g) std::copy_n(dst, ctx * d, dst + g * ctx * d);
    }
  });
}

std::vector<at::Tensor> gather_kv(const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_table, int64_t ctx, int64_t group) {
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad cache shapes");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "caches must share a dtype");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.dim() == 1,
              "block_table must be 1-D int32");
  const int64_t bs = k_cache.size(1);
  TORCH_CHECK(ctx >= 0 && block_table.size(0) * bs >= ctx, "block table too short for ctx");
  auto table = block_table.contiguous();
  const int64_t heads = k_cache.size(2) * group, d = k_cache.size(3);
  auto keys = at::empty({heads, ctx, d}, k_cache.options());
  auto values = at::empty({heads, ctx, d}, v_cache.options());
  dispatch(k_cache.scalar_type(), "gather_kv", [&](auto zero) {
    using T = decltype(zero);
    gather_rows<T>(k_cache, table.data_ptr<int32_t>(), ctx, group, keys);
    gather_rows<T>(v_cache, table.data_ptr<int32_t>(), ctx, group, values);
  });
  return {keys, values};
}

}  // namespace pagedserve_cpu
