"""A Llama folder made wider without changing what it computes, so that its rows fill
K-quant super-blocks (256 weights): the hidden size, each head and the FFN grow with zeros.

    python examples/widen_llama.py mlx_tfm/assets/default-model wide-model [--hidden 256 --head-dim 64]

Zero columns read the new hidden channels, which stay zero because every matrix writing to
them has zero rows there; the norms' mean over more channels is undone by scaling their
weights and epsilon by D / D'; each head's rotated pairs keep their frequencies (the real
dims stay at indices i and H'/2 + i, rope_theta ** (H' / H)); the queries are scaled by
sqrt(H' / H) for the wider head's 1 / sqrt(H'). So the logits are the source's (float
rounding apart), and llama.cpp and mlx_tfm run the same model with real K-quant blocks.
"""

import argparse
import json
import math
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np

NORMS = ("input_layernorm", "post_attention_layernorm", "model.norm")


def pad(w: np.ndarray, shape: tuple) -> np.ndarray:
    out = np.zeros(shape, np.float32)
    out[tuple(slice(0, n) for n in w.shape)] = w
    return out


def widen_heads(w: np.ndarray, n_heads: int, head_dim: int, new_head_dim: int, hidden: int, rotated: bool):
    """q/k/v rows (n_heads * head_dim, D) -> (n_heads * new_head_dim, hidden): a rotated
    head's halves at 0 and new_head_dim / 2 (its pairs), an unrotated one's dims first."""
    heads = w.reshape(n_heads, head_dim, -1)  # (n_heads, head_dim, D)
    out = np.zeros((n_heads, new_head_dim, hidden), np.float32)
    half, new_half = head_dim // 2, new_head_dim // 2
    if rotated:
        out[:, :half, : w.shape[1]] = heads[:, :half]
        out[:, new_half : new_half + half, : w.shape[1]] = heads[:, half:]
    else:
        out[:, :head_dim, : w.shape[1]] = heads
    return out.reshape(n_heads * new_head_dim, hidden)


def widen_weights(weights: dict, config: dict, hidden: int, head_dim: int, intermediate: int) -> dict:
    n_heads, n_kv = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    old_head = config.get("head_dim") or config["hidden_size"] // n_heads
    norm_scale = math.sqrt(config["hidden_size"] / hidden)
    out = {}
    for name, w in weights.items():
        if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
            heads = n_heads if "q_proj" in name else n_kv
            w = widen_heads(w, heads, old_head, head_dim, hidden, rotated="v_proj" not in name)
            w = w * math.sqrt(head_dim / old_head) if "q_proj" in name else w
        elif name.endswith("o_proj.weight"):  # columns follow v's layout: (D, n_heads, head_dim)
            columns = w.reshape(w.shape[0], n_heads, old_head)
            w = pad(columns, (hidden, n_heads, head_dim)).reshape(hidden, n_heads * head_dim)
        elif name.endswith(("gate_proj.weight", "up_proj.weight")):
            w = pad(w, (intermediate, hidden))
        elif name.endswith("down_proj.weight"):
            w = pad(w, (hidden, intermediate))
        elif any(norm in name for norm in NORMS):
            w = pad(w * norm_scale, (hidden,))
        else:  # the embedding and an untied head: (vocab, D)
            w = pad(w, (w.shape[0], hidden))
        out[name] = w
    return out


def widen(source: Path, target: Path, hidden: int = 256, head_dim: int | None = None,
          intermediate: int | None = None) -> Path:
    config = json.loads((source / "config.json").read_text())
    old_head = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    head_dim = head_dim or old_head * hidden // config["hidden_size"]
    intermediate = intermediate or -(-config["intermediate_size"] // 256) * 256
    weights = {k: np.array(v.astype(mx.float32)) for k, v in mx.load(str(source / "model.safetensors")).items()}
    wide = widen_weights(weights, config, hidden, head_dim, intermediate)
    eps_scale = config["hidden_size"] / hidden
    config.update(hidden_size=hidden, head_dim=head_dim, intermediate_size=intermediate,
                  rope_theta=config.get("rope_theta", 10000.0) ** (head_dim / old_head))
    for key in ("rms_norm_eps", "norm_eps"):
        if key in config:
            config[key] *= eps_scale
    if config.get("attention_scale"):
        config["attention_scale"] = head_dim**-0.5
    target.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(target / "model.safetensors"), {k: mx.array(v) for k, v in wide.items()},
                        metadata={"format": "mlx"})
    (target / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.model", "tokenizer.json", "tokenizer_config.json"):
        if (source / name).exists():
            shutil.copy(source / name, target / name)
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path)
    parser.add_argument("target", type=Path)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--head-dim", type=int, default=None)
    args = parser.parse_args()
    print(f"wrote {widen(args.source, args.target, args.hidden, args.head_dim)}")


if __name__ == "__main__":
    main()
