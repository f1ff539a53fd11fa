"""Two ranks against one process on this machine: data-parallel LoRA and split generation.

Every rank is a process on 127.0.0.1, started as mlx.launch starts them (a ring
hostfile in MLX_HOSTFILE, MLX_RANK), so the ring runs over loopback TCP. The model is a
random Llama of 23M parameters (hidden 512, 8 layers, 8 heads, 4 KV heads, d_ff 1408,
untied) with the stories260K tokenizer (vocab 512), float32, written once to a temporary
folder; the data is wikisql.

- LoRA: `mlx-tfm lora` (LoRA on all 8 layers, rank 8, batch 8, Adam) in one process
  and as two ranks taking 4 rows each; tokens/s from the report lines after the first
  (which includes compilation), whole-batch tokens in both.
- Generation: `mlx-tfm generate` (a 128-token prompt, 64 new tokens, greedy) in one
  process, with --pipeline and with --tensor-parallel; rank 0's own statistics.

On a machine with two cores shared with other jobs, two ranks split the same cores a
single process already uses, so this shows what the split costs more than what it gains;
README "More than one machine" estimates the gain between Macs.

    python examples/benchmarks/benchmark_distributed.py --iters 20 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from models import DATA, STORIES_HF, random_weights, write_model

CONFIG = {"model_type": "llama", "hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 8,
          "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 512, "max_position_embeddings": 1024,
          "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
REPORT = re.compile(r"Iter (\d+): Train loss [\d.]+, .*?Tokens/sec ([\d.]+)")
STATS = re.compile(r"(Prompt|Generation): (\d+) tokens, ([\d.]+) tokens-per-sec")


def write_model_folder(folder: Path) -> None:
    """The random model (as initialised) with stories260K's tokenizer, float32."""
    write_model(folder, CONFIG, random_weights(CONFIG, scale=None), STORIES_HF)


def free_first_port(n: int) -> int:
    while True:
        first = random.randint(20000, 60000)
        try:
            for port in range(first, first + n):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue


def run(command: list[str], ranks: int, folder: Path) -> tuple[str, str]:
    """``command`` in one process, or as ``ranks`` ranks on 127.0.0.1; rank 0's stdout and stderr."""
    if ranks == 1:
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        return done.stdout, done.stderr
    first = free_first_port(ranks + 1)
    hostfile = folder / f"hosts-{first}.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{first + r}"] for r in range(ranks)]))
    env = {**os.environ, "MLX_HOSTFILE": str(hostfile)}
    processes = [subprocess.Popen(command, env={**env, "MLX_RANK": str(r)}, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for r in range(ranks)]
    outputs = [p.communicate() for p in processes]
    if any(p.returncode for p in processes):
        raise SystemExit("a rank failed: " + " | ".join(f"rank {r}: status {p.returncode}, {err.strip()}"
                                                        for r, (p, (_, err)) in enumerate(zip(processes, outputs))))
    return outputs[0]


def lora_tokens_per_second(model: Path, ranks: int, iters: int, folder: Path) -> float:
    adapters = folder / f"adapters-{ranks}"
    command = [sys.executable, "-m", "mlx_tfm", "lora", "--model", str(model), "--train", "--data", str(DATA / "wikisql"),
               "--batch-size", "8", "--iters", str(iters), "--steps-per-report", "5", "--steps-per-eval", "0",
               "--num-layers", "-1", "--max-seq-length", "256", "--adapter-path", str(adapters)]
    out, _ = run(command, ranks, folder)
    rates = [float(rate) for step, rate in REPORT.findall(out) if int(step) > 5]
    return statistics.mean(rates)


def generation_rates(model: Path, split: str | None, folder: Path) -> tuple[float, float]:
    prompt = " ".join(["the little dog ran to the park"] * 18)  # about 128 tokens
    command = [sys.executable, "-m", "mlx_tfm", "generate", "--model", str(model), "-p", prompt, "-m", "64",
               "--ignore-chat-template"] + ([f"--{split}"] if split else [])
    _, err = run(command, 2 if split else 1, folder)
    rates = {kind: float(rate) for kind, _, rate in STATS.findall(err)}
    return rates["Prompt"], rates["Generation"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=20, help="LoRA steps per run")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each, alternating; the best is kept")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        model = folder / "model"
        write_model_folder(model)
        lora = {1: [], 2: []}
        generation = {None: [], "pipeline": [], "tensor-parallel": []}
        for _ in range(args.repeats):
            for ranks in lora:
                lora[ranks].append(lora_tokens_per_second(model, ranks, args.iters, folder))
            for split in generation:
                generation[split].append(generation_rates(model, split, folder))
    print("| run | LoRA tokens/s (batch 8) | prompt tok/s | generation tok/s |")
    print("|---|---|---|---|")
    print(f"| one process | {max(lora[1]):.0f} | {max(p for p, _ in generation[None]):.0f} | "
          f"{max(g for _, g in generation[None]):.1f} |")
    print(f"| two ranks, data parallel | {max(lora[2]):.0f} | | |")
    for split in ("pipeline", "tensor-parallel"):
        print(f"| two ranks, --{split} | | {max(p for p, _ in generation[split]):.0f} | "
              f"{max(g for _, g in generation[split]):.1f} |")


if __name__ == "__main__":
    main()
