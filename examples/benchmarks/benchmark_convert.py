"""Benchmark: convert a 135M-class Llama (SmolLM-135M's shape, random weights, Hugging
Face layout, float32 safetensors) to float16 and to 4-bit, with mlx_tfm and with
mlx_lm.convert, each in its own process so peak memory is per run.

    python examples/benchmarks/benchmark_convert.py [--workdir DIR] [--repeat N]

Prints wall time (process start to exit, imports included), peak RSS of the converting
process (from wait4's rusage) and output size, side by side.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from models import LLAMA_135M, STORIES_HF, random_weights, write_model

CONFIG = {**LLAMA_135M, "bos_token_id": 1, "eos_token_id": 2}


def build_source(folder: Path) -> int:
    """Random float32 weights in HF layout, plus a tokenizer (mlx_lm.convert needs one;
    stories260K's SentencePiece model stands in). Returns the number of parameters."""
    weights = random_weights(CONFIG)
    write_model(folder, CONFIG, weights, STORIES_HF, tensor_format="pt")
    return sum(value.size for value in weights.values())


def measure(command: list[str]) -> tuple[float, float]:
    """-> (wall seconds, peak RSS in MiB) of one child process."""
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"failed: {' '.join(command)}\n{process.stderr.read().decode()}")
    return wall, usage.ru_maxrss / 1024  # Linux reports KiB


def folder_size(folder: Path) -> float:
    return sum(p.stat().st_size for p in folder.iterdir()) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=None, help="Where to put the source and outputs (default: a temp dir).")
    parser.add_argument("--repeat", type=int, default=1, help="Runs per cell; the best time and lowest peak are kept.")
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench_convert_"))
    source = workdir / "source"
    if not source.exists():
        n_params = build_source(source)
        print(f"source: {n_params / 1e6:.1f}M parameters, float32, {folder_size(source):.0f} MiB at {source}")
    tools = {
        "mlx_tfm": [sys.executable, "-m", "mlx_tfm.convert"],
        "mlx_lm": [sys.executable, "-m", "mlx_lm", "convert"],
    }
    targets = {"float16": ["--dtype", "float16"], "4-bit g64": ["--dtype", "float16", "-q", "--q-bits", "4", "--q-group-size", "64"]}
    rows = []
    for target, flags in targets.items():
        for tool, command in tools.items():
            best_wall, best_rss = float("inf"), float("inf")
            for _ in range(args.repeat):
                out = workdir / f"{tool}-{target.split()[0]}"
                shutil.rmtree(out, ignore_errors=True)
                wall, rss = measure([*command, "--hf-path", str(source), "--mlx-path", str(out), *flags])
                best_wall, best_rss = min(best_wall, wall), min(best_rss, rss)
            rows.append((target, tool, best_wall, best_rss, folder_size(out)))
    print("\n| target | tool | wall time (s) | peak RSS (MiB) | output (MiB) |\n|---|---|---|---|---|")
    for target, tool, wall, rss, size in rows:
        print(f"| {target} | {tool} | {wall:.2f} | {rss:.0f} | {size:.0f} |")
    if args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
