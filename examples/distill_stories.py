"""Sample a corpus of short stories from a teacher model, for training a student by distillation.

Batched sampling with our own library: B rows start from BOS and decode together through one
KV cache; each row stops at EOS or --max-tokens. Writes one story per line as
``{"text": ...}`` into OUTPUT/train.jsonl and OUTPUT/valid.jsonl.

    python examples/distill_stories.py --teacher tests/data/stories260K-hf \
        --output /tmp/stories-distill --tokens 2000000
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import mlx_tfm
import mlx.core as mx


def sample_batch(model, bos: int, eos: int, rows: int, max_tokens: int, temperature: float) -> list[list[int]]:
    """rows stories, each a token list without BOS/EOS; all rows decode together. The teacher
    (llama2.c stories) rarely ends a story itself: a row also stops at BOS or at max_tokens."""
    cache = model.make_cache()
    tokens = mx.full((rows, 1), bos, dtype=mx.int32)  # (B, 1)
    steps = []
    done = mx.zeros((rows,), dtype=mx.bool_)
    for _ in range(max_tokens):
        logits = model(tokens, cache=cache)[:, -1, :]  # (B, V)
        nxt = mx.random.categorical(logits * (1.0 / temperature))  # (B,)
        nxt = mx.where(done, eos, nxt)
        done = done | (nxt == eos) | (nxt == bos)
        steps.append(nxt)
        tokens = nxt[:, None]
        mx.eval(tokens, done)
        if len(steps) % 32 == 0 and done.all().item():
            break
    table = mx.stack(steps, axis=1).tolist()  # (B, T)
    return [row[: first_stop(row, (bos, eos))] for row in table]


def first_stop(row: list[int], stops) -> int:
    return next((i for i, t in enumerate(row) if t in stops), len(row))


def whole_sentences(text: str) -> str:
    """Cut a story cut short by max_tokens back to its last full sentence."""
    end = max(text.rfind(p) for p in ".!?\"")
    return text[: end + 1] if end > 0 else text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--teacher", default="tests/data/stories260K-hf")
    parser.add_argument("--output", required=True)
    parser.add_argument("--tokens", type=int, default=2_000_000, help="stop after this many sampled tokens")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.9)
    parser.add_argument("--valid-fraction", type=float, default=0.02)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    mx.random.seed(args.seed)
    model, tokenizer = mlx_tfm.load(args.teacher)
    bos, eos = model_bos_eos(args.teacher)
    texts, total, start = [], 0, time.perf_counter()
    while total < args.tokens:
        for story in sample_batch(model, bos, eos, args.batch_size, args.max_tokens, args.temperature):
            text = whole_sentences(tokenizer.decode(story).strip())
            if text:
                texts.append(text)
                total += len(story)
        rate = total / (time.perf_counter() - start)
        print(f"{len(texts)} stories, {total} tokens, {rate:.0f} tokens/s", flush=True)

    n_valid = max(1, int(len(texts) * args.valid_fraction))
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    for name, part in (("valid", texts[:n_valid]), ("train", texts[n_valid:])):
        with open(out / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps({"text": t}) + "\n" for t in part)
    print(f"wrote {len(texts) - n_valid} train / {n_valid} valid stories to {out}")


def model_bos_eos(folder: str) -> tuple[int, int]:
    config = json.loads((Path(folder) / "config.json").read_text())
    return config["bos_token_id"], config["eos_token_id"]


if __name__ == "__main__":
    main()
