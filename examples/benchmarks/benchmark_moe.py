"""Mixture-of-experts decoding: mlx_tfm and mlx-lm side by side, same folders, prompt and machine.

    pip install -e '.[benchmark]'                # mlx-lm
    python examples/benchmarks/benchmark_moe.py  # several minutes on a 2-core CPU

The model: a Mixtral-style MoE of SmolLM2-135M's shape (hidden 576, 16 layers, 9 heads, 3 KV
heads, vocab 49152, tied embeddings) whose feed-forward is 8 experts of d_ff 1536, 2 active
per token; random weights (std 0.02). Written once in mlx-lm's layout, in float32 and in
4-bit (group 64, converted by ``mlx-tfm convert -q``: routers at 8 bits), and loaded by both
libraries from the same folder.

Timing as benchmark_generate.py: the same token ids, EOS off, runs of the two
libraries alternating (who goes first too), best of ``--repeats``; generation tok/s = (new
tokens - 1) / time from the first to the last; peak memory = MLX's peak from just after
loading (weights included).

Weights read per token: the bytes a decoding step reads (every non-expert weight: attention,
norms, routers, the embedding row, the LM head; and, per layer, the experts the router chose
for that token), from the routing of a decoding run, against the active-expert minimum
(exactly ``num_experts_per_tok`` experts per layer) and against reading every expert.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import mlx_tfm  # noqa: F401  (first: BLAS routing for both libraries)
import mlx.core as mx
from mlx.utils import tree_flatten

from models import (LLAMA_135M, build_once, prompt_ids, random_weights, shakespeare_tokenizer,
    write_model)
from stream_timing import RUNNERS, benchmark

MOE_CONFIG = {
    **LLAMA_135M,
    "model_type": "mixtral",
    "architectures": ["MixtralForCausalLM"],
    "num_hidden_layers": 16,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "intermediate_size": 1536,
}
BUILD_VERSION = ".built-moe-v1"


def mlx_lm_mixtral_name(name: str) -> str:
    """Our parameter name -> mlx-lm's Mixtral layout (``block_sparse_moe.switch_mlp.*`` stacked)."""
    return name.replace(".mlp.gate.", ".block_sparse_moe.gate.").replace(".mlp.switch_mlp.", ".block_sparse_moe.switch_mlp.")


def random_moe_weights(config: dict, seed: int = 0) -> dict[str, mx.array]:
    """std 0.02 weights in mlx-lm's Mixtral layout."""
    return {mlx_lm_mixtral_name(name): value for name, value in random_weights(config, seed).items()}


def build_models(root: Path) -> dict[str, Path]:
    from mlx_tfm.convert.converter import convert

    folders = {"moe-float32": root / "moe-float32", "moe-4bit": root / "moe-4bit"}

    def write() -> None:
        tokenizer_dir = shakespeare_tokenizer(root / "tokenizer")
        write_model(folders["moe-float32"], MOE_CONFIG, random_moe_weights(MOE_CONFIG), tokenizer_dir)
        convert(folders["moe-float32"], folders["moe-4bit"], quantize=True, q_group_size=64, q_bits=4, overwrite=True,
                log=lambda *_: None)

    build_once(root, BUILD_VERSION, write, folders.values())
    return folders


# -- bytes read per token --------------------------------------------------------------------


def module_bytes(module) -> int:
    return sum(v.nbytes for _, v in tree_flatten(module.parameters()))


def weights_read_per_token(folder: Path, prompt: list[int], max_tokens: int) -> tuple[float, float, float]:
    """(read, minimum, every expert) in MB per decoded token. ``read`` follows the routing of
    a greedy decoding run: per layer, the distinct experts chosen for the token."""
    import mlx_tfm.model.experts as experts
    from mlx_tfm.loading import load_model

    model, _ = load_model(folder)
    blocks = [layer.mlp for layer in model.layers if isinstance(layer.mlp, experts.SparseMoeBlock)]
    E, k = model.args.num_experts, model.args.num_experts_per_tok
    per_expert = module_bytes(blocks[0].switch_mlp) / E
    experts_total = sum(module_bytes(b.switch_mlp) for b in blocks)
    row = module_bytes(model.model.embed_tokens) / model.args.vocab_size  # the lookup; the tied head reads all rows
    always = module_bytes(model) - experts_total + row
    chosen = []  # distinct experts per layer, per decoded token
    route = experts.route

    def counting_route(logits, args, score_bias=None):
        indices, weights = route(logits, args, score_bias)
        if logits.size == logits.shape[-1]:  # one position: a decoding step
            chosen.append(len(set(indices.reshape(-1).tolist())))
        return indices, weights

    experts.route = counting_route
    try:
        cache = model.make_cache()
        logits = model(mx.array([prompt]), cache=cache)
        for _ in range(max_tokens):
            logits = model(mx.argmax(logits[0, -1]).reshape(1, 1), cache=cache)
    finally:
        experts.route = route
    read = always + per_expert * sum(chosen) / max_tokens
    minimum = always + per_expert * k * len(blocks)
    return read / 1e6, minimum / 1e6, (always + experts_total) / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="moe-float32,moe-4bit")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--folder", type=Path, default=Path("/tmp/mlx_tfm_benchmark_moe"))
    args = parser.parse_args()

    from mlx_tfm.blas import blas_description

    folders = build_models(args.folder)
    print(f"BLAS: {blas_description()}; prompt {args.prompt_tokens} tokens, {args.max_tokens} new tokens, "
          f"best of {args.repeats}; 8 experts, 2 active, hidden 576, 16 layers")
    header = f"{'model':<12} {'library':<8} {'prompt tok/s':>12} {'gen tok/s':>10} {'peak GB':>8}"
    print(header)
    print("-" * len(header))
    for name in args.models.split(","):
        prompt = prompt_ids(folders[name], args.prompt_tokens)
        results = benchmark(folders[name], prompt, args.max_tokens, args.repeats, RUNNERS)
        for library, m in results.items():
            print(f"{name:<12} {library:<8} {m.prompt_tps:>12.1f} {m.generation_tps:>10.1f} {m.peak_gb:>8.3f}")
        ours, theirs = results["mlx_tfm"], results["mlx-lm"]
        print(f"{'':<12} {'ratio':<8} {ours.prompt_tps / theirs.prompt_tps:>11.2f}x "
              f"{ours.generation_tps / theirs.generation_tps:>9.2f}x {ours.peak_gb / theirs.peak_gb:>7.2f}x", flush=True)
        read, minimum, every = weights_read_per_token(folders[name], prompt[:16], 16)
        print(f"{'':<12} weights read per token: {read:.1f} MB (active-expert minimum {minimum:.1f} MB, "
              f"every expert {every:.1f} MB)", flush=True)


if __name__ == "__main__":
    main()
