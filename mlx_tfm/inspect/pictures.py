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

HEADS_PER_ROW = 8
LABELLED_TOKENS = 48  # beyond this many tokens the axes show positions, not tokens
# An attention map labels a few positions, in type big enough to read at the saved size:
# a label per token would be too small to read (or overlap) once a panel holds many.
MAP_TICKS = 6
MAP_TICK_POINTS = 8


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
    """Token labels on the axes asked for, none past ``LABELLED_TOKENS`` tokens."""
    ax.set_xticks([])
    ax.set_yticks([])
    if len(labels) > LABELLED_TOKENS:
        return
    if x:
        ax.set_xticks(range(len(labels)), labels, rotation=90, fontsize=fontsize)
    if y:
        ax.set_yticks(range(len(labels)), labels, fontsize=fontsize)


def _map_ticks(ax, labels: list[str], x: bool, y: bool) -> None:
    """``MAP_TICKS`` positions, the first and the last among them, named by their token
    (by their number past ``LABELLED_TOKENS`` tokens); the names shown only on the axes
    asked for (a grid names its outer panels: text is most of a picture's drawing time)."""
    positions = sorted({int(p) for p in np.linspace(0, len(labels) - 1, min(len(labels), MAP_TICKS)).round()})
    names = [labels[p] if len(labels) <= LABELLED_TOKENS else str(p) for p in positions]
    ax.set_xticks(positions, names, rotation=90, fontsize=MAP_TICK_POINTS)
    ax.set_yticks(positions, names, fontsize=MAP_TICK_POINTS)
    ax.tick_params(labelbottom=x, labelleft=y)


def attention_grid(maps: list[np.ndarray], titles: list[str], labels: list[str], cols: int, panel_inches: float,
                   title: str):
    """A figure of attention maps (rows: queries, columns: keys), one panel each, and the
    colour bar of their weights (0..1)."""
    plt = _pyplot()
    rows = math.ceil(len(maps) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(panel_inches * cols + 1, panel_inches * rows + 0.8),
                             squeeze=False, layout="constrained")
    for index, ax in enumerate(axes.flat):
        if index >= len(maps):
            ax.axis("off")
            continue
        image = ax.imshow(maps[index], cmap="viridis", vmin=0, vmax=1)
        ax.set_title(titles[index], fontsize=10)
        _map_ticks(ax, labels, x=index + cols >= len(maps), y=index % cols == 0)
    colorbar = fig.colorbar(image, ax=axes, shrink=min(1.0, 0.9 / rows ** 0.5), pad=0.01)
    colorbar.set_label("attention weight", fontsize=MAP_TICK_POINTS + 1)
    colorbar.ax.tick_params(labelsize=MAP_TICK_POINTS)
    fig.suptitle(title)
    return fig


def attention_heads_figure(weights: np.ndarray, labels: list[str], layer: int):
    """One layer: a panel per head, weights (n_heads, L, L)."""
    n_heads = weights.shape[0]
    return attention_grid(list(weights), [f"head {h}" for h in range(n_heads)], labels, min(n_heads, HEADS_PER_ROW),
                          2.3, f"layer {layer}: attention per head (rows: queries, columns: keys)")


def attention_heads(path: Path, weights: np.ndarray, labels: list[str], layer: int) -> Path:
    """``attention_heads_figure`` as a PNG at ``path``."""
    return _save(attention_heads_figure(weights, labels, layer), path, dpi=100)


def attention_layers(path: Path, maps: list[np.ndarray], labels: list[str]) -> Path:
    """Every layer in one picture, its heads averaged."""
    fig = attention_grid([m.mean(axis=0) for m in maps], [f"layer {i}" for i in range(len(maps))], labels,
                         min(len(maps), 6), 3.2, "attention, heads averaged (rows: queries, columns: keys)")
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


def comparison_figure(changes: list[TensorChange]):
    """Top: the relative change per block (and outside the blocks); bottom: per tensor,
    in the model's order, coloured by its part of the block, with a legend of the parts
    beside the bars (never over them)."""
    from matplotlib.patches import Patch

    plt = _pyplot()
    groups = layer_changes(changes)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(7.0, 0.12 * len(changes) + 3) + 3, 6.5),
                                      layout="constrained")
    names = ["outside" if g.layer is None else str(g.layer) for g in groups]
    top.bar(names, [_finite(g.relative) for g in groups], color="tab:blue")
    top.set_xlabel("block")
    top.set_ylabel("||B - A|| / ||A||")
    top.set_title("relative change per block (all its tensors together)")
    parts = [c.part for c in changes]
    palette = {part: plt.get_cmap("tab10")(i % 10) for i, part in enumerate(dict.fromkeys(parts))}
    bottom.bar(range(len(changes)), [_finite(c.relative) for c in changes], color=[palette[p] for p in parts],
               width=0.9)
    bottom.set_xlabel("tensor, in the model's order")
    bottom.set_ylabel("||B - A|| / ||A||")
    bottom.set_title("relative change per tensor")
    # One patch per part: bars drawn empty to label the legend take the default colour.
    bottom.legend(handles=[Patch(facecolor=color, label=part) for part, color in palette.items()], fontsize=8,
                  loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0, title="part of the block",
                  title_fontsize=8)
    for ax in (top, bottom):
        ax.grid(alpha=0.3, axis="y")
    return fig


def comparison(path: Path, changes: list[TensorChange]) -> Path:
    """``comparison_figure`` as a PNG at ``path``."""
    return _save(comparison_figure(changes), path)


__all__ = ["attention_heads", "attention_heads_figure", "attention_layers", "attention_grid", "residual_norms",
           "logit_lens", "comparison", "comparison_figure"]
