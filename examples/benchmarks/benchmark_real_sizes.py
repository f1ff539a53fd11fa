"""Prompt and decode speed and peak memory at real sizes, next to llama.cpp and mlx-lm:
SmolLM2-1.7B's and Llama-3.1-8B's shapes, random weights, in 4, 8 and 16 bits.

    pip install -e '.[benchmark]'          # mlx-lm and llama-cpp-python
    python examples/benchmarks/benchmark_real_sizes.py --sizes 1.7b --formats 4bit --prompt-tokens 512
    python examples/benchmarks/benchmark_real_sizes.py --markdown    # every row: hours on 2 cores
    python examples/benchmarks/benchmark_real_sizes.py --toy         # the same pipeline, tiny models

Models (models.py): SmolLM2-1.7B's shape (hidden 2048, 24 layers, 32 heads, 32 KV heads,
d_ff 8192, vocab 49152, tied embeddings) and Llama-3.1-8B's (hidden 4096, 32 layers, 32 heads,
8 KV heads, d_ff 14336, vocab 128256, its own output head, Llama 3's RoPE scaling). Random
weights (normal, std 0.02) are written as a Hugging Face folder in float16 a shard at a
time (the 8B's 16 GB are never in memory at once), with a byte-level BPE tokenizer of the
model's vocabulary size (the prompts are token ids, never text). From that folder, one
format at a time under ``--work-dir`` (removed once its rows are measured, unless
``--keep``):

- mlx_tfm and mlx-lm read the same folders: ``mlx-tfm convert -q`` at 4 and 8 bits (group
  64) and the 16-bit folder as it is;
- llama.cpp reads GGUF files written by ``mlx-tfm convert --to-gguf`` (F16, Q8_0, Q4_0, and
  Q4_K_M where the CLI offers that type; else its row is skipped with a line saying so).
  llama.cpp's own converter (convert_hf_to_gguf.py) is not installed: llama-cpp-python
  ships the library, not the script. examples/check_gguf_export.py shows that llama.cpp's
  greedy text from our files equals ours.

Each measurement is a process of its own (one library, one format, one prompt length): it
loads the model, warms up on 8 tokens, then reads the prompt (random ids) and makes
``--decode-tokens`` greedy tokens after it. Runs alternate between the libraries (who goes
first too); the best of ``--repeats`` is reported:

- prompt tok/s: prompt tokens / time to the first new token;
- decode tok/s: (new tokens - 1) / time from the first new token to the last;
- peak RSS: the process's peak resident memory (``VmHWM``), everything in it: interpreter,
  libraries, weights (llama.cpp maps its file: the pages it reads count), caches.

``--threads`` (default 2) is given to llama.cpp, to mlx_tfm's kernels and to OpenBLAS.
Each ``mlx-tfm convert`` prints its time and peak RSS. Room needed for the 8B: disk for its
16 GB folder and the largest format beside it (the F16 GGUF, 16 GB); memory for the GGUF
export, which today keeps every source tensor it has read (16 GB) and, as the ``gguf``
package's writer does, the file's tensors until it writes them: the source plus the file,
more than 24 GB for the 8B's F16 and Q8_0 files. The machine should be otherwise idle.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

from benchmark_convert import measure as measure_command
from benchmark_llamacpp import peak_rss_mb, run_llama_cpp, run_mlx
from models import (
    LLAMA_3_1_8B,
    SMOLLM2_1_7B,
    build_once,
    parameter_shapes,
    write_random_checkpoint,
    write_sized_bpe_tokenizer,
)

SIZES = {"1.7b": SMOLLM2_1_7B, "8b": LLAMA_3_1_8B}
SPLITS = {"1.7b": "smollm", "8b": "llama-bpe"}  # how each model's own tokenizer splits text (llama.cpp's names)
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "vocab_size": 512}
TOY = {"1.7b": {**SMOLLM2_1_7B, **TINY, "num_key_value_heads": 4}, "8b": {**LLAMA_3_1_8B, **TINY, "num_key_value_heads": 2}}
# format -> (mlx-tfm convert flags making our folder, None: the 16-bit folder itself; llama.cpp's GGUF type)
FORMATS = {"4bit": (["-q", "--q-bits", "4", "--q-group-size", "64"], "q4_0"),
           "8bit": (["-q", "--q-bits", "8", "--q-group-size", "64"], "q8_0"),
           "16bit": (None, "f16")}
# disk a format's files take beside the 16-bit folder, as a share of its size (ours and the GGUF)
ROOM = {"4bit": 0.6, "8bit": 1.1, "16bit": 1.0}
EXTRA_GGUF = {"4bit": "q4_k_m"}  # a second llama.cpp row, where `mlx-tfm convert` writes the type
BUILD_VERSION = "v1"  # bump when a recipe changes
CONVERT = [sys.executable, "-m", "mlx_tfm.convert"]


# -- the models, one format at a time -----------------------------------------------------


def gguf_types_offered() -> set[str]:
    """The --gguf-type choices of this checkout's `mlx-tfm convert` (from its help)."""
    done = subprocess.run([*CONVERT, "--help"], capture_output=True, text=True, check=True)
    choices = done.stdout.split("--gguf-type {", 1)[1].split("}", 1)[0]
    return set(choices.split(","))


def convert(*flags: str) -> None:
    """One `mlx-tfm convert` in a process of its own, its time and peak memory printed (the
    8B's GGUF exports need the most)."""
    wall, peak_mib = measure_command([*CONVERT, *flags, "--overwrite"])
    print(f"  mlx-tfm convert {' '.join(flags[2:])}: {wall:.0f} s, peak RSS {peak_mib * 2**20 / 1e9:.2f} GB", flush=True)


def write_source(root: Path, config: dict, split: str) -> None:
    write_sized_bpe_tokenizer(root / "tokenizer", config["vocab_size"], split)
    write_random_checkpoint(root / "16bit", config, root / "tokenizer")


def in_fresh_process(function: Callable, *args) -> None:
    """Run ``function(*args)`` in a new interpreter, so that this process stays small: a
    child started from it (which shares its memory until it runs its program) then reports
    a peak RSS of its own."""
    process = multiprocessing.get_context("spawn").Process(target=function, args=args)
    process.start()
    process.join()
    if process.exitcode != 0:
        raise SystemExit(f"error: {function.__name__} failed (exit status {process.exitcode})")


def check_room(root: Path, config: dict, formats: list[str]) -> None:
    """One line, before anything is written, when the disk cannot hold the 16-bit folder
    and the largest format beside it."""
    sixteen_bit = 2 * sum(math.prod(shape) for shape in parameter_shapes(config).values())
    needed = sixteen_bit * (1 + max(ROOM[fmt] for fmt in formats))
    root.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(root).free + sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
    if free < needed:
        raise SystemExit(f"error: {root} has {free / 1e9:.0f} GB free, these formats need {needed / 1e9:.0f} GB")


def build_source(root: Path, config: dict, split: str) -> Path:
    """The 16-bit Hugging Face folder of random weights (and its tokenizer), once."""
    build_once(root, f".built-16bit-{BUILD_VERSION}", partial(in_fresh_process, write_source, root, config, split))
    return root / "16bit"


def build_format(root: Path, source: Path, fmt: str, gguf_types: list[str]) -> dict[str, Path]:
    """library (llama.cpp: one per GGUF type) -> the model it reads in ``fmt``, built once."""
    flags, _ = FORMATS[fmt]
    ours = source if flags is None else root / fmt
    if flags is not None:
        build_once(root, f".built-{fmt}-{BUILD_VERSION}", partial(convert, "--hf-path", str(source), "--mlx-path",
                                                                  str(ours), *flags))
    paths = {"mlx_tfm": ours, "mlx-lm": ours}
    for gguf_type in gguf_types:
        path = root / f"model-{gguf_type.upper()}.gguf"
        build_once(root, f".built-{gguf_type}-{BUILD_VERSION}",
                   partial(convert, "--hf-path", str(source), "--to-gguf", str(path), "--gguf-type", gguf_type))
        paths[f"llama.cpp {gguf_type.upper()}"] = path
    return paths


def remove_format(root: Path, fmt: str, paths: dict[str, Path], source: Path) -> None:
    """Free the disk a measured format took (its build markers too, so a rerun rebuilds)."""
    for path in set(paths.values()) - {source}:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    for marker in root.glob(".built-*"):
        if not marker.name.startswith(".built-16bit"):
            marker.unlink()


# -- one measurement, in a process of its own ------------------------------------------------


def random_prompt(n_tokens: int, vocab_size: int) -> list[int]:
    """The same random prompt for every library (ids past the first few, which are special)."""
    import numpy as np

    return [int(i) for i in np.random.default_rng(1).integers(3, vocab_size, n_tokens)]


def child(args) -> None:
    prompt = random_prompt(args.prompt_tokens, args.vocab_size)
    if args.child == "llama.cpp":
        result = run_llama_cpp(args.model, prompt, args.decode_tokens, args.threads)
    else:
        result = run_mlx(args.child, args.model, prompt, args.decode_tokens)
    print(json.dumps({"prompt_tps": result["prompt_tps"], "decode_tps": result["decode_tps"],
                      "peak_gb": peak_rss_mb() / 1e3}))


def measure(engine: str, model: Path, n_tokens: int, args, vocab_size: int) -> dict | None:
    """One run of ``engine`` in a fresh process -> its figures (None, with a line, if it failed)."""
    env = {**os.environ, "MLX_TFM_KERNELS_THREADS": str(args.threads), "OPENBLAS_NUM_THREADS": str(args.threads)}
    command = [sys.executable, __file__, "--child", engine.split()[0], "--model", str(model), "--vocab-size",
               str(vocab_size), "--prompt-tokens", str(n_tokens), "--decode-tokens", str(args.decode_tokens),
               "--threads", str(args.threads)]
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)  # a failure is a line
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        print(f"  {engine} on {model.name}, {n_tokens} tokens: failed: {last}", flush=True)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def best(runs: list[dict | None]) -> dict | None:
    """The best prompt and decode rates and the lowest peak of a cell's runs."""
    runs = [r for r in runs if r is not None]
    if not runs:
        return None
    return {"prompt_tps": max(r["prompt_tps"] for r in runs), "decode_tps": max(r["decode_tps"] for r in runs),
            "peak_gb": min(r["peak_gb"] for r in runs)}


def measure_format(paths: dict[str, Path], args, vocab_size: int, label: str) -> dict[tuple[str, int], dict | None]:
    """(engine, prompt tokens) -> best figures; the engines alternating, who goes first too."""
    engines = [engine for engine in paths if not (args.skip_mlx_lm and engine == "mlx-lm")]
    runs: dict[tuple[str, int], list] = {}
    for repeat in range(args.repeats):
        for n_tokens in args.prompt_tokens:
            for engine in engines if repeat % 2 == 0 else engines[::-1]:
                result = measure(engine, paths[engine], n_tokens, args, vocab_size)
                runs.setdefault((engine, n_tokens), []).append(result)
                if result is not None:
                    print(f"  {label:12} {engine:16} {n_tokens:5} tokens: prompt {result['prompt_tps']:8.1f} tok/s  "
                          f"decode {result['decode_tps']:6.1f} tok/s  peak {result['peak_gb']:6.2f} GB", flush=True)
    return {key: best(rs) for key, rs in runs.items()}


# -- the table ---------------------------------------------------------------------------------

HEADER = ("shape", "format", "prompt", "prompt tok/s ours / llama.cpp / mlx-lm", "decode tok/s ours / llama.cpp / mlx-lm",
          "peak RSS GB ours / llama.cpp / mlx-lm", "ours vs llama.cpp prompt, decode", "ours vs mlx-lm prompt, decode")


def three(cells: list[dict | None], key: str, digits: int) -> str:
    return " / ".join("-" if c is None else f"{c[key]:.{digits}f}" for c in cells)


def ratios(ours: dict | None, theirs: dict | None) -> str:
    if ours is None or theirs is None:
        return "-"
    return f"{ours['prompt_tps'] / theirs['prompt_tps']:.2f}x, {ours['decode_tps'] / theirs['decode_tps']:.2f}x"


def table_rows(size: str, fmt: str, figures: dict, prompt_tokens: list[int]) -> list[tuple[str, ...]]:
    """One row per prompt length and llama.cpp file (its GGUF type named in the format)."""
    rows = []
    for gguf_engine in sorted({engine for engine, _ in figures if engine.startswith("llama.cpp")}, key=len):
        for n_tokens in prompt_tokens:
            cells = [figures.get(("mlx_tfm", n_tokens)), figures.get((gguf_engine, n_tokens)),
                     figures.get(("mlx-lm", n_tokens))]
            rows.append((size, f"{fmt} ({gguf_engine.split()[1]})", str(n_tokens), three(cells, "prompt_tps", 1),
                         three(cells, "decode_tps", 1), three(cells, "peak_gb", 2), ratios(cells[0], cells[1]),
                         ratios(cells[0], cells[2])))
    return rows


def print_table(rows: list[tuple[str, ...]], markdown: bool) -> None:
    if markdown:
        print("\n| " + " | ".join(HEADER) + " |\n|" + "---|" * len(HEADER))
        for row in rows:
            print("| " + " | ".join(row) + " |")
        return
    widths = [max(len(r[i]) for r in [HEADER, *rows]) for i in range(len(HEADER))]
    print()
    for row in [HEADER, *rows]:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())


# -- the run --------------------------------------------------------------------------------------


def llama_cpp_types(fmt: str, offered: set[str]) -> list[str]:
    """The GGUF types llama.cpp runs for ``fmt``: its own, and the extra one where offered."""
    types = [FORMATS[fmt][1]]
    extra = EXTRA_GGUF.get(fmt)
    if extra and extra in offered:
        types.append(extra)
    elif extra:
        print(f"skipping llama.cpp {extra.upper()}: this mlx-tfm convert has no --gguf-type {extra}", flush=True)
    return types


def run_size(size: str, config: dict, args, offered: set[str]) -> list[tuple[str, ...]]:
    """Build, measure and (unless --keep) remove each format of one shape -> its table rows."""
    root = args.work_dir / ("toy" if args.toy else "full") / size
    check_room(root, config, args.formats)
    source = build_source(root, config, SPLITS[size])
    rows = []
    for fmt in args.formats:
        print(f"{size} {fmt}: converting...", flush=True)
        paths = build_format(root, source, fmt, llama_cpp_types(fmt, offered))
        figures = measure_format(paths, args, config["vocab_size"], f"{size} {fmt}")
        rows += table_rows(size, fmt, figures, args.prompt_tokens)
        if not args.keep:
            remove_format(root, fmt, paths, source)
    if not args.keep:
        shutil.rmtree(root)
    return rows


def comma_list(choices) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        items = text.split(",")
        unknown = [item for item in items if item not in choices]
        if unknown:
            raise argparse.ArgumentTypeError(f"{', '.join(unknown)} not among {', '.join(choices)}")
        return items
    return parse


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=comma_list(SIZES), default=list(SIZES), help="of 1.7b, 8b (default both)")
    parser.add_argument("--formats", type=comma_list(FORMATS), default=list(FORMATS), help="of 4bit, 8bit, 16bit")
    parser.add_argument("--prompt-tokens", type=lambda t: [int(n) for n in t.split(",")], default=[512, 4096])
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/mlx_tfm_real_sizes"))
    parser.add_argument("--keep", action="store_true", help="keep every folder and file built")
    parser.add_argument("--skip-mlx-lm", action="store_true",
                        help="time mlx_tfm and llama.cpp only (mlx-lm's 4- and 16-bit CPU routes take tens of minutes)")
    parser.add_argument("--toy", action="store_true", help="hidden 64, 2 layers, vocab 512: the pipeline in seconds")
    parser.add_argument("--markdown", action="store_true", help="print the table in markdown (the README's)")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # one measurement: the library
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)  # the folder or GGUF file it reads
    parser.add_argument("--vocab-size", type=int, help=argparse.SUPPRESS)  # the range of the prompt's ids
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.child:
        return child(args)
    offered = gguf_types_offered()
    print(f"{args.threads} threads; prompts of {', '.join(map(str, args.prompt_tokens))} tokens, "
          f"{args.decode_tokens} new; best of {args.repeats}", flush=True)
    rows = []
    for size in args.sizes:
        rows += run_size(size, (TOY if args.toy else SIZES)[size], args, offered)
    print_table(rows, args.markdown)


if __name__ == "__main__":
    main()
