"""llama.cpp reads `mlx-tfm convert --to-gguf`'s files: for each type, whether llama.cpp's
greedy tokens from a prompt are the ones mlx_tfm decodes greedily from the same file (needs
llama-cpp-python: `pip install -e '.[benchmark]'`).

    python examples/check_gguf_export.py [--model tests/data/stories260K-hf] [--wide]

stories260K's rows are 64 long, shorter than a K-quant super-block (256), so its K-quant
files hold llama.cpp's stand-ins (Q5_0 / Q5_1 / Q8_0) as llama-quantize writes them;
``--wide`` checks a random Llama with rows of 256 instead (hidden 256, 4 layers, the
stories tokenizer), whose files hold Q4_K / Q5_K / Q6_K blocks.
"""

import argparse
import shutil
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlx_tfm.convert.gguf_export import GGUF_TYPES, export_gguf
from mlx_tfm.loading import load

ROOT = Path(__file__).resolve().parents[1]


def llama_cpp_greedy(path: Path, prompt: str, tokens: int) -> tuple[list[int], list[int]]:
    """llama.cpp's prompt ids and its greedy continuation's ids."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=512, n_threads=2, verbose=False)
    prompt_ids = llm.tokenize(prompt.encode())
    generated = []
    for token in llm.generate(prompt_ids, temp=0.0):
        generated.append(token)
        if len(generated) == tokens or token == llm.token_eos():
            break
    return prompt_ids, generated


def compare(path: Path, prompt: str, tokens: int) -> str:
    """Our model read from ``path``, fed llama.cpp's greedy tokens: where its own greedy
    choice first differs (it would have decoded the same tokens up to there), and by how
    much its top choice led there."""
    prompt_ids, theirs = llama_cpp_greedy(path, prompt, tokens)
    model, tokenizer = load(path)
    logits = model(mx.array([prompt_ids + theirs]))[0, len(prompt_ids) - 1 : -1].astype(mx.float32)  # (T, V)
    ours = np.array(logits.argmax(axis=-1))
    text = tokenizer.decode(theirs).strip()[:60]
    differ = np.nonzero(ours != np.array(theirs))[0]
    if not len(differ):
        return f"same {len(theirs)} greedy tokens: {text!r}"
    step = int(differ[0])
    row = np.array(logits[step])
    return (f"same first {step} tokens; then ours {ours[step]} by {row[ours[step]] - row[theirs[step]]:.4f} "
            f"over llama.cpp's {theirs[step]}: {text!r}")


def wide_llama(folder: Path) -> Path:
    """A random Llama with 256-long rows, its weights drawn wide enough (std 0.15) that
    greedy choices have clear winners."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0.0, 0.15)
    model.save_pretrained(folder)
    for name in ("tokenizer.model", "tokenizer_config.json"):
        shutil.copy(ROOT / "tests/data/stories260K-hf" / name, folder / name)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "tests/data/stories260K-hf"))
    parser.add_argument("--wide", action="store_true", help="a random Llama with 256-long rows instead of --model")
    parser.add_argument("--prompt", default="Once upon a time")
    parser.add_argument("--tokens", type=int, default=60)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        source = wide_llama(Path(folder) / "wide") if args.wide else args.model
        for kind in GGUF_TYPES:
            path = export_gguf(source, Path(folder) / f"model-{kind}.gguf", kind, log=lambda *_: None)
            print(f"{kind:>6} {path.stat().st_size / 1e6:6.2f} MB  {compare(path, args.prompt, args.tokens)}")


if __name__ == "__main__":
    main()
