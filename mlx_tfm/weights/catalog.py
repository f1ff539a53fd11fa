"""The models on this machine: what a model folder is (family, parameters, quantization,
size, chat template, license) read from its files without loading it, and the registry
of folders `mlx-tfm convert` wrote and when `load` last used a folder.

The registry is one small JSON file (``~/.cache/mlx_tfm/models.json``; the environment
variable ``MLX_TFM_MODELS_REGISTRY`` names another), rewritten whole with
``atomic_file`` so a reader never sees half of it. Writing it is best effort: a registry
that cannot be written never makes a conversion or a load fail.
"""

from __future__ import annotations

import json
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path

from ..atomic import atomic_file
from ..errors import UserError
from ..jsonfile import read_json

REGISTRY_ENV = "MLX_TFM_MODELS_REGISTRY"
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin", "*.gguf")
# Packed quantized weights hold 32 // bits values per uint32 element.
PACKED_DTYPE = "U32"


def registry_path() -> Path:
    """Where the registry lives: ``$MLX_TFM_MODELS_REGISTRY``, else the user's cache folder."""
    if os.environ.get(REGISTRY_ENV):
        return Path(os.environ[REGISTRY_ENV]).expanduser()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "mlx_tfm" / "models.json"


def read_registry() -> dict:
    """``{"converted": {path: time}, "last_used": {path: time}}`` (empty when there is none yet)."""
    path = registry_path()
    if not path.is_file():
        return {"converted": {}, "last_used": {}}
    registry = read_json(path)
    return {"converted": dict(registry.get("converted", {})), "last_used": dict(registry.get("last_used", {}))}


def _write_registry(registry: dict) -> None:
    with atomic_file(registry_path()) as tmp:
        tmp.write_text(json.dumps(registry, indent=1, sort_keys=True), encoding="utf-8")


def _update(section: str, folder: str | Path) -> None:
    """Stamp ``folder`` in ``section`` now, dropping entries whose folders are gone (best effort)."""
    try:
        registry = read_registry()
        registry[section][str(Path(folder).resolve())] = time.time()
        for name in ("converted", "last_used"):
            registry[name] = {path: stamp for path, stamp in registry[name].items() if Path(path).exists()}
        _write_registry(registry)
    except (UserError, OSError):  # a read-only home or a corrupt registry must not stop the real work
        pass


def record_converted(folder: str | Path) -> None:
    """Remember that `mlx-tfm convert` wrote ``folder`` (so `mlx-tfm list` shows it)."""
    _update("converted", folder)


def record_used(folder: str | Path) -> None:
    """Remember that ``folder`` was loaded just now (`mlx-tfm list`'s "last used")."""
    _update("last_used", folder)


def forget(folder: str | Path) -> None:
    """Drop ``folder`` from the registry (after `mlx-tfm rm` removed it)."""
    registry = read_registry()
    key = str(Path(folder).resolve())
    registry["converted"].pop(key, None)
    registry["last_used"].pop(key, None)
    _write_registry(registry)


def converted_folders() -> list[Path]:
    """The registered folders that still look like models, newest conversion first."""
    converted = read_registry()["converted"]
    folders = [Path(path) for path, _ in sorted(converted.items(), key=lambda item: -item[1])]
    return [folder for folder in folders if looks_like_a_model(folder)]


def looks_like_a_model(folder: Path) -> bool:
    """A folder with a config.json and weights beside it."""
    return folder.is_dir() and (folder / "config.json").is_file() and bool(weight_files(folder))


def weight_files(folder: Path) -> list[Path]:
    return sorted(path for pattern in WEIGHT_PATTERNS for path in folder.glob(pattern))


@dataclass(frozen=True)
class ModelFolder:
    """What `mlx-tfm list` and `show` say about one model folder."""

    name: str
    path: Path
    config: dict
    parameters: int | None  # None: weights whose header cannot be read here (.bin, .gguf)
    size_bytes: int
    stored_dtype: str | None  # the float dtype most weights are stored in (safetensors headers)
    last_used: float | None

    @property
    def family(self) -> str:
        return str(self.config.get("model_type", "?"))

    @property
    def quantization(self) -> str:
        """"4-bit, group 64", or the float dtype the weights are stored in."""
        settings = self.config.get("quantization") or self.config.get("quantization_config")
        if isinstance(settings, dict) and "bits" in settings:
            return f"{settings['bits']}-bit, group {settings.get('group_size', '?')}"
        return str(self.config.get("torch_dtype") or self.config.get("dtype") or self.stored_dtype or "?")


def describe_folder(folder: Path, name: str | None = None, last_used: float | None = None) -> ModelFolder:
    """``folder`` read without loading it (its config, weight headers and file sizes)."""
    config = read_json(folder / "config.json", missing=f"{folder} has no config.json")
    tensors = tensor_headers(folder)
    return ModelFolder(name=name or folder.name, path=folder, config=config, size_bytes=folder_size(folder),
                       parameters=None if tensors is None else parameter_count(tensors, config),
                       stored_dtype=None if tensors is None else stored_dtype(tensors), last_used=last_used)


def folder_size(folder: Path) -> int:
    """Bytes on disk, each file counted once (the hub cache links snapshots to blobs)."""
    seen, total = set(), 0
    for path in folder.rglob("*"):
        real = path.resolve()
        if real.is_file() and real not in seen:
            seen.add(real)
            total += real.stat().st_size
    return total


def safetensors_header(path: Path) -> dict:
    """The JSON header of a safetensors file: ``name -> {"dtype", "shape", ...}``."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))  # little-endian u64 header size, then the header
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return header


SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def tensor_headers(folder: Path) -> dict | None:
    """Every tensor's header entry in the folder's safetensors files (None: none readable)."""
    files = sorted(folder.glob("*.safetensors"))
    tensors = {}
    try:
        for path in files:
            tensors.update(safetensors_header(path))
    except (OSError, ValueError, struct.error):
        return None
    return tensors or None


def stored_dtype(tensors: dict) -> str | None:
    """The float dtype most of the tensors are stored in."""
    counts = {}
    for info in tensors.values():
        if info["dtype"] in SAFETENSORS_DTYPES:
            counts[SAFETENSORS_DTYPES[info["dtype"]]] = counts.get(SAFETENSORS_DTYPES[info["dtype"]], 0) + 1
    return max(counts, key=counts.get) if counts else None


def parameter_count(tensors: dict, config: dict) -> int:
    """Parameters in the safetensors headers; packed quantized matrices counted unpacked,
    their scales and biases not at all."""
    settings = config.get("quantization") or {}
    values_per_element = 32 // int(settings.get("bits", 32)) if isinstance(settings, dict) else 1
    total = 0
    for name, info in tensors.items():
        numel = 1
        for dim in info["shape"]:
            numel *= dim
        packed_sibling = tensors.get(name.rsplit(".", 1)[0] + ".weight", {}).get("dtype") == PACKED_DTYPE
        if name.endswith((".scales", ".biases")) and packed_sibling:
            continue
        total += numel * (values_per_element if info["dtype"] == PACKED_DTYPE else 1)
    return total


def chat_template_of(folder: Path) -> str | None:
    """The folder's chat template (chat_template.jinja, chat_template.json or tokenizer_config.json), or None."""
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8")
    for name in ("chat_template.json", "tokenizer_config.json"):
        if (folder / name).is_file():
            template = read_json(folder / name).get("chat_template")
            if template:
                return template if isinstance(template, str) else json.dumps(template)
    return None


def license_of(folder: Path) -> str | None:
    """The license the README's front matter names (``license: mit``), else the LICENSE file's first line."""
    readme = folder / "README.md"
    if readme.is_file():
        lines = readme.read_text(encoding="utf-8", errors="replace").splitlines()
        if lines and lines[0].strip() == "---":
            for line in lines[1:]:
                if line.strip() == "---":
                    break
                if line.startswith("license:"):
                    return line.split(":", 1)[1].strip().strip("'\"")
    for name in ("LICENSE", "LICENSE.md", "LICENSE.txt"):
        if (folder / name).is_file():
            first = next((line.strip() for line in (folder / name).read_text(errors="replace").splitlines()
                          if line.strip()), "")
            return first or None
    return None
