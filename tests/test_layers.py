"""The layering rules of docs/architecture.md, checked on every module's own imports."""

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FORBIDDEN = {
    "artifacts": {"prefect", "flows", "tasks", "training", "data_prep", "torch", "deepspeed"},
    "data_prep": {"prefect", "flows", "tasks", "training"},
    "training": {"prefect", "flows", "tasks"},
    "tasks": {"flows", "torch", "deepspeed", "pyarrow"},
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


# What naming a model family looks like: its package, its registry, a model's name.
FAMILY_NAMES = re.compile(
    r"training\.(?:ctr|sequence)|SEQUENCE_MODEL|\b(?:ctr|CTR|sasrec|SASRec|bst|BST|dlrm|DLRM|dcn)\b"
    r"|[Ss]equence models?"
)


def test_tasks_never_name_a_model_family():
    """tasks/ orchestrates; `training.stages` is where a family is chosen."""
    offenders = {
        f"{path.relative_to(REPO)}:{number}": line.strip()
        for path in (REPO / "tasks").rglob("*.py")
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        if FAMILY_NAMES.search(line)
    }
    assert offenders == {}


def test_the_family_check_sees_a_family_branch(tmp_path):
    assert FAMILY_NAMES.search("if model in SEQUENCE_MODEL_REGISTRY:")
    assert FAMILY_NAMES.search("from training.ctr.evaluate import evaluate_model")
    assert FAMILY_NAMES.search("# CTR runs split a step")
    assert not FAMILY_NAMES.search('"sequences": result.sequences,')


def test_only_the_stages_module_imports_both_families():
    both = []
    for path in (REPO / "training").rglob("*.py"):
        parts = {training_part(m) for m, _ in training_imports(path)}
        if {"ctr", "sequence"} <= parts:
            both.append(str(path.relative_to(REPO)))
    assert both == ["training/stages.py"]


# The only environment reads in the libraries, each for a reason no argument can serve:
# path -> how many times the file may say os.environ.
ENVIRONMENT_READERS = {
    # The rank entry point: DeepSpeed's launcher hands each rank RANK, MASTER_ADDR and
    # MASTER_PORT there, and the rendezvous binds to them before torch reads them.
    "training/runtime/rank.py": 1,
    # A launcher that inherits this process's environment redacts its secret values
    # from launcher.log and the tail (docs/security.md).
    "training/runtime/launcher.py": 1,
}


def test_libraries_read_no_environment():
    for package in ("data_prep", "training"):
        for path in (REPO / package).rglob("*.py"):
            text = path.read_text()
            allowed = ENVIRONMENT_READERS.get(str(path.relative_to(REPO)), 0)
            assert text.count("os.environ") <= allowed and "getenv" not in text, path


# Inside training/: two model families share one runtime and never borrow from each other.
# Folder -> the training folders (and top-level modules) it may import from.
TRAINING_ALLOWED = {
    "runtime": {"runtime", "config", "errors"},
    "ctr": {"runtime", "ctr", "config", "packaging", "blessing", "errors"},
    "sequence": {"runtime", "sequence", "config", "packaging", "blessing", "errors"},
}


def training_imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, imported names) of every `training.*` import in a file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] == "training":
                found.append((node.module, [alias.name for alias in node.names]))
        elif isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names if a.name.split(".")[0] == "training"]
    return found


def training_part(module: str) -> str:
    """The folder (or top-level module) of training a module name belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


@pytest.mark.parametrize("folder", sorted(TRAINING_ALLOWED))
def test_training_folders_import_only_what_they_may(folder):
    offenders = []
    for path in (REPO / "training" / folder).rglob("*.py"):
        for module, names in training_imports(path):
            part = training_part(module)
            if part not in TRAINING_ALLOWED[folder]:
                offenders.append(f"{path.relative_to(REPO)}: {module}")
            elif part != folder:
                # Across folders only public names: a private helper is not an interface.
                offenders += [
                    f"{path.relative_to(REPO)}: {module}.{name}"
                    for name in names
                    if name.startswith("_")
                ]
    assert offenders == []


def test_packaging_imports_only_the_runtime():
    parts = {training_part(m) for m, _ in training_imports(REPO / "training" / "packaging.py")}
    assert parts <= {"runtime", "config", "errors"}


def test_the_layer_check_sees_a_cross_family_import(tmp_path):
    offending = tmp_path / "bad.py"
    offending.write_text("from training.ctr.train import _write\nimport training.sequence.bst\n")
    found = training_imports(offending)
    assert [training_part(m) for m, _ in found] == ["ctr", "sequence"]
    assert found[0][1] == ["_write"]


def test_the_flow_names_every_stages_task_and_library_entry():
    """flows/pipeline.py's stage table: one hop from the flow to any stage's code."""
    import importlib
    import re

    doc = ast.get_docstring(ast.parse((REPO / "flows" / "pipeline.py").read_text()))
    rows = [line for line in doc.splitlines() if line.startswith("| ") and "`" in line]
    stages = {row.split("|")[1].strip() for row in rows}
    assert {"ingest", "preprocess", "shard", "train", "evaluate", "export"} <= stages
    names = [n for row in rows for n in re.findall(r"`([a-z_]+(?:\.[A-Za-z_]+)+)`", row)]
    for name in names:
        module, _, attribute = name.rpartition(".")
        assert callable(getattr(importlib.import_module(module), attribute)), name
    # Every library entry a task calls is named, so none can be renamed without the table.
    for task in ("ingest", "preprocess", "shard", "train", "evaluate", "export"):
        tree = ast.parse((REPO / "tasks" / f"{task}.py").read_text())
        called = {
            n.func.id
            for n in ast.walk(tree)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
        }
        imported = {
            f"{node.module}.{alias.name}"
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom)
            and node.module
            and node.module.split(".")[0] in ("data_prep", "training")
            for alias in node.names
            if alias.name in called
            and alias.name.split("_")[0]
            in ("ingest", "preprocess", "write", "train", "evaluate", "export")
        }
        assert imported <= set(names), (task, imported - set(names))


def test_the_readme_layout_names_every_training_module():
    """docs/architecture.md's "How it is built" lists each training folder's modules as they are.

    training/ is the block's last folder: everything after its line counts as its entries.
    """
    import re

    readme = (REPO / "docs" / "architecture.md").read_text()
    block = readme.split("## How it is built", 1)[1].split("```")[1]
    entries = re.split(r"\n  (?=[a-z]+[/.])", block.split("\ntraining/", 1)[1])[1:]
    listed = {entry.split()[0]: set(re.findall(r"\b([a-z_]+\.py)\b", entry)) for entry in entries}
    for folder in ("runtime", "ctr", "sequence"):
        files = {p.name for p in (REPO / "training" / folder).glob("*.py")} - {"__init__.py"}
        assert listed[f"{folder}/"] == files, folder
    top = {p.name for p in (REPO / "training").glob("*.py")} - {"__init__.py"}
    assert top <= set(listed)
