"""``convert(hf_path, mlx_path, ...)``: read any supported source, check it against the
model it describes, cast / (de)quantize it, write an MLX folder."""

from __future__ import annotations

import atexit
import re
import shutil
import sys
import tempfile
from pathlib import Path

from ..atomic import remove_stale_temporaries
from ..errors import UserError
from ..families import architecture_for, on_disk_layout
from ..families.mlx_lm import MLX_LM_CONFIG_ALIASES, mlx_lm_config_keys
from ..hub import resolve_model_path
from ..model.config import ModelArgs
from ..weights.build import build_model
from ..weights.catalog import record_converted
from ..weights.files import (
    DEFAULT_MAX_SHARD_BYTES,
    DTYPES,
    cast_weights,
    dtype_name,
    save_model_folder,
)
from ..weights.quantization import (
    QUANT_RECIPES,
    dequantize_weights,
    quantization_plan,
    quantize_weights,
)
from .sources import Source

Q_BITS = (2, 3, 4, 5, 6, 8)
Q_GROUP_SIZES = (32, 64, 128)


def check_source(source: Source, origin: Path) -> tuple[ModelArgs, dict]:
    """Build the model the config describes and load the weights into it strictly, so a
    missing, unexpected or mis-shaped tensor is reported by name before anything is
    written. Returns the args and the weights in the on-disk layout."""
    weights = on_disk_layout(source.config, source.weights)
    config = source.config
    if source.quantization and not (config.get("quantization") or config.get("quantization_config")):
        config = {**config, "quantization": source.quantization}  # GGUF blocks carried over as MLX groups
    model = build_model(config, weights, origin)  # lazy: its random init is never computed
    return model.args, weights


def output_dtype(requested: str | None, config: dict) -> str | None:
    """--dtype, else the source's torch_dtype (as mlx-lm), else the tensors' own."""
    if requested is not None:
        return requested
    source = config.get("torch_dtype") or config.get("dtype")
    return source if source in DTYPES else None


def prepare_weights(weights: dict, source_quantization: dict | None, *, dtype, quantize, q_bits, q_group_size, dequantize,
                    plan=None):
    """-> (weights, quantization of the result or None). ``plan``: module path -> its
    quantization settings (``mlx_tfm.weights.quantization.quantization_plan``)."""
    quantization = source_quantization
    if quantization and (dequantize or quantize):
        weights, quantization = dequantize_weights(weights, quantization, DTYPES.get(dtype)), None
    if dtype is not None:
        weights = cast_weights(weights, DTYPES[dtype])
    if quantize:
        weights, per_layer = quantize_weights(weights, q_group_size, q_bits, plan)
        quantization = {"group_size": q_group_size, "bits": q_bits, "mode": "affine", **per_layer}
    return weights, quantization


def classic_rope_keys(config: dict) -> dict:
    """transformers 5 keeps rope settings only in ``rope_parameters``; mlx-lm (and
    transformers 4) read ``rope_theta`` / ``rope_scaling`` / ``partial_rotary_factor``,
    so the output carries both spellings."""
    params = dict(config.get("rope_parameters") or {})
    extra = {}
    if "rope_theta" in params and "rope_theta" not in config:
        extra["rope_theta"] = params.pop("rope_theta")
    if "partial_rotary_factor" in params and "partial_rotary_factor" not in config:
        extra["partial_rotary_factor"] = params.pop("partial_rotary_factor")
    if params.get("rope_type", "default") != "default" and "rope_scaling" not in config:
        extra["rope_scaling"] = params
    return extra


def output_config(config: dict, quantization: dict | None, dtype: str) -> dict:
    config = {k: v for k, v in config.items() if k not in ("quantization", "quantization_config")}
    config.update(classic_rope_keys(config))
    config.update(mlx_lm_config_keys(config))
    for key, same_as in MLX_LM_CONFIG_ALIASES.get(config["model_type"], {}).items():
        if key not in config and same_as in config:
            config[key] = config[same_as]
    config["torch_dtype"] = dtype
    if "dtype" in config:  # transformers 5 spells it so
        config["dtype"] = dtype
    if quantization:
        settings = {"mode": "affine", **quantization}
        config["quantization"] = settings
        config["quantization_config"] = settings  # mlx-lm writes both
    return config


def parse_size(text: str | int) -> int:
    """'5GB', '100MB', '20KB' or a byte count -> bytes."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?)B?\s*", str(text).upper())
    if not match:
        raise UserError(f"cannot read size {text!r} (use e.g. 5GB, 500MB, 20KB)")
    number, unit = match.groups()
    return int(float(number) * {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3}[unit])


def check_settings(quantize: bool, dequantize: bool, awq: dict | None, quant_predicate: str | None, q_bits: int,
                   q_group_size: int, dtype: str | None) -> None:
    """One line for settings that contradict each other or are out of range."""
    if quantize and dequantize:
        raise UserError("choose either --quantize or --dequantize, not both")
    if awq is not None and not quantize:
        raise UserError("--awq scales the weights for quantization: pass -q too")
    if quant_predicate is not None and (not quantize or quant_predicate not in QUANT_RECIPES):
        raise UserError(f"--quant-predicate takes -q and one of {', '.join(QUANT_RECIPES)}")
    if q_bits not in Q_BITS or q_group_size not in Q_GROUP_SIZES:
        raise UserError(f"--q-bits must be one of {Q_BITS} and --q-group-size one of {Q_GROUP_SIZES}")
    if dtype is not None and dtype not in DTYPES:
        raise UserError(f"--dtype must be one of {', '.join(DTYPES)}")


def convert(
    hf_path: str | Path,
    mlx_path: str | Path = "mlx_model",
    quantize: bool = False,
    q_group_size: int = 64,
    q_bits: int = 4,
    dtype: str | None = None,
    dequantize: bool = False,
    overwrite: bool = False,
    max_shard_size: str | int = DEFAULT_MAX_SHARD_BYTES,
    quant_predicate: str | None = None,
    awq: dict | None = None,
    quantize_vision: bool = False,
    log=print,
) -> Path:
    """Convert ``hf_path`` (a folder, a llama2.c or GGUF file, or a hub repo id) into an
    MLX folder at ``mlx_path``. ``quant_predicate``: one of mlx_lm.convert's mixed-bit
    recipes (``QUANT_RECIPES``). ``awq``: scale the weights as AWQ does before quantizing
    (``awq.awq_weights``' keywords: data, samples, sequence_length). ``quantize_vision``: -q
    quantizes an image-text model's vision tower and projector too (else they stay in
    float). Returns the folder."""
    check_settings(quantize, dequantize, awq, quant_predicate, q_bits, q_group_size, dtype)
    target = Path(mlx_path)
    if target.exists() and not overwrite:
        raise UserError(f"{target} already exists (pass --overwrite to replace it)")
    max_bytes = parse_size(max_shard_size)
    origin = resolve_model_path(hf_path)
    source = read_source(origin)
    args, weights = check_source(source, origin)
    source.weights = {}  # the lazy outputs below keep what they need; the rest can go
    log(f"read {origin}: {args.model_type}, {args.num_hidden_layers} layers, {len(weights)} tensors")
    if awq is not None:
        from .awq import awq_weights

        if source.quantization:
            raise UserError("--awq needs float weights; this source is quantized already")
        weights = awq_weights(source.config, weights, origin, group_size=q_group_size, bits=q_bits, log=log, **awq)
    weights, quantization = prepare_weights(
        weights,
        source.quantization,
        dtype=output_dtype(dtype, source.config),
        quantize=quantize,
        q_bits=q_bits,
        q_group_size=q_group_size,
        dequantize=dequantize,
        plan=quantization_plan(weights, q_group_size, q_bits, quant_predicate, args.num_hidden_layers,
                               architecture_for(source.config).routers, architecture_for(source.config).router_bits,
                               None if quantize_vision else architecture_for(source.config).unquantized),
    )
    config = output_config(source.config, quantization, dtype_name(weights))
    for stale in remove_stale_temporaries(target.parent, target.name):
        print(f"removed {stale}, left by an interrupted run", file=sys.stderr)  # a warning, even when quiet
    names = save_model_folder(target, config, weights, source.files, max_bytes, overwrite)
    record_converted(target)  # `mlx-tfm list` shows the folders converted here
    log(f"wrote {target} ({describe(weights, quantization, config['torch_dtype'])}, {len(names)} weight file(s))")
    return target


def describe(weights: dict, quantization: dict | None, dtype: str) -> str:
    """'float16' or '4-bit, group 64, 210 matrices quantized, 1 kept in float16' (bits as
    '3/6-bit' when layers have their own)."""
    if not quantization:
        return dtype
    n_quantized = sum(name.endswith(".scales") for name in weights)
    n_float = sum(name.endswith(".weight") and weights[name].ndim in (2, 3) for name in weights) - n_quantized
    own = [s["bits"] for s in quantization.values() if isinstance(s, dict)]  # layers with their own settings
    bits = sorted(set(own) | ({quantization["bits"]} if n_quantized > len(own) else set()))
    text = f"{'/'.join(map(str, bits))}-bit, group {quantization['group_size']}, {n_quantized} matrices quantized"
    return text + (f", {n_float} kept in {dtype}" if n_float else "")


_TEMPORARY_FOLDERS: list[str] = []


def _remove_temporary_folders() -> None:
    for folder in _TEMPORARY_FOLDERS:
        shutil.rmtree(folder, ignore_errors=True)


def convert_to_temporary(source: Path) -> Path:
    """For ``mlx_tfm.load``: convert a source it cannot read as is (llama2.c, GGUF,
    PyTorch .bin) into a temporary MLX folder, removed when the process exits."""
    if not _TEMPORARY_FOLDERS:
        atexit.register(_remove_temporary_folders)
    parent = tempfile.mkdtemp(prefix="mlx_tfm_convert_")
    _TEMPORARY_FOLDERS.append(parent)
    return convert(source, Path(parent) / "model", log=lambda *_: None)


GGUF_MAGIC = b"GGUF"
SOURCE_KINDS = ("folder", "gguf", "safetensors", "llama2c", "unknown")


def source_kind(path: Path) -> str:
    """What a local ``path`` holds, one of SOURCE_KINDS: a folder (Hugging Face or MLX), or a
    file told apart by its first bytes (GGUF magic; a safetensors header; a llama2.c
    checkpoint's header, which in the legacy format has no magic but only plausible sizes)."""
    if path.is_dir():
        return "folder"
    from .llama2c import LEGACY_HEADER_BYTES, may_be_llama2c

    with open(path, "rb") as f:
        head = f.read(LEGACY_HEADER_BYTES)
    if head[8:9] == b"{":  # safetensors: an 8-byte header length, then its JSON header
        return "safetensors"
    if head[:4] == GGUF_MAGIC:
        return "gguf"
    return "llama2c" if may_be_llama2c(head) else "unknown"


# How a message names each kind of source (SOURCE_KINDS), and "hub": a local folder or a
# Hugging Face repo id.
KIND_NAMES = {"folder": "folder", "gguf": "GGUF file", "llama2c": "llama2.c checkpoint",
              "safetensors": "single safetensors file", "hub": "folder or Hugging Face repo id"}


def check_kind(source: str, kind: str) -> None:
    """UserError unless ``source`` is a ``kind`` (a key of KIND_NAMES). A file of no format
    mlx_tfm reads is left to the reader, whose message says so."""
    path = Path(source).expanduser()
    if kind == "hub" and not path.exists():
        return  # a repo id: the hub says whether it exists
    if not path.exists():
        raise UserError(f"{source} does not exist")
    found = source_kind(path)
    if found != "unknown" and found != kind and not (kind == "hub" and found == "folder"):
        raise UserError(f"{source} is a {KIND_NAMES[found]}, not a {KIND_NAMES[kind]}")


def read_source(path: Path) -> Source:
    """The model at a local ``path``, read by the reader of its kind (``source_kind``);
    anything else is refused in one line."""
    kind = source_kind(path)
    if kind == "folder":
        from .hf import read_hf_folder

        return read_hf_folder(path)
    if kind == "gguf":
        from .gguf_file import read_gguf

        return read_gguf(path)
    if kind == "llama2c":
        from .llama2c import read_llama2c

        return read_llama2c(path)
    if kind == "safetensors":
        raise UserError(f"{path} is a safetensors file: pass the folder that holds it and its config.json")
    raise UserError(f"{path} is not a model file mlx_tfm can read: not a folder, GGUF, safetensors "
                    "or llama2.c checkpoint")
