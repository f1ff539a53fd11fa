"""Gemma 4 and Llama 4 shaped models: mlx_tfm and mlx-lm side by side, same folders and machine.

    pip install -e '.[benchmark]'                     # mlx-lm
    python examples/benchmarks/benchmark_families.py  # long on a 2-core CPU: --toy to try it

The models, about 200M parameters each, random weights (transformers' own initialisation,
std 0.02), vocab 32000:

- gemma4: Gemma 4's text model (``gemma4_text``): hidden 768, 12 layers, five sliding-window
  layers (window 512) to one full-attention layer with its own head size (512 against
  256), per-layer inputs of 128 per layer, the last 4 layers reading the KV cache of
  earlier ones (KV sharing), logits soft-capped.
- llama4: Llama 4's language model (the ``llama4`` image-text checkpoint, as mlx-lm's llama4
  reads it; its ``llama4_text`` is another, dense model): hidden 768, 12 layers, attention
  in chunks of 256 positions with every 4th layer global and unrotated, a mixture of 8
  experts (one active, the form mlx-lm's llama4 computes) beside a shared expert on every
  second layer.

Each is a transformers checkpoint written once and converted by ``mlx-tfm convert``, to
float32 and to 4-bit (group 64; the routers at 8 bits); both libraries load the same folder.
Timing is of the model calls alone, the same loop for both libraries (runs alternating,
who goes first too, best of ``--repeats``): prompt tok/s = prompt tokens / time of one
forward pass over the prompt into a fresh cache; decode tok/s = greedy steps / their time;
peak memory = MLX's peak over a run, weights included.
"""

from __future__ import annotations

import argparse
import gc
import time
from pathlib import Path

import mlx_tfm  # noqa: F401  (first: BLAS routing for both libraries)
import mlx.core as mx

from models import build_once

GEMMA4 = {
    "vocab_size": 32000, "vocab_size_per_layer_input": 32000, "hidden_size": 768, "intermediate_size": 3072,
    "num_hidden_layers": 12, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
    "global_head_dim": 512, "hidden_size_per_layer_input": 128, "num_kv_shared_layers": 4, "sliding_window": 512,
    "final_logit_softcapping": 30.0, "max_position_embeddings": 32768,
    "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 2,
}
LLAMA4 = {
    "vocab_size": 32000, "hidden_size": 768, "intermediate_size": 1024, "intermediate_size_mlp": 2048,
    "num_hidden_layers": 12, "num_attention_heads": 12, "num_key_value_heads": 4, "head_dim": 64,
    "num_local_experts": 8, "num_experts_per_tok": 1, "interleave_moe_layer_step": 2, "no_rope_layer_interval": 4,
    "attention_chunk_size": 256, "max_position_embeddings": 32768,
}
# --toy: the same architectures small enough to run in seconds
TOY = {
    "gemma4": {**GEMMA4, "vocab_size": 256, "vocab_size_per_layer_input": 256, "hidden_size": 64,
               "intermediate_size": 128, "num_attention_heads": 2, "head_dim": 32, "global_head_dim": 64,
               "hidden_size_per_layer_input": 8, "sliding_window": 16},
    "llama4": {**LLAMA4, "vocab_size": 256, "hidden_size": 64, "intermediate_size": 64, "intermediate_size_mlp": 128,
               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 4,
               "attention_chunk_size": 16},
}
# Llama 4's checkpoint holds a vision tower, which the converter drops; the smallest one.
LLAMA4_VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                 "image_size": 28, "patch_size": 14, "vision_output_dim": 32, "projector_input_dim": 32,
                 "projector_output_dim": 32}
BUILD_VERSION = ".built-families-v1"


def transformers_model(family: str, text: dict):
    """A randomly initialised transformers model of ``family`` (float32, eval)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, Llama4ForConditionalGeneration

    torch.manual_seed(0)
    if family == "gemma4":
        return AutoModelForCausalLM.from_config(AutoConfig.for_model("gemma4_text", **text)).float().eval()
    config = AutoConfig.for_model("llama4", text_config=text, vision_config=LLAMA4_VISION, image_token_index=0)
    return Llama4ForConditionalGeneration(config).float().eval()


def build_models(root: Path, shapes: dict[str, dict]) -> dict[str, Path]:
    """family-form -> folder: each family's checkpoint converted to float32 and 4-bit."""
    folders = {f"{family}-{form}": root / f"{family}-{form}" for family in shapes for form in ("float32", "4bit")}

    def write() -> None:
        from mlx_tfm.convert.converter import convert

        quiet = dict(overwrite=True, log=lambda *_: None)
        for family, text in shapes.items():
            transformers_model(family, text).save_pretrained(root / f"{family}-hf")
            convert(root / f"{family}-hf", folders[f"{family}-float32"], dtype="float32", **quiet)
            convert(root / f"{family}-hf", folders[f"{family}-4bit"], quantize=True, q_group_size=64, q_bits=4, **quiet)

    build_once(root, BUILD_VERSION, write, folders.values())
    return folders


def load(library: str, folder: Path):
    """(model, make_cache) of ``library`` reading ``folder``."""
    if library == "mlx-lm":
        from mlx_lm.models.cache import make_prompt_cache
        from mlx_lm.utils import load_model

        model = load_model(folder)[0]
        return model, lambda: make_prompt_cache(model)
    from mlx_tfm.loading import load_model

    model = load_model(folder)[0]
    return model, model.make_cache


def timed_run(library: str, folder: Path, prompt: mx.array, steps: int) -> tuple[float, float, float]:
    """(prompt tok/s, decode tok/s, peak GB) of one run."""
    model, make_cache = load(library, folder)
    mx.eval(model(prompt[:, :8], cache=make_cache()))  # warm up
    mx.reset_peak_memory()
    cache = make_cache()
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


def best_of(folder: Path, prompt: mx.array, steps: int, repeats: int) -> dict[str, tuple[float, float, float]]:
    """Each library's best prompt and decode rates and least peak, runs alternating."""
    runs = {"mlx_tfm": [], "mlx-lm": []}
    for i in range(repeats):
        order = list(runs) if i % 2 == 0 else list(runs)[::-1]
        for library in order:
            runs[library].append(timed_run(library, folder, prompt, steps))
    return {lib: (max(r[0] for r in rs), max(r[1] for r in rs), min(r[2] for r in rs)) for lib, rs in runs.items()}


def parameter_millions(folder: Path) -> float:
    from mlx.utils import tree_flatten

    from mlx_tfm.loading import load_model

    return sum(v.size for _, v in tree_flatten(load_model(folder)[0].parameters())) / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--toy", action="store_true", help="tiny models of the same architectures")
    parser.add_argument("--folder", type=Path, default=Path("/tmp/mlx_tfm_benchmark_families"))
    parser.add_argument("--forms", default="float32,4bit", help="which of float32, 4bit to time (default both)")
    args = parser.parse_args()
    forms = args.forms.split(",")

    shapes = TOY if args.toy else {"gemma4": GEMMA4, "llama4": LLAMA4}
    folders = build_models(args.folder / ("toy" if args.toy else "full"), shapes)
    header = f"{'model':<16} {'library':<8} {'prompt tok/s':>12} {'decode tok/s':>12} {'peak GB':>8}"
    print(f"prompt {args.prompt_tokens} tokens, {args.decode_tokens} decoding steps, best of {args.repeats}")
    print(header)
    print("-" * len(header))
    for name, folder in folders.items():
        if name.split("-")[1] not in forms:
            continue
        if name.endswith(forms[0]):
            print(f"{name.split('-')[0]}: {parameter_millions(folder):.0f}M parameters", flush=True)
        prompt = mx.random.randint(0, shapes[name.split("-")[0]]["vocab_size"], (1, args.prompt_tokens))
        results = best_of(folder, prompt, args.decode_tokens, args.repeats)
        for library, (p, d, peak) in results.items():
            print(f"{name:<16} {library:<8} {p:>12.1f} {d:>12.1f} {peak:>8.3f}", flush=True)
        (ours_p, ours_d, ours_m), (theirs_p, theirs_d, theirs_m) = results["mlx_tfm"], results["mlx-lm"]
        print(f"{'':<16} {'ratio':<8} {ours_p / theirs_p:>11.2f}x {ours_d / theirs_d:>11.2f}x {ours_m / theirs_m:>7.2f}x",
              flush=True)


if __name__ == "__main__":
    main()
