// Paged-memory kernels: the K/V store by slot, and the per-sequence K/V gather that the
// reference prefill attention takes (shapes attention.cpp has no instantiation for).
// Same semantics as kernels/reference.py.
#include "common.h"

namespace pagedserve_cpu {

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
  // A decode step's tokens each go to another block, so each one waits on its own cache
  // misses: splitting 32-64 of them over two threads halved the store's time.
  at::parallel_for(0, num_tokens, 16, [&](int64_t begin, int64_t end) {
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
