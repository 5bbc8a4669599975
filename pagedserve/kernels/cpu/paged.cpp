// Paged-memory kernels: decode attention straight from the blocks, the K/V store by slot,
// and the per-sequence K/V gather for prefill. Same semantics as kernels/reference.py.
#include "common.h"

namespace pagedserve_cpu {

// ---- paged decode attention -------------------------------------------------------------
// One query per sequence; keys 0..context_len-1 through the block table. Work item =
// (sequence, KV head): the `group` query heads sharing that KV head read each key once.
// Layout (checked by the caller): a key block of one head is stored d-major, [d][BS], so
// the scores of all BS tokens accumulate in one vector per query head with no horizontal
// sums; a value block is row-major, [BS][d], so the output accumulates along d.

// scores[g][t] = q_g . key_t for the BS tokens of one block (tokens past the context are
// computed too, from whatever the slot holds, and ignored by the caller).
template <int64_t BS, int64_t D>
void block_scores(const float* __restrict kbuf, const float* __restrict qf, int64_t group,
                  float* __restrict scores) {
  for (int64_t g = 0; g < group; ++g) {
    float s[BS] = {};
    const float* qg = qf + g * D;
    for (int64_t j = 0; j < D; ++j) {
      const float qj = qg[j];
#pragma omp simd
      for (int64_t t = 0; t < BS; ++t) s[t] += qj * kbuf[j * BS + t];
    }
    std::copy_n(s, BS, scores + g * BS);
  }
}

// acc[g] = acc[g] * correction[g] + sum_t p[g][t] * value_t, over the n live tokens.
template <int64_t BS, int64_t D>
void block_values(const float* __restrict vbuf, const float* __restrict probs,
                  const float* __restrict correction, int64_t group, int64_t n,
                  float* __restrict acc) {
  for (int64_t g = 0; g < group; ++g) {
    float a[D];
    const float c = correction[g];
#pragma omp simd
    for (int64_t j = 0; j < D; ++j) a[j] = acc[g * D + j] * c;
    for (int64_t t = 0; t < n; ++t) {
      const float p = probs[g * BS + t];
#pragma omp simd
      for (int64_t j = 0; j < D; ++j) a[j] += p * vbuf[t * D + j];
    }
    std::copy_n(a, D, acc + g * D);
  }
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

  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    FlushDenormals ftz;
    std::vector<float> qf(group * D), acc(group * D), kbuf(D * BS), vbuf(BS * D);
    std::vector<float> scores(group * BS), m(group), l(group), correction(group);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / Hkv, h = item % Hkv;
      const int64_t ctx = lp[b];
      const int32_t* table = tp + b * tsB;
      for (int64_t g = 0; g < group; ++g) {
        const T* src = qp + b * qsB + (h * group + g) * qsH;
        for (int64_t j = 0; j < D; ++j) qf[g * D + j] = to_f(src[j]) * fscale;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.f);
      for (int64_t start = 0; start < ctx; start += BS) {
        const int64_t n = std::min(BS, ctx - start);
        const T* kb = kp + table[start / BS] * ksN + h * ksH;
        const T* vb = vp + table[start / BS] * vsN + h * vsH;
        if (start + BS < ctx) {  // blocks are scattered: fetch the next one while on this
          const int64_t next = table[start / BS + 1];
          prefetch(kp + next * ksN + h * ksH, D * BS);
          prefetch(vp + next * vsN + h * vsH, D * BS);
        }
        load_row(kb, kbuf.data(), D * BS);
        load_row(vb, vbuf.data(), n * D);
        block_scores<BS, D>(kbuf.data(), qf.data(), group, scores.data());
        // Online softmax: rescale what was accumulated when the running max grows.
        for (int64_t g = 0; g < group; ++g) {
          float* sg = scores.data() + g * BS;
          float block_max = sg[0];
          for (int64_t t = 1; t < n; ++t) block_max = std::max(block_max, sg[t]);
          const float new_max = std::max(m[g], block_max);
          correction[g] = std::exp(m[g] - new_max);
#pragma omp simd
          for (int64_t t = 0; t < BS; ++t) sg[t] = t < n ? fast_exp(sg[t] - new_max) : 0.f;
          float sum = 0.f;
          for (int64_t t = 0; t < n; ++t) sum += sg[t];
          l[g] = l[g] * correction[g] + sum;
          m[g] = new_max;
        }
        block_values<BS, D>(vbuf.data(), scores.data(), correction.data(), group, n,
                            acc.data());
      }
      for (int64_t g = 0; g < group; ++g) {
        T* dst = op + (b * H + h * group + g) * D;
        const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
        for (int64_t j = 0; j < D; ++j) dst[j] = from_f<T>(acc[g * D + j] * inv);
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
// Any cache strides (the key cache is d-major per block); slot -1 writes nothing.
template <typename T>
void store_rows(const at::Tensor& src, at::Tensor& cache, const int64_t* slots) {
  const int64_t Tn = src.size(0), heads = src.size(1), d = src.size(2);
  const int64_t bs = cache.size(1), sN = cache.stride(0), sT = cache.stride(1);
  const int64_t sH = cache.stride(2), sD = cache.stride(3);
  const T* sp = ptr<T>(src);
  T* cp = mut_ptr<T>(cache);
  for (int64_t t = 0; t < Tn; ++t) {
    if (slots[t] < 0) continue;
    T* slot = cp + (slots[t] / bs) * sN + (slots[t] % bs) * sT;
    for (int64_t h = 0; h < heads; ++h) {
      const T* from = sp + t * src.stride(0) + h * src.stride(1);
      T* to = slot + h * sH;
      for (int64_t j = 0; j < d; ++j) to[j * sD] = from[j];
    }
  }
}

void store_kvcache(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache,
                   at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.scalar_type() == k_cache.scalar_type() &&
                  value.scalar_type() == v_cache.scalar_type(),
              "key/value and the caches must share a dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong, "slot_mapping must be int64");
  check_last_dim_contiguous(key, "key");
  check_last_dim_contiguous(value, "value");
  auto slots = slot_mapping.contiguous();
  dispatch(key.scalar_type(), "store_kvcache", [&](auto zero) {
    store_rows<decltype(zero)>(key, k_cache, slots.data_ptr<int64_t>());
    store_rows<decltype(zero)>(value, v_cache, slots.data_ptr<int64_t>());
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
