"""The attention-map example recomputes weights the fused kernel never shows: they must
be the weights the model really uses (weights @ V -> o_proj == the module's output)."""

import importlib.util
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlx_tfm.loading import load_model

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "attention_maps.py"


def load_example():
    spec = importlib.util.spec_from_file_location("attention_maps", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_recomputed_attention_reproduces_the_attention_output(stories_hf):
    example = load_example()
    model, _ = load_model(stories_hf)
    x = mx.random.normal((1, 9, model.args.hidden_size))
    attn = model.layers[2].self_attn
    weights = example.attention_weights(attn, x)  # (heads, L, L)
    assert np.allclose(np.array(weights.sum(-1)), 1.0, atol=1e-5)
    assert np.all(np.triu(np.array(weights), k=1) == 0)  # nothing from the future
    values = attn.v_proj(x).reshape(1, 9, attn.n_kv_heads, attn.head_dim).transpose(0, 2, 1, 3)
    values = mx.repeat(values, attn.n_heads // attn.n_kv_heads, axis=1)[0]  # (heads, L, head_dim)
    out = attn.o_proj((weights @ values).transpose(1, 0, 2).reshape(1, 9, -1))
    np.testing.assert_allclose(np.array(out), np.array(attn(x, "causal")), atol=1e-5)


def test_attention_maps_png_is_written(stories_hf, tmp_path):
    import subprocess
    import sys

    out = tmp_path / "attention.png"
    subprocess.run([sys.executable, str(EXAMPLE), "--model", str(stories_hf), "--out", str(out)], check=True)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
