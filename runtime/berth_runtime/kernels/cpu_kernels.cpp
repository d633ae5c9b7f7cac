// Berth's CPU kernels, registered as torch.ops.berth.*: paged decode attention and RMSNorm.
//
// Eager PyTorch has no attention that reads K/V through slot indices, so a decode step had to
// gather every sequence's K/V into a padded dense tensor first: a copy as large as the cache it
// reads, in every layer. `decode_attention` reads the token-slot pool in place, one pass over K
// and one over V, and only each sequence's own length. `rms_norm` and `add_rms_norm` replace
// PyTorch's decomposed bf16 RMSNorm (five kernels and an fp32 copy a call). Everything is
// computed in fp32 whatever the storage dtype (bf16 or fp32) and rounded once, as PyTorch's CPU
// kernels do. Built at run time by `berth_runtime.kernels.cpu` with the SIMD width of the CPU it
// runs on (at::vec picks AVX-512, AVX2 or plain C++ from CPU_CAPABILITY).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <limits>
#include <tuple>
#include <vector>

namespace {

using fVec = at::vec::Vectorized<float>;
constexpr int64_t kLanes = fVec::size();
// Head dims the attention kernel is built for, in SIMD vectors.
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

// One sequence: every query head attends over the sequence's first `len` slots. One pass over
// the K heads of each slot (contiguous in the pool), a softmax per head, one pass over V.
// NV (head dim / SIMD lanes) is a template parameter so that a head's row lives in registers.
template <typename T, int NV>
void attend_sequence(const T* q, const T* kv, const int64_t* slots, int64_t len, int64_t heads,
                     int64_t kv_heads, float scale, T* out, std::vector<float>& scratch) {
  constexpr int64_t dim = NV * kLanes;
  const int64_t group = heads / kv_heads;
  const int64_t slot_stride = 2 * kv_heads * dim;
  const int64_t half_bytes = kv_heads * dim * static_cast<int64_t>(sizeof(T));
  scratch.resize(2 * heads * dim + heads * len);
  float* qf = scratch.data();           // [H, D], scaled
  float* acc = qf + heads * dim;        // [H, D]
  float* scores = acc + heads * dim;    // [H, len]
  for (int64_t h = 0; h < heads; ++h)
    for (int j = 0; j < NV; ++j)
      (load_vec(q + h * dim + j * kLanes) * fVec(scale)).store(qf + h * dim + j * kLanes);

  for (int64_t t = 0; t < len; ++t) {
    if (t + kPrefetchAhead < len) prefetch_row(kv + slots[t + kPrefetchAhead] * slot_stride, half_bytes);
    const T* k_row = kv + slots[t] * slot_stride;
    for (int64_t kh = 0; kh < kv_heads; ++kh) {
      fVec kvec[NV];
      for (int j = 0; j < NV; ++j) kvec[j] = load_vec(k_row + kh * dim + j * kLanes);
      for (int64_t h = kh * group; h < (kh + 1) * group; ++h) {
        const float* qh = qf + h * dim;
        fVec dot = fVec::loadu(qh) * kvec[0];
        for (int j = 1; j < NV; ++j) dot = at::vec::fmadd(fVec::loadu(qh + j * kLanes), kvec[j], dot);
        scores[h * len + t] = reduce_sum(dot);
      }
    }
  }
  for (int64_t h = 0; h < heads; ++h) softmax_inplace(scores + h * len, len);

  std::fill(acc, acc + heads * dim, 0.f);
  for (int64_t t = 0; t < len; ++t) {
    if (t + kPrefetchAhead < len)
      prefetch_row(kv + slots[t + kPrefetchAhead] * slot_stride + kv_heads * dim, half_bytes);
    const T* v_row = kv + slots[t] * slot_stride + kv_heads * dim;
    for (int64_t kh = 0; kh < kv_heads; ++kh) {
      fVec vvec[NV];
      for (int j = 0; j < NV; ++j) vvec[j] = load_vec(v_row + kh * dim + j * kLanes);
      for (int64_t h = kh * group; h < (kh + 1) * group; ++h) {
        const fVec p(scores[h * len + t]);
        float* ah = acc + h * dim;
        for (int j = 0; j < NV; ++j)
          at::vec::fmadd(p, vvec[j], fVec::loadu(ah + j * kLanes)).store(ah + j * kLanes);
      }
    }
  }
  for (int64_t i = 0; i < heads * dim; ++i) out[i] = static_cast<T>(acc[i]);
}

template <typename T, int NV>
void decode_attention_impl(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& kv_indices,
                           const at::Tensor& seq_lens, double scale, at::Tensor& out) {
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = kv.size(1) / 2;
  const int64_t max_len = kv_indices.size(1);
  const T* q_ptr = q.data_ptr<T>();
  const T* kv_ptr = kv.data_ptr<T>();
  const int64_t* idx = kv_indices.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  T* out_ptr = out.data_ptr<T>();
  // Sequences differ in length: hand them out one at a time rather than in fixed halves.
#pragma omp parallel num_threads(at::get_num_threads())
  {
    std::vector<float> scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t b = 0; b < batch; ++b) {
      attend_sequence<T, NV>(q_ptr + b * heads * dim, kv_ptr, idx + b * max_len, lens[b], heads,
                             kv_heads, static_cast<float>(scale), out_ptr + b * heads * dim,
                             scratch);
    }
  }
}

template <typename T>
void decode_attention_dispatch(const at::Tensor& q, const at::Tensor& kv,
                               const at::Tensor& kv_indices, const at::Tensor& seq_lens,
                               double scale, at::Tensor& out) {
  switch (q.size(2) / kLanes) {
#define BERTH_HEAD_DIM_CASE(nv) \
  case nv:                      \
    return decode_attention_impl<T, nv>(q, kv, kv_indices, seq_lens, scale, out);
    BERTH_HEAD_DIM_CASE(kHeadDim64)
    BERTH_HEAD_DIM_CASE(kHeadDim128)
    BERTH_HEAD_DIM_CASE(kHeadDim256)
#undef BERTH_HEAD_DIM_CASE
    default:
      TORCH_CHECK(false, "berth::decode_attention supports head dims 64, 128 and 256");
  }
}

// q [B, H, D]: one new token per sequence; kv [slots, 2 * Hkv, D]: one layer of the pool, K heads
// then V heads; kv_indices [B, L] int64: the slot of each position; seq_lens [B] int64, 1..L.
// Returns [B, H, D]. Query head h reads KV head h / (H / Hkv), as in grouped-query attention.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& kv_indices,
                            const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(q.device().is_cpu() && kv.device().is_cpu(), "berth::decode_attention is CPU only");
  TORCH_CHECK(q.dim() == 3 && kv.dim() == 3 && kv.size(2) == q.size(2), "bad q/kv shapes");
  TORCH_CHECK(q.scalar_type() == kv.scalar_type(), "q and kv dtypes differ");
  const int64_t dim = q.size(2), kv_heads = kv.size(1) / 2;
  TORCH_CHECK(kv.size(1) % 2 == 0 && kv_heads > 0 && q.size(1) % kv_heads == 0, "bad head counts");
  TORCH_CHECK(dim == 64 || dim == 128 || dim == 256, "head dim must be 64, 128 or 256");
  TORCH_CHECK(kv_indices.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong,
              "kv_indices and seq_lens must be int64");
  TORCH_CHECK(kv_indices.dim() == 2 && kv_indices.size(0) == q.size(0) &&
                  seq_lens.numel() == q.size(0),
              "kv_indices / seq_lens do not match the batch");
  TORCH_CHECK(kv.is_contiguous(), "kv must be contiguous");
  const at::Tensor qc = q.contiguous(), idx = kv_indices.contiguous(), lens = seq_lens.contiguous();
  at::Tensor out = at::empty_like(qc);
  if (q.scalar_type() == at::kBFloat16) {
    decode_attention_dispatch<c10::BFloat16>(qc, kv, idx, lens, scale, out);
  } else {
    TORCH_CHECK(q.scalar_type() == at::kFloat, "berth::decode_attention takes bf16 or fp32");
    decode_attention_dispatch<float>(qc, kv, idx, lens, scale, out);
  }
  return out;
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

}  // namespace

TORCH_LIBRARY(berth, m) {
  m.def(
      "decode_attention(Tensor q, Tensor kv, Tensor kv_indices, Tensor seq_lens, float scale)"
      " -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(berth, CPU, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
}
