// Berth's CPU kernels, registered as torch.ops.berth.*: paged attention and RMSNorm.
//
// Eager PyTorch has no attention that reads K/V through slot indices, so a decode step had to
// gather every sequence's K/V into a padded dense tensor first: a copy as large as the cache it
// reads, in every layer. `decode_attention` reads the token-slot pool in place, one pass over K
// and one over V, and only each sequence's own length. `extend_attention` does the same for the
// tokens of a prefill, each token alone, so that a token's attention is computed the same way
// whether it is prefilled whole, after a cached prefix, in chunks, or decoded. `rms_norm` and `add_rms_norm` replace
// PyTorch's decomposed bf16 RMSNorm (five kernels and an fp32 copy a call). Everything is
// computed in fp32 whatever the storage dtype (bf16 or fp32) and rounded once, as PyTorch's CPU
// kernels do. Built at run time by `berth_runtime.kernels.cpu` with the SIMD width of the CPU it
// runs on (at::vec picks AVX-512, AVX2 or plain C++ from CPU_CAPABILITY).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <tuple>
#include <vector>

namespace {

using fVec = at::vec::Vectorized<float>;
constexpr int64_t kLanes = fVec::size();
// Head dims the attention kernels are built for, in SIMD vectors.
constexpr int kHeadDim64 = 64 / kLanes, kHeadDim128 = 128 / kLanes, kHeadDim256 = 256 / kLanes;

inline fVec load_vec(const float* p) { return fVec::loadu(p); }
inline fVec load_vec(const c10::BFloat16* p) {
  fVec out;
  at::vec::load_to_float<c10::BFloat16>(p, out);
  return out;
}

inline float reduce_sum(const fVec& v) {
  return at::vec::vec_reduce_all<float>([](fVec& a, fVec& b) { return a + b; }, v);
}

// Softmax in place over `len` scores: whole vectors, then a scalar tail.
inline void softmax_inplace(float* s, int64_t len) {
  fVec max_vec(-std::numeric_limits<float>::infinity());
  int64_t t = 0;
  for (; t + kLanes <= len; t += kLanes) max_vec = at::vec::maximum(max_vec, fVec::loadu(s + t));
  float m = at::vec::vec_reduce_all<float>(
      [](fVec& a, fVec& b) { return at::vec::maximum(a, b); }, max_vec);
  for (; t < len; ++t) m = std::max(m, s[t]);
  const fVec m_vec(m);
  fVec sum_vec(0.f);
  float sum = 0.f;
  for (t = 0; t + kLanes <= len; t += kLanes) {
    fVec e = (fVec::loadu(s + t) - m_vec).exp_u20();
    e.store(s + t);
    sum_vec = sum_vec + e;
  }
  for (; t < len; ++t) {
    s[t] = std::exp(s[t] - m);
    sum += s[t];
  }
  const float inv = 1.f / (sum + reduce_sum(sum_vec));
  const fVec inv_vec(inv);
  for (t = 0; t + kLanes <= len; t += kLanes) (fVec::loadu(s + t) * inv_vec).store(s + t);
  for (; t < len; ++t) s[t] *= inv;
}

// Ask for the cache lines of a slot's K (or V) heads ahead of use: slots are indirect, so the
// hardware prefetcher cannot see where the next row is.
inline void prefetch_row(const void* row, int64_t bytes) {
  const char* p = static_cast<const char*>(row);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 1);
}

constexpr int64_t kPrefetchAhead = 4;  // slots
// Queries of one sequence computed together: each K and V row is read once for all of them.
constexpr int64_t kQueryBlock = 16;

// Up to kQueryBlock queries of one sequence, q [nq, H, D]; query i attends over the sequence's
// first lens[i] slots. One pass over the K heads of each slot (contiguous in the pool), a softmax
// per query head, one pass over V. Each (query, head) is the same arithmetic whatever else is in
// the block or the step (a score is one FMA chain over the head dim then a fixed reduction; the
// softmax runs over the query's own length; the output is one FMA chain over its slots in
// order), so a token's attention is bit for bit the same in a decode step, a whole prefill, an
// extend after a cached prefix or any chunking of it. NV (head dim / SIMD lanes) is a template
// parameter so that a head's row lives in registers.
template <typename T, int NV>
void attend_block(const T* q, const int64_t* lens, int64_t nq, const T* kv, const int64_t* slots,
                  int64_t heads, int64_t kv_heads, float scale, T* out,
                  std::vector<float>& scratch) {
  constexpr int64_t dim = NV * kLanes;
  const int64_t group = heads / kv_heads;
  const int64_t slot_stride = 2 * kv_heads * dim;
  const int64_t half_bytes = kv_heads * dim * static_cast<int64_t>(sizeof(T));
  int64_t max_len = 0;
  for (int64_t i = 0; i < nq; ++i) max_len = std::max(max_len, lens[i]);
  const int64_t rows = nq * heads;  // (query, head) pairs
  scratch.resize(2 * rows * dim + rows * max_len);
  float* qf = scratch.data();          // [nq, H, D], scaled
  float* acc = qf + rows * dim;        // [nq, H, D]
  float* scores = acc + rows * dim;    // [nq, H, max_len]
  for (int64_t r = 0; r < rows; ++r)
    for (int j = 0; j < NV; ++j)
      (load_vec(q + r * dim + j * kLanes) * fVec(scale)).store(qf + r * dim + j * kLanes);

  for (int64_t t = 0; t < max_len; ++t) {
    if (t + kPrefetchAhead < max_len)
      prefetch_row(kv + slots[t + kPrefetchAhead] * slot_stride, half_bytes);
    const T* k_row = kv + slots[t] * slot_stride;
    for (int64_t kh = 0; kh < kv_heads; ++kh) {
      fVec kvec[NV];
      for (int j = 0; j < NV; ++j) kvec[j] = load_vec(k_row + kh * dim + j * kLanes);
      for (int64_t i = 0; i < nq; ++i) {
        if (t >= lens[i]) continue;
        for (int64_t h = kh * group; h < (kh + 1) * group; ++h) {
          const int64_t r = i * heads + h;
          const float* qh = qf + r * dim;
          fVec dot = fVec::loadu(qh) * kvec[0];
          for (int j = 1; j < NV; ++j)
            dot = at::vec::fmadd(fVec::loadu(qh + j * kLanes), kvec[j], dot);
          scores[r * max_len + t] = reduce_sum(dot);
        }
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) softmax_inplace(scores + r * max_len, lens[r / heads]);

  std::fill(acc, acc + rows * dim, 0.f);
  for (int64_t t = 0; t < max_len; ++t) {
    if (t + kPrefetchAhead < max_len)
      prefetch_row(kv + slots[t + kPrefetchAhead] * slot_stride + kv_heads * dim, half_bytes);
    const T* v_row = kv + slots[t] * slot_stride + kv_heads * dim;
    for (int64_t kh = 0; kh < kv_heads; ++kh) {
      fVec vvec[NV];
      for (int j = 0; j < NV; ++j) vvec[j] = load_vec(v_row + kh * dim + j * kLanes);
      for (int64_t i = 0; i < nq; ++i) {
        if (t >= lens[i]) continue;
        for (int64_t h = kh * group; h < (kh + 1) * group; ++h) {
          const int64_t r = i * heads + h;
          const fVec p(scores[r * max_len + t]);
          float* ah = acc + r * dim;
          for (int j = 0; j < NV; ++j)
            at::vec::fmadd(p, vvec[j], fVec::loadu(ah + j * kLanes)).store(ah + j * kLanes);
        }
      }
    }
  }
  for (int64_t i = 0; i < rows * dim; ++i) out[i] = static_cast<T>(acc[i]);
}

// Query i (all its heads) attends over the first `query_lens[i]` slots of the kv_indices row of
// its sequence, `query_seq[i]` (row i itself when query_seq is null: one query per sequence).
// Consecutive queries of one sequence go in blocks of up to kQueryBlock.
template <typename T, int NV>
void paged_attention_impl(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& kv_indices,
                          const int64_t* query_seq, const int64_t* query_lens, double scale,
                          at::Tensor& out) {
  const int64_t queries = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = kv.size(1) / 2;
  const int64_t max_len = kv_indices.size(1);
  const T* q_ptr = q.data_ptr<T>();
  const T* kv_ptr = kv.data_ptr<T>();
  const int64_t* idx = kv_indices.data_ptr<int64_t>();
  T* out_ptr = out.data_ptr<T>();
  std::vector<int64_t> block_start;  // first query of each block, then the end
  for (int64_t i = 0; i < queries;) {
    block_start.push_back(i);
    const int64_t seq = query_seq != nullptr ? query_seq[i] : i;
    int64_t n = 1;
    while (query_seq != nullptr && n < kQueryBlock && i + n < queries && query_seq[i + n] == seq)
      ++n;
    i += n;
  }
  block_start.push_back(queries);
  const int64_t blocks = static_cast<int64_t>(block_start.size()) - 1;
  // Blocks differ in length: hand them out one at a time rather than in fixed halves.
#pragma omp parallel num_threads(at::get_num_threads())
  {
    std::vector<float> scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t first = block_start[b];
      const int64_t seq = query_seq != nullptr ? query_seq[first] : first;
      attend_block<T, NV>(q_ptr + first * heads * dim, query_lens + first,
                          block_start[b + 1] - first, kv_ptr, idx + seq * max_len, heads,
                          kv_heads, static_cast<float>(scale), out_ptr + first * heads * dim,
                          scratch);
    }
  }
}

template <typename T>
void paged_attention_dispatch(const at::Tensor& q, const at::Tensor& kv,
                              const at::Tensor& kv_indices, const int64_t* query_seq,
                              const int64_t* query_lens, double scale, at::Tensor& out) {
  switch (q.size(2) / kLanes) {
#define BERTH_HEAD_DIM_CASE(nv) \
  case nv:                      \
    return paged_attention_impl<T, nv>(q, kv, kv_indices, query_seq, query_lens, scale, out);
    BERTH_HEAD_DIM_CASE(kHeadDim64)
    BERTH_HEAD_DIM_CASE(kHeadDim128)
    BERTH_HEAD_DIM_CASE(kHeadDim256)
#undef BERTH_HEAD_DIM_CASE
    default:
      TORCH_CHECK(false, "berth attention supports head dims 64, 128 and 256");
  }
}

// Checks shared by both attention ops; returns q contiguous.
at::Tensor check_attention_inputs(const at::Tensor& q, const at::Tensor& kv,
                                  const at::Tensor& kv_indices) {
  TORCH_CHECK(q.device().is_cpu() && kv.device().is_cpu(), "berth attention is CPU only");
  TORCH_CHECK(q.dim() == 3 && kv.dim() == 3 && kv.size(2) == q.size(2), "bad q/kv shapes");
  TORCH_CHECK(q.scalar_type() == kv.scalar_type(), "q and kv dtypes differ");
  const int64_t dim = q.size(2), kv_heads = kv.size(1) / 2;
  TORCH_CHECK(kv.size(1) % 2 == 0 && kv_heads > 0 && q.size(1) % kv_heads == 0, "bad head counts");
  TORCH_CHECK(dim == 64 || dim == 128 || dim == 256, "head dim must be 64, 128 or 256");
  TORCH_CHECK(kv_indices.scalar_type() == at::kLong, "kv_indices must be int64");
  TORCH_CHECK(kv_indices.dim() == 2, "kv_indices must be [sequences, max length]");
  TORCH_CHECK(kv.is_contiguous(), "kv must be contiguous");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kFloat,
              "berth attention takes bf16 or fp32");
  return q.contiguous();
}

at::Tensor run_paged_attention(const at::Tensor& qc, const at::Tensor& kv,
                               const at::Tensor& kv_indices, const int64_t* query_seq,
                               const int64_t* query_lens, double scale) {
  const at::Tensor idx = kv_indices.contiguous();
  at::Tensor out = at::empty_like(qc);
  if (qc.scalar_type() == at::kBFloat16) {
    paged_attention_dispatch<c10::BFloat16>(qc, kv, idx, query_seq, query_lens, scale, out);
  } else {
    paged_attention_dispatch<float>(qc, kv, idx, query_seq, query_lens, scale, out);
  }
  return out;
}

// q [B, H, D]: one new token per sequence; kv [slots, 2 * Hkv, D]: one layer of the pool, K heads
// then V heads; kv_indices [B, L] int64: the slot of each position; seq_lens [B] int64, 1..L.
// Returns [B, H, D]. Query head h reads KV head h / (H / Hkv), as in grouped-query attention.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& kv_indices,
                            const at::Tensor& seq_lens, double scale) {
  const at::Tensor qc = check_attention_inputs(q, kv, kv_indices);
  TORCH_CHECK(seq_lens.scalar_type() == at::kLong, "seq_lens must be int64");
  TORCH_CHECK(kv_indices.size(0) == q.size(0) && seq_lens.numel() == q.size(0),
              "kv_indices / seq_lens do not match the batch");
  const at::Tensor lens = seq_lens.contiguous();
  return run_paged_attention(qc, kv, kv_indices, nullptr, lens.data_ptr<int64_t>(), scale);
}

// q [T, H, D]: the new tokens of B sequences, flattened; query_seq [T] int64: the sequence (row
// of kv_indices [B, L]) of each token; query_lens [T] int64: the slots each token attends to,
// its position + 1 (causal, cached prefix included). Returns [T, H, D].
at::Tensor extend_attention(const at::Tensor& q, const at::Tensor& kv,
                            const at::Tensor& kv_indices, const at::Tensor& query_seq,
                            const at::Tensor& query_lens, double scale) {
  const at::Tensor qc = check_attention_inputs(q, kv, kv_indices);
  TORCH_CHECK(query_seq.scalar_type() == at::kLong && query_lens.scalar_type() == at::kLong,
              "query_seq and query_lens must be int64");
  TORCH_CHECK(query_seq.numel() == q.size(0) && query_lens.numel() == q.size(0),
              "query_seq / query_lens do not match the tokens");
  const at::Tensor seq = query_seq.contiguous(), lens = query_lens.contiguous();
  return run_paged_attention(qc, kv, kv_indices, seq.data_ptr<int64_t>(),
                             lens.data_ptr<int64_t>(), scale);
}

// out = x / sqrt(mean(x^2) + eps) * weight per row; with `residual`, x is first replaced by
// x + residual (rounded to T, as an add in T would be), which is also returned.
template <typename T>
void rms_norm_impl(const T* x, const T* residual, const T* weight, T* out, T* sum_out,
                   int64_t rows, int64_t dim, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(dim);
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t i = 0; i < dim; ++i) {
        float v = static_cast<float>(x[r * dim + i]);
        if (residual != nullptr) {
          const T rounded = static_cast<T>(v + static_cast<float>(residual[r * dim + i]));
          sum_out[r * dim + i] = rounded;
          v = static_cast<float>(rounded);
        }
        row[i] = v;
      }
      fVec ss_vec(0.f);
      int64_t i = 0;
      for (; i + kLanes <= dim; i += kLanes) {
        const fVec v = fVec::loadu(row.data() + i);
        ss_vec = at::vec::fmadd(v, v, ss_vec);
      }
      float ss = reduce_sum(ss_vec);
      for (; i < dim; ++i) ss += row[i] * row[i];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(dim) + eps);
      for (i = 0; i < dim; ++i)
        out[r * dim + i] = static_cast<T>(row[i] * inv * static_cast<float>(weight[i]));
    }
  });
}

std::tuple<at::Tensor, at::Tensor> rms_norm_dispatch(const at::Tensor& x,
                                                     const c10::optional<at::Tensor>& residual,
                                                     const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.device().is_cpu(), "berth::rms_norm is CPU only");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "x and weight dtypes differ");
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  const int64_t dim = xc.size(-1), rows = xc.numel() / dim;
  TORCH_CHECK(wc.numel() == dim, "weight size must equal the last dim");
  at::Tensor rc, sum;
  if (residual.has_value()) {
    rc = residual->contiguous();
    TORCH_CHECK(rc.sizes() == xc.sizes() && rc.scalar_type() == xc.scalar_type(),
                "residual must match x");
    sum = at::empty_like(xc);
  }
  at::Tensor out = at::empty_like(xc);
  const float e = static_cast<float>(eps);
  if (x.scalar_type() == at::kBFloat16) {
    using T = c10::BFloat16;
    rms_norm_impl<T>(xc.data_ptr<T>(), rc.defined() ? rc.data_ptr<T>() : nullptr,
                     wc.data_ptr<T>(), out.data_ptr<T>(),
                     sum.defined() ? sum.data_ptr<T>() : nullptr, rows, dim, e);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "berth::rms_norm takes bf16 or fp32");
    rms_norm_impl<float>(xc.data_ptr<float>(), rc.defined() ? rc.data_ptr<float>() : nullptr,
                         wc.data_ptr<float>(), out.data_ptr<float>(),
                         sum.defined() ? sum.data_ptr<float>() : nullptr, rows, dim, e);
  }
  return {out, sum};
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return std::get<0>(rms_norm_dispatch(x, c10::nullopt, weight, eps));
}

// (rms_norm(x + residual), x + residual): a decoder layer's residual add and the next norm.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  return rms_norm_dispatch(x, residual, weight, eps);
}

// The k largest entries of one row, as (value, index), in no particular order. One vector
// compare per kLanes entries against the smallest kept value: nearly every entry of a vocab row
// is rejected there, so this is one pass at memory speed (torch.topk sorts far more).
template <typename T>
void row_top_k(const T* x, int64_t n, int64_t k, int64_t* out) {
  using Entry = std::pair<float, int64_t>;
  // A min-heap on value: the root is the entry to beat.
  auto greater = [](const Entry& a, const Entry& b) { return a.first > b.first; };
  std::vector<Entry> heap;
  heap.reserve(k);
  float threshold = -std::numeric_limits<float>::infinity();
  auto offer = [&](float v, int64_t i) {
    if (static_cast<int64_t>(heap.size()) < k) {
      heap.emplace_back(v, i);
      std::push_heap(heap.begin(), heap.end(), greater);
      if (static_cast<int64_t>(heap.size()) == k) threshold = heap.front().first;
    } else if (v > threshold) {
      std::pop_heap(heap.begin(), heap.end(), greater);
      heap.back() = {v, i};
      std::push_heap(heap.begin(), heap.end(), greater);
      threshold = heap.front().first;
    }
  };
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const fVec v = load_vec(x + i);
    const bool full = static_cast<int64_t>(heap.size()) == k;
    if (full && (v > fVec(threshold)).zero_mask() == (1 << kLanes) - 1) continue;
    float lanes[kLanes];
    v.store(lanes);
    for (int64_t j = 0; j < kLanes; ++j) offer(lanes[j], i + j);
  }
  for (; i < n; ++i) offer(static_cast<float>(x[i]), i);
  for (int64_t j = 0; j < k; ++j) out[j] = heap[j].second;
}

// x [rows, n] (bf16 or fp32): the indices [rows, k] of each row's k largest entries, unordered.
at::Tensor top_k_indices(const at::Tensor& x, int64_t k) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2, "berth::top_k_indices takes a CPU matrix");
  TORCH_CHECK(k > 0 && k <= x.size(1), "k must be in 1..row length");
  const at::Tensor xc = x.contiguous();
  const int64_t rows = xc.size(0), n = xc.size(1);
  at::Tensor out = at::empty({rows, k}, x.options().dtype(at::kLong));
  int64_t* out_ptr = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      if (xc.scalar_type() == at::kBFloat16) {
        row_top_k(xc.data_ptr<c10::BFloat16>() + r * n, n, k, out_ptr + r * k);
      } else {
        TORCH_CHECK(xc.scalar_type() == at::kFloat, "berth::top_k_indices takes bf16 or fp32");
        row_top_k(xc.data_ptr<float>() + r * n, n, k, out_ptr + r * k);
      }
    }
  });
  return out;
}

// out[r, j] = dot(x[r], weight[indices[r, j]]) in fp32: a few scores of a bf16 lm_head computed
// again without rounding the result to bf16. Each dot is one FMA chain over the row then a fixed
// reduction, so it does not depend on the other rows.
template <typename T>
void dot_rows_impl(const T* x, const T* weight, const int64_t* indices, int64_t rows, int64_t k,
                   int64_t dim, float* out) {
  at::parallel_for(0, rows * k, 64, [&](int64_t begin, int64_t end) {
    for (int64_t e = begin; e < end; ++e) {
      const T* xr = x + (e / k) * dim;
      const T* wr = weight + indices[e] * dim;
      fVec acc(0.f);
      int64_t d = 0;
      for (; d + kLanes <= dim; d += kLanes) acc = at::vec::fmadd(load_vec(xr + d), load_vec(wr + d), acc);
      float sum = reduce_sum(acc);
      for (; d < dim; ++d) sum += static_cast<float>(xr[d]) * static_cast<float>(wr[d]);
      out[e] = sum;
    }
  });
}

// x [rows, D], weight [V, D] (same dtype, bf16 or fp32), indices [rows, k] int64 -> fp32 [rows, k].
at::Tensor dot_rows(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& indices) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "berth::dot_rows is CPU only");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "x [rows, D] and weight [V, D] expected");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "x and weight dtypes differ");
  TORCH_CHECK(indices.scalar_type() == at::kLong && indices.dim() == 2 &&
                  indices.size(0) == x.size(0),
              "indices must be int64 [rows, k]");
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous(), ic = indices.contiguous();
  const int64_t rows = xc.size(0), k = ic.size(1), dim = xc.size(1);
  at::Tensor out = at::empty({rows, k}, x.options().dtype(at::kFloat));
  if (xc.scalar_type() == at::kBFloat16) {
    using T = c10::BFloat16;
    dot_rows_impl<T>(xc.data_ptr<T>(), wc.data_ptr<T>(), ic.data_ptr<int64_t>(), rows, k, dim,
                     out.data_ptr<float>());
  } else {
    TORCH_CHECK(xc.scalar_type() == at::kFloat, "berth::dot_rows takes bf16 or fp32");
    dot_rows_impl<float>(xc.data_ptr<float>(), wc.data_ptr<float>(), ic.data_ptr<int64_t>(), rows,
                         k, dim, out.data_ptr<float>());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(berth, m) {
  m.def(
      "decode_attention(Tensor q, Tensor kv, Tensor kv_indices, Tensor seq_lens, float scale)"
      " -> Tensor");
  m.def(
      "extend_attention(Tensor q, Tensor kv, Tensor kv_indices, Tensor query_seq,"
      " Tensor query_lens, float scale) -> Tensor");
  m.def("top_k_indices(Tensor x, int k) -> Tensor");
  m.def("dot_rows(Tensor x, Tensor weight, Tensor indices) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(berth, CPU, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("extend_attention", &extend_attention);
  m.impl("top_k_indices", &top_k_indices);
  m.impl("dot_rows", &dot_rows);
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
}
