// The Python module mlx_tfm.cpu.kernels._kernels (nanobind, in MLX's nanobind domain so
// that mx.array passes through as MLX's own bindings define it).
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "mlx/version.h"

#include "isa.h"
#include "deltanet_op.h"
#include "int8dot.h"
#include "kernels.h"
#include "pool.h"
#include "primitives.h"

namespace nb = nanobind;
using namespace nb::literals;
namespace k = mlx_tfm_kernels;

#define STRINGIFY_(x) #x
#define STRINGIFY(x) STRINGIFY_(x)

NB_MODULE(_kernels, m) {
  m.doc() = "mlx_tfm's CPU kernels as MLX operations (see mlx_tfm/cpu/kernels/__init__.py).";
  m.def("matvec", &k::matvec, "x"_a, "w"_a, nb::kw_only(), "dense"_a = false, "stream"_a = nb::none(),
        "x (..., k) @ w.T for a float32/float16/bfloat16 w (n, k); dense: through float32 BLAS by blocks of "
        "w's rows made float32 (many positions).");
  m.def("quantized_matvec", &k::quantized_matvec, "x"_a, "w"_a, "scales"_a, "biases"_a, nb::kw_only(),
        "group_size"_a, "bits"_a, "dense"_a = false, "int8_activations"_a = false, "stream"_a = nb::none(),
        "x (..., k) @ dequantize(w).T for MLX's affine 4/8-bit layout; dense: through float32 BLAS by blocks "
        "of dequantized rows (many positions); int8_activations: x rounded to int8 per 32 values and integer "
        "dot products (as llama.cpp's Q8_0; not dense).");
  m.def("blas_found", &k::blas_found, "Whether the cblas_sgemm MLX multiplies with was found (dense products).");
  m.def("quantized_rows", &k::quantized_rows, "ids"_a, "w"_a, "scales"_a, "biases"_a, nb::kw_only(),
        "group_size"_a, "bits"_a, "stream"_a = nb::none(),
        "Rows ids of the dequantized w (a quantized embedding lookup).");
  m.def("attention", &k::attention, "queries"_a, "keys"_a, "values"_a, nb::kw_only(), "scale"_a,
        "mask"_a = nb::none(), "causal"_a = false, "stream"_a = nb::none(),
        "Attention of queries (B, H, L, D) over keys, values (B, H_kv, S, D): every position visible, or those "
        "a boolean mask (B or 1, 1, 1, S) allows; causal: query l sees positions up to S - L + l.");
  m.def("rms_norm", &k::rms_norm, "x"_a, "weight"_a, nb::kw_only(), "eps"_a, "stream"_a = nb::none(),
        "mx.fast.rms_norm(x, weight, eps) in one pass.");
  m.def("rope", &k::rope, "x"_a, "offset"_a, "freqs"_a, nb::kw_only(), "dims"_a, "traditional"_a, "scale"_a,
        "stream"_a = nb::none(), "mx.fast.rope with freqs for x (B, H, L, D), offset one integer or one per row.");
  m.def(
      "fused_products",
      [](const k::mx::array& x, const std::vector<k::mx::array>& weights, int group_size, int bits, bool gated,
         const std::vector<int>& heads, const std::optional<k::mx::array>& offset,
         const std::optional<k::mx::array>& freqs,
         int rope_dims, bool traditional, float rope_scale, bool int8_activations, k::mx::StreamOrDevice s) {
        return k::fused_products(x, weights, group_size, bits, gated, heads, offset, freqs,
                                 k::RopeSettings{rope_dims, traditional, rope_scale}, int8_activations, s);
      },
      "x"_a, "weights"_a, nb::kw_only(), "group_size"_a = 0, "bits"_a = 0, "gated"_a = false,
      "heads"_a = std::vector<int>{}, "offset"_a = nb::none(), "freqs"_a = nb::none(), "rope_dims"_a = 0,
      "traditional"_a = false, "rope_scale"_a = 1.0f, "int8_activations"_a = false, "stream"_a = nb::none(),
      "[x @ w.T for each weight] in one call (weights, or (w, scales, biases) triples when bits is 4 or 8); "
      "gated: silu(x @ gate.T) * (x @ up.T); heads: outputs (B, heads, 1, D) for x (B, 1, k), the first two "
      "rotated by RoPE (rope_dims, traditional, rope_scale, freqs periods) at positions offset when rope_dims > 0; "
      "int8_activations: as quantized_matvec's.");
  m.def("logsumexp", &k::logsumexp, "x"_a, nb::kw_only(), "stream"_a = nb::none(),
        "mx.logsumexp(x, axis=-1, keepdims=True) in one pass per row.");
  m.def("silu_mul", &k::silu_mul, "gate"_a, "up"_a, nb::kw_only(), "stream"_a = nb::none(),
        "silu(gate) * up in float32.");
  m.def("soft_cap", &k::soft_cap, "x"_a, nb::kw_only(), "cap"_a, "stream"_a = nb::none(),
        "cap * tanh(x / cap) in float32.");
  m.def("delta_rule_chunked", &k::delta_rule_chunked, "queries"_a, "keys"_a, "values"_a, "g"_a, "beta"_a, "state"_a,
        nb::kw_only(), "chunk_size"_a, "stream"_a = nb::none(),
        "The gated delta rule over queries, keys (B, H, L, Dk), values (B, H, L, Dv), g, beta (B, H, L) from state "
        "(B, H, Dk, Dv), chunk_size positions at a time: [out (B, H, L, Dv), the final state]. No gradient of its "
        "own (mlx_tfm.cpu.deltanet gives it the plain route's).");
  m.def("isa", [] { return std::string(k::best_kernels().name); },
        "The instruction set in use (ValueError when MLX_TFM_KERNELS_ISA cannot be honoured).");
  m.def("isa_request_error", &k::isa_request_error,
        "Why MLX_TFM_KERNELS_ISA cannot be honoured (a set unknown, or one this CPU lacks), or ''.");
  m.def("int8_isa", [] { return std::string(k::best_int8_kernels().name); },
        "The instruction set of the int8-activation products (avx512vnni, avx2 or generic).");
  m.def("outputs_poisoned", &k::outputs_poisoned,
        "Whether every output a kernel allocates starts as NaN (MLX_TFM_KERNELS_POISON=1, for tests).");
  m.def("runnable_isas", &k::runnable_isas, "The instruction sets of this build this CPU runs, best first.");
  m.def("threads", &k::pool_threads, "Threads a product runs on (the caller included).");
  // What mlx_tfm/cpu/kernels/__init__.py may call (its INTERFACE): bump both with every change of it,
  // so a library built from older sources is not used until it is rebuilt.
  m.attr("interface") = 6;
  m.attr("built_with_mlx") = STRINGIFY(MLX_VERSION_MAJOR) "." STRINGIFY(MLX_VERSION_MINOR) "." STRINGIFY(MLX_VERSION_PATCH);
}
