// Paged attention straight from the blocks: decode (one query per sequence) and prefill
// (a chunk of queries per sequence, causal). Same semantics as kernels/reference.py.
#include "bf16_pairs.h"
#include "f32_tiles.h"
#include "softmax.h"

namespace pagedserve_cpu {

// Both are one kernel over query rows: row r attends to keys 0..len[r]-1 through the block
// table table[r]. A decode row is a sequence; a prefill row is one token of a chunk, whose
// keys end at its own position. Work item = (cluster, KV head), where a cluster is a run of
// consecutive rows that start with the same physical block (the tokens of one prefill chunk,
// the samples of one request after a fork, requests on one cached prefix), at most
// kMaxCluster long. A block that several of them read is loaded and converted once for all
// their query heads; a lone row is a cluster of one. Each query's arithmetic, and so its
// result, is the same whichever cluster it is in: a token prefilled, or recomputed after a
// preemption, gets exactly what decoding it would have.
// Layout (checked by the caller): a key block of one head is stored d-major, [d][BS], so
// the scores of all BS tokens accumulate in one vector per query head with no horizontal
// sums; a value block is row-major, [BS][d], so the output accumulates along d.
constexpr int64_t kMaxCluster = 16;

struct Rows {
  std::vector<const int32_t*> table;  // row r's block table
  std::vector<int32_t> len;           // row r's number of keys
};

// The rows grouped into clusters (see above): each cluster's first row, then the row count.
std::vector<int64_t> cluster_starts(const Rows& rows) {
  std::vector<int64_t> starts;
  const auto& len = rows.len;
  for (int64_t b = 0; b < static_cast<int64_t>(len.size()); ++b) {
    const bool joins = !starts.empty() && b - starts.back() < kMaxCluster && len[b] > 0 &&
                       len[b - 1] > 0 && rows.table[b][0] == rows.table[b - 1][0];
    if (!joins) starts.push_back(b);
  }
  starts.push_back(static_cast<int64_t>(len.size()));
  return starts;
}

// Splits items 0..n-1 into `parts` contiguous ranges of about equal cost (the keys their
// rows read): the causal rows of a prefill chunk cost more the later they come, so equal
// counts of items would leave one thread with most of the work. Returns parts + 1 bounds.
std::vector<int64_t> balanced_bounds(const std::vector<int64_t>& cost, int64_t parts) {
  std::vector<int64_t> prefix(cost.size() + 1, 0);
  for (size_t i = 0; i < cost.size(); ++i) prefix[i + 1] = prefix[i] + cost[i];
  std::vector<int64_t> bounds(parts + 1, static_cast<int64_t>(cost.size()));
  for (int64_t p = 0; p < parts; ++p) {
    const int64_t target = prefix.back() * p / parts;
    bounds[p] = std::lower_bound(prefix.begin(), prefix.end(), target) - prefix.begin();
  }
  bounds[0] = 0;
  return bounds;
}

// A block as float32: itself if it is float32, else converted into buf (n elements).
template <typename T>
const float* as_float(const T* block, std::vector<float>& buf, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return block;
  } else {
    load_row(block, buf.data(), n);
    return buf.data();
  }
}

template <typename T, int64_t BS, int64_t D>
void attend_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 const Rows& rows_of, at::Tensor& out, double scale) {
  const int64_t H = q.size(1);
  const int64_t Hkv = k_cache.size(2), group = H / Hkv;
  const T* qp = ptr<T>(q);
  const T* kp = ptr<T>(k_cache);
  const T* vp = ptr<T>(v_cache);
  const auto& table = rows_of.table;
  const int32_t* lp = rows_of.len.data();
  T* op = mut_ptr<T>(out);
  const int64_t qsB = q.stride(0), qsH = q.stride(1);
  const int64_t ksN = k_cache.stride(0), ksH = k_cache.stride(2);
  const int64_t vsN = v_cache.stride(0), vsH = v_cache.stride(2);
  const float fscale = static_cast<float>(scale);
  const std::vector<int64_t> starts = cluster_starts(rows_of);
  const int64_t num_items = (static_cast<int64_t>(starts.size()) - 1) * Hkv;
  std::vector<int64_t> cost(num_items, BS);  // a fixed part: setup, the last partial block
  for (int64_t c = 0; c + 1 < static_cast<int64_t>(starts.size()); ++c) {
    int64_t keys = 0;
    for (int64_t r = starts[c]; r < starts[c + 1]; ++r) keys += lp[r];
    for (int64_t h = 0; h < Hkv; ++h) cost[c * Hkv + h] += keys;
  }
  // A few parts per thread, taken from a queue: a preempted thread holds up one part.
  constexpr int64_t kPartsPerThread = 4;
  const int64_t parts = std::max<int64_t>(
      1, std::min<int64_t>(kPartsPerThread * at::get_num_threads(), num_items));
  const std::vector<int64_t> bounds = balanced_bounds(cost, parts);

  TaskQueue queue(parts);
  run_workers(queue, [&](TaskQueue& parts_left) {
    FlushDenormals ftz;
    const int64_t most = kMaxCluster * group;
    constexpr bool paired = kPaired<T, BS>;  // bf16 dot products (bf16_pairs.h)
    // Query and block buffers: bf16 pairs, or float32 (f32_tiles.h).
    std::vector<T> qraw(paired ? most * D : 0), rounded(paired ? most * BS : 0);
    std::vector<uint32_t> pairs(paired ? D / 2 * BS : 0);
    std::vector<float> qf(paired ? 0 : most * D), kbuf(paired ? 0 : D * BS),
        vbuf(paired ? 0 : BS * D);
    std::vector<float> acc(most * D), scores(most * BS), m(most), l(most * BS), correction(most);
    std::vector<int64_t> live(most);
    // One item: a cluster of rows on one KV head; `end` bounds its part (for prefetching
    // the next item's first block).
    auto attend_item = [&](int64_t item, int64_t end) {
      const int64_t c = item / Hkv, h = item % Hkv;
      const int64_t first = starts[c], rows = starts[c + 1] - first;
      int64_t max_ctx = 0;
      for (int64_t r = 0; r < rows; ++r) {
        max_ctx = std::max<int64_t>(max_ctx, lp[first + r]);
        for (int64_t g = 0; g < group; ++g) {
          const T* src = qp + (first + r) * qsB + (h * group + g) * qsH;
          if constexpr (paired) {
            std::copy_n(src, D, qraw.data() + (r * group + g) * D);
          } else {
            float* dst = qf.data() + (r * group + g) * D;
            for (int64_t j = 0; j < D; ++j) dst[j] = to_f(src[j]) * fscale;
          }
        }
      }
      std::fill_n(acc.begin(), rows * group * D, 0.f);
      std::fill_n(m.begin(), rows * group, -std::numeric_limits<float>::infinity());
      std::fill_n(l.begin(), rows * group * BS, 0.f);
      auto block_of = [&](int64_t r, int64_t start) {
        return start < lp[first + r] ? table[first + r][start / BS] : -1;
      };
      auto softmax_steps = [&](int64_t qlo, int64_t qhi) {
        softmax_block<BS>(scores.data() + qlo * BS, live.data() + qlo, qhi - qlo,
                          m.data() + qlo, l.data() + qlo * BS, correction.data() + qlo);
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
          // Blocks are scattered: fetch the next run's block (or the next block of the first
          // or the last row, the longest in a prefill chunk, or the next item's first block)
          // while working on this one.
          int64_t next = r_end < rows ? block_of(r_end, start) : block_of(0, start + BS);
          if (next < 0 && r_end == rows) next = block_of(rows - 1, start + BS);
          const T* next_k = nullptr;
          const T* next_v = nullptr;
          if (next >= 0) {
            next_k = kp + next * ksN + h * ksH;
            next_v = vp + next * vsN + h * vsH;
          } else if (item + 1 < end && lp[starts[(item + 1) / Hkv]] > 0) {
            const int64_t c2 = (item + 1) / Hkv, h2 = (item + 1) % Hkv;
            const int64_t id2 = table[starts[c2]][0];
            next_k = kp + id2 * ksN + h2 * ksH;
            next_v = vp + id2 * vsN + h2 * vsH;
          }
          const T* kblock = kp + id * ksN + h * ksH;
          const T* vblock = vp + id * vsN + h * vsH;
          const int64_t qlo = r * group, qhi = r_end * group;
          float* sq = scores.data() + qlo * BS;
          if constexpr (paired) {  // the same arithmetic for a lone row and a run
            pair_rows<BS, D * BS>(kblock, D, pairs.data(), next_k);
            paired_scores<BS, D>(pairs.data(), qraw.data() + qlo * D, qhi - qlo, fscale, sq,
                                next_k);
            softmax_steps(qlo, qhi);
            pair_rows<D, D * BS>(vblock, n_max, pairs.data(), next_v);
            paired_values<BS, D>(pairs.data(), n_max, sq, correction.data() + qlo, qhi - qlo,
                                 acc.data() + qlo * D, rounded.data(), next_v);
          } else if (r_end - r == 1) {
            // One row's queries convert the block in registers as they read it.
            block_scores<T, BS, D>(kblock, qf.data() + qlo * D, qhi - qlo, sq, next_k);
            softmax_steps(qlo, qhi);
            block_values<T, BS, D, kLoneValueTile<T>>(vblock, scores.data(), correction.data(),
                                                      live.data(), qlo, qhi, acc.data(), next_v);
          } else {
            // A run shared by several rows reads it as float32 (converted once for bf16).
            block_scores<float, BS, D>(as_float(kblock, kbuf, D * BS), qf.data() + qlo * D,
                                       qhi - qlo, sq, next_k);
            softmax_steps(qlo, qhi);
            // Slots past the context may be NaN: only the first n_max rows are read.
            const float* vf = as_float(vblock, vbuf, n_max * D);
            block_values<float, BS, D, kSharedValueTile>(vf, scores.data(), correction.data(),
                                                         live.data(), qlo, qhi, acc.data(),
                                                         next_v);
          }
          r = r_end;
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t g = 0; g < group; ++g) {
          const int64_t qi = r * group + g;
          T* dst = op + ((first + r) * H + h * group + g) * D;
          const float sum = lane_sum<BS>(l.data() + qi * BS);
          const float inv = sum > 0.f ? 1.f / sum : 0.f;
          for (int64_t j = 0; j < D; ++j) dst[j] = from_f<T>(acc[qi * D + j] * inv);
        }
      }
    };
    for (int64_t part; parts_left.next(part);)
      for (int64_t item = bounds[part]; item < bounds[part + 1]; ++item)
        attend_item(item, bounds[part + 1]);
  });
}

// Instantiates attend_impl for the common head and block sizes.
template <typename T, int64_t D>
void attend_for_block_size(int64_t bs, const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const Rows& rows, at::Tensor& out,
                           double scale) {
  switch (bs) {
    case 8: return attend_impl<T, 8, D>(q, k_cache, v_cache, rows, out, scale);
    case 16: return attend_impl<T, 16, D>(q, k_cache, v_cache, rows, out, scale);
    case 32: return attend_impl<T, 32, D>(q, k_cache, v_cache, rows, out, scale);
    case 64: return attend_impl<T, 64, D>(q, k_cache, v_cache, rows, out, scale);
    default: TORCH_CHECK(false, "block size must be 8, 16, 32 or 64");
  }
}

// The cache layout attend_impl reads: per head, key blocks [d][BS] and value blocks [BS][d].
bool decode_layout_ok(const at::Tensor& k_cache, const at::Tensor& v_cache) {
  const int64_t bs = k_cache.size(1), d = k_cache.size(3);
  return k_cache.stride(1) == 1 && k_cache.stride(3) == bs && v_cache.stride(1) == d &&
         v_cache.stride(3) == 1 && v_cache.sizes() == k_cache.sizes();
}

at::Tensor attend(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const Rows& rows, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4, "bad ranks");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() &&
                  v_cache.scalar_type() == q.scalar_type(),
              "q and the caches must share a dtype");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "heads must be a multiple of KV heads");
  check_last_dim_contiguous(q, "q");
  TORCH_CHECK(decode_layout_ok(k_cache, v_cache),
              "caches must hold key blocks d-major and value blocks row-major per head");
  auto out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  dispatch(q.scalar_type(), "paged attention", [&](auto zero) {
    using T = decltype(zero);
    const int64_t bs = k_cache.size(1);
    switch (q.size(2)) {
      case 16: return attend_for_block_size<T, 16>(bs, q, k_cache, v_cache, rows, out, scale);
      case 32: return attend_for_block_size<T, 32>(bs, q, k_cache, v_cache, rows, out, scale);
      case 64: return attend_for_block_size<T, 64>(bs, q, k_cache, v_cache, rows, out, scale);
      case 128: return attend_for_block_size<T, 128>(bs, q, k_cache, v_cache, rows, out, scale);
      default: TORCH_CHECK(false, "head size must be 16, 32, 64 or 128");
    }
  });
  return out;
}

void check_int32(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kInt && t.is_contiguous(), name,
              " must be contiguous int32");
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& context_lens, double scale) {
  auto tables = block_tables.contiguous();
  auto lens = context_lens.contiguous();
  check_int32(tables, "block_tables");
  check_int32(lens, "context_lens");
  TORCH_CHECK(lens.size(0) == q.size(0) && tables.size(0) == q.size(0),
              "one block table and context length per query");
  const int32_t* tp = tables.data_ptr<int32_t>();
  Rows rows;
  rows.len.assign(lens.data_ptr<int32_t>(), lens.data_ptr<int32_t>() + lens.size(0));
  for (int64_t b = 0; b < q.size(0); ++b) rows.table.push_back(tp + b * tables.size(1));
  return attend(q, k_cache, v_cache, rows, scale);
}

// Sequence s owns query rows cu_seqlens_q[s]..cu_seqlens_q[s+1]-1, the last positions of
// its context_lens[s] keys; row i of its n reads keys 0..context_len - n + i (causal).
at::Tensor paged_prefill_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                   const at::Tensor& v_cache, const at::Tensor& block_tables,
                                   const at::Tensor& cu_seqlens_q,
                                   const at::Tensor& context_lens, double scale) {
  auto tables = block_tables.contiguous();
  auto cu = cu_seqlens_q.contiguous();
  auto lens = context_lens.contiguous();
  check_int32(tables, "block_tables");
  check_int32(cu, "cu_seqlens_q");
  check_int32(lens, "context_lens");
  const int64_t num_seqs = lens.size(0);
  TORCH_CHECK(cu.size(0) == num_seqs + 1 && tables.size(0) == num_seqs,
              "one block table and context length per sequence");
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int32_t* cp = cu.data_ptr<int32_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  TORCH_CHECK(cp[0] == 0 && cp[num_seqs] == q.size(0), "cu_seqlens_q must cover q's rows");
  Rows rows;
  rows.table.reserve(q.size(0));
  rows.len.reserve(q.size(0));
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t n = cp[s + 1] - cp[s];
    TORCH_CHECK(n >= 0 && n <= lp[s] && lp[s] <= tables.size(1) * k_cache.size(1),
                "sequence ", s, ": query longer than its context, or table too short");
    for (int64_t i = 0; i < n; ++i) {
      rows.table.push_back(tp + s * tables.size(1));
      rows.len.push_back(static_cast<int32_t>(lp[s] - n + i + 1));
    }
  }
  return attend(q, k_cache, v_cache, rows, scale);
}

}  // namespace pagedserve_cpu
