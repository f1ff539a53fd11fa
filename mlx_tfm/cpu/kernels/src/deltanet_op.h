// The chunked gated delta rule as an MLX operation (deltanet.cpp): heads over the thread
// pool, each head's chunks in order through deltanet.h's kernel.
#pragma once

#include <vector>

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mlx_tfm_kernels {

namespace mx = mlx::core;

// The gated delta rule over queries, keys (B, H, L, Dk), values (B, H, L, Dv), g and beta
// (B, H, L) from state (B, H, Dk, Dv), in chunks of chunk_size positions (the last one
// shorter), heads over the thread pool: {out (B, H, L, Dv), the final state}, both in the
// inputs' promoted dtype, computed in float32. Any layout, float32 / float16 / bfloat16.
// No gradient of its own: mlx_tfm/cpu/deltanet.py gives it the plain MLX route's.
std::vector<mx::array> delta_rule_chunked(const mx::array& queries, const mx::array& keys, const mx::array& values,
                                          const mx::array& g, const mx::array& beta, const mx::array& state,
                                          int chunk_size, mx::StreamOrDevice s = {});

class DeltaRuleChunked : public mx::Primitive {
 public:
  DeltaRuleChunked(mx::Stream stream, int chunk_size) : mx::Primitive(stream), chunk_size_(chunk_size) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  std::vector<mx::array> vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums, const std::vector<mx::array>& outputs) override;
  const char* name() const override { return "MlxTfmDeltaRuleChunked"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return chunk_size_ == static_cast<const DeltaRuleChunked&>(other).chunk_size_;
  }

 private:
  int chunk_size_;
};

}  // namespace mlx_tfm_kernels
