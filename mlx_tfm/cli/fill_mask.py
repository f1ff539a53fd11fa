"""`mlx-tfm fill-mask`: a masked-LM's guesses for each mask token of a text.

One line per guess: probability, the token, the text with the token in place (a blank
line between mask tokens); ``--format json`` gives the same as a list per mask token.
"""

from __future__ import annotations

from .flags import free_text

HELP = "Fill the mask tokens of a text with a masked-LM encoder (BERT, RoBERTa, ModernBERT...)."


def add_arguments(parser) -> None:
    parser.add_argument("--model", required=True, help="model folder or Hugging Face repo (a *ForMaskedLM)")
    parser.add_argument("--text", required=True, type=free_text, help='e.g. "Paris is the [MASK] of France."')
    parser.add_argument("--top-k", type=int, default=5, help="guesses per mask token (default 5)")
    parser.add_argument("--format", default="text", help="text (default) or json")


def run(args) -> int:
    import json

    from ..encode.tasks import fill_mask
    from ..errors import UserError
    from ..loading import load

    if args.format not in ("text", "json"):
        raise UserError(f"--format must be text or json, got {args.format!r}")
    model, tokenizer = load(args.model)
    guesses = fill_mask(model, tokenizer, args.text, args.top_k)
    if args.format == "json":
        print(json.dumps([[{"score": g.score, "token": g.token, "token_str": g.token_str, "sequence": g.sequence}
                           for g in per_mask] for per_mask in guesses]))
        return 0
    for i, per_mask in enumerate(guesses):
        if i:
            print()
        for g in per_mask:
            print(f"{g.score:.4f}\t{g.token_str}\t{g.sequence}")
    return 0
