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
from mlx.utils import tree_flatten, tree_map
from fixtures.convert_helpers import LLAMA4_TEXT, TINY_CONFIGS, greedy, hf_greedy, hf_logits, make_hf_model

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


def tiny_llama4(**overrides) -> Model:
    args = model_args_from_config({**LLAMA4_TEXT, "model_type": "llama4_text", **overrides})
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


def test_generation_over_an_8_bit_kv_cache_stays_close():
    """generate_step over QuantizedKVCache layers (chunk masks over packed keys) with a
    prefill in pieces of 3 that cross the chunk starts: near the float tokens' logprobs."""
    from mlx_tfm.generation.step import generate_step
    from mlx_tfm.model.cache import KVQuantization, QuantizedKVCache, quantized_layers

    model = tiny_llama4(head_dim=32)  # a KV group of 32 numbers
    prompt = mx.array(PROMPT)
    floats = list(generate_step(prompt, model, max_tokens=6, prefill_step_size=3))
    cache = quantized_layers(model.make_cache(), KVQuantization(bits=8))
    assert all(isinstance(c, QuantizedKVCache) for c in cache)
    quantized = list(generate_step(prompt, model, max_tokens=6, prefill_step_size=3, prompt_cache=cache))
    assert [t for t, _ in quantized] == [t for t, _ in floats]
    for (_, a), (_, b) in zip(floats, quantized):
        assert float(mx.abs(a - b).max()) < 0.2  # a wrong mask moves them by more than 1


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


@pytest.mark.parametrize("quantize", [False, True], ids=["float", "4bit"])
def test_llama4_image_text_folder_loads_in_mlx_lm(quantize, tmp_path):
    """mlx-lm's llama4 takes one expert per token and no RoPE on every 4th layer: in that
    form it reads our converted folder (experts split, vision tensors dropped; quantized,
    the routers at 8 bits) and computes our logits over the whole prompt, chunks included."""
    from mlx_lm.utils import load_model as mlx_lm_load_model

    hf = image_text_llama4(tmp_path / "hf", dict(LLAMA4_TEXT, num_experts_per_tok=1, no_rope_layer_interval=4))
    convert(tmp_path / "hf", tmp_path / "mlx", quantize=quantize, q_group_size=32, **QUIET)
    ours, config = load_model(tmp_path / "mlx")
    theirs, _ = mlx_lm_load_model(tmp_path / "mlx")
    if quantize:
        assert config["quantization"]["language_model.model.layers.1.feed_forward.router"]["bits"] == 8
    else:
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


# -- Cohere 2, GLM-4, GPT-NeoX, Apertus: what the plain parity cases do not show -------------


def transformers_config_dict(model_type: str, keys: dict) -> dict:
    """What transformers 5 makes of ``keys`` (it rewrites 4's layout into its own)."""
    from transformers import AutoConfig

    return {**AutoConfig.for_model(model_type, **keys).to_dict(), "model_type": model_type}


def test_pythia_hub_config_reads_as_transformers_5_writes_it():
    """Pythia's hub configs say ``rotary_pct`` and ``rotary_emb_base`` (transformers 4)."""
    hub = dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, vocab_size=256,
               rotary_pct=0.25, rotary_emb_base=500.0, use_parallel_residual=True, hidden_act="gelu")
    ours = model_args_from_config({**hub, "model_type": "gpt_neox"})
    assert ours == model_args_from_config(transformers_config_dict("gpt_neox", hub))
    assert (ours.partial_rotary_factor, ours.rope_theta, ours.norm_placement) == (0.25, 500.0, "parallel_two_norms")
    assert ours.num_key_value_heads == 4 and not ours.rope_traditional


def test_command_r7b_hub_config_says_the_window_pattern():
    """CohereLabs/c4ai-command-r7b's config: ``sliding_window_pattern`` 4, no layer_types."""
    hub = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=256, max_position_embeddings=128, sliding_window=6,
               sliding_window_pattern=4)
    ours = model_args_from_config({**hub, "model_type": "cohere2"})
    assert ours == model_args_from_config(transformers_config_dict("cohere2", hub))
    assert ours.rope_layers == (True, True, True, False) * 2 and ours.layer_types[3] == "full_attention"


def test_glm4_rotates_half_of_each_head_by_default():
    ours = model_args_from_config(dict(model_type="glm4", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                       head_dim=16, vocab_size=256))
    assert (ours.partial_rotary_factor, ours.rope_traditional, ours.norm_placement) == (0.5, True, "sandwich")


def test_xielu_follows_its_formula():
    from mlx_tfm.model.xielu import XIELU

    act = XIELU()
    act.alpha_p, act.alpha_n = mx.array([0.3]), mx.array([-0.7])
    x = np.linspace(-4, 4, 41, dtype=np.float32)
    softplus = lambda v: math.log1p(math.exp(v))  # noqa: E731
    alpha_p, alpha_n = softplus(0.3), 0.5 + softplus(-0.7)
    expected = np.where(x > 0, alpha_p * x * x + 0.5 * x, (np.expm1(np.minimum(x, -1e-6)) - x) * alpha_n + 0.5 * x)
    np.testing.assert_allclose(np.array(act(mx.array(x))), expected, atol=1e-6)
    assert set(dict(tree_flatten(act.trainable_parameters()))) == {"alpha_p", "alpha_n"}


def test_apertus_folder_with_scalar_alphas_loads(tmp_path):
    """mlx-lm's apertus stores alpha_p and alpha_n as scalars: such a folder loads the same."""
    hf = make_hf_model("apertus", tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "mlx", **QUIET)
    weights = mx.load(str(tmp_path / "mlx" / "model.safetensors"))
    scalars = {k: v.squeeze() if k.endswith(("alpha_p", "alpha_n")) else v for k, v in weights.items()}
    assert scalars["model.layers.0.mlp.act_fn.alpha_p"].shape == ()
    mx.save_safetensors(str(tmp_path / "mlx" / "model.safetensors"), scalars)
    model, _ = load_model(tmp_path / "mlx")
    np.testing.assert_allclose(our_logits(model, PROMPT), hf_logits(hf, PROMPT), atol=1e-4, rtol=0)


def test_xielu_in_a_gated_mlp_is_refused():
    args = ModelArgs.from_dict(dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=16,
                                    hidden_act="xielu", ffn_gated=True))
    with pytest.raises(ValueError, match="hidden_act 'xielu' is only defined for the ungated MLP"):
        Model(args)


# -- GGUF: GLM-4 as llama.cpp's converter writes it ------------------------------------------


def byte_level_bpe_writer():
    """A byte-level BPE trained here, written as llama.cpp writes a "gpt2" vocabulary."""
    import json

    from conftest import data_path
    from fixtures.convert_helpers import train_byte_level_bpe

    lines = data_path("tinyshakespeare", "input.txt").read_text().splitlines()[:2000]
    tokenizer = train_byte_level_bpe(lines, vocab_size=300)
    model_json = json.loads(tokenizer.to_str())["model"]
    tokens = sorted(model_json["vocab"], key=model_json["vocab"].get)
    merges = [" ".join(m) if isinstance(m, list) else m for m in model_json["merges"]]
    eot = tokenizer.token_to_id("<|endoftext|>")

    def add_tokenizer(writer):
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("gpt2")  # GLM-4's own "glm4" pre-tokenizer is not read yet
        writer.add_token_list(tokens)
        writer.add_token_types([3 if i == eot else 1 for i in range(len(tokens))])
        writer.add_token_merges(merges)
        writer.add_bos_token_id(eot)
        writer.add_eos_token_id(eot)

    return add_tokenizer, len(tokens), eot


@pytest.mark.parametrize("matrix_type", ["F32", "Q8_0"])
def test_glm4_gguf_matches_transformers(matrix_type, tmp_path):
    """Fused ffn_up (gate then up), GLM-4's four norms by llama.cpp's names, the rotated
    dims from rope.dimension_count; Q8_0 blocks carried over exactly stay close."""
    from fixtures.convert_helpers import write_llama_cpp_gguf

    add_tokenizer, vocab_size, eot = byte_level_bpe_writer()
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}  # not the default half
    hf = make_hf_model("glm4", tmp_path / "hf", vocab_size=vocab_size, bos_token_id=eot, eos_token_id=eot,
                       pad_token_id=eot, rope_parameters=rope)
    write_llama_cpp_gguf(tmp_path / "hf", tmp_path / "model.gguf", add_tokenizer, matrix_type)
    convert(tmp_path / "model.gguf", tmp_path / "out", **QUIET)
    model, config = load_model(tmp_path / "out")
    assert config["model_type"] == "glm4" and config["partial_rotary_factor"] == 0.25
    reference = hf_logits(hf, PROMPT)
    if matrix_type == "F32":
        np.testing.assert_allclose(our_logits(model, PROMPT), reference, atol=1e-4, rtol=0)
        assert greedy(model, PROMPT, 8) == hf_greedy(hf, PROMPT, 8)
    else:
        assert config["quantization"]["bits"] == 8
        assert np.abs(our_logits(model, PROMPT) - reference).max() < 0.05 * np.abs(reference).max()
