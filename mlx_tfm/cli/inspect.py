"""`mlx-tfm inspect`: a model's anatomy, as the explanations this project grew from draw it.

Parameters and bytes by part, each block's attention : FFN split next to the textbook
1 : 2, the architecture in words, KV-cache bytes and FLOPs per token; with ``--prompt``,
the residual stream's norm and the logit lens (and with ``--out``, attention maps and
pictures of both); with ``--compare``, which tensors differ from another model.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .flags import add_output_argument, free_text

HELP = "Show a model's anatomy: parameters and bytes by part, KV cache, FLOPs, attention and the residual stream."


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="model folder, Hugging Face repo, GGUF or llama2.c file")
    p.add_argument("--context", type=int,
                   help="KV-cache bytes and FLOPs at this many tokens (default: the model's context)")
    p.add_argument("--prompt", type=free_text,
                   help="trace this text: residual-stream norms and the logit lens (attention maps with --out; "
                        "default: no trace)")
    add_output_argument(p, "--out", metavar="FOLDER",
                        help="folder for the pictures (PNG) of --prompt and --compare (default: no pictures)")
    p.add_argument("--compare", metavar="B",
                   help="a second model: which tensors differ from --model, and by how much (default: none)")
    p.add_argument("--json", action="store_true", help="print everything as one JSON object")


def check_flags(args: argparse.Namespace) -> None:
    from ..errors import UserError

    if args.context is not None and args.context < 1:
        raise UserError(f"--context must be a positive number of tokens, got {args.context}")
    if args.out is not None and args.prompt is None and args.compare is None:
        raise UserError("--out holds the pictures of --prompt or --compare: give one of them")


def output_folder(out: str | None) -> Path | None:
    from ..errors import UserError

    if out is None:
        return None
    folder = Path(out).expanduser()
    if folder.exists() and not folder.is_dir():
        raise UserError(f"--out {folder} is a file, not a folder")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def run(args: argparse.Namespace) -> int:
    from ..inspect import report, text
    from ..inspect.source import open_model

    check_flags(args)
    out = output_folder(args.out)
    inspected = open_model(args.model)
    result = {"anatomy": report.anatomy(inspected, args.context)}
    if args.prompt is not None:
        result["stream"] = report.stream(inspected.model, inspected.tokenizer(), args.prompt, out)
    if args.compare is not None:
        other = open_model(args.compare)
        result["compare"] = report.comparison(inspected.model, other.model, (args.model, args.compare), out)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    sections = [text.anatomy_text(result["anatomy"])]
    if "stream" in result:
        sections.append(text.stream_text(result["stream"]))
    if "compare" in result:
        sections.append(text.comparison_text(result["compare"]))
    print("\n\n".join(sections))
    return 0
