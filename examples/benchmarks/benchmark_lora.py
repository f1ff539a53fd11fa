"""LoRA fine-tuning speed and memory: `mlx-tfm lora` next to `mlx_lm.lora`, same run.

The model is the 135M-class Llama shape (SmolLM-135M: hidden 576, 30 layers, 9 heads,
3 KV heads, d_ff 1536, vocab 49152, tied embeddings) with random float32 weights, written
as a Hugging Face folder. Its tokenizer is a byte-level BPE trained here with the
`tokenizers` library on the wikisql training text with a 49152 target; that small corpus
yields fewer merges, so the embedding rows past the tokenizer's vocabulary are padding
(the compute per token is the 135M model's all the same).

Both trainers run as subprocesses on the same folder and data with the same settings
(batch 4, 16 LoRA layers, rank 8, Adam 1e-5, wikisql), each with the same BLAS: mlx-lm is
started after `mlx_tfm.blas.route_blas()`, so both use the optimized OpenBLAS on Linux.
Throughput is taken from the reports after the first (which include compilation); mlx-lm's
numbers come from its own training callback (mlx-lm counts one more target per sequence
than there are, about 1.5% on wikisql; left as it reports it).

    python examples/benchmarks/benchmark_lora.py --iters 30 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from models import CHECKOUT, DATA, LLAMA_135M, random_weights, write_bpe_tokenizer, write_model

WIKISQL = DATA / "wikisql"
REPORT = re.compile(r"Iter (\d+): Train loss [\d.]+, .*?Tokens/sec ([\d.]+).*?Peak mem ([\d.]+) GB")


def write_model_folder(folder: Path, seed: int = 0) -> int:
    """Random weights (normal, std 0.02; norms 1) in Hugging Face names, float32, and the
    tokenizer trained on wikisql; returns the tokenizer's vocabulary size."""
    texts = [json.loads(line)["text"] for line in (WIKISQL / "train.jsonl").read_text().splitlines()]
    vocab = write_bpe_tokenizer(folder, texts, LLAMA_135M["vocab_size"],
                                ("<|endoftext|>", "<|im_start|>", "<|im_end|>"))
    write_model(folder, LLAMA_135M, random_weights(LLAMA_135M, seed), None, tensor_format="pt")
    return vocab


def common_flags(model: Path, iters: int, adapters: Path) -> list[str]:
    return [
        "--model", str(model), "--train", "--data", str(WIKISQL), "--batch-size", "4", "--num-layers", "16",
        "--iters", str(iters), "--learning-rate", "1e-5", "--steps-per-report", "10", "--steps-per-eval", "100000",
        "--val-batches", "1", "--save-every", "100000", "--adapter-path", str(adapters), "--seed", "0",
    ]  # fmt: skip


# mlx_lm.lora's own display shows no peak memory, so its training() gets a callback that
# prints mlx-lm's report numbers (tokens/s and peak memory as mlx-lm measures them).
MLX_LM = """
import sys
import mlx_tfm.blas as blas; blas.route_blas()
from mlx_lm import lora
from mlx_lm.tuner.callbacks import TrainingCallback


class Report(TrainingCallback):
    def on_train_loss_report(self, info):
        print(f"Iter {info['iteration']}: Train loss {info['train_loss']:.3f}, "
              f"Tokens/sec {info['tokens_per_second']:.1f}, Peak mem {info['peak_memory']:.3f} GB", flush=True)

def train(*args, **kwargs):
    kwargs["training_callback"] = Report()
    return real_train(*args, **kwargs)

real_train, lora.train = lora.train, train
sys.argv = ["mlx_lm.lora", *sys.argv[1:]]
lora.main()
"""


def run(name: str, command: list[str]) -> dict:
    shown = ["python", "-c", "<mlx_lm.lora with a reporting callback>"] if command[1] == "-c" else ["python", *command[1:]]
    print(f"$ {' '.join(shown[:3] + command[3:] if command[1] == '-c' else shown)}", flush=True)
    result = subprocess.run(command, capture_output=True, text=True, cwd=CHECKOUT)
    if result.returncode != 0:
        sys.exit(f"{name} failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    reports = [(int(i), float(t), float(m)) for i, t, m in REPORT.findall(result.stdout)]
    if len(reports) < 2:
        sys.exit(f"{name}: expected at least two reports, got:\n{result.stdout}")
    steady = reports[1:]  # the first window includes compilation
    return {
        "tokens_per_second": sum(t for _, t, _ in steady) / len(steady),
        "peak_memory_gb": max(m for _, _, m in reports),
        "reports": reports,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=2, help="runs of each, alternating; the fastest counts")
    parser.add_argument("--work-dir", help="keep the model folder here (default: a temporary folder)")
    args = parser.parse_args()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench-lora-"))
    model = work / "smol-135m-shape"
    if not (model / "model.safetensors").is_file():
        vocab = write_model_folder(model)
        print(f"wrote {model} (tokenizer vocabulary {vocab}, model vocabulary {LLAMA_135M['vocab_size']})")
    ours_runs, theirs_runs = [], []
    for _ in range(args.repeats):  # alternate, so both see the same spells of machine load
        ours_runs.append(run("mlx-tfm lora", [sys.executable, "-m", "mlx_tfm", "lora", *common_flags(model, args.iters, work / "ours")]))
        theirs_runs.append(run("mlx_lm.lora", [sys.executable, "-c", MLX_LM, *common_flags(model, args.iters, work / "theirs")]))
    ours = max(ours_runs, key=lambda r: r["tokens_per_second"])
    theirs = max(theirs_runs, key=lambda r: r["tokens_per_second"])
    for name, r in (("mlx-tfm lora", ours), ("mlx_lm.lora", theirs)):
        print(f"{name}: (iter, tokens/s, peak GB) per report: {r['reports']}")
    print(f"\n{'':14}{'tokens/s':>10}{'peak memory':>14}")
    for name, r in (("mlx-tfm lora", ours), ("mlx_lm.lora", theirs)):
        print(f"{name:14}{r['tokens_per_second']:10.1f}{r['peak_memory_gb']:11.3f} GB")
    print(
        f"speed ratio {ours['tokens_per_second'] / theirs['tokens_per_second']:.2f}x, "
        f"memory ratio {ours['peak_memory_gb'] / theirs['peak_memory_gb']:.2f}x (mlx-tfm / mlx-lm)"
    )


if __name__ == "__main__":
    main()
