// The kernels as MLX operations: lazy arrays in the graph, computed on a CPU stream.
#pragma once

#include <functional>
#include <optional>

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mlx_tfm_kernels {

namespace mx = mlx::core;

// x (..., k) @ w.T for a float32 / float16 / bfloat16 w (n, k): (..., n). dense (many
// positions, a prompt): through float32 BLAS, x made float32 once and w a cache-sized block
// of rows at a time into one buffer, which is all the float32 weights that ever exist
// (needs blas_found()).
mx::array matvec(const mx::array& x, const mx::array& w, bool dense = false, mx::StreamOrDevice s = {});

// x (..., k) @ dequantize(w, scales, biases).T for MLX's affine layout, 4 or 8 bits,
// group_size 32, 64 or 128: (..., n). dense (many positions, a prompt): through float32
// BLAS, w dequantized a cache-sized block of rows at a time into one buffer, which is all
// the float32 weights that ever exist (needs blas_found()). int8_activations (not dense):
// x rounded to int8 blocks and integer dot products (int8dot.h), as llama.cpp's Q8_0.
mx::array quantized_matvec(const mx::array& x, const mx::array& w, const mx::array& scales,
                           const mx::array& biases, int group_size, int bits, bool dense = false,
                           bool int8_activations = false, mx::StreamOrDevice s = {});

// Whether the cblas_sgemm MLX multiplies with was found (for quantized_matvec's dense route).
bool blas_found();

// Rows ids (...) of the dequantized w: (..., k), in the scales' type (an embedding lookup).
mx::array quantized_rows(const mx::array& ids, const mx::array& w, const mx::array& scales,
                         const mx::array& biases, int group_size, int bits,
                         mx::StreamOrDevice s = {});

// Attention of queries (B, H, L, D) over keys and values (B, H_kv, S, D), H a multiple of
// H_kv (GQA): every position visible, or those a boolean mask (B or 1, 1, 1, S) allows
// (rows of a batch that start at different slots, an encoder's padding); causal: query l
// sees positions up to S - L + l only (a prompt's chunk at the end of the cache).
mx::array attention(const mx::array& queries, const mx::array& keys, const mx::array& values, float scale,
                    const std::optional<mx::array>& mask = std::nullopt, bool causal = false,
                    mx::StreamOrDevice s = {});

// x (..., d) / sqrt(mean(x^2) + eps) * weight (d,), as mx.fast.rms_norm: in float32,
// rounded to the output's type before the weight multiplies.
mx::array rms_norm(const mx::array& x, const mx::array& weight, float eps, mx::StreamOrDevice s = {});

// mx.fast.rope with ``freqs`` (dims / 2 periods) for x (B, H, L, D) of any layout:
// position offset + l (offset a scalar or one per row, (B,)), angle scale * position / freq.
mx::array rope(const mx::array& x, const mx::array& offset, const mx::array& freqs, int dims, bool traditional,
               float scale, mx::StreamOrDevice s = {});

// log(sum(exp(x))) over the last axis, kept as size 1 (as mx.logsumexp(x, -1, keepdims=True)).
mx::array logsumexp(const mx::array& x, mx::StreamOrDevice s = {});

// silu(gate) * up, elementwise (SwiGLU's activation), computed in float32.
mx::array silu_mul(const mx::array& gate, const mx::array& up, mx::StreamOrDevice s = {});

// cap * tanh(x / cap), elementwise (Gemma's soft cap on logits), computed in float32.
mx::array soft_cap(const mx::array& x, float cap, mx::StreamOrDevice s = {});

// RoPE applied to the first two products of a decoding step (queries and keys): mx.fast.rope's
// dims, traditional and scale, with `freqs` periods and positions `offset` (one, or one per row).
struct RopeSettings {
  int dims = 0;  // 0: no rotation
  bool traditional = false;
  float scale = 1.0f;
};

// The products x (..., k) @ w_i.T of one x with several weights of one kind, in one call
// (one pass of the thread pool over all their rows): a layer's query, key and value
// projections. `weights` holds each w (float), or each (w, scales, biases) (quantized,
// bits 4 or 8). gated: two weights (gate, up) and one output, silu(x @ gate.T) * (x @ up.T).
// heads (one count per product; x (B, 1, k), one position): each output (B, heads, 1, n / heads),
// the layout attention reads, and with rope.dims the first two rotated at positions offset.
// int8_activations (quantized): as quantized_matvec's.
std::vector<mx::array> fused_products(const mx::array& x, const std::vector<mx::array>& weights, int group_size,
                                      int bits, bool gated, const std::vector<int>& heads = {},
                                      const std::optional<mx::array>& offset = std::nullopt,
                                      const std::optional<mx::array>& freqs = std::nullopt, RopeSettings rope = {},
                                      bool int8_activations = false, mx::StreamOrDevice s = {});

// Runs compute(inputs, outputs) on the stream's CPU encoder after MLX's other work there,
// the outputs given fresh buffers: the body of a multi-output primitive's eval_cpu.
using OutputsCompute = std::function<void(const std::vector<mx::array>&, std::vector<mx::array>&)>;
// Whether kernels' outputs start as NaN (MLX_TFM_KERNELS_POISON=1; primitives.cpp says why).
bool outputs_poisoned();

void dispatch_outputs(mx::Stream stream, const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs,
                      OutputsCompute compute);

// Gradients through MLX's own ops: those of `reference` (the same computation in MLX ops)
// with respect to the float inputs among argnums; zeros for integer inputs.
using Reference = std::function<std::vector<mx::array>(const std::vector<mx::array>&)>;
std::vector<mx::array> reference_vjp(const Reference& reference, const std::vector<mx::array>& primals,
                                     const std::vector<mx::array>& cotangents, const std::vector<int>& argnums,
                                     mx::Stream stream);

class FusedProducts : public mx::Primitive {
 public:
  FusedProducts(mx::Stream stream, Reference reference, int group_size, int bits, bool gated, RopeSettings rope,
                bool int8_activations)
      : mx::Primitive(stream), reference_(std::move(reference)), group_size_(group_size), bits_(bits), gated_(gated),
        rope_(rope), int8_activations_(int8_activations) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  std::vector<mx::array> vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums, const std::vector<mx::array>& outputs) override {
    return reference_vjp(reference_, primals, cotangents, argnums, stream());
  }
  const char* name() const override { return "MlxTfmFusedProducts"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  Reference reference_;
  int group_size_, bits_;
  bool gated_;
  RopeSettings rope_;
  bool int8_activations_;
};

// The pointwise primitives: one output shaped like the first input, gradients through
// MLX's own ops (the `reference` each was built with).
class Pointwise : public mx::UnaryPrimitive {
 public:
  Pointwise(mx::Stream stream, Reference reference) : mx::UnaryPrimitive(stream), reference_(std::move(reference)) {}
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  std::vector<mx::array> vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums, const std::vector<mx::array>& outputs) override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override { return {inputs[0].shape()}; }

 private:
  Reference reference_;
};

class RMSNorm : public Pointwise {
 public:
  RMSNorm(mx::Stream stream, Reference reference, float eps) : Pointwise(stream, std::move(reference)), eps_(eps) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override { return "MlxTfmRMSNorm"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  float eps_;
};

class RoPE : public Pointwise {
 public:
  RoPE(mx::Stream stream, Reference reference, int dims, bool traditional, float scale)
      : Pointwise(stream, std::move(reference)), dims_(dims), traditional_(traditional), scale_(scale) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override { return "MlxTfmRoPE"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  int dims_;
  bool traditional_;
  float scale_;
};

class LogSumExp : public Pointwise {
 public:
  LogSumExp(mx::Stream stream, Reference reference) : Pointwise(stream, std::move(reference)) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
  const char* name() const override { return "MlxTfmLogSumExp"; }
  bool is_equivalent(const mx::Primitive& other) const override { return true; }
};

class SiluMul : public Pointwise {
 public:
  SiluMul(mx::Stream stream, Reference reference) : Pointwise(stream, std::move(reference)) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override { return "MlxTfmSiluMul"; }
  bool is_equivalent(const mx::Primitive& other) const override { return true; }
};

class SoftCap : public Pointwise {
 public:
  SoftCap(mx::Stream stream, Reference reference, float cap) : Pointwise(stream, std::move(reference)), cap_(cap) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override { return "MlxTfmSoftCap"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  float cap_;
};

class Attention : public Pointwise {
 public:
  Attention(mx::Stream stream, Reference reference, float scale, bool causal)
      : Pointwise(stream, std::move(reference)), scale_(scale), causal_(causal) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override { return "MlxTfmAttention"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  float scale_;
  bool causal_;
};

class MatVec : public mx::UnaryPrimitive {
 public:
  MatVec(mx::Stream stream, bool dense) : mx::UnaryPrimitive(stream), dense_(dense) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  std::vector<mx::array> vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums, const std::vector<mx::array>& outputs) override;
  const char* name() const override { return "MlxTfmMatVec"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return dense_ == static_cast<const MatVec&>(other).dense_;
  }

 private:
  bool dense_;
};

class QuantizedMatVec : public mx::UnaryPrimitive {
 public:
  QuantizedMatVec(mx::Stream stream, int group_size, int bits, bool dense, bool int8_activations)
      : mx::UnaryPrimitive(stream), group_size_(group_size), bits_(bits), dense_(dense),
        int8_activations_(int8_activations) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  std::vector<mx::array> vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums, const std::vector<mx::array>& outputs) override;
  const char* name() const override { return "MlxTfmQuantizedMatVec"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  int group_size_, bits_;
  bool dense_, int8_activations_;
};

class QuantizedRows : public mx::UnaryPrimitive {
 public:
  QuantizedRows(mx::Stream stream, int group_size, int bits)
      : mx::UnaryPrimitive(stream), group_size_(group_size), bits_(bits) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  // The quantized inputs (packed integers, indices) carry no gradient: zeros, so a product
  // that reaches them behind mx.depends (a prompt's blocks in training) stays differentiable.
  std::vector<mx::array> vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums, const std::vector<mx::array>& outputs) override;
  const char* name() const override { return "MlxTfmQuantizedRows"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  int group_size_, bits_;
};

}  // namespace mlx_tfm_kernels
