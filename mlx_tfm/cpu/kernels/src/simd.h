// One float vector type per instruction set, with the few operations the kernels need.
// kernels_body.inc is compiled once per instruction set (kernels_avx512.cpp, kernels_avx2.cpp,
// kernels_generic.cpp), each with its own compiler flags and ISA_NAMESPACE (so the three
// vector types never meet at link time); dispatch.cpp picks one at run time.
#pragma once

#include <cstdint>

#include "convert.h"

#if defined(MLX_TFM_ISA_AVX512) || defined(MLX_TFM_ISA_AVX2)
#include <immintrin.h>
#endif

#if defined(MLX_TFM_ISA_AVX512)

namespace mlx_tfm_kernels::ISA_NAMESPACE::simd {
constexpr int LANES = 16;
using F = __m512;
inline F zero() { return _mm512_setzero_ps(); }
inline F set1(float v) { return _mm512_set1_ps(v); }
inline F load(const float* p) { return _mm512_loadu_ps(p); }
inline void store(float* p, F v) { _mm512_storeu_ps(p, v); }
inline F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
inline F add(F a, F b) { return _mm512_add_ps(a, b); }
inline float hsum(F v) { return _mm512_reduce_add_ps(v); }
// Lane i = the sum of v[i]'s lanes, for LANES vectors: halves of pairs added level by level
// (15 shuffle pairs in all, where 16 horizontal sums take 64 shuffles). The levels leave the
// sums in the lane order 0 2 1 3 8 10 9 11 4 6 5 7 12 14 13 15; one permute undoes it.
inline F transposed_sums(const F* v) {
  F a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)  // 256-bit halves: a[i] = (v[i], v[i + 8]), 8 lanes each
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[i], v[i + 8], 0x44), _mm512_shuffle_f32x4(v[i], v[i + 8], 0xEE));
  for (int i = 0; i < 4; ++i)  // 128-bit blocks: b[i] = (v[i], v[i + 8], v[i + 4], v[i + 12]), 4 lanes each
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[i], a[i + 4], 0x88), _mm512_shuffle_f32x4(a[i], a[i + 4], 0xDD));
  for (int i = 0; i < 2; ++i)  // pairs within blocks: 2 lanes each
    c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[i], b[i + 2], 0x44), _mm512_shuffle_ps(b[i], b[i + 2], 0xEE));
  const F sums = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD));
  const __m512i order = _mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15);
  return _mm512_permutexvar_ps(order, sums);
}
inline F load_f16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline F load_bf16(const uint16_t* p) {
  __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
// LANES floats rounded to the nearest float16 / bfloat16 (ties to even, as MLX's conversions;
// a NaN becomes bfloat16's quiet NaN 0x7FC0, as MLX's does).
inline void store_f16(uint16_t* p, F v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}
inline void store_bf16(uint16_t* p, F v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd)), 16);
  rounded = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), rounded, _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(rounded));
}
// LANES unsigned bytes as floats.
inline F load_u8(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
// LANES bytes hold 2 * LANES 4-bit values: low nibbles (even positions) and high nibbles
// (odd positions) as two float vectors.
inline void load_nibbles(const uint8_t* p, F& low, F& high) {
  __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  __m512i mask = _mm512_set1_epi32(0x0F);
  low = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, mask));
  high = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
}
// A group's 16 dequantized values (scale * q + bias for q = 0..15) in one register: a
// 4-bit row's values are then one permute each (vpermps reads the low 4 bits of each
// index, so the low nibbles need no mask), where converting and scaling take three.
constexpr bool HAS_NIBBLE_TABLE = true;
inline F nibble_table(float scale, float bias) {
  const F iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  return _mm512_fmadd_ps(iota, _mm512_set1_ps(scale), _mm512_set1_ps(bias));
}
inline void lookup_nibbles(const uint8_t* p, F table, F& low, F& high) {
  __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  low = _mm512_permutexvar_ps(bytes, table);
  high = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
}

// Elementwise helpers for the pointwise kernels (RMSNorm, SwiGLU).
inline F mul(F a, F b) { return _mm512_mul_ps(a, b); }
inline F div(F a, F b) { return _mm512_div_ps(a, b); }
inline F clamp(F v, float lo, float hi) { return _mm512_min_ps(_mm512_max_ps(v, set1(lo)), set1(hi)); }
inline F round_nearest(F v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// v * 2^n for whole-number n.
inline F times_power_of_two(F v, F n) { return _mm512_scalef_ps(v, n); }
// `result` where x is a number, x itself where it is NaN (so a NaN survives a clamp).
inline F nan_from(F x, F result) { return _mm512_mask_mov_ps(result, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), x); }
}  // namespace mlx_tfm_kernels::ISA_NAMESPACE::simd

#elif defined(MLX_TFM_ISA_AVX2)

namespace mlx_tfm_kernels::ISA_NAMESPACE::simd {
constexpr int LANES = 8;
using F = __m256;
inline F zero() { return _mm256_setzero_ps(); }
inline F set1(float v) { return _mm256_set1_ps(v); }
inline F load(const float* p) { return _mm256_loadu_ps(p); }
inline void store(float* p, F v) { _mm256_storeu_ps(p, v); }
inline F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
inline F add(F a, F b) { return _mm256_add_ps(a, b); }
inline float hsum(F v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline F load_f16(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline F load_bf16(const uint16_t* p) {
  __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
// As the AVX-512 versions: ties to even, a NaN as 0x7FC0 in bfloat16.
inline void store_f16(uint16_t* p, F v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}
inline void store_bf16(uint16_t* p, F v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd)), 16);
  rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  // 32-bit lanes holding 16-bit values packed in order (packus works within each 128-bit half)
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1)));
}
inline F load_u8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
// Lane i = the sum of v[i]'s lanes, for LANES vectors (as the AVX-512 version: sums left
// in the lane order 0 2 1 3 4 6 5 7, one permute undoes it).
inline F transposed_sums(const F* v) {
  F a[4], b[2];
  for (int i = 0; i < 4; ++i)
    a[i] = _mm256_add_ps(_mm256_permute2f128_ps(v[i], v[i + 4], 0x20), _mm256_permute2f128_ps(v[i], v[i + 4], 0x31));
  for (int i = 0; i < 2; ++i)
    b[i] = _mm256_add_ps(_mm256_shuffle_ps(a[i], a[i + 2], 0x44), _mm256_shuffle_ps(a[i], a[i + 2], 0xEE));
  const F sums = _mm256_add_ps(_mm256_shuffle_ps(b[0], b[1], 0x88), _mm256_shuffle_ps(b[0], b[1], 0xDD));
  return _mm256_permutevar8x32_ps(sums, _mm256_setr_epi32(0, 2, 1, 3, 4, 6, 5, 7));
}

constexpr bool HAS_NIBBLE_TABLE = false;
inline F nibble_table(float, float) { return zero(); }
inline void lookup_nibbles(const uint8_t*, F, F&, F&) {}
inline void load_nibbles(const uint8_t* p, F& low, F& high) {
  __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  __m256i mask = _mm256_set1_epi32(0x0F);
  low = _mm256_cvtepi32_ps(_mm256_and_si256(bytes, mask));
  high = _mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4));
}

inline F mul(F a, F b) { return _mm256_mul_ps(a, b); }
inline F div(F a, F b) { return _mm256_div_ps(a, b); }
inline F clamp(F v, float lo, float hi) { return _mm256_min_ps(_mm256_max_ps(v, set1(lo)), set1(hi)); }
inline F round_nearest(F v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// v * 2^n for whole-number n in the normal range (exp's reduction keeps it there): n is
// added to v's exponent bits.
inline F times_power_of_two(F v, F n) {
  __m256i shift = _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23);
  return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(v), shift));
}
inline F nan_from(F x, F result) { return _mm256_blendv_ps(result, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q)); }
}  // namespace mlx_tfm_kernels::ISA_NAMESPACE::simd

#else  // portable: fixed-size arrays the compiler vectorizes (NEON on arm64, SSE2 on x86-64)

namespace mlx_tfm_kernels::ISA_NAMESPACE::simd {
constexpr int LANES = 8;
struct F {
  float v[LANES];
};
inline F zero() { return F{}; }
inline F set1(float s) {
  F r;
  for (int i = 0; i < LANES; ++i) r.v[i] = s;
  return r;
}
inline F load(const float* p) {
  F r;
  for (int i = 0; i < LANES; ++i) r.v[i] = p[i];
  return r;
}
inline void store(float* p, F a) {
  for (int i = 0; i < LANES; ++i) p[i] = a.v[i];
}
inline F fma(F a, F b, F c) {
  for (int i = 0; i < LANES; ++i) c.v[i] += a.v[i] * b.v[i];
  return c;
}
inline F add(F a, F b) {
  for (int i = 0; i < LANES; ++i) a.v[i] += b.v[i];
  return a;
}
inline float hsum(F a) {
  float s = 0;
  for (int i = 0; i < LANES; ++i) s += a.v[i];
  return s;
}
inline F load_f16(const uint16_t* p) {
  F r;
  for (int i = 0; i < LANES; ++i) r.v[i] = half_to_float(p[i]);
  return r;
}
inline F load_bf16(const uint16_t* p) {
  F r;
  for (int i = 0; i < LANES; ++i) r.v[i] = bf16_to_float(p[i]);
  return r;
}
inline void store_f16(uint16_t* p, F a) {
  for (int i = 0; i < LANES; ++i) p[i] = float_to_half(a.v[i]);
}
inline void store_bf16(uint16_t* p, F a) {
  for (int i = 0; i < LANES; ++i) p[i] = float_to_bf16(a.v[i]);
}
inline F load_u8(const uint8_t* p) {
  F r;
  for (int i = 0; i < LANES; ++i) r.v[i] = static_cast<float>(p[i]);
  return r;
}
// Lane i = the sum of v[i]'s lanes, for LANES vectors.
inline F transposed_sums(const F* v) {
  F r;
  for (int i = 0; i < LANES; ++i) r.v[i] = hsum(v[i]);
  return r;
}

constexpr bool HAS_NIBBLE_TABLE = false;
inline F nibble_table(float, float) { return zero(); }
inline void lookup_nibbles(const uint8_t*, F, F&, F&) {}
inline void load_nibbles(const uint8_t* p, F& low, F& high) {
  for (int i = 0; i < LANES; ++i) {
    low.v[i] = static_cast<float>(p[i] & 0x0F);
    high.v[i] = static_cast<float>(p[i] >> 4);
  }
}

inline F mul(F a, F b) {
  for (int i = 0; i < LANES; ++i) a.v[i] *= b.v[i];
  return a;
}
inline F div(F a, F b) {
  for (int i = 0; i < LANES; ++i) a.v[i] /= b.v[i];
  return a;
}
inline F clamp(F a, float lo, float hi) {
  for (int i = 0; i < LANES; ++i) a.v[i] = a.v[i] < lo ? lo : (a.v[i] > hi ? hi : a.v[i]);
  return a;
}
inline F round_nearest(F a) {
  for (int i = 0; i < LANES; ++i) a.v[i] = __builtin_nearbyintf(a.v[i]);
  return a;
}
inline F times_power_of_two(F a, F n) {
  for (int i = 0; i < LANES; ++i) a.v[i] = __builtin_ldexpf(a.v[i], static_cast<int>(n.v[i]));
  return a;
}
inline F nan_from(F x, F result) {
  for (int i = 0; i < LANES; ++i) result.v[i] = x.v[i] != x.v[i] ? x.v[i] : result.v[i];
  return result;
}
}  // namespace mlx_tfm_kernels::ISA_NAMESPACE::simd

#endif
