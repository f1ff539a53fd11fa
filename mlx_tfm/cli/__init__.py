"""`mlx-tfm` console script: one subcommand per module, imported only when it runs.

Each subcommand module defines ``HELP`` (one line), ``add_arguments(parser)`` and
``run(args) -> int``. Heavy imports stay inside ``run`` so that ``mlx-tfm generate`` pays
for MLX and nothing else (cold start is part of every command).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from ..errors import UserError
from .flags import HelpFormatter, mark_free_text
from .interrupts import forget_handled_interrupts, hold_interrupts_in_extension_imports

SUBCOMMANDS = {
    "info": "mlx_tfm.cli.info",
    "generate": "mlx_tfm.cli.generate",
    "chat": "mlx_tfm.cli.chat",
    "convert": "mlx_tfm.cli.convert",
    "train": "mlx_tfm.cli.train",
    "lora": "mlx_tfm.cli.lora",
    "fuse": "mlx_tfm.cli.fuse",
    "inspect": "mlx_tfm.cli.inspect",
    "server": "mlx_tfm.cli.server",
    "embed": "mlx_tfm.cli.embed",
    "fill-mask": "mlx_tfm.cli.fill_mask",
    "rerank": "mlx_tfm.cli.rerank",
    "perplexity": "mlx_tfm.cli.perplexity",
    "example-data": "mlx_tfm.cli.example_data",
    # model management (cli/manage/)
    "list": "mlx_tfm.cli.manage.list",
    "show": "mlx_tfm.cli.manage.show",
    "pull": "mlx_tfm.cli.manage.pull",
    "rm": "mlx_tfm.cli.manage.rm",
    "ps": "mlx_tfm.cli.manage.ps",
}


def _available_subcommands() -> dict:
    modules = {}
    for name, module_name in SUBCOMMANDS.items():
        try:
            modules[name] = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name != module_name:  # a real import error inside the module
                raise
    return modules


def build_parser(modules: dict) -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The `mlx-tfm` parser, and each subcommand's parser by name (defaults shown in --help)."""
    from .. import __version__

    parser = argparse.ArgumentParser(prog="mlx-tfm", description="On-device transformer runtime on MLX.",
                                     formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"mlx-tfm {__version__}",
                        help="show mlx-tfm's version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers = {}
    for name, module in modules.items():
        p = sub.add_parser(name, help=module.HELP, description=module.HELP, formatter_class=HelpFormatter)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
        subparsers[name] = p
    return parser, subparsers


def main(argv: list[str] | None = None) -> int:
    hold_interrupts_in_extension_imports()
    code = command_status(sys.argv[1:] if argv is None else argv)
    forget_handled_interrupts()  # the status is ``code``, whatever Ctrl-C the command caught on the way
    return code


def command_status(argv: list[str]) -> int:
    try:
        parser, args = parsed(argv)
    except KeyboardInterrupt:  # Ctrl-C while the command's modules are still being imported
        print("\ninterrupted", file=sys.stderr)
        return 130
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    code, failure = run_command(args)
    if "mlx_tfm.distributed.world" in sys.modules:  # the command joined other ranks: tell them how it ended
        from ..distributed.world import command_ended

        command_ended(code, failure)
    settle_mlx()
    return code


def settle_mlx() -> None:
    """Wait for the main thread's queued MLX work before the process exits. (The threads
    that ran MLX work have freed their streams already: engine/threads.py.)"""
    if "mlx.core" in sys.modules:
        sys.modules["mlx.core"].synchronize()


def parsed(argv: list[str]) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """The `mlx-tfm` parser and ``argv`` parsed. Only the chosen subcommand's module is
    imported when it is named first."""
    if argv and argv[0] in SUBCOMMANDS:
        try:
            modules = {argv[0]: importlib.import_module(SUBCOMMANDS[argv[0]])}
        except ModuleNotFoundError:
            modules = _available_subcommands()
    else:
        modules = _available_subcommands()
    parser, subparsers = build_parser(modules)
    if argv and argv[0] in subparsers:
        argv = [argv[0], *mark_free_text(argv[1:], subparsers[argv[0]])]
    return parser, parser.parse_args(argv)


def run_command(args) -> tuple[int, str | None]:
    """The command's exit status, and what went wrong when it failed."""
    try:
        return int(args._run(args) or 0), None
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1, str(e)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130, "interrupted"
    except BrokenPipeError:
        return 0, None


if __name__ == "__main__":
    sys.exit(main())
