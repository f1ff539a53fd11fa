"""Timing a generation stream from outside, the same way for every library: one run of
mlx_tfm's or mlx-lm's, and the runs of both, alternating, best of several.

Imports nothing of mlx_tfm at module level (mlx_tfm's run imports it when it runs), so that
``python examples/benchmarks/stream_timing.py FOLDER IDS MAX_TOKENS`` times mlx-lm in a
process of its own, as installed (MLX's bundled CPU BLAS, which ``import mlx_tfm`` would
have replaced by OpenBLAS), and prints the measurement as JSON.
"""

from __future__ import annotations

import gc
import json
import subprocess
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


def run_mlx_tfm(folder: Path, prompt: list[int], max_tokens: int) -> Measurement:
    from mlx_tfm import load, stream_generate

    model, tokenizer = load(folder)
    tokenizer.eos_token_ids = set()  # every run makes max_tokens tokens
    list(stream_generate(model, tokenizer, prompt[:8], max_tokens=4))  # warm up
    result = time_stream(stream_generate(model, tokenizer, prompt, max_tokens=max_tokens), len(prompt))
    del model
    return result


def run_mlx_lm_as_installed(folder: Path, prompt: list[int], max_tokens: int) -> Measurement:
    """mlx-lm in a process of its own, without our BLAS routing: what its users on Linux get."""
    command = [sys.executable, __file__, str(folder), json.dumps(prompt), str(max_tokens)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(f"error: mlx-lm as installed failed on {folder}: {last}")
    return Measurement(**json.loads(done.stdout.strip().splitlines()[-1]))


RUNNERS = {"mlx_tfm": run_mlx_tfm, "mlx-lm": run_mlx_lm}


def release_memory() -> None:
    gc.collect()
    mx.clear_cache()


def benchmark(folder: Path, prompt: list[int], max_tokens: int, repeats: int, runners: dict) -> dict[str, Measurement]:
    """Each runner ``repeats`` times, who goes first alternating; the best of each."""
    runs: dict[str, list[Measurement]] = {name: [] for name in runners}
    for repeat in range(repeats):
        order = list(runners) if repeat % 2 == 0 else list(runners)[::-1]
        for name in order:
            release_memory()
            runs[name].append(runners[name](folder, prompt, max_tokens))
    return {
        name: Measurement(
            max(m.prompt_tps for m in ms), max(m.generation_tps for m in ms), max(m.peak_gb for m in ms),
            min(m.tokens for m in ms),
        )
        for name, ms in runs.items()
    }


if __name__ == "__main__":
    folder, ids, max_tokens = Path(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3])
    print(json.dumps(asdict(run_mlx_lm(folder, ids, max_tokens))))
