import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import pytest
import torch
from safetensors.torch import load_file

from artifacts.errors import ConfigError, InputNotFoundError
from training.config import EvaluateConfig, ExportConfig, TrainConfig
from training.ctr.embedding import decode_rows
from training.ctr.evaluate import evaluate_model
from training.ctr.export import export_model
from training.ctr.model import load_model
from training.ctr.train import train_model
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


# bf16 too: onnxruntime's CPU provider gathers and casts BFLOAT16 (checked with 1.32).
@pytest.mark.parametrize("precision", ["fp16", "bf16", "int8"])
def test_a_compact_table_package_keeps_its_rows_and_parity(
    precision: str,
    make_shards: Callable[..., Path],
    make_train_dir: Callable[..., Path],
    transform_path: Path,
    tmp_path: Path,
) -> None:
    """train.table_precision: the package holds the rows as training stored them, and its
    ONNX and TorchScript graphs decode them after the gather, within parity."""
    shards = make_shards("mh", multi_hot={"tags": 12})
    train_dir = make_train_dir(shards, name=precision, pooling="mean", table_precision=precision)
    out_dir = tmp_path / f"package-{precision}"
    result = export_model(
        ExportConfig(parity_rows=200), train_dir, transform_path, shards, None, out_dir
    )
    assert result.parity_max_abs_diff_onnx <= 1e-5
    assert result.parity_max_abs_diff_torchscript <= 1e-5

    trained = load_file(str(train_dir / "model.safetensors"))
    packaged = load_file(str(out_dir / "model.safetensors"))
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "int8": torch.uint8}[precision]
    assert packaged["embedding.weight"].dtype == dtype
    assert set(packaged) == set(trained)
    assert all(torch.equal(packaged[name], trained[name]) for name in trained)
    assert ("embedding.scale_bias" in packaged) == (precision == "int8")
    # The table's bytes: half of fp32's at 2 bytes; D + 8 a row at int8 (D = 8 here).
    rows, dim = packaged["embedding.weight"].shape
    table_bytes = sum(
        t.numel() * t.element_size() for n, t in packaged.items() if n.startswith("embedding.")
    )
    assert table_bytes == rows * (dim + 8 if precision == "int8" else dim * 2)
    assert table_bytes <= 0.5 * rows * dim * 4
    model_config = json.loads((out_dir / "model_config.json").read_text())
    assert model_config["table_precision"] == precision

    # The ONNX graph's table initializer is the compact one; no fp32 copy of the table.
    graph = onnx.load(str(out_dir / "model.onnx")).graph
    tables = {i.name: i for i in graph.initializer if list(i.dims[:1]) == [rows]}
    onnx_type = {"fp16": "FLOAT16", "bf16": "BFLOAT16", "int8": "UINT8"}[precision]
    assert tables["model.embedding.weight"].data_type == onnx.TensorProto.DataType.Value(onnx_type)
    others = [t for name, t in tables.items() if name != "model.embedding.weight"]
    assert all(list(t.dims) == [rows, 2] for t in others)  # only int8's scale and bias
    assert {"Gather", "Cast"} <= {node.op_type for node in graph.node}
    scripted = torch.jit.load(str(out_dir / "model.ts"))
    assert scripted.state_dict()["model.embedding.weight"].dtype == dtype
    card = (out_dir / "model_card.md").read_text()
    assert f"at {precision}" in card


@pytest.mark.slow
def test_a_trained_int8_table_is_packaged_as_its_codes(
    make_shards: Callable[..., Path], transform_path: Path, tmp_path: Path
) -> None:
    """One real (tiny) int8 training run: the consolidated model.safetensors holds the
    shards' codes and grids as they are, never-admitted rows hold their feature's default
    row quantized on its own grid, and the package scores within parity."""
    shards = make_shards()
    config = TrainConfig(
        embedding_dim=8, bottom_mlp=[16, 8], top_mlp=[16], batch_size=32, max_steps=6,
        world_size=1, zero_stage=0, table_precision="int8", admission_min_count=3,
        tensorboard=False,
    )  # fmt: skip
    train_dir = tmp_path / "train"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    train_model(config, shards, train_dir, "cpu", port, env)
    weights = load_file(str(train_dir / "model.safetensors"))
    shard = load_file(
        str(train_dir / "checkpoints" / "final" / "sparse-rank-00000-of-00001.safetensors")
    )
    assert json.loads((train_dir / "model_config.json").read_text())["table_precision"] == "int8"
    codes, grids = weights["embedding.weight"], weights["embedding.scale_bias"]
    assert codes.dtype == torch.uint8 and grids.dtype == torch.float32
    admitted = shard["counts"] >= 3
    assert 0 < int(admitted.sum()) < len(admitted)
    assert torch.equal(codes[admitted], shard["weight"][admitted])
    assert torch.equal(grids[admitted], shard["scale_bias"][admitted])
    # user_id (rows 0..100) rows never admitted: its default row, to half a grid step.
    defaults = weights["arch.default_rows"]
    rejected = torch.nonzero(~admitted[:101])[:, 0]
    decoded = decode_rows(codes[rejected], grids[rejected])
    step = grids[rejected, :1]
    assert ((decoded - defaults[0]).abs() <= step / 2 + 1e-6).all()

    evaluated = evaluate_model(EvaluateConfig(), train_dir, shards, tmp_path / "evaluate")
    assert evaluated.table_precision == "int8"
    result = export_model(
        ExportConfig(parity_rows=200), train_dir, transform_path, shards,
        evaluated.metrics_path, tmp_path / "package",
    )  # fmt: skip
    assert result.parity_max_abs_diff_onnx <= 1e-5
    assert result.parity_max_abs_diff_torchscript <= 1e-5
    packaged = load_file(str(tmp_path / "package" / "model.safetensors"))
    assert torch.equal(packaged["embedding.weight"], codes)


def test_a_bf16_table_needs_an_opset_with_bfloat16(
    shards_dir: Path, make_train_dir: Callable[..., Path], transform_path: Path, tmp_path: Path
) -> None:
    train_dir = make_train_dir(shards_dir, table_precision="bf16")
    with pytest.raises(ConfigError, match="export.opset=12.*set export.opset: 13"):
        export_model(
            ExportConfig(opset=12), train_dir, transform_path, shards_dir, None, tmp_path / "p"
        )
    assert not (tmp_path / "p").exists()  # refused before anything was written
