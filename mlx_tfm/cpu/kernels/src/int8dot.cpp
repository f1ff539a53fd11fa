// The int8-activation products' choice of instruction set, and x rounded to int8 blocks
// (int8dot.h). Compiled for the build's baseline, as dispatch.cpp.
#include <cmath>
#include <cstring>
#include <string>

#include "int8dot.h"

namespace mlx_tfm_kernels {

const Int8Kernels& best_int8_kernels() {
  const std::string name = best_kernels().name;
#if defined(__x86_64__)
  if (name == "avx512") {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vnni") ? avx512vnni::int8_kernels() : avx2::int8_kernels();
  }
  if (name == "avx2") return avx2::int8_kernels();
#endif
  return generic::int8_kernels();
}

void quantize_activations(const float* x, int64_t m, int64_t k, int group_size, int bits, int8_t* x_int8,
                          float* lane_scales, float* int8_group_sums) {
  const int64_t blocks = m * k / ACT_BLOCK, per_group = group_size / ACT_BLOCK;
  for (int64_t b = 0; b < blocks; ++b) {
    const float* from = x + b * ACT_BLOCK;
    float largest = 0.0f;
    for (int i = 0; i < ACT_BLOCK; ++i) {
      const float magnitude = std::fabs(from[i]);
      if (magnitude > largest || magnitude != magnitude) largest = magnitude;  // a NaN stays
    }
    const float scale = largest / 127.0f, inverse = largest > 0.0f ? 127.0f / largest : 0.0f;
    int8_t rounded[ACT_BLOCK];
    int32_t total = 0;
    for (int i = 0; i < ACT_BLOCK; ++i) {
      // nearbyint rounds ties to even (the default rounding mode), as numpy's rint; a NaN
      // block has inverse 0 and scale NaN: zeros here, NaN through its scale
      const float v = std::nearbyint(from[i] * inverse);
      rounded[i] = v == v ? static_cast<int8_t>(v) : 0;
      total += rounded[i];
    }
    if (bits == 4) {  // the even values, then the odd ones, of this block or of its pair (int8dot.h)
      const bool paired = group_size >= 2 * ACT_BLOCK;
      int8_t* evens = x_int8 + (paired ? (b & ~int64_t{1}) * ACT_BLOCK + (b & 1) * ACT_BLOCK / 2 : b * ACT_BLOCK);
      int8_t* odds = evens + (paired ? ACT_BLOCK : ACT_BLOCK / 2);
      for (int i = 0; i < ACT_BLOCK / 2; ++i) {
        evens[i] = rounded[2 * i];
        odds[i] = rounded[2 * i + 1];
      }
    } else {
      std::memcpy(x_int8 + b * ACT_BLOCK, rounded, ACT_BLOCK);
    }
    for (int lane = 0; lane < 4; ++lane) lane_scales[4 * b + lane] = scale;
    if (b % per_group == 0) int8_group_sums[b / per_group] = 0.0f;
    int8_group_sums[b / per_group] += scale * static_cast<float>(total);
  }
}

}  // namespace mlx_tfm_kernels
