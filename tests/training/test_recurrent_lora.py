"""LoRA on an LFM2-like model (short convolutions between attention layers): adapters go
on the conv layers' projections too, the loss on a short synthetic set falls, and the
fused model computes what the adapted one does."""

from __future__ import annotations

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from fixtures.recurrent_models import tiny_lfm2

from mlx_tfm.model.lora import LoRALinear, apply_lora, fuse_adapters
from mlx_tfm.training.data import pad_batch
from mlx_tfm.training.trainer import TrainingArgs, evaluate, train

# a counting pattern: easy to learn, so a few steps lower the loss clearly
EXAMPLES = [([(start + i) % 50 + 10 for i in range(16)], 0) for start in range(8)]


def batches():
    return pad_batch(EXAMPLES)


def test_lora_on_conv_layers_lowers_the_loss_and_fuses():
    model = tiny_lfm2()
    apply_lora(model, num_layers=0, rank=4, scale=10.0)
    assert isinstance(model.layers[0].conv.in_proj, LoRALinear) and isinstance(model.layers[0].conv.out_proj, LoRALinear)
    tokens = mx.array([EXAMPLES[0][0]])
    before = evaluate(model, [batches()])
    args = TrainingArgs(batch_size=8, iters=30, val_batches=1, steps_per_report=100, steps_per_eval=100,
                        steps_per_save=1000)
    losses = train(model, optim.Adam(learning_rate=1e-2), lambda step: batches(), None, args)
    after = evaluate(model, [batches()])
    assert len(losses) == 30 and after < 0.7 * before
    adapted = np.array(model(tokens))
    fuse_adapters(model)
    assert not any(isinstance(m, LoRALinear) for _, m in model.named_modules())
    np.testing.assert_allclose(np.array(model(tokens)), adapted, atol=1e-4)
