"""Fine-tuning a loaded model, as ``mlx-tfm lora`` runs it: LoRA, DoRA or full, on a float
or quantized (QLoRA) base, with mlx-lm's flags, YAML config and adapter files."""

from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.optimizers as optim
from mlx.utils import tree_flatten

from ..atomic import remove_stale_temporaries
from ..datasets import load_split
from ..distributed.world import World, join
from ..errors import UserError
from ..model.lora import FINE_TUNE_TYPES, LORA_DEFAULTS, apply_lora
from ..model.vision_language import VisionLanguageModel
from ..weights.adapters import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    load_adapter_weights,
    load_adapters,
    save_adapters,
)
from .data import LengthGroupedBatches
from .image_data import ImageBatches, load_image_split, refuse_images_for_text_model
from .image_loss import image_loss
from .options import LOOP_RULES, LoopOptions, Rule, check_options, one_of, positive, whole
from .reporting import ProgressReporter
from .seq2seq import check_prompts, loss_for
from .trainer import TrainingDiverged, evaluate, loss_fn, train, training_args

OPTIMIZERS = {"adam": optim.Adam, "adamw": optim.AdamW, "sgd": optim.SGD, "adafactor": optim.Adafactor}
SCHEDULES = {
    "cosine_decay": optim.cosine_decay,
    "linear_schedule": optim.linear_schedule,
    "exponential_decay": optim.exponential_decay,
    "step_decay": optim.step_decay,
}


@dataclass(frozen=True, kw_only=True)
class FinetuneOptions(LoopOptions):
    """What ``mlx-tfm lora`` runs with: ``mlx_lm.lora``'s options by its names (flags and
    YAML keys) with its defaults, so a recipe means the same thing in both. Checked when
    created: a bad value is one line naming the option. Build it with ``from_dict``."""

    # The loop's options (batch_size, iters, val_batches, steps_per_report, steps_per_eval,
    # save_every, grad_accumulation_steps, grad_checkpoint, log_grad_norms, seed) come from
    # LoopOptions with mlx-lm's defaults.
    model: str | None = None
    train: bool = False
    data: str = "data"
    fine_tune_type: str = "lora"
    optimizer: str = "adam"
    optimizer_config: dict = field(default_factory=dict)  # {optimizer name: {its keyword arguments}}
    mask_prompt: bool = False
    num_layers: int = 16  # -1: every layer
    learning_rate: float = 1e-5
    resume_adapter_file: str | None = None
    adapter_path: str = "adapters"
    test: bool = False
    test_batches: int = 500  # -1: all
    max_seq_length: int = 2048
    lr_schedule: dict | None = None  # {name, arguments, warmup, warmup_init}
    lora_parameters: dict = field(default_factory=lambda: dict(LORA_DEFAULTS))  # rank, scale, dropout, keys
    # image-text models: the tower and projector stay frozen unless asked (mlx-vlm's --train-vision)
    train_vision: bool = False  # train the vision tower and the projector, in full
    train_projector: bool = False  # train the projector alone, in full

    @classmethod
    def from_dict(cls, values: dict, source: str | None = None) -> "FinetuneOptions":
        """Options from ``values`` by name (None: the default); ``lora_parameters`` fills
        in the LoRA defaults it leaves out. ``source`` (a recipe file) names where an
        unknown option came from."""
        unknown = sorted(set(values) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise UserError(f"{source + ': ' if source else ''}unknown option(s) {', '.join(unknown)}")
        given = {name: value for name, value in values.items() if value is not None}
        if isinstance(given.get("lora_parameters"), dict):
            given["lora_parameters"] = {**LORA_DEFAULTS, **given["lora_parameters"]}
        return cls(**given)

    def __post_init__(self):
        if self.model is None:
            raise UserError("no model: pass --model or set model in the -c config")
        check_options(vars(self), FINETUNE_RULES, spell=_spelled)
        check_options(self.lora_parameters, LORA_PARAMETER_RULES, spell=lambda name: f"lora_parameters.{name}")
        if self.lr_schedule is not None:
            _check_schedule(self.lr_schedule)
        if not self.train and not self.test:
            raise UserError("nothing to do: pass --train and/or --test")


FINETUNE_RULES = {
    "model": Rule(str), "train": Rule(bool), "data": Rule(str), "fine_tune_type": one_of(FINE_TUNE_TYPES),
    "optimizer": one_of(tuple(OPTIMIZERS)),
    "optimizer_config": Rule(dict, lambda v: all(isinstance(s, dict) for s in v.values()),
                             "a mapping of optimizer name to its settings"),
    "mask_prompt": Rule(bool),
    "num_layers": Rule(int, lambda v: v == -1 or v >= 1, "-1 (every layer) or a whole number >= 1"),
    **LOOP_RULES, "learning_rate": positive(), "resume_adapter_file": Rule(str, optional=True),
    "adapter_path": Rule(str), "test": Rule(bool), "test_batches": Rule(int), "max_seq_length": whole(2),
    "lr_schedule": Rule(dict, optional=True), "lora_parameters": Rule(dict),
    "train_vision": Rule(bool), "train_projector": Rule(bool),
}  # fmt: skip
FLAGLESS = ("optimizer_config", "lr_schedule", "lora_parameters")  # YAML only


def _spelled(name: str) -> str:
    return name if name in FLAGLESS else f"{name} (--{name.replace('_', '-')})"


LORA_PARAMETER_RULES = {
    "rank": whole(1),
    "scale": Rule(float),
    "dropout": Rule(float, lambda v: 0 <= v < 1, "a number in [0, 1)"),
    "keys": Rule(list, lambda v: all(isinstance(k, str) for k in v), "a list of module names", optional=True),
}


def _check_schedule(spec: dict) -> None:
    if spec.get("name") not in SCHEDULES:
        raise UserError(f"unknown lr_schedule name {spec.get('name')!r} ({', '.join(SCHEDULES)})")
    if not isinstance(spec.get("arguments", []), list):
        raise UserError(f"lr_schedule.arguments must be a list, not {spec['arguments']!r}")


def build_schedule(options: FinetuneOptions):
    """mlx-lm's ``lr_schedule`` {name, arguments, warmup, warmup_init}, or a constant rate."""
    spec = options.lr_schedule
    if not spec:
        return options.learning_rate
    arguments = spec.get("arguments", [])
    schedule = SCHEDULES[spec["name"]](*arguments)
    warmup = spec.get("warmup", 0)
    if not warmup:
        return schedule
    ramp = optim.linear_schedule(spec.get("warmup_init", 0.0), arguments[0], warmup)
    return optim.join_schedules([ramp, schedule], [warmup + 1])


def build_optimizer(options: FinetuneOptions) -> optim.Optimizer:
    keywords = dict(options.optimizer_config.get(options.optimizer, {}))
    return OPTIMIZERS[options.optimizer](learning_rate=build_schedule(options), **keywords)


def load_examples(options: FinetuneOptions, split: str, tokenizer, model=None):
    """A split's examples; an image-text ``model``'s may hold images (image_data.py)."""
    if isinstance(model, VisionLanguageModel):
        return load_image_split(Path(options.data), split, tokenizer, model.vision_args.image_token_id,
                                options.max_seq_length, options.mask_prompt)
    if model is not None:
        refuse_images_for_text_model(Path(options.data), [split], model.args.model_type)
    examples = load_split(Path(options.data), split, tokenizer, options.max_seq_length)
    if not options.mask_prompt:
        examples = [(tokens, 0) for tokens, _ in examples]
    return examples


def describe_trainable(model) -> str:
    total = sum(v.size for _, v in tree_flatten(model.parameters()))
    trainable = sum(v.size for _, v in tree_flatten(model.trainable_parameters()))
    return f"Trainable parameters: {100 * trainable / total:.3f}% ({trainable / 1e6:.3f}M/{total / 1e6:.3f}M)"


def saved_adapter_config(options: FinetuneOptions) -> dict:
    """adapter_config.json: mlx-lm keeps the whole training configuration there."""
    config = dataclasses.asdict(options)
    config["lora_parameters"] = {**options.lora_parameters, "keys": options.lora_parameters.get("keys")}
    return config


def unfreeze_vision(model, tower: bool) -> None:
    """Train the projector (and, with ``tower``, the vision tower) in full beside the adapters."""
    if not isinstance(model, VisionLanguageModel):
        raise UserError(f"--train-vision / --train-projector: this model ({model.args.model_type}) has no vision tower")
    model.multi_modal_projector.unfreeze()
    if tower:
        model.vision_tower.unfreeze()


def finetune(options: FinetuneOptions) -> int:
    """Under mlx.launch, data parallel: every rank trains on its share of each batch, the
    gradients are averaged inside the step, rank 0 reports and writes the adapters."""
    from ..loading import load

    world = join()
    world.check_divides(options.batch_size)
    if not Path(options.data).is_dir():
        raise UserError(f"--data {options.data} is not a folder with train/valid/test .jsonl files")
    mx.random.seed(options.seed)
    model, tokenizer = load(options.model)
    takes_images = isinstance(model, VisionLanguageModel)
    if takes_images and world.size > 1:
        raise UserError("fine-tuning an image-text model runs in one process here, not under mlx.launch")
    loss, batching = (image_loss, ImageBatches) if takes_images else (loss_for(model), LengthGroupedBatches)
    if model.args.kind == "encoder-decoder":
        options = dataclasses.replace(options, mask_prompt=True)  # T5: the prompt is the encoder's input
    adapter_path = Path(options.adapter_path).expanduser()
    if options.train:
        train_set = load_examples(options, "train", tokenizer, model)
        valid_set = load_examples(options, "valid", tokenizer, model)
        test_set = load_examples(options, "test", tokenizer, model) if options.test else None
        if model.args.kind == "encoder-decoder":
            check_prompts(train_set + valid_set, options.data)
        run_training(model, options, train_set, valid_set, adapter_path, loss, world, batching)
    else:
        test_set = load_examples(options, "test", tokenizer, model)
        if (adapter_path / ADAPTER_CONFIG).is_file():
            load_adapters(model, adapter_path)
    if test_set is not None:
        model.eval()
        batches = batching(test_set, options.batch_size, options.seed).evaluation(options.test_batches)
        test_loss = evaluate(model, world.rows_of(batches), loss, world.group)
        print(f"Test loss {test_loss:.3f}, Test ppl {math.exp(min(test_loss, 700)):.3f}.")
    return 0


def run_training(model, options: FinetuneOptions, train_set, valid_set, adapter_path: Path, loss=loss_fn,
                 world: World = World(), batching=LengthGroupedBatches) -> None:
    """Adapt, train and save; ``batching``: the batches' class (``ImageBatches`` for image data)."""
    params = options.lora_parameters
    apply_lora(
        model,
        num_layers=options.num_layers,
        fine_tune_type=options.fine_tune_type,
        rank=params["rank"],
        scale=params["scale"],
        dropout=params["dropout"],
        keys=params.get("keys"),
    )
    if options.train_vision or options.train_projector:
        unfreeze_vision(model, tower=options.train_vision)
    if options.resume_adapter_file and world.leader:
        load_adapter_weights(model, Path(options.resume_adapter_file))
    world.start_alike(model)  # every rank starts from rank 0's trainable weights
    if world.leader:  # rank 0 alone reports and writes
        print(describe_trainable(model), file=sys.stderr)
        for stale in remove_stale_temporaries(adapter_path):
            print(f"removed {stale}, left by an interrupted run", file=sys.stderr)
    train_batches = batching(train_set, options.batch_size, options.seed)
    valid_batches = batching(valid_set, options.batch_size, options.seed)
    saved_config = saved_adapter_config(options)

    def save(step: int) -> Path:
        save_adapters(adapter_path, model, saved_config)
        return adapter_path / ADAPTER_WEIGHTS

    reporter = ProgressReporter(options.iters, save=save if world.leader else None)
    try:
        train(model, build_optimizer(options), lambda i: world.rows(train_batches.batch(i)),
              lambda: world.rows_of(valid_batches.evaluation(options.val_batches)), training_args(options), reporter,
              loss=loss, group=world.group)
    except TrainingDiverged as e:
        reporter.close()
        saved = (adapter_path / ADAPTER_WEIGHTS).is_file()
        raise UserError(f"{e}; " + (f"the last good adapters are in {adapter_path}" if saved else "no adapters were saved")) from None
    finally:
        reporter.close()
    if world.leader:
        print(f"Saved final weights to {adapter_path / ADAPTER_WEIGHTS}.")
        write_plots(adapter_path, reporter.history)


def write_plots(folder: Path, history: dict) -> None:
    from .plots import plot_grad_norms, plot_losses

    plot_losses(folder / "loss_curve.png", history["train"], history["valid"], title="fine-tuning")
    if history["grad_norms"]:
        plot_grad_norms(folder / "grad_norms.png", history["grad_norm_steps"], history["grad_norms"])
        print(f"Saved per-layer gradient norms to {folder / 'grad_norms.png'}")
