"""The MLA families (mlx_tfm/families/latent.py) beyond the parity cases of
tests/convert/test_convert_architectures.py: variants of their configs against
transformers, the on-disk layout mlx-lm keeps for each, and configs we refuse."""

import json

import mlx.core as mx
import numpy as np
import pytest
from fixtures.convert_helpers import TINY_CONFIGS, greedy, hf_greedy, hf_logits, make_hf_model

from mlx_tfm.convert.converter import convert
from mlx_tfm.errors import UserError
from mlx_tfm.families import model_args_from_config
from mlx_tfm.loading import load_model

PROMPT = [5, 17, 200, 33, 9, 101, 64, 250, 3, 77, 18]
QUIET = dict(log=lambda *_: None)


def our_logits(model, ids) -> np.ndarray:
    return np.array(model(mx.array([ids]))[0].astype(mx.float32))


VARIANTS = {
    # transformers' rope_interleave=False rotates the halves of the rotary dims
    "halves": ("deepseek_v3", dict(rope_interleave=False)),
    # q_a_layernorm and kv_a_layernorm keep 1e-6 whatever rms_norm_eps says
    "norm_eps": ("deepseek_v3", dict(rms_norm_eps=0.5)),
    # every group eligible: group_limited_greedy chooses as greedy does
    "v2_groups": ("deepseek_v2", dict(topk_method="group_limited_greedy", n_group=2, topk_group=2)),
    # the experts in the first layer only
    "glm_layer_types": ("glm4_moe_lite", dict(mlp_layer_types=["sparse", "dense"])),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variants_match_transformers(variant, tmp_path):
    name, overrides = VARIANTS[variant]
    hf = make_hf_model(name, tmp_path / "hf", **overrides)
    convert(tmp_path / "hf", tmp_path / "mlx", **QUIET)
    model, _ = load_model(tmp_path / "mlx")
    np.testing.assert_allclose(our_logits(model, PROMPT), hf_logits(hf, PROMPT), atol=1e-4, rtol=0)
    assert greedy(model, PROMPT, 8) == hf_greedy(hf, PROMPT, 8)


def test_glm_layer_types_choose_the_expert_layers():
    config = {**TINY_CONFIGS["glm4_moe_lite"], "model_type": "glm4_moe_lite", "mlp_layer_types": ["sparse", "dense"]}
    args = model_args_from_config(config)
    assert [args.has_experts(i) for i in range(2)] == [True, False]


@pytest.mark.parametrize("name, per_head", [("deepseek_v3", True), ("glm4_moe_lite", True), ("deepseek_v2", False)])
def test_on_disk_layout_is_mlx_lms(name, per_head, tmp_path):
    """mlx-lm stores deepseek_v3's and glm4_moe_lite's kv_b_proj per head (embed_q,
    unembed_out) and keeps deepseek_v2's whole; the 4-bit folders quantize it as it is."""
    make_hf_model(name, tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "q4", quantize=True, q_group_size=32, **QUIET)
    weights = mx.load(str(tmp_path / "q4" / "model.safetensors"))
    attn = "model.layers.0.self_attn"
    present = {part for part in ("embed_q", "unembed_out", "kv_b_proj") if f"{attn}.{part}.weight" in weights}
    assert present == ({"embed_q", "unembed_out"} if per_head else {"kv_b_proj"})
    assert all(weights[f"{attn}.{part}.weight"].dtype == mx.uint32 for part in present)
    assert "model.layers.1.mlp.switch_mlp.gate_proj.weight" in weights
    assert json.loads((tmp_path / "q4" / "config.json").read_text())["quantization"]["bits"] == 4


def test_quantized_whole_kv_b_loads_dequantized(tmp_path):
    """A 4-bit deepseek_v2 folder: its kv_b_proj is dequantized once on loading, so our
    logits equal those of the same folder with kv_b_proj dequantized on disk."""
    make_hf_model("deepseek_v2", tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "q4", quantize=True, q_group_size=32, **QUIET)
    ours, _ = load_model(tmp_path / "q4")
    assert ours.layers[0].self_attn.embed_q.weight.dtype == mx.float32
    weights = mx.load(str(tmp_path / "q4" / "model.safetensors"))
    attn = "model.layers.0.self_attn.kv_b_proj"
    kv_b = mx.dequantize(weights[f"{attn}.weight"], weights[f"{attn}.scales"], weights[f"{attn}.biases"],
                         group_size=32, bits=4)
    embed_q = kv_b.reshape(4, 64, 32)[:, :32].swapaxes(-1, -2)  # (H, R, nope) from (H * (nope + v), R)
    np.testing.assert_array_equal(ours.layers[0].self_attn.embed_q.weight, embed_q)


REFUSED = [
    ("deepseek_v3", dict(moe_layer_freq=2), "moe_layer_freq 2 is not supported"),
    ("deepseek_v3", dict(topk_method="greedy"), "deepseek_v3 with topk_method 'greedy' is not supported"),
    ("deepseek_v2", dict(topk_method="group_limited_greedy", n_group=4, topk_group=2),
     "deepseek_v2 with topk_method 'group_limited_greedy' (topk_group 2 of n_group 4) is not supported"),
]


@pytest.mark.parametrize("name, overrides, message", REFUSED)
def test_unsupported_routing_is_refused_in_one_line(name, overrides, message):
    config = {**TINY_CONFIGS[name], "model_type": name, **overrides}
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")) as error:
        model_args_from_config(config)
    assert "\n" not in str(error.value)


def test_bfloat16_folder_caches_bfloat16_latents(tmp_path):
    """The latents are cached in the model's dtype (half the bytes of float32), and the
    bfloat16 model's logits stay near the float32 model's."""
    make_hf_model("deepseek_v3", tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "f32", **QUIET)
    convert(tmp_path / "hf", tmp_path / "bf16", dtype="bfloat16", **QUIET)
    (half, _), (full, _) = load_model(tmp_path / "bf16"), load_model(tmp_path / "f32")
    cache = half.make_cache()
    logits = half(mx.array([PROMPT]), cache=cache)
    assert cache[0].state[0].dtype == mx.bfloat16 and cache[0].state[1].dtype == mx.bfloat16
    reference = our_logits(full, PROMPT)
    assert np.abs(np.array(logits[0].astype(mx.float32)) - reference).max() < 0.05 * np.abs(reference).max()
