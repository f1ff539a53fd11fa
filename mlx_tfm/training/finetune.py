"""Fine-tuning a loaded model, as ``mlx-tfm lora`` runs it: LoRA, DoRA or full, on a float
or quantized (QLoRA) base, with mlx-lm's flags, YAML config and adapter files."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import mlx.core as mx
import mlx.optimizers as optim
from mlx.utils import tree_flatten

from ..atomic import remove_stale_temporaries
from ..errors import UserError
from .data import LengthGroupedBatches, load_split
from .lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, LORA_DEFAULTS, apply_lora, load_adapter_weights, load_adapters, save_adapters
from .reporting import ProgressReporter
from .trainer import TrainingArgs, TrainingDiverged, evaluate, train

# The defaults of mlx_lm.lora, so a recipe means the same thing in both.
DEFAULTS = {
    "model": None,
    "train": False,
    "data": "data",
    "fine_tune_type": "lora",
    "optimizer": "adam",
    "optimizer_config": {},
    "mask_prompt": False,
    "num_layers": 16,
    "batch_size": 4,
    "iters": 1000,
    "val_batches": 25,
    "learning_rate": 1e-5,
    "steps_per_report": 10,
    "steps_per_eval": 200,
    "resume_adapter_file": None,
    "adapter_path": "adapters",
    "save_every": 100,
    "test": False,
    "test_batches": 500,
    "max_seq_length": 2048,
    "grad_checkpoint": False,
    "grad_accumulation_steps": 1,
    "lr_schedule": None,
    "lora_parameters": dict(LORA_DEFAULTS),
    "seed": 0,
    "log_grad_norms": False,
}

OPTIMIZERS = {"adam": optim.Adam, "adamw": optim.AdamW, "sgd": optim.SGD, "adafactor": optim.Adafactor}
SCHEDULES = {
    "cosine_decay": optim.cosine_decay,
    "linear_schedule": optim.linear_schedule,
    "exponential_decay": optim.exponential_decay,
    "step_decay": optim.step_decay,
}


def merge_config(flags: dict, yaml_path: str | None) -> dict:
    """Flags given on the command line win over the YAML file, which wins over defaults."""
    config = dict(DEFAULTS)
    if yaml_path:
        config.update(read_yaml(Path(yaml_path)))
    config.update({k: v for k, v in flags.items() if v is not None and k in DEFAULTS})
    config["lora_parameters"] = {**LORA_DEFAULTS, **(config.get("lora_parameters") or {})}
    if config["model"] is None:
        raise UserError("no model: pass --model or set model in the -c config")
    return config


def read_yaml(path: Path) -> dict:
    import yaml

    if not path.is_file():
        raise UserError(f"config file {path} not found")
    try:
        config = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise UserError(f"{path} is not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(config, dict):
        raise UserError(f"{path} must hold a mapping of option: value")
    unknown = sorted(set(config) - set(DEFAULTS))
    if unknown:
        raise UserError(f"{path}: unknown option(s) {', '.join(unknown)}")
    return config


def build_schedule(config: dict):
    """mlx-lm's ``lr_schedule`` {name, arguments, warmup, warmup_init}, or a constant rate."""
    spec = config["lr_schedule"]
    if not spec:
        return config["learning_rate"]
    if spec.get("name") not in SCHEDULES:
        raise UserError(f"unknown lr_schedule name {spec.get('name')!r} ({', '.join(SCHEDULES)})")
    arguments = spec.get("arguments", [])
    schedule = SCHEDULES[spec["name"]](*arguments)
    warmup = spec.get("warmup", 0)
    if not warmup:
        return schedule
    ramp = optim.linear_schedule(spec.get("warmup_init", 0.0), arguments[0], warmup)
    return optim.join_schedules([ramp, schedule], [warmup + 1])


def build_optimizer(config: dict) -> optim.Optimizer:
    name = config["optimizer"]
    if name not in OPTIMIZERS:
        raise UserError(f"unknown optimizer {name!r} ({', '.join(OPTIMIZERS)})")
    options = dict((config.get("optimizer_config") or {}).get(name, {}))
    return OPTIMIZERS[name](learning_rate=build_schedule(config), **options)


def load_examples(config: dict, split: str, tokenizer):
    examples = load_split(Path(config["data"]), split, tokenizer, config["max_seq_length"])
    if not config["mask_prompt"]:
        examples = [(tokens, 0) for tokens, _ in examples]
    return examples


def describe_trainable(model) -> str:
    total = sum(v.size for _, v in tree_flatten(model.parameters()))
    trainable = sum(v.size for _, v in tree_flatten(model.trainable_parameters()))
    return f"Trainable parameters: {100 * trainable / total:.3f}% ({trainable / 1e6:.3f}M/{total / 1e6:.3f}M)"


def saved_adapter_config(config: dict) -> dict:
    """adapter_config.json: mlx-lm keeps the whole training configuration there."""
    params = config["lora_parameters"]
    return {
        **{k: v for k, v in config.items() if k not in ("lora_parameters", "config")},
        "lora_parameters": {**params, "keys": params.get("keys")},
    }


def finetune(config: dict) -> int:
    from ..loading import load

    if not config["train"] and not config["test"]:
        raise UserError("nothing to do: pass --train and/or --test")
    if not Path(config["data"]).is_dir():
        raise UserError(f"--data {config['data']} is not a folder with train/valid/test .jsonl files")
    mx.random.seed(config["seed"])
    model, tokenizer = load(config["model"])
    adapter_path = Path(config["adapter_path"]).expanduser()
    if config["train"]:
        train_set = load_examples(config, "train", tokenizer)
        valid_set = load_examples(config, "valid", tokenizer)
        test_set = load_examples(config, "test", tokenizer) if config["test"] else None
        run_training(model, tokenizer, config, train_set, valid_set, adapter_path)
    else:
        test_set = load_examples(config, "test", tokenizer)
        if (adapter_path / ADAPTER_CONFIG).is_file():
            load_adapters(model, adapter_path)
    if test_set is not None:
        model.eval()
        batches = LengthGroupedBatches(test_set, config["batch_size"], config["seed"]).evaluation(config["test_batches"])
        test_loss = evaluate(model, batches)
        print(f"Test loss {test_loss:.3f}, Test ppl {math.exp(min(test_loss, 700)):.3f}.")
    return 0


def run_training(model, tokenizer, config: dict, train_set, valid_set, adapter_path: Path) -> None:
    params = config["lora_parameters"]
    apply_lora(
        model,
        num_layers=config["num_layers"],
        fine_tune_type=config["fine_tune_type"],
        rank=params["rank"],
        scale=params["scale"],
        dropout=params["dropout"],
        keys=params.get("keys"),
    )
    if config["resume_adapter_file"]:
        load_adapter_weights(model, Path(config["resume_adapter_file"]))
    print(describe_trainable(model), file=sys.stderr)
    for stale in remove_stale_temporaries(adapter_path):
        print(f"removed {stale}, left by an interrupted run", file=sys.stderr)
    train_batches = LengthGroupedBatches(train_set, config["batch_size"], config["seed"])
    valid_batches = LengthGroupedBatches(valid_set, config["batch_size"], config["seed"])
    saved_config = saved_adapter_config(config)

    def save(step: int) -> Path:
        save_adapters(adapter_path, model, saved_config)
        return adapter_path / ADAPTER_WEIGHTS

    reporter = ProgressReporter(config["iters"], save=save)
    args = TrainingArgs(
        batch_size=config["batch_size"],
        iters=config["iters"],
        val_batches=config["val_batches"],
        steps_per_report=config["steps_per_report"],
        steps_per_eval=config["steps_per_eval"],
        steps_per_save=config["save_every"],
        grad_accumulation_steps=config["grad_accumulation_steps"],
        grad_checkpoint=config["grad_checkpoint"],
        log_grad_norms=config["log_grad_norms"],
        seed=config["seed"],
    )
    try:
        train(model, build_optimizer(config), train_batches.batch, lambda: valid_batches.evaluation(args.val_batches), args, reporter)
    except TrainingDiverged as e:
        reporter.close()
        kept = f"the last good adapters are in {adapter_path}" if (adapter_path / ADAPTER_WEIGHTS).is_file() else "no adapters were saved"
        raise UserError(f"{e}; {kept}") from None
    finally:
        reporter.close()
    print(f"Saved final weights to {adapter_path / ADAPTER_WEIGHTS}.")
    write_plots(adapter_path, reporter.history)


def write_plots(folder: Path, history: dict) -> None:
    from .plots import plot_grad_norms, plot_losses

    plot_losses(folder / "loss_curve.png", history["train"], history["valid"], title="fine-tuning")
    if history["grad_norms"]:
        plot_grad_norms(folder / "grad_norms.png", history["grad_norm_steps"], history["grad_norms"])
        print(f"Saved per-layer gradient norms to {folder / 'grad_norms.png'}")
