"""Reference parity for the position and attention variants that test_model.py only checks
for self-consistency: linear and YaRN RoPE scaling, partial rotary, interleaved RoPE, MQA
and post-norm against transformers; the original Transformer (post-norm, sinusoidal
positions, ReLU FFN) against numpy written from the seed's formulas.

Each case compares float32 logits over a 40-token prompt within 1e-4, and our greedy
decode through the KV cache (12 tokens) with the reference's greedy decode. The prompt
runs far past ``original_max_position_embeddings`` (16) for the scaled RoPE variants, and
each case also checks that the variant matters: our model with the feature switched off
misses the reference by far more than the tolerance.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
import pytest
from fixtures.convert_helpers import COMMON, greedy, hf_greedy, hf_logits, make_hf_model, random_hf_model
from mlx.utils import tree_flatten

from mlx_tfm.loading import load_model
from mlx_tfm.model.transformer import Model
from mlx_tfm.model.config import ModelArgs
from mlx_tfm.model.positions import SinusoidalPositions

PROMPT = [int(t) for t in np.random.default_rng(7).integers(3, 256, size=40)]
NEW_TOKENS = 12
ATOL = 1e-4
# A switched-off feature must move some logit by at least this much (100x the tolerance).
MATTERS = 1e-2
ORIGINAL_CONTEXT = 16  # the scaled variants' pre-training context; PROMPT runs to 52


def our_logits(model: Model, ids: list[int]) -> np.ndarray:
    return np.array(model(mx.array([ids]))[0].astype(mx.float32))


def with_args(model: Model, **changes) -> Model:
    """The same weights in a model whose ``ModelArgs`` differ by ``changes``."""
    other = Model(dataclasses.replace(model.args, **changes))
    other.load_weights(tree_flatten(model.parameters()), strict=True)
    return other


def assert_parity(model: Model, reference_logits: np.ndarray, reference_greedy: list[int],
                  **feature_off) -> float:
    """Logits within ATOL, equal greedy tokens through our cache; with ``feature_off``
    applied to our args, the logits must miss the reference by more than MATTERS.
    Returns the max |diff| of the logits."""
    diff = float(np.abs(our_logits(model, PROMPT) - reference_logits).max())
    assert diff < ATOL, f"max |diff| {diff:.3g} against the reference"
    assert greedy(model, PROMPT, NEW_TOKENS) == reference_greedy
    if feature_off:
        off = float(np.abs(our_logits(with_args(model, **feature_off), PROMPT) - reference_logits).max())
        assert off > MATTERS, f"switching off {feature_off} changed the logits by only {off:.3g}"
    return diff


def assert_hf_parity(hf, model: Model, **feature_off) -> float:
    return assert_parity(model, hf_logits(hf, PROMPT), hf_greedy(hf, PROMPT, NEW_TOKENS), **feature_off)


# -- RoPE scaling, partial rotary and MQA: families in our table, loaded from the HF folder


def rope(rope_type: str, **params) -> dict:
    return {"rope_type": rope_type, "rope_theta": 10000.0, **params}


def test_linear_rope_scaling(tmp_path):
    # factor 4 over a 64-position model: trained on 16, the prompt reaches position 51.
    hf = make_hf_model("llama", tmp_path / "hf", max_position_embeddings=4 * ORIGINAL_CONTEXT,
                       rope_parameters=rope("linear", factor=4.0))
    model, _ = load_model(tmp_path / "hf")
    assert model.args.rope_scaling["rope_type"] == "linear"
    assert_hf_parity(hf, model, rope_scaling=None)


YARN = {
    # attention factor from factor alone: 0.1 ln(4) + 1
    "default-mscale": dict(factor=4.0),
    # DeepSeek style: mscale(factor, mscale) / mscale(factor, mscale_all_dim)
    "mscale-ratio": dict(factor=4.0, mscale=1.0, mscale_all_dim=0.5),
    "explicit-attention-factor": dict(factor=4.0, attention_factor=1.5),
    # gpt-oss style: no rounding of the correction range, other betas
    "untruncated": dict(factor=8.0, truncate=False, beta_fast=16.0, beta_slow=2.0),
}


@pytest.mark.parametrize("case", sorted(YARN))
def test_yarn_rope_scaling(case, tmp_path):
    params = rope("yarn", original_max_position_embeddings=ORIGINAL_CONTEXT, **YARN[case])
    context = int(YARN[case]["factor"] * ORIGINAL_CONTEXT)
    hf = make_hf_model("llama", tmp_path / "hf", max_position_embeddings=context, rope_parameters=params)
    model, _ = load_model(tmp_path / "hf")
    assert model.args.rope_scaling["rope_type"] == "yarn"
    assert_hf_parity(hf, model, rope_scaling=None)
    # The attention factor is exercised on its own: without it the logits move too.
    without_factor = {**model.args.rope_scaling, "attention_factor": 1.0}
    off = np.abs(our_logits(with_args(model, rope_scaling=without_factor), PROMPT) - hf_logits(hf, PROMPT)).max()
    assert off > MATTERS


def test_partial_rotary_half_split(tmp_path):
    # Phi-3 rotates the first half of each head (rotate_half within those dims).
    hf = make_hf_model("phi3", tmp_path / "hf", rope_parameters=rope("default", partial_rotary_factor=0.5))
    model, _ = load_model(tmp_path / "hf")
    assert model.args.partial_rotary_factor == 0.5
    assert_hf_parity(hf, model, partial_rotary_factor=1.0)


def test_multi_query_attention(tmp_path):
    hf = make_hf_model("llama", tmp_path / "hf", num_key_value_heads=1)
    model, _ = load_model(tmp_path / "hf")
    assert model.args.num_key_value_heads == 1
    assert_hf_parity(hf, model)


# -- interleaved RoPE: GLM rotates adjacent pairs of the first part of each head ---------


def glm_model(hf) -> Model:
    """Our model with a transformers GLM's weights. GLM is Llama with q/k/v biases, a fused
    gate_up_proj (gate first) and interleaved partial RoPE; no family of ours reads its
    config, so the mapping is spelled out here."""
    c = hf.config
    params = dict(c.rope_parameters)
    theta, partial = params.pop("rope_theta"), params.pop("partial_rotary_factor")
    args = ModelArgs.from_dict(dict(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim, intermediate_size=c.intermediate_size, norm_eps=c.rms_norm_eps,
        attention_bias=True, attention_out_bias=False, rope_traditional=True, rope_theta=theta,
        partial_rotary_factor=partial, rope_scaling=params if params["rope_type"] != "default" else None,
        max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=False,
    ))
    weights = {}
    for name, tensor in hf.state_dict().items():
        tensor = tensor.numpy()
        if name.endswith("mlp.gate_up_proj.weight"):
            gate, up = np.split(tensor, 2)
            weights[name.replace("gate_up_proj", "gate_proj")] = gate
            weights[name.replace("gate_up_proj", "up_proj")] = up
        else:
            weights[name] = tensor
    model = Model(args)
    model.load_weights([(k, mx.array(v)) for k, v in weights.items()], strict=True)
    return model


GLM = dict(COMMON, head_dim=16)


@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_interleaved_rope(partial, tmp_path):
    hf = random_hf_model("glm", {**GLM, "partial_rotary_factor": partial}, tmp_path / "hf")
    assert_hf_parity(hf, glm_model(hf), rope_traditional=False)


def test_interleaved_partial_rope_with_yarn(tmp_path):
    """YaRN's attention factor scales cos and sin, so only the rotated dims; the rest of
    each head passes through unscaled."""
    params = rope("yarn", factor=4.0, original_max_position_embeddings=ORIGINAL_CONTEXT, partial_rotary_factor=0.5)
    hf = random_hf_model("glm", {**GLM, "max_position_embeddings": 64, "rope_parameters": params}, tmp_path / "hf")
    model = glm_model(hf)
    assert model.args.rope_scaling["rope_type"] == "yarn" and model.args.partial_rotary_factor == 0.5
    assert_hf_parity(hf, model, rope_scaling=None)


# -- post-norm: OPT-350m's layout (LayerNorm after each residual addition) ---------------


def opt_model(hf) -> Model:
    """Our post-norm model with a transformers OPT's weights (do_layer_norm_before=False:
    no final norm; learned positions stored with an offset of 2)."""
    c = hf.config
    args = ModelArgs.from_dict(dict(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads, intermediate_size=c.ffn_dim, norm_type="layernorm",
        norm_placement="post", final_norm=False, hidden_act="relu", ffn_gated=False, mlp_bias=True,
        attention_bias=True, attention_out_bias=True, position_embedding="learned",
        max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=True,
    ))
    renames = {
        "self_attn.out_proj": "self_attn.o_proj", "self_attn_layer_norm": "input_layernorm",
        "final_layer_norm": "post_attention_layernorm", "fc1": "mlp.up_proj", "fc2": "mlp.down_proj",
    }
    weights = {}
    for name, tensor in hf.state_dict().items():
        tensor = tensor.numpy()
        if name == "lm_head.weight":  # tied to the token embeddings
            continue
        name = name.replace("model.decoder.", "model.")
        if name == "model.embed_positions.weight":
            tensor = tensor[2:]  # OPT looks position p up at row p + 2
        for theirs, ours in renames.items():
            name = name.replace(f".{theirs}.", f".{ours}.")
        weights[name] = tensor
    model = Model(args)
    model.load_weights([(k, mx.array(v)) for k, v in weights.items()], strict=True)
    return model


def test_post_norm_against_opt(tmp_path):
    config = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, ffn_dim=128, num_attention_heads=4,
                  max_position_embeddings=128, do_layer_norm_before=False, word_embed_proj_dim=64,
                  activation_function="relu", bos_token_id=1, eos_token_id=2, pad_token_id=0)
    hf = random_hf_model("opt", config, tmp_path / "hf")
    assert_hf_parity(hf, opt_model(hf), norm_placement="pre")


# -- the original Transformer, in numpy from the seed's formulas --------------------------

PROMPT_97 = [t % 97 for t in PROMPT]  # the same positions in the smaller vocabulary
ORIGINAL = dict(
    vocab_size=97, hidden_size=48, num_hidden_layers=2, num_attention_heads=6, intermediate_size=96,
    norm_type="layernorm", norm_eps=1e-5, norm_placement="post", final_norm=False, hidden_act="relu",
    ffn_gated=False, position_embedding="sinusoidal", attention_bias=True, attention_out_bias=True,
    mlp_bias=True, tie_word_embeddings=False,
)


def sinusoids(positions: np.ndarray, d_model: int) -> np.ndarray:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d_model)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d_model))."""
    pe = np.zeros((len(positions), d_model))
    two_i = np.arange(0, d_model, 2)
    angles = positions[:, None] / 10000.0 ** (two_i / d_model)
    pe[:, 0::2] = np.sin(angles)
    pe[:, 1::2] = np.cos(angles)
    return pe


def layer_norm(x, gamma, beta, eps):
    """LayerNorm(x) = gamma * (x - mu) / sqrt(sigma^2 + eps) + beta over each position's features."""
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return gamma * (x - mu) / np.sqrt(var + eps) + beta


def multi_head_causal_attention(x, w, prefix, n_heads):
    """MultiHead = Concat(head_1..head_h) W_O, head_i = softmax(Q_i K_i^T / sqrt(d_k) + mask) V_i."""
    linear = lambda name, v: v @ w[f"{prefix}.{name}.weight"].T + w[f"{prefix}.{name}.bias"]  # noqa: E731
    L, D = x.shape
    d_k = D // n_heads
    q, k, v = (linear(n, x).reshape(L, n_heads, d_k).transpose(1, 0, 2) for n in ("q_proj", "k_proj", "v_proj"))
    scores = q @ k.transpose(0, 2, 1) / np.sqrt(d_k)  # (h, L, L)
    scores = np.where(np.tril(np.ones((L, L), bool)), scores, -np.inf)  # a token sees itself and before
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    heads = (weights @ v).transpose(1, 0, 2).reshape(L, D)  # concat the heads
    return linear("o_proj", heads)


def original_transformer_logits(w: dict, ids: list[int], args: dict) -> np.ndarray:
    """Post-norm decoder: x = LayerNorm(x + Sublayer(x)) after attention and after
    FFN(x) = max(0, x W_1 + b_1) W_2 + b_2; sinusoids added to the embeddings."""
    x = w["model.embed_tokens.weight"][ids] + sinusoids(np.arange(len(ids)), args["hidden_size"])
    eps = args["norm_eps"]
    for i in range(args["num_hidden_layers"]):
        p = f"model.layers.{i}"
        norm = lambda name, v: layer_norm(v, w[f"{p}.{name}.weight"], w[f"{p}.{name}.bias"], eps)  # noqa: E731
        x = norm("input_layernorm", x + multi_head_causal_attention(x, w, f"{p}.self_attn", args["num_attention_heads"]))
        hidden = np.maximum(0, x @ w[f"{p}.mlp.up_proj.weight"].T + w[f"{p}.mlp.up_proj.bias"])
        x = norm("post_attention_layernorm", x + hidden @ w[f"{p}.mlp.down_proj.weight"].T + w[f"{p}.mlp.down_proj.bias"])
    return x @ w["lm_head.weight"].T


def numpy_greedy(w: dict, prompt: list[int], n: int, args: dict) -> list[int]:
    """Greedy decoding by recomputing the whole sequence each step (no cache)."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(np.argmax(original_transformer_logits(w, ids, args)[-1])))
    return ids[len(prompt):]


def random_weights(model: Model, seed: int) -> dict[str, np.ndarray]:
    """O(1) weights in float64 for every parameter of ``model``: matrices ~ N(0, 1/fan_in)
    times 1.5, embeddings ~ N(0, 1) (as large as the sinusoids), norm scales near 1, biases ~ 0.1."""
    rng = np.random.default_rng(seed)
    weights = {}
    for name, value in tree_flatten(model.parameters()):
        shape = value.shape
        if name == "model.embed_tokens.weight":
            weights[name] = rng.normal(0, 1.0, shape)
        elif len(shape) == 2:
            weights[name] = rng.normal(0, 1.5 / np.sqrt(shape[1]), shape)
        elif name.endswith("layernorm.weight"):
            weights[name] = 1 + rng.normal(0, 0.1, shape)
        else:
            weights[name] = rng.normal(0, 0.1, shape)
    return weights


def test_sinusoidal_table_matches_the_seed_formula():
    table = SinusoidalPositions(48)
    np.testing.assert_allclose(np.array(table(0, 60)), sinusoids(np.arange(60), 48), atol=2e-5, rtol=0)
    np.testing.assert_allclose(np.array(table(37, 5)), sinusoids(np.arange(37, 42), 48), atol=2e-5, rtol=0)


def test_original_transformer_against_numpy():
    model = Model(ModelArgs.from_dict(ORIGINAL))
    weights = random_weights(model, seed=3)
    model.load_weights([(k, mx.array(v.astype(np.float32))) for k, v in weights.items()], strict=True)
    reference = original_transformer_logits(weights, PROMPT_97, ORIGINAL)
    diff = float(np.abs(our_logits(model, PROMPT_97) - reference).max())
    assert diff < ATOL, f"max |diff| {diff:.3g} against numpy"
    assert greedy(model, PROMPT_97, NEW_TOKENS) == numpy_greedy(weights, PROMPT_97, NEW_TOKENS, ORIGINAL)
    # Each of the two features matters at this weight scale.
    for off in (dict(norm_placement="pre"), dict(position_embedding="none")):
        moved = np.abs(our_logits(with_args(model, **off), PROMPT_97) - reference).max()
        assert moved > MATTERS, off

