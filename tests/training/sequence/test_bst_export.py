import json
from pathlib import Path

import numpy as np
import onnxruntime
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import save_file

from data_prep.errors import SchemaError
from training.config import ExportConfig
from training.errors import ParityError
from training.packaging import ExportResult
from training.sequence import bst_export
from training.sequence.bst import BST, score_candidates
from training.sequence.bst_export import PARITY_NEGATIVES, export_bst_model
from training.sequence.export import load_sequence_model

ARCH = {
    "num_items": 30,
    "max_length": 5,
    "hidden_dim": 8,
    "num_blocks": 1,
    "num_heads": 2,
    "dropout": 0.0,
    "mlp": [8],
}


@pytest.fixture
def dirs(tmp_path: Path) -> dict[str, Path]:
    torch.manual_seed(0)
    model = BST(**ARCH).eval()
    train = tmp_path / "train"
    train.mkdir()
    (train / "model_config.json").write_text(json.dumps({"model": "bst", **ARCH}))
    save_file(model.state_dict(), str(train / "model.safetensors"))
    seq = tmp_path / "seq"
    seq.mkdir()
    rng = np.random.default_rng(0)
    histories = [rng.integers(1, 30, int(n)).tolist() for n in rng.integers(0, 6, 12)]
    pq.write_table(
        pa.table(
            {
                "user": pa.array(range(12), pa.int64()),
                "history": pa.array(histories, pa.list_(pa.int64())),
                "target": pa.array(rng.integers(1, 30, 12), pa.int64()),
            }
        ),
        seq / "test.parquet",
    )
    transform = tmp_path / "transform.json"
    values = list(range(100, 129))  # 29 raw ids: indices 1..29
    transform.write_text(json.dumps({"sparse": {"item_id": {"kind": "vocab", "values": values}}}))
    return {"train": train, "seq": seq, "transform": transform, "out": tmp_path / "pkg"}


def export(dirs: dict[str, Path], **config) -> ExportResult:
    return export_bst_model(
        ExportConfig(model_name="bst", parity_rows=10, **config),
        dirs["train"],
        dirs["transform"],
        dirs["seq"],
        "item_id",
        None,
        dirs["out"],
    )


def test_package_scores_candidates_like_the_trained_model(dirs: dict[str, Path]) -> None:
    result = export(dirs)
    assert result.parity_rows == 10 and result.parity_max_abs_diff_onnx <= 1e-5
    pkg = dirs["out"]
    inputs = dict(np.load(pkg / "parity" / "inputs.npz"))
    assert inputs["history"].shape == (10, 5)
    assert inputs["candidates"].shape == (10, 1 + PARITY_NEGATIVES)
    targets = pq.read_table(dirs["seq"] / "test.parquet").column("target").to_pylist()
    assert inputs["candidates"][:, 0].tolist() == targets[:10]  # the real next item first
    session = onnxruntime.InferenceSession(str(pkg / "model.onnx"))
    scores = session.run(["scores"], inputs)[0]
    np.testing.assert_allclose(scores, np.load(pkg / "parity" / "scores.npy"), atol=1e-5)
    # The reference: the model itself, one candidate column at a time.
    model, _ = load_sequence_model(dirs["train"], kind="bst")
    history = torch.from_numpy(inputs["history"])
    with torch.no_grad():
        for column in range(inputs["candidates"].shape[1]):
            target = torch.from_numpy(inputs["candidates"][:, column])
            expected = torch.sigmoid(model(history, target)).numpy()
            np.testing.assert_allclose(scores[:, column], expected, atol=1e-5)
    assert json.loads((pkg / "item_ids.json").read_text())[1] == 100
    signature = json.loads((pkg / "signature.json").read_text())
    assert [i["name"] for i in signature["inputs"]] == ["history", "candidates"]
    assert "BST" in (pkg / "model_card.md").read_text()


def test_a_scorer_that_drifts_from_the_model_fails_parity(
    dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    class Drifted(bst_export.CandidateScorer):
        def forward(self, history: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
            return torch.sigmoid(score_candidates(self.model, history, candidates) + 0.01)

    trace = torch.jit.trace
    # The TorchScript file is traced from a scorer whose logits are off by 0.01.
    monkeypatch.setattr(
        bst_export.torch.jit, "trace", lambda module, example: trace(Drifted(module.model), example)
    )
    with pytest.raises(ParityError, match="TorchScript 0.00"):
        export(dirs)
    assert not (dirs["out"] / "parity" / "scores.npy").exists()  # nothing looks whole


def test_a_sasrec_train_dir_is_refused(dirs: dict[str, Path]) -> None:
    config = dirs["train"] / "model_config.json"
    config.write_text(json.dumps({"model": "sasrec", **ARCH}))
    with pytest.raises(SchemaError, match="not 'bst'"):
        export(dirs)
