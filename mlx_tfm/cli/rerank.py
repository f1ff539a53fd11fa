"""`mlx-tfm rerank`: order documents by a cross-encoder's relevance to a query.

One line per document, most relevant first: rank, score, its index in the input, the
document; ``--format json`` gives ``[{"index", "score", "document"}, ...]``.
"""

from __future__ import annotations

import sys

from .flags import free_text

HELP = "Rank documents by relevance to a query with a cross-encoder (reranker) model."


def add_arguments(parser) -> None:
    parser.add_argument("--model", required=True, help="model folder or Hugging Face repo (a cross-encoder)")
    parser.add_argument("--query", required=True, type=free_text, help="the query")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--documents", nargs="+", type=free_text, help="documents to rank")
    source.add_argument("--file", help="a text file: one document per line ('-' for stdin)")
    parser.add_argument("--top-k", type=int, help="show only the k most relevant (default: all)")
    parser.add_argument("--batch-size", type=int, default=32, help="pairs per forward pass (default 32)")
    parser.add_argument("--format", default="text", help="text (default) or json")


def run(args) -> int:
    import json

    from ..encode.tasks import rerank
    from ..errors import UserError
    from ..loading import load
    from .embed import note, read_lines

    if args.format not in ("text", "json"):
        raise UserError(f"--format must be text or json, got {args.format!r}")
    if args.top_k is not None and args.top_k < 1:
        raise UserError(f"--top-k must be at least 1, got {args.top_k}")
    documents = args.documents if args.documents is not None else read_lines(args.file)
    model, tokenizer = load(args.model)
    ranked = rerank(model, tokenizer, args.query, documents, args.top_k, args.batch_size, notify=note)
    if args.format == "json":
        print(json.dumps([{"index": r.index, "score": r.score, "document": r.document} for r in ranked]))
        return 0
    for rank, r in enumerate(ranked, start=1):
        print(f"{rank}\t{r.score:.4f}\t{r.index}\t{r.document}")
    sys.stdout.flush()
    return 0
