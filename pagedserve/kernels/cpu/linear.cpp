// float32 linear layers (y = x W^T + b) on a weight packed once, for CPUs whose widest
// vectors are AVX2's (kernels/cpu/__init__.py decides). oneDNN's AVX2 code reached 58-70% of
// the FMA peak at the model's shapes (K of 576 or 1,536, 64 to 1,024 rows; its AVX-512 code
// ~90%); this register-tiled kernel gets more, most of all at decode batch sizes
// (docs/performance-linear.md).
//
// Packing: the weight [N][K] becomes panels of kCols output columns, each [K][kCols], so the
// micro-kernel reads one contiguous run of kCols values per k. Every output is one sum over
// k = 0..K-1 in order, whatever the tile, the batch or the thread: a row's result does not
// depend on the rows it is computed with (chunked = whole stays exact).
#include "common.h"

namespace pagedserve_cpu {

#if defined(__AVX2__) && defined(__FMA__)
constexpr int64_t kVecs = 3;              // AVX2 vectors of output columns per panel
constexpr int64_t kCols = 8 * kVecs;      // a panel's width: 24 columns
constexpr int64_t kRows = 4;              // rows per micro-tile: 4 x 3 = 12 accumulators,
                                          // 3 weight vectors and a broadcast in 16 registers
constexpr int64_t kCacheBytes = 1 << 18;  // what one task's weight panels (or input rows) take

// Rows x kCols outputs over all of K: acc[i][v] += x[i][k] * panel[k][8v..8v+7].
template <int Rows>
void micro_tile(const float* __restrict x, int64_t ldx, const float* __restrict panel,
                int64_t K, const float* __restrict bias, float* __restrict y, int64_t ldy,
                int64_t cols) {
  __m256 acc[Rows][kVecs];
  // Unrolled by pragma, not left to the late unroller: GCC then keeps acc in registers
  // instead of storing it to the stack on every k (measured 2x slower).
  _Pragma("GCC unroll 4") for (int i = 0; i < Rows; ++i)
    _Pragma("GCC unroll 3") for (int v = 0; v < kVecs; ++v) acc[i][v] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m256 w[kVecs];
    _Pragma("GCC unroll 3") for (int v = 0; v < kVecs; ++v)
      w[v] = _mm256_loadu_ps(panel + k * kCols + 8 * v);
    _Pragma("GCC unroll 4") for (int i = 0; i < Rows; ++i) {
      const __m256 xi = _mm256_broadcast_ss(x + i * ldx + k);
      _Pragma("GCC unroll 3") for (int v = 0; v < kVecs; ++v)
        acc[i][v] = _mm256_fmadd_ps(xi, w[v], acc[i][v]);
    }
  }
  // A full panel takes plain stores. Only the last panel may be partial: masked stores
  // there (a staging buffer would make GCC keep acc in memory). AMD's vmaskmovps store is
  // slow enough that using it on every tile cost 3-9% at the model's shapes.
  if (cols == kCols) {
    _Pragma("GCC unroll 3") for (int v = 0; v < kVecs; ++v) {
      const __m256 b = bias != nullptr ? _mm256_loadu_ps(bias + 8 * v) : _mm256_setzero_ps();
      _Pragma("GCC unroll 4") for (int i = 0; i < Rows; ++i)
        _mm256_storeu_ps(y + i * ldy + 8 * v, _mm256_add_ps(acc[i][v], b));
    }
    return;
  }
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  _Pragma("GCC unroll 3") for (int v = 0; v < kVecs; ++v) {
    const int live = static_cast<int>(cols - 8 * v);
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(live), lane);
    const __m256 b = bias != nullptr ? _mm256_maskload_ps(bias + 8 * v, mask)
                                     : _mm256_setzero_ps();
    _Pragma("GCC unroll 4") for (int i = 0; i < Rows; ++i)
      _mm256_maskstore_ps(y + i * ldy + 8 * v, mask, _mm256_add_ps(acc[i][v], b));
  }
}

bool has_linear_f32() { return true; }

at::Tensor pack_linear_f32(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat,
              "pack_linear_f32: a float32 [N, K] weight");
  const int64_t N = weight.size(0), K = weight.size(1), panels = (N + kCols - 1) / kCols;
  auto packed = at::zeros({panels, K, kCols}, weight.options());
  const auto w = weight.contiguous();
  const float* src = w.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t n = p * kCols; n < std::min(N, (p + 1) * kCols); ++n)
        for (int64_t k = 0; k < K; ++k) dst[(p * K + k) * kCols + n % kCols] = src[n * K + k];
  });
  return packed;
}

at::Tensor linear_f32(const at::Tensor& input, const at::Tensor& packed,
                      const c10::optional<at::Tensor>& bias, int64_t N) {
  const int64_t K = input.size(-1);
  TORCH_CHECK(input.scalar_type() == at::kFloat && packed.dim() == 3 &&
                  packed.size(1) == K && packed.size(2) == kCols &&
                  packed.size(0) == (N + kCols - 1) / kCols,
              "linear_f32: float32 input whose last dimension is the packed weight's K");
  const auto x = input.reshape({-1, K}).contiguous();
  const auto b = bias.has_value() ? bias->contiguous() : at::Tensor();
  TORCH_CHECK(!b.defined() || (b.scalar_type() == at::kFloat && b.numel() == N),
              "linear_f32: a float32 bias of N values");
  const int64_t M = x.size(0), panels = packed.size(0);
  auto out = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  float* yp = out.data_ptr<float>();
  // Tasks: a group of panels x a band of rows, each sized to stay in L2 while its rows (or
  // panels) stream past; panels-major, so that consecutive tasks share their panels.
  const int64_t threads = at::get_num_threads();
  const int64_t panel_bytes = K * kCols * 4;
  const int64_t group = std::clamp<int64_t>(
      std::min(kCacheBytes / panel_bytes, panels / (2 * threads)), 1, panels);
  const int64_t band = std::max<int64_t>(kRows, kCacheBytes / (K * 4) / kRows * kRows);
  const int64_t groups = (panels + group - 1) / group, bands = (M + band - 1) / band;
  parallel_tasks(groups * bands, [&](int64_t t) {
    const int64_t g = t / bands, m_end = std::min(M, (t % bands + 1) * band);
    const int64_t p_end = std::min(panels, (g + 1) * group);
    for (int64_t m = t % bands * band; m < m_end; m += kRows) {
      for (int64_t p = g * group; p < p_end; ++p) {
        const float* xr = xp + m * K;
        const float* panel = wp + p * K * kCols;
        const float* bias_p = bp != nullptr ? bp + p * kCols : nullptr;
        float* y = yp + m * N + p * kCols;
        const int64_t cols = std::min(kCols, N - p * kCols);
        switch (std::min(kRows, m_end - m)) {
          case 4: micro_tile<4>(xr, K, panel, K, bias_p, y, N, cols); break;
          case 3: micro_tile<3>(xr, K, panel, K, bias_p, y, N, cols); break;
          case 2: micro_tile<2>(xr, K, panel, K, bias_p, y, N, cols); break;
          default: micro_tile<1>(xr, K, panel, K, bias_p, y, N, cols);
        }
      }
    }
  });
  auto sizes = input.sizes().vec();
  sizes.back() = N;
  return out.view(sizes);
}
#else
bool has_linear_f32() { return false; }
at::Tensor pack_linear_f32(const at::Tensor&) { TORCH_CHECK(false, "built without AVX2/FMA"); }
at::Tensor linear_f32(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&,
                      int64_t) {
  TORCH_CHECK(false, "built without AVX2/FMA");
}
#endif

}  // namespace pagedserve_cpu
