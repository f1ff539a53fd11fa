// The kernels, written once over simd.h's vector type. Included by kernels_<isa>.cpp inside
// namespace mlx_tfm_kernels::<isa>, compiled with that set's flags. No std:: algorithms or
// other shared inline code here: the linker keeps one copy of such code for all files, and
// it could be the AVX-512 file's.
#pragma once

#include <math.h>

#include <type_traits>

#include "kernels.h"
#include "simd.h"

namespace mlx_tfm_kernels::ISA_NAMESPACE {

using namespace simd;

template <Real R>
inline F load_real(const void* base, int64_t i) {
  if constexpr (R == Real::F32) return load(static_cast<const float*>(base) + i);
  if constexpr (R == Real::F16) return load_f16(static_cast<const uint16_t*>(base) + i);
  if constexpr (R == Real::BF16) return load_bf16(static_cast<const uint16_t*>(base) + i);
}

template <Real R>
inline float scalar_real(const void* base, int64_t i) {
  if constexpr (R == Real::F32) return static_cast<const float*>(base)[i];
  if constexpr (R == Real::F16) return half_to_float(static_cast<const uint16_t*>(base)[i]);
  if constexpr (R == Real::BF16) return bf16_to_float(static_cast<const uint16_t*>(base)[i]);
}

// How far ahead of the multiply-adds a float product asks for its weights: the hardware
// prefetcher alone left a decoding step's weights streaming below the memory's read
// bandwidth (README, "CPU kernels").
constexpr int64_t PREFETCH_BYTES = 4096;

template <Real R>
constexpr int64_t real_bytes() { return R == Real::F32 ? 4 : 2; }

// M positions at once, so each weight is read once for all of them; U independent
// accumulators per position hide the latency of the multiply-adds.
template <Real R, int M>
void float_rows_m(const FloatProduct& p, const float* x, float* y, int64_t n0, int64_t n1) {
  constexpr int U = M == 1 ? 4 : (M <= 4 ? 2 : 1);
  constexpr int64_t STEP_BYTES = U * LANES * real_bytes<R>();
  const int64_t k = p.k;
  const char* bytes = static_cast<const char*>(p.w);
  for (int64_t n = n0; n < n1; ++n) {
    const int64_t row = n * k;
    F acc[M][U];
    for (int m = 0; m < M; ++m)
      for (int u = 0; u < U; ++u) acc[m][u] = zero();
    int64_t j = 0;
    for (; j + U * LANES <= k; j += U * LANES) {
      const char* ahead = bytes + (row + j) * real_bytes<R>() + PREFETCH_BYTES;
      for (int64_t b = 0; b < STEP_BYTES; b += CACHE_LINE_BYTES) __builtin_prefetch(ahead + b, 0, 3);
      for (int u = 0; u < U; ++u) {
        F w = load_real<R>(p.w, row + j + u * LANES);
        for (int m = 0; m < M; ++m) acc[m][u] = fma(w, load(x + m * k + j + u * LANES), acc[m][u]);
      }
    }
    for (; j + LANES <= k; j += LANES) {
      F w = load_real<R>(p.w, row + j);
      for (int m = 0; m < M; ++m) acc[m][0] = fma(w, load(x + m * k + j), acc[m][0]);
    }
    float tail[M] = {};
    for (; j < k; ++j) {
      float w = scalar_real<R>(p.w, row + j);
      for (int m = 0; m < M; ++m) tail[m] += w * x[m * k + j];
    }
    for (int m = 0; m < M; ++m) {
      F total = acc[m][0];
      for (int u = 1; u < U; ++u) total = add(total, acc[m][u]);
      y[m * p.n + n] = hsum(total) + tail[m];
    }
  }
}

// Each group of a row: the dot product of its raw values with x, times the group's scale,
// plus its bias times the sum of x over the group. The scaled dot products stay vectors
// until the row's end (one horizontal sum per row, not per group). The group size is a
// compile-time constant, so a group's loop unrolls whole.
// 4 bits where a group's dequantized values fit one register (AVX-512): each value is
// looked up already scaled and shifted, so a group costs one multiply-add per value.
// x is arranged (arrange_for_nibbles): the M positions' blocks of 2 * LANES values side by
// side, so each load is one pointer plus a constant.
template <int GS, Real S, int M>
void nibble_table_rows_m(const QuantizedProduct& p, const float* x, float* y, int64_t n0, int64_t n1) {
  constexpr int BLOCK = 2 * LANES;
  const int64_t k = p.k, groups = k / GS, row_bytes = k / 2;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* w = p.w + n * row_bytes;
    const int64_t first_scale = n * groups;
    F acc[M][2];
    for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = zero();
    const float* xb = x;
    for (int64_t g = 0; g < groups; ++g) {
      const F table = nibble_table(scalar_real<S>(p.scales, first_scale + g), scalar_real<S>(p.biases, first_scale + g));
      for (int j = 0; j < GS; j += BLOCK, w += BLOCK / 2, xb += M * BLOCK) {
        F low, high;
        lookup_nibbles(w, table, low, high);
        for (int m = 0; m < M; ++m) {
          acc[m][0] = fma(low, load(xb + m * BLOCK), acc[m][0]);
          acc[m][1] = fma(high, load(xb + m * BLOCK + LANES), acc[m][1]);
        }
      }
    }
    for (int m = 0; m < M; ++m) y[m * p.n + n] = hsum(add(acc[m][0], acc[m][1]));
  }
}

template <int BITS, int GS, Real S, int M>
void quantized_rows_m(const QuantizedProduct& p, const float* x, const float* sums, float* y,
                      int64_t n0, int64_t n1) {
  constexpr int GROUP_BYTES = GS * BITS / 8;
  const int64_t k = p.k, groups = k / GS, row_bytes = k * BITS / 8;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* w = p.w + n * row_bytes;
    const int64_t first_scale = n * groups;
    F acc[M];
    float bias_acc[M] = {};
    for (int m = 0; m < M; ++m) acc[m] = zero();
    const float* xg = x;  // 8 bits: x (M, k) as is; 4 bits: arranged as for nibble_table_rows_m
    for (int64_t g = 0; g < groups; ++g, w += GROUP_BYTES, xg += GS * (BITS == 4 ? M : 1)) {
      F dot[M][2];
      for (int m = 0; m < M; ++m) dot[m][0] = dot[m][1] = zero();
      if constexpr (BITS == 4) {
        constexpr int BLOCK = 2 * LANES;
        for (int j = 0; j < GS; j += BLOCK) {
          F low, high;
          load_nibbles(w + j / 2, low, high);
          const float* xb = xg + j * M;
          for (int m = 0; m < M; ++m) {
            dot[m][0] = fma(low, load(xb + m * BLOCK), dot[m][0]);
            dot[m][1] = fma(high, load(xb + m * BLOCK + LANES), dot[m][1]);
          }
        }
      } else {
        for (int j = 0; j < GS; j += 2 * LANES) {
          F a = load_u8(w + j), b = load_u8(w + j + LANES);
          for (int m = 0; m < M; ++m) {
            dot[m][0] = fma(a, load(xg + m * k + j), dot[m][0]);
            dot[m][1] = fma(b, load(xg + m * k + j + LANES), dot[m][1]);
          }
        }
      }
      const F scale = set1(scalar_real<S>(p.scales, first_scale + g));
      const float bias = scalar_real<S>(p.biases, first_scale + g);
      for (int m = 0; m < M; ++m) {
        acc[m] = fma(scale, add(dot[m][0], dot[m][1]), acc[m]);
        bias_acc[m] += bias * sums[m * groups + g];
      }
    }
    for (int m = 0; m < M; ++m) y[m * p.n + n] = hsum(acc[m]) + bias_acc[m];
  }
}

// Calls kernel<M> for the positions in chunks of up to MAX_POSITIONS (M a compile-time constant).
template <template <int> class Kernel, class... Args>
void by_position_chunks(int64_t m_total, Args&&... args) {
  static_assert(MAX_POSITIONS == 8, "one case per chunk size");
  for (int64_t m0 = 0; m0 < m_total; m0 += MAX_POSITIONS) {
    switch (m_total - m0 < MAX_POSITIONS ? m_total - m0 : MAX_POSITIONS) {
      case 1: Kernel<1>::run(m0, args...); break;
      case 2: Kernel<2>::run(m0, args...); break;
      case 3: Kernel<3>::run(m0, args...); break;
      case 4: Kernel<4>::run(m0, args...); break;
      case 5: Kernel<5>::run(m0, args...); break;
      case 6: Kernel<6>::run(m0, args...); break;
      case 7: Kernel<7>::run(m0, args...); break;
      default: Kernel<8>::run(m0, args...); break;
    }
  }
}

template <Real R>
struct FloatKernel {
  template <int M>
  struct At {
    static void run(int64_t m0, const FloatProduct& p, int64_t n0, int64_t n1) {
      float_rows_m<R, M>(p, p.x + m0 * p.k, p.y + m0 * p.n, n0, n1);
    }
  };
};

template <int BITS, int GS, Real S>
struct QuantizedKernel {
  template <int M>
  struct At {
    static void run(int64_t m0, const QuantizedProduct& p, int64_t n0, int64_t n1) {
      const int64_t groups = p.k / GS;
      if constexpr (BITS == 4 && HAS_NIBBLE_TABLE) {
        nibble_table_rows_m<GS, S, M>(p, p.x_arranged + m0 * p.k, p.y + m0 * p.n, n0, n1);
        return;
      }
      quantized_rows_m<BITS, GS, S, M>(p, p.x_arranged + m0 * p.k, p.x_group_sums + m0 * groups,
                                   p.y + m0 * p.n, n0, n1);
    }
  };
};

inline void float_rows(const FloatProduct& p, int64_t n0, int64_t n1) {
  switch (p.w_type) {
    case Real::F32: by_position_chunks<FloatKernel<Real::F32>::At>(p.m, p, n0, n1); break;
    case Real::F16: by_position_chunks<FloatKernel<Real::F16>::At>(p.m, p, n0, n1); break;
    case Real::BF16: by_position_chunks<FloatKernel<Real::BF16>::At>(p.m, p, n0, n1); break;
  }
}

template <int BITS, int GS>
inline void quantized_rows_group(const QuantizedProduct& p, int64_t n0, int64_t n1) {
  switch (p.scale_type) {
    case Real::F32: by_position_chunks<QuantizedKernel<BITS, GS, Real::F32>::template At>(p.m, p, n0, n1); break;
    case Real::F16: by_position_chunks<QuantizedKernel<BITS, GS, Real::F16>::template At>(p.m, p, n0, n1); break;
    case Real::BF16: by_position_chunks<QuantizedKernel<BITS, GS, Real::BF16>::template At>(p.m, p, n0, n1); break;
  }
}

template <int BITS>
inline void quantized_rows_bits(const QuantizedProduct& p, int64_t n0, int64_t n1) {
  switch (p.group_size) {
    case 32: quantized_rows_group<BITS, 32>(p, n0, n1); break;
    case 64: quantized_rows_group<BITS, 64>(p, n0, n1); break;
    default: quantized_rows_group<BITS, 128>(p, n0, n1); break;
  }
}

inline void quantized_rows(const QuantizedProduct& p, int64_t n0, int64_t n1) {
  if (p.bits == 4) quantized_rows_bits<4>(p, n0, n1);
  else quantized_rows_bits<8>(p, n0, n1);
}

// dot(q, row) over d values, row of type R.
template <Real R>
inline float dot_row(const float* q, const void* row, int64_t d) {
  F acc = zero();
  int64_t j = 0;
  for (; j + LANES <= d; j += LANES) acc = fma(load(q + j), load_real<R>(row, j), acc);
  float total = hsum(acc);
  for (; j < d; ++j) total += q[j] * scalar_real<R>(row, j);
  return total;
}

// e^v for every lane, within 2 ulp over float32's range: v = n ln2 + r, |r| <= ln2 / 2
// (ln2 in two parts, so r keeps its low bits), e^r by a degree-7 polynomial (Cephes'
// coefficients), times 2^n. Inputs are clamped where e^v leaves float32's normal range.
inline F exp_lanes(F v) {
  v = clamp(v, -87.33654f, 88.0f);
  const F n = round_nearest(mul(v, set1(1.44269504088896341f)));
  F r = fma(n, set1(-0.693359375f), v);
  r = fma(n, set1(2.12194440e-4f), r);
  F p = set1(1.9875691500e-4f);
  p = fma(p, r, set1(1.3981999507e-3f));
  p = fma(p, r, set1(8.3334519073e-3f));
  p = fma(p, r, set1(4.1665795894e-2f));
  p = fma(p, r, set1(1.6666665459e-1f));
  p = fma(p, r, set1(5.0000001201e-1f));
  p = fma(p, mul(r, r), add(r, set1(1.0f)));
  return times_power_of_two(p, n);
}

// e^(v[i] - shift) into v, n values; returns their sum.
inline float exp_shifted_sum(float* v, int64_t n, float shift) {
  const F minus = set1(-shift);
  F total = zero();
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES) {
    const F e = exp_lanes(add(load(v + i), minus));
    store(v + i, e);
    total = add(total, e);
  }
  float sum = hsum(total);
  for (; i < n; ++i) sum += (v[i] = ::expf(v[i] - shift));
  return sum;
}

// out (H, d) = weights (H, positions; rows `stride` apart) @ the value rows, for H <=
// HEAD_BLOCK query vectors: a value row's CHUNK columns at a time, every vector's sums for
// them in registers, so each row is loaded once per chunk and nothing is stored until the end.
constexpr int HEAD_BLOCK = 4;
constexpr int CHUNK = 64;

template <Real R, int H>
void weighted_values(const float* weights, int64_t positions, int64_t stride, const uint8_t* values,
                     int64_t value_bytes, int64_t d, float* out) {
  constexpr int CV = CHUNK / LANES;
  int64_t c0 = 0;
  for (; c0 + CHUNK <= d; c0 += CHUNK) {
    F acc[H][CV];
    for (int h = 0; h < H; ++h)
      for (int c = 0; c < CV; ++c) acc[h][c] = zero();
    for (int64_t s = 0; s < positions; ++s) {
      const uint8_t* row = values + s * value_bytes;
      F v[CV];
      for (int c = 0; c < CV; ++c) v[c] = load_real<R>(row, c0 + c * LANES);
      for (int h = 0; h < H; ++h) {
        const F w = set1(weights[h * stride + s]);
        for (int c = 0; c < CV; ++c) acc[h][c] = fma(w, v[c], acc[h][c]);
      }
    }
    for (int h = 0; h < H; ++h)
      for (int c = 0; c < CV; ++c) store(out + h * d + c0 + c * LANES, acc[h][c]);
  }
  if (c0 == d) return;
  for (int h = 0; h < H; ++h)
    for (int64_t j = c0; j < d; ++j) out[h * d + j] = 0.0f;
  for (int64_t s = 0; s < positions; ++s) {
    const uint8_t* row = values + s * value_bytes;
    for (int h = 0; h < H; ++h) {
      const float w = weights[h * stride + s];
      for (int64_t j = c0; j < d; ++j) out[h * d + j] += w * scalar_real<R>(row, j);
    }
  }
}

// weighted_values for `vectors` (any count) query vectors, HEAD_BLOCK at a time.
template <Real R>
void weighted_values_of(int64_t vectors, const float* weights, int64_t positions, int64_t stride,
                        const uint8_t* values, int64_t value_bytes, int64_t d, float* out) {
  for (int64_t v = 0; v < vectors; v += HEAD_BLOCK) {
    const float* w = weights + v * stride;
    float* o = out + v * d;
    switch (vectors - v < HEAD_BLOCK ? vectors - v : HEAD_BLOCK) {
      case 1: weighted_values<R, 1>(w, positions, stride, values, value_bytes, d, o); break;
      case 2: weighted_values<R, 2>(w, positions, stride, values, value_bytes, d, o); break;
      case 3: weighted_values<R, 3>(w, positions, stride, values, value_bytes, d, o); break;
      default: weighted_values<R, 4>(w, positions, stride, values, value_bytes, d, o); break;
    }
  }
}

// Softmax of row[0, visible) in place, rows of a mask's hidden positions being -inf, and
// zeros from visible to `through`. Weights too small to matter become 0, not subnormals
// (each multiply-add with a subnormal takes a slow microcode path): peaked attention has many.
// Nothing visible: zeros.
inline void softmax_visible(float* row, int64_t visible, int64_t through) {
  float top = -INFINITY;
  for (int64_t s = 0; s < visible; ++s) top = row[s] > top ? row[s] : top;
  if (top == -INFINITY) visible = 0;
  if (visible > 0) {
    const float inverse = 1.0f / exp_shifted_sum(row, visible, top);
    for (int64_t s = 0; s < visible; ++s) row[s] = row[s] * inverse < 1e-30f ? 0.0f : row[s] * inverse;
  }
  for (int64_t s = visible; s < through; ++s) row[s] = 0.0f;
}

// scores[g * positions + s] = scale * q_g . key s for the group's query heads (group, d),
// LANES positions at a time: each position's products are summed lane-wise, then the
// LANES sums come out of transposed_sums as one vector (a horizontal sum per position
// cost more than its multiply-adds). d is a multiple of LANES. Returns the positions done
// (the whole tiles); the caller scores the rest.
template <Real R>
int64_t group_scores(const float* q, int64_t group, const uint8_t* keys, int64_t key_bytes, int64_t positions,
                     int64_t d, float scale, float* scores) {
  const F sv = set1(scale);
  int64_t s0 = 0;
  for (; s0 + LANES <= positions; s0 += LANES) {
    const uint8_t* tile = keys + s0 * key_bytes;
    for (int64_t g = 0; g < group; ++g) {
      F acc[LANES];
      for (int t = 0; t < LANES; ++t) acc[t] = zero();
      for (int64_t j = 0; j < d; j += LANES) {
        const F qj = load(q + g * d + j);
        for (int t = 0; t < LANES; ++t) acc[t] = fma(qj, load_real<R>(tile + t * key_bytes, j), acc[t]);
      }
      store(scores + g * positions + s0, mul(transposed_sums(acc), sv));
    }
  }
  return s0;
}

// (batch, KV head) pairs [i0, i1): the group of query heads that share a KV head go
// through its keys and values together, so each cached row is read from memory once for
// all of them (then from L1), not once per query head.
template <Real R>
void one_query_groups(const AttentionProblem& p, int64_t i0, int64_t i1, float* scores) {
  const int64_t d = p.head_dim, group = p.heads / p.kv_heads, positions = p.positions;
  const int64_t item = R == Real::F32 ? 4 : 2;
  for (int64_t i = i0; i < i1; ++i) {
    const int64_t b = i / p.kv_heads, kvh = i % p.kv_heads;
    const float* q = p.q + (b * p.heads + kvh * group) * d;  // the group's query heads, (group, d)
    const auto* keys = static_cast<const uint8_t*>(p.keys) + item * (b * p.key_strides[0] + kvh * p.key_strides[1]);
    const auto* values = static_cast<const uint8_t*>(p.values) + item * (b * p.value_strides[0] + kvh * p.value_strides[1]);
    const uint8_t* visible = p.mask ? p.mask + b * p.mask_row_stride : nullptr;
    const int64_t key_bytes = item * p.key_strides[2];
    int64_t s = d % LANES == 0 ? group_scores<R>(q, group, keys, key_bytes, positions, d, p.scale, scores) : 0;
    for (; s < positions; ++s)
      for (int64_t g = 0; g < group; ++g) scores[g * positions + s] = p.scale * dot_row<R>(q + g * d, keys + s * key_bytes, d);
    if (visible)
      for (int64_t s = 0; s < positions; ++s)
        if (!visible[s])
          for (int64_t g = 0; g < group; ++g) scores[g * positions + s] = -INFINITY;
    float* out = p.out + (b * p.heads + kvh * group) * d;
    for (int64_t g = 0; g < group; ++g) softmax_visible(scores + g * positions, positions, positions);
    weighted_values_of<R>(group, scores, positions, positions, values, item * p.value_strides[2], d, out);
  }
}

// scores[v * stride + t] = scale * q_v . keys[t] for V query vectors and the COLS * LANES
// keys of a transposed tile kt (d, KEY_TILE): each tile load serves V vectors.
template <int V, int COLS>
inline void tile_scores(const float* const* q, const float* kt, int64_t d, float scale, float* scores,
                        int64_t stride) {
  F acc[V][COLS];
  for (int v = 0; v < V; ++v)
    for (int c = 0; c < COLS; ++c) acc[v][c] = zero();
  for (int64_t j = 0; j < d; ++j) {
    F k[COLS];
    for (int c = 0; c < COLS; ++c) k[c] = load(kt + j * KEY_TILE + c * LANES);
    for (int v = 0; v < V; ++v) {
      const F qj = set1(q[v][j]);
      for (int c = 0; c < COLS; ++c) acc[v][c] = fma(qj, k[c], acc[v][c]);
    }
  }
  const F sv = set1(scale);
  for (int v = 0; v < V; ++v)
    for (int c = 0; c < COLS; ++c) store(scores + v * stride + c * LANES, mul(acc[v][c], sv));
}

// Work item `item` of a prompt's attention: a block of query positions [l0, l1) of one
// (batch, KV head) pair, with the group's query heads: vectors (g, l) in that order, so
// the vectors of one head are consecutive rows of q and of out. Scores over each tile of
// KEY_TILE positions come from the tile transposed (d, KEY_TILE) in scratch, so a key
// multiplies queries lane-wise with no horizontal sums.
template <Real R>
void query_block_of(const AttentionProblem& p, int64_t item, float* scratch) {
  const int64_t d = p.head_dim, group = p.heads / p.kv_heads, S = p.positions, L = p.queries;
  const int64_t blocks = (L + p.block_queries - 1) / p.block_queries;
  const int64_t pair = item / blocks, l0 = (item % blocks) * p.block_queries;
  const int64_t l1 = l0 + p.block_queries < L ? l0 + p.block_queries : L, rows = l1 - l0, vectors = group * rows;
  const int64_t b = pair / p.kv_heads, kvh = pair % p.kv_heads;
  const int64_t size = R == Real::F32 ? 4 : 2;
  const auto* keys = static_cast<const uint8_t*>(p.keys) + size * (b * p.key_strides[0] + kvh * p.key_strides[1]);
  const auto* values = static_cast<const uint8_t*>(p.values) + size * (b * p.value_strides[0] + kvh * p.value_strides[1]);
  const uint8_t* visible = p.mask ? p.mask + b * p.mask_row_stride : nullptr;
  // the positions any vector of the block sees, and each row's own count
  auto seen_by = [&](int64_t l) { return p.causal ? S - L + l + 1 : S; };
  const int64_t seen = seen_by(l1 - 1);
  const int64_t stride = (S + KEY_TILE - 1) / KEY_TILE * KEY_TILE;
  float* scores = scratch;                       // (vectors, stride)
  float* kt = scratch + group * p.block_queries * stride;  // (d, KEY_TILE)
  const float* q = p.q + ((b * p.heads + kvh * group) * L) * d;  // (group, L, d)
  float* out = p.out + ((b * p.heads + kvh * group) * L) * d;
  constexpr int COLS = KEY_TILE / LANES < 4 ? KEY_TILE / LANES : 4;
  constexpr int V = LANES >= 16 ? 4 : 2;
  const float* qv[V];
  for (int64_t t0 = 0; t0 < seen; t0 += KEY_TILE) {
    const int64_t tile = seen - t0 < KEY_TILE ? seen - t0 : KEY_TILE;
    for (int64_t t = 0; t < KEY_TILE; ++t) {
      const uint8_t* key = keys + size * (t0 + t) * p.key_strides[2];
      for (int64_t j = 0; j < d; ++j) kt[j * KEY_TILE + t] = t < tile ? scalar_real<R>(key, j) : 0.0f;
    }
    for (int64_t c0 = 0; c0 < KEY_TILE; c0 += COLS * LANES) {
      if (c0 >= tile) break;
      for (int64_t v = 0; v < vectors; v += V) {
        const int64_t n = vectors - v < V ? vectors - v : V;
        for (int i = 0; i < V; ++i) {
          const int64_t w = v + (i < n ? i : 0);
          qv[i] = q + ((w / rows) * L + l0 + w % rows) * d;
        }
        float* at = scores + v * stride + t0 + c0;
        if (n == V) {
          tile_scores<V, COLS>(qv, kt + c0, d, p.scale, at, stride);
        } else {
          for (int64_t i = 0; i < n; ++i) tile_scores<1, COLS>(qv + i, kt + c0, d, p.scale, at + i * stride, stride);
        }
      }
    }
  }
  for (int64_t v = 0; v < vectors; ++v) {
    float* row = scores + v * stride;
    const int64_t own = seen_by(l0 + v % rows);
    if (visible)
      for (int64_t s = 0; s < own; ++s)
        if (!visible[s]) row[s] = -INFINITY;
    softmax_visible(row, own, seen);
  }
  for (int64_t g = 0; g < group; ++g)
    weighted_values_of<R>(rows, scores + g * rows * stride, seen, stride, values, size * p.value_strides[2], d,
                          out + (g * L + l0) * d);
}

template <Real R>
void attention_of(const AttentionProblem& p, int64_t i0, int64_t i1, float* scratch) {
  if (p.queries == 1) {
    one_query_groups<R>(p, i0, i1, scratch);
    return;
  }
  for (int64_t i = i0; i < i1; ++i) query_block_of<R>(p, i, scratch);
}

inline void attention(const AttentionProblem& p, int64_t i0, int64_t i1, float* scratch) {
  switch (p.kv_type) {
    case Real::F32: attention_of<Real::F32>(p, i0, i1, scratch); break;
    case Real::F16: attention_of<Real::F16>(p, i0, i1, scratch); break;
    case Real::BF16: attention_of<Real::BF16>(p, i0, i1, scratch); break;
  }
}

template <int BITS, Real S>
void dequantize_rows_of(const QuantizedProduct& p, float* out, int64_t n0, int64_t n1) {
  const int64_t k = p.k, gs = p.group_size, groups = k / gs, row_bytes = k * BITS / 8;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* w = p.w + n * row_bytes;
    float* o = out + n * k;
    for (int64_t g = 0; g < groups; ++g) {
      const F scale = set1(scalar_real<S>(p.scales, n * groups + g));
      const F bias = set1(scalar_real<S>(p.biases, n * groups + g));
      for (int64_t j = g * gs; j < (g + 1) * gs; j += 2 * LANES) {
        if constexpr (BITS == 4) {
          // The nibbles come out as (even positions, odd positions): interleave on store.
          F low, high;
          load_nibbles(w + j / 2, low, high);
          float lo[LANES], hi[LANES];
          store(lo, fma(low, scale, bias));
          store(hi, fma(high, scale, bias));
          for (int i = 0; i < LANES; ++i) {
            o[j + 2 * i] = lo[i];
            o[j + 2 * i + 1] = hi[i];
          }
        } else {
          store(o + j, fma(load_u8(w + j), scale, bias));
          store(o + j + LANES, fma(load_u8(w + j + LANES), scale, bias));
        }
      }
    }
  }
}

inline void dequantize_rows(const QuantizedProduct& p, float* out, int64_t n0, int64_t n1) {
  auto by_scale = [&](auto bits) {
    constexpr int B = decltype(bits)::value;
    switch (p.scale_type) {
      case Real::F32: dequantize_rows_of<B, Real::F32>(p, out, n0, n1); break;
      case Real::F16: dequantize_rows_of<B, Real::F16>(p, out, n0, n1); break;
      case Real::BF16: dequantize_rows_of<B, Real::BF16>(p, out, n0, n1); break;
    }
  };
  if (p.bits == 4) by_scale(std::integral_constant<int, 4>{});
  else by_scale(std::integral_constant<int, 8>{});
}

// log(sum(e^x)) of n values, shifted by their largest so nothing overflows; NaN when any
// value is NaN (a broken model is told by its NaN log-sum-exp).
inline float logsumexp_row(const float* x, int64_t n) {
  bool nan = false;
  float top = -INFINITY;
  for (int64_t i = 0; i < n; ++i) {
    nan |= x[i] != x[i];
    top = x[i] > top ? x[i] : top;
  }
  if (nan) return NAN;
  if (top == -INFINITY || top == INFINITY) return top;
  const F minus = set1(-top);
  F total = zero();
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES) total = add(total, exp_lanes(add(load(x + i), minus)));
  float sum = hsum(total);
  for (; i < n; ++i) sum += ::expf(x[i] - top);
  return top + ::logf(sum);
}

inline void logsumexp_rows(const float* x, int64_t n, float* out, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) out[r] = logsumexp_row(x + r * n, n);
}

// out = silu(gate) * up = gate * up / (1 + e^-gate), float32, n values.
inline void silu_mul(const float* gate, const float* up, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES) {
    const F g = load(gate + i);
    const F e = exp_lanes(mul(g, set1(-1.0f)));
    store(out + i, div(mul(g, load(up + i)), add(e, set1(1.0f))));
  }
  for (; i < n; ++i) out[i] = gate[i] * up[i] / (1.0f + ::expf(-gate[i]));
}

// Rows [r0, r1) of x (rows, d), float32: x / sqrt(mean(x^2) + eps), times weight (d,) when
// given, as MLX's rms_norm rounds in float32: (x * r) * w.
inline void rms_norm_rows(const float* x, const float* weight, float eps, int64_t d, float* out, int64_t r0,
                          int64_t r1) {
  for (int64_t row = r0; row < r1; ++row) {
    const float* xr = x + row * d;
    float* o = out + row * d;
    F acc = zero();
    int64_t j = 0;
    for (; j + LANES <= d; j += LANES) acc = fma(load(xr + j), load(xr + j), acc);
    float squares = hsum(acc);
    for (; j < d; ++j) squares += xr[j] * xr[j];
    const float r = 1.0f / ::sqrtf(squares / static_cast<float>(d) + eps);
    const F rv = set1(r);
    j = 0;
    if (weight) {
      for (; j + LANES <= d; j += LANES) store(o + j, mul(mul(load(xr + j), rv), load(weight + j)));
      for (; j < d; ++j) o[j] = (xr[j] * r) * weight[j];
    } else {
      for (; j + LANES <= d; j += LANES) store(o + j, mul(load(xr + j), rv));
      for (; j < d; ++j) o[j] = xr[j] * r;
    }
  }
}

const Kernels& kernels() {
  static const Kernels set{ISA_LABEL, LANES, float_rows, quantized_rows, attention, dequantize_rows,
                           silu_mul, rms_norm_rows, logsumexp_rows};
  return set;
}

}  // namespace mlx_tfm_kernels::ISA_NAMESPACE
