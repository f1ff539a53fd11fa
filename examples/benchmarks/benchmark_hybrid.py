"""Hybrid (Gated DeltaNet) models: mlx_tfm and mlx-lm side by side, same folders and machine.

    pip install -e '.[benchmark]'                   # mlx-lm
    python examples/benchmarks/benchmark_hybrid.py  # long on a 2-core CPU: --toy to try it
    python examples/benchmarks/benchmark_hybrid.py --formats 4bit --prompt-tokens 4096

The model: Qwen3-Next's architecture at about 200M parameters (hidden 1024, 12 layers, every
4th full attention with a gated output and partial RoPE, the others Gated DeltaNet with 8
key heads and 16 value heads of 128; 16 experts of d_ff 512, 2 active, and a gated shared
expert; vocab 32000), random weights (std 0.02), written as a Qwen3.5-MoE checkpoint
(split projections: ``in_proj_qkv``, ``in_proj_z``...) in float32, and in 4-bit (group 64)
converted by ``mlx-tfm convert -q`` (routers at 8 bits).

Timing is of the model calls alone, the same loop for both libraries (runs alternating,
who goes first too, best of ``--repeats``, of ``--long-repeats`` from a prompt of
``LONG_PROMPT`` tokens on: mlx-lm reads a 4,096-token prompt in 4-bit at a few tokens a
second, so each such run takes minutes): prompt tok/s = prompt tokens / time of one
forward pass over the prompt into a fresh cache; decode tok/s = greedy steps / their time.
Peak memory = MLX's peak over a run (weights included); cache MB = the bytes of every
layer's cache after a prompt of ``--cache-tokens`` (taken from the timed runs when that is
one of ``--prompt-tokens``, so a 4,096-token prompt is not read once more for it).
``--formats`` and ``--prompt-tokens`` choose the rows (``--formats 4bit --prompt-tokens 4096``:
that row alone).

``--forms``: the delta rule of one layer reading a 2,000-position prompt chunk by chunk and
position by position (the two forms of model/deltanet.py; the chunked one also in MLX ops
where the CPU kernel runs it), at this model's 16 value heads of
128 and at Qwen3-Next's 32 (in chunks of 16, the layers' default, or of each of
``--forms-chunks``), and the same for Mamba-2's SSD scan (model/ssd.py) at
``SSD_FORMS`` sizes; ``--forms-only``: that alone.
"""

from __future__ import annotations

import argparse
import gc
import time
from pathlib import Path

import mlx_tfm  # noqa: F401  (first: BLAS routing for both libraries)
import mlx.core as mx

from models import build_once, random_weights, write_model

TEXT = {
    "model_type": "qwen3_5_moe_text", "hidden_size": 1024, "num_hidden_layers": 12, "num_attention_heads": 8,
    "num_key_value_heads": 2, "head_dim": 128, "intermediate_size": 2048, "vocab_size": 32000,
    "linear_num_key_heads": 8, "linear_num_value_heads": 16, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4, "num_experts": 16, "num_experts_per_tok": 2, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "full_attention_interval": 4, "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    "max_position_embeddings": 32768, "tie_word_embeddings": False,
}
# --toy: the same architecture small enough to run in seconds
TOY = {**TEXT, "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1,
       "head_dim": 32, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
       "linear_value_head_dim": 16, "num_experts": 4, "moe_intermediate_size": 32,
       "shared_expert_intermediate_size": 32, "vocab_size": 256}
BUILD_VERSION = ".built-hybrid-v1"


def config_of(text: dict) -> dict:
    """The image-text config the checkpoint ships (mlx-lm's qwen3_5_moe reads it as it is)."""
    return {"model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"],
            "text_config": text, "tie_word_embeddings": False}


def build_models(root: Path, text: dict) -> dict[str, Path]:
    folders = {"float32": root / "float32", "4bit": root / "4bit"}

    def write() -> None:
        from mlx_tfm.convert.converter import convert

        config = config_of(text)
        # our parameter names are mlx-lm's text model's (which it reads under language_model.)
        write_model(folders["float32"], config, random_weights(config), None)
        convert(folders["float32"], folders["4bit"], quantize=True, q_group_size=64, q_bits=4, overwrite=True,
                log=lambda *_: None)

    build_once(root, BUILD_VERSION, write, folders.values())
    return folders


def load(library: str, folder: Path):
    if library == "mlx-lm":
        from mlx_lm.utils import load_model

        return load_model(folder)[0]
    from mlx_tfm.loading import load_model

    return load_model(folder)[0]


# From this many prompt tokens on, a row is timed ``--long-repeats`` times, not ``--repeats``.
LONG_PROMPT = 2048


def timed_run(library: str, folder: Path, prompt: mx.array, steps: int) -> tuple[float, float, float, float]:
    """(prompt tok/s, decode tok/s, peak GB, cache MB after the prompt) of one run."""
    model = load(library, folder)
    mx.eval(model(prompt[:, :8], cache=model.make_cache()))  # warm up
    mx.reset_peak_memory()
    cache = model.make_cache()
    start = time.perf_counter()
    logits = model(prompt, cache=cache)
    mx.eval(logits)
    prompt_time = time.perf_counter() - start
    megabytes = cache_bytes(cache) / 1e6  # outside the timing: a sum of array sizes
    token = mx.argmax(logits[:, -1], axis=-1)[:, None]
    start = time.perf_counter()
    for _ in range(steps):
        token = mx.argmax(model(token, cache=cache)[:, -1], axis=-1)[:, None]
        mx.eval(token)
    decode_time = time.perf_counter() - start
    peak = mx.get_peak_memory() / 1e9
    del model, cache
    gc.collect()
    return prompt.shape[1] / prompt_time, steps / decode_time, peak, megabytes


def cache_bytes(cache: list) -> int:
    """The bytes of every layer's cache (either library's: each has ``.state``)."""
    from mlx.utils import tree_flatten

    return sum(a.nbytes for _, a in tree_flatten([c.state for c in cache]) if isinstance(a, mx.array))


def cache_megabytes(library: str, folder: Path, n_tokens: int) -> float:
    model = load(library, folder)
    cache = model.make_cache()
    mx.eval(model(mx.zeros((1, n_tokens), dtype=mx.int32), cache=cache))
    return cache_bytes(cache) / 1e6


def best_of(folder: Path, prompt: mx.array, steps: int, repeats: int) -> dict[str, tuple[float, float, float, float]]:
    """Each library's best prompt and decode tok/s, least peak GB and its cache MB over
    ``repeats`` runs, the libraries alternating (who goes first too)."""
    runs = {"mlx_tfm": [], "mlx-lm": []}
    for i in range(repeats):
        order = list(runs) if i % 2 == 0 else list(runs)[::-1]
        for library in order:
            runs[library].append(timed_run(library, folder, prompt, steps))
    return {lib: (max(r[0] for r in rs), max(r[1] for r in rs), min(r[2] for r in rs), rs[0][3])
            for lib, rs in runs.items()}


def fastest_alternating(forms: dict, inputs: tuple, repeats: int) -> dict[str, float]:
    """Each form's best seconds over ``repeats`` runs on ``inputs``, the forms alternating
    (who goes first too) so that a busy machine slows them alike."""
    runs = {name: [] for name in forms}
    for i in range(repeats):
        for name in list(forms) if i % 2 == 0 else list(forms)[::-1]:
            start = time.perf_counter()
            mx.eval(forms[name](*inputs))
            runs[name].append(time.perf_counter() - start)
    return {name: min(times) for name, times in runs.items()}


def compare_forms(n_heads: int, head_dim: int, chunk_size: int = 16, length: int = 2000,
                  repeats: int = 3) -> dict[str, float]:
    """Seconds for the delta rule of one layer (``n_heads`` value heads, keys and values of
    ``head_dim``) to read ``length`` positions, best of ``repeats``, per form: "chunked" in
    chunks of ``chunk_size`` (the layers' ``linear_chunk_size``) as a prompt runs it (the CPU
    kernel where it runs), "plain chunked" in MLX ops (as Metal and CUDA run it), "stepped"
    as decoding runs it. The projections and the convolution around it are the same work in
    every form, so they are left out."""
    from mlx_tfm.model.deltanet import delta_rule_chunked, delta_rule_steps, l2_normalised, plain_delta_rule_chunked

    H, D = n_heads, head_dim
    queries = l2_normalised(mx.random.normal((1, H, length, D))) * D ** -0.5
    keys = l2_normalised(mx.random.normal((1, H, length, D)))
    values = mx.random.normal((1, H, length, D))
    g, beta = -mx.random.uniform(0, 1, (1, H, length)), mx.random.uniform(0, 1, (1, H, length))
    inputs = (queries, keys, values, g, beta, mx.zeros((1, H, D, D)))
    mx.eval(inputs)
    forms = {"chunked": lambda *a: delta_rule_chunked(*a, chunk_size),
             "plain chunked": lambda *a: plain_delta_rule_chunked(*a, chunk_size),
             "stepped": delta_rule_steps}
    return fastest_alternating(forms, inputs, repeats)


def compare_ssd_forms(n_heads: int, head_dim: int, state_size: int, chunk_size: int, length: int = 2000,
                      repeats: int = 3) -> tuple[float, float]:
    """The same for Mamba-2's SSD scan of one layer (one group of B and C): (chunked in
    chunks of ``chunk_size``, stepped) seconds to read ``length`` positions."""
    from mlx_tfm.model.ssd import ssd_chunked, ssd_step

    def stepped(x, dt, A, B, C):
        state, ys = mx.zeros((1, n_heads, head_dim, state_size)), []
        for t in range(length):
            y, state = ssd_step(x[:, t], dt[:, t], A, B[:, t], C[:, t], state)
            ys.append(y)
        return mx.stack(ys, axis=1), state

    x = mx.random.normal((1, length, n_heads, head_dim))
    dt = mx.random.uniform(0.001, 0.1, (1, length, n_heads))  # softplus'd time steps, as Mamba-2's
    A = -mx.random.uniform(1, 16, (n_heads,))
    B, C = mx.random.normal((1, length, 1, state_size)), mx.random.normal((1, length, 1, state_size))
    inputs = (x, dt, A, B, C)
    mx.eval(inputs)
    chunked = lambda *a: ssd_chunked(*a, chunk_size)  # noqa: E731
    best = fastest_alternating({"chunked": chunked, "stepped": stepped}, inputs, repeats)
    return best["chunked"], best["stepped"]


# --forms: the value heads of this benchmark's layers (as Qwen3.5's smaller models) and of
# Qwen3-Next's (32 value heads of 128)
FORMS_HEADS = (16, 32)
# --forms, Mamba-2's scan: (heads, head_dim, state_size, chunk_size) of mamba2-370m's layers
# (inner 2048 in heads of 64, a state of 128, chunks of 256) and mamba2-2.7b's (80 heads)
SSD_FORMS = ((32, 64, 128, 256), (80, 64, 128, 256))


def print_forms(text: dict, chunk_sizes: list[int]) -> None:
    D = text["linear_key_head_dim"]
    for n_heads in FORMS_HEADS if text is TEXT else (text["linear_num_value_heads"],):
        for chunk_size in chunk_sizes:
            best = compare_forms(n_heads, D, chunk_size)
            chunked, plain, stepped = best["chunked"], best["plain chunked"], best["stepped"]
            print(f"the delta rule of one layer ({n_heads} heads of {D}), 2000 positions, chunks of {chunk_size}: "
                  f"chunked {chunked:.3f} s ({stepped / chunked:.1f}x), in MLX ops {plain:.3f} s "
                  f"({stepped / plain:.1f}x), stepped {stepped:.3f} s", flush=True)
    for n_heads, head_dim, state_size, chunk_size in SSD_FORMS if text is TEXT else ((4, 16, 16, 64),):
        chunked, stepped = compare_ssd_forms(n_heads, head_dim, state_size, chunk_size)
        print(f"the SSD scan of one layer ({n_heads} heads of {head_dim}, state {state_size}, chunks of "
              f"{chunk_size}), 2000 positions: chunked {chunked:.3f} s, stepped {stepped:.3f} s "
              f"({stepped / chunked:.1f}x)", flush=True)


FORMATS = ("float32", "4bit")


def whole_numbers(parser: argparse.ArgumentParser, flag: str, text: str) -> list[int]:
    try:
        return [int(n) for n in text.split(",")]
    except ValueError:
        parser.error(f"{flag}: {text!r} is not comma-separated whole numbers")


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", default=",".join(FORMATS), help=f"comma-separated, of {', '.join(FORMATS)}")
    parser.add_argument("--prompt-tokens", default="512,4096", help="comma-separated prompt lengths")
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--cache-tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--long-repeats", type=int, default=1, help=f"runs for prompts of {LONG_PROMPT}+ tokens")
    parser.add_argument("--toy", action="store_true", help="a tiny model of the same architecture")
    parser.add_argument("--forms", action="store_true", help="also time the chunked and stepped forms")
    parser.add_argument("--forms-only", action="store_true", help="time only the chunked and stepped forms")
    parser.add_argument("--forms-chunks", default="16", help="comma-separated chunk sizes of the chunked delta rule")
    parser.add_argument("--folder", type=Path, default=Path("/tmp/mlx_tfm_benchmark_hybrid"))
    args = parser.parse_args()
    args.formats = args.formats.split(",")
    unknown = [name for name in args.formats if name not in FORMATS]
    if unknown:
        parser.error(f"--formats: {', '.join(unknown)} not among {', '.join(FORMATS)}")
    args.prompt_tokens = whole_numbers(parser, "--prompt-tokens", args.prompt_tokens)
    args.forms_chunks = whole_numbers(parser, "--forms-chunks", args.forms_chunks)
    if any(n < 1 or n & (n - 1) for n in args.forms_chunks):
        parser.error(f"--forms-chunks: the delta rule's chunks are powers of two, not {args.forms_chunks}")
    if min(args.prompt_tokens) < 8 or min(args.repeats, args.long_repeats) < 1:
        parser.error("prompts need at least 8 tokens (the warm-up reads 8) and repeats at least 1 run")
    return args


def main() -> None:
    args = parse_arguments()
    text = TOY if args.toy else TEXT
    if args.forms_only:
        print_forms(text, args.forms_chunks)
        return
    folders = build_models(args.folder / ("toy" if args.toy else "full"), text)
    header = f"{'model':<8} {'prompt':>6} {'library':<8} {'prompt tok/s':>12} {'decode tok/s':>12} {'peak GB':>8}"
    print(header)
    print("-" * len(header))
    for name in args.formats:
        cache_mb = {}
        for n in args.prompt_tokens:
            prompt = mx.random.randint(0, text["vocab_size"], (1, n))
            repeats = args.long_repeats if n >= LONG_PROMPT else args.repeats
            for library, (p, d, peak, mb) in best_of(folders[name], prompt, args.decode_tokens, repeats).items():
                print(f"{name:<8} {n:>6} {library:<8} {p:>12.1f} {d:>12.1f} {peak:>8.3f}", flush=True)
                if n == args.cache_tokens:
                    cache_mb[library] = mb
        for library in ("mlx_tfm", "mlx-lm"):
            megabytes = cache_mb[library] if library in cache_mb else cache_megabytes(library, folders[name],
                                                                                       args.cache_tokens)
            print(f"{name:<8} cache at {args.cache_tokens} tokens, {library}: {megabytes:.1f} MB", flush=True)
    if args.forms:
        print_forms(text, args.forms_chunks)


if __name__ == "__main__":
    main()
