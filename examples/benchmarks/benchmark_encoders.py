"""Encoders and T5 against the torch references, in one run with the same thread count:

- sentence embeddings per second of a MiniLM-L6-shaped sentence-transformers model (6
  layers, 384 wide, 12 heads, 1536 FFN, vocabulary 30522, mean pooling, Normalize) on 512
  sentences of mixed length: ``mlx_tfm.encode`` against sentence-transformers' ``encode``;
- generated tokens per second of a T5-small-shaped model (6 + 6 layers, 512 wide, 8 heads,
  2048 FFN, vocabulary 32128), greedy: our decoding loop against transformers' ``generate``.

Both models have random weights (the speed does not depend on them) and a WordPiece
vocabulary made here; nothing is downloaded. Usage:

    python examples/benchmarks/benchmark_encoders.py [--threads N] [--sentences 512] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="threads for torch and the BLAS")
    parser.add_argument("--sentences", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens T5 generates per run")
    parser.add_argument("--prompt-tokens", type=int, default=48, help="T5's encoder input length")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each (the median is reported)")
    parser.add_argument("--skip", choices=["embeddings", "t5"], action="append", default=[])
    return parser.parse_args()


ARGS = parse_args()
# The BLAS reads its thread count when it loads: before mlx_tfm (which loads it) and torch.
for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[name] = str(ARGS.threads)

import mlx_tfm  # noqa: E402  (routes MLX's BLAS first)
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(ARGS.threads)
MINILM = dict(vocab_size=30522, hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536,
              max_position_embeddings=512)
T5_SMALL = dict(vocab_size=32128, d_model=512, d_kv=64, d_ff=2048, num_layers=6, num_heads=8,
                feed_forward_proj="relu", decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)


def timed(run, repeats: int) -> float:
    """The median seconds of ``repeats`` runs after one warm-up run."""
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def wordpiece_folder(folder: Path, vocab_size: int) -> list[str]:
    """A BERT tokenizer over ``vocab_size`` made-up words; returns the words."""
    from transformers import BertTokenizer

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    words = [f"w{i}" for i in range(vocab_size - len(specials))]
    (folder / "vocab.txt").write_text("\n".join(specials + words) + "\n")
    BertTokenizer(vocab=str(folder / "vocab.txt"), model_max_length=256).save_pretrained(folder)
    return words


def mixed_sentences(words: list[str], n: int, seed: int = 0) -> list[str]:
    """Lengths as in a retrieval corpus: mostly short, some long (4 to 200 words)."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(3.2, 0.8, n).astype(int), 4, 200)
    return [" ".join(rng.choice(words, length)) for length in lengths]


def bench_embeddings(root: Path) -> dict:
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling
    from transformers import BertConfig, BertModel

    folder = root / "minilm"
    folder.mkdir()
    BertModel(BertConfig(**MINILM)).eval().save_pretrained(folder)
    words = wordpiece_folder(folder, MINILM["vocab_size"])
    transformer = Transformer(str(folder), max_seq_length=256)
    reference = SentenceTransformer(modules=[transformer, Pooling(384, "mean"), Normalize()], device="cpu")
    reference.save(str(root / "st"))
    texts = mixed_sentences(words, ARGS.sentences)
    model, tokenizer = mlx_tfm.load(root / "st")
    ours = lambda: mlx_tfm.encode(model, tokenizer, texts, batch_size=ARGS.batch_size)  # noqa: E731
    theirs = lambda: reference.encode(texts, batch_size=ARGS.batch_size)  # noqa: E731
    difference = float(np.abs(ours() - theirs()).max())
    tokens = sum(min(len(ids), 256) for ids, _, _ in tokenizer.encode_truncated(texts, None, 256))
    seconds = {"mlx_tfm": timed(ours, ARGS.repeats), "sentence-transformers": timed(theirs, ARGS.repeats)}
    return {"seconds": seconds, "tokens": tokens, "max_difference": difference}


def bench_t5(root: Path) -> dict:
    from transformers import T5Config, T5ForConditionalGeneration

    from mlx_tfm.generation.step import generate_step

    torch.manual_seed(0)
    reference = T5ForConditionalGeneration(T5Config(**T5_SMALL)).eval()
    reference.save_pretrained(root / "t5")
    from mlx_tfm.loading import load_model

    model, _ = load_model(root / "t5")
    prompt = np.random.default_rng(0).integers(3, 32000, ARGS.prompt_tokens).tolist() + [1]
    n = ARGS.new_tokens

    def ours():
        decoder = model.bind(model.encode(mx.array([prompt])))
        tokens = [t for t, _ in generate_step(mx.array([model.args.decoder_start_token_id]), decoder, max_tokens=n)]
        return tokens

    def theirs():
        with torch.no_grad():
            out = reference.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return out[0, 1:].tolist()

    same = ours() == theirs()
    seconds = {"mlx_tfm": timed(ours, ARGS.repeats), "transformers": timed(theirs, ARGS.repeats)}
    return {"seconds": seconds, "tokens": n, "same_tokens": same}


def main() -> int:
    print(f"threads {ARGS.threads}; mlx {mx.__version__}, torch {torch.__version__}; median of {ARGS.repeats} runs",
          file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if "embeddings" not in ARGS.skip:
            result = bench_embeddings(root)
            s = result["seconds"]
            print(f"\nMiniLM-L6 shape, {ARGS.sentences} sentences ({result['tokens']} tokens), batch {ARGS.batch_size}; "
                  f"largest difference {result['max_difference']:.1e}")
            for name, seconds in s.items():
                print(f"  {name:22s} {ARGS.sentences / seconds:8.1f} sentences/s  ({seconds:.2f} s)")
            print(f"  speed-up: {s['sentence-transformers'] / s['mlx_tfm']:.2f}x")
        if "t5" not in ARGS.skip:
            result = bench_t5(root)
            s = result["seconds"]
            print(f"\nT5-small shape, greedy, {ARGS.prompt_tokens + 1}-token input, {result['tokens']} new tokens; "
                  f"same tokens as transformers: {result['same_tokens']}")
            for name, seconds in s.items():
                print(f"  {name:22s} {result['tokens'] / seconds:8.1f} tokens/s  ({seconds:.2f} s, encoder included)")
            print(f"  speed-up: {s['transformers'] / s['mlx_tfm']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
