"""`mlx-tfm perplexity`: a model's perplexity on a text, with its standard error (flags as
mlx_lm.perplexity). The number to compare before and after quantizing weights or the KV
cache. The result goes to stdout, the progress bar to stderr."""

from __future__ import annotations

import sys

from .flags import length_flags

HELP = "Perplexity of a model on a text file, jsonl file or data folder, with its standard error."


def add_arguments(parser) -> None:
    parser.add_argument("--model", required=True, help="model folder or Hugging Face repo")
    parser.add_argument("--adapter-path", help="folder of LoRA adapters to apply")
    parser.add_argument("--data", required=True,
                        help="a .txt file, a .jsonl file (text, prompt-completion or chat records) or a folder as "
                             "`mlx-tfm lora` takes (its test.jsonl, else valid.jsonl, else train.jsonl)")
    parser.add_argument("--split", choices=("train", "valid", "test"), help="which file of a data folder to read")
    parser.add_argument(*length_flags("--sequence-length"), type=int, default=512,
                        help="tokens per window (default: %(default)s)")
    parser.add_argument("--stride", type=int,
                        help="tokens between window starts (default: the sequence length, windows back to back as "
                             "mlx_lm.perplexity; smaller: overlapping windows, each scoring its last STRIDE tokens)")
    parser.add_argument("--num-samples", type=int, default=-1, help="use the first N windows (-1: all; default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=8, help="windows per forward pass (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=123, help="order of jsonl records (default: %(default)s, as mlx_lm)")
    parser.add_argument("--kv-bits", type=int, help="compute through a KV cache quantized to 4 or 8 bits")
    parser.add_argument("--kv-group-size", type=int, default=None,
                        help="KV-cache quantization group size: 32, 64 or 128 (default: the largest of them that "
                             "divides the model's head_dim)")


class ProgressBar:
    """``[#######.............]  12/40 windows`` on stderr, redrawn in place."""

    WIDTH = 30

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr

    def __call__(self, done: int, total: int) -> None:
        filled = self.WIDTH * done // total
        self.stream.write(f"\r[{'#' * filled}{'.' * (self.WIDTH - filled)}] {done}/{total} windows")
        if done == total:
            self.stream.write("\n")
        self.stream.flush()


def run(args) -> int:
    from ..generation.perplexity import check_settings, perplexity
    from ..loading import load

    stride = args.sequence_length if args.stride is None else args.stride
    check_settings(args.sequence_length, stride, args.num_samples, args.batch_size)
    model, tokenizer = load(args.model, adapter_path=args.adapter_path)
    result = perplexity(model, tokenizer, args.data, sequence_length=args.sequence_length, stride=stride,
                        num_samples=args.num_samples, batch_size=args.batch_size, seed=args.seed, split=args.split,
                        kv_bits=args.kv_bits, kv_group_size=args.kv_group_size, progress=ProgressBar())
    print(result)
    return 0
