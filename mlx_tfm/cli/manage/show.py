"""`mlx-tfm show MODEL`: a model's config summary, chat template, license, quantization and size."""

from __future__ import annotations

from pathlib import Path

from ...errors import UserError
from . import find_local_model, human_count, human_size

HELP = "Show a model's family, shape, context length, chat template, license, quantization and size."


def add_arguments(parser) -> None:
    parser.add_argument("model", metavar="MODEL", help="a name `mlx-tfm list` shows, or a model folder")
    parser.add_argument("--template", action="store_true", help="print the whole chat template, not only its size")


def folder_of(name: str):
    """The described folder: any model folder given by path, else a listed model."""
    from ...weights.catalog import describe_folder, looks_like_a_model

    path = Path(name).expanduser()
    if path.is_dir():
        if not looks_like_a_model(path):
            raise UserError(f"{name} is not a model folder (it needs a config.json and weights)")
        return describe_folder(path, name=str(path))
    return find_local_model(name).folder


def summary(folder) -> dict[str, str]:
    from ...weights.catalog import license_of

    config = folder.config
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    fields = {"name": folder.name, "path": str(folder.path), "family": folder.family,
              "layers": text.get("num_hidden_layers"), "hidden size": text.get("hidden_size"),
              "heads": text.get("num_attention_heads"), "kv heads": text.get("num_key_value_heads"),
              "vocab": text.get("vocab_size"), "context length": text.get("max_position_embeddings"),
              "parameters": human_count(folder.parameters), "quantization": folder.quantization,
              "size": human_size(folder.size_bytes), "license": license_of(folder.path) or "none found"}
    return {key: "?" if value is None else str(value) for key, value in fields.items()}


def run(args) -> int:
    from ...weights.catalog import chat_template_of

    folder = folder_of(args.model)
    info = summary(folder)
    template = chat_template_of(folder.path)
    info["chat template"] = f"{len(template)} characters" if template else "none (plain prompts only)"
    width = max(map(len, info))
    for key, value in info.items():
        print(f"{key:<{width}}  {value}")
    if template and args.template:
        print(template)
    return 0
