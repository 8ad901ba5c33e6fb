"""Stage fingerprints cover every library module a stage runs, found from its imports."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from artifacts.fingerprint import FIRST_PARTY, code_version, library_versions, module_closure
from artifacts.store import STAGES

REPO = Path(__file__).resolve().parents[2]
# The modules each stage starts as separate processes (`python -m ...`): a closure that
# only followed import statements would miss them.
RANK_MODULES = {
    "train": ["training.ctr.worker", "training.sequence.pipeline_worker"],
    "evaluate": ["training.ctr.evaluate_worker", "training.sequence.evaluate_worker"],
}


def loaded_library_modules(stage: str) -> set[str]:
    """What importing the task (and its rank modules) really loads, in a fresh process."""
    imports = [f"tasks.{stage}", *RANK_MODULES.get(stage, [])]
    script = (
        "import importlib, json, sys\n"
        f"for name in {imports!r}: importlib.import_module(name)\n"
        "files = [m.__file__ for n, m in list(sys.modules.items())\n"
        f"         if n.split('.')[0] in {FIRST_PARTY!r} and getattr(m, '__file__', None)]\n"
        "print(json.dumps(files))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, check=True
    )
    files = json.loads(result.stdout.strip().splitlines()[-1])
    return {str(Path(f).resolve().relative_to(REPO)) for f in files}


@pytest.mark.parametrize("stage", STAGES)
def test_closure_holds_every_module_the_stage_loads(stage: str) -> None:
    closure = set(module_closure(f"tasks.{stage}", REPO))
    assert loaded_library_modules(stage) <= closure


def test_closures_name_the_modules_hand_kept_lists_missed() -> None:
    assert "training/runtime/consolidate.py" in module_closure("tasks.train", REPO)
    assert "training/ctr/data.py" in module_closure("tasks.evaluate", REPO)
    # Shipped as a file into the package, never imported: named by module string.
    assert "training/ctr/package_scorer.py" in module_closure("tasks.export", REPO)


@pytest.mark.parametrize("stage", STAGES)
def test_editing_any_module_of_the_closure_changes_the_code_version(
    stage: str, tmp_path: Path
) -> None:
    for package in FIRST_PARTY:
        shutil.copytree(
            REPO / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__")
        )
    modules = module_closure(f"tasks.{stage}", tmp_path)
    assert modules == module_closure(f"tasks.{stage}", REPO)
    before = code_version(modules, tmp_path)
    originals = {module: (tmp_path / module).read_bytes() for module in modules}
    for module, original in originals.items():
        (tmp_path / module).write_bytes(original + b"\n# edited\n")
        assert code_version(modules, tmp_path) != before, module
        (tmp_path / module).write_bytes(original)
    # The closure is computed from the files as they are now: edited, it keeps them all.
    for module, original in originals.items():
        (tmp_path / module).write_bytes(original + b"\n# edited\n")
    edited = module_closure(f"tasks.{stage}", tmp_path)
    assert edited == modules and code_version(edited, tmp_path) != before
    for module, original in originals.items():
        (tmp_path / module).write_bytes(original)
    assert code_version(modules, tmp_path) == before


def test_library_versions_are_part_of_the_code_version(monkeypatch: pytest.MonkeyPatch) -> None:
    modules = module_closure("tasks.shard", REPO)
    before = code_version(modules, REPO)
    versions = library_versions()
    assert set(versions) == {"torch", "deepspeed", "pyarrow"} and all(versions.values())
    monkeypatch.setattr(
        "artifacts.fingerprint.library_versions",
        lambda: {**versions, "torch": versions["torch"] + "+x"},
    )
    assert code_version(modules, REPO) != before


def test_a_missing_entry_module_is_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="tasks.nope"):
        module_closure("tasks.nope", tmp_path)


def test_content_digests_are_remembered_per_version_of_a_file(tmp_path: Path) -> None:
    import hashlib
    import os

    from artifacts.fingerprint import _version, content_sha256

    memo = tmp_path / "memo"
    a, b = tmp_path / "a.csv", tmp_path / "elsewhere" / "a.csv"
    b.parent.mkdir()
    a.write_bytes(b"ts,user_id\n1,2\n")
    b.write_bytes(a.read_bytes())
    expected = hashlib.sha256(a.read_bytes()).hexdigest()
    assert content_sha256(a, memo) == content_sha256(b, memo) == expected
    # A remembered digest is used without reading the file: plant one for this version.
    planted = next(p for p in memo.iterdir() if json.loads(p.read_text())["version"] == _version(a))
    planted.write_text(json.dumps({"version": _version(a), "sha256": "f" * 64}))
    assert content_sha256(a, memo) == "f" * 64
    # New bytes of the same size under the old mtime: ctime moved, so it is hashed again.
    stat = a.stat()
    a.write_bytes(b"ts,user_id\n1,3\n")
    os.utime(a, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert content_sha256(a, memo) == hashlib.sha256(a.read_bytes()).hexdigest() != expected
