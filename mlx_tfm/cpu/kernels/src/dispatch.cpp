// Picks the instruction set at run time from what the CPU reports.
#include <algorithm>
#include <cstdlib>
#include <string>

#include "kernels.h"

namespace mlx_tfm_kernels {

namespace {

const Kernels& detect() {
  const char* cap = std::getenv("MLX_TFM_KERNELS_ISA");
  const std::string limit = cap ? cap : "";
#if defined(__x86_64__)
  __builtin_cpu_init();
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c");
  if (avx512 && limit.empty()) return avx512::kernels();
  if (avx2 && limit != "generic") return avx2::kernels();
#endif
  return generic::kernels();
}

}  // namespace

const Kernels& best_kernels() {
  static const Kernels& chosen = detect();
  return chosen;
}

void arrange_for_nibbles(const float* x, float* out, int64_t m, int64_t k, int lanes) {
  const int64_t block = 2 * lanes;
  for (int64_t m0 = 0; m0 < m; m0 += MAX_POSITIONS) {
    const int64_t chunk = std::min<int64_t>(MAX_POSITIONS, m - m0);
    for (int64_t i = 0; i < chunk; ++i) {
      const float* row = x + (m0 + i) * k;
      for (int64_t start = 0; start < k; start += block) {
        float* to = out + m0 * k + ((start / block) * chunk + i) * block;
        for (int j = 0; j < lanes; ++j) {
          to[j] = row[start + 2 * j];
          to[lanes + j] = row[start + 2 * j + 1];
        }
      }
    }
  }
}

int64_t attention_items(const AttentionProblem& p) {
  const int64_t pairs = p.batch * p.kv_heads;
  return p.queries == 1 ? pairs : pairs * ((p.queries + p.block_queries - 1) / p.block_queries);
}

int64_t attention_scratch(const AttentionProblem& p) {
  const int64_t group = p.heads / p.kv_heads;
  if (p.queries == 1) return group * p.positions;
  const int64_t padded = (p.positions + KEY_TILE - 1) / KEY_TILE * KEY_TILE;
  return group * p.block_queries * padded + KEY_TILE * p.head_dim;
}

}  // namespace mlx_tfm_kernels
