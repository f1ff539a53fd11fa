"""PNG plots of a training run: the loss curve and per-layer gradient norms.

matplotlib is imported inside each function (with the file-only Agg backend), so training
without plots never pays for it.
"""

from __future__ import annotations

from pathlib import Path

from ..atomic import atomic_file


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_losses(path: Path, train: list[tuple[int, float]], valid: list[tuple[int, float]], title: str = "") -> None:
    """Training loss per step and validation loss at its steps, on one chart."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    if train:
        ax.plot(*zip(*train), label="train", linewidth=1)
    if valid:
        ax.plot(*zip(*valid), "o-", label="validation", markersize=4)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_title(title or "loss")
    ax.grid(alpha=0.3)
    ax.legend()
    _save(fig, path)


def plot_grad_norms(path: Path, steps: list[int], norms: list[list[float]], title: str = "") -> None:
    """Left: each layer's gradient norm over the steps (log scale); right: the mean
    norm per layer, which shows at a glance whether early layers' gradients vanish."""
    import numpy as np

    plt = _pyplot()
    values = np.asarray(norms, dtype=np.float64)  # (steps, layers)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4), dpi=100)
    cmap = plt.get_cmap("viridis")
    n_layers = values.shape[1]
    for layer in range(n_layers):
        left.plot(steps, np.maximum(values[:, layer], 1e-30), color=cmap(layer / max(n_layers - 1, 1)), linewidth=1)
    left.set_yscale("log")
    left.set_xlabel("step")
    left.set_ylabel("gradient L2 norm (dark: first layer)")
    right.plot(range(n_layers), np.maximum(values.mean(axis=0), 1e-30), "o-")
    right.set_yscale("log")
    right.set_xlabel("layer")
    right.set_ylabel("mean gradient L2 norm")
    for ax in (left, right):
        ax.grid(alpha=0.3)
    fig.suptitle(title or "per-layer gradient norms")
    _save(fig, path)


def plot_grad_norm_profiles(path: Path, profiles: dict[str, list[float]], title: str = "") -> None:
    """One line per configuration: mean gradient norm against layer index."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    for label, values in profiles.items():
        ax.plot(range(len(values)), [max(v, 1e-30) for v in values], "o-", label=label, markersize=3)
    ax.set_yscale("log")
    ax.set_xlabel("layer (0 = nearest the embeddings)")
    ax.set_ylabel("gradient L2 norm")
    ax.set_title(title or "gradient norm by depth")
    ax.grid(alpha=0.3)
    ax.legend()
    _save(fig, path)


def _save(fig, path: Path) -> None:
    plt = _pyplot()
    with atomic_file(path) as tmp:
        fig.savefig(tmp, format="png", bbox_inches="tight")
    plt.close(fig)
