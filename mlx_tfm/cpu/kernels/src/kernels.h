// The products the kernels compute, described as plain pointers and sizes, and the entry
// points each instruction set provides (kernels_body.inc, compiled once per set).
#pragma once

#include <cstdint>

namespace mlx_tfm_kernels {

enum class Real { F32, F16, BF16 };

// y (m, n) = x (m, k) @ w.T for a row-contiguous w (n, k) of type w_type. x is float32,
// row-contiguous; y float32.
struct FloatProduct {
  const void* w;
  Real w_type;
  int64_t n, k;
  const float* x;
  int64_t m;
  float* y;
};

// The same for MLX's affine quantization: w (n, k * bits / 8) bytes, value j of a row in
// bits j*bits.. of its little-endian words; scales and biases (n, k / group_size) of type
// scale_type: w_value = scale * q + bias. For 4 bits x_arranged holds x arranged as the
// kernel reads it (arrange_for_nibbles); for 8 bits it is x (m, k) as is. x_group_sums
// (m, k / group_size) holds the sum of x over each group (what the biases multiply).
struct QuantizedProduct {
  const uint8_t* w;
  int bits, group_size;
  int64_t n, k;
  const void* scales;
  const void* biases;
  Real scale_type;
  const float* x_arranged;
  const float* x_group_sums;
  int64_t m;
  float* y;
};

// Attention of L queries per (batch, head) over S positions: out (B, H, L, D) =
// softmax(scale * q . K) @ V, the H query heads sharing H / H_kv KV heads (GQA). q is
// float32 (B, H, L, D) row-major; keys and values of kv_type, each position's D values
// contiguous, strided over (batch, KV head, position) in elements; out float32 like q.
struct AttentionProblem {
  const float* q;
  const void* keys;
  const void* values;
  Real kv_type;
  int64_t batch, heads, kv_heads, queries, positions, head_dim;
  int64_t key_strides[3], value_strides[3];
  float scale;
  float* out;
  // Which positions each row may attend to (a batch of rows that start at different
  // slots, an encoder's padding): mask[b * mask_row_stride + s] nonzero; null: every position.
  const uint8_t* mask = nullptr;
  int64_t mask_row_stride = 0;
  // Query l sees positions up to S - L + l only (the last L of S positions, as the
  // fused op aligns a causal mask).
  bool causal = false;
  // Several queries (a prompt): each work item is a block of this many query positions of
  // one (batch, KV head) pair, with its group's query heads.
  int64_t block_queries = 1;
};

// One instruction set's kernels: each computes the outputs of rows [n0, n1) of w.
struct Kernels {
  const char* name;
  int lanes;
  void (*float_rows)(const FloatProduct&, int64_t n0, int64_t n1);
  void (*quantized_rows)(const QuantizedProduct&, int64_t n0, int64_t n1);
  // Work items [i0, i1) of an attention problem (attention_items counts them), each with
  // its H / H_kv query heads; scratch: attention_scratch floats.
  void (*attention)(const AttentionProblem&, int64_t i0, int64_t i1, float* scratch);
  // Rows [n0, n1) of a quantized product's w dequantized into out (n, k) float32 (the
  // product's x, sums, m and y are not read).
  void (*dequantize_rows)(const QuantizedProduct&, float* out, int64_t n0, int64_t n1);
  // out (n) = silu(gate) * up, float32.
  void (*silu_mul)(const float* gate, const float* up, float* out, int64_t n);
  // Rows [r0, r1) of x (rows, d) RMS-normalized, times weight (d,) unless it is null.
  void (*rms_norm_rows)(const float* x, const float* weight, float eps, int64_t d, float* out, int64_t r0,
                        int64_t r1);
  // out[r] = log(sum(e^x[r, :])) for rows [r0, r1) of x (rows, n); NaN for a row with a NaN.
  void (*logsumexp_rows)(const float* x, int64_t n, float* out, int64_t r0, int64_t r1);
  // Rows [r0, r1) of a row-major (rows, k) matrix of type `type` as float32 into out (rows, k):
  // a 16-bit weight's block for BLAS, a prompt's activations.
  void (*to_float32_rows)(const void* from, Real type, int64_t k, float* out, int64_t r0, int64_t r1);
  // n float32 values rounded to `type` (float16 or bfloat16; float32: copied) into `to`.
  void (*from_float32)(const float* from, Real type, void* to, int64_t n);
  // out (n) = cap * tanh(x / cap), float32.
  void (*soft_cap)(const float* x, float cap, float* out, int64_t n);
};

namespace avx512 { const Kernels& kernels(); }
namespace avx2 { const Kernels& kernels(); }
namespace generic { const Kernels& kernels(); }

// The set in use: the best this CPU runs, or the one MLX_TFM_KERNELS_ISA names (avx512,
// avx2 or generic). Throws std::invalid_argument (isa.h's isa_request_error) when that
// names a set unknown or one this CPU lacks.
const Kernels& best_kernels();

// The products compute up to this many positions (rows of x) per pass over the weights.
constexpr int MAX_POSITIONS = 8;

constexpr int64_t CACHE_LINE_BYTES = 64;

// x (m, k) arranged for 4-bit rows read LANES bytes at a time: in each block of 2 * lanes
// values, the even ones first, then the odd ones (a byte holds two neighbours); and the
// positions of each chunk of MAX_POSITIONS side by side, block by block (out[m0 * k +
// (block * chunk + i) * 2 * lanes ...] for position m0 + i of the chunk at m0), so the
// kernel reads every position's block at a fixed distance from one pointer.
void arrange_for_nibbles(const float* x, float* out, int64_t m, int64_t k, int lanes);

// The work items of an attention problem: (batch, KV head) pairs for one query, blocks
// of block_queries positions of each pair for several; and the floats of scratch each
// needs (scores, and for several queries a transposed tile of keys).
constexpr int64_t KEY_TILE = 64;
int64_t attention_items(const AttentionProblem& p);
int64_t attention_scratch(const AttentionProblem& p);

}  // namespace mlx_tfm_kernels
