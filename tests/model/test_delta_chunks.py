"""The chunked delta rule's pieces (mlx_tfm/model/deltanet.py): the decays within a chunk
built from few exponentials against the pairwise formula in float64, however strong the
decay, and the route a prompt takes through a Gated DeltaNet layer (chunks, not steps)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_tfm.model import deltanet
from mlx_tfm.model.config import ModelArgs
from mlx_tfm.model.deltanet import ChunkDecays, GatedDeltaNet, compensated_cumsum
from mlx_tfm.model.transformer import Model

HYBRID = dict(model_type="qwen3_next", hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
              num_key_value_heads=1, head_dim=16, vocab_size=256, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=8, linear_value_head_dim=8, attn_output_gate=True, qk_norm=True,
              partial_rotary_factor=0.5, tie_word_embeddings=False,
              layer_types=["linear_attention", "full_attention", "linear_attention"])


def log_decays(C: int, strong: bool, seed: int = 0) -> np.ndarray:
    """g (2, 3, C) <= 0; ``strong``: every 5th position forgets almost everything (g = -150),
    so the sum over a chunk reaches thousands and exp(-gamma) alone would overflow."""
    g = -np.random.default_rng(seed).uniform(0, 1.0, size=(2, 3, C))
    if strong:
        g[..., ::5] = -150.0
    return g.astype(np.float32)


def pairwise(g: np.ndarray) -> dict[str, np.ndarray]:
    """The decays as their definition reads, in float64: gamma_i = g_1 + ... + g_i."""
    gamma = np.cumsum(g.astype(np.float64), axis=-1)
    C = g.shape[-1]
    gaps = gamma[..., :, None] - gamma[..., None, :]
    matrix = np.where(np.tril(np.ones((C, C), dtype=bool)), np.exp(np.minimum(gaps, 0)), 0.0)
    return {"matrix": matrix, "from_start": np.exp(gamma), "to_end": np.exp(gamma[..., -1:] - gamma),
            "whole_chunk": np.exp(gamma[..., -1:])}


@pytest.mark.parametrize("C", [4, 16, 64])
@pytest.mark.parametrize("strong", [False, True], ids=["mild", "strong"])
def test_chunk_decays_equal_the_pairwise_exponentials(C, strong):
    """Chunks shorter than a block (4), of two blocks (16) and of eight (64)."""
    g = log_decays(C, strong)
    decays = ChunkDecays(*compensated_cumsum(mx.array(g)))
    got = {"matrix": decays.matrix(), "from_start": decays.from_start(), "to_end": decays.to_end(),
           "whole_chunk": decays.whole_chunk()}
    for name, expected in pairwise(g).items():
        value = np.array(got[name])
        assert np.isfinite(value).all(), name
        np.testing.assert_allclose(value, expected, rtol=2e-5, atol=1e-7, err_msg=name)


def counted(monkeypatch) -> dict[str, int]:
    """Count the calls of the two forms of the delta rule (still computing)."""
    calls = {"chunked": 0, "steps": 0}
    chunked, steps = deltanet.delta_rule_chunked, deltanet.delta_rule_steps

    def counting(name, form):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return form(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(deltanet, "delta_rule_chunked", counting("chunked", chunked))
    monkeypatch.setattr(deltanet, "delta_rule_steps", counting("steps", steps))
    return calls


def test_prompts_take_the_chunked_route_and_decoding_the_steps(monkeypatch):
    calls = counted(monkeypatch)
    mx.random.seed(0)
    model = Model(ModelArgs.from_dict(HYBRID))
    cache = model.make_cache()
    mx.eval(model(mx.array([list(range(3, 43))]), cache=cache))  # a 40-token prompt
    assert calls == {"chunked": 2, "steps": 0}  # the two linear_attention layers, once each
    mx.eval(model(mx.array([[7]]), cache=cache))
    assert calls == {"chunked": 2, "steps": 2}


def test_the_chunked_route_starts_past_the_step_limit(monkeypatch):
    calls = counted(monkeypatch)
    mx.random.seed(1)
    layer = GatedDeltaNet(ModelArgs.from_dict(HYBRID), 0)
    mx.eval(layer(mx.random.normal((1, deltanet.STEPS_UP_TO, 32)), None, layer.make_cache()))
    assert calls == {"chunked": 0, "steps": 1}
    mx.eval(layer(mx.random.normal((1, deltanet.STEPS_UP_TO + 1, 32)), None, layer.make_cache()))
    assert calls == {"chunked": 1, "steps": 1}
