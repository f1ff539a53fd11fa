"""Generation speed and memory: mlx_tfm and mlx-lm side by side, same models, prompt and machine.

    pip install -e '.[benchmark]'                     # mlx-lm
    python examples/benchmarks/benchmark_generate.py  # a few minutes on a 2-core CPU

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
process of its own (``stream_timing.py`` here), with MLX's bundled CPU BLAS: what an
mlx-lm user on Linux gets.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import mlx_tfm  # noqa: F401  (first: BLAS routing for both libraries)

from models import (LLAMA_135M, STORIES_HF, build_once, prompt_ids, random_weights, shakespeare_tokenizer,
    write_model)
from stream_timing import RUNNERS, benchmark, run_mlx_lm_as_installed

BUILD_VERSION = ".built-v2"  # bump when the folders' recipe changes

# MLX's CPU kernels for float16 are slow (a 180-token prompt takes ~40 s on the 135M model):
# that model gets a shorter run, the same for both libraries.
SHORT_RUN = {"llama135m-float16": (32, 16)}
FORMS = {"llama135m-float32": "float32", "llama135m-float16": "float16", "llama135m-4bit": "4bit"}


def build_models(root: Path) -> dict[str, Path]:
    """The benchmark folders under ``root``, written on the first run and reused after."""
    folders = {name: root / name for name in FORMS}

    def write() -> None:
        tokenizer_dir = shakespeare_tokenizer(root / "tokenizer")
        weights = random_weights(LLAMA_135M)
        for name, form in FORMS.items():
            write_model(folders[name], LLAMA_135M, weights, tokenizer_dir, form)

    build_once(root, BUILD_VERSION, write, folders.values())
    return {**folders, "stories260K": STORIES_HF}


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
