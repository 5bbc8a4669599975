// Shared helpers of the C++ CPU kernels (element types, conversions, a vectorizable exp,
// denormal flushing, dtype dispatch). Included by every .cpp here.
#pragma once

// ATen's tensor and the two factories used, not <torch/extension.h>: that header (the
// whole C++ frontend) took ~24 s to parse in every file, most of a first-use build.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <limits>
#include <vector>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace pagedserve_cpu {


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

// fast_exp's constants, shared by its scalar and vector forms (which must give the same
// bits): n = round(x * log2 e), r = x - n * ln 2 with ln 2 split in a high and a low part,
// exp(r) ~ 1 + r + r^2 * (the polynomial, highest power first).
constexpr float kExpLog2e = 1.44269504088896341f;
constexpr float kExpLn2Hi = 0.693359375f, kExpLn2Lo = 2.12194440e-4f;
constexpr float kExpPoly[] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                              4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

// exp for float32 that the compiler can vectorize (std::exp is a scalar call): range
// reduction to |r| <= ln2/2 and a degree-6 polynomial; ~1 ulp, clamps far tails.
inline float fast_exp(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  // n = round(x / ln2); the offset keeps the truncating conversion a floor.
  const int32_t k = static_cast<int32_t>(x * kExpLog2e + 128.5f) - 128;
  const float n = static_cast<float>(k);
  const float r = x - n * kExpLn2Hi + n * kExpLn2Lo;
  float p = kExpPoly[0];
  for (int i = 1; i < 6; ++i) p = p * r + kExpPoly[i];
  p = p * r * r + r + 1.0f;
  return p * std::bit_cast<float>((k + 127) << 23);
}

#if defined(__AVX2__) && defined(__FMA__)
// fast_exp on 8 lanes, written out: the same operations in the same order, so the same bits
// (std::max(x, lo) is max_ps(lo, x), std::min(x, hi) is min_ps(hi, x), NaNs included): GCC
// vectorized fast_exp in attention's short, masked softmax loop with masked loads and
// compare-and-blend pairs on every vector.
inline __m256 fast_exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_set1_ps(88.0f), _mm256_max_ps(_mm256_set1_ps(-87.0f), x));
  const __m256i k = _mm256_sub_epi32(
      _mm256_cvttps_epi32(
          _mm256_fmadd_ps(x, _mm256_set1_ps(kExpLog2e), _mm256_set1_ps(128.5f))),
      _mm256_set1_epi32(128));
  const __m256 n = _mm256_cvtepi32_ps(k);
  const __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(kExpLn2Lo),
                                   _mm256_fnmadd_ps(n, _mm256_set1_ps(kExpLn2Hi), x));
  __m256 p = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[i]));
  p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
  const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(k, _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}
#define PAGEDSERVE_EXP8 1
#endif

#if defined(__AVX512F__)
// fast_exp8 on 16 lanes: the same operations in the same order, so the same bits.
inline __m512 fast_exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_set1_ps(88.0f), _mm512_max_ps(_mm512_set1_ps(-87.0f), x));
  const __m512i k = _mm512_sub_epi32(
      _mm512_cvttps_epi32(
          _mm512_fmadd_ps(x, _mm512_set1_ps(kExpLog2e), _mm512_set1_ps(128.5f))),
      _mm512_set1_epi32(128));
  const __m512 n = _mm512_cvtepi32_ps(k);
  const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(kExpLn2Lo),
                                   _mm512_fnmadd_ps(n, _mm512_set1_ps(kExpLn2Hi), x));
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[i]));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  const __m512i scale = _mm512_slli_epi32(_mm512_add_epi32(k, _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(scale));
}
#define PAGEDSERVE_EXP16 1
#endif

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

// Prefetches slice `part` of `parts` of the cache lines of a block of Elems elements, into
// L2. A whole block's prefetches issued at once stall the core until the lines arrive
// (measured: no overlap of memory and work); spread over a loop they overlap with it (float32
// decode attention 1.3x faster on an AVX2 EPYC).
template <typename T, int64_t Elems>
inline void prefetch_slice(const T* base, int64_t part, int64_t parts) {
  constexpr int64_t kPerLine = 64 / static_cast<int64_t>(sizeof(T));
  constexpr int64_t kLines = (Elems + kPerLine - 1) / kPerLine;
  for (int64_t l = part * kLines / parts; l < (part + 1) * kLines / parts; ++l)
    __builtin_prefetch(base + l * kPerLine, 0, 2);
}

template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = to_f(src[i]);
}

// Element-wise ops give each thread at least this many rows: waking a sleeping OpenMP
// thread costs tens of microseconds, more than a few rows take. (32 rather than 128 made a
// whole decode step of 128 rows 3-4% faster, and of 64 rows 2-3%.)
constexpr int64_t kRowsPerTask = 32;

// Tasks 0..size-1, each handed to whichever thread asks next. On shared vCPUs the OS
// preempts one of the OpenMP threads now and then (a streaming client, the server's event
// loop): split statically, the other thread then waited for the whole of the preempted
// one's share; claimed one at a time, it waits only for the task in progress.
class TaskQueue {
 public:
  explicit TaskQueue(int64_t size) : size_(size) {}
  int64_t size() const { return size_; }
  bool next(int64_t& task) {
    task = next_.fetch_add(1, std::memory_order_relaxed);
    return task < size_;
  }

 private:
  const int64_t size_;
  std::atomic<int64_t> next_{0};
};

// worker(queue) once on each OpenMP thread (at most one per task); each worker sets up its
// buffers once, then takes tasks from the queue until none are left.
template <typename F>
void run_workers(TaskQueue& queue, const F& worker) {
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), queue.size());
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) { worker(queue); });
}

// run(task) for every task of 0..tasks-1, taken from one queue by every thread.
template <typename F>
void parallel_tasks(int64_t tasks, const F& run) {
  TaskQueue queue(tasks);
  run_workers(queue, [&](TaskQueue& q) {
    for (int64_t t; q.next(t);) run(t);
  });
}

inline void check_last_dim_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.stride(-1) == 1, name, ": the last dimension must be contiguous");
}


// The ops (attention.cpp, paged.cpp, elementwise.cpp, linear.cpp); bound to Python in
// module.cpp.
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& context_lens, double scale);
at::Tensor paged_prefill_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                   const at::Tensor& v_cache, const at::Tensor& block_tables,
                                   const at::Tensor& cu_seqlens_q,
                                   const at::Tensor& context_lens, double scale);
bool decode_layout_ok(const at::Tensor& k_cache, const at::Tensor& v_cache);
void store_kvcache(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache,
                   at::Tensor& v_cache, const at::Tensor& slot_mapping);
std::vector<at::Tensor> gather_kv(const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_table, int64_t ctx, int64_t group);
at::Tensor rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                    const at::Tensor& weight, double eps);
void rope_(at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos,
           const at::Tensor& sin);
at::Tensor silu_and_mul(const at::Tensor& x);
at::Tensor argmax_rows(const at::Tensor& x);
bool has_linear_f32();
at::Tensor pack_linear_f32(const at::Tensor& weight);
at::Tensor linear_f32(const at::Tensor& input, const at::Tensor& packed,
                      const c10::optional<at::Tensor>& bias, int64_t N);

}  // namespace pagedserve_cpu
