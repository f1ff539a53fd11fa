"""The small operations of a decoding step on MLX's CPU backend, MLX's own against
mlx_tfm's kernels: RMSNorm, RoPE, silu(gate) * up, the log-sum-exp over the vocabulary,
one query's attention over the cache and a 4-bit feed-forward product, for 1 and 16 rows
of the 135M Llama shape (models.py); a prompt's causal attention (as many
queries as positions); and 16 rows through the 4-bit tied head. Then the 16-bit products at
SmolLM2-1.7B's shapes (2048 -> 2048, 2048 -> 8192, 8192 -> 2048), float16 and bfloat16
weights: a prompt's ``--half-rows`` rows and one decoding row, through MLX's plain route
(``x @ W.T`` in the weight's dtype, what runs with the CPU routes off), through mlx_tfm's CPU
route (``mlx_tfm.cpu.linear.half_product``) and as numpy's float32 product of the same values
(the BLAS ceiling), the three alternated in each of ``--rounds`` rounds; a decoding row
cycles through 4 distinct weights, so that it reads them from memory as a model does. And
(``--section int8``) the quantized decoding products at those shapes, 4- and 8-bit group 64,
``--int8-rows`` positions: the kernel's float route against its int8 activations
(``int8_activations=True``), alternated product by product, 4 distinct weights each.

    python examples/benchmarks/benchmark_cpu_ops.py
    python examples/benchmarks/benchmark_cpu_ops.py --section half --rounds 2
    python examples/benchmarks/benchmark_cpu_ops.py --section int8 --rounds 3

Each op runs ``--calls`` times on distinct inputs in one graph (an input plus a small
offset, so no call reuses another's result and no value drifts into subnormals), minus
the time of making those inputs; MLX's ops are the ones the model runs where the kernels
are off (RMSNorm, RoPE and SwiGLU compiled, as mlx_tfm/model/ and positions.py compile
them). The machine should be otherwise idle.
"""

from __future__ import annotations

import argparse
import time

import mlx_tfm  # noqa: F401  (BLAS routing)
import mlx.core as mx
import numpy as np

from mlx_tfm.cpu.kernels import kernels, status
from mlx_tfm.cpu.linear import half_product
from mlx_tfm.model.layers import fused_rms_norm, gated_activation
from mlx_tfm.model.positions import fused_rope
from models import LLAMA_135M

HIDDEN, FFN, VOCAB = LLAMA_135M["hidden_size"], LLAMA_135M["intermediate_size"], LLAMA_135M["vocab_size"]
HEADS, KV_HEADS = LLAMA_135M["num_attention_heads"], LLAMA_135M["num_key_value_heads"]
HEAD_DIM = HIDDEN // HEADS


def per_call_us(op, x: mx.array, calls: int) -> float:
    """Microseconds per call of ``op`` on ``calls`` distinct inputs made from ``x``."""
    inputs = lambda: [x + i * 1e-3 for i in range(calls)]  # noqa: E731
    mx.eval([op(v) for v in inputs()[:3]])
    start = time.perf_counter()
    mx.eval(inputs())
    making = time.perf_counter() - start
    start = time.perf_counter()
    mx.eval([op(v) for v in inputs()])
    return (time.perf_counter() - start - making) / calls * 1e6


def ops(rows: int, positions: int):
    """(name, MLX op, kernel op, input) for ``rows`` decoding rows."""
    K = kernels()
    weight = mx.random.normal((HIDDEN,)) * 0.1 + 1
    periods = mx.array((LLAMA_135M["rope_theta"] ** (np.arange(0, HEAD_DIM, 2) / HEAD_DIM)).astype(np.float32))
    offset = mx.arange(rows, dtype=mx.int32) + positions
    up = mx.random.normal((rows, 1, FFN))
    keys, values = (mx.random.normal((rows, KV_HEADS, positions, HEAD_DIM)) for _ in range(2))
    swiglu = gated_activation("silu")
    scale = HEAD_DIM**-0.5
    return [
        ("RMSNorm", lambda x: fused_rms_norm(x, weight, 1e-5), lambda x: K.rms_norm(x, weight, eps=1e-5),
         mx.random.normal((rows, 1, HIDDEN))),
        ("RoPE", lambda x: fused_rope(x, periods, offset, HEAD_DIM, False, 1.0),
         lambda x: K.rope(x, offset, periods, dims=HEAD_DIM, traditional=False, scale=1.0),
         mx.random.normal((rows, HEADS, 1, HEAD_DIM))),
        ("silu(gate) * up", lambda x: swiglu(x, up), lambda x: K.silu_mul(x, up), mx.random.normal((rows, 1, FFN))),
        ("log-sum-exp", lambda x: mx.logsumexp(x, axis=-1, keepdims=True), lambda x: K.logsumexp(x),
         mx.random.normal((rows, VOCAB))),
        (f"attention ({positions} positions)",
         lambda q: mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale),
         lambda q: K.attention(q, keys, values, scale=scale), mx.random.normal((rows, HEADS, 1, HEAD_DIM))),
        quantized_product(rows, FFN),
    ]


def quantized_product(rows: int, out_dims: int):
    """(name, MLX op, kernel op, input): ``rows`` positions through a 4-bit layer (group 64,
    float32 scales) of HIDDEN inputs and ``out_dims`` outputs."""
    K = kernels()
    weight, scales, biases = mx.quantize(mx.random.normal((out_dims, HIDDEN)) * 0.02, group_size=64, bits=4)
    return (f"4-bit product {HIDDEN} -> {out_dims}",
            lambda x: mx.quantized_matmul(x, weight, scales, biases, transpose=True, group_size=64, bits=4),
            lambda x: K.quantized_matvec(x, weight, scales, biases, group_size=64, bits=4),
            mx.random.normal((rows, HIDDEN)))


def prompt_attention(positions: int):
    """(name, MLX op, kernel op, queries) for a prompt of ``positions`` tokens, causal."""
    K = kernels()
    keys, values = (mx.random.normal((1, KV_HEADS, positions, HEAD_DIM)) for _ in range(2))
    scale = HEAD_DIM**-0.5
    return (f"attention, {positions}-token prompt",
            lambda q: mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask="causal"),
            lambda q: K.attention(q, keys, values, scale=scale, causal=True),
            mx.random.normal((1, HEADS, positions, HEAD_DIM)))


# SmolLM2-1.7B's products: (inputs, outputs) of attention's, the FFN's up and its down.
HALF_SHAPES = ((2048, 2048), (2048, 8192), (8192, 2048))


def best_ms(op, repeats: int) -> float:
    """The fastest of ``repeats`` evaluations of ``op()``, in milliseconds (after one warm-up)."""
    mx.eval(op())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(op())
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def numpy_ms(x: np.ndarray, weights: list[np.ndarray], repeats: int) -> float:
    """The fastest of ``repeats`` rounds of ``x @ W.T`` over ``weights``, per product."""
    times = []
    for _ in range(repeats + 1):  # the first a warm-up
        start = time.perf_counter()
        for weight in weights:
            x @ weight.T
        times.append(time.perf_counter() - start)
    return min(times[1:]) * 1e3 / len(weights)


def half_products(rows: int, rounds: int) -> None:
    """The table of 16-bit products: MLX's plain route, mlx_tfm's, numpy's float32 sgemm."""
    print(f"cpu kernels: {status()}; 16-bit products at SmolLM2-1.7B's shapes, milliseconds (best of 2 per round, "
          "MLX's plain route once for a prompt)\n")
    print("| round | weight | in -> out | rows | MLX plain | mlx_tfm | numpy float32 | mlx_tfm vs plain "
          "| numpy / mlx_tfm |\n|---|---|---|---|---|---|---|---|---|")
    for round_ in range(1, rounds + 1):
        for in_dims, out_dims in HALF_SHAPES:
            for dtype in (mx.float16, mx.bfloat16):
                # A decoding row streams its weights from memory: 4 distinct ones, more than a cache holds.
                weights = [(mx.random.normal((out_dims, in_dims)) * 0.02).astype(dtype) for _ in range(4)]
                weights32 = [np.array(weight.astype(mx.float32)) for weight in weights]
                for count in (rows, 1):
                    used = weights[:1] if count > 1 else weights
                    x = mx.random.normal((count, in_dims)).astype(dtype)
                    mx.eval(weights, x)
                    plain = best_ms(lambda: [x @ w.T for w in used], 1 if count > 1 else 5) / len(used)
                    ours = best_ms(lambda: [half_product(x, w) for w in used], 2 if count > 1 else 10) / len(used)
                    x32 = np.array(x.astype(mx.float32))
                    ceiling = numpy_ms(x32, weights32[: len(used)], 2 if count > 1 else 10)
                    name = "float16" if dtype == mx.float16 else "bfloat16"
                    print(f"| {round_} | {name} | {in_dims} -> {out_dims} | {count} | {plain:.2f} | {ours:.2f} "
                          f"| {ceiling:.2f} | {plain / ours:.1f}x | {ceiling / ours:.2f} |", flush=True)


def int8_products(rows: int, rounds: int) -> None:
    """The table of quantized decoding products, float activations against int8 ones: the two
    alternated product by product (so both see the same load), ``10 * rounds`` timings each."""
    K = kernels()
    print(f"cpu kernels: {status()}, int8 products: {K.int8_isa()}; quantized products at SmolLM2-1.7B's shapes, "
          f"group 64, {rows} position(s), milliseconds per product over 4 distinct weights, fastest and median of "
          f"{10 * rounds} alternated timings\n")
    print("| bits | in -> out | float fastest | int8 fastest | float / int8 fastest | float median | int8 median "
          "| float / int8 median |\n|---|---|---|---|---|---|---|---|")
    for bits in (4, 8):
        for in_dims, out_dims in HALF_SHAPES:
            layers = [mx.quantize(mx.random.normal((out_dims, in_dims)) * 0.02, group_size=64, bits=bits)
                      for _ in range(4)]
            x = mx.random.normal((rows, in_dims))
            mx.eval(layers, x)
            timings = {False: [], True: []}
            for _ in range(10 * rounds + 1):  # the first of each a warm-up
                for int8, times in timings.items():
                    start = time.perf_counter()
                    mx.eval([K.quantized_matvec(x, *layer, group_size=64, bits=bits, int8_activations=int8)
                             for layer in layers])
                    times.append((time.perf_counter() - start) * 1e3 / len(layers))
            (fast_f, fast_i), (mid_f, mid_i) = ([f(timings[o][1:]) for o in (False, True)] for f in (min, np.median))
            print(f"| {bits} | {in_dims} -> {out_dims} | {fast_f:.3f} | {fast_i:.3f} | {fast_f / fast_i:.2f}x "
                  f"| {mid_f:.3f} | {mid_i:.3f} | {mid_f / mid_i:.2f}x |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--positions", type=int, default=170, help="cached positions the attention reads")
    parser.add_argument("--section", choices=("all", "ops", "half", "int8"), default="all",
                        help="the decoding step's small ops, the 16-bit products, both, or (only when asked for) "
                             "the quantized products with int8 activations")
    parser.add_argument("--half-rows", type=int, default=512, help="a prompt's rows through the 16-bit products")
    parser.add_argument("--rounds", type=int, default=2, help="alternated rounds of the 16-bit (or int8) products")
    parser.add_argument("--int8-rows", type=int, default=1, help="positions through the int8 section's products")
    args = parser.parse_args()
    if kernels() is None:
        raise SystemExit(f"error: mlx_tfm's CPU kernels are {status()}")
    if args.section == "int8":
        int8_products(args.int8_rows, args.rounds)
        return
    if args.section != "ops":
        half_products(args.half_rows, args.rounds)
    if args.section == "half":
        return
    print(f"cpu kernels: {status()}; {args.calls} calls each, microseconds per call\n")
    print(f"| op | rows | MLX | mlx_tfm kernel | ratio |\n|---|---|---|---|---|")
    for rows in (1, 16):
        for name, plain, kernel, x in ops(rows, args.positions):
            mx.eval(x)
            a, b = per_call_us(plain, x, args.calls), per_call_us(kernel, x, args.calls)
            print(f"| {name} | {rows} | {a:.1f} | {b:.1f} | {a / b:.1f}x |", flush=True)
    for rows, (name, plain, kernel, x) in ((1, prompt_attention(args.positions)),
                                           (16, quantized_product(16, VOCAB))):  # the tied head
        mx.eval(x)
        a, b = per_call_us(plain, x, args.calls // 10), per_call_us(kernel, x, args.calls // 10)
        print(f"| {name} | {rows} | {a:.1f} | {b:.1f} | {a / b:.1f}x |", flush=True)


if __name__ == "__main__":
    with mx.stream(mx.cpu):
        main()
