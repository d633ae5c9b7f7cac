// Quantized projections on CPU with 8-bit integer dot products: torch.ops.berth.quant_linear.
//
// At one to eight rows a projection is a pass over its weight. PyTorch's int4 kernel turns each
// weight into a float before multiplying, which costs more than reading it (about 18 GB/s at one
// row, 6 at eight, on the embedded model's projections). This runs blocks of 32 weights the way
// llama.cpp does: the activations are quantized to int8 per block (scale da, code sum s), the
// weight's unsigned codes q multiply them as bytes (AVX-512 VNNI, AVX-512BW's two-step
// equivalent, or AVX2's), and each block's exact integer sum gets the weight's fp16 scale d and offset m:
//   sum_k (d q_k + m) (da a_k) = d da sum q a + m (da s).
// Two weight formats: the GGUF's 4-bit Q4_0/Q4_1 blocks (q in 0..15), and 8-bit blocks with
// q = code + 128 and m = -128 d (a symmetric int8 lm_head). Every activation row is computed
// alone, so a row's result does not depend on the batch.
//
// Layout (models/gguf_q4.py's `pack_q4_vnni`, models/int8_lm_head.py's `quantize_rows_q8`): output
// rows in groups of 16, one SIMD lane each. codes uint8 [N/16, K/32, C, 16, 4]: with 8-bit
// codes (C = 8) vector j holds per lane k = 4j..4j+3; with 4-bit ones (C = 4) vector c holds k =
// 8c..8c+3 in its low nibbles and 8c+4..8c+7 in its high ones. scales fp16 [N/16, K/32, 2, 16]:
// d, then m, per lane.
//
// This file holds the ops: their checks, the choice of instruction set (quant_linear_avx512.cpp,
// quant_linear_avx2.cpp) and a portable dequantization.

#include <torch/library.h>

#include <cstdlib>
#include <string>
#include <strings.h>

#include "quant_linear.h"

namespace {

using berth_quant::kBlock;
using berth_quant::kLanes;

// Ordered: each includes what the kernels need of the ones before.
enum class Isa { kNone, kAvx2, kAvx512Bw, kAvx512Vnni };
constexpr const char* kIsaNames[] = {"none", "avx2", "avx512bw", "avx512_vnni"};

// The best instruction set the kernels may use here: the CPU's, capped by $BERTH_CPU_ISA
// ("avx2" runs the AVX2 kernel on an AVX-512 machine, so that tests cover it everywhere;
// berth_runtime/utils/cpu_isa.py reads the same variable and checks its value).
Isa best_isa() {
  static const Isa best = [] {
    Isa isa = Isa::kNone;
#if defined(__x86_64__)
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) isa = Isa::kAvx2;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")) {
      isa = __builtin_cpu_supports("avx512vnni") ? Isa::kAvx512Vnni : Isa::kAvx512Bw;
    }
#endif
    const char* cap = std::getenv("BERTH_CPU_ISA");
    if (cap != nullptr && strcasecmp(cap, "avx2") == 0 && isa > Isa::kAvx2) isa = Isa::kAvx2;
    return isa;
  }();
  return best;
}

// `name` ("auto" or one of kIsaNames but "none") as an instruction set this CPU has.
Isa chosen_isa(c10::string_view name) {
  const Isa best = best_isa();
  if (name == "auto") {
    TORCH_CHECK(best != Isa::kNone,
                "berth::quant_linear needs AVX2 or AVX-512BW (see quant_linear_isa)");
    return best;
  }
  for (int i = 1; i < 4; ++i) {
    if (name == kIsaNames[i]) {
      const Isa isa = static_cast<Isa>(i);
      TORCH_CHECK(isa <= best, "berth::quant_linear: ", kIsaNames[i],
                  " is not available on this CPU (best: ", kIsaNames[static_cast<int>(best)], ")");
      return isa;
    }
  }
  TORCH_CHECK(false, "berth::quant_linear: unknown isa '", std::string(name),
              "' (auto, avx2, avx512bw or avx512_vnni)");
}

void check_packed(const at::Tensor& codes, const at::Tensor& scales, const char* op) {
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 5 &&
                  (codes.size(2) == 4 || codes.size(2) == 8) && codes.size(3) == kLanes &&
                  codes.size(4) == 4,
              "berth::", op, ": codes must be uint8 [N/16, K/32, 4 or 8, 16, 4]");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.dim() == 4 &&
                  scales.size(0) == codes.size(0) && scales.size(1) == codes.size(1) &&
                  scales.size(2) == 2 && scales.size(3) == kLanes,
              "berth::", op, ": scales must be fp16 [N/16, K/32, 2, 16]");
  TORCH_CHECK(codes.is_contiguous() && scales.is_contiguous(),
              "berth::", op, ": packed weight not contiguous");
}

template <typename T>
void linear_on(Isa isa, const T* x, int64_t rows, const uint8_t* codes, const c10::Half* scales,
               int64_t bits, int64_t k, int64_t n, T* out) {
  if (isa == Isa::kAvx2) {
    berth_quant::linear_avx2<T>(x, rows, codes, scales, bits, k, n, out);
  } else {
    berth_quant::linear_avx512<T>(x, rows, codes, scales, bits, k, n, out,
                                  isa == Isa::kAvx512Vnni);
  }
}

// x [rows, K] bf16 or fp32; codes uint8 [N/16, K/32, C, 16, 4] with C = 4 (4-bit codes, two a
// byte) or 8 (8-bit codes); scales fp16 [N/16, K/32, 2, 16] -> [rows, N] in x's dtype. `isa`
// "auto" takes the best this CPU has; naming a lesser one gives the same bits (the tests
// compare them).
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                        c10::string_view isa_name) {
  const Isa isa = chosen_isa(isa_name);
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2, "berth::quant_linear: x must be CPU [rows, K]");
  check_packed(codes, scales, "quant_linear");
  const int64_t k = codes.size(1) * kBlock, n = codes.size(0) * kLanes, bits = codes.size(2);
  TORCH_CHECK(x.size(1) == k, "berth::quant_linear: x has ", x.size(1), " columns, weight ", k);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "berth::quant_linear takes bf16 or fp32 activations");
  const at::Tensor xc = x.contiguous();
  const int64_t rows = xc.size(0);
  at::Tensor out = at::empty({rows, n}, xc.options());
  if (rows == 0) return out;
  if (xc.scalar_type() == at::kBFloat16) {
    using T = c10::BFloat16;
    linear_on<T>(isa, xc.data_ptr<T>(), rows, codes.data_ptr<uint8_t>(),
                 scales.data_ptr<c10::Half>(), bits, k, n, out.data_ptr<T>());
  } else {
    linear_on<float>(isa, xc.data_ptr<float>(), rows, codes.data_ptr<uint8_t>(),
                     scales.data_ptr<c10::Half>(), bits, k, n, out.data_ptr<float>());
  }
  return out;
}

// quant_dequantize without AVX-512, one weight at a time: w = d q + m, d q exact in fp32, then
// the one rounding to bf16 (to nearest even) that the AVX-512 kernel makes.
void dequantize_portable(const uint8_t* codes, const c10::Half* scales, int64_t bits, int64_t k,
                         int64_t g0, int64_t g1, c10::BFloat16* out) {
  const int64_t blocks = k / kBlock, chunks = bits == 4 ? 4 : 8;
  for (int64_t g = g0; g < g1; ++g) {
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* tile = codes + (g * blocks + b) * chunks * kLanes * 4;
      const c10::Half* pair = scales + (g * blocks + b) * 2 * kLanes;
      for (int64_t lane = 0; lane < kLanes; ++lane) {
        const float d = pair[lane], m = pair[kLanes + lane];
        c10::BFloat16* dst = out + (g * kLanes + lane) * k + b * kBlock;
        for (int64_t i = 0; i < kBlock; ++i) {
          int q;
          if (bits == 4) {  // chunk i / 8, byte i % 4, high nibble for i % 8 >= 4
            q = (tile[(i / 8) * 64 + lane * 4 + i % 4] >> (4 * ((i % 8) / 4))) & 0x0F;
          } else {  // chunk i / 4, byte i % 4
            q = tile[(i / 4) * 64 + lane * 4 + i % 4];
          }
          dst[i] = c10::BFloat16(d * static_cast<float>(q) + m);
        }
      }
    }
  }
}

// Writes into `out` (bf16 [N, K], contiguous) the weight a packed one stands for, bit for bit the
// bf16 rounding of the GGUF's dequantization. Steps too large for quant_linear run on it (through
// oneDNN, as a bf16 checkpoint's would), so a model need not keep bf16 weights besides the 4-bit
// ones; the caller reuses one `out` for every projection, which costs no page faults.
void quant_dequantize(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& out) {
  check_packed(codes, scales, "quant_dequantize");
  const int64_t k = codes.size(1) * kBlock, groups = codes.size(0), bits = codes.size(2);
  TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == at::kBFloat16 && out.dim() == 2 &&
                  out.size(0) == groups * kLanes && out.size(1) == k && out.is_contiguous(),
              "berth::quant_dequantize: out must be a contiguous bf16 [", groups * kLanes, ", ",
              k, "]");
  const auto* code_ptr = codes.data_ptr<uint8_t>();
  const auto* scale_ptr = scales.data_ptr<c10::Half>();
  auto* out_ptr = out.data_ptr<c10::BFloat16>();
  const bool avx512 = best_isa() >= Isa::kAvx512Bw;
  at::parallel_for(0, groups, 4, [&](int64_t g0, int64_t g1) {
    if (avx512) {
      berth_quant::dequantize_avx512(code_ptr, scale_ptr, bits, k, g0, g1, out_ptr);
    } else {
      dequantize_portable(code_ptr, scale_ptr, bits, k, g0, g1, out_ptr);
    }
  });
}

std::string quant_linear_isa() { return kIsaNames[static_cast<int>(best_isa())]; }

bool quant_linear_supported() { return best_isa() != Isa::kNone; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(berth, m) {
  m.def("quant_linear(Tensor x, Tensor codes, Tensor scales, str isa=\"auto\") -> Tensor");
  m.def("quant_dequantize(Tensor codes, Tensor scales, Tensor(a!) out) -> ()");
  m.def("quant_linear_isa() -> str", &quant_linear_isa);
  m.def("quant_linear_supported() -> bool", &quant_linear_supported);
}

TORCH_LIBRARY_IMPL(berth, CPU, m) {
  m.impl("quant_linear", &quant_linear);
  m.impl("quant_dequantize", &quant_dequantize);
}
