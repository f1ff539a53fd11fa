"""Llama 4 (mlx_tfm/families/llama4.py, mlx_tfm/model/local_attention.py) beyond the plain
parity of test_convert_architectures.py: the chunk mask and the temperature against their
formulas, the top-k sigmoid router, cached and chunked decoding against the full forward,
mlx-lm reading a converted image-text folder of the form its llama4 file takes, and the
errors a user can meet."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_map
from fixtures.convert_helpers import LLAMA4_TEXT, TINY_CONFIGS, greedy, hf_greedy, hf_logits

from mlx_tfm.convert.converter import convert
from mlx_tfm.errors import UserError
from mlx_tfm.families import model_args_from_config
from mlx_tfm.loading import load_model
from mlx_tfm.model.config import ModelArgs
from mlx_tfm.model.experts import route
from mlx_tfm.model.local_attention import chunk_mask, chunked_mask, temperature_scales
from mlx_tfm.model.transformer import Model

PROMPT = [5, 17, 200, 33, 9, 101, 64, 250, 3, 77, 18, 140, 42, 11]
QUIET = dict(log=lambda *_: None)


def our_logits(model, ids) -> np.ndarray:
    return np.array(model(mx.array([ids]))[0].astype(mx.float32))


def test_chunk_mask_is_causal_within_each_chunk():
    queries, keys = mx.arange(7, 13), mx.arange(13)
    expected = [[k <= q and k // 5 == q // 5 for k in range(13)] for q in range(7, 13)]
    assert np.array(chunk_mask(queries, keys, 5)).tolist() == expected


def test_chunked_mask_is_plain_causal_inside_the_first_chunk():
    assert chunked_mask(0, 5, 5) == "causal"
    assert chunked_mask(4, 1, 5) is None
    row = np.array(chunked_mask(11, 1, 5))  # position 11 sees 10 and 11 only
    assert row.tolist() == [[k in (10, 11) for k in range(12)]]


def test_temperature_scales_follow_the_formula():
    got = np.array(temperature_scales(6, 4, 4.0, 0.5)).reshape(-1)
    expected = [math.log(math.floor((p + 1) / 4) + 1) * 0.5 + 1 for p in range(6, 10)]
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    per_row = temperature_scales(mx.array([0, 6]), 4, 4.0, 0.5)  # a batched cache: one offset per row
    assert per_row.shape == (2, 1, 4, 1)
    np.testing.assert_allclose(np.array(per_row[1]).reshape(-1), expected, rtol=1e-6)


def test_topk_sigmoid_router_weights_are_the_chosen_logits_sigmoid():
    args = ModelArgs.from_dict(dict(num_experts=4, num_experts_per_tok=2, router_scoring="topk_sigmoid"))
    logits = mx.array([[0.5, -1.0, 2.0, 1.5]])
    indices, weights = route(logits, args)
    assert indices.tolist() == [[2, 3]]
    np.testing.assert_allclose(np.array(weights), [[1 / (1 + math.exp(-2.0)), 1 / (1 + math.exp(-1.5))]], rtol=1e-6)


def tiny_llama4() -> Model:
    args = model_args_from_config({**LLAMA4_TEXT, "model_type": "llama4_text"})
    assert args.layer_types == ("chunked_attention", "chunked_attention", "full_attention", "chunked_attention")
    assert args.rope_layers == (True, True, False, True) and args.mlp_only_layers == (0, 2)
    mx.random.seed(0)
    model = Model(args)
    model.update(tree_map(lambda p: mx.random.normal(p.shape) * 0.3, model.parameters()))
    return model


@pytest.mark.parametrize("pieces", [[14], [3] + [1] * 11, [7, 7], [4, 6, 4]], ids=["one", "steps", "halves", "odd"])
def test_cached_decode_equals_the_full_forward(pieces):
    """The chunk masks over a growing cache and the temperature at the cache's offset give
    the full forward's logits, however the prompt is fed."""
    model = tiny_llama4()
    full = our_logits(model, PROMPT)
    cache, start, parts = model.make_cache(), 0, []
    for n in pieces:
        parts.append(np.array(model(mx.array([PROMPT[start : start + n]]), cache=cache)[0]))
        start += n
    np.testing.assert_allclose(np.concatenate(parts), full, atol=1e-4, rtol=0)


def test_chunked_layers_keep_every_position_even_with_max_kv_size():
    """A bounded rotating cache would hold positions its chunk mask does not count."""
    caches = tiny_llama4().make_cache(max_kv_size=8)
    assert [type(c).__name__ for c in caches] == ["KVCache", "KVCache", "RotatingKVCache", "KVCache"]


def image_text_llama4(folder, text_config: dict):
    """A random transformers Llama4ForConditionalGeneration (vision tower and projector
    included) saved to ``folder``, weights at the scale of ``make_hf_model``; returns its
    language model (transformers' image-text forward needs images)."""
    import torch
    from transformers import AutoConfig, Llama4ForConditionalGeneration

    keys = {k: v for k, v in TINY_CONFIGS["llama4"].items() if k != "text_config"}
    torch.manual_seed(0)
    model = Llama4ForConditionalGeneration(AutoConfig.for_model("llama4", text_config=text_config, **keys)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.15) if p.ndim == 2 else p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder)
    return model.language_model


@pytest.mark.parametrize("experts_per_token", [2, 1])
def test_image_text_checkpoint_converts_to_its_language_model(experts_per_token, tmp_path):
    """A real image-text checkpoint (``language_model.*``, ``vision_model.*``,
    ``multi_modal_projector.*``): the vision side is dropped, the text model matches."""
    hf = image_text_llama4(tmp_path / "hf", dict(LLAMA4_TEXT, num_experts_per_tok=experts_per_token))
    convert(tmp_path / "hf", tmp_path / "mlx", **QUIET)
    model, _ = load_model(tmp_path / "mlx")
    np.testing.assert_allclose(our_logits(model, PROMPT), hf_logits(hf, PROMPT), atol=1e-4, rtol=0)
    assert greedy(model, PROMPT, 12) == hf_greedy(hf, PROMPT, 12)


def test_llama4_image_text_folder_loads_in_mlx_lm(tmp_path):
    """mlx-lm's llama4 takes one expert per token and no RoPE on every 4th layer: in that
    form it reads our converted folder (experts split, vision tensors dropped) and computes
    our logits over the whole prompt, chunks included."""
    from mlx_lm.utils import load_model as mlx_lm_load_model

    hf = image_text_llama4(tmp_path / "hf", dict(LLAMA4_TEXT, num_experts_per_tok=1, no_rope_layer_interval=4))
    convert(tmp_path / "hf", tmp_path / "mlx", **QUIET)
    ours, _ = load_model(tmp_path / "mlx")
    theirs, _ = mlx_lm_load_model(tmp_path / "mlx")
    np.testing.assert_allclose(our_logits(ours, PROMPT), hf_logits(hf, PROMPT), atol=1e-4, rtol=0)
    np.testing.assert_allclose(our_logits(ours, PROMPT), our_logits(theirs, PROMPT), atol=1e-4, rtol=0)


def test_chunked_layers_without_a_chunk_size_are_refused():
    args = ModelArgs.from_dict(dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=16,
                                    layer_types=["chunked_attention"]))
    with pytest.raises(ValueError, match="chunked_attention layers need attention_chunk_size"):
        Model(args)


def test_batched_caches_are_refused_on_chunked_layers():
    with pytest.raises(UserError, match="chunked attention .* batched caches"):
        chunked_mask(mx.array([3, 5]), 1, 4)
