// CPU kernels for pagedserve: the same semantics as kernels/reference.py, without the
// temporaries PyTorch ops need. Paged decode attention reads each key and value once,
// straight from its block (the reference gathers every block into a copy first), and the
// element-wise ops do in one pass what eager PyTorch does in five to ten.
//
// Built on first use by kernels/cpu_ops.py (torch.utils.cpp_extension); every op works
// on float32 and bfloat16 with float32 arithmetic inside. Threads: at::parallel_for, so
// torch.set_num_threads applies.

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <bit>
#include <limits>
#include <vector>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace {

// Element types: float, or bfloat16 held as its raw uint16_t bits. Arithmetic is float32;
// bfloat16 converts by bit manipulation (round to nearest even, like PyTorch) so that the
// loops over rows vectorize.
using bf16_bits = uint16_t;

inline float to_f(float x) { return x; }
inline float to_f(bf16_bits x) {
  return std::bit_cast<float>(static_cast<uint32_t>(x) << 16);
}

template <typename T>
inline T from_f(float f);
template <>
inline float from_f<float>(float f) { return f; }
template <>
inline bf16_bits from_f<bf16_bits>(float f) {
  const auto u = std::bit_cast<uint32_t>(f);
  const auto rounded = static_cast<bf16_bits>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  return f != f ? bf16_bits{0x7fc0} : rounded;
}

// Runs `body` with scalar_t bound to the element type of `dtype`.
template <typename F>
void dispatch(at::ScalarType dtype, const char* name, F body) {
  if (dtype == at::kFloat) {
    body(float{});
  } else if (dtype == at::kBFloat16) {
    body(bf16_bits{});
  } else {
    TORCH_CHECK(false, name, ": float32 or bfloat16 only, got ", dtype);
  }
}

template <typename T>
inline const T* ptr(const at::Tensor& t) { return static_cast<const T*>(t.data_ptr()); }
template <typename T>
inline T* mut_ptr(at::Tensor& t) { return static_cast<T*>(t.data_ptr()); }

// Rounds through the working dtype, as an eager op that materializes a tensor would.
template <typename T>
inline float round_to(float f) { return to_f(from_f<T>(f)); }

// exp for float32 that the compiler can vectorize (std::exp is a scalar call): range
// reduction to |r| <= ln2/2 and a degree-6 polynomial; ~1 ulp, clamps far tails.
inline float fast_exp(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  // n = round(x / ln2); the offset keeps the truncating conversion a floor.
  const int32_t k = static_cast<int32_t>(x * 1.44269504088896341f + 128.5f) - 128;
  const float n = static_cast<float>(k);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  return p * std::bit_cast<float>((k + 127) << 23);
}

// Flush denormal inputs and results to zero while a kernel runs: the compiler evaluates
// both sides of fast_exp's clamp, and a tiny quotient on the unused side costs a ~100-cycle
// microcode assist per vector (seen: silu 12x slower). Restored on exit.
class FlushDenormals {
 public:
#if defined(__x86_64__) || defined(__i386__)
  FlushDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | 0x8040u); }
  ~FlushDenormals() { _mm_setcsr(saved_); }

 private:
  unsigned saved_;
#endif
};

template <typename T>
inline void prefetch(const T* base, int64_t count) {
  for (int64_t i = 0; i < count; i += 64 / static_cast<int64_t>(sizeof(T)))
    __builtin_prefetch(base + i);
}

template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = to_f(src[i]);
}

// Element-wise ops split rows across threads only when there are many: waking a sleeping
// OpenMP thread costs tens of microseconds, more than a decode step's few rows take.
constexpr int64_t kRowsPerTask = 128;

void check_last_dim_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.stride(-1) == 1, name, ": the last dimension must be contiguous");
}

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

// ---- RMSNorm, optionally fused with the residual add --------------------------------------
// With a residual: residual += x (rounded to the working dtype, as an eager add would),
// then the result is normalized. out = weight * dtype(r * rsqrt(mean(r^2) + eps)).
template <typename T>
void rms_norm_row(const T* __restrict src, T* __restrict res, const T* __restrict w,
                  T* __restrict dst, float* __restrict r, int64_t D, float eps) {
  if (res != nullptr) {
#pragma omp simd
    for (int64_t j = 0; j < D; ++j) {
      r[j] = round_to<T>(to_f(src[j]) + to_f(res[j]));
      res[j] = from_f<T>(r[j]);
    }
  } else {
    load_row(src, r, D);
  }
  float sq = 0.f;
#pragma omp simd reduction(+ : sq)
  for (int64_t j = 0; j < D; ++j) sq += r[j] * r[j];
  const float inv = 1.f / std::sqrt(sq / static_cast<float>(D) + eps);
#pragma omp simd
  for (int64_t j = 0; j < D; ++j) dst[j] = from_f<T>(to_f(w[j]) * round_to<T>(r[j] * inv));
}

template <typename T>
void rms_norm_impl(const at::Tensor& x, T* residual, const at::Tensor& weight, at::Tensor& out,
                   double eps) {
  const int64_t rows = x.size(0), D = x.size(1), xs = x.stride(0);
  const T* xp = ptr<T>(x);
  const T* wp = ptr<T>(weight);
  T* op = mut_ptr<T>(out);
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    FlushDenormals ftz;
    std::vector<float> r(D);
    for (int64_t i = begin; i < end; ++i)
      rms_norm_row(xp + i * xs, residual == nullptr ? nullptr : residual + i * D, wp, op + i * D,
                   r.data(), D, static_cast<float>(eps));
  });
}

at::Tensor rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                    const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2, "rms_norm takes [rows, hidden]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "weight and x must share a dtype");
  check_last_dim_contiguous(x, "x");
  auto w = weight.contiguous();
  auto out = at::empty({x.size(0), x.size(1)}, x.options());
  dispatch(x.scalar_type(), "rms_norm", [&](auto zero) {
    using scalar_t = decltype(zero);
    scalar_t* res = nullptr;
    if (residual.has_value()) {
      TORCH_CHECK(residual->is_contiguous() && residual->sizes() == x.sizes() &&
                      residual->scalar_type() == x.scalar_type(),
                  "residual must be contiguous, shaped and typed like x");
      res = static_cast<scalar_t*>(residual->data_ptr());
    }
    rms_norm_impl<scalar_t>(x, res, w, out, eps);
  });
  return out;
}

// ---- rotary embedding, in place ---------------------------------------------------------
// x: [T, heads, d] (any strides, d contiguous); cos/sin: [max_positions, d/2] float32.
// Rotate-half: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), in float32, rounded once.
template <typename T>
void rope_row(T* __restrict v, const float* __restrict c, const float* __restrict s,
              int64_t half) {
#pragma omp simd
  for (int64_t j = 0; j < half; ++j) {
    const float x1 = to_f(v[j]), x2 = to_f(v[j + half]);
    v[j] = from_f<T>(x1 * c[j] - x2 * s[j]);
    v[j + half] = from_f<T>(x2 * c[j] + x1 * s[j]);
  }
}

template <typename T>
void rope_impl(at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos,
               const at::Tensor& sin) {
  const int64_t Tn = x.size(0), heads = x.size(1), half = x.size(2) / 2;
  const int64_t sT = x.stride(0), sH = x.stride(1);
  T* xp = mut_ptr<T>(x);
  const int64_t* pp = positions.data_ptr<int64_t>();
  const float* cp = cos.data_ptr<float>();
  const float* snp = sin.data_ptr<float>();
  at::parallel_for(0, Tn, kRowsPerTask, [&](int64_t begin, int64_t end) {
    FlushDenormals ftz;
    for (int64_t t = begin; t < end; ++t)
      for (int64_t h = 0; h < heads; ++h)
        rope_row(xp + t * sT + h * sH, cp + pp[t] * half, snp + pp[t] * half, half);
  });
}

void rope_(at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos,
           const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.size(2) % 2 == 0, "rope_ takes [tokens, heads, even d]");
  TORCH_CHECK(positions.scalar_type() == at::kLong, "positions must be int64");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.size(1) == x.size(2) / 2,
              "cos/sin must be contiguous float32 [positions, d/2]");
  check_last_dim_contiguous(x, "x");
  auto pos = positions.contiguous();
  TORCH_CHECK(pos.numel() == 0 || (pos.min().item<int64_t>() >= 0 &&
                                   pos.max().item<int64_t>() < cos.size(0)),
              "position outside the rotary table");
  dispatch(x.scalar_type(), "rope_", [&](auto zero) {
    rope_impl<decltype(zero)>(x, pos, cos, sin);
  });
}

// ---- SwiGLU: silu(gate) * up ------------------------------------------------------------
// x: [T, 2I] = [gate | up]. Rounded after silu and after the product, like the eager ops.
template <typename T>
void silu_mul_row(const T* __restrict gate, const T* __restrict up, T* __restrict dst,
                  int64_t I) {
#pragma omp simd
  for (int64_t j = 0; j < I; ++j) {
    const float g = to_f(gate[j]);
    dst[j] = from_f<T>(round_to<T>(g / (1.f + fast_exp(-g))) * to_f(up[j]));
  }
}

template <typename T>
void silu_mul_impl(const at::Tensor& x, at::Tensor& out) {
  const int64_t Tn = x.size(0), I = x.size(1) / 2, xs = x.stride(0);
  const T* xp = ptr<T>(x);
  T* op = mut_ptr<T>(out);
  at::parallel_for(0, Tn, kRowsPerTask, [&](int64_t begin, int64_t end) {
    FlushDenormals ftz;
    for (int64_t t = begin; t < end; ++t) silu_mul_row(xp + t * xs, xp + t * xs + I, op + t * I, I);
  });
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "silu_and_mul takes [tokens, 2 * inter]");
  check_last_dim_contiguous(x, "x");
  auto out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  dispatch(x.scalar_type(), "silu_and_mul", [&](auto zero) {
    silu_mul_impl<decltype(zero)>(x, out);
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention);
  m.def("store_kvcache", &store_kvcache);
  m.def("decode_layout_ok", &decode_layout_ok);
  m.def("gather_kv", &gather_kv);
  m.def("rms_norm", &rms_norm);
  m.def("rope_", &rope_);
  m.def("silu_and_mul", &silu_and_mul);
}
