"""`mlx-tfm pull REPO`: download a model from the Hugging Face hub into its cache."""

from __future__ import annotations

HELP = "Download a model from the Hugging Face hub into the local cache (with a progress bar)."


def add_arguments(parser) -> None:
    parser.add_argument("repo", metavar="REPO", help="a Hugging Face repo id, e.g. mlx-community/Qwen3-0.6B-4bit")


def run(args) -> int:
    from ...hub import pull

    print(f"downloaded {args.repo} to {pull(args.repo)}")
    return 0
