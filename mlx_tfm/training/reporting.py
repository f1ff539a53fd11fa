"""What the commands show while training: a tqdm bar (loss, tokens/s, ETA, peak memory),
mlx-lm style report lines, and the history the plots are drawn from."""

from __future__ import annotations

import sys

from .trainer import Callbacks


class ProgressReporter(Callbacks):
    """Shows progress and keeps the loss and gradient-norm history.

    ``save`` is called by ``on_save``; the command decides what a save writes.
    """

    def __init__(self, total_steps: int, start_step: int = 0, history: dict | None = None, save=None):
        from tqdm import tqdm

        self.history = history or {"train": [], "valid": [], "grad_norm_steps": [], "grad_norms": []}
        self.save = save
        # disable=None hides the bar when stderr is not a terminal (logs, tests)
        self.bar = tqdm(total=total_steps, initial=start_step, unit="step", file=sys.stderr, disable=None, dynamic_ncols=True)
        self.last_report: dict = {}

    def write(self, line: str) -> None:
        self.bar.write(line, file=sys.stdout)
        sys.stdout.flush()

    def on_step(self, step: int, loss: float, ntoks: int, info: dict) -> None:
        self.history["train"].append((step, loss))
        if "layer_grad_norms" in info:
            self.history["grad_norm_steps"].append(step)
            self.history["grad_norms"].append(info["layer_grad_norms"])
        self.bar.update(1)

    def on_report(self, step: int, info: dict) -> None:
        self.last_report = info
        self.bar.set_postfix(
            loss=f"{info['train_loss']:.3f}",
            tok_s=f"{info['tokens_per_second']:.0f}",
            peak_mem=f"{info['peak_memory_gb']:.2f}GB",
            refresh=False,
        )
        self.write(
            f"Iter {step}: Train loss {info['train_loss']:.3f}, Learning Rate {info['learning_rate']:.3e}, "
            f"It/sec {info['iterations_per_second']:.3f}, Tokens/sec {info['tokens_per_second']:.1f}, "
            f"Peak mem {info['peak_memory_gb']:.3f} GB"
        )

    def on_eval(self, step: int, val_loss: float, seconds: float) -> None:
        self.history["valid"].append((step, val_loss))
        self.write(f"Iter {step}: Val loss {val_loss:.3f}, Val took {seconds:.3f}s")

    def on_save(self, step: int) -> None:
        if self.save is not None:
            where = self.save(step)
            if where:
                self.write(f"Iter {step}: Saved {where}")

    def close(self) -> None:
        self.bar.close()
