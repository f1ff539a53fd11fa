"""Mixtures of experts (mlx_tfm/model/experts.py) against transformers, mlx-lm and numpy.

Every MoE family's plain parity (logits within 1e-4 of transformers', greedy through the
cache, mlx-lm reading our folders) runs with the dense families in
test_convert_architectures.py. Here: the routers on their own and where experts tie or
renormalisation matters, dense layers mixed in, transformers 5's fused expert layout,
gpt-oss (clamped SwiGLU, sinks, MXFP4 checkpoints), quantized experts, mixed-bit recipes,
mlx-community folders, LoRA on experts, and the errors a user can meet.
"""

from __future__ import annotations

import json
from contextlib import nullcontext
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from fixtures.quantization_quality import QUANT_BOUNDS, agreement_and_perplexity
from fixtures.convert_helpers import greedy, hf_logits, make_hf_model
from fixtures.float32_rounding import products_per_logit, rounding_bound

from mlx_tfm.cli import main
from mlx_tfm.convert.converter import convert
from mlx_tfm.model.experts import QuantizedSwitchLinear, SparseMoeBlock, SwitchGLU, SwitchLinear, route
from mlx_tfm.loading import load_model
from mlx_tfm.model.layers import MLP
from mlx_tfm.model.config import ModelArgs
from mlx_tfm.weights.quantization import QUANT_RECIPES

PROMPT = [5, 17, 200, 33, 9, 101, 64, 250, 3, 77, 18, 140, 42, 11]
QUIET = dict(log=lambda *_: None)


def our_logits(model, ids) -> np.ndarray:
    return np.array(model(mx.array([ids]))[0].astype(mx.float32))


def transformers_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """Greedy through transformers' own KV cache (not ``generate``, which holds back EOS)."""
    import torch

    tokens = []
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), use_cache=True)
        for _ in range(n):
            tokens.append(int(out.logits[0, -1].argmax()))
            out = hf(torch.tensor([tokens[-1:]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens


def assert_matches_transformers(hf, folder: Path, n_greedy: int = 12) -> None:
    model, _ = load_model(folder)
    np.testing.assert_allclose(our_logits(model, PROMPT), hf_logits(hf, PROMPT), atol=1e-4, rtol=0)
    assert greedy(model, PROMPT, n_greedy) == transformers_greedy(hf, PROMPT, n_greedy)


def cli_error(capsys, *argv) -> str:
    """Run ``mlx-tfm ARGV``; it must fail with one ``error: ...`` line."""
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err.strip()
    assert code == 1 and err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    return err


# -- routing -----------------------------------------------------------------------------


def numpy_route(logits: np.ndarray, k: int, scoring: str, normalize: bool, bias=None, scale=1.0, n_group=1,
                topk_group=1):
    """The routers from their formulas; ties go to the lower expert index."""
    def top_k(scores):
        return np.argsort(-scores, axis=-1, kind="stable")[..., :k]

    if scoring == "topk_softmax":
        indices = top_k(logits)
        chosen = np.take_along_axis(logits, indices, -1)
        weights = np.exp(chosen - chosen.max(-1, keepdims=True))
        return indices, weights / weights.sum(-1, keepdims=True)
    if scoring == "softmax":
        scores = np.exp(logits - logits.max(-1, keepdims=True))
        scores /= scores.sum(-1, keepdims=True)
        choice = scores
    else:
        scores = 1 / (1 + np.exp(-logits))
        choice = scores + bias
        if n_group > 1:  # a group scores its two best experts; only the best topk_group groups stay
            groups = choice.reshape(*choice.shape[:-1], n_group, -1)
            group_scores = np.sort(groups, axis=-1)[..., -2:].sum(-1)
            kept = np.argsort(-group_scores, axis=-1, kind="stable")[..., :topk_group]
            mask = np.zeros_like(group_scores, dtype=bool)
            np.put_along_axis(mask, kept, True, -1)
            choice = np.where(np.repeat(mask, groups.shape[-1], -1), choice, -np.inf)
    indices = top_k(choice)
    weights = np.take_along_axis(scores, indices, -1)
    if normalize:
        weights = weights / weights.sum(-1, keepdims=True)
    return indices, weights * scale


ROUTERS = [
    dict(router_scoring="softmax", norm_topk_prob=False),
    dict(router_scoring="softmax", norm_topk_prob=True),
    dict(router_scoring="topk_softmax"),
    dict(router_scoring="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5),
    dict(router_scoring="sigmoid", norm_topk_prob=False, n_group=4, topk_group=2),
]


def moe_args(**fields) -> ModelArgs:
    return ModelArgs.from_dict(dict(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                    intermediate_size=48, num_experts=8, num_experts_per_tok=3, **fields))


@pytest.mark.parametrize("router", ROUTERS, ids=lambda r: "-".join(str(v) for v in r.values()))
def test_routers_follow_their_formulas(router):
    args = moe_args(**router)
    rng = np.random.default_rng(0)
    logits, bias = rng.normal(size=(2, 5, 8)).astype(np.float32), rng.normal(size=8).astype(np.float32)
    indices, weights = route(mx.array(logits), args, mx.array(bias))
    expected_indices, expected_weights = numpy_route(
        logits, 3, args.router_scoring, args.norm_topk_prob, bias, args.routed_scaling_factor, args.n_group,
        args.topk_group)
    np.testing.assert_array_equal(np.array(indices), expected_indices)
    np.testing.assert_allclose(np.array(weights), expected_weights, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("router", ROUTERS[:4], ids=lambda r: "-".join(str(v) for v in r.values()))
def test_tied_experts_are_taken_in_index_order(router):
    """Experts 1, 3 and 6 tie for first place; two of them fit in k = 2 and then 4 and 7 tie
    with each other after them: the lower indices win, every time, and the weights are
    those of the chosen experts."""
    args = ModelArgs.from_dict({**moe_args(**router).to_dict(), "num_experts_per_tok": 2})
    logits = np.array([[0.1, 2.0, -1.0, 2.0, 0.5, -3.0, 2.0, 0.5]] * 3, dtype=np.float32)
    indices, weights = route(mx.array(logits), args, mx.zeros((8,)))
    assert np.array(indices).tolist() == [[1, 3]] * 3
    _, expected = numpy_route(logits, 2, args.router_scoring, args.norm_topk_prob, np.zeros(8),
                              args.routed_scaling_factor)
    np.testing.assert_allclose(np.array(weights), expected, atol=1e-6)
    args = ModelArgs.from_dict({**args.to_dict(), "num_experts_per_tok": 5})
    assert np.array(route(mx.array(logits), args, mx.zeros((8,)))[0]).tolist()[0] == [1, 3, 6, 4, 7]


def tie_experts(hf, copies: list[int]) -> None:
    """Experts ``copies`` of every layer become one expert: the same router row and the same
    weights, so they tie for every token (transformers' layout in memory: fused experts)."""
    import torch

    with torch.no_grad():
        for layer in hf.model.layers:
            moe = layer.mlp
            for e in copies[1:]:
                moe.gate.weight[e] = moe.gate.weight[copies[0]]
                moe.experts.gate_up_proj[e] = moe.experts.gate_up_proj[copies[0]]
                moe.experts.down_proj[e] = moe.experts.down_proj[copies[0]]


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_tied_experts_match_transformers(name, tmp_path):
    """Three experts tie for every token and only two are taken: whichever two an
    implementation takes, the logits are the same, and ours are transformers'. A router
    that took all tied experts, or one twice, would be off."""
    hf = make_hf_model(name, tmp_path / "hf", num_hidden_layers=1, decoder_sparse_step=1)
    tie_experts(hf, [0, 1, 2])
    hf.save_pretrained(tmp_path / "tied")
    model, _ = load_model(tmp_path / "tied")
    moe = model.layers[0].mlp
    gate_logits = np.array(moe.gate(mx.random.normal((5, 64))))
    assert (gate_logits[:, 0] == gate_logits[:, 1]).all() and (gate_logits[:, 1] == gate_logits[:, 2]).all()
    assert_matches_transformers(hf, tmp_path / "tied")


def test_top_k_renormalisation_matters_and_matches_transformers(tmp_path):
    """qwen3_moe with and without ``norm_topk_prob``: both match transformers, and they
    differ from each other by far more than the tolerance."""
    logits = {}
    for normalize in (False, True):
        hf = make_hf_model("qwen3_moe", tmp_path / f"hf{normalize}", norm_topk_prob=normalize)
        assert_matches_transformers(hf, tmp_path / f"hf{normalize}")
        logits[normalize] = hf_logits(hf, PROMPT)
    assert np.abs(logits[True] - logits[False]).max() > 0.1


def test_routing_moves_the_logits(tmp_path):
    """The tiny checkpoints are a real test of routing: swapping two experts' router rows
    changes the logits by far more than the parity tolerance."""
    make_hf_model("mixtral", tmp_path / "hf")
    model, _ = load_model(tmp_path / "hf")
    before = our_logits(model, PROMPT)
    gate = model.layers[0].mlp.gate
    gate.weight = gate.weight[mx.array([1, 0, 2, 3])]
    assert np.abs(our_logits(model, PROMPT) - before).max() > 0.1


# -- the stacked experts against a dense reference ----------------------------------------


def dense_experts(block: SwitchGLU, x: np.ndarray, indices: np.ndarray, weights=None) -> np.ndarray:
    """Each position through each of its experts one by one, in numpy: (N, D) -> (N, k, D)."""
    def weight_of(layer):
        w = layer.dense_weight() if isinstance(layer, QuantizedSwitchLinear) else layer.weight
        return np.array(w), (np.array(layer.bias) if "bias" in layer else None)

    (gate, gate_b), (up, up_b), (down, down_b) = (weight_of(layer) for layer in (block.gate_proj, block.up_proj,
                                                                                 block.down_proj))
    out = np.zeros((*indices.shape, x.shape[-1]), dtype=np.float32)
    for n, row in enumerate(x):
        for j, e in enumerate(indices[n]):
            g, u = gate[e] @ row, up[e] @ row
            if gate_b is not None:
                g, u = g + gate_b[e], u + up_b[e]
            h = g / (1 + np.exp(-g)) * u  # SwiGLU
            out[n, j] = down[e] @ h + (down_b[e] if down_b is not None else 0)
    return out


@pytest.mark.parametrize("positions", [3, 40], ids=["unsorted", "sorted-by-expert"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("bits", [None, 4])
def test_gather_route_equals_dense_reference(positions, bias, bits):
    """gather_mm / gather_qmm over the chosen experts (and, from 64 pairs on, over the pairs
    sorted by expert) give what multiplying each chosen expert's matrix does."""
    from mlx_tfm.model.layers import gated_activation

    mx.random.seed(1)
    block = SwitchGLU(64, 96, 6, gated_activation("silu"), bias=bias)
    if bias:
        for layer in (block.gate_proj, block.up_proj, block.down_proj):
            layer.bias = mx.random.normal(layer.bias.shape)
    if bits:
        nn.quantize(block, group_size=32, bits=bits)
        assert isinstance(block.up_proj, QuantizedSwitchLinear)
    x = mx.random.normal((positions, 64))
    indices = mx.random.randint(0, 6, (positions, 2)).astype(mx.uint32)
    got = np.array(block(x, indices))
    np.testing.assert_allclose(got, dense_experts(block, np.array(x), np.array(indices)), atol=2e-4, rtol=1e-4)


def test_moe_block_equals_dense_reference_with_shared_expert():
    """The whole block: routing weights times the chosen experts, plus the gated shared
    expert (Qwen2-MoE), against numpy."""
    args = moe_args(shared_expert_intermediate_size=40, shared_expert_gate=True, norm_topk_prob=True)
    from mlx_tfm.model.layers import gated_activation

    mx.random.seed(2)
    block = SparseMoeBlock(args, gated_activation("silu"), MLP(args, 40))
    x = mx.random.normal((7, 32))
    indices, weights = route(block.gate(x), args)
    experts = dense_experts(block.switch_mlp, np.array(x), np.array(indices))
    expected = (experts * np.array(weights)[..., None]).sum(1)
    shared = np.array(block.shared_expert(x))
    gate = 1 / (1 + np.exp(-np.array(block.shared_expert_gate(x))))
    np.testing.assert_allclose(np.array(block(x)), expected + gate * shared, atol=1e-5, rtol=1e-5)


# -- dense layers mixed in, layouts -------------------------------------------------------


@pytest.mark.parametrize("name,overrides,dense", [
    ("qwen2_moe", dict(num_hidden_layers=3, mlp_only_layers=[1]), [1]),
    ("qwen3_moe", dict(num_hidden_layers=4, decoder_sparse_step=2), [0, 2]),
    ("glm4_moe", dict(num_hidden_layers=3, first_k_dense_replace=2), [0, 1]),
])
def test_dense_layers_mixed_in(name, overrides, dense, tmp_path):
    hf = make_hf_model(name, tmp_path / "hf", **overrides)
    model, _ = load_model(tmp_path / "hf")
    kinds = [type(layer.mlp) for layer in model.layers]
    assert [i for i, kind in enumerate(kinds) if kind is MLP] == dense
    assert all(kind is SparseMoeBlock for i, kind in enumerate(kinds) if i not in dense)
    assert_matches_transformers(hf, tmp_path / "hf")


def test_sigmoid_router_bias_matches_transformers(tmp_path):
    """GLM-4.5's choice bias (a buffer transformers leaves at zero) set to O(1) values, so
    it changes which experts run."""
    import torch

    hf = make_hf_model("glm4_moe", tmp_path / "hf")
    with torch.no_grad():
        for layer in hf.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(8))
    hf.save_pretrained(tmp_path / "biased")
    assert_matches_transformers(hf, tmp_path / "biased")
    unbiased, _ = load_model(tmp_path / "hf")
    assert np.abs(our_logits(unbiased, PROMPT) - hf_logits(hf, PROMPT)).max() > 0.1


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"])
def test_transformers5_fused_expert_layout(name, tmp_path):
    """transformers 5 writes per-expert tensors by default and its fused in-memory layout
    (``experts.gate_up_proj``, gate rows first) with ``save_original_format=False``: both
    convert to the same folder, and match transformers."""
    hf = make_hf_model(name, tmp_path / "per_expert")
    hf.save_pretrained(tmp_path / "fused", save_original_format=False)
    names = set(mx.load(str(tmp_path / "fused" / "model.safetensors")))
    assert "model.layers.1.mlp.experts.gate_up_proj" in names
    assert not any(".experts.0." in n for n in names)
    convert(tmp_path / "per_expert", tmp_path / "a", **QUIET)
    convert(tmp_path / "fused", tmp_path / "b", **QUIET)
    a, b = (mx.load(str(tmp_path / x / "model.safetensors")) for x in "ab")
    assert sorted(a) == sorted(b)
    for key in a:
        assert mx.array_equal(a[key], b[key]), key
    assert_matches_transformers(hf, tmp_path / "b")


# -- gpt-oss -------------------------------------------------------------------------------


def test_gpt_oss_clamped_swiglu_and_sinks_match_transformers(tmp_path):
    """A low swiglu_limit, so the clamp acts on many units, and O(1) sinks."""
    import torch

    hf = make_hf_model("gpt_oss", tmp_path / "hf", swiglu_limit=0.5)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.sinks.copy_(torch.randn_like(layer.self_attn.sinks) * 2)
    hf.save_pretrained(tmp_path / "hf")
    assert_matches_transformers(hf, tmp_path / "hf")


def test_gpt_oss_differs_from_mlx_lm_only_by_yarn_truncation(tmp_path):
    """gpt-oss's YaRN has truncate false; mlx-lm 0.32 rounds the correction range as if it
    were true (test_convert_architectures allows for that). With truncate true in the
    config, mlx-lm and we agree within 1e-4."""
    from mlx_lm.utils import load_model as mlx_lm_load_model

    make_hf_model("gpt_oss", tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "mlx", **QUIET)
    config = json.loads((tmp_path / "mlx" / "config.json").read_text())
    assert config["rope_scaling"]["truncate"] is False
    config["rope_scaling"]["truncate"] = True
    (tmp_path / "mlx" / "config.json").write_text(json.dumps(config))
    ours, _ = load_model(tmp_path / "mlx")
    theirs, _ = mlx_lm_load_model(tmp_path / "mlx")
    np.testing.assert_allclose(our_logits(ours, PROMPT[:5]), our_logits(theirs, PROMPT[:5]), atol=1e-4, rtol=0)


def openai_mxfp4(weight) -> tuple[np.ndarray, np.ndarray]:
    """A float (experts, out, in) weight as OpenAI's gpt-oss checkpoints store experts:
    (experts, out, in / 32, 16) bytes of two 4-bit floats each, and a uint8 power-of-two
    exponent per 32 values."""
    packed, scales = mx.quantize(mx.array(weight), 32, 4, mode="mxfp4")
    E, out, in_dims = weight.shape
    return np.array(packed).view(np.uint8).reshape(E, out, in_dims // 32, 16), np.array(scales)


def test_gpt_oss_mxfp4_checkpoint(tmp_path):
    """An OpenAI-style MXFP4 checkpoint (``*_blocks`` / ``*_scales``, quant_method mxfp4)
    loads as MLX mxfp4 experts and gives the logits of transformers running the weights
    transformers' own MXFP4 decoder makes of those blocks; converted, mlx-lm reads it too."""
    import torch
    from mlx_lm.utils import load_model as mlx_lm_load_model
    from safetensors.torch import save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rope = {"rope_type": "default", "rope_theta": 10000.0}  # mlx-lm rounds YaRN otherwise (above)
    hf = make_hf_model("gpt_oss", tmp_path / "hf", rope_parameters=rope)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    for i, layer in enumerate(hf.model.layers):
        prefix = f"model.layers.{i}.mlp.experts."
        for name in ("gate_up_proj", "down_proj"):
            float_weight = state.pop(prefix + name).transpose(1, 2).numpy()  # (experts, in, out) -> (experts, out, in)
            blocks, scales = openai_mxfp4(float_weight)
            state[prefix + name + "_blocks"], state[prefix + name + "_scales"] = map(torch.from_numpy, (blocks, scales))
            with torch.no_grad():  # the reference runs what transformers decodes from the blocks
                getattr(layer.mlp.experts, name).copy_(convert_moe_packed_tensors(
                    torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32))
    folder = tmp_path / "mxfp4"
    folder.mkdir()
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (folder / "config.json").write_text(json.dumps(config))

    model, _ = load_model(folder)
    experts = model.layers[0].mlp.switch_mlp
    assert isinstance(experts.gate_proj, QuantizedSwitchLinear) and experts.gate_proj.mode == "mxfp4"
    assert isinstance(model.layers[0].self_attn.q_proj, nn.Linear)
    np.testing.assert_allclose(our_logits(model, PROMPT), hf_logits(hf, PROMPT), atol=1e-4, rtol=0)

    convert(folder, tmp_path / "mlx", **QUIET)
    written = json.loads((tmp_path / "mlx" / "config.json").read_text())
    assert written["quantization"] == {"group_size": 32, "bits": 4, "mode": "mxfp4"}
    theirs, _ = mlx_lm_load_model(tmp_path / "mlx")
    ours, _ = load_model(tmp_path / "mlx")
    np.testing.assert_allclose(our_logits(ours, PROMPT), our_logits(theirs, PROMPT), atol=1e-4, rtol=0)


# -- quantization ---------------------------------------------------------------------------


def upcycled_stories(stories_hf: Path, folder: Path) -> None:
    """stories260K as a Mixtral checkpoint ("sparse upcycling"): each layer's MLP copied into
    4 experts with 10% multiplicative noise, a random router choosing 2. A real language
    model with experts, so quantization errors show as they do on the dense model."""
    config = json.loads((stories_hf / "config.json").read_text())
    config.update(model_type="mixtral", architectures=["MixtralForCausalLM"], num_local_experts=4,
                  num_experts_per_tok=2)
    dense = mx.load(str(stories_hf / "model.safetensors"))
    rng = np.random.default_rng(0)
    weights = {}
    for name, tensor in dense.items():
        if ".mlp." not in name:
            weights[name] = tensor
            continue
        prefix, projection = name.split(".mlp.")
        hf_name = {"gate_proj.weight": "w1", "down_proj.weight": "w2", "up_proj.weight": "w3"}[projection]
        for e in range(4):
            noise = 1 + 0.1 * rng.standard_normal(tensor.shape).astype(np.float32)
            weights[f"{prefix}.block_sparse_moe.experts.{e}.{hf_name}.weight"] = tensor * mx.array(noise)
    for i in range(config["num_hidden_layers"]):
        router = rng.standard_normal((4, config["hidden_size"])).astype(np.float32) * 0.5
        weights[f"model.layers.{i}.block_sparse_moe.gate.weight"] = mx.array(router)
    folder.mkdir()
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_moe_within_the_dense_bounds(bits, tmp_path, stories_hf, golden):
    """Quantized experts (routers kept at 8 bits) against the float MoE, teacher-forced over
    the 200 golden tokens: the bounds test_convert_stories.py holds dense stories260K to."""
    upcycled_stories(stories_hf, tmp_path / "moe")
    convert(tmp_path / "moe", tmp_path / "q", quantize=True, q_bits=bits, **QUIET)
    sequence = golden["prompt_ids"] + golden["generated_ids"]
    top_float, ppl_float = agreement_and_perplexity(tmp_path / "moe", sequence)
    top_q, ppl_q = agreement_and_perplexity(tmp_path / "q", sequence)
    min_agreement, max_increase = QUANT_BOUNDS[bits]
    assert (top_q == top_float).mean() >= min_agreement
    assert ppl_q / ppl_float - 1 <= max_increase
    model, _ = load_model(tmp_path / "q")
    assert isinstance(model.layers[0].mlp.switch_mlp.gate_proj, QuantizedSwitchLinear)
    assert model.layers[0].mlp.gate.bits == 8
    # decoding through the cache follows the full forward
    cached = greedy(model, golden["prompt_ids"], 40)
    ids = golden["prompt_ids"] + cached
    assert np.array(mx.argmax(model(mx.array([ids[:-1]]))[0], axis=-1)).tolist()[-40:] == cached


def quantized_paths(folder: Path) -> dict[str, int]:
    """Module path -> bits of every quantized layer of a folder, as its config.json says."""
    weights = mx.load(str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    quantization = config["quantization"]
    bits = {}
    for name in weights:
        if name.endswith(".scales"):
            path = name.removesuffix(".scales")
            own = quantization.get(path)
            bits[path] = (own if isinstance(own, dict) else quantization)["bits"]
    return bits


@pytest.mark.parametrize("recipe", sorted(QUANT_RECIPES))
def test_mixed_recipes_as_mlx_lm(recipe, tmp_path):
    """Our --quant-predicate gives every layer the bits mlx_lm.convert's recipe gives it,
    except the routers, which we keep at 8 bits; mlx-lm loads the folder and computes our
    logits."""
    from mlx_lm.convert import mixed_quant_predicate_builder
    from mlx_lm.utils import load_model as mlx_lm_load_model

    make_hf_model("qwen3_moe", tmp_path / "hf", num_hidden_layers=8, decoder_sparse_step=1)
    convert(tmp_path / "hf", tmp_path / "mixed", quantize=True, q_group_size=32, quant_predicate=recipe, **QUIET)
    theirs, _ = mlx_lm_load_model(tmp_path / "mixed")
    ours, _ = load_model(tmp_path / "mixed")
    np.testing.assert_allclose(our_logits(ours, PROMPT), our_logits(theirs, PROMPT), atol=1e-4, rtol=0)

    convert(tmp_path / "hf", tmp_path / "float", **QUIET)
    float_model, _ = mlx_lm_load_model(tmp_path / "float")
    predicate = mixed_quant_predicate_builder(recipe, float_model, 32)
    written = quantized_paths(tmp_path / "mixed")
    modules = dict(float_model.named_modules())
    for path, bits in written.items():
        expected = 8 if path.endswith("mlp.gate") else predicate(path, modules[path])["bits"]
        assert bits == expected, path
    low, high = QUANT_RECIPES[recipe]
    assert {low, high, 8} == set(written.values())


def test_mlx_community_moe_folders_load_as_they_are(tmp_path):
    """A folder written by mlx-lm itself (its stacked layout, 4-bit with its 8-bit router
    predicate) loads here and gives mlx-lm's logits."""
    from mlx_lm.utils import load_model as mlx_lm_load_model
    from mlx_lm.utils import quantize_model, save_config, save_model

    make_hf_model("qwen3_moe", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    # the keys hub configs (transformers 4) have and mlx-lm reads
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "num_experts": 4, "rope_theta": 10000.0}))
    model, config = mlx_lm_load_model(tmp_path / "hf")
    float_logits = our_logits(model, PROMPT)
    model, config = quantize_model(model, config, 32, 4)
    save_model(tmp_path / "community", model)
    save_config(config, tmp_path / "community" / "config.json")
    assert config["quantization"]["model.layers.1.mlp.gate"]["bits"] == 8
    ours, _ = load_model(tmp_path / "community")
    np.testing.assert_allclose(our_logits(ours, PROMPT), our_logits(model, PROMPT), atol=1e-4, rtol=0)
    assert np.abs(our_logits(ours, PROMPT) - float_logits).max() > 1e-3  # really quantized


def test_quant_predicate_on_the_command_line(tmp_path, capsys):
    make_hf_model("mixtral", tmp_path / "hf")
    capsys.readouterr()
    assert "--quant-predicate takes -q" in cli_error(
        capsys, "convert", "--hf-path", tmp_path / "hf", "--mlx-path", tmp_path / "a", "--quant-predicate", "mixed_3_6")
    code = main(["convert", "--hf-path", str(tmp_path / "hf"), "--mlx-path", str(tmp_path / "b"), "-q",
                 "--q-group-size", "32", "--quant-predicate", "mixed_3_6"])
    assert code == 0 and "3/6/8-bit" in capsys.readouterr().out
    assert set(quantized_paths(tmp_path / "b").values()) == {3, 6, 8}


# -- LoRA on experts ----------------------------------------------------------------------


def randomize(model) -> None:
    from mlx_tfm.model.lora import LoRALinear, LoRASwitchLinear

    mx.random.seed(3)
    for _, module in model.named_modules():
        if isinstance(module, (LoRALinear, LoRASwitchLinear)):
            module.lora_b = 0.05 * mx.random.normal(module.lora_b.shape)


@pytest.mark.parametrize("quantized", [False, True])
def test_lora_on_experts_fuses_exactly(quantized, tmp_path):
    from mlx_tfm.model.lora import LoRALinear, LoRASwitchLinear, apply_lora, fuse_adapters

    make_hf_model("qwen3_moe", tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "mlx", quantize=quantized, q_group_size=32, **QUIET)
    model, _ = load_model(tmp_path / "mlx")
    before = our_logits(model, PROMPT)
    rank = 4
    apply_lora(model, num_layers=2, rank=rank, scale=10.0)
    moe = model.layers[1].mlp
    assert isinstance(moe.switch_mlp.up_proj, LoRASwitchLinear) and isinstance(moe.gate, LoRALinear)
    assert moe.switch_mlp.up_proj.lora_a.shape == (4, 4, 64) and moe.switch_mlp.up_proj.lora_b.shape == (4, 32, 4)
    assert isinstance(model.layers[0].mlp.up_proj, LoRALinear)  # the dense layer 0
    # Zero adapters add exactly zero, but experts under adapters take MLX's plain route
    # (gather_mm) where the bare ones took the CPU route (BLAS by expert, or the quantized
    # kernels), which sums in another order: the logits may differ by float32 rounding, as far
    # as the sums on a logit's path allow on any CPU. A nonzero adapter moves them by > 1e-2.
    summed = products_per_logit(model.args, len(PROMPT))
    np.testing.assert_allclose(our_logits(model, PROMPT), before, atol=rounding_bound(summed, np.abs(before).max()),
                               rtol=0)
    randomize(model)
    adapted = our_logits(model, PROMPT)
    assert np.abs(adapted - before).max() > 1e-2
    if quantized:  # fused and quantized again (rounded anew), or fused into float (exact, below)
        assert type(moe.switch_mlp.up_proj.fuse()) is QuantizedSwitchLinear
    fuse_adapters(model, dequantize=quantized)
    assert type(model.layers[1].mlp.switch_mlp.up_proj) is SwitchLinear
    assert not any(isinstance(m, (QuantizedSwitchLinear, nn.QuantizedLinear)) for _, m in model.named_modules())
    # W x + scale * B (A x) against (W + scale * B A) x: the same sums regrouped, plus the
    # rank products of B A folded into each fused weight.
    bound = rounding_bound(summed + rank, np.abs(adapted).max())
    np.testing.assert_allclose(our_logits(model, PROMPT), adapted, atol=bound, rtol=0)


def test_lora_adapters_on_experts_load_in_mlx_lm(tmp_path):
    from mlx_lm.tuner.utils import load_adapters as mlx_lm_load_adapters
    from mlx_lm.utils import load_model as mlx_lm_load_model

    from mlx_tfm.model.lora import apply_lora
    from mlx_tfm.weights.adapters import save_adapters

    make_hf_model("qwen3_moe", tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "mlx", **QUIET)
    model, _ = load_model(tmp_path / "mlx")
    apply_lora(model, num_layers=1, rank=4, scale=10.0)
    randomize(model)
    save_adapters(tmp_path / "adapters", model, {"fine_tune_type": "lora", "num_layers": 1,
                                                 "lora_parameters": {"rank": 4, "scale": 10.0, "dropout": 0.0}})
    theirs, _ = mlx_lm_load_model(tmp_path / "mlx")
    mlx_lm_load_adapters(theirs, str(tmp_path / "adapters"))
    np.testing.assert_allclose(our_logits(model, PROMPT), our_logits(theirs, PROMPT), atol=1e-4, rtol=0)


def test_dora_on_experts_is_one_line(tmp_path):
    from mlx_tfm.errors import UserError
    from mlx_tfm.model.lora import apply_lora

    make_hf_model("mixtral", tmp_path / "hf")
    model, _ = load_model(tmp_path / "hf")
    with pytest.raises(UserError, match="DoRA is not defined for stacked experts"):
        apply_lora(model, fine_tune_type="dora")
    apply_lora(model, fine_tune_type="dora", keys=["self_attn.q_proj"])  # attention alone is fine


# -- bad input -----------------------------------------------------------------------------


def test_missing_expert_is_named(tmp_path, capsys):
    make_hf_model("qwen2_moe", tmp_path / "hf")
    weights = mx.load(str(tmp_path / "hf" / "model.safetensors"))
    del weights["model.layers.1.mlp.experts.2.up_proj.weight"]
    mx.save_safetensors(str(tmp_path / "hf" / "model.safetensors"), weights)
    capsys.readouterr()
    err = cli_error(capsys, "convert", "--hf-path", tmp_path / "hf", "--mlx-path", tmp_path / "out")
    assert "missing expert 2 of model.layers.1.mlp" in err and "model.layers.1.mlp.experts.2.up_proj.weight" in err
    assert not (tmp_path / "out").exists()


def test_the_last_expert_missing_is_named_too(tmp_path):
    from mlx_tfm.errors import UserError

    make_hf_model("mixtral", tmp_path / "hf")
    weights = mx.load(str(tmp_path / "hf" / "model.safetensors"))
    weights = {k: v for k, v in weights.items() if ".experts.3." not in k}
    mx.save_safetensors(str(tmp_path / "hf" / "model.safetensors"), weights)
    with pytest.raises(UserError, match=r"missing expert 3 of model\.layers\.0\.block_sparse_moe \(4 experts\)"):
        load_model(tmp_path / "hf")


def test_more_experts_per_token_than_experts_is_one_line(tmp_path, capsys):
    make_hf_model("olmoe", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "num_experts_per_tok": 5}))
    capsys.readouterr()
    err = cli_error(capsys, "convert", "--hf-path", tmp_path / "hf", "--mlx-path", tmp_path / "out")
    assert "num_experts_per_tok is 5; it must be between 1 and num_experts (4)" in err


# -- the CPU routes against the plain one (tests/cpu/test_device_routes.py's pattern) ----------


class ExpertRouteSpy:
    def __init__(self, monkeypatch):
        import mlx_tfm.cpu.experts as cpu_experts

        self.calls = {"by_expert": 0, "chosen_experts": 0}
        for name in self.calls:
            monkeypatch.setattr(cpu_experts, name, self._counting(name, getattr(cpu_experts, name)))

    def _counting(self, name, function):
        def counted(*args, **kwargs):
            self.calls[name] += 1
            return function(*args, **kwargs)

        return counted


def prompt_then_decode(model) -> np.ndarray:
    cache = model.make_cache()
    outputs = [model(mx.array([PROMPT]), cache=cache)]  # 14 positions x 2 experts: a chunk
    for token in (5, 77, 123):
        outputs.append(model(mx.array([[token]]), cache=cache))
    return np.array(mx.concatenate(outputs, axis=1).astype(mx.float32))


@pytest.mark.parametrize("weights", ["float32", "float16", "8-bit", "4-bit"])
def test_cpu_expert_routes_equal_the_generic_route(weights, tmp_path, monkeypatch):
    """A prompt goes by expert through float32 BLAS, a decoding step of quantized or
    half-precision experts through the kernels; inside ``generic_routes()`` both take
    gather_mm / gather_qmm: the same logits. (MLX's CPU gather_mm is float32 only, so the
    float16 model's generic reference is the float32 model's.)"""
    from mlx_tfm.cpu import generic_routes
    from mlx_tfm.cpu.kernels import kernels, status

    assert kernels() is not None, f"mlx_tfm's CPU kernels are needed here: {status()}"
    bits = {"8-bit": 8, "4-bit": 4}.get(weights)
    make_hf_model("qwen2_moe", tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "mlx", quantize=bits is not None, q_bits=bits or 4, q_group_size=32,
            dtype="float16" if weights == "float16" else None, **QUIET)
    model, _ = load_model(tmp_path / "mlx")
    spy = ExpertRouteSpy(monkeypatch)
    fast = prompt_then_decode(model)
    assert spy.calls["by_expert"] == 2  # the prompt, in each of the two layers
    assert spy.calls["chosen_experts"] == (0 if weights == "float32" else 2 * 3)  # the decoding steps
    before = dict(spy.calls)
    reference = load_model(tmp_path / "hf")[0] if weights == "float16" else model
    with generic_routes():
        generic = prompt_then_decode(reference)
    assert spy.calls == before, "the generic run went through a CPU-only route"
    tolerance = {"float32": 1e-4, "float16": 3e-2}.get(weights, 1e-3)
    np.testing.assert_allclose(fast, generic, atol=tolerance, rtol=tolerance)


def test_training_mode_takes_the_plain_route(tmp_path, monkeypatch):
    """Training steps are compiled and differentiated: no device sync, no kernels."""
    make_hf_model("qwen2_moe", tmp_path / "hf")
    model, _ = load_model(tmp_path / "hf")
    spy = ExpertRouteSpy(monkeypatch)
    model.train()
    loss = lambda m: m(mx.array([PROMPT])).astype(mx.float32).mean()  # noqa: E731
    mx.eval(nn.value_and_grad(model, loss)(model))
    assert spy.calls == {"by_expert": 0, "chosen_experts": 0}


@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("positions", [1, 40])
def test_a_position_reads_only_its_chosen_experts(quantized, positions):
    """An expert nobody chose is never read: made NaN, it changes nothing, on every route
    (a route multiplying all experts and masking would turn the output NaN)."""
    from mlx_tfm.cpu import generic_routes
    from mlx_tfm.model.layers import gated_activation

    mx.random.seed(5)
    block = SwitchGLU(64, 96, 4, gated_activation("silu"))
    if quantized:
        nn.quantize(block, group_size=32, bits=4)
    block.eval()
    x = mx.random.normal((positions, 64))
    indices = mx.random.randint(0, 3, (positions, 2)).astype(mx.uint32)  # expert 3 never chosen
    expected = np.array(block(x, indices))
    for layer in (block.gate_proj, block.up_proj, block.down_proj):
        name = "scales" if quantized else "weight"
        layer[name] = mx.concatenate([layer[name][:3], mx.full(layer[name][3:].shape, mx.nan, layer[name].dtype)])
    for generic in (False, True):
        with generic_routes() if generic else nullcontext():
            got = np.array(block(x, indices))
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, expected, atol=1e-5, rtol=1e-5)


def test_a_recipe_on_a_model_without_down_proj_is_one_line(tmp_path, capsys):
    """mlx-lm's recipes key on down_proj (as its own check does): gpt2 has none."""
    make_hf_model("gpt2", tmp_path / "hf")
    capsys.readouterr()
    err = cli_error(capsys, "convert", "--hf-path", tmp_path / "hf", "--mlx-path", tmp_path / "out", "-q",
                    "--quant-predicate", "mixed_4_6")
    assert "the mixed_4_6 recipe needs down_proj layers" in err
