"""Timing a generation stream from outside, the same way for every library; and mlx-lm's run.

Imports nothing of mlx_tfm, so that ``python examples/stream_timing.py FOLDER IDS MAX_TOKENS``
times mlx-lm in a process of its own, as installed (MLX's bundled CPU BLAS, which
``import mlx_tfm`` would have replaced by OpenBLAS), and prints the measurement as JSON.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx


@dataclass
class Measurement:
    prompt_tps: float
    generation_tps: float
    peak_gb: float
    tokens: int


def time_stream(responses, n_prompt: int) -> Measurement:
    """prompt tok/s = prompt tokens / time to the first new token; generation tok/s = (new
    tokens - 1) / time from the first to the last; peak = MLX's peak from the start (weights
    included, since they are allocated)."""
    mx.reset_peak_memory()
    start = time.perf_counter()
    stamps = []
    for _ in responses:
        stamps.append(time.perf_counter())
    generation = (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else 0.0
    return Measurement(n_prompt / (stamps[0] - start), generation, mx.get_peak_memory() / 1e9, len(stamps))


def run_mlx_lm(folder: Path, prompt: list[int], max_tokens: int) -> Measurement:
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(folder))
    tokenizer.eos_token_ids = set()  # every run makes max_tokens tokens
    list(mlx_lm.stream_generate(model, tokenizer, prompt[:8], max_tokens=4))  # warm up
    result = time_stream(mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=max_tokens), len(prompt))
    del model
    return result


if __name__ == "__main__":
    folder, ids, max_tokens = Path(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3])
    print(json.dumps(asdict(run_mlx_lm(folder, ids, max_tokens))))
