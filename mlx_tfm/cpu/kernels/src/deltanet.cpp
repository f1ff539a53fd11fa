#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"

#include "deltanet.h"
#include "deltanet_op.h"
#include "kernels.h"
#include "pool.h"
#include "primitives.h"

namespace mlx_tfm_kernels {

const DeltaKernels& best_delta_kernels() {
  const std::string name = best_kernels().name;
#if defined(__x86_64__)
  if (name == "avx512") return avx512::delta_kernels();
  if (name == "avx2") return avx2::delta_kernels();
#endif
  return generic::delta_kernels();
}

namespace {

// An input of any layout and float dtype, read a row of floats at a time.
struct Strided {
  const uint8_t* base;
  mx::Dtype dtype;
  std::vector<int64_t> strides;  // in elements

  explicit Strided(const mx::array& a)
      : base(static_cast<const uint8_t*>(a.data<void>())), dtype(a.dtype()), strides(a.strides().begin(), a.strides().end()) {}

  int64_t at(int64_t i0, int64_t i1, int64_t i2 = 0, int64_t i3 = 0) const {
    return i0 * strides[0] + i1 * strides[1] + (strides.size() > 2 ? i2 * strides[2] : 0) +
           (strides.size() > 3 ? i3 * strides[3] : 0);
  }

  float value(int64_t offset) const {
    if (dtype == mx::float32) return reinterpret_cast<const float*>(base)[offset];
    if (dtype == mx::float16) return static_cast<float>(reinterpret_cast<const mx::float16_t*>(base)[offset]);
    return static_cast<float>(reinterpret_cast<const mx::bfloat16_t*>(base)[offset]);
  }

  // n values from `offset`, `step` elements apart (the last axis' stride), as float32 into `to`.
  void row(int64_t offset, int64_t n, float* to) const {
    const int64_t step = strides.back();
    if (dtype == mx::float32 && step == 1) {
      std::memcpy(to, reinterpret_cast<const float*>(base) + offset, n * sizeof(float));
      return;
    }
    for (int64_t i = 0; i < n; ++i) to[i] = value(offset + i * step);
  }
};

// n float32 values into `out`'s memory from element `offset`, in out's dtype.
void write_row(const float* from, mx::array& out, int64_t offset, int64_t n) {
  if (out.dtype() == mx::float32) {
    std::memcpy(out.data<float>() + offset, from, n * sizeof(float));
  } else if (out.dtype() == mx::float16) {
    for (int64_t i = 0; i < n; ++i) out.data<mx::float16_t>()[offset + i] = static_cast<mx::float16_t>(from[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) out.data<mx::bfloat16_t>()[offset + i] = static_cast<mx::bfloat16_t>(from[i]);
  }
}

float* on_cache_line(std::vector<float>& buffer, size_t count) {
  buffer.assign(count + 16, 0.0f);
  const uintptr_t start = reinterpret_cast<uintptr_t>(buffer.data());
  return reinterpret_cast<float*>((start + 63) & ~uintptr_t{63});
}

// What every head reads: in = {queries, keys, values, g, beta, state}, out = {out, state}.
struct Problem {
  Strided queries, keys, values, g, beta, state;
  int64_t length, dk, dv, dv_padded, chunk;
  int64_t heads;
};

// One head (b, h): its state, then its chunks in order, each gathered as float32 rows.
void one_head(const Problem& p, int64_t b, int64_t h, std::vector<mx::array>& outs) {
  const int64_t C = p.chunk, dk = p.dk, dv = p.dv, dvp = p.dv_padded;
  std::vector<float> state_buffer, rows_buffer, values_buffer, out_buffer, scratch_buffer, beta(C);
  std::vector<double> gamma(C);
  float* state = on_cache_line(state_buffer, dk * dvp);
  float* rows = on_cache_line(rows_buffer, 2 * C * dk);
  float* values = on_cache_line(values_buffer, C * dvp);  // columns past dv stay zero
  float* out = on_cache_line(out_buffer, C * dvp);
  float* scratch = on_cache_line(scratch_buffer, delta_chunk_scratch(C, dk, dvp));
  for (int64_t d = 0; d < dk; ++d) p.state.row(p.state.at(b, h, d, 0), dv, state + d * dvp);
  const DeltaKernels& kernels = best_delta_kernels();
  for (int64_t l0 = 0; l0 < p.length; l0 += C) {
    const int64_t c = std::min(C, p.length - l0);
    double sum = 0.0;
    for (int64_t i = 0; i < c; ++i) {
      const int64_t l = l0 + i;
      p.queries.row(p.queries.at(b, h, l, 0), dk, rows + i * dk);
      p.keys.row(p.keys.at(b, h, l, 0), dk, rows + (c + i) * dk);
      p.values.row(p.values.at(b, h, l, 0), dv, values + i * dvp);
      gamma[i] = sum += p.g.value(p.g.at(b, h, l));
      beta[i] = p.beta.value(p.beta.at(b, h, l));
    }
    kernels.chunk({c, dk, dvp, rows, values, gamma.data(), beta.data(), state, out, scratch});
    for (int64_t i = 0; i < c; ++i) write_row(out + i * dvp, outs[0], ((b * p.heads + h) * p.length + l0 + i) * dv, dv);
  }
  for (int64_t d = 0; d < dk; ++d) write_row(state + d * dvp, outs[1], ((b * p.heads + h) * dk + d) * dv, dv);
}

void delta_rule(const std::vector<mx::array>& in, std::vector<mx::array>& outs, int chunk_size) {
  const int64_t batch = in[0].shape(0), heads = in[0].shape(1), length = in[0].shape(2);
  const int64_t dk = in[0].shape(3), dv = in[2].shape(3);
  const Problem p{Strided(in[0]), Strided(in[1]), Strided(in[2]), Strided(in[3]), Strided(in[4]), Strided(in[5]),
                  length, dk, dv, padded_to(dv, DELTA_PAD), std::max<int64_t>(1, std::min<int64_t>(chunk_size, length)),
                  heads};
  parallel_for(batch * heads, [&](int64_t item) { one_head(p, item / heads, item % heads, outs); });
}

void check_float(const mx::array& a) {
  if (a.dtype() != mx::float32 && a.dtype() != mx::float16 && a.dtype() != mx::bfloat16)
    throw std::invalid_argument("mlx_tfm kernels: delta_rule_chunked takes float32, float16 or bfloat16 arrays");
}

}  // namespace

std::vector<mx::array> delta_rule_chunked(const mx::array& queries, const mx::array& keys, const mx::array& values,
                                          const mx::array& g, const mx::array& beta, const mx::array& state,
                                          int chunk_size, mx::StreamOrDevice s) {
  for (const auto* a : {&queries, &keys, &values, &g, &beta, &state}) check_float(*a);
  const bool shaped = queries.ndim() == 4 && keys.shape() == queries.shape() && values.ndim() == 4 &&
                      values.shape(0) == queries.shape(0) && values.shape(1) == queries.shape(1) &&
                      values.shape(2) == queries.shape(2) && g.shape() == mx::Shape(queries.shape().begin(), queries.shape().end() - 1) &&
                      beta.shape() == g.shape() &&
                      state.shape() == mx::Shape{queries.shape(0), queries.shape(1), queries.shape(3), values.shape(3)};
  if (!shaped)
    throw std::invalid_argument(
        "mlx_tfm kernels: delta_rule_chunked needs queries, keys (B, H, L, Dk), values (B, H, L, Dv), g and beta "
        "(B, H, L), state (B, H, Dk, Dv)");
  if (chunk_size < 1) throw std::invalid_argument("mlx_tfm kernels: delta_rule_chunked needs chunk_size >= 1");
  const mx::Stream stream = mx::to_stream(s);
  if (stream.device != mx::Device::cpu) throw std::invalid_argument("mlx_tfm kernels run on the CPU only");
  best_kernels();  // a bad MLX_TFM_KERNELS_ISA throws here, as the op is made, not when it runs
  mx::Dtype dtype = queries.dtype();
  for (const auto* a : {&keys, &values, &g, &beta, &state}) dtype = mx::promote_types(dtype, a->dtype());
  return mx::array::make_arrays({values.shape(), state.shape()}, {dtype, dtype},
                                std::make_shared<DeltaRuleChunked>(stream, chunk_size),
                                {queries, keys, values, g, beta, state});
}

void DeltaRuleChunked::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const int chunk_size = chunk_size_;
  dispatch_outputs(stream(), inputs, outputs,
                   [chunk_size](const std::vector<mx::array>& held, std::vector<mx::array>& outs) {
                     delta_rule(held, outs, chunk_size);
                   });
}

void DeltaRuleChunked::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("mlx_tfm kernels run on the CPU only");
}

std::vector<mx::array> DeltaRuleChunked::vjp(const std::vector<mx::array>&, const std::vector<mx::array>&,
                                             const std::vector<int>&, const std::vector<mx::array>&) {
  throw std::invalid_argument(
      "mlx_tfm kernels: delta_rule_chunked has no gradient of its own: call it through mlx_tfm.cpu.deltanet, "
      "which differentiates the plain MLX route");
}

}  // namespace mlx_tfm_kernels
