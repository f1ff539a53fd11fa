"""A config whose attention head counts do not fit is one line naming the numbers, from
`mlx-tfm generate --model` and from `mlx-tfm convert`, never a traceback."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import save_file

HIDDEN, INTERMEDIATE, VOCAB, LAYERS = 32, 64, 512, 2


def llama_weights(n_heads: int, n_kv_heads: int, head_dim: int) -> dict[str, np.ndarray]:
    """Random weights of exactly the shapes such a config asks for (tied embeddings), so
    only the head counts themselves can be wrong."""
    rng = np.random.default_rng(0)
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,)}
    for i in range(LAYERS):
        prefix = f"model.layers.{i}."
        shapes.update({
            prefix + "self_attn.q_proj.weight": (n_heads * head_dim, HIDDEN),
            prefix + "self_attn.k_proj.weight": (n_kv_heads * head_dim, HIDDEN),
            prefix + "self_attn.v_proj.weight": (n_kv_heads * head_dim, HIDDEN),
            prefix + "self_attn.o_proj.weight": (HIDDEN, n_heads * head_dim),
            prefix + "mlp.gate_proj.weight": (INTERMEDIATE, HIDDEN),
            prefix + "mlp.up_proj.weight": (INTERMEDIATE, HIDDEN),
            prefix + "mlp.down_proj.weight": (HIDDEN, INTERMEDIATE),
            prefix + "input_layernorm.weight": (HIDDEN,),
            prefix + "post_attention_layernorm.weight": (HIDDEN,),
        })  # fmt: skip
    return {name: (0.02 * rng.standard_normal(shape)).astype(np.float32) for name, shape in shapes.items()}


def model_folder(folder, stories_hf, heads: dict, weight_head_dim: int):
    folder.mkdir()
    config = {
        "model_type": "llama", "hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE, "num_hidden_layers": LAYERS,
        "vocab_size": VOCAB, "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
        **heads,
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    n_heads = max(heads["num_attention_heads"], 1)
    n_kv_heads = max(heads.get("num_key_value_heads", n_heads), 1)  # no tensor has fewer rows than that
    save_file(llama_weights(n_heads, n_kv_heads, weight_head_dim), str(folder / "model.safetensors"))
    for name in ("tokenizer.model", "tokenizer_config.json"):
        shutil.copy(stories_hf / name, folder / name)
    return folder


def mlx_tfm(*args):
    return subprocess.run([sys.executable, "-m", "mlx_tfm", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})


def assert_one_line_error(result, *fragments):
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stderr.startswith("error: ") and len(result.stderr.strip().splitlines()) == 1, result.stderr
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr


BAD_HEADS = [
    # heads, the head_dim the weights were made with, what the message must say
    ({"num_attention_heads": 4, "num_key_value_heads": 3}, 8,
     "num_attention_heads (4) is not a multiple of num_key_value_heads (3)"),
    ({"num_attention_heads": 5, "num_key_value_heads": 5}, 6,
     "hidden_size (32) is not divisible by num_attention_heads (5)"),
    ({"num_attention_heads": 0}, 8, "num_attention_heads must be at least 1, not 0"),
    ({"num_attention_heads": 4, "num_key_value_heads": -2}, 8, "num_key_value_heads must be at least 1, not -2"),
]  # fmt: skip


@pytest.mark.parametrize("heads,weight_head_dim,message", BAD_HEADS)
def test_generate_names_the_head_counts(heads, weight_head_dim, message, stories_hf, tmp_path):
    folder = model_folder(tmp_path / "m", stories_hf, heads, weight_head_dim)
    result = mlx_tfm("generate", "--model", str(folder), "--prompt", "Once", "--max-tokens", "3")
    assert_one_line_error(result, str(folder), message)


@pytest.mark.parametrize("heads,weight_head_dim,message", BAD_HEADS[:2])
def test_convert_names_the_head_counts_and_writes_nothing(heads, weight_head_dim, message, stories_hf, tmp_path):
    folder = model_folder(tmp_path / "m", stories_hf, heads, weight_head_dim)
    result = mlx_tfm("convert", "--hf-path", str(folder), "--mlx-path", str(tmp_path / "out"))
    assert_one_line_error(result, message)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_a_head_dim_that_does_not_divide_the_width_is_fine_when_given(stories_hf, tmp_path):
    """hidden_size need not be heads x head_dim when the config says head_dim (Gemma)."""
    heads = {"num_attention_heads": 5, "num_key_value_heads": 5, "head_dim": 8}
    folder = model_folder(tmp_path / "m", stories_hf, heads, 8)
    result = mlx_tfm("generate", "--model", str(folder), "--prompt", "Once", "--max-tokens", "3")
    assert result.returncode == 0, result.stderr
