// The AVX2 kernel of torch.ops.berth.quant_linear (see quant_linear.cpp for the layout), for the
// many cloud and laptop CPUs without AVX-512. A 256-bit vector holds half a group: output lanes
// 0..7, then 8..15, each half read from its 32 bytes of every 64-byte chunk, so the packed weight
// is the one the AVX-512 kernel reads. The products are llama.cpp's AVX2 ones: vpmaddubsw
// multiplies the unsigned codes by the int8 activations into 16-bit pair sums, vpmaddwd widens
// them. A 4-bit block's eight pair sums add up in 16 bits without overflow (8 x 2 x 15 x 127 =
// 30,480), so one widening serves the block; 8-bit codes are split into nibbles as on AVX-512BW.
// Every integer sum is exact and the float steps are the AVX-512 kernel's, lane for lane: the
// result is the same bits.

#include "quant_linear.h"

#include <type_traits>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace berth_quant {
namespace {

#if defined(__x86_64__)

#define BERTH_AVX2 __attribute__((target("avx2,fma,f16c")))

// Activation rows a pass over a weight tile takes: with 16 vector registers (AVX-512 has 32),
// eight rows' accumulators beside a block's eight weight vectors spill. Measured on the AVX2
// build, alternating: a 32-row pass over one layer's projections 0.70-1.08 ms with four rows a
// pass, 1.07-1.23 ms with eight.
constexpr int64_t kAvx2Rows = 4;

template <typename T>
BERTH_AVX2 inline __m256 load8(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm256_loadu_ps(p);
  } else {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
  }
}

BERTH_AVX2 inline float max_of(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

BERTH_AVX2 inline int32_t sum_of(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// The AVX-512 kernel's quantization in 8-float steps: the same scale, reciprocal and rounding.
template <typename T>
BERTH_AVX2 void quantize_rows(const T* x, int64_t rows, int64_t k, QuantizedRows q) {
  const int64_t blocks = k / kBlock;
  const __m256 sign = _mm256_set1_ps(-0.f);
  // packs_epi32 then packs_epi16 leave 4-byte groups in the order 0, 2, 4, 6, 1, 3, 5, 7.
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      const T* src = x + r * k + b * kBlock;
      __m256 v[4];
      for (int i = 0; i < 4; ++i) v[i] = load8(src + 8 * i);
      const __m256 abs_max = _mm256_max_ps(
          _mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
          _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
      const float amax = max_of(abs_max);
      const float scale = amax / 127.f;
      const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
      __m256i c[4];
      for (int i = 0; i < 4; ++i) c[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
      const __m256i bytes = _mm256_permutevar8x32_epi32(
          _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3])),
          order);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q.codes + r * k + b * kBlock), bytes);
      const int32_t sum =
          sum_of(_mm256_add_epi32(_mm256_add_epi32(c[0], c[1]), _mm256_add_epi32(c[2], c[3])));
      q.scale[r * blocks + b] = scale;
      q.scaled_sum[r * blocks + b] = scale * static_cast<float>(sum);
    }
  }
}

template <typename T>
BERTH_AVX2 inline void store8(T* p, __m256 v) {
  if constexpr (std::is_same_v<T, float>) {
    _mm256_storeu_ps(p, v);
  } else {
    // float -> bf16, rounding to nearest even (finite values), as the AVX-512 kernel does.
    __m256i bits = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    bits = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    // packus puts 4 halves of each 128-bit lane side by side: qwords 0 and 2 hold all eight.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(bits, bits), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
}

// One block's exact integer dot products for 8 lanes. 4-bit codes: w[j] holds k = 4j..4j+3 of
// each lane. 8-bit codes, which could saturate a pair (255 x 128 x 2 > 32767): w[j] holds their
// low nibbles and w[8 + j] their high ones, split once per block for all rows.
template <int BITS>
BERTH_AVX2 inline __m256i block_dot(const __m256i* w, const int8_t* a) {
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (BITS == 4) {
    __m256i pairs = _mm256_maddubs_epi16(w[0], _mm256_set1_epi32(four_bytes(a)));
    for (int j = 1; j < 8; ++j)
      pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(w[j], _mm256_set1_epi32(four_bytes(a + 4 * j))));
    return _mm256_madd_epi16(pairs, ones);
  } else {
    __m256i lo = _mm256_setzero_si256(), hi = _mm256_setzero_si256();
    for (int j = 0; j < 8; ++j) {
      const __m256i s8 = _mm256_set1_epi32(four_bytes(a + 4 * j));
      lo = _mm256_add_epi16(lo, _mm256_maddubs_epi16(w[j], s8));
      hi = _mm256_add_epi16(hi, _mm256_maddubs_epi16(w[8 + j], s8));
    }
    return _mm256_add_epi32(_mm256_madd_epi16(lo, ones),
                            _mm256_slli_epi32(_mm256_madd_epi16(hi, ones), 4));
  }
}

// Output groups [g0, g1), both halves, for ROWS activation rows.
template <int BITS, int ROWS, typename T>
BERTH_AVX2 void groups_avx2(const uint8_t* codes, const c10::Half* scales, QuantizedRows q,
                            int64_t k, int64_t n, int64_t g0, int64_t g1, T* out) {
  constexpr int64_t block_bytes = kBlock * kLanes * BITS / 8;
  const int64_t blocks = k / kBlock;
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  for (int64_t g = g0; g < g1; ++g) {
    for (int64_t half = 0; half < 2; ++half) {
      __m256 acc[ROWS];
      for (int r = 0; r < ROWS; ++r) acc[r] = _mm256_setzero_ps();
      const uint8_t* wc = codes + g * blocks * block_bytes + half * 32;
      const c10::Half* ws = scales + g * blocks * 2 * kLanes + half * 8;
      for (int64_t b = 0; b < blocks; ++b, wc += block_bytes, ws += 2 * kLanes) {
        __m256i w[16];
        for (int c = 0; c < BITS; ++c) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wc + c * 64));
          const __m256i low = _mm256_and_si256(v, nibble);
          const __m256i high = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
          if constexpr (BITS == 4) {  // chunk c: k = 8c..8c+3 low, 8c+4..8c+7 high
            w[2 * c] = low;
            w[2 * c + 1] = high;
          } else {  // chunk c: k = 4c..4c+3
            w[c] = low;
            w[8 + c] = high;
          }
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ws)));
        const __m256 m =
            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ws + kLanes)));
        for (int r = 0; r < ROWS; ++r) {
          const __m256i isum = block_dot<BITS>(w, q.codes + r * k + b * kBlock);
          const __m256 da = _mm256_set1_ps(q.scale[r * blocks + b]);
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(d, da), acc[r]);
          acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(q.scaled_sum[r * blocks + b]), acc[r]);
        }
      }
      for (int r = 0; r < ROWS; ++r) store8(out + r * n + g * kLanes + half * 8, acc[r]);
    }
  }
}

// Rows [0, rows) in passes of at most kAvx2Rows over the same weight tile (still in cache).
template <int BITS, typename T>
void groups_for_rows(const uint8_t* codes, const c10::Half* scales, QuantizedRows q, int64_t rows,
                     int64_t k, int64_t n, int64_t g0, int64_t g1, T* out) {
  if (rows > kAvx2Rows) {
    groups_for_rows<BITS, T>(codes, scales, q, kAvx2Rows, k, n, g0, g1, out);
    groups_for_rows<BITS, T>(codes, scales, q.from_row(kAvx2Rows, k), rows - kAvx2Rows, k, n, g0,
                             g1, out + kAvx2Rows * n);
    return;
  }
  switch (rows) {
#define BERTH_ROWS_CASE(R) \
  case R:                  \
    return groups_avx2<BITS, R, T>(codes, scales, q, k, n, g0, g1, out);
    BERTH_ROWS_CASE(1)
    BERTH_ROWS_CASE(2)
    BERTH_ROWS_CASE(3)
    BERTH_ROWS_CASE(4)
#undef BERTH_ROWS_CASE
  }
}

#endif  // __x86_64__

}  // namespace

template <typename T>
void linear_avx2(const T* x, int64_t rows, const uint8_t* codes, const c10::Half* scales,
                 int64_t bits, int64_t k, int64_t n, T* out) {
#if defined(__x86_64__)
  const auto quantize = [](const T* src, int64_t r, int64_t kk, QuantizedRows q) {
    quantize_rows<T>(src, r, kk, q);
  };
  run_projection<T>(x, rows, k, n, quantize,
                    [&](QuantizedRows q, int64_t r0, int64_t r, int64_t g0, int64_t g1) {
                      if (bits == 4) {
                        groups_for_rows<4, T>(codes, scales, q, r, k, n, g0, g1, out + r0 * n);
                      } else {
                        groups_for_rows<8, T>(codes, scales, q, r, k, n, g0, g1, out + r0 * n);
                      }
                    });
#else
  TORCH_CHECK(false, "berth::quant_linear: no AVX2 on this architecture");
#endif
}

template void linear_avx2<float>(const float*, int64_t, const uint8_t*, const c10::Half*, int64_t,
                                 int64_t, int64_t, float*);
template void linear_avx2<c10::BFloat16>(const c10::BFloat16*, int64_t, const uint8_t*,
                                         const c10::Half*, int64_t, int64_t, int64_t,
                                         c10::BFloat16*);

}  // namespace berth_quant
