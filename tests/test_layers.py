"""The package's layers only import downward (README: "How the code is layered").

Every module of mlx_tfm has a layer; an import of a module in a higher layer, at module
level or inside a function, fails this test, and so does a module nobody placed."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "mlx_tfm"

# Layer by module name prefix (the longest matching prefix wins), lowest first.
LAYERS = {
    # 0 foundations: no model knowledge at all
    "mlx_tfm.errors": 0, "mlx_tfm.atomic": 0, "mlx_tfm.blas": 0,
    # 1 device routes: how MLX's CPU backend is made fast
    "mlx_tfm.cpu": 1,
    # 2 the math: the model and what it computes with
    "mlx_tfm.model": 2, "mlx_tfm.attention": 2, "mlx_tfm.cache": 2, "mlx_tfm.positions": 2, "mlx_tfm.sample": 2,
    "mlx_tfm.experts": 2, "mlx_tfm.encoders": 2, "mlx_tfm.heads": 2, "mlx_tfm.relative_positions": 2,
    # 3 model families and weight I/O
    "mlx_tfm.families": 3, "mlx_tfm.weights": 3, "mlx_tfm.tokenizer": 3, "mlx_tfm.hub": 3,
    "mlx_tfm.sentence_modules": 3,
    # 4 importers of foreign formats
    "mlx_tfm.convert": 4,
    # 5 running models: loading, generation, chat, training
    "mlx_tfm.loading": 5, "mlx_tfm.prompt_cache": 5, "mlx_tfm.generate": 5, "mlx_tfm.chat": 5,
    "mlx_tfm.chat_commands": 5, "mlx_tfm.training": 5, "mlx_tfm.batching": 5, "mlx_tfm.batch_cache": 5,
    "mlx_tfm.batch_sampling": 5, "mlx_tfm.prompt_cache_pool": 5, "mlx_tfm.inspect": 5,
    "mlx_tfm.perplexity": 5, "mlx_tfm.speculative": 5, "mlx_tfm.distributed": 5, "mlx_tfm.embeddings": 5,
    "mlx_tfm.encoder_tasks": 5, "mlx_tfm.text_to_text": 5,
    # 6 interfaces: the command line, the server, the package's entry points
    "mlx_tfm.cli": 6, "mlx_tfm.server": 6, "mlx_tfm.convert.__main__": 6, "mlx_tfm.__main__": 6, "mlx_tfm": 6,
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(name: str) -> int | None:
    matches = [prefix for prefix in LAYERS if name == prefix or name.startswith(prefix + ".")]
    return LAYERS[max(matches, key=len)] if matches else None


def is_module(name: str) -> bool:
    path = PACKAGE.parent / name.replace(".", "/")
    return path.is_dir() or path.with_suffix(".py").is_file()


def imported_modules(path: Path, name: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of every mlx_tfm import in the file, lazy ones too."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from . import x` may name a submodule: check the submodule when it is one
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                found.append((node.lineno, candidate if is_module(candidate) else base))
    return [(line, module) for line, module in found if module == "mlx_tfm" or module.startswith("mlx_tfm.")]


MODULES = sorted(p for p in PACKAGE.rglob("*.py"))


def test_every_module_has_a_layer():
    unplaced = [module_name(p) for p in MODULES if layer_of(module_name(p)) is None]
    assert not unplaced, f"place these modules in LAYERS: {unplaced}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_point_down(path):
    name = module_name(path)
    own = layer_of(name)
    upward = [f"line {line}: {module} (layer {layer_of(module)})" for line, module in imported_modules(path, name)
              if layer_of(module) is not None and layer_of(module) > own]
    assert not upward, f"{name} (layer {own}) imports upward: {upward}"


def test_the_walker_sees_an_upward_import(tmp_path):
    """The check itself can fail: a lazy import of the loader inside the math is caught,
    and so is a relative one from a subpackage."""
    model = tmp_path / "model.py"
    model.write_text("import mlx.core as mx\n\ndef f():\n    from .loading import load\n    from . import chat\n")
    imports = imported_modules(model, "mlx_tfm.model")
    assert imports == [(4, "mlx_tfm.loading"), (5, "mlx_tfm.chat")]
    assert all(layer_of(module) > layer_of("mlx_tfm.model") for _, module in imports)
    linear = tmp_path / "linear.py"
    linear.write_text("from ..weights import read_config\n")
    assert imported_modules(linear, "mlx_tfm.cpu.linear") == [(1, "mlx_tfm.weights")]
