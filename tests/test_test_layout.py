"""The test suite's own layout: shared helpers live in tests/fixtures/ (or conftest.py),
and no test module imports another, so each test file can be run, moved or deleted alone."""

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
TEST_FILES = sorted(TESTS.rglob("test_*.py"))
TEST_MODULES = {path.stem for path in TEST_FILES}


def imported_names(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in the file, those inside functions too."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            found.append((node.lineno, module))
            if not module or node.level:  # `from . import test_x`
                found += [(node.lineno, alias.name) for alias in node.names]
    return found


def imports_of_test_modules(path: Path) -> list[str]:
    return [
        f"{path.relative_to(TESTS)}:{line} imports {name}"
        for line, name in imported_names(path)
        if name.split(".")[0] in TEST_MODULES or name.startswith("tests.")
    ]


def test_no_test_module_or_fixture_imports_a_test_module():
    files = TEST_FILES + sorted((TESTS / "fixtures").glob("*.py")) + [TESTS / "conftest.py"]
    offenders = [line for path in files for line in imports_of_test_modules(path)]
    assert not offenders, "move shared helpers into tests/fixtures/:\n" + "\n".join(offenders)


def test_the_check_sees_every_kind_of_import(tmp_path):
    """The walk above must catch plain, from- and lazy (in-function) imports."""
    other = sorted(TEST_MODULES - {Path(__file__).stem})[0]
    source = tmp_path / "test_probe.py"
    for text in (f"import {other}\n", f"from {other} import x\n", f"def f():\n    from {other} import x\n",
                 f"import tests.{other}\n"):
        source.write_text(text)
        offenders = [f"{line} imports {name}" for line, name in imported_names(source)
                     if name.split(".")[0] in TEST_MODULES or name.startswith("tests.")]
        assert offenders, text
    source.write_text("from fixtures.model_folders import tiny_llama_config\nimport conftest\n")
    assert not [n for _, n in imported_names(source) if n.split(".")[0] in TEST_MODULES]


PACKAGE = TESTS.parent / "mlx_tfm"
NOT_TESTS = {"fixtures", "data", "__pycache__"}


def test_test_folders_mirror_the_package():
    """tests/model/ tests mlx_tfm/model/, and so on: a folder here names a folder there."""
    folders = {p.name for p in TESTS.iterdir() if p.is_dir() and p.name not in NOT_TESTS}
    strays = sorted(f for f in folders if not (PACKAGE / f).is_dir())
    assert not strays, f"test folders with no package folder of that name: {strays}"


def test_test_file_names_are_unique():
    """pytest imports test files by their base name: two of one name would collide."""
    names = [path.name for path in TEST_FILES]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
