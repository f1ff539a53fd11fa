"""AWQ (`convert -q --awq`): scaling keeps the float function, the searches lower the
quantized error they measure, and on the shipped model the calibrated 3-bit folder reads
held-out stories with a lower perplexity than plain 3-bit rounding."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import data_path
from fixtures.cli_runs import convert_error

import mlx_tfm
from mlx_tfm.cli import main
from mlx_tfm.convert.awq import awq_weights, clip_search, search_scale
from mlx_tfm.convert.converter import check_source, convert, read_source
from mlx_tfm.errors import UserError
from mlx_tfm.generation.perplexity import perplexity
from mlx_tfm.loading import load, load_model
from mlx_tfm.weights.build import build_model

SHIPPED = Path(mlx_tfm.__file__).parent / "assets" / "default-model"
QUIET = dict(log=lambda *_: None)
IDS = mx.array([[1, 403, 407, 261, 378, 432, 383, 286, 261, 376, 298]])


def quantized_error(x, w, group_size=32, bits=3, s=None):
    s = mx.ones((w.shape[1],)) if s is None else s
    rounded = mx.dequantize(*mx.quantize(w * s, group_size, bits), group_size, bits) / s
    return mx.mean(mx.square(x @ rounded.T - x @ w.T)).item()


@pytest.fixture(scope="module")
def calibration() -> str:
    return str(data_path("stories260K") / "samples_calibration.txt")


@pytest.mark.parametrize("model", ["shipped", "stories"])
def test_scaling_alone_keeps_the_float_function(model, calibration, stories_hf):
    """Without clipping, every 1/s lands where it cancels: same logits in float (stories'
    down_proj reads 172 features, no multiple of 32, so its group is skipped)."""
    folder = SHIPPED if model == "shipped" else stories_hf
    source = read_source(folder)
    _, weights = check_source(source, folder)
    scaled = awq_weights(source.config, weights, folder, calibration, 32, 3, samples=4, sequence_length=64,
                         clip=False, **QUIET)
    changed = [name for name in weights if not mx.array_equal(scaled[name], weights[name]).item()]
    assert any("norm" in n for n in changed) and any("up_proj" in n for n in changed)
    before = build_model(source.config, weights, folder)(IDS)
    after = build_model(source.config, scaled, folder)(IDS)
    np.testing.assert_allclose(np.array(after), np.array(before), atol=1e-4, rtol=0)


def test_scale_search_protects_outlier_channels():
    """Inputs with a few large channels: the scale found rounds their weights more finely,
    lowering the error of the quantized product well below plain rounding's."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 128)).astype(np.float32)
    x[:, :4] *= 30  # four outlier channels
    w = mx.array(rng.normal(size=(64, 128)).astype(np.float32))
    x = mx.array(x)
    s = search_scale(x, [w], 32, 3)
    assert quantized_error(x, w, s=s) < 0.7 * quantized_error(x, w)


def test_clip_search_never_loses_to_the_full_range():
    """Heavy-tailed weights: clipping each group's range where it helps lowers each
    group's output error, so the total error too, against quantizing the full range."""
    rng = np.random.default_rng(1)
    x = mx.array(rng.normal(size=(256, 128)).astype(np.float32))
    w = mx.array(rng.standard_t(2, size=(64, 128)).astype(np.float32))
    clipped = clip_search(x, w, 32, 3)
    rounded = mx.dequantize(*mx.quantize(clipped, 32, 3), 32, 3)
    full = mx.dequantize(*mx.quantize(w, 32, 3), 32, 3)
    error = mx.mean(mx.square(x @ rounded.T - x @ w.T)).item()
    assert error < mx.mean(mx.square(x @ full.T - x @ w.T)).item()


def test_awq_3bit_reads_held_out_stories_better_than_plain_3bit(tmp_path, calibration):
    held_out = str(data_path("stories260K") / "samples_heldout.txt")
    results = {}
    for method in ("plain", "awq"):
        awq = dict(data=calibration, samples=32, sequence_length=128) if method == "awq" else None
        out = convert(SHIPPED, tmp_path / method, quantize=True, q_bits=3, q_group_size=64, awq=awq, **QUIET)
        model, tokenizer = load(out)
        results[method] = perplexity(model, tokenizer, held_out, sequence_length=128).perplexity
    assert results["awq"] < results["plain"] - 0.05, results


def test_cli_awq_and_its_refusals(tmp_path, calibration, capsys):
    assert main(["convert", "--hf-path", str(SHIPPED), "--mlx-path", str(tmp_path / "awq"), "-q", "--awq",
                 "--calibration-data", calibration, "--awq-num-samples", "2", "--awq-sequence-length", "64"]) == 0
    model, _ = load_model(tmp_path / "awq")
    assert model.layers[0].mlp.up_proj.bits == 4
    assert "needs --calibration-data" in convert_error(capsys, "--hf-path", SHIPPED, "--mlx-path", tmp_path / "a",
                                                       "-q", "--awq")
    assert "pass -q too" in convert_error(capsys, "--hf-path", SHIPPED, "--mlx-path", tmp_path / "b", "--awq",
                                          "--calibration-data", calibration)
    assert "fewer than one window" in convert_error(capsys, "--hf-path", SHIPPED, "--mlx-path", tmp_path / "c", "-q",
                                                    "--awq", "--calibration-data", calibration,
                                                    "--awq-sequence-length", "100000")
    assert "does not exist" in convert_error(capsys, "--hf-path", SHIPPED, "--mlx-path", tmp_path / "d", "-q",
                                             "--awq", "--calibration-data", tmp_path / "missing.txt")
    assert not any((tmp_path / name).exists() for name in "abcd")


def test_awq_refuses_what_it_cannot_scale(tmp_path, calibration):
    """Norms that scale by (offset + w), as Gemma's: 1/s cannot be folded into w alone."""
    import json
    import shutil

    folder = tmp_path / "offset"
    shutil.copytree(SHIPPED, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "norm_weight_offset": 1.0}))
    source = read_source(folder)
    _, weights = check_source(source, folder)
    with pytest.raises(UserError, match="--awq supports pre-norm attention.*offset norms"):
        awq_weights(source.config, weights, folder, calibration, 32, 4, **QUIET)
