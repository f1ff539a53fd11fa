"""Draw a model's attention maps for a prompt: one panel per layer, heads averaged.

    python examples/attention_maps.py --model ../shared/data/stories260K-hf \
        --prompt "Once upon a time, there was a little girl named Lily." --out attention.png

The model computes attention inside the fused kernel and never materialises the weights;
this script recomputes them from the same modules (norm -> q/k projections -> RoPE ->
softmax(q k^T * scale) under the causal mask), layer by layer, for pictures only.
"""

import argparse

import mlx_tfm  # noqa: F401  (before mlx: BLAS routing)
import mlx.core as mx
import numpy as np

from mlx_tfm.cache import window_mask


def attention_weights(attn, x: mx.array) -> mx.array:
    """softmax(Q K^T * scale) of one Attention module for input x (1, L, D) -> (heads, L, L)."""
    _, L, _ = x.shape
    # (1, L, heads * head_dim) -> (1, heads, L, head_dim)
    queries = attn.q_proj(x).reshape(1, L, attn.n_heads, attn.head_dim).transpose(0, 2, 1, 3)
    keys = attn.k_proj(x).reshape(1, L, attn.n_kv_heads, attn.head_dim).transpose(0, 2, 1, 3)
    if attn.qk_norm:
        queries, keys = attn.q_norm(queries), attn.k_norm(keys)
    if attn.rope is not None:
        queries, keys = attn.rope(queries, 0), attn.rope(keys, 0)
    # GQA: each group of n_heads / n_kv_heads query heads reads one KV head.
    keys = mx.repeat(keys, attn.n_heads // attn.n_kv_heads, axis=1)
    scores = (queries * attn.scale) @ keys.transpose(0, 1, 3, 2)  # (1, heads, L, L)
    positions = mx.arange(L)
    scores = mx.where(window_mask(positions, positions, None), scores, -mx.inf)
    return mx.softmax(scores, axis=-1)[0]


def layer_attention(model, tokens: mx.array) -> list[np.ndarray]:
    """Per layer, the heads' average attention (L, L), following the residual stream."""
    maps = []
    h = model.model.embed_tokens(tokens)
    for layer in model.layers:
        normed = layer.input_layernorm(h) if layer.placement != "post" else h
        maps.append(np.array(attention_weights(layer.self_attn, normed).mean(axis=0)))
        h = layer(h, "causal")
    return maps


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompt", default="Once upon a time, there was a little girl named Lily.")
    parser.add_argument("--out", default="attention.png")
    args = parser.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    model, tokenizer = mlx_tfm.load(args.model)
    ids = tokenizer.encode(args.prompt)
    labels = [tokenizer.decode([i]) or "<s>" for i in ids]
    maps = layer_attention(model, mx.array([ids]))
    fig, axes = plt.subplots(1, len(maps), figsize=(4 * len(maps), 4.4), squeeze=False)
    for i, (ax, weights) in enumerate(zip(axes[0], maps)):
        ax.imshow(weights, cmap="viridis", vmin=0, vmax=1)
        ax.set_title(f"layer {i}")
        ax.set_xticks(range(len(labels)), labels, rotation=90, fontsize=6)
        ax.set_yticks(range(len(labels)), labels, fontsize=6)
    fig.suptitle("attention (heads averaged; rows: queries, columns: keys)")
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
