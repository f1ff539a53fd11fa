"""A sentence-transformers folder's modules, read and carried: ``modules.json`` names the
pipeline (the transformer, then ``1_Pooling``, optionally ``2_Dense`` layers and
``Normalize``); ``sentence_bert_config.json`` the longest input (``max_seq_length``);
``config_sentence_transformers.json`` the prompts. The converter copies these files as
they are, so a converted folder embeds as sentence-transformers embeds the original; the
loader reads them into one ``SentenceModules`` (``mlx_tfm.encode.embeddings.encode`` runs it).

A folder without ``modules.json`` (a plain transformers encoder) gets sentence-transformers'
own default: mean pooling, no Dense, no Normalize.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx

from ..errors import UserError
from ..jsonfile import read_json
from ..model.heads import POOLING_MODES

MODULES_FILE = "modules.json"
# sentence-transformers reads the first of these it finds (older versions wrote the others).
SENTENCE_CONFIG_FILES = ("sentence_bert_config.json", "sentence_roberta_config.json", "sentence_distilbert_config.json",
                         "sentence_xlm-roberta_config.json", "sentence_camembert_config.json")
PROMPTS_FILE = "config_sentence_transformers.json"
# The module types we run, by the last part of their class path in modules.json.
POOLING, DENSE, NORMALIZE, TRANSFORMER = "Pooling", "Dense", "Normalize", "Transformer"
# Older Pooling configs flag each mode (sentence-transformers' order, the order it concatenates).
LEGACY_POOLING_KEYS = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
                       "pooling_mode_mean_tokens": "mean", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                       "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}
DENSE_ACTIVATIONS = {"torch.nn.modules.activation.Tanh": "tanh", "torch.nn.modules.linear.Identity": "identity",
                     "torch.nn.modules.activation.ReLU": "relu", "torch.nn.modules.activation.GELU": "gelu",
                     "torch.nn.modules.activation.Sigmoid": "sigmoid", "torch.nn.modules.activation.SiLU": "silu"}


@dataclass(frozen=True)
class DenseLayer:
    """A ``Dense`` module: ``activation(x @ weight.T + bias)`` on the pooled vector."""

    weight: mx.array  # (out, in)
    bias: mx.array | None
    activation: str


@dataclass(frozen=True)
class SentenceModules:
    pooling: tuple[str, ...] = ("mean",)  # several modes are concatenated, in this order
    include_prompt: bool = True
    dense: tuple[DenseLayer, ...] = ()
    normalize: bool = False
    max_seq_length: int | None = None
    prompts: dict = field(default_factory=dict)
    default_prompt_name: str | None = None
    from_modules_json: bool = True  # False: sentence-transformers' default for a plain encoder
    # a cross-encoder's score of its single logit: sigmoid unless its config.json names another
    score_activation: str = "sigmoid"


def module_entries(folder: Path) -> list[dict]:
    """modules.json's entries ({"idx", "name", "path", "type"}), [] without the file."""
    path = folder / MODULES_FILE
    if not path.is_file():
        return []
    entries = read_json(path, expect=list)
    if not isinstance(entries, list) or not all(isinstance(e, dict) and "type" in e for e in entries):
        raise UserError(f"{path} is not a sentence-transformers module list")
    return entries


def module_kind(entry: dict) -> str:
    return entry["type"].rsplit(".", 1)[-1]


def sentence_files(folder: Path) -> dict[str, bytes]:
    """The files of the sentence-transformers modules (name relative to the folder -> bytes),
    for the converter to carry over: modules.json, the configs, and each module folder's
    files (2_Dense's weights included; PyTorch-only Dense weights are read by the importer)."""
    files = {name: (folder / name).read_bytes() for name in (MODULES_FILE, PROMPTS_FILE, *SENTENCE_CONFIG_FILES)
             if (folder / name).is_file()}
    for entry in module_entries(folder):
        sub = entry.get("path") or ""
        if not sub or not (folder / sub).is_dir():
            continue
        for file in sorted((folder / sub).iterdir()):
            if file.is_file() and file.suffix in (".json", ".safetensors", ".bin"):
                files[f"{sub}/{file.name}"] = file.read_bytes()
    return files


def pooling_modes(config: dict, source: Path) -> tuple[str, ...]:
    """A Pooling config's modes: ``pooling_mode`` (a name or a list) or the older flags."""
    modes = config.get("pooling_mode")
    if modes is None:
        modes = [mode for key, mode in LEGACY_POOLING_KEYS.items() if config.get(key)] or ["mean"]
    modes = (modes,) if isinstance(modes, str) else tuple(modes)
    check_pooling(modes, source)
    return modes


def check_pooling(modes: tuple[str, ...], source) -> None:
    unknown = [m for m in modes if m not in POOLING_MODES]
    if unknown:
        raise UserError(f"unknown pooling mode {unknown[0]!r} in {source}; known: {', '.join(POOLING_MODES)}")


def read_dense(folder: Path) -> DenseLayer:
    config = read_json(folder / "config.json")
    name = config.get("activation_function", "torch.nn.modules.activation.Tanh")
    if name not in DENSE_ACTIVATIONS:
        raise UserError(f"{folder}: Dense activation {name!r} is not supported ({', '.join(DENSE_ACTIVATIONS)})")
    if config.get("use_residual"):
        raise UserError(f"{folder}: Dense with use_residual is not supported")
    path = folder / "model.safetensors"
    if not path.is_file():
        raise UserError(f"{folder} has no model.safetensors (convert the folder with mlx-tfm convert first)")
    weights = mx.load(str(path))
    weight, bias = weights["linear.weight"].astype(mx.float32), weights.get("linear.bias")
    # computed now, on the loading thread: a lazy array may not be evaluated on another thread
    # (the server loads on one thread and embeds on others)
    mx.eval(weight, bias)
    return DenseLayer(weight, bias, DENSE_ACTIVATIONS[name])


def max_seq_length_of(folder: Path) -> int | None:
    """sentence_bert_config.json's max_seq_length, else tokenizer_config.json's
    model_max_length (where sentence-transformers 6 keeps it), else None."""
    for name in SENTENCE_CONFIG_FILES:
        if (folder / name).is_file():
            length = read_json(folder / name).get("max_seq_length")
            if length:
                return int(length)
            break
    tokenizer_config = folder / "tokenizer_config.json"
    length = read_json(tokenizer_config).get("model_max_length") if tokenizer_config.is_file() else None
    return int(length) if isinstance(length, (int, float)) and length < 1_000_000 else None


def score_activation(config: dict) -> str:
    """CrossEncoder's activation of a single logit: what config.json names (its
    ``sentence_transformers.activation_fn``, or the key sentence-transformers 3 wrote), else sigmoid."""
    path = (config.get("sentence_transformers") or {}).get("activation_fn") \
        or config.get("sbert_ce_default_activation_function") or "torch.nn.modules.activation.Sigmoid"
    if path not in DENSE_ACTIVATIONS:
        raise UserError(f"cross-encoder activation {path!r} is not supported ({', '.join(DENSE_ACTIVATIONS)})")
    return DENSE_ACTIVATIONS[path]


def read_sentence_modules(folder: Path, config: dict) -> SentenceModules:
    """The pipeline of a sentence-transformers folder (mean pooling alone without
    modules.json); ``config``: its config.json."""
    entries = module_entries(folder)
    prompts = read_json(folder / PROMPTS_FILE) if (folder / PROMPTS_FILE).is_file() else {}
    common = {"max_seq_length": max_seq_length_of(folder), "prompts": dict(prompts.get("prompts") or {}),
              "default_prompt_name": prompts.get("default_prompt_name"), "score_activation": score_activation(config)}
    if not entries:
        return SentenceModules(from_modules_json=False, **common)
    pooling, include_prompt, dense, normalize = None, True, [], False
    for entry in entries:
        kind, sub = module_kind(entry), folder / (entry.get("path") or "")
        if kind == POOLING:
            config = read_json(sub / "config.json")
            pooling, include_prompt = pooling_modes(config, sub / "config.json"), config.get("include_prompt", True)
        elif kind == DENSE:
            dense.append(read_dense(sub))
        elif kind == NORMALIZE:
            normalize = True
        elif kind != TRANSFORMER:
            raise UserError(f"{folder / MODULES_FILE} names a {kind} module, which mlx-tfm cannot run")
    return SentenceModules(pooling or ("mean",), include_prompt, tuple(dense), normalize, **common)


__all__ = ["SentenceModules", "DenseLayer", "read_sentence_modules", "sentence_files", "check_pooling"]
