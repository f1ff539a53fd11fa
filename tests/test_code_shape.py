"""The package reads at a glance (STYLE.md, docs/architecture.md): no function in mlx_tfm
longer than MAX_FUNCTION_LINES and no class longer than MAX_CLASS_LINES. A function that
long is a design that has not been found yet; split it where its steps are."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "mlx_tfm"
MAX_FUNCTION_LINES = 60
MAX_CLASS_LINES = 250


def oversized(source: str) -> list[str]:
    """'name (N lines)' of every function over MAX_FUNCTION_LINES and class over MAX_CLASS_LINES."""
    found = []
    for node in ast.walk(ast.parse(source)):
        limit = (MAX_CLASS_LINES if isinstance(node, ast.ClassDef)
                 else MAX_FUNCTION_LINES if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None)
        if limit is not None and node.end_lineno - node.lineno + 1 > limit:
            found.append(f"{node.name} ({node.end_lineno - node.lineno + 1} lines, line {node.lineno})")
    return found


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_function_or_class_is_too_long_to_read(path):
    assert not oversized(path.read_text()), f"{path.relative_to(PACKAGE)}: {oversized(path.read_text())}"


def test_the_check_sees_a_long_function_and_a_long_class():
    long_function = "def f():\n" + "    x = 1\n" * MAX_FUNCTION_LINES
    long_class = "class C:\n" + "".join(f"    def m{i}(self):\n        return {i}\n" for i in range(MAX_CLASS_LINES // 2))
    assert oversized(long_function) == [f"f ({MAX_FUNCTION_LINES + 1} lines, line 1)"]
    assert oversized(long_class) == [f"C ({MAX_CLASS_LINES + 1} lines, line 1)"]
    assert oversized("def g():\n    return 1\n") == []
