"""mlx-tfm inspect on a model with recurrent layers: parameters and cache bytes per layer
kind, the KV cache counting only the attention layers."""

from __future__ import annotations

import mlx.core as mx
from fixtures.recurrent_models import LFM2_LIKE, tiny_lfm2

from mlx_tfm.inspect.architecture import kv_cache_bytes
from mlx_tfm.inspect.layer_kinds import layer_kinds
from mlx_tfm.inspect.parts import model_parts
from mlx_tfm.inspect.text import layer_kind_lines


def test_layer_kinds_count_parameters_and_cache_bytes():
    model = tiny_lfm2()  # conv, attention, conv; D 32, 2 KV heads of 8, K 3
    D, K = LFM2_LIKE["hidden_size"], LFM2_LIKE["conv_L_cache"]
    rows = {row["kind"]: row for row in layer_kinds(model, model_parts(model), context=100)}
    conv, attention = rows["conv"], rows["full_attention"]
    assert conv["layers"] == 2 and attention["layers"] == 1 and conv["recurrent"]
    assert conv["mixer_parameters"] == 2 * (3 * D * D + D * K + D * D)  # in_proj, the taps, out_proj
    assert attention["mixer_parameters"] == D * D + 2 * (D * 16) + D * D + 2 * 8  # q, k, v, o, q/k norms
    assert conv["cache_bytes_per_layer"] == (K - 1) * D * 4  # the last K - 1 inputs, float32
    assert attention["cache_bytes_per_layer"] == 100 * 2 * 2 * 8 * 2  # positions, k and v, heads, head_dim, fp16
    ffn_and_norms = 3 * D * 64 + 2 * D
    assert conv["block_parameters"] == conv["mixer_parameters"] + 2 * ffn_and_norms
    lines = layer_kind_lines({"layer_kinds": list(rows.values()), "kv_cache": {"context": 100}})
    assert any(line.startswith("conv") and "fixed state" in line for line in lines)


def test_the_measured_state_is_what_generation_keeps():
    model = tiny_lfm2()
    cache = model.make_cache()
    model(mx.array([[1, 2, 3, 4, 5]]), cache=cache)
    rows = {row["kind"]: row for row in layer_kinds(model, model_parts(model), context=5)}
    assert cache[0].nbytes == cache[2].nbytes == rows["conv"]["cache_bytes_per_layer"]


def test_kv_bytes_count_only_attention_layers():
    model = tiny_lfm2()
    per_position = 2 * 2 * 8 * 2  # k and v, 2 KV heads, head_dim 8, float16
    assert kv_cache_bytes(model.args, 10) == {"per_token": per_position, "at_context": 10 * per_position}
