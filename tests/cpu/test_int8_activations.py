"""The quantized decoding products with int8 activations (mlx_tfm/cpu/kernels/src/int8dot*):
x rounded to int8 per 32 values, integer dot products with the 4- or 8-bit weights.

Against float64 numpy: the exact arithmetic the route promises (the rounded x times the
dequantized weights, within float32 accumulation), and the float64 product of the true x
within the bound the rounding allows, the plain float route closer; under each instruction
set the CPU runs; through the layers behind the switch, which off leaves today's route bit
for bit. They call the extension directly, so they run with ``MLX_TFM_KERNELS=0`` too.
"""

import json
import os
import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlx_tfm.cpu import linear as cpu_linear
from mlx_tfm.cpu.kernels import kernels
from mlx_tfm.cpu.linear import QuantizedLinear
from mlx_tfm.cpu.switch import int8_activations_set

try:
    from mlx_tfm.cpu.kernels import _kernels as K
except ImportError as error:  # fail loudly, never skip
    pytest.fail(f"the CPU kernels are not built ({error}): run `pip install -e .` with a C++ compiler and CMake",
                pytrace=False)

BLOCK = 32  # values of x per int8 scale (int8dot.h's ACT_BLOCK)
SCALES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


@pytest.fixture(autouse=True)
def on_the_cpu():
    mx.random.seed(5)
    with mx.stream(mx.cpu):
        yield


def quantized(n: int, k: int, group_size: int, bits: int, scale_dtype=mx.float32):
    w, scales, biases = mx.quantize(mx.random.normal((n, k)), group_size=group_size, bits=bits)
    return w, scales.astype(scale_dtype), biases.astype(scale_dtype)


def dequantized64(w, scales, biases, group_size: int, bits: int) -> np.ndarray:
    """The weights' values in float64 (scales and biases as stored, exactly)."""
    ones, zeros = mx.ones(scales.shape), mx.zeros(scales.shape)
    q = np.array(mx.dequantize(w, ones, zeros, group_size=group_size, bits=bits)).astype(np.float64)
    per_value = lambda a: np.repeat(np.array(a.astype(mx.float32)).astype(np.float64), group_size, axis=1)
    return per_value(scales) * q + per_value(biases)


def rounded_x(x: mx.array) -> tuple[np.ndarray, np.ndarray]:
    """x (m, k) as the route rounds it, in float64, and each value's block scale: per block,
    scale = max |x| / 127, x * (127 / max |x|) rounded to the nearest integer, in float32."""
    x32 = np.array(x.astype(mx.float32))
    blocks = x32.reshape(x32.shape[0], -1, BLOCK)
    largest = np.abs(blocks).max(axis=-1, keepdims=True)
    scale = largest / np.float32(127)
    inverse = np.where(largest > 0, np.float32(127) / np.where(largest > 0, largest, 1), np.float32(0))
    integers = np.rint(blocks * inverse.astype(np.float32))
    assert np.abs(integers).max() <= 127
    per_value = np.broadcast_to(scale, blocks.shape).reshape(x32.shape).astype(np.float64)
    return (integers.astype(np.float64) * scale.astype(np.float64)).reshape(x32.shape), per_value


def int8_product(x, w, scales, biases, group_size, bits) -> np.ndarray:
    return np.array(K.quantized_matvec(x, w, scales, biases, group_size=group_size, bits=bits,
                                       int8_activations=True).astype(mx.float32)).astype(np.float64)


def assert_float32_close(result: np.ndarray, reference: np.ndarray, magnitude: np.ndarray, k: int) -> None:
    bound = 4 * k * 2.0**-24 * magnitude + 1e-30
    excess = np.abs(result - reference) / bound
    assert excess.max() <= 1.0, f"off by {excess.max():.1f}x the float32 bound"


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("scale_dtype", SCALES)
def test_the_products_are_the_rounded_x_times_the_weights(bits, group_size, m, scale_dtype):
    """Integer dot products lose nothing: the result is the float64 product of the rounded x
    with the dequantized weights, within float32 accumulation (odd output counts; 6 positions:
    a chunk of 4 and one of 2)."""
    n, k = 37, 4 * 128
    w, scales, biases = quantized(n, k, group_size, bits, SCALES[scale_dtype])
    x = mx.random.normal((m, k))
    weights = dequantized64(w, scales, biases, group_size, bits)
    x_rounded, _ = rounded_x(x)
    assert_float32_close(int8_product(x, w, scales, biases, group_size, bits), x_rounded @ weights.T,
                         np.abs(x_rounded) @ np.abs(weights).T, k)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_the_error_is_within_what_rounding_x_allows_and_the_float_route_is_closer(bits, group_size):
    """Against the float64 product of the true x: each value of x moves by at most half its
    block's scale, so |error| <= sum_i |w_i| * scale_i / 2 (plus float32 accumulation). The
    plain float route (no rounding of x) is far closer."""
    m, n, k = 3, 101, 2 * 128
    w, scales, biases = quantized(n, k, group_size, bits)
    x = mx.random.normal((m, k)) * mx.exp(mx.random.normal((m, k)))  # magnitudes spread as activations' are
    weights = dequantized64(w, scales, biases, group_size, bits)
    exact = np.array(x).astype(np.float64) @ weights.T
    _, block_scales = rounded_x(x)
    bound = (block_scales / 2) @ np.abs(weights).T + 4 * k * 2.0**-24 * (np.abs(np.array(x)) @ np.abs(weights).T)
    int8_error = np.abs(int8_product(x, w, scales, biases, group_size, bits) - exact)
    assert (int8_error <= bound).all(), f"{(int8_error / bound).max():.2f}x the rounding bound"
    float_route = np.array(K.quantized_matvec(x, w, scales, biases, group_size=group_size, bits=bits))
    float_error = np.abs(float_route.astype(np.float64) - exact)
    assert float_error.mean() < int8_error.mean() / 20


def test_positions_are_each_computed_as_alone():
    """A batch of positions gives each the bits it gets alone (chunks of 4 and the rest)."""
    w, scales, biases = quantized(45, 256, 64, 4)
    x = mx.random.normal((7, 256))
    together = int8_product(x, w, scales, biases, 64, 4)
    for i in range(7):
        assert np.array_equal(together[i], int8_product(x[i:i + 1], w, scales, biases, 64, 4)[0])


def test_a_nan_in_x_gives_nan_and_zeros_give_zeros():
    w, scales, biases = quantized(9, 128, 32, 8)
    x = mx.zeros((2, 128))
    x = mx.where(mx.arange(128)[None] == 40, mx.array([[0.0], [float("nan")]]), x)  # row 1: one NaN
    y = int8_product(x, w, scales, biases, 32, 8)
    assert np.array_equal(y[0], np.zeros(9)) and np.isnan(y[1]).all()


def test_leading_axes_and_half_inputs():
    w, scales, biases = quantized(33, 128, 64, 4, mx.float16)
    x = mx.random.normal((2, 1, 128)).astype(mx.float16)
    y = K.quantized_matvec(x, w, scales, biases, group_size=64, bits=4, int8_activations=True)
    assert y.shape == (2, 1, 33) and y.dtype == mx.float16
    flat = int8_product(x.reshape(2, 128), w, scales, biases, 64, 4)
    assert np.allclose(np.array(y.astype(mx.float32)).reshape(2, 33), flat, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("bits", [4, 8])
def test_fused_products_take_int8_activations_as_each_product(bits):
    """q/k/v in one call give each product's int8 result bit for bit; gated gives silu(gate) * up."""
    x = mx.random.normal((3, 128))
    layers = [quantized(n, 128, 64, bits) for n in (64, 32, 32)]
    fused = K.fused_products(x, [a for layer in layers for a in layer], group_size=64, bits=bits,
                             int8_activations=True)
    for out, layer in zip(fused, layers):
        assert np.array_equal(np.array(out).astype(np.float64), int8_product(x, *layer, 64, bits))
    gate, up = layers[1], layers[2]
    gated = K.fused_products(x, [*gate, *up], group_size=64, bits=bits, gated=True, int8_activations=True)[0]
    g, u = int8_product(x, *gate, 64, bits), int8_product(x, *up, 64, bits)
    assert np.allclose(np.array(gated), g / (1 + np.exp(-g)) * u, rtol=1e-5, atol=1e-5)


def test_a_dense_product_refuses_int8_activations():
    w, scales, biases = quantized(8, 64, 32, 4)
    with pytest.raises(ValueError, match="int8 activations are for the decoding products, not dense ones"):
        K.quantized_matvec(mx.ones((2, 64)), w, scales, biases, group_size=32, bits=4, dense=True,
                           int8_activations=True)


# -- every instruction set -----------------------------------------------------------------

ISA_RUN = """
import sys, mlx.core as mx, numpy as np
from mlx_tfm.cpu.kernels import _kernels as K
data = dict(np.load(sys.argv[1]))
outputs = {}
for bits in (4, 8):
    for group_size in (32, 64, 128):
        name = f"q{bits}g{group_size}"
        w, s, b = (mx.array(data[f"{name}_{part}"]) for part in ("w", "s", "b"))
        outputs[name] = np.array(K.quantized_matvec(mx.array(data["x"]), w, s, b, group_size=group_size, bits=bits,
                                                    int8_activations=True))
np.savez(sys.argv[2], isa=K.isa(), int8_isa=K.int8_isa(), **outputs)
"""
INT8_SETS = {"avx2": "avx2", "generic": "generic"}  # avx512: avx512vnni where the CPU has it, else avx2's


@pytest.mark.parametrize("isa", K.runnable_isas())
def test_every_instruction_set_gives_the_rounded_arithmetic(isa, tmp_path):
    x = mx.random.normal((5, 256))
    data = {"x": np.array(x)}
    for bits in (4, 8):
        for group_size in (32, 64, 128):
            for part, array in zip("wsb", quantized(19, 256, group_size, bits, mx.bfloat16 if bits == 8 else mx.float32)):
                data[f"q{bits}g{group_size}_{part}"] = np.array(array.astype(mx.float32) if part != "w" else array)
    np.savez(tmp_path / "in.npz", **data)
    env = {**os.environ, "MLX_TFM_KERNELS_ISA": isa, "MLX_TFM_KERNELS_THREADS": "2"}
    done = subprocess.run([sys.executable, "-c", ISA_RUN, str(tmp_path / "in.npz"), str(tmp_path / "out.npz")],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    out = np.load(tmp_path / "out.npz")
    assert str(out["isa"]) == isa
    assert str(out["int8_isa"]) == INT8_SETS.get(isa) or (isa == "avx512" and str(out["int8_isa"]) in ("avx512vnni", "avx2"))
    x_rounded, _ = rounded_x(x)
    for bits in (4, 8):
        for group_size in (32, 64, 128):
            name = f"q{bits}g{group_size}"
            w, s, b = (mx.array(data[f"{name}_{part}"]) for part in "wsb")
            weights = dequantized64(w, s, b, group_size, bits)
            assert_float32_close(out[name].astype(np.float64), x_rounded @ weights.T,
                                 np.abs(x_rounded) @ np.abs(weights).T, 256)


# -- the switch (with the kernels off, MLX_TFM_KERNELS=0 as CI runs tests/cpu again: no effect) --


@pytest.mark.parametrize("bits", [4, 8])
def test_the_switch_off_leaves_the_route_bit_for_bit_and_on_takes_int8(bits):
    reference = nn.QuantizedLinear.from_linear(nn.Linear(128, 75, bias=False), group_size=64, bits=bits)
    layer = QuantizedLinear.from_quantized(reference)
    x = mx.random.normal((1, 2, 128))
    arrays = (layer["weight"], layer["scales"], layer["biases"])
    with int8_activations_set(False):
        off = layer(x)
    with int8_activations_set(True):
        on = layer(x)
    if kernels() is None:  # MLX's route: the switch is not its to take
        assert mx.array_equal(on, off)
        return
    today = K.quantized_matvec(x, *arrays, group_size=64, bits=bits)
    assert mx.array_equal(off, today)
    assert mx.array_equal(on, K.quantized_matvec(x, *arrays, group_size=64, bits=bits, int8_activations=True))
    assert not mx.array_equal(on, today)
    assert np.allclose(np.array(on), np.array(reference(x)), atol=0.2)


def test_the_switch_reaches_the_fused_projections(monkeypatch):
    """q/k/v and gate/up of a layer go through fused_products: they take the switch too."""
    layers = tuple(QuantizedLinear.from_quantized(nn.QuantizedLinear.from_linear(nn.Linear(128, n, bias=False),
                                                                                 group_size=64, bits=4))
                   for n in (64, 32))
    x = mx.random.normal((1, 1, 128))
    with int8_activations_set(True):
        fused = cpu_linear.fused_products(layers, x)
        alone = [layer(x) for layer in layers]
    with int8_activations_set(False):
        plain = cpu_linear.fused_products(layers, x)
    if kernels() is None:  # no fused route without the kernels
        assert fused is None and plain is None
        return
    assert all(mx.array_equal(a, b) for a, b in zip(fused, alone))
    assert not all(mx.array_equal(a, b) for a, b in zip(fused, plain))


def run_generate(model, *flags: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mlx_tfm", "generate", "--model", str(model), "-p", "Once",
                           "-m", "12", *flags], capture_output=True, text=True, env={**os.environ, **(env or {})},
                          timeout=300)


def test_a_bad_environment_value_is_one_line(stories_hf):
    done = run_generate(stories_hf, env={"MLX_TFM_INT8_ACTIVATIONS": "yes"})
    assert done.returncode == 1
    assert done.stderr == ("error: MLX_TFM_INT8_ACTIVATIONS=yes: use 1 (int8 activations in quantized decoding) "
                           "or 0 (off)\n")


@pytest.fixture(scope="module")
def stories_8bit(stories_hf, tmp_path_factory):
    """stories260K quantized to 8 bits, group 32 (down_proj's 172 inputs stay float)."""
    from mlx.utils import tree_flatten

    from mlx_tfm import load

    model, _ = load(stories_hf)
    nn.quantize(model, group_size=32, bits=8,
                class_predicate=lambda _, m: isinstance(m, (nn.Linear, nn.Embedding)) and m.weight.shape[-1] % 32 == 0)
    folder = tmp_path_factory.mktemp("q8")
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    config = json.loads((stories_hf / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization": {"group_size": 32, "bits": 8}}))
    (folder / "tokenizer.model").write_bytes((stories_hf / "tokenizer.model").read_bytes())
    return folder


def test_generate_with_the_flag_or_the_variable_keeps_the_greedy_text(stories_8bit):
    """8-bit weights, x rounded to 8 bits: the tiny model's greedy text stays its own."""
    plain = run_generate(stories_8bit)
    assert plain.returncode == 0, plain.stderr
    for done in (run_generate(stories_8bit, "--int8-activations"),
                 run_generate(stories_8bit, env={"MLX_TFM_INT8_ACTIVATIONS": "1"})):
        assert done.returncode == 0, done.stderr
        assert done.stdout == plain.stdout


def test_a_decoding_step_takes_the_switch_compiled_or_not(stories_8bit):
    """The compiled decoder keeps one trace per state of the switch: compiled == plain call
    under each state, and the two states differ (slightly)."""
    from mlx_tfm import load
    from mlx_tfm.model.compiled import CompiledDecoder

    model, _ = load(stories_8bit)
    decoder = CompiledDecoder(model)
    prompt, token = mx.array([[1, 403, 271, 29]]), mx.array([[365]])
    steps = {}
    for on in (False, True, False):
        with int8_activations_set(on):
            plain_cache, compiled_cache = model.make_cache(), model.make_cache()
            model(prompt, cache=plain_cache)
            model(prompt, cache=compiled_cache)
            plain, compiled = model(token, cache=plain_cache), decoder(token, compiled_cache)
        assert np.allclose(np.array(plain), np.array(compiled), atol=1e-4)
        steps.setdefault(on, compiled)
    off, on = np.array(steps[False]), np.array(steps[True])
    if kernels() is None:
        assert np.array_equal(off, on)
        return
    assert not np.array_equal(off, on)
    assert off.argmax() == on.argmax() and np.abs(off - on).max() < 0.02 * (off.max() - off.min())


@pytest.mark.parametrize("command", ["generate", "chat", "server"])
def test_each_decoding_command_takes_the_flag_and_sets_the_switch(command):
    from mlx_tfm.cli import _available_subcommands, build_parser
    from mlx_tfm.cli.decoding_flags import set_process_switches
    from mlx_tfm.cpu.switch import int8_activations

    _, subparsers = build_parser(_available_subcommands())
    with int8_activations_set(False):
        set_process_switches(subparsers[command].parse_args([]))
        assert not int8_activations()
        set_process_switches(subparsers[command].parse_args(["--int8-activations"]))
        assert int8_activations()
