"""`mlx-tfm embed`: sentence embeddings of texts, as sentence-transformers makes them.

JSON (the default) goes to stdout as ``{"model", "dimensions", "embeddings": [[...], ...]}``;
``--format npy`` writes one float32 array (N, dims) to ``--output`` or stdout. Notices
(texts cut to max_seq_length, a plain encoder's default pooling) go to stderr.
"""

from __future__ import annotations

import sys

from .flags import add_output_argument, free_text

HELP = "Embed texts with an encoder model (sentence-transformers folders, BERT family)."
FORMATS = ("json", "npy")


def add_arguments(parser) -> None:
    parser.add_argument("--model", required=True, help="model folder or Hugging Face repo")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--text", nargs="+", type=free_text, help="texts to embed")
    source.add_argument("--file", help="a text file: one text per line ('-' for stdin)")
    parser.add_argument("--batch-size", type=int, default=32, help="texts per forward pass (default 32)")
    parser.add_argument("--pooling",
                        help="override the folder's pooling: cls, mean, max, lasttoken, ... (default: the folder's)")
    parser.add_argument("--normalize", action="store_true", default=None,
                        help="scale each vector to length 1 (default: as the folder says, with its Normalize module)")
    parser.add_argument("--no-normalize", dest="normalize", action="store_false", help="do not normalise")
    parser.add_argument("--prompt-name",
                        help="one of the model's prompts (config_sentence_transformers.json; default: its default "
                             "prompt, if it names one)")
    parser.add_argument("--dimensions", type=int,
                        help="keep the first N dimensions (Matryoshka models; default: all of them)")
    parser.add_argument("--format", default="json", help="json (default) or npy")
    add_output_argument(parser, "--output", "-o", metavar="FILE", help="write here (default: stdout)")


def read_lines(path: str) -> list[str]:
    from ..errors import UserError

    if path == "-":
        lines = sys.stdin.read().splitlines()
    else:
        try:
            with open(path, encoding="utf-8") as f:
                lines = f.read().splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"cannot read {path}: {e}") from None
    texts = [line for line in lines if line.strip()]
    if not texts:
        raise UserError(f"{path} has no text (one text per line)")
    return texts


def note(message: str) -> None:
    print(f"note: {message}", file=sys.stderr)


def run(args) -> int:
    from ..encode.embeddings import check_encoder, encode
    from ..errors import UserError
    from ..loading import load

    if args.format not in FORMATS:
        raise UserError(f"--format must be json or npy, got {args.format!r}")
    texts = args.text if args.text is not None else read_lines(args.file)
    model, tokenizer = load(args.model)
    check_encoder(model)
    vectors = encode(model, tokenizer, texts, batch_size=args.batch_size, normalize=args.normalize,
                     prompt_name=args.prompt_name, truncate_dim=args.dimensions, pooling=args.pooling, notify=note)
    write(vectors, args)
    return 0


def write(vectors, args) -> None:
    import io
    import json

    import numpy as np

    if args.format == "npy":
        buffer = io.BytesIO()
        np.save(buffer, vectors)
        data = buffer.getvalue()
    else:
        data = (json.dumps({"model": args.model, "dimensions": int(vectors.shape[1]),
                            "embeddings": vectors.tolist()}) + "\n").encode()
    if args.output:
        with open(args.output, "wb") as f:
            f.write(data)
    else:
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
