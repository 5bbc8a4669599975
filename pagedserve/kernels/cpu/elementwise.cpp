// Element-wise kernels: RMSNorm (fused with the residual add), RoPE in place, SwiGLU, and
// the argmax of each row (greedy sampling).
// One pass each where eager PyTorch makes five to ten. Same semantics as reference.py.
#include "common.h"

// These loops are vectorized by the compiler, which on recent Intel targets defaults to
// 256-bit vectors; 512-bit ones make them 1.2-1.4x faster here. (Not for attention.cpp, whose
// decode loop came out slightly slower with them.)
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#pragma GCC target("prefer-vector-width=512")
#endif

namespace pagedserve_cpu {

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
// Rotate-half: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) in float32, then rounded to T.
// Each product is rounded before the sum, as the eager ops round it: a fused multiply-add
// changed 1 bf16 value in 60,000, and with it greedy tokens in bf16.
template <typename T>
__attribute__((optimize("fp-contract=off")))
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
  const int64_t* pp = pos.data_ptr<int64_t>();
  const bool in_table = std::all_of(pp, pp + pos.numel(),
                                    [&](int64_t p) { return p >= 0 && p < cos.size(0); });
  TORCH_CHECK(in_table, "position outside the rotary table");
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

// ---- argmax of each row ----------------------------------------------------------------
// torch.max(dim=-1).indices: the first maximum, and a NaN counts as the maximum (the first
// NaN wins). One pass in chunks: a chunk's max is a vector reduction, and only the first
// chunk that raised the running max is searched for the index.
template <typename T>
int64_t row_argmax(const T* __restrict x, int64_t n) {
  constexpr int64_t kChunk = 256;
  float best = -std::numeric_limits<float>::infinity();
  int64_t best_chunk = 0;
  for (int64_t c = 0; c < n; c += kChunk) {
    const int64_t len = std::min(kChunk, n - c);
    float m = -std::numeric_limits<float>::infinity();
    int32_t nans = 0;
#pragma omp simd reduction(max : m) reduction(+ : nans)
    for (int64_t j = 0; j < len; ++j) {
      const float v = to_f(x[c + j]);
      m = std::max(m, v);
      nans += v != v;
    }
    if (nans > 0) {
      for (int64_t j = 0;; ++j)
        if (to_f(x[c + j]) != to_f(x[c + j])) return c + j;
    }
    if (m > best) {  // an all -inf row keeps chunk 0, whose first entry is the answer
      best = m;
      best_chunk = c;
    }
  }
  for (int64_t j = best_chunk;; ++j)
    if (to_f(x[j]) == best) return j;
}

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0, "argmax_rows takes [rows, n > 0]");
  check_last_dim_contiguous(x, "x");
  auto out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t rows = x.size(0), n = x.size(1), xs = x.stride(0);
  dispatch(x.scalar_type(), "argmax_rows", [&](auto zero) {
    using T = decltype(zero);
    const T* xp = ptr<T>(x);
    at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) op[i] = row_argmax(xp + i * xs, n);
    });
  });
  return out;
}

}  // namespace pagedserve_cpu
