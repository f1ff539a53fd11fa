"""Kimi Delta Attention (mlx_tfm/model/kimi_delta.py): the step form with a decay per key
channel against the recurrence written out in numpy, the chunked form against the step
form (several chunks, strong decays, a non-zero state), and a Kimi Linear model's cache
(full forward == prefill in pieces + decode)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_tfm.families import model_args_from_config
from mlx_tfm.model.deltanet import delta_rule_steps, l2_normalised
from mlx_tfm.model.kimi_delta import KimiDeltaAttention, per_channel_delta_rule_chunked
from mlx_tfm.model.state_cache import StateCache
from mlx_tfm.model.transformer import Model

# transformers' config keys (as KimiLinearConfig writes them): KDA, MLA, KDA, KDA layers
KIMI = dict(model_type="kimi_linear", vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
            num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8,
            qk_rope_head_dim=8, v_head_dim=8, num_experts=4, num_experts_per_token=2, moe_intermediate_size=16,
            num_shared_experts=1, num_expert_group=2, topk_group=1, routed_scaling_factor=2.0, moe_renormalize=True,
            linear_head_dim=8, linear_num_heads=2, linear_conv_kernel_dim=4, rms_norm_eps=1e-5,
            layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
            mlp_layer_types=["dense", "sparse", "sparse", "sparse"])


def recurrence_inputs(length: int, strong_decay: bool = False, seed: int = 0, B: int = 2, H: int = 3):
    """queries, keys, g (B, H, L, 8), values (B, H, L, 4), beta (B, H, L), state (B, H, 8, 4).
    ``strong_decay``: every 8th position some channels forget almost everything (g = -150)."""
    rng = np.random.default_rng(seed)
    Dk, Dv = 8, 4
    queries = l2_normalised(mx.array(rng.normal(size=(B, H, length, Dk)), mx.float32)) * Dk ** -0.5
    keys = l2_normalised(mx.array(rng.normal(size=(B, H, length, Dk)), mx.float32))
    values = mx.array(rng.normal(size=(B, H, length, Dv)), mx.float32)
    g = -rng.uniform(0, 0.1 if strong_decay else 1.0, size=(B, H, length, Dk))
    if strong_decay:
        g[..., ::8, ::2] = -150.0
    beta = mx.array(rng.uniform(0, 1, size=(B, H, length)), mx.float32)
    state = mx.array(rng.normal(size=(B, H, Dk, Dv)) * 0.3, mx.float32)
    return queries, keys, values, mx.array(g, mx.float32), beta, state


def numpy_recurrence(queries, keys, values, g, beta, state):
    """KDA as its definition reads, in float64: S = diag(exp(g)) S, then the delta rule."""
    q, k, v, g, beta, S = (np.array(t, dtype=np.float64) for t in (queries, keys, values, g, beta, state))
    B, H, L, _ = q.shape
    out = np.zeros((*q.shape[:3], v.shape[-1]))
    for b in range(B):
        for h in range(H):
            s = S[b, h].copy()
            for t in range(L):
                s = np.exp(g[b, h, t])[:, None] * s
                s = s + np.outer(k[b, h, t], beta[b, h, t] * (v[b, h, t] - k[b, h, t] @ s))
                out[b, h, t] = q[b, h, t] @ s
            S[b, h] = s
    return out, S


def test_step_form_takes_a_decay_per_key_channel():
    inputs = recurrence_inputs(20)
    out, state = delta_rule_steps(*inputs)
    expected_out, expected_state = numpy_recurrence(*inputs)
    np.testing.assert_allclose(np.array(out), expected_out, atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.array(state), expected_state, atol=1e-5, rtol=0)


@pytest.mark.parametrize("strong_decay", [False, True], ids=["mild", "strong"])
def test_chunked_equals_steps_over_several_chunks(strong_decay):
    """100 positions in chunks of 16 (the last one padded), from a non-zero state; with
    strong decays exp(-gamma) alone would overflow, the pairwise differences do not."""
    inputs = recurrence_inputs(100, strong_decay)
    out_steps, state_steps = delta_rule_steps(*inputs)
    out_chunks, state_chunks = per_channel_delta_rule_chunked(*inputs, chunk_size=16)
    assert np.isfinite(np.array(out_chunks)).all()
    np.testing.assert_allclose(np.array(out_chunks), np.array(out_steps), atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.array(state_chunks), np.array(state_steps), atol=1e-5, rtol=0)
    expected_out, _ = numpy_recurrence(*inputs)
    np.testing.assert_allclose(np.array(out_chunks), expected_out, atol=1e-5, rtol=0)


def kimi_model(seed: int = 0, **overrides) -> Model:
    mx.random.seed(seed)
    model = Model(model_args_from_config({**KIMI, **overrides}))
    model.set_dtype(mx.float32)
    return model


def test_config_builds_kda_and_position_free_latent_attention():
    args = model_args_from_config(KIMI)
    assert args.layer_types == ("kimi_delta_attention", "full_attention", "kimi_delta_attention",
                                "kimi_delta_attention")
    assert args.position_embedding == "none" and args.kv_lora_rank == 16
    assert args.mlp_only_layers == (0,) and args.num_experts_per_tok == 2 and args.n_group == 2
    caches = kimi_model().make_cache()
    assert [isinstance(c, StateCache) for c in caches] == [True, False, True, True]


def test_moonshot_config_spelling_gives_the_same_layers():
    """Moonshot's own config: 1-based kda_layers / full_attn_layers, first_k_dense_replace."""
    moonshot = {k: v for k, v in KIMI.items() if k not in ("layer_types", "mlp_layer_types", "linear_head_dim",
                                                            "linear_num_heads", "linear_conv_kernel_dim")}
    moonshot.update(first_k_dense_replace=1, linear_attn_config=dict(
        kda_layers=[1, 3, 4], full_attn_layers=[2], num_heads=2, head_dim=8, short_conv_kernel_size=4))
    assert model_args_from_config(moonshot) == model_args_from_config(KIMI)


def test_full_forward_equals_prefill_in_pieces_and_decode():
    """60 positions: a 37-position prefill (chunked: two chunks of 16 and a padded one), a
    piece of 5 (steps), a piece of 10 (chunked, from the cached state), then 8 decoded one
    at a time, against one forward pass over all 60."""
    model = kimi_model(linear_chunk_size=16)
    assert model.args.linear_chunk_size == 16
    tokens = mx.array(np.random.default_rng(4).integers(0, 256, size=(2, 60)))
    full = model(tokens)
    cache = model.make_cache()
    pieces = [model(tokens[:, :37], cache=cache), model(tokens[:, 37:42], cache=cache),
              model(tokens[:, 42:52], cache=cache)]
    pieces += [model(tokens[:, t : t + 1], cache=cache) for t in range(52, 60)]
    np.testing.assert_allclose(np.array(mx.concatenate(pieces, axis=1)), np.array(full), atol=1e-4, rtol=0)
    assert cache[0].offset == 60 and cache[1].offset == 60


def test_layer_reads_prompts_chunked_and_decodes_by_steps():
    args = model_args_from_config({**KIMI, "linear_chunk_size": 16})
    mx.random.seed(5)
    layer = KimiDeltaAttention(args, 0)
    x = mx.random.normal((1, 50, 32))
    whole = layer(x)
    cache = layer.make_cache()
    stepped = mx.concatenate([layer(x[:, t : t + 1], None, cache) for t in range(50)], axis=1)
    np.testing.assert_allclose(np.array(stepped), np.array(whole), atol=1e-5, rtol=0)
    assert cache[0].shape == (1, 3, 3 * 2 * 8) and cache[1].shape == (1, 2, 8, 8)


def test_unknown_kimi_layer_type_is_named():
    from mlx_tfm.errors import UserError

    with pytest.raises(UserError, match="kimi_linear layer type 'mamba' is not supported"):
        model_args_from_config({**KIMI, "layer_types": ["mamba"] * 4})


def test_inspect_counts_kda_layers_as_recurrent():
    """KDA sits under ``self_attn`` as attention does; the parameter table tells them apart."""
    from mlx_tfm.inspect.parts import model_parts

    kinds = {(p.layer, p.kind) for p in model_parts(kimi_model()) if p.name_in_block.startswith("self_attn.")}
    assert kinds == {(0, "recurrent"), (1, "attention"), (2, "recurrent"), (3, "recurrent")}
