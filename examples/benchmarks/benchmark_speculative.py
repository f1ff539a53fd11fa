"""Speculative decoding and the quantized KV cache: mlx_tfm and mlx-lm in one run.

    pip install -e '.[benchmark]'              # mlx-lm
    python examples/benchmarks/benchmark_speculative.py   # ~5 minutes on a 2-core CPU

Models: the 135M-class Llama shape (models.py; random float32 weights, as in
benchmark_generate.py) as the model, and a 2-layer draft of the same vocabulary (the
model's embeddings and first two blocks), in float32 and 4-bit (group 64: its 49152-row
head is most of its reading). All are Hugging Face folders loaded by both libraries.

1. **A copy-heavy task.** The prompt asks to correct the spelling of a passage (~120 tokens
   of tinyshakespeare); the answer is the passage with every 13th token changed. Random
   weights answer nothing sensible, so the model is *steered*: its real forward pass runs
   and a large bias is added to the scripted answer's token at each answer position
   (``Steered``). The draft is steered to the passage as it stands, as a draft that copies
   would guess: it is wrong exactly at the edits. Prompt lookup needs nothing. Greedy
   decoding, so every library and method must produce exactly the scripted answer (checked).
   Reported: generation tok/s (best of ``--repeats``, libraries alternating) and the
   acceptance rate. The compute per token is the 135M model's; only the answer is chosen.
2. **The cost of checking k guesses**: one forward pass over 1, 2, 4, 8 and 16 positions
   after 300 cached ones (ms): what speculation trades against.
3. **KV cache at 4,096 positions**: float, 8-bit and 4-bit (group 64), float16 and float32
   models: the cache's bytes (its arrays' bytes per position times 4,096) and ms per
   decoding step at that length, ours and mlx-lm's ``QuantizedKVCache``. The cache is
   filled with random keys and values (a 4,096-token prefill of the float16 model takes
   minutes on a CPU), then the model decodes 8 tokens over it.

Figures from a shared machine move with its load: compare the ratios within one run.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import mlx_tfm  # noqa: F401  (first: BLAS routing for both libraries)
import mlx.core as mx
from mlx.utils import tree_flatten

from models import (LLAMA_135M, SHAKESPEARE, build_once, random_weights, shakespeare_tokenizer, write_bpe_tokenizer,
    write_model)
from stream_timing import time_stream

BUILD_VERSION = ".built-v2"
# 5: best of 3-15 in a simulation of this task's rounds priced by the measured cost of
# checking 1-8 positions (median 1 + 0.14 per extra position, on this box)
PROMPT_LOOKUP_TOKENS = 5
NUM_DRAFT_TOKENS = 3
DRAFTS = {"draft": "draft-2-layers", "draft 4-bit": "draft-2-layers-4bit"}  # method -> folder
EDIT_EVERY = 13  # the answer changes every 13th token of the passage (coprime to the rounds of 4 and 8)


# -- models ---------------------------------------------------------------------------------


def build_models(root: Path) -> dict[str, Path]:
    folders = {name: root / name for name in ("target-float32", "target-float16", "draft-2-layers",
                                              "draft-2-layers-4bit")}

    def write() -> None:
        tokenizer_dir = shakespeare_tokenizer(root / "tokenizer")
        weights = random_weights(LLAMA_135M)
        write_model(folders["target-float32"], LLAMA_135M, weights, tokenizer_dir, "float32")
        write_model(folders["target-float16"], LLAMA_135M, weights, tokenizer_dir, "float16")
        draft = {k: v for k, v in weights.items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < 2}
        draft_config = {**LLAMA_135M, "num_hidden_layers": 2}
        write_model(folders["draft-2-layers"], draft_config, draft, tokenizer_dir, "float32")
        write_model(folders["draft-2-layers-4bit"], draft_config, draft, tokenizer_dir, "4bit")

    build_once(root, BUILD_VERSION, write, folders.values())
    return folders
    print(f"writing the benchmark models to {root} (once)...", flush=True)
    tokenizer_dir = root / "tokenizer"
    write_bpe_tokenizer(tokenizer_dir, SHAKESPEARE.read_text().splitlines())
    weights = random_weights(LLAMA_135M)
    write_model(folders["target-float32"], LLAMA_135M, weights, tokenizer_dir, "float32")
    write_model(folders["target-float16"], LLAMA_135M, weights, tokenizer_dir, "float16")
    draft = {k: v for k, v in weights.items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < 2}
    draft_config = {**LLAMA_135M, "num_hidden_layers": 2}
    write_model(folders["draft-2-layers"], draft_config, draft, tokenizer_dir, "float32")
    write_model(folders["draft-2-layers-4bit"], draft_config, draft, tokenizer_dir, "4bit")
    (root / BUILD_VERSION).write_text("")
    return folders


class Steered:
    """A model whose greedy answer after ``prompt_length`` tokens is ``script``: its real
    forward pass runs, then ``bias`` is added to the scripted token's logit at every answer
    position. Works with either library's model and caches (``cache[0].offset``)."""

    def __init__(self, model, prompt_length: int, script: list[int], bias: float = 100.0):
        self.model, self.prompt_length, self.bias = model, prompt_length, bias
        self.script = mx.array(script, mx.int32)

    def __call__(self, inputs: mx.array, cache=None, **kwargs) -> mx.array:
        offset = cache[0].offset if cache else 0
        logits = self.model(inputs, cache=cache, **kwargs)  # (1, L, V)
        answer_index = offset + mx.arange(inputs.shape[1]) + 1 - self.prompt_length  # what each row predicts
        inside = (answer_index >= 0) & (answer_index < self.script.size)
        token = self.script[mx.clip(answer_index, 0, self.script.size - 1)][None, :, None]  # (1, L, 1)
        picked = mx.take_along_axis(logits, token, axis=-1)
        return mx.put_along_axis(logits, token, picked + self.bias * inside[None, :, None], axis=-1)

    def __getattr__(self, name):
        return getattr(self.model, name)


def copy_task(tokenizer) -> tuple[list[int], list[int], list[int]]:
    """(prompt, the answer: the passage with every ``EDIT_EVERY``-th token changed, the
    passage as it is). Edits by token keep the two aligned, so the draft steered to the
    passage is wrong exactly at the edits."""
    text = SHAKESPEARE.read_text()
    passage = " ".join(text[:2000].split()[:90])
    prompt = f"Correct the spelling in this passage.\n\n{passage}\n\nThe corrected passage:\n"
    passage_ids = tokenizer.encode(passage, add_special_tokens=False)
    answer = [t + 1 if i % EDIT_EVERY == EDIT_EVERY - 1 else t for i, t in enumerate(passage_ids)]
    return tokenizer.encode(prompt), answer, passage_ids


# -- 1. the copy task ------------------------------------------------------------------------


def run_ours(folders, method: str, task) -> tuple[float, float, list[int]]:
    from mlx_tfm import load, stream_generate

    prompt, answer, passage = task
    model, tokenizer = load(folders["target-float32"])
    tokenizer.eos_token_ids = set()
    target = Steered(model, len(prompt), answer)
    kwargs = {}
    if method == "prompt lookup":
        kwargs = dict(prompt_lookup_num_tokens=PROMPT_LOOKUP_TOKENS)
    elif method in DRAFTS:
        draft, _ = load(folders[DRAFTS[method]])
        kwargs = dict(draft_model=Steered(draft, len(prompt), passage), num_draft_tokens=NUM_DRAFT_TOKENS)
    list(stream_generate(target, tokenizer, prompt[:8], max_tokens=4))  # warm up
    responses = []
    measurement = time_stream((responses.append(r) or r for r in stream_generate(
        target, tokenizer, prompt, max_tokens=len(answer), **kwargs)), len(prompt))
    last = responses[-1]
    rate = last.accepted_tokens / last.drafted_tokens if last.drafted_tokens else float("nan")
    return measurement.generation_tps, rate, [r.token for r in responses]


def run_mlx_lm(folders, method: str, task) -> tuple[float, float, list[int]]:
    import mlx_lm

    prompt, answer, passage = task
    model, tokenizer = mlx_lm.load(str(folders["target-float32"]))
    tokenizer.eos_token_ids = set()
    target = Steered(model, len(prompt), answer)
    kwargs = {}
    if method in DRAFTS:
        draft, _ = mlx_lm.load(str(folders[DRAFTS[method]]))
        kwargs = dict(draft_model=Steered(draft, len(prompt), passage), num_draft_tokens=NUM_DRAFT_TOKENS)
    list(mlx_lm.stream_generate(target, tokenizer, prompt[:8], max_tokens=4))  # warm up
    responses = []
    measurement = time_stream((responses.append(r) or r for r in mlx_lm.stream_generate(
        target, tokenizer, prompt, max_tokens=len(answer), **kwargs)), len(prompt))
    drafted = [r.from_draft for r in responses]
    # mlx-lm marks the tokens that came from the draft; each round ends with one that did not
    rate = sum(drafted) / max(1, len(responses) - sum(drafted)) / NUM_DRAFT_TOKENS if method in DRAFTS else float("nan")
    return measurement.generation_tps, rate, [r.token for r in responses]


def copy_task_table(folders, repeats: int) -> None:
    from mlx_tfm.tokenizer import load_tokenizer

    task = copy_task(load_tokenizer(folders["target-float32"]))
    print(f"\n1. copy task: {len(task[0])}-token prompt, {len(task[1])}-token answer; greedy; best of {repeats}")
    runs = [("mlx_tfm", "plain"), ("mlx_tfm", "prompt lookup"), *[("mlx_tfm", d) for d in DRAFTS],
            ("mlx-lm", "plain"), *[("mlx-lm", d) for d in DRAFTS]]
    best = {}
    for repeat in range(repeats):
        for library, method in runs if repeat % 2 == 0 else runs[::-1]:
            gc.collect()
            mx.clear_cache()
            runner = run_ours if library == "mlx_tfm" else run_mlx_lm
            tps, rate, tokens = runner(folders, method, task)
            assert tokens == task[1], f"{library} {method} did not produce the scripted answer"
            if tps > best.get((library, method), (0, 0))[0]:
                best[(library, method)] = (tps, rate)
    plain = best[("mlx_tfm", "plain")][0]
    print(f"{'library':<9} {'method':<26} {'gen tok/s':>9} {'vs our plain':>13} {'accepted':>9}")
    for (library, method), (tps, rate) in best.items():
        label = {"prompt lookup": f"prompt lookup ({PROMPT_LOOKUP_TOKENS} tokens)",
                 "draft": f"2-layer draft ({NUM_DRAFT_TOKENS} tokens)",
                 "draft 4-bit": f"2-layer 4-bit draft ({NUM_DRAFT_TOKENS})"}.get(method, method)
        accepted = "" if rate != rate else f"{rate:.0%}"
        print(f"{library:<9} {label:<26} {tps:>9.2f} {tps / plain:>12.2f}x {accepted:>9}")
    for draft in DRAFTS:
        print(f"{draft} decoding, ours / mlx-lm's: {best[('mlx_tfm', draft)][0] / best[('mlx-lm', draft)][0]:.2f}x",
              flush=True)


# -- 2. the cost of checking k guesses ---------------------------------------------------------


def verification_cost(folders) -> None:
    from mlx_tfm import load

    model, _ = load(folders["target-float32"])
    context = mx.array([[(7 * i) % 4000 + 5 for i in range(300)]])
    print("\n2. one forward pass of the 135M float32 model after 300 cached positions (ms, best of 5)")
    for length in (1, 2, 4, 8, 16):
        times = []
        for _ in range(5):
            cache = model.make_cache()
            model(context, cache=cache)
            mx.eval([c.state for c in cache])
            start = time.perf_counter()
            mx.eval(model(context[:, :length], cache=cache))
            times.append(time.perf_counter() - start)
        print(f"  {length:>2} positions: {1000 * min(times):7.1f} ms", flush=True)


# -- 3. the KV cache at 4,096 positions ---------------------------------------------------------


def fill(cache: list, args, length: int, dtype) -> None:
    """``length`` positions of random keys and values in every layer."""
    mx.random.seed(0)
    for layer in cache:
        shape = (1, args.num_key_value_heads, length, args.head_dim)
        layer.update_and_fetch(mx.random.normal(shape).astype(dtype), mx.random.normal(shape).astype(dtype))
    mx.eval([layer.state for layer in cache])


def decode_ms(model, cache: list, steps: int) -> float:
    token = mx.array([[42]])
    for _ in range(2):  # warm up (the quantized path's first call)
        mx.eval(model(token, cache=cache))
    start = time.perf_counter()
    for _ in range(steps):
        token = mx.argmax(model(token, cache=cache)[:, -1:], axis=-1)
        mx.eval(token)
    return 1000 * (time.perf_counter() - start) / steps


def bytes_at(cache: list, length: int) -> float:
    """The cache's arrays' bytes per position (axis 2 of each), times ``length``: the same
    measure for both libraries, whatever room their buffers keep ahead."""
    arrays = [a for layer in cache for _, a in tree_flatten(layer.state) if isinstance(a, mx.array)]
    return sum(a.nbytes / a.shape[2] for a in arrays) * length


def kv_table(folders, repeats: int, length: int = 4096) -> None:
    import mlx_lm
    from mlx_lm.models import cache as lm_cache

    from mlx_tfm import load
    from mlx_tfm.model.cache import KVQuantization, quantized_layers

    print(f"\n3. KV cache at {length} positions (random keys and values), then 8 decoding steps; "
          f"ms/token best of {repeats}, the caches taking turns")
    print(f"{'model':<9} {'cache':<7} {'library':<8} {'MB':>7} {'vs float16':>10} {'ms/token':>9}")
    float16_bytes = None
    for name, dtype in (("float16", mx.float16), ("float32", mx.float32)):
        models = {"mlx_tfm": load(folders[f"target-{name}"])[0], "mlx-lm": mlx_lm.load(str(folders[f"target-{name}"]))[0]}
        args = models["mlx_tfm"].args

        def make(library: str, bits: int | None) -> list:
            if library == "mlx-lm":
                return [lm_cache.KVCache() if bits is None else lm_cache.QuantizedKVCache(64, bits)
                        for _ in models["mlx-lm"].layers]
            layers = models["mlx_tfm"].make_cache()
            return layers if bits is None else quantized_layers(layers, KVQuantization(bits, 64, start=0))

        configs = [(bits, library) for bits in (None, 8, 4) for library in models]
        best, sizes = {}, {}
        for _ in range(repeats):
            for bits, library in configs:
                gc.collect()
                mx.clear_cache()
                cache = make(library, bits)
                fill(cache, args, length - 1, dtype)
                ms = decode_ms(models[library], cache, steps=8)
                best[(bits, library)] = min(ms, best.get((bits, library), ms))
                sizes[(bits, library)] = bytes_at(cache, length)
        for bits, library in configs:
            size = sizes[(bits, library)]
            float16_bytes = float16_bytes or size
            label = "float" if bits is None else f"{bits}-bit"
            print(f"{name:<9} {label:<7} {library:<8} {size / 1e6:>7.1f} {size / float16_bytes:>9.3f}x "
                  f"{best[(bits, library)]:>9.1f}", flush=True)
        del models


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--parts", default="copy,cost,kv", help="which parts to run (copy, cost, kv)")
    parser.add_argument("--folder", type=Path, default=Path("/tmp/mlx_tfm_benchmark_speculative"))
    args = parser.parse_args()
    from mlx_tfm.blas import blas_description

    folders = build_models(args.folder)
    print(f"BLAS: {blas_description()}; {json.dumps({k: LLAMA_135M[k] for k in ('hidden_size', 'num_hidden_layers')})}")
    parts = args.parts.split(",")
    if "copy" in parts:
        copy_task_table(folders, args.repeats)
    if "cost" in parts:
        verification_cost(folders)
    if "kv" in parts:
        kv_table(folders, args.repeats)


if __name__ == "__main__":
    main()
