"""Kimi Linear (mlx_tfm/families/kimi.py) on a prompt longer than a chunk of the delta
rule: 150 positions (three chunks of 64) against transformers computed in float64, greedy
tokens equal, and the folders we write converting again unchanged."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from fixtures.convert_helpers import greedy, hf_greedy, make_hf_model

from mlx_tfm.convert.converter import convert
from mlx_tfm.loading import load_model

LONG_PROMPT = [int(t) for t in np.random.default_rng(7).integers(3, 256, size=150)]
QUIET = dict(log=lambda *_: None)


def logits_of(model, ids) -> np.ndarray:
    return np.array(model(mx.array([ids]))[0].astype(mx.float32))


def float64_logits(hf, ids) -> np.ndarray:
    """transformers' logits in float64: the reference a float32 run of the chunked rule is
    held to over 150 positions."""
    import torch

    hf.set_experts_implementation("eager")  # the grouped products have no float64
    with torch.no_grad():
        return hf.double()(torch.tensor([ids])).logits[0].numpy()


def test_long_prompt_matches_transformers(tmp_path):
    hf = make_hf_model("kimi_linear", tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "mlx", **QUIET)
    model, _ = load_model(tmp_path / "mlx")
    assert model.args.linear_chunk_size < len(LONG_PROMPT)
    expected_greedy = hf_greedy(hf, LONG_PROMPT, 6)
    np.testing.assert_allclose(logits_of(model, LONG_PROMPT), float64_logits(hf, LONG_PROMPT), atol=1e-4, rtol=0)
    assert greedy(model, LONG_PROMPT, 6) == expected_greedy


def test_our_folders_convert_again_unchanged(tmp_path):
    make_hf_model("kimi_linear", tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "mlx", **QUIET)
    convert(tmp_path / "mlx", tmp_path / "again", **QUIET)
    first, _ = load_model(tmp_path / "mlx")
    second, _ = load_model(tmp_path / "again")
    np.testing.assert_array_equal(logits_of(second, LONG_PROMPT[:20]), logits_of(first, LONG_PROMPT[:20]))


def test_folders_in_the_earlier_names_still_load_the_same(tmp_path):
    """Folders written before the on-disk names became mlx-lm's (``block_sparse_moe.*``, the
    convolutions as ``q_conv1d`` laid out (C, K, 1), ``kv_b_proj`` whole) load to the same
    model."""
    import json
    import re
    import shutil

    make_hf_model("kimi_linear", tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "mlx", **QUIET)
    config = json.loads((tmp_path / "mlx" / "config.json").read_text())
    assert config["linear_attn_config"]["kda_layers"] == [1, 3] and config["first_k_dense_replace"] == 1
    weights = mx.load(str(tmp_path / "mlx" / "model.safetensors"))
    assert {"model.layers.0.self_attn.q_conv.conv.weight", "model.layers.1.mlp.gate.weight",
            "model.layers.1.self_attn.embed_q.weight"} <= set(weights)
    attention = "model.layers.1.self_attn"
    keys_t, values = weights.pop(f"{attention}.embed_q.weight"), weights.pop(f"{attention}.unembed_out.weight")
    per_head = mx.concatenate([keys_t.swapaxes(-1, -2), values], axis=1)  # (H, nope + v, R)
    weights[f"{attention}.kv_b_proj.weight"] = per_head.reshape(-1, per_head.shape[-1])  # (H * (nope + v), R)
    earlier = {}
    for name, tensor in weights.items():
        name = re.sub(r"\.mlp\.e_score_correction_bias$", ".block_sparse_moe.gate.e_score_correction_bias", name)
        name = re.sub(r"\.self_attn\.([qkv])_conv\.conv\.weight$", r".self_attn.\1_conv1d.weight", name)
        earlier[name.replace(".mlp.", ".block_sparse_moe.")] = tensor
    shutil.copytree(tmp_path / "mlx", tmp_path / "earlier")
    mx.save_safetensors(str(tmp_path / "earlier" / "model.safetensors"), earlier)
    ours, _ = load_model(tmp_path / "mlx")
    again, _ = load_model(tmp_path / "earlier")
    np.testing.assert_array_equal(logits_of(again, LONG_PROMPT[:9]), logits_of(ours, LONG_PROMPT[:9]))
