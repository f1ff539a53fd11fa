// The kernels as MLX operations: lazy arrays in the graph, computed on a CPU stream.
#pragma once

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mlx_tfm_kernels {

namespace mx = mlx::core;

// x (..., k) @ w.T for a float32 / float16 / bfloat16 w (n, k): (..., n).
mx::array matvec(const mx::array& x, const mx::array& w, mx::StreamOrDevice s = {});

// x (..., k) @ dequantize(w, scales, biases).T for MLX's affine layout, 4 or 8 bits,
// group_size 32, 64 or 128: (..., n).
mx::array quantized_matvec(const mx::array& x, const mx::array& w, const mx::array& scales,
                           const mx::array& biases, int group_size, int bits,
                           mx::StreamOrDevice s = {});

// Rows ids (...) of the dequantized w: (..., k), in the scales' type (an embedding lookup).
mx::array quantized_rows(const mx::array& ids, const mx::array& w, const mx::array& scales,
                         const mx::array& biases, int group_size, int bits,
                         mx::StreamOrDevice s = {});

// Attention of one query position: queries (B, H, 1, D) over keys and values
// (B, H_kv, S, D), H a multiple of H_kv (GQA), every position visible (a decoding step).
mx::array one_query_attention(const mx::array& queries, const mx::array& keys, const mx::array& values,
                              float scale, mx::StreamOrDevice s = {});

// dequantize(w, scales, biases) as float32 (n, k), on every core: a prompt's quantized
// products then run as float32 BLAS.
mx::array dequantize(const mx::array& w, const mx::array& scales, const mx::array& biases, int group_size,
                     int bits, mx::StreamOrDevice s = {});

class Dequantize : public mx::UnaryPrimitive {
 public:
  Dequantize(mx::Stream stream, int group_size, int bits)
      : mx::UnaryPrimitive(stream), group_size_(group_size), bits_(bits) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  // The quantized inputs (packed integers, indices) carry no gradient: zeros, so a product
  // that reaches them behind mx.depends (a prompt's blocks in training) stays differentiable.
  std::vector<mx::array> vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums, const std::vector<mx::array>& outputs) override;
  const char* name() const override { return "MlxTfmDequantize"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  int group_size_, bits_;
};

class OneQueryAttention : public mx::UnaryPrimitive {
 public:
  OneQueryAttention(mx::Stream stream, float scale) : mx::UnaryPrimitive(stream), scale_(scale) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override { return "MlxTfmOneQueryAttention"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  float scale_;
};

class MatVec : public mx::UnaryPrimitive {
 public:
  explicit MatVec(mx::Stream stream) : mx::UnaryPrimitive(stream) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  std::vector<mx::array> vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums, const std::vector<mx::array>& outputs) override;
  const char* name() const override { return "MlxTfmMatVec"; }
  bool is_equivalent(const mx::Primitive& other) const override { return true; }
};

class QuantizedMatVec : public mx::UnaryPrimitive {
 public:
  QuantizedMatVec(mx::Stream stream, int group_size, int bits)
      : mx::UnaryPrimitive(stream), group_size_(group_size), bits_(bits) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  std::vector<mx::array> vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums, const std::vector<mx::array>& outputs) override;
  const char* name() const override { return "MlxTfmQuantizedMatVec"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  int group_size_, bits_;
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
