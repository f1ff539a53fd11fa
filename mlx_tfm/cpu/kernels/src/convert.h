// Scalar conversions from the half-precision formats' bits. Internal linkage (static): the
// kernel files are compiled with different instruction sets, and a shared inline copy of
// these could be one built for AVX-512 called on a CPU without it.
#pragma once

#include <cstdint>
#include <cstring>

namespace mlx_tfm_kernels {

static inline float bits_to_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// IEEE binary16 -> binary32, exactly (subnormals, infinities and NaN included).
static inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exponent = (h >> 10) & 0x1Fu, mantissa = h & 0x3FFu;
  if (exponent == 0x1F) return bits_to_float(sign | 0x7F800000u | (mantissa << 13));
  if (exponent == 0) {
    if (mantissa == 0) return bits_to_float(sign);
    exponent = 113;  // a subnormal: shift the mantissa up to its leading 1
    while (!(mantissa & 0x400u)) {
      mantissa <<= 1;
      --exponent;
    }
    return bits_to_float(sign | (exponent << 23) | ((mantissa & 0x3FFu) << 13));
  }
  return bits_to_float(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

static inline float bf16_to_float(uint16_t bits) { return bits_to_float(static_cast<uint32_t>(bits) << 16); }

// binary32 -> bfloat16 bits, to nearest with ties to even; a NaN as the quiet NaN 0x7FC0
// (MLX's rounding).
static inline uint16_t float_to_bf16(float v) {
  if (v != v) return 0x7FC0u;
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

// binary32 -> binary16 bits, to nearest with ties to even (the compiler's own conversion:
// F16C where the file is built with it, else its library's exact routine).
static inline uint16_t float_to_half(float v) {
  const _Float16 h = static_cast<_Float16>(v);
  uint16_t bits;
  std::memcpy(&bits, &h, 2);
  return bits;
}

}  // namespace mlx_tfm_kernels
