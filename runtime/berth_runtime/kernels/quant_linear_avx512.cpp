// The AVX-512 kernels of torch.ops.berth.quant_linear and quant_dequantize (see quant_linear.cpp
// for the layout): one 512-bit vector holds a group's 16 output lanes. The weight's unsigned
// codes multiply the int8 activations as bytes with VNNI's vpdpbusd, or AVX-512BW's two-step
// equivalent; a block's transposed chunks give the dequantized rows.

#include "quant_linear.h"

#include <type_traits>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace berth_quant {
namespace {

#if defined(__x86_64__)

#define BERTH_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,f16c,fma")))
#define BERTH_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,f16c,fma")))

template <typename T>
BERTH_AVX512 inline __m512 load16(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_loadu_ps(p);
  } else {
    __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  }
}

template <typename T>
BERTH_AVX512 void quantize_rows(const T* x, int64_t rows, int64_t k, QuantizedRows q) {
  const int64_t blocks = k / kBlock;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      const T* src = x + r * k + b * kBlock;
      __m512 lo = load16(src), hi = load16(src + 16);
      const float amax = _mm512_reduce_max_ps(
          _mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
      const float scale = amax / 127.f;
      const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
      __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv));
      __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
      int8_t* dst = q.codes + r * k + b * kBlock;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtsepi32_epi8(qlo));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), _mm512_cvtsepi32_epi8(qhi));
      const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
      q.scale[r * blocks + b] = scale;
      q.scaled_sum[r * blocks + b] = scale * static_cast<float>(sum);
    }
  }
}

// acc + the 4-byte dot products of unsigned codes and signed activations, per 32-bit lane.
template <int BITS>
BERTH_AVX512 inline __m512i dot_bytes_bw(__m512i acc, __m512i u8, __m512i s8) {
  const __m512i ones = _mm512_set1_epi16(1);
  if constexpr (BITS == 4) {
    // Products are at most 15 * 128 a byte pair: the 16-bit pair sums cannot saturate.
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u8, s8), ones));
  } else {
    // 8-bit codes could (255 * 128 * 2 > 32767): multiply their two nibbles separately.
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    const __m512i lo = _mm512_and_si512(u8, nibble);
    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(u8, 4), nibble);
    const __m512i lo_sum = _mm512_madd_epi16(_mm512_maddubs_epi16(lo, s8), ones);
    const __m512i hi_sum = _mm512_madd_epi16(_mm512_maddubs_epi16(hi, s8), ones);
    return _mm512_add_epi32(acc, _mm512_add_epi32(lo_sum, _mm512_slli_epi32(hi_sum, 4)));
  }
}

template <int BITS>
BERTH_VNNI inline __m512i dot_bytes_vnni(__m512i acc, __m512i u8, __m512i s8) {
  return _mm512_dpbusd_epi32(acc, u8, s8);  // 32-bit sums: no saturation at either width
}

template <typename T>
BERTH_AVX512 inline void store16(T* p, __m512 v) {
  if constexpr (std::is_same_v<T, float>) {
    _mm512_storeu_ps(p, v);
  } else {
    // float -> bf16, rounding to nearest even (finite values).
    __m512i bits = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    bits = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
  }
}

// Rows [g0, g1) of groups: out[r, 16g + lane] for every activation row r < ROWS. Each block's
// weight comes as eight vectors of unsigned bytes, vector j holding k = 4j..4j+3 of every lane.
#define BERTH_QUANT_GROUPS(ATTR, DOT)                                                            \
  template <int BITS, int ROWS, typename T>                                                     \
  ATTR void groups_##DOT(const uint8_t* codes, const c10::Half* scales, QuantizedRows q,        \
                         int64_t k, int64_t n, int64_t g0, int64_t g1, T* out) {                 \
    constexpr int64_t block_bytes = kBlock * kLanes * BITS / 8;                                  \
    const int64_t blocks = k / kBlock;                                                          \
    const __m512i nibble = _mm512_set1_epi8(0x0F);                                              \
    for (int64_t g = g0; g < g1; ++g) {                                                         \
      __m512 acc[ROWS];                                                                         \
      for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();                              \
      const uint8_t* wc = codes + g * blocks * block_bytes;                                     \
      const c10::Half* ws = scales + g * blocks * 2 * kLanes;                                    \
      for (int64_t b = 0; b < blocks; ++b, wc += block_bytes, ws += 2 * kLanes) {                \
        __m512i w[8];                                                                           \
        for (int c = 0; c < BITS; ++c) {                                                        \
          const __m512i v = _mm512_loadu_si512(wc + c * 64);                                    \
          if constexpr (BITS == 4) {                                                            \
            w[2 * c] = _mm512_and_si512(v, nibble);                                             \
            w[2 * c + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);                   \
          } else {                                                                              \
            w[c] = v;                                                                           \
          }                                                                                     \
        }                                                                                       \
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ws))); \
        const __m512 m =                                                                        \
            _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ws + kLanes)));  \
        for (int r = 0; r < ROWS; ++r) {                                                        \
          const int8_t* a = q.codes + r * k + b * kBlock;                                       \
          __m512i isum = _mm512_setzero_si512();                                                \
          for (int j = 0; j < 8; ++j)                                                           \
            isum = dot_bytes_##DOT<BITS>(isum, w[j], _mm512_set1_epi32(four_bytes(a + 4 * j)));        \
          const __m512 da = _mm512_set1_ps(q.scale[r * blocks + b]);                            \
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(d, da), acc[r]);     \
          acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(q.scaled_sum[r * blocks + b]), acc[r]);    \
        }                                                                                       \
      }                                                                                         \
      for (int r = 0; r < ROWS; ++r) store16(out + r * n + g * kLanes, acc[r]);                 \
    }                                                                                           \
  }

BERTH_QUANT_GROUPS(BERTH_VNNI, vnni)
BERTH_QUANT_GROUPS(BERTH_AVX512, bw)

// Groups [g0, g1) for `rows` activation rows (rows <= kMaxRows) from `q` into `out`.
template <int BITS, typename T>
void groups_for_rows(const uint8_t* codes, const c10::Half* scales, QuantizedRows q, int64_t rows,
                     int64_t k, int64_t n, int64_t g0, int64_t g1, T* out, bool vnni) {
  switch (rows) {
#define BERTH_ROWS_CASE(R)                                                            \
  case R:                                                                             \
    if (vnni) return groups_vnni<BITS, R, T>(codes, scales, q, k, n, g0, g1, out);    \
    return groups_bw<BITS, R, T>(codes, scales, q, k, n, g0, g1, out);
    BERTH_ROWS_CASE(1)
    BERTH_ROWS_CASE(2)
    BERTH_ROWS_CASE(3)
    BERTH_ROWS_CASE(4)
    BERTH_ROWS_CASE(5)
    BERTH_ROWS_CASE(6)
    BERTH_ROWS_CASE(7)
    BERTH_ROWS_CASE(8)
#undef BERTH_ROWS_CASE
  }
}

// fp32 -> bf16, rounding to nearest even, as c10::BFloat16 does (the weights are finite).
BERTH_AVX512 inline void store_bf16(c10::BFloat16* dst, __m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst),
                      _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
}

// One output row's 32 codes (one a byte, k order) -> its 32 bf16 weights w = d q + m at `dst`.
BERTH_AVX512 inline void dequantize_row_block(__m128i first, __m128i second, float d, float m,
                                              c10::BFloat16* dst) {
  const __m512 dv = _mm512_set1_ps(d), mv = _mm512_set1_ps(m);
  const __m512 q0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(first));
  const __m512 q1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(second));
  store_bf16(dst, _mm512_add_ps(_mm512_mul_ps(q0, dv), mv));
  store_bf16(dst + 16, _mm512_add_ps(_mm512_mul_ps(q1, dv), mv));
}

// Four 64-byte chunks (16 lanes x 4 bytes each) transposed: lane 4s + j's 16 bytes (its 4 bytes
// of chunk 0, 1, 2, 3) end up in 128-bit segment s of out[j].
BERTH_AVX512 inline void transpose_chunks(const uint8_t* chunks, __m512i out[4]) {
  const __m512i c0 = _mm512_loadu_si512(chunks), c1 = _mm512_loadu_si512(chunks + 64);
  const __m512i c2 = _mm512_loadu_si512(chunks + 128), c3 = _mm512_loadu_si512(chunks + 192);
  const __m512i lo01 = _mm512_unpacklo_epi32(c0, c1), hi01 = _mm512_unpackhi_epi32(c0, c1);
  const __m512i lo23 = _mm512_unpacklo_epi32(c2, c3), hi23 = _mm512_unpackhi_epi32(c2, c3);
  out[0] = _mm512_unpacklo_epi64(lo01, lo23);
  out[1] = _mm512_unpackhi_epi64(lo01, lo23);
  out[2] = _mm512_unpacklo_epi64(hi01, hi23);
  out[3] = _mm512_unpackhi_epi64(hi01, hi23);
}

template <int SEGMENT>
BERTH_AVX512 inline __m128i segment(__m512i v) {
  return _mm512_extracti32x4_epi32(v, SEGMENT);
}

// The 4 lanes 4 S + j (j = 0..3) of one block: their codes from the transposed chunks.
template <int BITS, int S>
BERTH_AVX512 inline void dequantize_segment(const __m512i (&first)[4], const __m512i (&second)[4],
                                            const float* d, const float* m, int64_t k,
                                            c10::BFloat16* block_out) {
  const __m128i low_nibbles = _mm_set1_epi8(0x0F);
  for (int j = 0; j < 4; ++j) {
    const int lane = 4 * S + j;
    __m128i a, b;  // the lane's codes k = 0..15 and 16..31
    if constexpr (BITS == 4) {
      const __m128i packed = segment<S>(first[j]);  // chunk c: k = 8c..8c+3 low, +4..+7 high
      const __m128i lo = _mm_and_si128(packed, low_nibbles);
      const __m128i hi = _mm_and_si128(_mm_srli_epi16(packed, 4), low_nibbles);
      a = _mm_unpacklo_epi32(lo, hi);
      b = _mm_unpackhi_epi32(lo, hi);
    } else {
      a = segment<S>(first[j]);  // chunks 0..3: k = 0..15
      b = segment<S>(second[j]);  // chunks 4..7: k = 16..31
    }
    dequantize_row_block(a, b, d[lane], m[lane], block_out + lane * k);
  }
}

// Groups g0..g1 of a packed weight back to bf16 rows [16 (g1 - g0), K]: w = d q + m. d q is
// exact in fp32 (a 4- or 8-bit integer times an fp16), so w is the one fp32 rounding of the
// GGUF's own dequantization, and its bf16 the weight a bf16 checkpoint of the file holds. A
// block's chunks are transposed in registers so that each lane's codes come out together.
template <int BITS>
BERTH_AVX512 void dequantize_groups(const uint8_t* codes, const c10::Half* scales, int64_t k,
                                    int64_t g0, int64_t g1, c10::BFloat16* out) {
  constexpr int64_t kChunks = BITS == 4 ? 4 : 8;
  const int64_t blocks = k / kBlock;
  for (int64_t g = g0; g < g1; ++g) {
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* tile = codes + (g * blocks + b) * kChunks * kLanes * 4;
      const c10::Half* pair = scales + (g * blocks + b) * 2 * kLanes;
      alignas(64) float d[kLanes], m[kLanes];
      _mm512_store_ps(d, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(pair))));
      _mm512_store_ps(
          m, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(pair + kLanes))));
      __m512i first[4], second[4];
      transpose_chunks(tile, first);
      if constexpr (BITS == 8) transpose_chunks(tile + 4 * kLanes * 4, second);
      c10::BFloat16* block_out = out + g * kLanes * k + b * kBlock;
      dequantize_segment<BITS, 0>(first, second, d, m, k, block_out);
      dequantize_segment<BITS, 1>(first, second, d, m, k, block_out);
      dequantize_segment<BITS, 2>(first, second, d, m, k, block_out);
      dequantize_segment<BITS, 3>(first, second, d, m, k, block_out);
    }
  }
}

#endif  // __x86_64__

}  // namespace

template <typename T>
void linear_avx512(const T* x, int64_t rows, const uint8_t* codes, const c10::Half* scales,
                   int64_t bits, int64_t k, int64_t n, T* out, bool vnni) {
#if defined(__x86_64__)
  const auto quantize = [](const T* src, int64_t r, int64_t kk, QuantizedRows q) {
    quantize_rows<T>(src, r, kk, q);
  };
  run_projection<T>(x, rows, k, n, quantize,
                    [&](QuantizedRows q, int64_t r0, int64_t r, int64_t g0, int64_t g1) {
                      if (bits == 4) {
                        groups_for_rows<4, T>(codes, scales, q, r, k, n, g0, g1, out + r0 * n, vnni);
                      } else {
                        groups_for_rows<8, T>(codes, scales, q, r, k, n, g0, g1, out + r0 * n, vnni);
                      }
                    });
#else
  TORCH_CHECK(false, "berth::quant_linear: no AVX-512 on this architecture");
#endif
}

template void linear_avx512<float>(const float*, int64_t, const uint8_t*, const c10::Half*,
                                   int64_t, int64_t, int64_t, float*, bool);
template void linear_avx512<c10::BFloat16>(const c10::BFloat16*, int64_t, const uint8_t*,
                                           const c10::Half*, int64_t, int64_t, int64_t,
                                           c10::BFloat16*, bool);

void dequantize_avx512(const uint8_t* codes, const c10::Half* scales, int64_t bits, int64_t k,
                       int64_t g0, int64_t g1, c10::BFloat16* out) {
#if defined(__x86_64__)
  if (bits == 4) {
    dequantize_groups<4>(codes, scales, k, g0, g1, out);
  } else {
    dequantize_groups<8>(codes, scales, k, g0, g1, out);
  }
#else
  TORCH_CHECK(false, "berth::quant_dequantize: no AVX-512 on this architecture");
#endif
}

}  // namespace berth_quant
