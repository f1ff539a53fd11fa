"""Hybrid (Gated DeltaNet) models: mlx_tfm and mlx-lm side by side, same folders and machine.

    pip install -e '.[benchmark]'                   # mlx-lm
    python examples/benchmarks/benchmark_hybrid.py  # long on a 2-core CPU: --toy to try it

The model: Qwen3-Next's architecture at about 200M parameters (hidden 1024, 12 layers, every
4th full attention with a gated output and partial RoPE, the others Gated DeltaNet with 8
key heads and 16 value heads of 128; 16 experts of d_ff 512, 2 active, and a gated shared
expert; vocab 32000), random weights (std 0.02), written as a Qwen3.5-MoE checkpoint
(split projections: ``in_proj_qkv``, ``in_proj_z``...) in float32, and in 4-bit (group 64)
converted by ``mlx-tfm convert -q`` (routers at 8 bits).

Timing is of the model calls alone, the same loop for both libraries (runs alternating,
who goes first too, best of ``--repeats``): prompt tok/s = prompt tokens / time of one
forward pass over the prompt into a fresh cache; decode tok/s = greedy steps / their time.
Peak memory = MLX's peak over a run (weights included); cache MB = the bytes of every
layer's cache after a prompt of ``--cache-tokens``.

``--forms``: the delta rule of one layer reading a 2,000-position prompt chunk by chunk and
position by position (the two forms of model/deltanet.py), at this model's 16 value heads of
128 and at Qwen3-Next's 32; ``--forms-only``: that alone.
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


def timed_run(library: str, folder: Path, prompt: mx.array, steps: int) -> tuple[float, float, float]:
    """(prompt tok/s, decode tok/s, peak GB) of one run."""
    model = load(library, folder)
    mx.eval(model(prompt[:, :8], cache=model.make_cache()))  # warm up
    mx.reset_peak_memory()
    cache = model.make_cache()
    start = time.perf_counter()
    logits = model(prompt, cache=cache)
    mx.eval(logits)
    prompt_time = time.perf_counter() - start
    token = mx.argmax(logits[:, -1], axis=-1)[:, None]
    start = time.perf_counter()
    for _ in range(steps):
        token = mx.argmax(model(token, cache=cache)[:, -1], axis=-1)[:, None]
        mx.eval(token)
    decode_time = time.perf_counter() - start
    peak = mx.get_peak_memory() / 1e9
    del model, cache
    gc.collect()
    return prompt.shape[1] / prompt_time, steps / decode_time, peak


def cache_megabytes(library: str, folder: Path, n_tokens: int) -> float:
    model = load(library, folder)
    cache = model.make_cache()
    mx.eval(model(mx.zeros((1, n_tokens), dtype=mx.int32), cache=cache))
    from mlx.utils import tree_flatten

    return sum(a.nbytes for _, a in tree_flatten([c.state for c in cache]) if isinstance(a, mx.array)) / 1e6


def best_of(folder: Path, prompt: mx.array, steps: int, repeats: int) -> dict[str, tuple[float, float, float]]:
    runs = {"mlx_tfm": [], "mlx-lm": []}
    for i in range(repeats):
        order = list(runs) if i % 2 == 0 else list(runs)[::-1]
        for library in order:
            runs[library].append(timed_run(library, folder, prompt, steps))
    return {lib: (max(r[0] for r in rs), max(r[1] for r in rs), min(r[2] for r in rs)) for lib, rs in runs.items()}


def compare_forms(n_heads: int, head_dim: int, length: int = 2000, repeats: int = 3) -> tuple[float, float]:
    """Seconds for the delta rule of one layer (``n_heads`` value heads, keys and values of
    ``head_dim``) to read ``length`` positions: (chunked, stepped), best of ``repeats``, the
    two forms alternating (who goes first too) so that a busy machine slows both alike. The
    projections and the convolution around it are the same work in both forms, so they are
    left out."""
    from mlx_tfm.model.deltanet import delta_rule_chunked, delta_rule_steps, l2_normalised

    H, D = n_heads, head_dim
    queries = l2_normalised(mx.random.normal((1, H, length, D))) * D ** -0.5
    keys = l2_normalised(mx.random.normal((1, H, length, D)))
    values = mx.random.normal((1, H, length, D))
    g, beta = -mx.random.uniform(0, 1, (1, H, length)), mx.random.uniform(0, 1, (1, H, length))
    inputs = (queries, keys, values, g, beta, mx.zeros((1, H, D, D)))
    mx.eval(inputs)
    runs = {delta_rule_chunked: [], delta_rule_steps: []}
    for i in range(repeats):
        for form in list(runs) if i % 2 == 0 else list(runs)[::-1]:
            start = time.perf_counter()
            mx.eval(form(*inputs))
            runs[form].append(time.perf_counter() - start)
    return min(runs[delta_rule_chunked]), min(runs[delta_rule_steps])


# --forms: the value heads of this benchmark's layers (as Qwen3.5's smaller models) and of
# Qwen3-Next's (32 value heads of 128)
FORMS_HEADS = (16, 32)


def print_forms(text: dict) -> None:
    for n_heads in FORMS_HEADS if text is TEXT else (text["linear_num_value_heads"],):
        chunked, stepped = compare_forms(n_heads, text["linear_key_head_dim"])
        print(f"the delta rule of one layer ({n_heads} heads of {text['linear_key_head_dim']}), 2000 positions: "
              f"chunked {chunked:.3f} s, stepped {stepped:.3f} s ({stepped / chunked:.1f}x)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", default="512,4096")
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--cache-tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--toy", action="store_true", help="a tiny model of the same architecture")
    parser.add_argument("--forms", action="store_true", help="also time the chunked and stepped delta rule")
    parser.add_argument("--forms-only", action="store_true", help="time only the two forms of the delta rule")
    parser.add_argument("--folder", type=Path, default=Path("/tmp/mlx_tfm_benchmark_hybrid"))
    args = parser.parse_args()

    text = TOY if args.toy else TEXT
    if args.forms_only:
        print_forms(text)
        return
    folders = build_models(args.folder / ("toy" if args.toy else "full"), text)
    header = f"{'model':<8} {'prompt':>6} {'library':<8} {'prompt tok/s':>12} {'decode tok/s':>12} {'peak GB':>8}"
    print(header)
    print("-" * len(header))
    for name, folder in folders.items():
        for n in (int(n) for n in args.prompt_tokens.split(",")):
            prompt = mx.random.randint(0, text["vocab_size"], (1, n))
            for library, (p, d, peak) in best_of(folder, prompt, args.decode_tokens, args.repeats).items():
                print(f"{name:<8} {n:>6} {library:<8} {p:>12.1f} {d:>12.1f} {peak:>8.3f}", flush=True)
        for library in ("mlx_tfm", "mlx-lm"):
            megabytes = cache_megabytes(library, folder, args.cache_tokens)
            print(f"{name:<8} cache at {args.cache_tokens} tokens, {library}: {megabytes:.1f} MB", flush=True)
    if args.forms:
        print_forms(text)


if __name__ == "__main__":
    main()
