"""llama.cpp reads `mlx-tfm convert --to-gguf`'s files: for each type, whether llama.cpp's
greedy tokens from a prompt are the ones mlx_tfm decodes greedily from the same file (needs
llama-cpp-python: `pip install -e '.[benchmark]'`).

    python examples/check_gguf_export.py [--model tests/data/stories260K-hf] [--wide]

stories260K's rows are 64 long, shorter than a K-quant super-block (256), so its K-quant
files hold llama.cpp's stand-ins (Q5_0 / Q5_1 / Q8_0) as llama-quantize writes them;
``--wide`` checks the model widened to rows of 256 first (examples/widen_llama.py: the same
logits), whose files hold Q4_K / Q5_K / Q6_K blocks.
"""

import argparse
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np
from widen_llama import widen

from mlx_tfm.convert.gguf_export import GGUF_TYPES, export_gguf
from mlx_tfm.loading import load

ROOT = Path(__file__).resolve().parents[1]


def llama_cpp_greedy(path: Path, prompt: str, tokens: int) -> tuple[list[int], list[int], np.ndarray]:
    """llama.cpp's prompt ids, its greedy continuation's ids, and its logits at every
    position of the two (P + T, V)."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=512, n_threads=2, verbose=False, logits_all=True)
    prompt_ids = llm.tokenize(prompt.encode())
    generated = []
    for token in llm.generate(prompt_ids, temp=0.0):
        generated.append(token)
        if len(generated) == tokens or token == llm.token_eos():
            break
    llm.reset()
    llm.eval(prompt_ids + generated)
    return prompt_ids, generated, np.array(llm.scores[: len(prompt_ids) + len(generated)])


def compare(path: Path, prompt: str, tokens: int) -> str:
    """Our model read from ``path``, fed llama.cpp's greedy tokens: where its own greedy
    choice first differs (it would have decoded the same tokens up to there) and by how
    much its top choice led there, and how far llama.cpp's logits are from ours."""
    prompt_ids, theirs, their_logits = llama_cpp_greedy(path, prompt, tokens)
    model, tokenizer = load(path)
    logits = np.array(model(mx.array([prompt_ids + theirs]))[0].astype(mx.float32))  # (P + T, V)
    gap = np.abs(logits - their_logits).max()
    logits = logits[len(prompt_ids) - 1 : -1]  # (T, V): the predictions of the generated tokens
    ours = logits.argmax(axis=-1)
    text = tokenizer.decode(theirs).strip()[:50]
    spread = f"logits within {gap:.3f} of ours (theirs' std {their_logits.std():.2f})"
    differ = np.nonzero(ours != np.array(theirs))[0]
    if not len(differ):
        return f"same {len(theirs)} greedy tokens, {spread}: {text!r}"
    step = int(differ[0])
    return (f"same first {step} tokens, then ours {ours[step]} by {logits[step, ours[step]] - logits[step, theirs[step]]:.4f}"
            f" over llama.cpp's {theirs[step]}; {spread}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "tests/data/stories260K-hf"))
    parser.add_argument("--wide", action="store_true", help="--model widened to 256-long rows (the same logits)")
    parser.add_argument("--prompt", default="Once upon a time")
    parser.add_argument("--tokens", type=int, default=60)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        source = widen(Path(args.model), Path(folder) / "wide") if args.wide else args.model
        for kind in GGUF_TYPES:
            path = export_gguf(source, Path(folder) / f"model-{kind}.gguf", kind, log=lambda *_: None)
            print(f"{kind:>6} {path.stat().st_size / 1e6:6.2f} MB  {compare(path, args.prompt, args.tokens)}")


if __name__ == "__main__":
    main()
