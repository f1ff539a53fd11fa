"""mlx-tfm inspect on Gated DeltaNet, Mamba-2, MLA and Falcon-H1 layers: each layer kind's
mixer parameters are its mixers' own, and its cache bytes are what generation keeps
after that many positions (a fixed state, MLA's latents and rotary keys, keys and values
plus the Mamba-2 state beside them)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from fixtures.hybrid_models import tiny_family_model
from mlx.utils import tree_flatten

from mlx_tfm.inspect.architecture import kv_cache_bytes
from mlx_tfm.inspect.layer_kinds import layer_kinds
from mlx_tfm.inspect.parts import model_parts

CONTEXT = 7


def held_bytes(layer_cache) -> int:
    """Bytes of what a layer cache holds (its state arrays, without spare capacity)."""
    return sum(a.nbytes for _, a in tree_flatten(layer_cache.state))


@pytest.mark.parametrize("case,kinds", [("qwen3_next", ["linear_attention", "full_attention"]),
                                        ("mamba2", ["mamba"]),
                                        ("deepseek_v3", ["full_attention"]),
                                        ("falcon_h1", ["full_attention"])])
def test_layer_kinds_report_the_mixers_parameters_and_the_bytes_generation_keeps(case, kinds):
    model = tiny_family_model(case)  # float32 weights and caches
    cache = model.make_cache()
    model(mx.array([list(range(1, CONTEXT + 1))]), cache=cache)
    mx.eval([c.state for c in cache])
    rows = {row["kind"]: row for row in layer_kinds(model, model_parts(model), context=CONTEXT, dtype_bytes=4)}
    assert list(rows) == kinds
    for kind, row in rows.items():
        layers = [i for i, t in enumerate(model.args.layer_types) if t == kind]
        own = sum(a.size for i in layers for _, a in tree_flatten(model.layers[i].mixer.parameters()))
        assert row["mixer_parameters"] == own, kind
        assert row["recurrent"] == (kind not in ("full_attention",))
        assert {held_bytes(cache[i]) for i in layers} == {row["cache_bytes_per_layer"]}, kind


def test_mla_caches_one_latent_and_one_rotary_key_per_position():
    args = tiny_family_model("deepseek_v3").args
    per_position = (args.kv_lora_rank + args.qk_rope_head_dim) * 2  # float16, shared by every head
    assert kv_cache_bytes(args, 10) == {"per_token": per_position * args.num_hidden_layers,
                                        "at_context": 10 * per_position * args.num_hidden_layers}


def test_falcon_h1_counts_the_state_beside_its_attention():
    model = tiny_family_model("falcon_h1")
    row = layer_kinds(model, model_parts(model), context=CONTEXT, dtype_bytes=4)[0]
    state = model.make_cache()[0].mamba
    model.layers[0].mamba(mx.zeros((1, 1, model.args.hidden_size)), None, state)
    assert row["state_bytes_beside_attention"] == held_bytes(state) > 0
