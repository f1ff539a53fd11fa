"""Fine-tuning hybrids: a Gated DeltaNet hybrid (Qwen3.5's text model: linear attention
between full attention layers) and a Mamba-2 hybrid (Nemotron-H: Mamba-2, MLP and
attention blocks), on the wikisql example set the package ships.

- QLoRA: LoRA on a 4-bit folder converted from a random transformers model; the loss
  falls, and the fused, dequantized model computes what the adapted one does;
- DoRA: the same on float weights;
- full fine-tuning: gradients reach the recurrent layers' own parameters (A_log, dt_bias,
  the convolution's taps), training moves them, and the loss falls."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest
from fixtures.convert_helpers import make_hf_model
from fixtures.hybrid_models import tiny_family_model
from mlx.utils import tree_flatten

from mlx_tfm.cli.example_data import ASSETS
from mlx_tfm.convert.converter import convert
from mlx_tfm.datasets import load_split
from mlx_tfm.loading import load_model
from mlx_tfm.model.lora import DoRALinear, LoRALinear, apply_lora, fuse_adapters
from mlx_tfm.tokenizer import load_tokenizer
from mlx_tfm.training.data import LengthGroupedBatches
from mlx_tfm.training.trainer import TrainingArgs, evaluate, loss_fn, train

STEPS = 30
# TINY_CONFIGS case -> (a block index with a recurrent mixer, its mixer attribute and one of its projections)
HYBRIDS = {
    "qwen3_5_text": (0, "linear_attn", "in_proj_qkv"),  # Gated DeltaNet
    "nemotron_h": (0, "mamba", "in_proj"),  # Mamba-2 (pattern M-*-M)
}
# the recurrent mixers' own parameters, which no adapter covers
RECURRENT_PARAMETERS = ("A_log", "dt_bias", "conv1d.weight")


@pytest.fixture(scope="module")
def wikisql(stories_hf):
    examples = load_split(ASSETS / "wikisql", "train", load_tokenizer(stories_hf), max_seq_length=40)[:32]
    return LengthGroupedBatches(examples, batch_size=4, seed=0)


def trained(model, wikisql, learning_rate: float = 1e-2) -> tuple[float, float]:
    """(held-out loss before, after) ``STEPS`` Adam steps on wikisql."""
    held_out = wikisql.evaluation(2)
    before = evaluate(model, held_out)
    args = TrainingArgs(batch_size=4, iters=STEPS, val_batches=1, steps_per_report=100, steps_per_eval=100,
                        steps_per_save=1000)
    losses = train(model, optim.Adam(learning_rate=learning_rate), wikisql.batch, None, args)
    assert len(losses) == STEPS and all(np.isfinite(losses))
    return before, evaluate(model, held_out)


def mixer_projection(model, case: str) -> nn.Module:
    layer, mixer, projection = HYBRIDS[case]
    return getattr(getattr(model.layers[layer], mixer), projection)


def assert_fused_matches(model, wikisql, dequantize: bool) -> None:
    tokens = mx.array(wikisql.evaluation(1)[0].tokens[:1])
    adapted = np.array(model(tokens))
    fuse_adapters(model, dequantize=dequantize)
    assert not any(isinstance(m, LoRALinear) for _, m in model.named_modules())
    if dequantize:
        assert not any(isinstance(m, nn.QuantizedLinear) for _, m in model.named_modules())
    np.testing.assert_allclose(np.array(model(tokens)), adapted, atol=1e-3, rtol=1e-4)


@pytest.fixture(scope="module", params=list(HYBRIDS))
def quantized_folder(request, tmp_path_factory):
    """A random transformers model of the case, converted to 4 bits (groups of 32)."""
    root = tmp_path_factory.mktemp(request.param)
    make_hf_model(request.param, root / "hf", vocab_size=512)
    convert(root / "hf", root / "q4", quantize=True, q_group_size=32, q_bits=4, log=lambda *_: None)
    return request.param, root / "q4"


def test_qlora_on_a_4bit_hybrid_folder_lowers_the_loss_and_fuses(wikisql, quantized_folder):
    case, folder = quantized_folder
    model, _ = load_model(folder)
    assert isinstance(mixer_projection(model, case), nn.QuantizedLinear)
    apply_lora(model, num_layers=0, rank=4, scale=10.0)
    adapter = mixer_projection(model, case)
    assert isinstance(adapter, LoRALinear) and isinstance(adapter.linear, nn.QuantizedLinear)
    before, after = trained(model, wikisql)
    assert after < 0.9 * before, (before, after)
    assert_fused_matches(model, wikisql, dequantize=True)


@pytest.mark.parametrize("case", list(HYBRIDS))
def test_dora_on_hybrids_lowers_the_loss_and_fuses(wikisql, case):
    model = tiny_family_model(case)
    apply_lora(model, num_layers=0, fine_tune_type="dora", rank=4, scale=10.0)
    assert isinstance(mixer_projection(model, case), DoRALinear)
    before, after = trained(model, wikisql)
    assert after < 0.8 * before, (before, after)
    assert_fused_matches(model, wikisql, dequantize=False)


def recurrent_entries(tree: dict, case: str) -> dict[str, mx.array]:
    """The recurrent parameters of the case's recurrent block, by name, from a parameter
    (or gradient) tree."""
    layer, mixer, _ = HYBRIDS[case]
    flat = dict(tree_flatten(tree))
    return {name: flat[f"model.layers.{layer}.{mixer}.{name}"] for name in RECURRENT_PARAMETERS}


@pytest.mark.parametrize("case", list(HYBRIDS))
def test_full_fine_tuning_reaches_the_recurrent_parameters(wikisql, case):
    model = tiny_family_model(case)
    apply_lora(model, num_layers=0, fine_tune_type="full")
    trainable = recurrent_entries(model.trainable_parameters(), case)
    batch = wikisql.batch(0)
    _, grads = nn.value_and_grad(model, loss_fn)(model, mx.array(batch.tokens), mx.array(batch.lengths))
    for name, grad in recurrent_entries(grads, case).items():
        assert grad.shape == trainable[name].shape and np.abs(np.array(grad)).max() > 1e-6, name
    initial = {name: np.array(value) for name, value in trainable.items()}
    before, after = trained(model, wikisql, learning_rate=3e-3)
    assert after < 0.8 * before, (before, after)
    for name, value in recurrent_entries(model.parameters(), case).items():
        assert np.abs(np.array(value) - initial[name]).max() > 1e-4, name
