"""The layering rules of DESIGN.md, checked on every module's own imports."""

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FORBIDDEN = {
    "data_prep": {"prefect", "flows", "tasks", "training"},
    "training": {"prefect", "flows", "tasks"},
    "tasks": {"flows"},
    "flows": {"torch", "pyarrow", "deepspeed"},
}


def imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_forbidden_imports(package):
    offenders = {
        str(path.relative_to(REPO)): sorted(imported_roots(path) & FORBIDDEN[package])
        for path in (REPO / package).rglob("*.py")
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_libraries_read_no_environment():
    for package in ("data_prep", "training"):
        for path in (REPO / package).rglob("*.py"):
            text = path.read_text()
            assert "os.environ" not in text and "getenv" not in text, path
