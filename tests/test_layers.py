"""The package's layers only import downward, and no module imports itself back through a
circle (docs/architecture.md).

Each folder of mlx_tfm (and each module directly in it) has a layer; an import of a higher
layer, at module level or inside a function, fails, and so does a module nobody placed.
Imports within one layer are allowed only while they form no circle: the whole import
graph, lazy imports included, must be acyclic."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "mlx_tfm"

# Layer by module name prefix (the longest matching prefix wins), lowest first.
LAYERS = {
    # 0 ground: no model knowledge at all
    "mlx_tfm.errors": 0, "mlx_tfm.atomic": 0, "mlx_tfm.blas": 0, "mlx_tfm.jsonfile": 0,
    # 1 device routes: how MLX's CPU backend is made fast
    "mlx_tfm.cpu": 1,
    # 2 the math: the model, its caches and what it computes with
    "mlx_tfm.model": 2,
    # 3 what a model folder holds: families (config -> ModelArgs, rename tables), weight I/O,
    # tokenizers, the hub, training and evaluation records
    "mlx_tfm.families": 3, "mlx_tfm.weights": 3, "mlx_tfm.tokenizer": 3, "mlx_tfm.hub": 3, "mlx_tfm.datasets": 3,
    # 4 importers of foreign formats
    "mlx_tfm.convert": 4,
    # 5 loading a folder, a hub id or a foreign file into (model, tokenizer)
    "mlx_tfm.loading": 5,
    # 6 one sequence at a time: sampling, the decoding loop, speculation, prompt caches
    "mlx_tfm.generation": 6,
    # 7 many sequences at once: the continuous-batching engine
    "mlx_tfm.engine": 7,
    # 8 encoders' tasks: embeddings, fill-mask, reranking
    "mlx_tfm.encode": 8,
    # 9 the conversation and its slash commands
    "mlx_tfm.chat": 9,
    # 10 training, runs over several processes, looking inside a model
    "mlx_tfm.training": 10, "mlx_tfm.distributed": 10, "mlx_tfm.inspect": 10,
    # 11 interfaces: the command line, the server, the package's entry points
    "mlx_tfm.cli": 11, "mlx_tfm.server": 11, "mlx_tfm.convert.__main__": 11, "mlx_tfm.__main__": 11, "mlx_tfm": 11,
}
MAX_TOP_LEVEL_MODULES = 12


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


def import_graph(paths: list[Path]) -> dict[str, set[str]]:
    """module -> the mlx_tfm modules it imports (a package's ``__init__`` is the package)."""
    return {module_name(p): {m for _, m in imported_modules(p, module_name(p))} - {module_name(p)} for p in paths}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle: the strongly connected components of more than one module
    (Tarjan's algorithm, iterative), each as its sorted module names."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


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


def test_no_import_circle_anywhere():
    """Lazy imports count: a circle hidden inside a function is still a circle."""
    found = cycles(import_graph(MODULES))
    assert not found, "import circles: " + "; ".join(" <-> ".join(c) for c in found)


def test_the_top_level_stays_small():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, f"{len(top)} modules directly in mlx_tfm/: {top}"


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


def test_the_circle_finder_sees_a_lazy_circle_inside_one_folder(tmp_path):
    """A circle of three modules of one folder, one edge a lazy import, is found; the same
    modules in a line are not a circle."""
    folder = tmp_path / "mlx_tfm" / "generation"
    folder.mkdir(parents=True)
    files = {"step": "from .stream import x\n", "stream": "from .speculative import y\n",
             "speculative": "def f():\n    from .step import z\n"}
    paths = []
    for stem, text in files.items():
        (folder / f"{stem}.py").write_text(text)
        paths.append(folder / f"{stem}.py")
    graph = {f"mlx_tfm.generation.{p.stem}": {m for _, m in imported_modules(p, f"mlx_tfm.generation.{p.stem}")}
             for p in paths}
    assert cycles(graph) == [["mlx_tfm.generation.speculative", "mlx_tfm.generation.step", "mlx_tfm.generation.stream"]]
    graph["mlx_tfm.generation.speculative"] = set()
    assert cycles(graph) == []
