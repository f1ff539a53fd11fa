"""LoRA on tiny Qwen3-Next-like (Gated DeltaNet between attention layers, experts) and
Mamba-2-like models, on the wikisql example set the package ships (``mlx-tfm
example-data``): adapters go on the recurrent mixers' projections, the loss falls over a
few dozen steps, and the fused model computes what the adapted one does."""

from __future__ import annotations

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
import pytest
from fixtures.hybrid_models import tiny_family_model

from mlx_tfm.cli.example_data import ASSETS
from mlx_tfm.datasets import load_split
from mlx_tfm.model.lora import LoRALinear, apply_lora, fuse_adapters
from mlx_tfm.tokenizer import load_tokenizer
from mlx_tfm.training.data import LengthGroupedBatches
from mlx_tfm.training.trainer import TrainingArgs, evaluate, train

STEPS = 30


@pytest.fixture(scope="module")
def wikisql(stories_hf):
    examples = load_split(ASSETS / "wikisql", "train", load_tokenizer(stories_hf), max_seq_length=40)[:32]
    return LengthGroupedBatches(examples, batch_size=4, seed=0)


@pytest.mark.parametrize("case,adapted", [("qwen3_next", "linear_attn.in_proj_qkv"), ("mamba2", "mamba.in_proj")])
def test_lora_on_recurrent_mixers_lowers_the_wikisql_loss_and_fuses(wikisql, case, adapted):
    model = tiny_family_model(case)
    apply_lora(model, num_layers=0, rank=4, scale=10.0)
    block = model.layers[0]
    mixer_attribute, projection = adapted.split(".")
    assert isinstance(getattr(getattr(block, mixer_attribute), projection), LoRALinear)
    held_out = wikisql.evaluation(2)
    before = evaluate(model, held_out)
    args = TrainingArgs(batch_size=4, iters=STEPS, val_batches=1, steps_per_report=100, steps_per_eval=100,
                        steps_per_save=1000)
    losses = train(model, optim.Adam(learning_rate=1e-2), wikisql.batch, None, args)
    after = evaluate(model, held_out)
    assert len(losses) == STEPS and after < 0.8 * before, (before, after)
    tokens = mx.array(held_out[0].tokens[:1])
    adapted_logits = np.array(model(tokens))
    fuse_adapters(model)
    assert not any(isinstance(m, LoRALinear) for _, m in model.named_modules())
    np.testing.assert_allclose(np.array(model(tokens)), adapted_logits, atol=1e-3)
