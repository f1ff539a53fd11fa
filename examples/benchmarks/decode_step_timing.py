"""The fixed cost of a decoding step: ms per token of ``generate_step`` with the compiled
decoder (mlx_tfm/model/compiled.py) off and on, alternated in one process, on random
weights of SmolLM2-135M's shape (float32 or 4-bit); and the Python time of building one
step's graph both ways.

    python examples/benchmarks/decode_step_timing.py --form 4bit --tokens 40 --rounds 8

The machine may be shared: compare the two columns of one run (best and median of the
rounds), not runs of different days.
"""

from __future__ import annotations

import argparse
import time

import mlx_tfm  # noqa: F401  (BLAS routing before MLX)
import mlx.core as mx
import mlx.nn as nn

from models import LLAMA_135M
from mlx_tfm.cpu import specialize
from mlx_tfm.families import model_args_from_config
from mlx_tfm.generation.step import generate_step
from mlx_tfm.model import compiled
from mlx_tfm.model.transformer import Model


def random_model(form: str) -> Model:
    mx.random.seed(0)
    model = Model(model_args_from_config(LLAMA_135M))
    if form == "4bit":
        nn.quantize(model, group_size=64, bits=4)
    mx.eval(model.parameters())
    return specialize(model)


def decode_ms(model: Model, prompt: mx.array, tokens: int) -> float:
    """ms per token of ``generate_step`` after its first two tokens (decoding only)."""
    stamps = [time.perf_counter() for _ in generate_step(prompt, model, max_tokens=tokens)]
    return (stamps[-1] - stamps[1]) / (len(stamps) - 2) * 1e3


def build_ms(model: Model, decode, steps: int = 20) -> float:
    """Median ms of Python spent building one step's graph (evaluated after the clock)."""
    cache = model.make_cache()
    model(mx.arange(32)[None], cache=cache)  # (1, 32)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        logits = decode(mx.array([[3]]), cache)  # (1, 1, V)
        times.append(time.perf_counter() - start)
        mx.eval(logits)
    return sorted(times)[steps // 2] * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--form", choices=("float32", "4bit"), default="4bit")
    parser.add_argument("--tokens", type=int, default=40, help="tokens generated per round")
    parser.add_argument("--rounds", type=int, default=8, help="rounds of each route, alternated")
    args = parser.parse_args()
    model = random_model(args.form)
    prompt = (mx.arange(32) * 13) % 5000  # (32,)
    routes = {"plain": False, "compiled": True}
    results = {name: [] for name in routes}
    for name, on in routes.items():  # warm-up: traces, the allocator
        compiled._enabled = on
        decode_ms(model, prompt, 8)
    for round_ in range(args.rounds):
        for name in list(routes)[:: 1 if round_ % 2 == 0 else -1]:
            compiled._enabled = routes[name]
            results[name].append(decode_ms(model, prompt, args.tokens))
    builds = {"plain": build_ms(model, lambda token, cache: model(token, cache=cache)),
              "compiled": build_ms(model, compiled.CompiledDecoder(model))}
    for name, times in results.items():
        times.sort()
        print(f"{args.form} {name:8s}: best {times[0]:.1f} ms/token, median {times[len(times) // 2]:.1f}; "
              f"graph building {builds[name]:.2f} ms/step")
    best = results["compiled"][0] / results["plain"][0]
    median = results["compiled"][len(results["compiled"]) // 2] / results["plain"][len(results["plain"]) // 2]
    print(f"compiled / plain: best {best:.3f}, median {median:.3f}")


if __name__ == "__main__":
    main()
