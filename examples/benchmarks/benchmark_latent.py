"""Multi-head latent attention (DeepSeek-V3's MLA): mlx_tfm and mlx-lm side by side, same folders.

    pip install -e '.[benchmark]'                      # mlx-lm
    python examples/benchmarks/benchmark_latent.py     # long on a 2-core CPU (4096-token prompts)
    python examples/benchmarks/benchmark_latent.py --toy --prompt-tokens 32 --max-tokens 8 --repeats 1

The model: DeepSeek-V3's layer at a small scale (hidden 768, 8 layers, 12 heads, q_lora_rank
384, kv_lora_rank 256, per head 64 dims without positions + 32 rotated, values 64; the
first layer dense (d_ff 2048), the rest 16 experts of d_ff 512, 4 active, in 4 groups of
which 2 stay eligible, sigmoid routing, one shared expert; about 170M parameters), random
weights (std 0.02), vocab of the tinyshakespeare BPE. Written once in mlx-lm's layout, in
float32 and in 4-bit (group 64, ``mlx-tfm convert -q``), loaded by both libraries from the
same folder. ``--toy``: the same layer at hidden 64, 2 layers (to check that the script runs).

Timing as benchmark_generate.py: the same token ids, EOS off, the two libraries' runs
alternating (who goes first too), best of ``--repeats``; prompt tok/s at each of
``--prompt-tokens``; generation tok/s = (new tokens - 1) / time from the first to the last;
peak memory = MLX's peak from just after loading (weights included).

KV cache at ``--cache-tokens``: mlx_tfm's cache after a prompt that long (the latent and the
rotated key per position and layer), against what per-head keys and values would take.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import mlx_tfm  # noqa: F401  (first: BLAS routing for both libraries)
import mlx.core as mx

from models import build_once, prompt_ids, random_weights, shakespeare_tokenizer, write_model
from stream_timing import RUNNERS, benchmark

LATENT_CONFIG = {
    "model_type": "deepseek_v3",
    "architectures": ["DeepseekV3ForCausalLM"],
    "hidden_size": 768,
    "num_hidden_layers": 8,
    "num_attention_heads": 12,
    "num_key_value_heads": 12,
    "q_lora_rank": 384,
    "kv_lora_rank": 256,
    "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 32,
    "v_head_dim": 64,
    "intermediate_size": 2048,
    "moe_intermediate_size": 512,
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
    "n_group": 4,
    "topk_group": 2,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
    "vocab_size": 4096,  # the tinyshakespeare BPE's
}
TOY_CONFIG = {**LATENT_CONFIG, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 4, "q_lora_rank": 64, "kv_lora_rank": 64, "intermediate_size": 128,
              "moe_intermediate_size": 64, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 2,
              "topk_group": 1}
BUILD_VERSION = ".built-latent-v1"
# our parameter names -> mlx-lm's deepseek_v3 layout (the shared expert and the router's bias)
MLX_LM_NAMES = ((".mlp.shared_expert.", ".mlp.shared_experts."),
                (".mlp.e_score_correction_bias", ".mlp.gate.e_score_correction_bias"))


def mlx_lm_name(name: str) -> str:
    for ours, theirs in MLX_LM_NAMES:
        name = name.replace(ours, theirs)
    return name


def build_models(root: Path, config: dict) -> dict[str, Path]:
    from mlx_tfm.convert.converter import convert

    folders = {"mla-float32": root / "mla-float32", "mla-4bit": root / "mla-4bit"}

    def write() -> None:
        tokenizer_dir = shakespeare_tokenizer(root / "tokenizer")
        weights = {mlx_lm_name(name): value for name, value in random_weights(config).items()}
        write_model(folders["mla-float32"], config, weights, tokenizer_dir)
        convert(folders["mla-float32"], folders["mla-4bit"], quantize=True, q_group_size=64, q_bits=4,
                overwrite=True, log=lambda *_: None)

    build_once(root, BUILD_VERSION, write, folders.values())
    return folders


def cache_bytes(folder: Path, prompt: list[int]) -> tuple[int, int]:
    """(mlx_tfm's KV cache after ``prompt``, per-head keys and values for as many positions), bytes."""
    from mlx_tfm.loading import load_model

    model, _ = load_model(folder)
    cache = model.make_cache()
    mx.eval(model(mx.array([prompt]), cache=cache))
    held = sum(sum(a.nbytes for a in layer.state) for layer in cache)
    args = model.args
    per_head = args.qk_nope_head_dim + args.qk_rope_head_dim + args.v_head_dim  # a key and a value
    itemsize = cache[0].state[0].dtype.size
    return held, args.num_hidden_layers * len(prompt) * args.num_attention_heads * per_head * itemsize


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mla-float32,mla-4bit")
    parser.add_argument("--prompt-tokens", default="512,4096", help="comma-separated prompt lengths")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--cache-tokens", type=int, default=4096)
    parser.add_argument("--toy", action="store_true", help="hidden 64, 2 layers: only to check the script runs")
    parser.add_argument("--folder", type=Path, default=Path("/tmp/mlx_tfm_benchmark_latent"))
    args = parser.parse_args()

    from mlx_tfm.blas import blas_description

    config = TOY_CONFIG if args.toy else LATENT_CONFIG
    folders = build_models(args.folder / ("toy" if args.toy else "full"), config)
    print(f"BLAS: {blas_description()}; {args.max_tokens} new tokens, best of {args.repeats}; MLA hidden "
          f"{config['hidden_size']}, {config['num_hidden_layers']} layers, kv_lora_rank {config['kv_lora_rank']}")
    header = f"{'model':<12} {'prompt':>6} {'library':<8} {'prompt tok/s':>12} {'gen tok/s':>10} {'peak GB':>8}"
    print(header)
    print("-" * len(header))
    for name in args.models.split(","):
        for n_prompt in (int(n) for n in args.prompt_tokens.split(",")):
            prompt = prompt_ids(folders[name], n_prompt)
            results = benchmark(folders[name], prompt, args.max_tokens, args.repeats, RUNNERS)
            for library, m in results.items():
                print(f"{name:<12} {n_prompt:>6} {library:<8} {m.prompt_tps:>12.1f} {m.generation_tps:>10.1f} "
                      f"{m.peak_gb:>8.3f}")
            ours, theirs = results["mlx_tfm"], results["mlx-lm"]
            print(f"{'':<12} {'':>6} {'ratio':<8} {ours.prompt_tps / theirs.prompt_tps:>11.2f}x "
                  f"{ours.generation_tps / theirs.generation_tps:>9.2f}x {ours.peak_gb / theirs.peak_gb:>7.2f}x",
                  flush=True)
        held, full = cache_bytes(folders[name], prompt_ids(folders[name], args.cache_tokens))
        print(f"{'':<12} KV cache at {args.cache_tokens} tokens: {held / 1e6:.1f} MB latent "
              f"(per-head keys and values: {full / 1e6:.1f} MB, {full / held:.1f}x)", flush=True)


if __name__ == "__main__":
    main()
