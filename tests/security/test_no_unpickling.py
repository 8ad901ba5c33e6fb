"""Attack: a writer to the bucket replaces a resume checkpoint's `rank-N.pt` with a pickle
whose loading runs code. Nothing recforge reads from storage may be unpickled (issue 27,
finding 1; docs/security.md), so the payload must not run and the resume must stop with
a message that names the file.

The static test holds every project module to that rule: no `pickle.load`, no
`cloudpickle`, no `weights_only=False`, no `torch.load` without `weights_only=True`, no
`np.load(..., allow_pickle=True)`. DeepSpeed's own checkpoint loader (which hard-codes
`weights_only=False`) is not a project module: it only runs on checkpoints whose signed
manifest verified (`artifacts.checkpoints`).
"""

import ast
import json
import pickle
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from artifacts.checkpoints import CheckpointCorrupt
from training.ctr import worker
from training.runtime.rank import ResumePoint, rank_state_file, rng_state

pytestmark = pytest.mark.security

REPO = Path(__file__).resolve().parents[2]
PROJECT_PACKAGES = ("artifacts", "data_prep", "training", "tasks", "flows", "bench")


class Payload:
    """A pickle whose loading creates `marker` (what a remote code execution would do)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: ANN204
        return (Path.touch, (self.marker,))


class FakeEngine:
    """Stands in for the DeepSpeed engine: its dense load is not what this test attacks."""

    def load_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        pass


class FakeReader:
    def __init__(self) -> None:
        self.restored: dict[str, int] | None = None

    def restore(self, position: dict[str, int]) -> None:
        self.restored = position


@pytest.fixture
def one_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker as rank 0 of 1, without a process group."""
    monkeypatch.setattr(worker.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(worker.dist, "get_world_size", lambda: 1)


def resume_point(path: Path) -> ResumePoint:
    meta = {"step": 4, "micro_done": 4, "world_size": 1}
    return ResumePoint(path=path, meta=meta, dense_dir=path, universal=False)


def test_a_tampered_rank_state_file_runs_no_payload_and_is_refused(
    one_rank: None, tmp_path: Path
) -> None:
    checkpoint = tmp_path / "step-00000004"
    checkpoint.mkdir()
    marker = tmp_path / "pwned"
    state = {"rng": Payload(marker), "reader": {"epoch": 0, "step": 1}}
    # torch.save's zip container, as the honest file is: only the pickle inside is forged.
    torch.save(state, checkpoint / rank_state_file(0), pickle_module=pickle)
    reader = FakeReader()
    with pytest.raises(CheckpointCorrupt, match=rank_state_file(0)):
        worker.load_resume_point(resume_point(checkpoint), FakeEngine(), None, reader, 0)
    assert not marker.exists(), "the forged pickle ran its payload"
    assert reader.restored is None


def draws() -> tuple[float, float, float, torch.Tensor]:
    """The next numbers of python's, numpy's and torch's global generators."""
    return random.gauss(0.0, 1.0), np.random.normal(), np.random.random_sample(), torch.rand(3)


def test_an_honest_rank_state_file_restores_the_rng_states_and_the_reader_position(
    one_rank: None, tmp_path: Path
) -> None:
    checkpoint = tmp_path / "step-00000004"
    checkpoint.mkdir()
    random.seed(1)
    random.gauss(0.0, 1.0)  # both cache their second gaussian: part of the state
    np.random.seed(2)
    np.random.normal()
    torch.manual_seed(3)
    torch.save(
        {"rng": rng_state(), "reader": {"epoch": 1, "step": 2}},
        checkpoint / rank_state_file(0),
    )
    expected = draws()
    random.seed(9)
    np.random.seed(9)
    torch.manual_seed(9)
    reader = FakeReader()
    counters = worker.load_resume_point(resume_point(checkpoint), FakeEngine(), None, reader, 0)
    assert counters == {"step": 4, "micro_done": 4}
    assert reader.restored == {"epoch": 1, "step": 2}
    drawn = draws()
    assert drawn[:3] == expected[:3]
    assert torch.equal(drawn[3], expected[3])


def test_the_rank_state_is_tensors_and_json_values() -> None:
    """What `weights_only=True` loads without an allow-list, and JSON can say."""
    np.random.normal()  # a cached gaussian is part of numpy's state too
    state = rng_state()
    assert state["torch"].dtype == torch.uint8
    json.dumps({name: value for name, value in state.items() if name != "torch"}, default=_list)


def _list(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not a tensor or a JSON value")


# --- static: no project module unpickles ----------------------------------------------

# Modules whose loads unpickle whatever the file holds.
_PICKLE_MODULES = {"pickle", "_pickle", "cPickle", "cloudpickle", "dill", "joblib"}
_PICKLE_LOADERS = {"load", "loads", "Unpickler"}


def _dotted(node: ast.AST) -> str:
    """`a.b.c` of a Name/Attribute chain, "" for anything else."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return ""
    return ".".join([node.id, *reversed(parts)])


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_constant(node: ast.expr | None, value: bool) -> bool:
    return isinstance(node, ast.Constant) and node.value is value


def unpickling_sites(source: str, filename: str) -> list[str]:
    """Every place in `source` that may unpickle data, as "file:line: what"."""
    tree = ast.parse(source, filename)
    found = []

    def report(node: ast.AST, what: str) -> None:
        found.append(f"{filename}:{node.lineno}: {what}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "cloudpickle":
                    report(node, "import cloudpickle")
        elif isinstance(node, ast.ImportFrom):
            module = (node.module or "").split(".")[0]
            if module == "cloudpickle":
                report(node, "from cloudpickle import ...")
            elif module in _PICKLE_MODULES and {a.name for a in node.names} & _PICKLE_LOADERS:
                report(node, f"from {node.module} import a loader")
        elif isinstance(node, ast.Attribute) and _dotted(node.value) == "cloudpickle":
            report(node, f"cloudpickle.{node.attr}")
        elif isinstance(node, ast.Call):
            name = _dotted(node.func)
            module, _, function = name.rpartition(".")
            if _is_constant(_keyword(node, "weights_only"), False):
                report(node, f"{name or 'a call'}(weights_only=False)")
            if module in _PICKLE_MODULES and function in _PICKLE_LOADERS:
                report(node, f"{name}(...)")
            elif name in ("torch.load", "torch.serialization.load"):
                if not _is_constant(_keyword(node, "weights_only"), True):
                    report(node, f"{name} without weights_only=True")
            elif name in ("np.load", "numpy.load"):
                allow = _keyword(node, "allow_pickle")
                if allow is not None and not _is_constant(allow, False):
                    report(node, f"{name}(allow_pickle=...) other than False")
            elif function == "read_pickle":
                report(node, f"{name}(...)")
    return found


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import pickle\npickle.load(f)", "pickle.load(...)"),
        ("import pickle\npickle.loads(b)", "pickle.loads(...)"),
        ("from pickle import loads", "from pickle import a loader"),
        ("import cloudpickle", "import cloudpickle"),
        ("torch.load(p)", "torch.load without weights_only=True"),
        ("torch.load(p, weights_only=flag)", "torch.load without weights_only=True"),
        ("torch.load(p, weights_only=False)", "torch.load(weights_only=False)"),
        ("np.load(p, allow_pickle=True)", "np.load(allow_pickle=...) other than False"),
        ("pd.read_pickle(p)", "pd.read_pickle(...)"),
    ],
)
def test_the_static_check_catches(source: str, expected: str) -> None:
    assert any(expected in site for site in unpickling_sites(source, "m.py"))


@pytest.mark.parametrize(
    "source",
    [
        "torch.load(p, weights_only=True, mmap=True)",
        "np.load(p)",
        "np.load(p, allow_pickle=False)",
        "import pickle\npickle.dumps(x)",
        "json.loads(s)",
    ],
)
def test_the_static_check_passes(source: str) -> None:
    assert unpickling_sites(source, "m.py") == []


def test_no_project_module_unpickles() -> None:
    modules = [
        path
        for package in PROJECT_PACKAGES
        for path in sorted((REPO / package).rglob("*.py"))
        if ".venv" not in path.parts
    ]
    assert len(modules) > 50  # the walk found the packages
    sites = [
        site
        for path in modules
        for site in unpickling_sites(path.read_text(), str(path.relative_to(REPO)))
    ]
    assert sites == [], "\n".join(sites)
