"""`mlx-tfm lora`: fine-tune with LoRA, DoRA or full fine-tuning; flags follow mlx_lm.lora."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from ..errors import UserError
from .flags import flag_adder, length_flags, output_flags

HELP = "Fine-tune a model with LoRA / QLoRA / DoRA or fully (flags and -c YAML as mlx_lm.lora)."


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..training.finetune import FinetuneOptions

    # Defaults are None so that a -c YAML value is only overridden by a flag actually given;
    # the defaults that apply live in FinetuneOptions and are written into each help.
    flag = flag_adder(p, FinetuneOptions)
    flag("--model", help="model folder or Hugging Face repo id")
    flag("--train", action="store_true", default=None, help="train")
    flag("--data", help="folder with train.jsonl, valid.jsonl, test.jsonl")
    flag("--fine-tune-type", choices=["lora", "dora", "full"], help="which weights to train")
    flag("--optimizer", choices=["adam", "adamw", "sgd", "adafactor"], help="the optimizer")
    flag("--mask-prompt", action="store_true", default=None, help="loss on completions / the last turn only")
    flag("--num-layers", type=int, help="how many of the last layers to fine-tune (-1: all)")
    flag("--batch-size", type=int, help="examples per optimizer step")
    flag("--iters", type=int, help="optimizer steps")
    flag("--val-batches", type=int, help="validation batches (-1: all)")
    flag("--learning-rate", type=float, help="the learning rate (-c lr_schedule: a schedule)")
    flag("--steps-per-report", type=int, help="print the training loss every N steps")
    flag("--steps-per-eval", type=int, help="validate every N steps")
    flag("--resume-adapter-file", help="start from these adapter weights")
    flag(*output_flags("--adapter-path"), help="where to save adapters")
    flag("--save-every", type=int, help="save adapters every N steps")
    flag("--test", action="store_true", default=None, help="report test loss and perplexity")
    flag("--test-batches", type=int, help="test batches (-1: all)")
    flag(*length_flags("--max-seq-length"), type=int, help="truncate longer examples to this many tokens")
    flag("-c", "--config", help="YAML file with any of these options and lora_parameters")
    flag("--grad-checkpoint", action="store_true", default=None, help="recompute activations to save memory")
    flag("--grad-accumulation-steps", type=int, help="micro-batches summed into each optimizer step")
    flag("--log-grad-norms", action="store_true", default=None, help="plot per-layer gradient norms")
    flag("--seed", type=int, help="seed of the data order, dropout and the adapters' initial weights")
    flag("--train-vision", action="store_true", default=None, help="image-text models: also train the vision tower "
         "and projector in full (frozen by default)")
    flag("--train-projector", action="store_true", default=None, help="image-text models: also train the projector")


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
