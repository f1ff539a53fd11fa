"""Why residual connections and pre-norm: gradient norms per layer in a deep tiny model.

A 24-layer model (hidden 64) reads Shakespeare byte by byte. For four variants, the same
batches, the same seed:

    pre-norm + residual     x + f(norm(x))          (Llama, GPT-2 and nearly all since)
    post-norm + residual    norm(x + f(x))          (the original Transformer)
    pre-norm, no residual   f(norm(x))
    post-norm, no residual  norm(f(x))

it measures each block's gradient L2 norm at initialisation (the mean over a few batches)
and then trains each variant briefly with the same optimizer, recording the per-layer norms
at every step (what `--log-grad-norms` records) and the loss. Without the residual stream
the gradient reaching the first layers is orders of magnitude smaller than at the top
(it must pass through every block's Jacobian); with it, every layer gets a gradient of
similar size, and the model learns.

    python examples/residual_gradients.py            # writes residual_gradients.png
"""

from __future__ import annotations

import argparse
from pathlib import Path

import mlx_tfm  # noqa: F401  (BLAS routing before MLX)
import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

from mlx_tfm.model.transformer import Model
from mlx_tfm.model.config import ModelArgs
from mlx_tfm.training.data import ByteTokenizer, TokenWindows
from mlx_tfm.training.plots import plot_grad_norm_profiles
from mlx_tfm.training.trainer import TrainingArgs, layer_grad_norms, loss_fn, train

CORPUS = Path(__file__).resolve().parents[1] / "tests" / "data" / "tinyshakespeare" / "input.txt"
DEEP = dict(vocab_size=258, hidden_size=64, num_hidden_layers=24, num_attention_heads=4, intermediate_size=128)
VARIANTS = {
    "pre-norm + residual": dict(norm_placement="pre", residual=True),
    "post-norm + residual": dict(norm_placement="post", residual=True),
    "pre-norm, no residual": dict(norm_placement="pre", residual=False),
    "post-norm, no residual": dict(norm_placement="post", residual=False),
}


def build(variant: dict, seed: int) -> Model:
    mx.random.seed(seed)
    model = Model(ModelArgs.from_dict({**DEEP, **variant}))
    mx.eval(model.parameters())
    return model


def grad_norms_at_init(model: Model, batches) -> np.ndarray:
    """(n_layers,) mean per-block gradient norm of the loss over ``batches``."""
    loss_and_grad = nn.value_and_grad(model, loss_fn)
    norms = []
    for batch in batches:
        _, grads = loss_and_grad(model, mx.array(batch.tokens), mx.array(batch.lengths))
        norms.append(np.array(layer_grad_norms(grads)))
    return np.mean(norms, axis=0)


def train_briefly(model: Model, windows: TokenWindows, steps: int) -> tuple[list[float], np.ndarray]:
    """Train with AdamW; return the losses and the (steps, n_layers) gradient norms."""
    norms = []

    class Record:
        def on_step(self, step, loss, ntoks, info):
            norms.append(info["layer_grad_norms"])

        on_report = on_eval = on_save = lambda self, *a: None

    args = TrainingArgs(iters=steps, steps_per_report=steps, steps_per_save=steps + 1, log_grad_norms=True)
    losses = train(model, optim.AdamW(learning_rate=1e-3), windows.batch, None, args, Record())
    return losses, np.array(norms)


def main() -> None:
    parser = argparse.ArgumentParser(description="Per-layer gradient norms with and without residuals / pre-norm.")
    parser.add_argument("--steps", type=int, default=60, help="training steps per variant")
    parser.add_argument("--output", default="residual_gradients.png")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    tokenizer = ByteTokenizer()
    tokens = np.array(tokenizer.encode(CORPUS.read_text()[:200_000]), np.int32)
    windows = TokenWindows(tokens, batch_size=8, seq_len=64, seed=args.seed)
    probe = [windows.batch(10_000 + i) for i in range(4)]

    profiles, rows = {}, []
    for name, variant in VARIANTS.items():
        at_init = grad_norms_at_init(build(variant, args.seed), probe)
        losses, during = train_briefly(build(variant, args.seed), windows, args.steps)
        profiles[f"{name} (init)"] = at_init.tolist()
        profiles[f"{name} (training mean)"] = during.mean(axis=0).tolist()
        rows.append((name, at_init, during.mean(axis=0), losses))

    print(f"{'variant':24} {'layer 0':>9} {'layer 12':>9} {'layer 23':>9} {'first/last':>11} {'loss 0 -> ' + str(args.steps):>16}")
    for name, at_init, during, losses in rows:
        print(
            f"{name:24} {at_init[0]:9.2e} {at_init[12]:9.2e} {at_init[-1]:9.2e} {at_init[0] / at_init[-1]:11.2e} "
            f"{losses[0]:7.3f} -> {np.mean(losses[-5:]):.3f}"
        )
    print("(gradient L2 norm per block at initialisation, mean of 4 batches; loss: mean of the last 5 steps)")
    plot_grad_norm_profiles(Path(args.output), profiles, title="gradient norm per layer, 24-layer model")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
