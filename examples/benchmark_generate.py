"""Generation speed and memory: mlx_tfm and mlx-lm side by side, same models, prompt and machine.

    pip install -e '.[benchmark]'          # mlx-lm
    python examples/benchmark_generate.py  # a few minutes on a 2-core CPU

Models: a 135M-class Llama (SmolLM2-135M's shape: hidden 576, 30 layers, 9 heads, 3 KV
heads, d_ff 1536, vocab 49152, tied embeddings; random weights) in float32, float16 and
4-bit (group 64), and stories260K. Each folder is written once in Hugging Face layout
(config.json, model.safetensors, tokenizer.json) and loaded by both libraries.

Both are timed the same way from outside, on the same token ids: prompt tok/s = prompt
tokens / time to the first new token; generation tok/s = (new tokens - 1) / time from the
first to the last; peak memory = MLX's peak from just after loading to the end (weights
included), one model in memory at a time. EOS is disabled so every run makes all tokens.
The runs of the two libraries alternate (who goes first too); the best of ``--repeats`` is
reported. The machine should be otherwise idle: other jobs move these numbers a lot.

``import mlx_tfm`` comes first: it routes MLX's CPU BLAS to OpenBLAS (see mlx_tfm/blas.py),
which mlx-lm, in the same process, then uses too. ``--as-installed`` adds mlx-lm in a
process of its own (``examples/stream_timing.py``), with MLX's bundled CPU BLAS: what an
mlx-lm user on Linux gets.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
from pathlib import Path

import mlx_tfm  # noqa: F401  (first: BLAS routing for both libraries)
import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from llama135m import LLAMA_135M  # examples/ is on sys.path when a script here runs
from stream_timing import Measurement, run_mlx_lm, time_stream

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"


BUILD_VERSION = ".built-v2"  # bump when the folders' recipe changes

# MLX's CPU kernels for float16 are slow (a 180-token prompt takes ~40 s on the 135M model):
# that model gets a shorter run, the same for both libraries.
SHORT_RUN = {"llama135m-float16": (32, 16)}


# -- building the model folders ------------------------------------------------------------


def write_tokenizer(folder: Path, text: str, vocab_size: int = 4096) -> None:
    """A byte-level BPE tokenizer.json trained on ``text``, readable by both libraries."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(text.splitlines(), trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>",
              "eos_token": "<|endoftext|>", "model_max_length": 2048}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def random_weights(config: dict, seed: int = 0) -> dict[str, mx.array]:
    """Hugging Face Llama tensor names (ours are the same), std 0.02 as at initialisation."""
    from mlx_tfm.model.transformer import Model
    from mlx_tfm.model.config import ModelArgs

    mx.random.seed(seed)
    model = Model(ModelArgs.from_dict(config))
    weights = {}
    for name, value in tree_flatten(model.parameters()):
        weights[name] = value if name.endswith("norm.weight") else 0.02 * mx.random.normal(value.shape)
        mx.eval(weights[name])
    return weights


def write_folder(folder: Path, config: dict, weights: dict[str, mx.array], tokenizer_from: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((tokenizer_from / name).read_bytes())


def quantized(config: dict, weights: dict[str, mx.array], group_size: int = 64, bits: int = 4):
    """The weights as nn.quantize stores them (weight, scales, biases per quantized layer)."""
    from mlx_tfm.model.transformer import Model
    from mlx_tfm.model.config import ModelArgs

    model = Model(ModelArgs.from_dict(config))
    model.load_weights(list(weights.items()))
    nn.quantize(model, group_size=group_size, bits=bits)
    q_weights = dict(tree_flatten(model.parameters()))
    mx.eval(q_weights)
    return {**config, "quantization": {"group_size": group_size, "bits": bits}}, q_weights


def build_models(root: Path) -> dict[str, Path]:
    """The benchmark folders under ``root``, written on the first run and reused after."""
    folders = {name: root / name for name in ("llama135m-float32", "llama135m-float16", "llama135m-4bit")}
    folders["stories260K"] = SHARED / "stories260K-hf"
    if all((f / "model.safetensors").is_file() for f in folders.values()) and (root / BUILD_VERSION).is_file():
        return folders
    print(f"writing the benchmark models to {root} (once)...", flush=True)
    tokenizer_dir = root / "tokenizer"
    tokenizer_dir.mkdir(parents=True, exist_ok=True)
    write_tokenizer(tokenizer_dir, (SHARED / "tinyshakespeare" / "input.txt").read_text())
    weights = random_weights(LLAMA_135M)
    write_folder(folders["llama135m-float32"], {**LLAMA_135M, "torch_dtype": "float32"}, weights, tokenizer_dir)
    half = {k: v.astype(mx.float16) for k, v in weights.items()}
    write_folder(folders["llama135m-float16"], {**LLAMA_135M, "torch_dtype": "float16"}, half, tokenizer_dir)
    # From the float32 weights, so scales and biases are float32: MLX's CPU quantized
    # matmul is ~100x slower with float16 scales.
    q_config, q_weights = quantized({**LLAMA_135M, "torch_dtype": "float32"}, weights)
    write_folder(folders["llama135m-4bit"], q_config, q_weights, tokenizer_dir)
    (root / BUILD_VERSION).write_text("")
    return folders


# -- timing --------------------------------------------------------------------------------


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
    command = [sys.executable, str(Path(__file__).with_name("stream_timing.py")), str(folder), json.dumps(prompt), str(max_tokens)]
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
    runs: dict[str, list[Measurement]] = {name: [] for name in runners}
    for repeat in range(repeats):
        order = list(runners) if repeat % 2 == 0 else list(runners)[::-1]  # who goes first alternates
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


def prompt_ids(folder: Path, n_tokens: int) -> list[int]:
    """The first ``n_tokens`` tokens of tinyshakespeare in this model's tokenizer."""
    from mlx_tfm.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(folder)
    text = (SHARED / "tinyshakespeare" / "input.txt").read_text()[: 40 * n_tokens]
    ids = tokenizer.encode(text)[:n_tokens]
    assert len(ids) == n_tokens, "the prompt text is too short for that many tokens"
    return ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="llama135m-float32,llama135m-float16,llama135m-4bit,stories260K")
    parser.add_argument("--prompt-tokens", type=int, default=181)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--folder", type=Path, default=Path("/tmp/mlx_tfm_benchmark"), help="where the models are written")
    parser.add_argument("--as-installed", action="store_true",
                        help="also time mlx-lm in its own process, with MLX's bundled CPU BLAS (slow for float32)")
    args = parser.parse_args()
    runners = {**RUNNERS, "mlx-lm*": run_mlx_lm_as_installed} if args.as_installed else RUNNERS

    from mlx_tfm.blas import blas_description

    folders = build_models(args.folder)
    print(f"BLAS: {blas_description()}; prompt {args.prompt_tokens} tokens, {args.max_tokens} new tokens, "
          f"best of {args.repeats}")
    header = f"{'model':<20} {'library':<8} {'prompt tok/s':>12} {'gen tok/s':>10} {'peak GB':>8}"
    print(header)
    print("-" * len(header))
    for name in args.models.split(","):
        n_prompt, max_tokens = SHORT_RUN.get(name, (args.prompt_tokens, args.max_tokens))
        prompt = prompt_ids(folders[name], n_prompt)
        results = benchmark(folders[name], prompt, max_tokens, args.repeats, runners)
        for library, m in results.items():
            print(f"{name:<20} {library:<8} {m.prompt_tps:>12.1f} {m.generation_tps:>10.1f} {m.peak_gb:>8.3f}")
        ours, theirs = results["mlx_tfm"], results["mlx-lm"]
        print(f"{'':<20} {'ratio':<8} {ours.prompt_tps / theirs.prompt_tps:>11.2f}x "
              f"{ours.generation_tps / theirs.generation_tps:>9.2f}x {ours.peak_gb / theirs.peak_gb:>7.2f}x"
              f"   ({n_prompt}-token prompt, {max_tokens} new)", flush=True)
        if "mlx-lm*" in results:
            installed = results["mlx-lm*"]
            print(f"{'':<20} {'ratio*':<8} {ours.prompt_tps / installed.prompt_tps:>11.2f}x "
                  f"{ours.generation_tps / installed.generation_tps:>9.2f}x {ours.peak_gb / installed.peak_gb:>7.2f}x"
                  f"   (* mlx-lm as installed, own process)", flush=True)


if __name__ == "__main__":
    main()
