"""PNGs of a model's anatomy: attention maps, the residual stream's norm, the logit lens,
and what changed between two models. matplotlib (file-only Agg backend) is imported
inside each function, so inspecting without pictures never pays for it. Pictures are
kept small (80-100 dpi); every file is written whole or not at all."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from ..atomic import atomic_file
from .compare import TensorChange, layer_changes
from .parts import BLOCK

HEADS_PER_ROW = 8
LABELLED_TOKENS = 48  # beyond this many tokens the axes show positions, not tokens


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path, dpi: int = 90) -> Path:
    plt = _pyplot()
    with atomic_file(path) as tmp:
        fig.savefig(tmp, format="png", dpi=dpi, bbox_inches="tight")
    plt.close(fig)
    return path


def _token_axes(ax, labels: list[str], x: bool = True, y: bool = True, fontsize: int = 6) -> None:
    """Token labels on the axes asked for (text is most of a picture's drawing time, so
    a grid labels only its outer panels), none past ``LABELLED_TOKENS`` tokens."""
    ax.set_xticks([])
    ax.set_yticks([])
    if len(labels) > LABELLED_TOKENS:
        return
    if x:
        ax.set_xticks(range(len(labels)), labels, rotation=90, fontsize=fontsize)
    if y:
        ax.set_yticks(range(len(labels)), labels, fontsize=fontsize)


def _grid_axes(axes, index: int, drawn: int, labels: list[str], fontsize: int = 6) -> None:
    """Panel ``index`` of a grid of ``drawn`` panels: x labels where no panel is drawn
    below it, y labels on the first column."""
    cols = axes.shape[1]
    _token_axes(axes.flat[index], labels, x=index + cols >= drawn, y=index % cols == 0, fontsize=fontsize)


def attention_heads(path: Path, weights: np.ndarray, labels: list[str], layer: int) -> Path:
    """One layer: a panel per head (rows: queries, columns: keys), weights 0..1."""
    plt = _pyplot()
    n_heads = weights.shape[0]
    cols = min(n_heads, HEADS_PER_ROW)
    rows = math.ceil(n_heads / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(2.3 * cols, 2.5 * rows), squeeze=False)
    for head, ax in enumerate(axes.flat):
        if head >= n_heads:
            ax.axis("off")
            continue
        ax.imshow(weights[head], cmap="viridis", vmin=0, vmax=1)
        ax.set_title(f"head {head}", fontsize=8)
        _grid_axes(axes, head, n_heads, labels, fontsize=5)
    fig.suptitle(f"layer {layer}: attention per head (rows: queries, columns: keys)")
    fig.tight_layout()
    return _save(fig, path, dpi=80)


def attention_layers(path: Path, maps: list[np.ndarray], labels: list[str]) -> Path:
    """Every layer in one picture, its heads averaged."""
    plt = _pyplot()
    cols = min(len(maps), 6)
    rows = math.ceil(len(maps) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 3.4 * rows), squeeze=False)
    for layer, ax in enumerate(axes.flat):
        if layer >= len(maps):
            ax.axis("off")
            continue
        ax.imshow(maps[layer].mean(axis=0), cmap="viridis", vmin=0, vmax=1)
        ax.set_title(f"layer {layer}", fontsize=9)
        _grid_axes(axes, layer, len(maps), labels)
    fig.suptitle("attention, heads averaged (rows: queries, columns: keys)")
    fig.tight_layout()
    return _save(fig, path)


def residual_norms(path: Path, norms: np.ndarray, labels: list[str]) -> Path:
    """Each position's residual-vector norm through the layers (thin), and their mean."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    depth = np.arange(norms.shape[0])
    cmap = plt.get_cmap("viridis")
    for position in range(norms.shape[1]):
        ax.plot(depth, norms[:, position], color=cmap(position / max(norms.shape[1] - 1, 1)), linewidth=0.8,
                alpha=0.7)
    ax.plot(depth, norms.mean(axis=1), "k-o", linewidth=2, markersize=4, label="mean over positions")
    ax.set_xticks(depth, ["emb"] + [str(i) for i in range(norms.shape[0] - 1)])
    ax.set_xlabel("residual stream after the embeddings (emb) and after each block")
    ax.set_ylabel("L2 norm of the residual vector")
    ax.set_title("the residual stream's norm through the layers (colour: position, dark = first)")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)


def logit_lens(path: Path, top_tokens: list[list[str]], top_probs: np.ndarray, labels: list[str]) -> Path:
    """Rows: the stream after the embeddings and after each block; columns: positions;
    each cell the token that state predicts next, coloured by its probability."""
    plt = _pyplot()
    states, length = top_probs.shape
    fig, ax = plt.subplots(figsize=(max(6.0, 0.75 * length + 2), max(3.0, 0.38 * states + 1.5)))
    image = ax.imshow(top_probs, cmap="magma", vmin=0, vmax=1, aspect="auto")
    if length <= LABELLED_TOKENS and states <= LABELLED_TOKENS:
        for row in range(states):
            for col in range(length):
                color = "black" if top_probs[row, col] > 0.6 else "white"
                ax.text(col, row, top_tokens[row][col], ha="center", va="center", fontsize=6, color=color)
    _token_axes(ax, labels, y=False, fontsize=7)
    ax.set_yticks(range(states), ["emb"] + [f"block {i}" for i in range(states - 1)], fontsize=7)
    ax.invert_yaxis()  # the last block on top, as the stream rises
    ax.set_xlabel("input token (each column predicts the token after it)")
    ax.set_title("logit lens: each layer's residual through the final norm and the head")
    fig.colorbar(image, ax=ax, label="probability of the top token")
    return _save(fig, path)


def _finite(value: float) -> float:
    return value if math.isfinite(value) else float("nan")  # a tensor that was zero in A: no bar


def comparison(path: Path, changes: list[TensorChange]) -> Path:
    """Top: the relative change per block (and outside the blocks); bottom: per tensor,
    in the model's order, coloured by its name in the block."""
    plt = _pyplot()
    groups = layer_changes(changes)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(7.0, 0.12 * len(changes) + 3), 6.5))
    names = ["outside" if g.layer is None else str(g.layer) for g in groups]
    top.bar(names, [_finite(g.relative) for g in groups], color="tab:blue")
    top.set_xlabel("block")
    top.set_ylabel("||B - A|| / ||A||")
    top.set_title("relative change per block (all its tensors together)")
    kinds = [BLOCK.fullmatch(c.name).group(2) if BLOCK.fullmatch(c.name) else "outside the blocks" for c in changes]
    palette = {kind: plt.get_cmap("tab10")(i % 10) for i, kind in enumerate(dict.fromkeys(kinds))}
    bottom.bar(range(len(changes)), [_finite(c.relative) for c in changes], color=[palette[k] for k in kinds],
               width=0.9)
    for kind, color in palette.items():
        bottom.bar([], [], color=color, label=kind)
    bottom.set_xlabel("tensor, in the model's order")
    bottom.set_ylabel("||B - A|| / ||A||")
    bottom.set_title("relative change per tensor")
    bottom.legend(fontsize=6, ncol=3)
    for ax in (top, bottom):
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    return _save(fig, path)


__all__ = ["attention_heads", "attention_layers", "residual_norms", "logit_lens", "comparison"]
