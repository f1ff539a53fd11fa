"""llama.cpp reads `mlx-tfm convert --to-gguf`'s files: for each type, its greedy text from
a prompt next to mlx_tfm's greedy text from the same file (needs llama-cpp-python:
`pip install -e '.[benchmark]'`).

    python examples/check_gguf_export.py [--model tests/data/stories260K-hf]
"""

import argparse
import tempfile
from pathlib import Path

import mlx_tfm
from mlx_tfm.convert.gguf_export import GGUF_TYPES, export_gguf
from mlx_tfm.loading import load

ROOT = Path(__file__).resolve().parents[1]


def llama_cpp_text(path: Path, prompt: str, tokens: int) -> str:
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=512, n_threads=2, verbose=False)
    return llm.create_completion(prompt, max_tokens=tokens, temperature=0.0)["choices"][0]["text"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "tests/data/stories260K-hf"))
    parser.add_argument("--prompt", default="Once upon a time")
    parser.add_argument("--tokens", type=int, default=60)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        for kind in GGUF_TYPES:
            path = export_gguf(args.model, Path(folder) / f"model-{kind}.gguf", kind, log=lambda *_: None)
            theirs = llama_cpp_text(path, args.prompt, args.tokens)
            model, tokenizer = load(path)
            ours = mlx_tfm.generate(model, tokenizer, args.prompt, max_tokens=args.tokens)
            same = "same text" if theirs.strip() == ours.strip() else "DIFFERENT"
            print(f"{kind:>5} {path.stat().st_size / 1e6:6.2f} MB  {same}: {theirs.strip()[:70]!r}")
            if same != "same text":
                print(f"{'':>15} ours: {ours.strip()[:70]!r}")


if __name__ == "__main__":
    main()
