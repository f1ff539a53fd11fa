"""`mlx-tfm lora`: fine-tune with LoRA, DoRA or full fine-tuning; flags follow mlx_lm.lora."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from ..errors import UserError

HELP = "Fine-tune a model with LoRA / QLoRA / DoRA or fully (flags and -c YAML as mlx_lm.lora)."


def add_arguments(p: argparse.ArgumentParser) -> None:
    # Defaults are None so that a -c YAML value is only overridden by a flag actually given.
    p.add_argument("--model", help="model folder or Hugging Face repo id")
    p.add_argument("--train", action="store_true", default=None, help="train")
    p.add_argument("--data", help="folder with train.jsonl, valid.jsonl, test.jsonl")
    p.add_argument("--fine-tune-type", choices=["lora", "dora", "full"], help="default: lora")
    p.add_argument("--optimizer", choices=["adam", "adamw", "sgd", "adafactor"], help="default: adam")
    p.add_argument("--mask-prompt", action="store_true", default=None, help="loss on completions / the last turn only")
    p.add_argument("--num-layers", type=int, help="how many of the last layers to fine-tune (-1: all; default 16)")
    p.add_argument("--batch-size", type=int, help="default: 4")
    p.add_argument("--iters", type=int, help="default: 1000")
    p.add_argument("--val-batches", type=int, help="validation batches, -1 for all (default 25)")
    p.add_argument("--learning-rate", type=float, help="default: 1e-5")
    p.add_argument("--steps-per-report", type=int, help="default: 10")
    p.add_argument("--steps-per-eval", type=int, help="default: 200")
    p.add_argument("--resume-adapter-file", help="start from these adapter weights")
    p.add_argument("--adapter-path", help="where to save adapters (default: adapters)")
    p.add_argument("--save-every", type=int, help="save adapters every N steps (default 100)")
    p.add_argument("--test", action="store_true", default=None, help="report test loss and perplexity")
    p.add_argument("--test-batches", type=int, help="test batches, -1 for all (default 500)")
    p.add_argument("--max-seq-length", type=int, help="truncate longer examples (default 2048)")
    p.add_argument("-c", "--config", help="YAML file with any of these options and lora_parameters")
    p.add_argument("--grad-checkpoint", action="store_true", default=None, help="recompute activations to save memory")
    p.add_argument("--grad-accumulation-steps", type=int, help="default: 1")
    p.add_argument("--log-grad-norms", action="store_true", default=None, help="plot per-layer gradient norms")
    p.add_argument("--seed", type=int, help="default: 0")


def run(args: argparse.Namespace) -> int:
    from ..training.finetune import finetune

    flags = {k: v for k, v in vars(args).items() if k not in ("config", "command", "_run")}
    return finetune(options_from(flags, args.config))


def options_from(flags: dict, yaml_path: str | None):
    """``FinetuneOptions``: flags given on the command line win over the -c YAML file,
    which wins over the defaults (as mlx_lm.lora)."""
    from ..training.finetune import FinetuneOptions

    values = read_yaml(Path(yaml_path)) if yaml_path else {}
    values.update({name: value for name, value in flags.items() if value is not None})
    return FinetuneOptions.from_dict(values, source=yaml_path)


def read_yaml(path: Path) -> dict:
    """The option: value mapping of a recipe; a float such as 1e-5 reads as a number
    (PyYAML alone reads it as text; mlx-lm's loader reads it so too)."""
    import yaml

    if not path.is_file():
        raise UserError(f"config file {path} not found")
    try:
        config = yaml.load(path.read_text(), Loader=_recipe_loader(yaml)) or {}
    except yaml.YAMLError as e:
        raise UserError(f"{path} is not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(config, dict):
        raise UserError(f"{path} must hold a mapping of option: value")
    return config


FLOAT = re.compile(
    r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+][0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.X,
)


def _recipe_loader(yaml):
    class RecipeLoader(yaml.SafeLoader):
        """SafeLoader that also reads 1e-5 (no dot) as a float."""

    RecipeLoader.add_implicit_resolver("tag:yaml.org,2002:float", FLOAT, list("-+0123456789."))
    return RecipeLoader
