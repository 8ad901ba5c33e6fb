import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime
import pytest
import torch

from artifacts.errors import InputNotFoundError
from training.config import ExportConfig
from training.ctr.export import export_model
from training.ctr.model import load_model
from training.errors import ParityError

# Scores the package with onnxruntime and numpy only, in a fresh interpreter, and fails
# if anything from this repository got imported on the way.
STANDALONE_CHECK = """
import json, sys
import numpy as np
import onnxruntime

package = sys.argv[1]
session = onnxruntime.InferenceSession(package + "/model.onnx", providers=["CPUExecutionProvider"])
inputs = dict(np.load(package + "/parity/inputs.npz"))
assert sorted(inputs) == sorted(i.name for i in session.get_inputs()), inputs.keys()
scores = session.run(["score"], inputs)[0]
expected = np.load(package + "/parity/scores.npy")
leaked = [m for m in sys.modules if m.split(".")[0] in ("training", "data_prep", "torch")]
assert not leaked, leaked
print(json.dumps({"shape": list(scores.shape), "dtype": str(scores.dtype),
                  "max_abs_diff": float(np.max(np.abs(scores - expected)))}))
"""


@pytest.fixture
def transform_path(tmp_path: Path) -> Path:
    path = tmp_path / "transform.json"
    path.write_text(json.dumps({"user_id": {"vocabulary": ["a", "b"]}}))
    return path


@pytest.mark.parametrize("interaction", ["dot", "cross"])
def test_package_scores_like_the_trained_model(
    interaction: str,
    shards_dir: Path,
    make_train_dir: Callable[..., Path],
    transform_path: Path,
    tmp_path: Path,
) -> None:
    train_dir = make_train_dir(shards_dir, interaction=interaction)
    metrics_path = tmp_path / "metrics.json"
    metrics_path.write_text(json.dumps({"auc": 0.61, "logloss": 0.66}))
    out_dir = tmp_path / "package"
    result = export_model(
        ExportConfig(parity_rows=300), train_dir, transform_path, shards_dir, metrics_path, out_dir
    )

    assert result.files == [
        "model.onnx",
        "model.safetensors",
        "model.ts",
        "model_card.md",
        "model_config.json",
        "parity/inputs.npz",
        "parity/scores.npy",
        "score.py",
        "signature.json",
        "transform.json",
    ]
    assert result.infra_validation is None  # no raw events given
    assert result.parity_max_abs_diff_onnx <= 1e-5
    assert result.parity_max_abs_diff_torchscript <= 1e-5

    check = subprocess.run(
        [sys.executable, "-c", STANDALONE_CHECK, str(out_dir)],
        capture_output=True,
        text=True,
        check=True,
    )
    standalone = json.loads(check.stdout.strip().splitlines()[-1])
    assert standalone["shape"] == [300] and standalone["dtype"] == "float32"
    assert standalone["max_abs_diff"] <= 1e-5

    # The parity scores are the trained model's probabilities on the first test rows.
    inputs = np.load(out_dir / "parity" / "inputs.npz")
    assert inputs["sparse"].dtype == np.int64 and inputs["sparse"].shape == (300, 3)
    assert inputs["dense"].dtype == np.float32 and inputs["dense"].shape == (300, 2)
    model, _ = load_model(train_dir)
    with torch.no_grad():
        expected = torch.sigmoid(
            model(torch.from_numpy(inputs["sparse"]), torch.from_numpy(inputs["dense"]))
        )[:, 0]
    np.testing.assert_allclose(np.load(out_dir / "parity" / "scores.npy"), expected.numpy())

    # TorchScript loads without this repository's code and handles another batch size.
    scripted = torch.jit.load(str(out_dir / "model.ts"))
    with torch.no_grad():
        few = scripted(
            torch.from_numpy(inputs["sparse"][:7]), torch.from_numpy(inputs["dense"][:7])
        )
    np.testing.assert_allclose(few.numpy(), expected[:7].numpy(), atol=1e-6)

    signature = json.loads((out_dir / "signature.json").read_text())
    assert [i["name"] for i in signature["inputs"]] == ["sparse", "dense"]
    assert signature["inputs"][0]["features"] == ["user_id", "city", "category"]
    assert signature["inputs"][1]["features"] == ["price", "position"]
    assert signature["outputs"][0]["name"] == "score"
    assert signature["parity"] == {
        "inputs": "parity/inputs.npz",
        "input_keys": ["sparse", "dense"],
        "scores": "parity/scores.npy",
        "scores_dtype": "float32",
        "rows": 300,
        "atol": 1e-5,
        "check": "onnxruntime(model.onnx) on inputs.npz vs scores.npy, max abs diff <= atol",
    }
    assert (out_dir / "transform.json").read_bytes() == transform_path.read_bytes()
    card = (out_dir / "model_card.md").read_text()
    assert "0.61" in card and "user_id" in card and "TorchScript" in card
    assert "parity/inputs.npz" in card and "Infra validation: not run" in card


def test_parity_failure_raises(
    shards_dir: Path,
    random_train_dir: Path,
    transform_path: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real_session = onnxruntime.InferenceSession

    class DriftingSession:
        """An ONNX runtime whose scores are off by 1e-3."""

        def __init__(self, *args: object, **kwargs: object) -> None:
            self.session = real_session(*args, **kwargs)

        def run(self, *args: object) -> list[np.ndarray]:
            return [output + np.float32(1e-3) for output in self.session.run(*args)]

    monkeypatch.setattr(onnxruntime, "InferenceSession", DriftingSession)
    with pytest.raises(ParityError, match="ONNX 0.001"):
        export_model(
            ExportConfig(parity_rows=50),
            random_train_dir,
            transform_path,
            shards_dir,
            None,
            tmp_path,
        )


def test_missing_transform_is_reported(
    shards_dir: Path, random_train_dir: Path, tmp_path: Path
) -> None:
    missing = tmp_path / "nope.json"
    with pytest.raises(InputNotFoundError, match="nope.json"):
        export_model(ExportConfig(), random_train_dir, missing, shards_dir, None, tmp_path / "p")


def test_multi_hot_multi_task_package_keeps_parity(
    make_shards: Callable[..., Path],
    make_train_dir: Callable[..., Path],
    transform_path: Path,
    tmp_path: Path,
) -> None:
    shards = make_shards("mh", multi_hot={"tags": 12}, extra_labels=["purchase"])
    train_dir = make_train_dir(shards, interaction="cross", tasks=["click", "purchase"])
    out_dir = tmp_path / "package-mh"
    result = export_model(
        ExportConfig(parity_rows=200), train_dir, transform_path, shards, None, out_dir
    )
    assert result.parity_max_abs_diff_onnx <= 1e-5
    inputs = dict(np.load(out_dir / "parity" / "inputs.npz"))
    assert sorted(inputs) == ["dense", "multi_hot_tags", "sparse"]
    signature = json.loads((out_dir / "signature.json").read_text())
    assert signature["parity"]["input_keys"] == ["sparse", "dense", "multi_hot_tags"]
    assert inputs["multi_hot_tags"].min() == -1  # padded lists
    scores = np.load(out_dir / "parity" / "scores.npy")
    assert scores.shape == (200, 2)
    session = onnxruntime.InferenceSession(str(out_dir / "model.onnx"))
    # Another batch size and another list length than the trace example.
    few = {name: value[:7] for name, value in inputs.items()}
    few["multi_hot_tags"] = np.concatenate(
        [few["multi_hot_tags"], np.full((7, 3), -1, dtype=np.int64)], axis=1
    )
    np.testing.assert_allclose(session.run(["score"], few)[0], scores[:7], atol=1e-6)
    assert signature["tasks"] == ["click", "purchase"]
    assert signature["outputs"][0]["shape"] == ["batch", 2]
