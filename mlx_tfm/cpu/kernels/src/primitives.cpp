#include "primitives.h"

#include <dlfcn.h>

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/fast.h"
#include "mlx/transforms.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/utils.h"

#include "int8dot.h"
#include "kernels.h"
#include "pool.h"
#include "convert.h"

namespace mlx_tfm_kernels {

namespace {

// -- reading arrays of any layout --------------------------------------------------------

// The elements of `a` in row-major order as contiguous bytes: the array's own memory when
// it is row-contiguous, else a copy made in `scratch`.
const uint8_t* contiguous_bytes(const mx::array& a, std::vector<uint8_t>& scratch) {
  const uint8_t* base = static_cast<const uint8_t*>(a.data<void>());
  if (a.flags().row_contiguous) return base;
  const size_t item = a.itemsize();
  scratch.resize(a.size() * item);
  const int nd = a.ndim();
  std::vector<int64_t> index(nd, 0);
  int64_t offset = 0;  // in elements, from `base`
  for (size_t e = 0; e < a.size(); ++e) {
    std::memcpy(scratch.data() + e * item, base + offset * item, item);
    for (int d = nd - 1; d >= 0; --d) {  // the next index, like an odometer
      offset += a.strides()[d];
      if (++index[d] < a.shape(d)) break;
      offset -= a.strides()[d] * a.shape(d);
      index[d] = 0;
    }
  }
  return scratch.data();
}

Real real_of(mx::Dtype dtype) {
  if (dtype == mx::float32) return Real::F32;
  if (dtype == mx::float16) return Real::F16;
  if (dtype == mx::bfloat16) return Real::BF16;
  throw std::invalid_argument("mlx_tfm kernels: float32, float16 or bfloat16 expected");
}

float real_at(const uint8_t* bytes, Real type, size_t i) {
  switch (type) {
    case Real::F32: { float v; std::memcpy(&v, bytes + 4 * i, 4); return v; }
    case Real::F16: { uint16_t v; std::memcpy(&v, bytes + 2 * i, 2); return half_to_float(v); }
    default: { uint16_t v; std::memcpy(&v, bytes + 2 * i, 2); return bf16_to_float(v); }
  }
}

// Buffers a computation reuses from call to call on its thread (an MLX stream's): decoding
// makes hundreds of calls a step, and fresh allocations of these sizes cost more than
// the small products themselves.
enum Scratch { X32, X_ARRANGED, X_SUMS, RESULT, SECOND, WEIGHT, X_INT8, X_BLOCK_SCALES, X_INT8_SUMS, SCRATCH_COUNT };

// Scratch starts on a cache line: a vector load from memory that does not (MLX's CPU
// allocator hands out memory 8 bytes past malloc's) touches two lines, and the products
// load their input once per multiply-add (docs/cpu-kernels.md, for what it saves).
template <class T>
T* on_cache_line(std::vector<T>& buffer, size_t count) {
  const size_t slack = CACHE_LINE_BYTES / sizeof(T);
  if (buffer.size() < count + slack) buffer.resize(count + slack);
  const uintptr_t start = reinterpret_cast<uintptr_t>(buffer.data());
  constexpr uintptr_t line = CACHE_LINE_BYTES;
  return reinterpret_cast<T*>((start + line - 1) & ~(line - 1));
}

float* scratch(Scratch which, size_t count) {
  thread_local std::vector<float> buffers[SCRATCH_COUNT];
  return on_cache_line(buffers[which], count);
}

bool starts_on_cache_line(const void* data) { return reinterpret_cast<uintptr_t>(data) % CACHE_LINE_BYTES == 0; }

// compute(i0, i1) over n elementwise values in pieces of at least 16K values on the pool (a
// decoding step's few thousand stay on this thread), each piece a whole number of 64.
template <class Compute>
void in_value_pieces(int64_t n, Compute compute) {
  const int64_t tasks = std::max<int64_t>(1, std::min<int64_t>(n / (16 << 10), 4 * pool_threads()));
  const int64_t step = ((n + tasks - 1) / tasks + 63) / 64 * 64;
  parallel_for(tasks, [&](int64_t t) {
    const int64_t i0 = t * step, i1 = std::min(n, i0 + step);
    if (i0 < i1) compute(i0, i1);
  });
}


// x (any layout, float32 / float16 / bfloat16) as float32, row-major: its own memory when
// it is that already (and on a cache line, when `aligned`: for inputs a kernel reads
// again and again), else a copy in scratch `which`.
const float* as_float32(const mx::array& x, Scratch which = X32, bool aligned = false) {
  if (x.dtype() == mx::float32 && x.flags().row_contiguous && (!aligned || starts_on_cache_line(x.data<void>())))
    return x.data<float>();
  float* out = scratch(which, x.size());
  std::vector<uint8_t> bytes_scratch;
  const uint8_t* bytes = contiguous_bytes(x, bytes_scratch);
  const Real type = real_of(x.dtype());
  // On every core, with the instruction set's conversions: element by element, a prompt's
  // (512, 2048) float16 activations took longer to read than the RMSNorm that reads them.
  const int64_t size = static_cast<int64_t>(x.itemsize());
  const Kernels& kernels = best_kernels();
  in_value_pieces(static_cast<int64_t>(x.size()), [&](int64_t i0, int64_t i1) {
    kernels.to_float32_rows(bytes + i0 * size, type, i1 - i0, out + i0, 0, 1);
  });
  return out;
}

// Where a kernel writes its float32 results: `out` itself when it is float32.
float* result_buffer(mx::array& out) {
  return out.dtype() == mx::float32 ? out.data<float>() : scratch(RESULT, out.size());
}

// The float32 results written into `out` in its dtype (nothing to do for float32).
void store(const float* y, mx::array& out) {
  if (out.dtype() == mx::float32) return;
  // On every core, vectorised (F16C, or bfloat16's rounding shift), as MLX's astype rounds.
  const Real type = real_of(out.dtype());
  uint8_t* dst = out.data<uint8_t>();
  const Kernels& kernels = best_kernels();
  in_value_pieces(static_cast<int64_t>(out.size()), [&](int64_t i0, int64_t i1) {
    kernels.from_float32(y + i0, type, dst + i0 * 2, i1 - i0);  // 16-bit outputs
  });
}

// -- splitting the rows of a product over the pool -------------------------------------

// Rows [0, n) in pieces of about `TASK_BYTES` of weights, at most a few per thread (taken
// dynamically: a core busy with other work takes fewer); small products stay on one thread.
constexpr int64_t TASK_BYTES = 64 << 10;

template <class Rows>
void over_rows(int64_t n, int64_t row_bytes, Rows rows) {
  const int64_t by_size = (n * row_bytes) / TASK_BYTES;
  const int64_t tasks = std::max<int64_t>(1, std::min<int64_t>({by_size, 4 * pool_threads(), n}));
  const int64_t step = (n + tasks - 1) / tasks;
  parallel_for(tasks, [&](int64_t t) {
    const int64_t n0 = t * step, n1 = std::min(n, n0 + step);
    if (n0 < n1) rows(n0, n1);
  });
}

// -- the computations ------------------------------------------------------------------

// x rounded to int8 blocks for the int8 products (int8dot.h), in this thread's scratch.
struct Int8Activations {
  const int8_t* x_int8;
  const float* lane_scales;
  const float* int8_group_sums;
};

Int8Activations int8_activations_of(const float* x32, int64_t m, int64_t k, int group_size, int bits) {
  // int8 values in a float buffer: a quarter of the floats, on a cache line like the rest
  int8_t* x_int8 = reinterpret_cast<int8_t*>(scratch(X_INT8, (m * k + 3) / 4));
  float* lane_scales = scratch(X_BLOCK_SCALES, 4 * m * k / ACT_BLOCK);
  float* int8_sums = scratch(X_INT8_SUMS, m * k / group_size);
  quantize_activations(x32, m, k, group_size, bits, x_int8, lane_scales, int8_sums);
  return {x_int8, lane_scales, int8_sums};
}

// The products x @ w_i.T of in = {x, then each w (float) or each w, scales, biases (bits 4
// or 8)}: count of them, float32 results into ys[i], all their rows in one pass of the pool.
// int8_activations (quantized only): x rounded to int8 blocks and integer dot products.
void products_of_one_input(const std::vector<mx::array>& in, size_t count, int group_size, int bits,
                           float* const* ys, bool int8_activations = false) {
  const mx::array& x = in[0];
  const bool quantized = bits != 0;
  const bool int8 = quantized && int8_activations;
  const int per_weight = quantized ? 3 : 1;
  const int64_t k = x.shape(-1), m = static_cast<int64_t>(x.size()) / k;
  const Kernels& kernels = best_kernels();
  const Int8Kernels& int8_kernels = best_int8_kernels();
  const float* x32 = as_float32(x, X32, bits != 4);  // 4 bits read a permuted copy
  const float* x_read = x32;
  float* sums = nullptr;
  Int8Activations rounded{};
  if (quantized) {
    const int64_t groups = k / group_size;
    sums = scratch(X_SUMS, m * groups);
    for (int64_t i = 0; i < m * groups && !int8; ++i) {  // int8 products keep sums of their own
      float total = 0.0f;
      for (int j = 0; j < group_size; ++j) total += x32[i * group_size + j];
      sums[i] = total;
    }
    if (int8) {
      rounded = int8_activations_of(x32, m, k, group_size, bits);
    } else if (bits == 4) {
      float* arranged = scratch(X_ARRANGED, m * k);
      arrange_for_nibbles(x32, arranged, m, k, kernels.lanes);
      x_read = arranged;
    }
  }
  std::vector<std::vector<uint8_t>> copies(count * per_weight);
  std::vector<FloatProduct> floats;
  std::vector<QuantizedProduct> quants;
  std::vector<Int8Product> int8s;
  std::vector<int64_t> first_row{0};  // where each weight's rows start among all of them
  for (size_t i = 0; i < count; ++i) {
    const mx::array& w = in[1 + per_weight * i];
    const int64_t n = w.shape(0);
    if (quantized) {
      const mx::array &scales = in[2 + 3 * i], &biases = in[3 + 3 * i];
      quants.push_back({contiguous_bytes(w, copies[3 * i]), bits, group_size, n, k,
                        contiguous_bytes(scales, copies[3 * i + 1]), contiguous_bytes(biases, copies[3 * i + 2]),
                        real_of(scales.dtype()), x_read, sums, m, ys[i]});
      const QuantizedProduct& q = quants.back();
      if (int8)
        int8s.push_back({q.w, bits, group_size, n, k, q.scales, q.biases, q.scale_type, rounded.x_int8,
                         rounded.lane_scales, rounded.int8_group_sums, m, ys[i]});
    } else {
      floats.push_back({contiguous_bytes(w, copies[i]), real_of(w.dtype()), n, k, x32, m, ys[i]});
    }
    first_row.push_back(first_row.back() + n);
  }
  const int64_t row_bytes = quantized ? k * bits / 8 : k * in[1].itemsize();
  over_rows(first_row.back(), row_bytes, [&](int64_t g0, int64_t g1) {
    for (size_t i = 0; i < count; ++i) {
      const int64_t lo = std::max(g0, first_row[i]) - first_row[i], hi = std::min(g1, first_row[i + 1]) - first_row[i];
      if (lo >= hi) continue;
      if (int8) int8_kernels.rows(int8s[i], lo, hi);
      else if (quantized) kernels.quantized_rows(quants[i], lo, hi);
      else kernels.float_rows(floats[i], lo, hi);
    }
  });
}

// x @ w.T into out, in out's dtype: in = {x, w} or {x, w, scales, biases}.
void product(const std::vector<mx::array>& in, int group_size, int bits, mx::array& out,
             bool int8_activations = false) {
  float* y = result_buffer(out);
  products_of_one_input(in, 1, group_size, bits, &y, int8_activations);
  store(y, out);
}

// cblas_sgemm as MLX calls it: the optimized BLAS mlx_tfm loaded globally (blas.py), else
// (macOS: Accelerate, or MLX's bundled BLAS) the one libmlx itself was linked with.
using Sgemm = void (*)(int order, int trans_a, int trans_b, int m, int n, int k, float alpha, const float* a, int lda,
                       const float* b, int ldb, float beta, float* c, int ldc);
constexpr int CBLAS_ROW_MAJOR = 101, CBLAS_NO_TRANS = 111, CBLAS_TRANS = 112;

Sgemm find_sgemm() {
  if (void* global = dlsym(RTLD_DEFAULT, "cblas_sgemm")) return reinterpret_cast<Sgemm>(global);
  Dl_info info;
  void (*in_libmlx)(std::vector<mx::array>) = &mx::eval;
  if (!dladdr(reinterpret_cast<void*>(in_libmlx), &info) || !info.dli_fname) return nullptr;
  void* libmlx = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
  return libmlx ? reinterpret_cast<Sgemm>(dlsym(libmlx, "cblas_sgemm")) : nullptr;
}

Sgemm sgemm() {
  static const Sgemm found = find_sgemm();
  return found;
}

// Rows of w dequantized per BLAS call: ~4 MiB of float32 (a whole layer of a small model),
// in cache between the dequantization and the product; fewer and larger BLAS calls.
constexpr int64_t DENSE_BLOCK_BYTES = 1 << 22;

// x @ dequantize(w).T into out through float32 BLAS, a block of w's rows at a time in one
// reused buffer: in = {x, w, scales, biases}.
void dense_product(const std::vector<mx::array>& in, int group_size, int bits, mx::array& out) {
  const mx::array& w = in[1];
  const int64_t n = w.shape(0), k = w.shape(1) * 32 / bits, m = in[0].size() / k;
  const int64_t groups = k / group_size, row_bytes = k * bits / 8, scale_bytes = groups * in[2].itemsize();
  const float* x = as_float32(in[0]);  // BLAS packs x itself: no copy onto a cache line
  std::vector<uint8_t> w_scratch, s_scratch, b_scratch;
  const uint8_t* wb = contiguous_bytes(w, w_scratch);
  const uint8_t* sb = contiguous_bytes(in[2], s_scratch);
  const uint8_t* bb = contiguous_bytes(in[3], b_scratch);
  const int64_t block_rows = std::max<int64_t>(1, std::min<int64_t>(n, DENSE_BLOCK_BYTES / (4 * k)));
  float* block = scratch(WEIGHT, block_rows * k);
  float* y = result_buffer(out);
  const Kernels& kernels = best_kernels();
  for (int64_t n0 = 0; n0 < n; n0 += block_rows) {
    const int64_t rows = std::min(block_rows, n - n0);
    const QuantizedProduct p{wb + n0 * row_bytes, bits, group_size, rows, k, sb + n0 * scale_bytes,
                             bb + n0 * scale_bytes, real_of(in[2].dtype()), nullptr, nullptr, 0, nullptr};
    over_rows(rows, row_bytes, [&](int64_t r0, int64_t r1) { kernels.dequantize_rows(p, block, r0, r1); });
    sgemm()(CBLAS_ROW_MAJOR, CBLAS_NO_TRANS, CBLAS_TRANS, m, rows, k, 1.0f, x, k, block, k, 0.0f, y + n0, n);
  }
  store(y, out);
}

// x (m, k) as float32 rows: x's own memory when it is float32 and row-contiguous, else
// converted (a vector at a time, on every core) into `copy`, which lives only as long as
// the caller's product (a prompt's activations are large; no scratch keeps them).
const float* float32_matrix(const mx::array& x, int64_t m, int64_t k, std::unique_ptr<float[]>& copy) {
  if (x.dtype() == mx::float32 && x.flags().row_contiguous) return x.data<float>();
  std::vector<uint8_t> bytes_scratch;
  const uint8_t* bytes = contiguous_bytes(x, bytes_scratch);
  copy.reset(new float[m * k]);
  const Kernels& kernels = best_kernels();
  const Real type = real_of(x.dtype());
  over_rows(m, k * x.itemsize(), [&](int64_t r0, int64_t r1) { kernels.to_float32_rows(bytes, type, k, copy.get(), r0, r1); });
  return copy.get();
}

// A tile (m, columns) of float32 results written into columns [n0, n0 + columns) of out
// (m, n), rounded to out's dtype, the rows split over the pool.
void store_columns(const float* tile, int64_t m, int64_t columns, mx::array& out, int64_t n0) {
  const int64_t n = out.shape(-1), item = out.itemsize();
  const Real type = real_of(out.dtype());
  uint8_t* base = static_cast<uint8_t*>(out.data<void>());
  const Kernels& kernels = best_kernels();
  over_rows(m, columns * 4, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      kernels.from_float32(tile + r * columns, type, base + (r * n + n0) * item, columns);
  });
}

// Rows of a 16-bit w made float32 per BLAS call (~4 MiB, as for quantized layers): fewer,
// larger calls amortize BLAS's packing of x, while the block stays in cache between its
// conversion and its product.
constexpr int64_t FLOAT_BLOCK_BYTES = 1 << 22;

// x @ w.T into out through float32 BLAS for a float16 / bfloat16 (or float32) w: x made
// float32 once, w a block of rows at a time into one reused float32 buffer (no float32
// copy of the whole w ever exists), each block's product rounded into its columns of out.
void dense_float_product(const std::vector<mx::array>& in, mx::array& out) {
  const mx::array &x = in[0], &w = in[1];
  const int64_t n = w.shape(0), k = w.shape(1), m = x.size() / k, row_bytes = k * w.itemsize();
  std::unique_ptr<float[]> x_copy;
  const float* x32 = float32_matrix(x, m, k, x_copy);
  std::vector<uint8_t> w_scratch;
  const uint8_t* wb = contiguous_bytes(w, w_scratch);
  const Real w_type = real_of(w.dtype());
  const int64_t block_rows = std::max<int64_t>(1, std::min<int64_t>(n, FLOAT_BLOCK_BYTES / (4 * k)));
  float* block = scratch(WEIGHT, block_rows * k);
  const bool direct = out.dtype() == mx::float32;  // BLAS writes into out itself
  float* tile = direct ? nullptr : scratch(RESULT, m * block_rows);
  const Kernels& kernels = best_kernels();
  for (int64_t n0 = 0; n0 < n; n0 += block_rows) {
    const int64_t rows = std::min(block_rows, n - n0);
    const uint8_t* from = wb + n0 * row_bytes;
    over_rows(rows, row_bytes, [&](int64_t r0, int64_t r1) { kernels.to_float32_rows(from, w_type, k, block, r0, r1); });
    float* y = direct ? out.data<float>() + n0 : tile;
    sgemm()(CBLAS_ROW_MAJOR, CBLAS_NO_TRANS, CBLAS_TRANS, m, rows, k, 1.0f, x32, k, block, k, 0.0f, y, direct ? n : rows);
    if (!direct) store_columns(tile, m, rows, out, n0);
  }
}

int64_t id_at(const uint8_t* bytes, mx::Dtype dtype, size_t i) {
  switch (dtype) {
    case mx::uint32: { uint32_t v; std::memcpy(&v, bytes + 4 * i, 4); return v; }
    case mx::int32: { int32_t v; std::memcpy(&v, bytes + 4 * i, 4); return v; }
    case mx::int64: { int64_t v; std::memcpy(&v, bytes + 8 * i, 8); return v; }
    case mx::uint64: { uint64_t v; std::memcpy(&v, bytes + 8 * i, 8); return static_cast<int64_t>(v); }
    default: throw std::invalid_argument("mlx_tfm kernels: integer ids expected");
  }
}

void dequantized_rows(const mx::array& ids, const mx::array& w, const mx::array& scales,
                      const mx::array& biases, int group_size, int bits, mx::array& out) {
  const int64_t n = w.shape(0), k = w.shape(1) * 32 / bits, groups = k / group_size;
  std::vector<uint8_t> i_scratch, w_scratch, s_scratch, b_scratch;
  const uint8_t* id_bytes = contiguous_bytes(ids, i_scratch);
  const uint8_t* wb = contiguous_bytes(w, w_scratch);
  const uint8_t* sb = contiguous_bytes(scales, s_scratch);
  const uint8_t* bb = contiguous_bytes(biases, b_scratch);
  const Real type = real_of(scales.dtype());
  const unsigned mask = (1u << bits) - 1;
  float* y = result_buffer(out);
  for (size_t r = 0; r < ids.size(); ++r) {
    int64_t id = id_at(id_bytes, ids.dtype(), r);
    id = id < 0 ? id + n : id;  // as MLX's indexing: negative ids count from the end
    if (id < 0 || id >= n) {  // no exception on the stream's thread: a row of zeros
      std::fill(y + r * k, y + (r + 1) * k, 0.0f);
      continue;
    }
    const uint8_t* row = wb + id * (k * bits / 8);
    for (int64_t g = 0; g < groups; ++g) {
      const float s = real_at(sb, type, id * groups + g), b = real_at(bb, type, id * groups + g);
      for (int j = 0; j < group_size; ++j) {
        const int64_t c = g * group_size + j, bit = c * bits;
        const unsigned q = (row[bit / 8] >> (bit % 8)) & mask;
        y[r * k + c] = s * static_cast<float>(q) + b;
      }
    }
  }
  store(y, out);
}

void attention(const mx::array& queries, const mx::array& keys, const mx::array& values, float scale, bool causal,
               const mx::array* mask, mx::array& out) {
  const int64_t batch = queries.shape(0), heads = queries.shape(1), length = queries.shape(2);
  const int64_t head_dim = queries.shape(3), kv_heads = keys.shape(1), positions = keys.shape(2);
  const float* q = as_float32(queries, X32, true);
  // Each position's values must be contiguous; a cache's keys and values are, whatever
  // their other strides (a slice of a larger buffer).
  std::vector<uint8_t> k_scratch, v_scratch;
  auto rows_of = [](const mx::array& a, std::vector<uint8_t>& bytes, int64_t* strides) -> const void* {
    if (a.strides()[3] == 1) {
      for (int d = 0; d < 3; ++d) strides[d] = a.strides()[d];
      return a.data<void>();
    }
    const void* copy = contiguous_bytes(a, bytes);
    strides[2] = a.shape(3), strides[1] = strides[2] * a.shape(2), strides[0] = strides[1] * a.shape(1);
    return copy;
  };
  AttentionProblem p{q, nullptr, nullptr, real_of(keys.dtype()), batch, heads, kv_heads, length, positions, head_dim,
                     {}, {}, scale, result_buffer(out)};
  p.keys = rows_of(keys, k_scratch, p.key_strides);
  p.values = rows_of(values, v_scratch, p.value_strides);
  std::vector<uint8_t> m_scratch;
  if (mask) {  // (B or 1, 1, 1, S) booleans, one byte each
    p.mask = contiguous_bytes(*mask, m_scratch);
    p.mask_row_stride = mask->shape(0) == 1 ? 0 : positions;
  }
  p.causal = causal;
  // About 64 query vectors per work item (a block of positions times the group's heads):
  // enough to share each transposed tile of keys, few enough to split a prompt over the cores.
  const int64_t group = heads / kv_heads;
  p.block_queries = std::min<int64_t>(length, std::max<int64_t>(1, 64 / group));
  const Kernels& kernels = best_kernels();
  const int64_t items = attention_items(p);
  const bool worth_threads = batch * heads * length * positions * head_dim >= (64 << 10);
  parallel_for(worth_threads ? items : 1, [&](int64_t t) {
    std::vector<float> buffer;
    float* scratch = on_cache_line(buffer, attention_scratch(p));
    if (worth_threads) kernels.attention(p, t, t + 1, scratch);
    else kernels.attention(p, 0, items, scratch);
  });
  store(p.out, out);
}

// Rounds v to T's precision and back (what an MLX op with a T output keeps).
template <class T>
float rounded(float v) {
  return static_cast<float>(static_cast<T>(v));
}

void rms_normalized(const mx::array& x, const mx::array& weight, float eps, mx::array& out) {
  const int64_t d = x.shape(-1), rows = static_cast<int64_t>(x.size()) / d;
  const float* x32 = as_float32(x);
  const float* w32 = as_float32(weight, WEIGHT);
  const Kernels& kernels = best_kernels();
  if (out.dtype() == mx::float32) {
    kernels.rms_norm_rows(x32, w32, eps, d, out.data<float>(), 0, rows);
    return;
  }
  // Half precision: MLX rounds the normalized values to the output's type, then multiplies
  // by the weight in that type (a product of two 16-bit values is exact in float32, so one
  // rounding of it is MLX's). Rows on every core, each row's roundings vectorised.
  float* normalized = scratch(RESULT, x.size());
  const Real type = real_of(out.dtype());
  uint8_t* dst = out.data<uint8_t>();
  over_rows(rows, d * 4, [&](int64_t r0, int64_t r1) {
    kernels.rms_norm_rows(x32, nullptr, eps, d, normalized, r0, r1);
    float* v = normalized + r0 * d;
    uint8_t* o = dst + r0 * d * 2;  // 16-bit outputs
    const int64_t n = (r1 - r0) * d;
    kernels.from_float32(v, type, o, n);  // normalized, rounded to the output's type
    kernels.to_float32_rows(o, type, n, v, 0, 1);
    for (int64_t r = 0; r < r1 - r0; ++r)
      for (int64_t j = 0; j < d; ++j) v[r * d + j] *= w32[j];
    kernels.from_float32(v, type, o, n);
  });
}

// RoPE's angles at one position: cos and sin of position * scale / period_i, i < dims / 2.
struct Angles {
  std::vector<float> cosines, sines;

  Angles(int64_t half) : cosines(half), sines(half) {}

  void at(int64_t position, float scale, const float* periods) {
    const float scaled = scale * static_cast<float>(position);
    for (size_t i = 0; i < cosines.size(); ++i) {
      const float theta = scaled * (1.0f / periods[i]);
      cosines[i] = std::cos(theta);
      sines[i] = std::sin(theta);
    }
  }

  // Rotates the first dims values of one head's row in place (pairs (2i, 2i + 1) when
  // traditional, else (i, i + dims / 2)).
  void rotate(float* row, bool traditional) const {
    const int64_t half = cosines.size();
    for (int64_t i = 0; i < half; ++i) {
      const int64_t a = traditional ? 2 * i : i, c = traditional ? 2 * i + 1 : i + half;
      const float first = row[a], second = row[c];
      row[a] = first * cosines[i] - second * sines[i];
      row[c] = first * sines[i] + second * cosines[i];
    }
  }
};

int64_t offset_of_row(const uint8_t* offsets, const mx::array& offset, int64_t b) {
  return id_at(offsets, offset.dtype(), offset.size() == 1 ? 0 : b);
}

void rotated(const mx::array& x, const mx::array& offset, const mx::array& freqs, int dims, bool traditional,
             float scale, mx::array& out) {
  const int64_t batch = x.shape(0), heads = x.shape(1), length = x.shape(2), d = x.shape(3);
  std::vector<uint8_t> o_scratch, f_scratch;
  const uint8_t* offsets = contiguous_bytes(offset, o_scratch);
  const float* periods = reinterpret_cast<const float*>(contiguous_bytes(freqs, f_scratch));
  const auto* x_bytes = static_cast<const uint8_t*>(x.data<void>());
  const Real type = real_of(x.dtype());
  const auto& st = x.strides();
  float* y = result_buffer(out);  // (B, H, L, D) row-major
  Angles angles(dims / 2);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t first = offset_of_row(offsets, offset, b);
    for (int64_t l = 0; l < length; ++l) {
      angles.at(first + l, scale, periods);
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t base = b * st[0] + h * st[1] + l * st[2];
        float* o = y + ((b * heads + h) * length + l) * d;
        for (int64_t j = 0; j < d; ++j) o[j] = real_at(x_bytes, type, base + j * st[3]);
        angles.rotate(o, traditional);
      }
    }
  }
  store(y, out);
}

// RoPE on products laid out (B, heads, 1, D): one position per row b (a decoding step).
void rotate_heads(float* y, int64_t batch, int64_t heads, int64_t d, const mx::array& offset,
                  const mx::array& freqs, const RopeSettings& rope) {
  std::vector<uint8_t> o_scratch, f_scratch;
  const uint8_t* offsets = contiguous_bytes(offset, o_scratch);
  const float* periods = reinterpret_cast<const float*>(contiguous_bytes(freqs, f_scratch));
  Angles angles(rope.dims / 2);
  for (int64_t b = 0; b < batch; ++b) {
    angles.at(offset_of_row(offsets, offset, b), rope.scale, periods);
    for (int64_t h = 0; h < heads; ++h) angles.rotate(y + (b * heads + h) * d, rope.traditional);
  }
}

void logsumexp_of_rows(const mx::array& x, mx::array& out) {
  const int64_t n = x.shape(-1), rows = static_cast<int64_t>(x.size()) / n;
  const float* x32 = as_float32(x);
  float* y = result_buffer(out);
  const Kernels& kernels = best_kernels();
  // A batch's rows on every core; one row (a single stream's vocabulary) on this thread.
  parallel_for(rows * n >= (256 << 10) ? rows : 1, [&](int64_t t) {
    if (rows * n >= (256 << 10)) kernels.logsumexp_rows(x32, n, y, t, t + 1);
    else kernels.logsumexp_rows(x32, n, y, 0, rows);
  });
  store(y, out);
}

void silu_multiplied(const mx::array& gate, const mx::array& up, mx::array& out) {
  const int64_t n = gate.size();
  const float* g = as_float32(gate);
  const float* u = as_float32(up, SECOND);
  float* y = result_buffer(out);
  const Kernels& kernels = best_kernels();
  in_value_pieces(n, [&](int64_t i0, int64_t i1) { kernels.silu_mul(g + i0, u + i0, y + i0, i1 - i0); });
  store(y, out);
}

void soft_capped(const mx::array& x, float cap, mx::array& out) {
  const int64_t n = x.size();
  const float* v = as_float32(x);
  float* y = result_buffer(out);
  const Kernels& kernels = best_kernels();
  in_value_pieces(n, [&](int64_t i0, int64_t i1) { kernels.soft_cap(v + i0, cap, y + i0, i1 - i0); });
  store(y, out);
}

// -- checks a caller's arguments get -----------------------------------------------------

mx::Stream cpu_stream(mx::StreamOrDevice s) {
  mx::Stream stream = mx::to_stream(s);
  if (stream.device != mx::Device::cpu)
    throw std::invalid_argument("mlx_tfm kernels run on the CPU only");
  best_kernels();  // a bad MLX_TFM_KERNELS_ISA throws here, as the op is made, not when it runs
  return stream;
}

void check_float(const mx::array& a, const char* what) {
  if (a.dtype() != mx::float32 && a.dtype() != mx::float16 && a.dtype() != mx::bfloat16)
    throw std::invalid_argument(std::string("mlx_tfm kernels: ") + what + " must be float32, float16 or bfloat16");
}

void check_quantized(const mx::array& w, const mx::array& scales, const mx::array& biases,
                     int group_size, int bits) {
  if (bits != 4 && bits != 8) throw std::invalid_argument("mlx_tfm kernels: bits must be 4 or 8");
  if (group_size != 32 && group_size != 64 && group_size != 128)
    throw std::invalid_argument("mlx_tfm kernels: group_size must be 32, 64 or 128");
  if (w.ndim() != 2 || w.dtype() != mx::uint32)
    throw std::invalid_argument("mlx_tfm kernels: w must be a 2-D uint32 array");
  const int64_t k = w.shape(1) * 32 / bits;
  if (k % group_size) throw std::invalid_argument("mlx_tfm kernels: w's width is not a whole number of groups");
  const mx::Shape expected{w.shape(0), static_cast<int>(k / group_size)};
  if (scales.shape() != expected || biases.shape() != expected)
    throw std::invalid_argument("mlx_tfm kernels: scales and biases must be (n, k / group_size)");
  check_float(scales, "scales");
  if (biases.dtype() != scales.dtype())
    throw std::invalid_argument("mlx_tfm kernels: scales and biases must have one dtype");
}

// RoPE's periods (dims / 2,) float32 and positions: one integer, or one per row of `batch`.
void check_rope_positions(const mx::array& offset, const mx::array& freqs, int dims, int batch) {
  if (freqs.dtype() != mx::float32 || freqs.ndim() != 1 || freqs.shape(0) != dims / 2)
    throw std::invalid_argument("mlx_tfm kernels: rope needs float32 freqs (dims / 2,)");
  if (!mx::issubdtype(offset.dtype(), mx::integer) || offset.ndim() > 1 ||
      (offset.size() != 1 && offset.size() != static_cast<size_t>(batch)))
    throw std::invalid_argument("mlx_tfm kernels: rope's offset must be one integer or one per row (B,)");
}

mx::Shape with_last(const mx::Shape& shape, int last) {
  mx::Shape out = shape;
  out.back() = last;
  return out;
}

}  // namespace

// -- operations -------------------------------------------------------------------------

mx::array matvec(const mx::array& x, const mx::array& w, bool dense, mx::StreamOrDevice s) {
  check_float(x, "x");
  check_float(w, "w");
  if (x.ndim() < 1 || w.ndim() != 2 || x.shape(-1) != w.shape(1))
    throw std::invalid_argument("mlx_tfm kernels: matvec needs x (..., k) and w (n, k)");
  if (dense && !blas_found()) throw std::invalid_argument("mlx_tfm kernels: no cblas_sgemm for the dense route");
  return mx::array(with_last(x.shape(), w.shape(0)), mx::promote_types(x.dtype(), w.dtype()),
                   std::make_shared<MatVec>(cpu_stream(s), dense), {x, w});
}

bool blas_found() { return sgemm() != nullptr; }

mx::array quantized_matvec(const mx::array& x, const mx::array& w, const mx::array& scales,
                           const mx::array& biases, int group_size, int bits, bool dense, bool int8_activations,
                           mx::StreamOrDevice s) {
  check_float(x, "x");
  check_quantized(w, scales, biases, group_size, bits);
  if (x.ndim() < 1 || x.shape(-1) != w.shape(1) * 32 / bits)
    throw std::invalid_argument("mlx_tfm kernels: x's last axis must match w's width");
  if (dense && !blas_found()) throw std::invalid_argument("mlx_tfm kernels: no cblas_sgemm for the dense route");
  if (dense && int8_activations)
    throw std::invalid_argument("mlx_tfm kernels: int8 activations are for the decoding products, not dense ones");
  return mx::array(with_last(x.shape(), w.shape(0)), mx::promote_types(x.dtype(), scales.dtype()),
                   std::make_shared<QuantizedMatVec>(cpu_stream(s), group_size, bits, dense, int8_activations),
                   {x, w, scales, biases});
}

mx::array quantized_rows(const mx::array& ids, const mx::array& w, const mx::array& scales,
                         const mx::array& biases, int group_size, int bits, mx::StreamOrDevice s) {
  check_quantized(w, scales, biases, group_size, bits);
  if (!mx::issubdtype(ids.dtype(), mx::integer)) throw std::invalid_argument("mlx_tfm kernels: ids must be integers");
  mx::Shape shape = ids.shape();
  shape.push_back(w.shape(1) * 32 / bits);
  return mx::array(shape, scales.dtype(), std::make_shared<QuantizedRows>(cpu_stream(s), group_size, bits),
                   {ids, w, scales, biases});
}

mx::array attention(const mx::array& queries, const mx::array& keys, const mx::array& values, float scale,
                    const std::optional<mx::array>& mask, bool causal, mx::StreamOrDevice s) {
  for (const auto* a : {&queries, &keys, &values}) check_float(*a, "queries, keys and values");
  if (queries.ndim() != 4 || keys.ndim() != 4 || values.shape() != keys.shape() || queries.shape(0) != keys.shape(0) ||
      queries.shape(3) != keys.shape(3) || keys.shape(1) == 0 || queries.shape(1) % keys.shape(1) ||
      keys.dtype() != values.dtype())
    throw std::invalid_argument(
        "mlx_tfm kernels: attention needs queries (B, H, L, D) and keys, values (B, H_kv, S, D) of one dtype, "
        "H a multiple of H_kv");
  if (causal && queries.shape(2) > keys.shape(2))
    throw std::invalid_argument("mlx_tfm kernels: causal attention needs no more queries than positions");
  if (mask && (mask->dtype() != mx::bool_ || mask->ndim() != 4 || mask->shape(1) != 1 || mask->shape(2) != 1 ||
               mask->shape(3) != keys.shape(2) || (mask->shape(0) != 1 && mask->shape(0) != keys.shape(0))))
    throw std::invalid_argument("mlx_tfm kernels: attention's mask must be boolean (B or 1, 1, 1, S)");
  const mx::Stream stream = cpu_stream(s);
  // Gradients (a prompt's attention in training) through the fused op, with the same mask:
  // the row mask broadcasts over the queries, causal alignment is the fused op's own.
  auto reference = [scale, causal, stream](const std::vector<mx::array>& in) {
    std::string mask_mode = causal && in.size() == 3 ? "causal" : "";
    std::optional<mx::array> mask_array;
    if (in.size() > 3) {
      mask_array = in[3];
      if (causal) {
        const int L = in[0].shape(2), S = in[1].shape(2);
        auto rows = mx::reshape(mx::arange(S - L, S, stream), {L, 1}, stream);
        auto columns = mx::reshape(mx::arange(0, S, stream), {1, S}, stream);
        mask_array = mx::logical_and(*mask_array, mx::less_equal(columns, rows, stream), stream);
      }
    }
    return std::vector<mx::array>{
        mx::fast::scaled_dot_product_attention(in[0], in[1], in[2], scale, mask_mode, mask_array, {}, false, stream)};
  };
  std::vector<mx::array> inputs{queries, keys, values};
  if (mask) inputs.push_back(*mask);
  return mx::array(queries.shape(), queries.dtype(), std::make_shared<Attention>(stream, reference, scale, causal),
                   std::move(inputs));
}

mx::array rms_norm(const mx::array& x, const mx::array& weight, float eps, mx::StreamOrDevice s) {
  check_float(x, "x");
  check_float(weight, "weight");
  if (x.ndim() < 1 || weight.ndim() != 1 || weight.shape(0) != x.shape(-1))
    throw std::invalid_argument("mlx_tfm kernels: rms_norm needs x (..., d) and weight (d,)");
  const mx::Stream stream = cpu_stream(s);
  auto reference = [eps, stream](const std::vector<mx::array>& in) {
    return std::vector<mx::array>{mx::fast::rms_norm(in[0], in[1], eps, stream)};
  };
  return mx::array(x.shape(), mx::promote_types(x.dtype(), weight.dtype()),
                   std::make_shared<RMSNorm>(stream, reference, eps), {x, weight});
}

mx::array rope(const mx::array& x, const mx::array& offset, const mx::array& freqs, int dims, bool traditional,
               float scale, mx::StreamOrDevice s) {
  check_float(x, "x");
  if (x.ndim() != 4 || dims < 2 || dims % 2 || dims > x.shape(3))
    throw std::invalid_argument("mlx_tfm kernels: rope needs x (B, H, L, D) and an even dims <= D");
  check_rope_positions(offset, freqs, dims, x.shape(0));
  const mx::Stream stream = cpu_stream(s);
  auto reference = [dims, traditional, scale, stream](const std::vector<mx::array>& in) {
    return std::vector<mx::array>{mx::fast::rope(in[0], dims, traditional, std::nullopt, scale, in[1], in[2], stream)};
  };
  return mx::array(x.shape(), x.dtype(), std::make_shared<RoPE>(stream, reference, dims, traditional, scale),
                   {x, offset, freqs});
}

std::vector<mx::array> fused_products(const mx::array& x, const std::vector<mx::array>& weights, int group_size,
                                      int bits, bool gated, const std::vector<int>& heads,
                                      const std::optional<mx::array>& offset, const std::optional<mx::array>& freqs,
                                      RopeSettings rope, bool int8_activations, mx::StreamOrDevice s) {
  check_float(x, "x");
  const bool quantized = bits != 0;
  const size_t per_weight = quantized ? 3 : 1;
  if (weights.empty() || weights.size() % per_weight || (gated && weights.size() != 2 * per_weight))
    throw std::invalid_argument("mlx_tfm kernels: fused_products needs weights (or weight, scales, biases triples), "
                                "two of them when gated");
  const int64_t k = x.ndim() ? x.shape(-1) : 0;
  std::vector<mx::Shape> shapes;
  mx::Dtype out_type = x.dtype();
  for (size_t i = 0; i < weights.size(); i += per_weight) {
    const mx::array& w = weights[i];
    if (quantized) {
      check_quantized(w, weights[i + 1], weights[i + 2], group_size, bits);
      if (weights[i + 1].dtype() != weights[1].dtype())
        throw std::invalid_argument("mlx_tfm kernels: fused_products needs one scales dtype");
      if (w.shape(1) * 32 / bits != k) throw std::invalid_argument("mlx_tfm kernels: x's last axis must match w's width");
      out_type = mx::promote_types(x.dtype(), weights[i + 1].dtype());
    } else {
      check_float(w, "w");
      if (w.ndim() != 2 || w.shape(1) != k || w.dtype() != weights[0].dtype())
        throw std::invalid_argument("mlx_tfm kernels: fused_products needs x (..., k) and weights (n, k) of one dtype");
      out_type = mx::promote_types(x.dtype(), w.dtype());
    }
    shapes.push_back(with_last(x.shape(), w.shape(0)));
  }
  if (gated && shapes[0] != shapes[1]) throw std::invalid_argument("mlx_tfm kernels: gate and up must have one shape");
  const size_t count = shapes.size();
  if (!heads.empty()) {
    if (gated || heads.size() != count || x.ndim() != 3 || x.shape(1) != 1)
      throw std::invalid_argument("mlx_tfm kernels: heads needs x (B, 1, k) and one head count per product");
    for (size_t i = 0; i < count; ++i) {
      const int n = shapes[i].back();
      if (heads[i] < 1 || n % heads[i]) throw std::invalid_argument("mlx_tfm kernels: a product's width is not heads x D");
      shapes[i] = {x.shape(0), heads[i], 1, n / heads[i]};
    }
  }
  if (rope.dims) {
    if (heads.empty() || count < 2 || !offset || !freqs || rope.dims % 2 || rope.dims > shapes[0][3] ||
        rope.dims > shapes[1][3])
      throw std::invalid_argument("mlx_tfm kernels: rope needs heads, an even dims <= D, freqs and offset");
    check_rope_positions(*offset, *freqs, rope.dims, x.shape(0));
  }
  const mx::Stream stream = cpu_stream(s);
  const std::vector<int> head_counts = heads;
  auto reference = [group_size, bits, gated, per_weight, count, head_counts, rope, stream](const std::vector<mx::array>& in) {
    std::vector<mx::array> outs;
    for (size_t i = 0; i < count; ++i) {
      const size_t w = 1 + i * per_weight;
      outs.push_back(per_weight == 3 ? mx::quantized_matmul(in[0], in[w], in[w + 1], in[w + 2], true, group_size, bits,
                                                            "affine", stream)
                                     : mx::matmul(in[0], mx::transpose(in[w], stream), stream));
    }
    if (gated) return std::vector<mx::array>{
        mx::multiply(mx::multiply(outs[0], mx::sigmoid(outs[0], stream), stream), outs[1], stream)};
    for (size_t i = 0; i < head_counts.size(); ++i) {
      // (B, 1, H * D) -> (B, H, 1, D)
      const int batch = outs[i].shape(0), d = outs[i].shape(2) / head_counts[i];
      outs[i] = mx::transpose(mx::reshape(outs[i], {batch, 1, head_counts[i], d}, stream), {0, 2, 1, 3}, stream);
      if (rope.dims && i < 2)
        outs[i] = mx::fast::rope(outs[i], rope.dims, rope.traditional, std::nullopt, rope.scale, in[in.size() - 2],
                                 in.back(), stream);
    }
    return outs;
  };
  std::vector<mx::array> inputs{x};
  inputs.insert(inputs.end(), weights.begin(), weights.end());
  if (rope.dims) {
    inputs.push_back(*offset);
    inputs.push_back(*freqs);
  }
  if (gated) shapes.resize(1);
  auto primitive = std::make_shared<FusedProducts>(stream, reference, group_size, bits, gated, rope,
                                                   quantized && int8_activations);
  return mx::array::make_arrays(shapes, std::vector<mx::Dtype>(shapes.size(), out_type), primitive, inputs);
}

mx::array logsumexp(const mx::array& x, mx::StreamOrDevice s) {
  check_float(x, "x");
  if (x.ndim() < 1 || x.shape(-1) == 0) throw std::invalid_argument("mlx_tfm kernels: logsumexp needs x (..., n), n > 0");
  const mx::Stream stream = cpu_stream(s);
  auto reference = [stream](const std::vector<mx::array>& in) {
    return std::vector<mx::array>{mx::logsumexp(in[0], -1, true, stream)};
  };
  return mx::array(with_last(x.shape(), 1), x.dtype(), std::make_shared<LogSumExp>(stream, reference), {x});
}

mx::array silu_mul(const mx::array& gate, const mx::array& up, mx::StreamOrDevice s) {
  check_float(gate, "gate");
  check_float(up, "up");
  if (gate.shape() != up.shape()) throw std::invalid_argument("mlx_tfm kernels: silu_mul needs gate and up of one shape");
  const mx::Stream stream = cpu_stream(s);
  auto reference = [stream](const std::vector<mx::array>& in) {
    return std::vector<mx::array>{
        mx::multiply(mx::multiply(in[0], mx::sigmoid(in[0], stream), stream), in[1], stream)};
  };
  return mx::array(gate.shape(), mx::promote_types(gate.dtype(), up.dtype()),
                   std::make_shared<SiluMul>(stream, reference), {gate, up});
}

mx::array soft_cap(const mx::array& x, float cap, mx::StreamOrDevice s) {
  check_float(x, "x");
  if (!(cap > 0.0f)) throw std::invalid_argument("mlx_tfm kernels: soft_cap needs a cap above 0");
  const mx::Stream stream = cpu_stream(s);
  auto reference = [stream, cap](const std::vector<mx::array>& in) {
    return std::vector<mx::array>{mx::multiply(mx::tanh(mx::divide(in[0], mx::array(cap, in[0].dtype()), stream), stream),
                                               mx::array(cap, in[0].dtype()), stream)};
  };
  return mx::array(x.shape(), x.dtype(), std::make_shared<SoftCap>(stream, reference, cap), {x});
}

// -- primitives ---------------------------------------------------------------------------

// MLX_TFM_KERNELS_POISON=1 (tests): every output a kernel allocates starts as NaN (all bits
// set is a NaN in float32, float16 and bfloat16), so a kernel that leaves some of its output
// unwritten gives NaN every time, not whatever an earlier array left in a reused buffer.
bool outputs_poisoned() {
  static const bool poison = [] {
    const char* env = std::getenv("MLX_TFM_KERNELS_POISON");
    return env != nullptr && std::string(env) == "1";
  }();
  return poison;
}


namespace {

void allocate(mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  if (outputs_poisoned()) std::memset(out.data<void>(), 0xFF, out.nbytes());
}

// Whether `out` may be written over `in`'s memory: nothing else reads `in` (MLX's own
// element-wise ops take such an input's buffer too), and it is laid out as `out` is.
bool can_donate(const mx::array& in, const mx::array& out) {
  return in.is_donatable() && in.dtype() == out.dtype() && in.flags().row_contiguous && in.data_size() == out.size();
}

// Allocates `out` (or gives it input `donor`'s memory, when it can take it) and queues
// `compute` on the primitive's CPU stream, as MLX's own CPU primitives do (the inputs stay
// alive until the stream has run it).
template <class Compute>
void dispatch(mx::Stream stream, const std::vector<mx::array>& inputs, mx::array& out, Compute compute,
              int donor = -1) {
  if (donor >= 0 && can_donate(inputs[donor], out)) out.copy_shared_buffer(inputs[donor]);
  else allocate(out);
  auto& encoder = mx::cpu::get_command_encoder(stream);
  for (const auto& in : inputs) encoder.set_input_array(in);
  encoder.set_output_array(out);
  std::vector<mx::array> held;
  for (const auto& in : inputs) held.push_back(mx::array::unsafe_weak_copy(in));
  encoder.dispatch([held = std::move(held), out = mx::array::unsafe_weak_copy(out), compute]() mutable {
    compute(held, out);
  });
}

[[noreturn]] void cpu_only() { throw std::runtime_error("mlx_tfm kernels run on the CPU only"); }

}  // namespace

void MatVec::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const bool dense = dense_;
  dispatch(stream(), inputs, out, [dense](const std::vector<mx::array>& in, mx::array& o) {
    if (dense) dense_float_product(in, o);
    else product(in, 0, 0, o);
  });
}

void QuantizedMatVec::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const int group_size = group_size_, bits = bits_;
  const bool dense = dense_, int8 = int8_activations_;
  dispatch(stream(), inputs, out, [group_size, bits, dense, int8](const std::vector<mx::array>& in, mx::array& o) {
    if (dense) dense_product(in, group_size, bits, o);
    else product(in, group_size, bits, o, int8);
  });
}

void QuantizedRows::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const int group_size = group_size_, bits = bits_;
  dispatch(stream(), inputs, out, [group_size, bits](const std::vector<mx::array>& in, mx::array& o) {
    dequantized_rows(in[0], in[1], in[2], in[3], group_size, bits, o);
  });
}

void Attention::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const float scale = scale_;
  const bool causal = causal_;
  dispatch(stream(), inputs, out, [scale, causal](const std::vector<mx::array>& in, mx::array& o) {
    attention(in[0], in[1], in[2], scale, causal, in.size() > 3 ? &in[3] : nullptr, o);
  });
}

bool Attention::is_equivalent(const mx::Primitive& other) const {
  const auto& that = static_cast<const Attention&>(other);
  return scale_ == that.scale_ && causal_ == that.causal_;
}

void RMSNorm::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const float eps = eps_;
  dispatch(stream(), inputs, out, [eps](const std::vector<mx::array>& in, mx::array& o) {
    rms_normalized(in[0], in[1], eps, o);
  });
}

bool RMSNorm::is_equivalent(const mx::Primitive& other) const { return eps_ == static_cast<const RMSNorm&>(other).eps_; }

void RoPE::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const int dims = dims_;
  const bool traditional = traditional_;
  const float scale = scale_;
  dispatch(stream(), inputs, out, [dims, traditional, scale](const std::vector<mx::array>& in, mx::array& o) {
    rotated(in[0], in[1], in[2], dims, traditional, scale, o);
  });
}

bool RoPE::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const RoPE&>(other);
  return dims_ == o.dims_ && traditional_ == o.traditional_ && scale_ == o.scale_;
}

void LogSumExp::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  dispatch(stream(), inputs, out, [](const std::vector<mx::array>& in, mx::array& o) { logsumexp_of_rows(in[0], o); });
}

std::vector<mx::Shape> LogSumExp::output_shapes(const std::vector<mx::array>& inputs) {
  return {with_last(inputs[0].shape(), 1)};
}

// The product is written over the gate when nothing else reads it: a prompt's FFN then holds
// two (L, intermediate) activations at a time instead of three. Element by element, each
// value is read before it is written.
void SiluMul::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  dispatch(
      stream(), inputs, out, [](const std::vector<mx::array>& in, mx::array& o) { silu_multiplied(in[0], in[1], o); },
      /*donor=*/0);
}

// Written over x when nothing else reads it: the logits of a prompt are the largest
// activation there is, and the capped ones replace them.
void SoftCap::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const float cap = cap_;
  dispatch(
      stream(), inputs, out, [cap](const std::vector<mx::array>& in, mx::array& o) { soft_capped(in[0], cap, o); },
      /*donor=*/0);
}

bool SoftCap::is_equivalent(const mx::Primitive& other) const { return cap_ == static_cast<const SoftCap&>(other).cap_; }

void dispatch_outputs(mx::Stream stream, const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs,
                      OutputsCompute compute) {
  auto& encoder = mx::cpu::get_command_encoder(stream);
  for (auto& out : outputs) allocate(out);
  for (const auto& in : inputs) encoder.set_input_array(in);
  for (auto& out : outputs) encoder.set_output_array(out);
  std::vector<mx::array> held, outs;
  for (const auto& in : inputs) held.push_back(mx::array::unsafe_weak_copy(in));
  for (const auto& out : outputs) outs.push_back(mx::array::unsafe_weak_copy(out));
  encoder.dispatch([held = std::move(held), outs = std::move(outs), compute = std::move(compute)]() mutable {
    compute(held, outs);
  });
}

void FusedProducts::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const int group_size = group_size_, bits = bits_;
  const bool gated = gated_, int8 = int8_activations_;
  const RopeSettings rope = rope_;
  dispatch_outputs(stream(), inputs, outputs, [group_size, bits, gated, rope, int8](const std::vector<mx::array>& held,
                                                                                    std::vector<mx::array>& outs) {
    const size_t count = gated ? 2 : outs.size();
    std::vector<std::vector<float>> buffers(count);
    std::vector<float*> ys(count);
    for (size_t i = 0; i < count; ++i) {
      if (!gated && outs[i].dtype() == mx::float32) {
        ys[i] = outs[i].data<float>();
      } else {
        buffers[i].resize(outs[gated ? 0 : i].size());
        ys[i] = buffers[i].data();
      }
    }
    products_of_one_input(held, count, group_size, bits, ys.data(), int8);
    if (rope.dims) {  // queries and keys, (B, heads, 1, D) each
      const mx::array &offset = held[held.size() - 2], &freqs = held.back();
      for (size_t i = 0; i < 2; ++i)
        rotate_heads(ys[i], outs[i].shape(0), outs[i].shape(1), outs[i].shape(3), offset, freqs, rope);
    }
    if (gated) {
      float* y = result_buffer(outs[0]);
      best_kernels().silu_mul(ys[0], ys[1], y, outs[0].size());
      store(y, outs[0]);
      return;
    }
    for (size_t i = 0; i < count; ++i)
      if (outs[i].dtype() != mx::float32) store(ys[i], outs[i]);
  });
}

void FusedProducts::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) { cpu_only(); }

bool FusedProducts::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const FusedProducts&>(other);
  return group_size_ == o.group_size_ && bits_ == o.bits_ && gated_ == o.gated_ && rope_.dims == o.rope_.dims &&
         rope_.traditional == o.rope_.traditional && rope_.scale == o.rope_.scale &&
         int8_activations_ == o.int8_activations_;
}

void Pointwise::eval_gpu(const std::vector<mx::array>&, mx::array&) { cpu_only(); }

// The gradient of the MLX ops the primitive stands for, with respect to its float inputs
// (a RoPE's integer offsets get zeros).
std::vector<mx::array> Pointwise::vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                                      const std::vector<int>& argnums, const std::vector<mx::array>&) {
  return reference_vjp(reference_, primals, cotangents, argnums, stream());
}

std::vector<mx::array> reference_vjp(const Reference& reference, const std::vector<mx::array>& primals,
                                     const std::vector<mx::array>& cotangents, const std::vector<int>& argnums,
                                     mx::Stream stream) {
  std::vector<int> floats;
  for (int arg : argnums)
    if (mx::issubdtype(primals[arg].dtype(), mx::floating)) floats.push_back(arg);
  std::vector<mx::array> chosen;
  for (int arg : floats) chosen.push_back(primals[arg]);
  auto of_chosen = [&](const std::vector<mx::array>& values) {
    std::vector<mx::array> all = primals;
    for (size_t i = 0; i < floats.size(); ++i) all[floats[i]] = values[i];
    return reference(all);
  };
  std::vector<mx::array> float_grads = chosen.empty() ? chosen : mx::vjp(of_chosen, chosen, cotangents).second;
  std::vector<mx::array> grads;
  for (int arg : argnums) {
    auto found = std::find(floats.begin(), floats.end(), arg);
    grads.push_back(found == floats.end() ? mx::zeros_like(primals[arg], stream)
                                          : float_grads[found - floats.begin()]);
  }
  return grads;
}

void MatVec::eval_gpu(const std::vector<mx::array>&, mx::array&) { cpu_only(); }
void QuantizedMatVec::eval_gpu(const std::vector<mx::array>&, mx::array&) { cpu_only(); }
void QuantizedRows::eval_gpu(const std::vector<mx::array>&, mx::array&) { cpu_only(); }

// Gradients through MLX's own ops (training never takes these routes; this keeps a
// product differentiable wherever it appears).
std::vector<mx::array> MatVec::vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                                   const std::vector<int>& argnums, const std::vector<mx::array>&) {
  const mx::array &x = primals[0], &w = primals[1], &cotangent = cotangents[0];
  std::vector<mx::array> grads;
  for (int arg : argnums) {
    if (arg == 0 && dense_) {  // many positions: float32 BLAS, not MLX's half-precision product
      mx::array product = mx::matmul(mx::astype(cotangent, mx::float32, stream()),
                                     mx::astype(w, mx::float32, stream()), stream());
      grads.push_back(mx::astype(product, x.dtype(), stream()));
    } else if (arg == 0) {
      grads.push_back(mx::astype(mx::matmul(cotangent, w, stream()), x.dtype(), stream()));
    } else {  // (n, positions) @ (positions, k)
      mx::array c = mx::reshape(cotangent, {-1, w.shape(0)}, stream());
      mx::array xs = mx::reshape(x, {-1, w.shape(1)}, stream());
      grads.push_back(mx::astype(mx::matmul(mx::transpose(c, stream()), xs, stream()), w.dtype(), stream()));
    }
  }
  return grads;
}

std::vector<mx::array> QuantizedMatVec::vjp(const std::vector<mx::array>& primals,
                                            const std::vector<mx::array>& cotangents,
                                            const std::vector<int>& argnums, const std::vector<mx::array>&) {
  std::vector<mx::array> grads;
  for (int arg : argnums) {
    if (arg != 0) throw std::invalid_argument("mlx_tfm kernels: quantized weights have no gradient");
    if (dense_) {
      // Many positions (training): float32 BLAS against the layer dequantized for the
      // moment, not MLX's quantized_matmul, which runs on one core.
      const mx::array weight = mx::dequantize(primals[1], primals[2], primals[3], group_size_, bits_, "affine",
                                              std::nullopt, mx::float32, stream());
      grads.push_back(mx::astype(mx::matmul(mx::astype(cotangents[0], mx::float32, stream()), weight, stream()),
                                 primals[0].dtype(), stream()));
      continue;
    }
    grads.push_back(mx::astype(mx::quantized_matmul(cotangents[0], primals[1], primals[2], primals[3], false,
                                                    group_size_, bits_, "affine", stream()),
                               primals[0].dtype(), stream()));
  }
  return grads;
}

std::vector<mx::array> no_gradient(const std::vector<mx::array>& primals, const std::vector<int>& argnums,
                                   mx::Stream stream) {
  std::vector<mx::array> grads;
  for (int arg : argnums) grads.push_back(mx::zeros_like(primals[arg], stream));
  return grads;
}

std::vector<mx::array> QuantizedRows::vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>&,
                                          const std::vector<int>& argnums, const std::vector<mx::array>&) {
  return no_gradient(primals, argnums, stream());
}

bool QuantizedMatVec::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const QuantizedMatVec&>(other);
  return group_size_ == o.group_size_ && bits_ == o.bits_ && dense_ == o.dense_ &&
         int8_activations_ == o.int8_activations_;
}

bool QuantizedRows::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const QuantizedRows&>(other);
  return group_size_ == o.group_size_ && bits_ == o.bits_;
}

}  // namespace mlx_tfm_kernels
