// The chunked gated delta rule (Gated DeltaNet: Qwen3-Next, Qwen3.5) on the CPU: one head's
// chunk of positions against its state, compiled per instruction set (deltanet_body.inc);
// the MLX operation over every head and chunk is deltanet_op.h. Apart from kernels.h so that
// the other kernels' files and these change without touching each other. Included by the
// instruction sets' files: nothing here may be shared inline code (static inline only).
#pragma once

#include <cstdint>

namespace mlx_tfm_kernels {

// Rows of values, states and outputs are this many floats apart at least (a multiple of
// every instruction set's lanes; the padding is zeros), and so are the keys' columns once
// transposed.
constexpr int64_t DELTA_PAD = 16;

static inline int64_t padded_to(int64_t n, int64_t multiple) { return (n + multiple - 1) / multiple * multiple; }

// One head's chunk of c positions, float32, and the state it starts from. With the decay
// summed within the chunk, gamma_i = g_1 + ... + g_i, the chunk computes (the delta rule
// position by position, written for the whole chunk at once):
//   delta_i = beta_i (v_i - e^gamma_i k_i S - sum_{j<i} e^(gamma_i - gamma_j) (k_i.k_j) delta_j)
//   out_i   = e^gamma_i q_i S + sum_{j<=i} e^(gamma_i - gamma_j) (q_i.k_j) delta_j
//   S       = e^gamma_c S + sum_i e^(gamma_c - gamma_i) k_i^T delta_i
// The first line is a unit lower-triangular system, solved by forward substitution.
struct DeltaChunk {
  int64_t c, dk, dv_padded;  // positions, key size, value size padded to DELTA_PAD
  // rows: queries (c, dk), then keys (c, dk) right after them (the two multiply the state in
  // one pass); values (c, dv_padded)
  const float* queries_then_keys;
  const float* values;
  const double* gamma;  // (c,) the summed decays, in double: their differences stay exact
  const float* beta;    // (c,)
  float* state;         // (dk, dv_padded), updated in place
  float* out;           // (c, dv_padded)
  float* scratch;       // delta_chunk_scratch floats
};

// The floats of scratch a chunk of up to `chunk` positions needs.
static inline int64_t delta_chunk_scratch(int64_t chunk, int64_t dk, int64_t dv_padded) {
  const int64_t columns = padded_to(chunk, DELTA_PAD);
  return dk * columns            // keys transposed (dk, columns)
         + 2 * chunk * columns   // q.k and k.k (c, columns) each
         + 2 * chunk * dv_padded // q S and k S
         + chunk * dv_padded     // delta
         + chunk * chunk         // decays within the chunk
         + 4 * chunk + 64;       // decays from its start / to its end, coefficients, alignment
}

struct DeltaKernels {
  const char* name;
  void (*chunk)(const DeltaChunk&);
};

namespace avx512 { const DeltaKernels& delta_kernels(); }
namespace avx2 { const DeltaKernels& delta_kernels(); }
namespace generic { const DeltaKernels& delta_kernels(); }

// The set for the instruction set the other kernels use (best_kernels()).
const DeltaKernels& best_delta_kernels();

}  // namespace mlx_tfm_kernels
