"""The pictures of `mlx-tfm inspect`, read from the matplotlib figures they save: the
comparison's legend names each part with the colour of its bars and sits beside them,
attention maps carry a few readable token labels and a colour bar."""

from __future__ import annotations

import numpy as np
import pytest

from mlx_tfm.inspect.compare import TensorChange
from mlx_tfm.inspect.pictures import attention_heads_figure, comparison_figure

PARTS = ["self_attn.q_proj.weight", "self_attn.v_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight"]
MOST_TICKS = 8  # "a few" labels per axis
SMALLEST_POINTS = 8  # readable at the saved size


@pytest.fixture
def changes() -> list[TensorChange]:
    rng = np.random.default_rng(0)
    names = ["model.embed_tokens.weight"] + [f"model.layers.{i}.{part}" for i in range(3) for part in PARTS]
    names.append("model.norm.weight")
    return [TensorChange(name, None, (4, 4), 1.0, float(rng.uniform(0.01, 0.1))) for name in names]


def data_axes(fig) -> list:
    return [ax for ax in fig.axes if ax.patches or ax.images]


def test_the_comparison_legend_names_each_part_in_its_colour_beside_the_bars(changes):
    fig = comparison_figure(changes)
    _, per_tensor = data_axes(fig)
    legend = per_tensor.get_legend()
    labels = [text.get_text() for text in legend.get_texts()]
    assert labels == ["outside the blocks", *PARTS]
    colours = [tuple(handle.get_facecolor()) for handle in legend.legend_handles]
    assert len(set(colours)) == len(labels)  # one colour per part, no two alike
    bars = per_tensor.patches
    assert len(bars) == len(changes)
    for bar, change in zip(bars, changes):  # each bar has its part's colour in the legend
        part = change.name.split(".", 3)[3] if change.name.startswith("model.layers.") else "outside the blocks"
        assert tuple(bar.get_facecolor()) == colours[labels.index(part)]
    fig.canvas.draw()
    box = legend.get_window_extent()
    for ax in data_axes(fig):
        assert not box.overlaps(ax.get_window_extent()), "the legend covers the bars"
    assert fig.bbox.contains(box.x0, box.y0) and fig.bbox.contains(box.x1, box.y1)  # room was made for it


@pytest.mark.parametrize("n_heads,length", [(8, 14), (10, 60)])
def test_attention_maps_have_a_few_readable_token_labels_and_a_colour_bar(n_heads, length):
    rng = np.random.default_rng(0)
    weights = np.tril(rng.random((n_heads, length, length)))
    weights /= weights.sum(axis=-1, keepdims=True)
    labels = [f"tok{i}" for i in range(length)]
    fig = attention_heads_figure(weights, labels, layer=2)
    panels = [ax for ax in fig.axes if ax.images]
    assert len(panels) == n_heads
    named = {"x": 0, "y": 0}
    for ax in panels:
        for axis, ticks, names in (("x", ax.get_xticks(), ax.get_xticklabels()),
                                   ("y", ax.get_yticks(), ax.get_yticklabels())):
            assert 2 <= len(ticks) <= MOST_TICKS
            if not names:  # an inner panel of the grid: its neighbours name the positions
                continue
            named[axis] += 1
            assert min(name.get_fontsize() for name in names) >= SMALLEST_POINTS
            expected = [labels[int(t)] if length <= 48 else str(int(t)) for t in ticks]
            assert [name.get_text() for name in names] == expected  # each label names its own row or column
    rows = -(-n_heads // 8)
    assert named == {"x": min(n_heads, 8), "y": rows}  # the bottom panel of each column, the first of each row
    (colorbar,) = [ax.images[0].colorbar for ax in panels if ax.images[0].colorbar is not None]  # one for the figure
    assert colorbar.ax in fig.axes and colorbar.ax not in panels
    assert (colorbar.vmin, colorbar.vmax) == (0, 1)
    assert all(ax.images[0].norm.vmin == 0 and ax.images[0].norm.vmax == 1 for ax in panels)  # one scale for all
    assert min(label.get_fontsize() for label in colorbar.ax.get_yticklabels()) >= SMALLEST_POINTS
