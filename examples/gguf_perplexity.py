"""Perplexity of the shipped model's GGUF files, run by mlx_tfm and by llama.cpp (needs
llama-cpp-python: `pip install -e '.[benchmark]'`), on the held-out stories; also the model
widened to 256-long rows (examples/widen_llama.py, the same logits), whose K-quant files
hold real Q4_K / Q5_K / Q6_K blocks (the shipped model's 128-long rows get llama.cpp's
Q5_0 / Q5_1 / Q8_0 stand-ins).

    python examples/gguf_perplexity.py            # 18 minutes on 2 cores shared with other jobs

mlx_tfm decodes every block to float and multiplies in float32; llama.cpp's CPU kernels
round the activations to 8 bits too (Q8_0 blocks of 32 against Q4_0 / Q8_0 weights, Q8_K
super-blocks against K-quants), so the two columns differ by what that rounding costs.
"""

import argparse
import math
import tempfile
from pathlib import Path

import numpy as np
from widen_llama import widen

from mlx_tfm.convert.gguf_export import export_gguf
from mlx_tfm.generation.perplexity import perplexity, read_token_stream
from mlx_tfm.loading import load

ROOT = Path(__file__).resolve().parents[1]
TYPES = ("f32", "q8_0", "q6_k", "q5_k_m", "q4_k_m", "q4_k_s", "q4_0")


def llama_cpp_perplexity(path: Path, tokens: list[int], sequence_length: int) -> float:
    """Back-to-back windows as ``perplexity`` cuts them: each predicts its tokens 2..L."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=sequence_length, n_batch=sequence_length, logits_all=True,
                n_threads=2, verbose=False)
    losses = []
    for start in range(0, len(tokens) - sequence_length + 1, sequence_length):
        window = tokens[start : start + sequence_length]
        llm.reset()
        llm.eval(window)
        logits = np.array(llm.scores[: sequence_length - 1], np.float64)  # (L - 1, V)
        top = logits.max(axis=1)
        normalizer = top + np.log(np.exp(logits - top[:, None]).sum(axis=1))
        losses.extend(normalizer - logits[np.arange(sequence_length - 1), window[1:]])
    return math.exp(float(np.mean(losses)))


def report(name: str, source: Path, tokens: list[int], sequence_length: int, folder: Path) -> None:
    model, tokenizer = load(source)
    print(f"\n{name}: float {perplexity(model, tokenizer, tokens, sequence_length=sequence_length).perplexity:.4f}")
    print(f"{'type':>7} {'MB':>6} {'mlx_tfm':>9} {'llama.cpp':>10}")
    for kind in TYPES:
        path = export_gguf(source, folder / f"{name}-{kind}.gguf", kind, log=lambda *_: None)
        model, tokenizer = load(path)
        ours = perplexity(model, tokenizer, tokens, sequence_length=sequence_length).perplexity
        theirs = llama_cpp_perplexity(path, tokens, sequence_length)
        print(f"{kind:>7} {path.stat().st_size / 1e6:6.2f} {ours:9.4f} {theirs:10.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "mlx_tfm/assets/default-model"))
    parser.add_argument("--held-out", default=str(ROOT / "tests/data/stories260K/samples_heldout.txt"))
    parser.add_argument("--sequence-length", type=int, default=128)
    args = parser.parse_args()
    _, tokenizer = load(args.model)
    tokens = [int(t) for t in np.array(read_token_stream(args.held_out, tokenizer))]
    print(f"{len(tokens)} tokens in windows of {args.sequence_length}")
    with tempfile.TemporaryDirectory() as folder:
        report("shipped", Path(args.model), tokens, args.sequence_length, Path(folder))
        wide = widen(Path(args.model), Path(folder) / "wide")
        report("widened", wide, tokens, args.sequence_length, Path(folder))


if __name__ == "__main__":
    main()
