// A quantized product of a few positions in integer arithmetic, as llama.cpp's Q8_0
// activations: x rounded to int8 in blocks of ACT_BLOCK values (one float scale each), then
// integer dot products of the weights' unsigned 4- or 8-bit values with those bytes. Off by
// default (the rounding of x changes results slightly: mlx_tfm/cpu/switch.py). Compiled per
// instruction set (int8dot_body.inc); apart from kernels.h so that each changes on its own.
// Included by the instruction sets' files: nothing here may be shared inline code.
#pragma once

#include <cstdint>

#include "kernels.h"

namespace mlx_tfm_kernels {

// Values of x per int8 scale: Q8_0's block, and the smallest group MLX quantizes by, so
// every group holds whole blocks.
constexpr int ACT_BLOCK = 32;

// x (m, k) as int8 blocks against MLX's affine w (QuantizedProduct's layout: w_value =
// scale * q + bias per group). For block b of position i, x ~ x_lane_scales[i, 4 b] * x_int8;
// a group's contribution to y is
//   scale * sum_b block_scale[b] * (q_b . x_int8_b) + bias * x_int8_group_sums[g],
// the bias term with the sum of the rounded x, as llama.cpp's Q8_1 keeps it: then the error
// is sum (scale * q + bias) * (rounded x - x), the weights' own values times x's rounding.
// With the exact sum of x it is sum scale * q * (rounded x - x), and scale * q spans the
// group's whole range (up to twice the largest |w|): a larger error (docs/cpu-kernels.md).
struct Int8Product {
  const uint8_t* w;
  int bits, group_size;
  int64_t n, k;
  const void* scales;
  const void* biases;
  Real scale_type;
  // (m, k): for 4 bits each block's even values first, then its odd ones (a byte of w holds
  // two neighbours, its low nibble the even one), and from groups of 64 on, each pair of
  // blocks' even values (block by block), then their odd ones (32 bytes of w, two blocks, are
  // read at once); for 8 bits as x.
  const int8_t* x_int8;
  // (m, 4 * k / ACT_BLOCK): each block's scale four times, as the lanes of the integer dot
  // products hold their sums (a pair of blocks' scales is one load).
  const float* x_lane_scales;
  const float* x_int8_group_sums;  // (m, k / group_size): the sums of the rounded x (block scale * x_int8)
  int64_t m;
  float* y;                        // (m, n)
};

struct Int8Kernels {
  const char* name;
  // The outputs of rows [n0, n1) of w, every position.
  void (*rows)(const Int8Product&, int64_t n0, int64_t n1);
};

#if defined(__x86_64__)
namespace avx512vnni { const Int8Kernels& int8_kernels(); }
namespace avx2 { const Int8Kernels& int8_kernels(); }
#endif
namespace generic { const Int8Kernels& int8_kernels(); }

// The set that goes with best_kernels(): AVX-512's uses VNNI where the CPU has it, else the
// AVX2 set's (every AVX-512 CPU runs AVX2; the integer dot products are 256 bits wide either way).
const Int8Kernels& best_int8_kernels();

// x (m, k) float32 into an Int8Product's x_int8, x_lane_scales and x_int8_group_sums
// each block's scale is its largest magnitude / 127 (NaN where the block holds a NaN, so
// the product is NaN as the float one is), its values x / scale rounded to the nearest
// integer (ties to even), so |x_int8| <= 127.
void quantize_activations(const float* x, int64_t m, int64_t k, int group_size, int bits, int8_t* x_int8,
                          float* lane_scales, float* int8_group_sums);

}  // namespace mlx_tfm_kernels
