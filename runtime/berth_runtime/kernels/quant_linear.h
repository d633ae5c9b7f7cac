// Shared by quant_linear*.cpp: the packed layout's constants, activation rows quantized per
// block, the threads' split of a projection, and each instruction set's entry points.
//
// Every instruction set computes the same bits: the activations are quantized by the same
// float operations, each block's integer dot product is exact, and each output lane then gets
// the same two fused multiply-adds per block in the same order. So a decode step gives the same
// tokens on an AVX2 laptop as on an AVX-512 server (tests/integration/runtime/test_quant_linear.py
// compares the paths bit for bit).

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace berth_quant {

constexpr int64_t kBlock = 32;   // the GGUF's quantization block
constexpr int64_t kLanes = 16;   // output rows per group
constexpr int64_t kMaxRows = 8;  // activation rows kept in registers over a weight tile

// Activation rows quantized per block: int8 codes, and per block da and da * sum(codes).
struct QuantizedRows {
  int8_t* codes;       // [rows, K]
  float* scale;        // [rows, K/32]
  float* scaled_sum;   // [rows, K/32]

  QuantizedRows from_row(int64_t r0, int64_t k) const {
    const int64_t blocks = k / kBlock;
    return {codes + r0 * k, scale + r0 * blocks, scaled_sum + r0 * blocks};
  }
};

inline int32_t four_bytes(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// x [rows, K] -> out [rows, N]: `quantize(x, rows, k, q)` fills the quantized rows, then
// `groups(part, r0, rows, g0, g1)` computes output groups [g0, g1) for activation rows
// [r0, r0 + rows), rows <= kMaxRows. Threads split the output rows, in tiles of a few groups
// (a few KB of weight each, kept in cache while every chunk of eight activation rows passes
// over them): the weight is read from memory once however many rows there are.
template <typename T, typename Quantize, typename Groups>
void run_projection(const T* x, int64_t rows, int64_t k, int64_t n, Quantize quantize,
                    Groups groups) {
  const int64_t blocks = k / kBlock;
  at::Tensor workspace = at::empty({rows * (k + 8 * blocks)}, at::kByte);
  auto* base = workspace.data_ptr<uint8_t>();
  const QuantizedRows q{reinterpret_cast<int8_t*>(base),
                        reinterpret_cast<float*>(base + rows * k),
                        reinterpret_cast<float*>(base + rows * k + 4 * rows * blocks)};
  quantize(x, rows, k, q);
  constexpr int64_t kTileGroups = 4;
  at::parallel_for(0, n / kLanes, kTileGroups, [&](int64_t g0, int64_t g1) {
    for (int64_t t = g0; t < g1; t += kTileGroups) {
      const int64_t t1 = std::min(g1, t + kTileGroups);
      for (int64_t r0 = 0; r0 < rows; r0 += kMaxRows) {
        groups(q.from_row(r0, k), r0, std::min(kMaxRows, rows - r0), t, t1);
      }
    }
  });
}

// The instruction sets' kernels, T float or c10::BFloat16, bits 4 or 8 (see quant_linear.cpp
// for the layout). Each is defined in its own file, compiled with that set's target attributes
// whatever the library's own -m flags, and called only where the CPU has it.
template <typename T>
void linear_avx512(const T* x, int64_t rows, const uint8_t* codes, const c10::Half* scales,
                   int64_t bits, int64_t k, int64_t n, T* out, bool vnni);
template <typename T>
void linear_avx2(const T* x, int64_t rows, const uint8_t* codes, const c10::Half* scales,
                 int64_t bits, int64_t k, int64_t n, T* out);
// Groups [g0, g1) of a packed weight back to bf16 rows (see quant_linear.cpp's quant_dequantize).
void dequantize_avx512(const uint8_t* codes, const c10::Half* scales, int64_t bits, int64_t k,
                       int64_t g0, int64_t g1, c10::BFloat16* out);

}  // namespace berth_quant
