// A decode step through every decoder layer in one call: torch.ops.berth.decode_layers.
//
// At one to a few sequences a step on the 4-bit weights reads about 70 MB, a few milliseconds,
// and the Python around its ops cost about 2 ms more (some twenty ops a layer, each dispatched
// from Python; measured on the embedded model, 2 cores). This runs the same ops, in the same order and on the same tensors, from
// C++ (models/llama.py's decode path on 4-bit weights and Berth's attention): the result is bit
// for bit the one the Python layers give, which a test holds it to, and only the dispatch cost
// goes away.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

namespace {

// Tensors per layer in `weights`, in this order.
enum LayerWeight {
  kInputNorm,
  kQkvPacked,
  kQkvScales,
  kOutPacked,
  kOutScales,
  kPostNorm,
  kGateUpPacked,
  kGateUpScales,
  kDownPacked,
  kDownScales,
  kWeightsPerLayer,
};

constexpr int64_t kGroupSize = 32;  // the GGUF's 4-bit groups

// The 4-bit weight in either packing of models/gguf_q4.py's Int4Weight: Berth's integer kernel
// (quant_linear.cpp, codes of rank 5) or PyTorch's int4 kernel.
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales) {
  if (packed.dim() == 5) {
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("berth::quant_linear", "")
                               .typed<at::Tensor(const at::Tensor&, const at::Tensor&,
                                                 const at::Tensor&, c10::string_view)>();
    return op.call(x, packed, scales, "auto");
  }
  return at::_weight_int4pack_mm_for_cpu(x.contiguous(), packed, kGroupSize, scales);
}

// Berth's own kernels (cpu_kernels.cpp), through the dispatcher as Python calls them.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("berth::rms_norm", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, double)>();
  return op.call(x, weight, eps);
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("berth::add_rms_norm", "")
          .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                    const at::Tensor&, double)>();
  return op.call(x, residual, weight, eps);
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& kv_indices,
                            const at::Tensor& seq_lens, double scale) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("berth::decode_attention", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&,
                                               const at::Tensor&, const at::Tensor&, double)>();
  return op.call(q, kv, kv_indices, seq_lens, scale);
}

// hidden [T, H]: the step's embeddings; cos / signed_sin [T, 1, D]: its rotary tables;
// kv_buffer [layers, slots, 2 * kv_heads, D]; weights: kWeightsPerLayer tensors a layer, then
// the final norm's weight. Returns the final norm's output [T, H], as LlamaForCausalLM.forward.
at::Tensor decode_layers(const at::Tensor& hidden, const at::Tensor& cos,
                         const at::Tensor& signed_sin, const at::Tensor& kv_buffer,
                         const at::Tensor& out_cache_loc, const at::Tensor& kv_indices,
                         const at::Tensor& seq_lens, at::TensorList weights, int64_t num_heads,
                         int64_t num_kv_heads, int64_t intermediate_size, double eps,
                         double scale) {
  const int64_t layers = kv_buffer.size(0);
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * kWeightsPerLayer + 1,
              "decode_layers: expected ", layers * kWeightsPerLayer + 1, " weights, got ",
              weights.size());
  TORCH_CHECK(hidden.dim() == 2 && kv_buffer.dim() == 4, "hidden [T, H], kv_buffer [L, S, 2Hkv, D]");
  const int64_t tokens = hidden.size(0), head_dim = kv_buffer.size(3);
  const int64_t qk_heads = num_heads + num_kv_heads;
  at::Tensor x = hidden, residual;
  for (int64_t layer = 0; layer < layers; ++layer) {
    const at::Tensor* w = weights.data() + layer * kWeightsPerLayer;
    at::Tensor h;
    if (layer == 0) {
      h = rms_norm(x, w[kInputNorm], eps);
      residual = x;
    } else {
      std::tie(h, residual) = add_rms_norm(x, residual, w[kInputNorm], eps);
    }
    // Attention: q/k/v, rotary on q and k in place, the new K/V into the pool, paged attention.
    at::Tensor qkv = int4_linear(h, w[kQkvPacked], w[kQkvScales]).view({tokens, -1, head_dim});
    at::Tensor qk = qkv.narrow(1, 0, qk_heads);
    const std::vector<at::Tensor> halves = qk.chunk(2, -1);
    qk.copy_(qk * cos + at::cat({halves[1], halves[0]}, -1) * signed_sin);
    at::Tensor kv_cache = kv_buffer.select(0, layer);
    kv_cache.index_copy_(0, out_cache_loc, qkv.narrow(1, num_heads, 2 * num_kv_heads));
    at::Tensor attn = decode_attention(qkv.narrow(1, 0, num_heads), kv_cache, kv_indices,
                                       seq_lens, scale);
    at::Tensor o = int4_linear(attn.view({tokens, num_heads * head_dim}), w[kOutPacked],
                               w[kOutScales]);
    std::tie(h, residual) = add_rms_norm(o, residual, w[kPostNorm], eps);
    // MLP.
    at::Tensor gate_up = int4_linear(h, w[kGateUpPacked], w[kGateUpScales]);
    at::Tensor act = at::silu(gate_up.narrow(-1, 0, intermediate_size)) *
                     gate_up.narrow(-1, intermediate_size, intermediate_size);
    x = int4_linear(act, w[kDownPacked], w[kDownScales]);
  }
  return std::get<0>(add_rms_norm(x, residual, weights.back(), eps));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(berth, m) {
  m.def(
      "decode_layers(Tensor hidden, Tensor cos, Tensor signed_sin, Tensor(a!) kv_buffer,"
      " Tensor out_cache_loc, Tensor kv_indices, Tensor seq_lens, Tensor[] weights,"
      " int num_heads, int num_kv_heads, int intermediate_size, float eps, float scale)"
      " -> Tensor");
}

TORCH_LIBRARY_IMPL(berth, CPU, m) { m.impl("decode_layers", &decode_layers); }
