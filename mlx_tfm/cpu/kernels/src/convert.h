// Scalar conversions from the half-precision formats' bits.
#pragma once

#include <cstdint>
#include <cstring>

#include "mlx/types/half_types.h"

namespace mlx_tfm_kernels {

inline float half_to_float(uint16_t bits) {
  mlx::core::float16_t h;
  std::memcpy(&h, &bits, 2);
  return static_cast<float>(h);
}

inline float bf16_to_float(uint16_t bits) {
  uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &wide, 4);
  return f;
}

}  // namespace mlx_tfm_kernels
