import json
import re
from pathlib import Path

import numpy as np
import onnxruntime
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import save_file

from artifacts.errors import ConfigError, InputNotFoundError
from data_prep.errors import SchemaError
from training.config import ExportConfig
from training.errors import ParityError
from training.packaging import ExportResult
from training.sequence import export as sequence_export
from training.sequence.export import (
    TopKScorer,
    export_sequence_model,
    load_sequence_model,
    pad_histories,
    reference_top_k,
)
from training.sequence.sasrec import SASRec

ARCH = {
    "num_items": 50,
    "max_length": 6,
    "hidden_dim": 8,
    "num_blocks": 2,
    "num_heads": 2,
    "dropout": 0.1,
}
ITEM_FIELD = "item_id"
TEST_ROWS = 30
K = 10


def make_model(seed: int = 0) -> SASRec:
    torch.manual_seed(seed)
    model = SASRec(**ARCH)
    # Random LayerNorm affine parameters, so the user state is not just the normalised
    # sum of the inputs and an all-padding history gets a state of its own.
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.normal_(mean=1.0 if name.endswith("weight") else 0.0, std=0.5)
    return model.eval()


def write_train_dir(root: Path, model: SASRec) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "model_config.json").write_text(json.dumps({"model": "sasrec", **ARCH}))
    save_file(model.state_dict(), str(root / "model.safetensors"))
    return root


def random_histories(rows: int, seed: int) -> list[list[int]]:
    """Histories of 0..max_length items (the first empty, the second full), no padding."""
    rng = np.random.default_rng(seed)
    lengths = [0, ARCH["max_length"], *rng.integers(0, ARCH["max_length"] + 1, rows - 2)]
    return [rng.integers(1, ARCH["num_items"], n).tolist() for n in lengths]


def write_sequences_dir(root: Path, histories: list[list[int]]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    rows = len(histories)
    table = pa.table(
        {
            "user": pa.array(range(rows), pa.int64()),
            "history": pa.array(histories, pa.list_(pa.int64())),
            "target": pa.array(
                [1 + row % (ARCH["num_items"] - 1) for row in range(rows)], pa.int64()
            ),
            "ts": pa.array([1_700_000_000 + row for row in range(rows)], pa.int64()),
            "seen": pa.array([row % 2 for row in range(rows)], pa.int64()),
        }
    )
    pq.write_table(table, root / "test.parquet", row_group_size=8)
    return root


def write_transform(path: Path, kind: str = "vocab") -> Path:
    if kind == "vocab":
        entry = {
            "kind": "vocab",
            "dtype": "string",
            "multi_hot": False,
            "num_embeddings": ARCH["num_items"],
            "values": [f"sku-{index}" for index in range(1, ARCH["num_items"])],
        }
    else:
        entry = {"kind": "hash", "dtype": "int64", "multi_hot": False, "hash_buckets": 50}
        entry["num_embeddings"] = ARCH["num_items"]
    path.write_text(json.dumps({"sparse": {ITEM_FIELD: entry, "user_id": {"kind": "hash"}}}))
    return path


@pytest.fixture
def inputs(tmp_path: Path) -> dict[str, Path]:
    return {
        "train_dir": write_train_dir(tmp_path / "train", make_model()),
        "transform_path": write_transform(tmp_path / "transform.json"),
        "sequences_dir": write_sequences_dir(
            tmp_path / "sequences", random_histories(TEST_ROWS, 1)
        ),
    }


def export(inputs: dict[str, Path], out_dir: Path, **config: object) -> ExportResult:
    return export_sequence_model(
        ExportConfig(model_name="sasrec-test", **config),
        inputs["train_dir"],
        inputs["transform_path"],
        inputs["sequences_dir"],
        ITEM_FIELD,
        inputs.get("metrics_path"),
        out_dir,
        k=K,
    )


def test_pad_histories_left_pads_and_keeps_the_newest_items() -> None:
    padded = pad_histories([[3, 4], [], [1, 2, 3, 4, 5]], max_length=3)
    assert padded.dtype == torch.int64
    assert padded.tolist() == [[0, 3, 4], [0, 0, 0], [3, 4, 5]]


def test_top_k_scorer_excludes_padding_and_history_and_matches_reference() -> None:
    model = make_model()
    history = pad_histories(random_histories(64, 2), ARCH["max_length"])  # (64, 6)
    with torch.no_grad():
        items, scores = TopKScorer(model, K).eval()(history)

    assert items.shape == scores.shape == (64, K)
    assert items.dtype == torch.int64 and scores.dtype == torch.float32
    assert (items != 0).all()
    for row_items, row_history in zip(items.tolist(), history.tolist(), strict=True):
        assert not set(row_items) & set(row_history)
        assert len(set(row_items)) == K
    assert (scores[:, :-1] >= scores[:, 1:]).all()
    expected_items, expected_scores = reference_top_k(model, history, K)
    np.testing.assert_array_equal(items.numpy(), expected_items)
    np.testing.assert_allclose(scores.numpy(), expected_scores, rtol=0, atol=1e-6)
    # The reference ranks the model's own scores: the top-K scores are the unmasked ones.
    with torch.no_grad():
        all_scores = model.score(model(history)[:, -1]).numpy()  # (64, V)
    np.testing.assert_array_equal(
        np.take_along_axis(all_scores, expected_items, 1), expected_scores
    )


def test_reference_breaks_ties_by_the_lower_item_index() -> None:
    model = make_model()
    with torch.no_grad():
        model.item_embedding.weight[1:] = model.item_embedding.weight[1]  # every item ties
    history = pad_histories([[5, 2], []], ARCH["max_length"])
    items, scores = reference_top_k(model, history, 3)
    assert items.tolist() == [[1, 3, 4], [1, 2, 3]]
    assert (scores == scores[:, :1]).all()


def test_k_that_would_reach_masked_items_is_refused() -> None:
    # 50 items - padding - 6 history items leave 43 that can always be recommended.
    TopKScorer(make_model(), 43)
    with pytest.raises(ConfigError, match="k=44"):
        TopKScorer(make_model(), 44)


def test_package_recommends_like_the_trained_model(inputs: dict[str, Path], tmp_path: Path) -> None:
    inputs["metrics_path"] = tmp_path / "metrics.json"
    inputs["metrics_path"].write_text(json.dumps({"hit_rate@10": 0.31, "ndcg@10": 0.17}))
    out_dir = tmp_path / "package"
    result = export(inputs, out_dir, parity_rows=20)

    assert result.files == [
        "item_ids.json",
        "model.onnx",
        "model.safetensors",
        "model.ts",
        "model_card.md",
        "model_config.json",
        "parity/inputs.npz",
        "parity/items.npy",
        "parity/scores.npy",
        "signature.json",
        "transform.json",
    ]
    assert result.parity_rows == 20
    assert result.top_k_match_onnx == result.top_k_match_torchscript == 1.0
    assert result.parity_max_abs_diff_onnx <= 1e-5
    assert result.parity_max_abs_diff_torchscript <= 1e-5

    # The package on its own: onnxruntime reproduces the stored reference, and the
    # 20 rows (the graph was traced on 2) prove the batch axis is dynamic.
    session = onnxruntime.InferenceSession(
        str(out_dir / "model.onnx"), providers=["CPUExecutionProvider"]
    )
    parity = dict(np.load(out_dir / "parity" / "inputs.npz"))
    assert sorted(parity) == [i.name for i in session.get_inputs()] == ["history"]
    assert [o.name for o in session.get_outputs()] == ["items", "scores"]
    items, scores = session.run(["items", "scores"], parity)
    expected_items = np.load(out_dir / "parity" / "items.npy")
    expected_scores = np.load(out_dir / "parity" / "scores.npy")
    assert expected_items.shape == expected_scores.shape == (20, K)
    assert expected_items.dtype == np.int64 and expected_scores.dtype == np.float32
    np.testing.assert_array_equal(items, expected_items)
    np.testing.assert_allclose(scores, expected_scores, rtol=0, atol=1e-5)
    traced_items, _ = torch.jit.load(str(out_dir / "model.ts"))(torch.from_numpy(parity["history"]))
    np.testing.assert_array_equal(traced_items.numpy(), expected_items)

    # The parity inputs are the first 20 test histories, left-padded.
    histories = pq.read_table(inputs["sequences_dir"] / "test.parquet")["history"].to_pylist()
    np.testing.assert_array_equal(parity["history"], pad_histories(histories[:20], 6).numpy())
    assert (parity["history"][0] == 0).all()  # the empty history still gets K items
    for row_items, row_history in zip(expected_items, parity["history"], strict=True):
        assert not set(row_items) & set(row_history) and 0 not in row_items

    item_ids = json.loads((out_dir / "item_ids.json").read_text())
    assert len(item_ids) == 50 and item_ids[0] is None and item_ids[7] == "sku-7"
    signature = json.loads((out_dir / "signature.json").read_text())
    assert signature["inputs"][0] | {"description": None} == {
        "name": "history",
        "dtype": "int64",
        "shape": ["batch", 6],
        "description": None,
        "num_items": 50,
        "padding": 0,
    }
    assert [(o["name"], o["dtype"], o["shape"]) for o in signature["outputs"]] == [
        ("items", "int64", ["batch", K]),
        ("scores", "float32", ["batch", K]),
    ]
    assert (signature["k"], signature["max_length"], signature["padding_item"]) == (K, 6, 0)
    assert signature["items"]["index_to_id"] == "item_ids.json"
    assert json.loads((out_dir / "model_config.json").read_text())["model"] == "sasrec"
    card = (out_dir / "model_card.md").read_text()
    assert "# sasrec-test" in card and "| hit_rate@10 | 0.31 |" in card
    assert "first 20 test histories" in card


def test_hash_item_field_has_no_item_ids_and_parity_uses_every_row(
    inputs: dict[str, Path], tmp_path: Path
) -> None:
    write_transform(inputs["transform_path"], kind="hash")
    result = export(inputs, tmp_path / "package", parity_rows=1000)

    assert "item_ids.json" not in result.files
    assert result.parity_rows == TEST_ROWS
    signature = json.loads((tmp_path / "package" / "signature.json").read_text())
    assert signature["items"]["kind"] == "hash" and signature["items"]["index_to_id"] is None
    assert "Not evaluated." in (tmp_path / "package" / "model_card.md").read_text()


class UnmaskedScorer(TopKScorer):
    """A wrong served graph: it forgets to exclude the history."""

    def forward(self, history: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.model.score(self.model(history)[:, -1])  # (B, V)
        scores = scores.index_fill(1, torch.tensor([0]), float("-inf"))
        top_scores, items = torch.topk(scores, self.k, dim=1)
        return items, top_scores


def test_parity_check_catches_other_items(
    inputs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = make_model()
    history = pad_histories(random_histories(TEST_ROWS, 1), ARCH["max_length"])
    with torch.no_grad():
        wrong_items, _ = UnmaskedScorer(model, K)(history)
    expected_items, _ = reference_top_k(model, history, K)
    differing = int((wrong_items.numpy() != expected_items).any(axis=1).sum())
    assert 0 < differing < TEST_ROWS  # the wrong graph is wrong on some rows only

    monkeypatch.setattr(sequence_export, "TopKScorer", UnmaskedScorer)
    with pytest.raises(ParityError) as caught:
        export(inputs, tmp_path / "package", parity_rows=1000)
    message = str(caught.value)
    assert f"ONNX {differing} rows with other item ids" in message
    assert f"TorchScript {differing} rows" in message


def test_parity_check_catches_score_differences(
    inputs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def shifted_reference(
        model: SASRec, history: torch.Tensor, k: int
    ) -> tuple[np.ndarray, np.ndarray]:
        items, scores = reference_top_k(model, history, k)
        return items, scores + np.float32(1e-3)

    monkeypatch.setattr(sequence_export, "reference_top_k", shifted_reference)
    with pytest.raises(ParityError) as caught:
        export(inputs, tmp_path / "package", parity_atol=1e-4)
    message = str(caught.value)
    assert "ONNX 0 rows with other item ids" in message
    diffs = [float(d) for d in re.findall(r"max \|score diff\| ([0-9.e-]+)", message)]
    assert len(diffs) == 2 and all(9e-4 < d < 1.1e-3 for d in diffs)


@pytest.mark.parametrize("name", ["model_config.json", "model.safetensors"])
def test_missing_train_file_is_named(inputs: dict[str, Path], tmp_path: Path, name: str) -> None:
    (inputs["train_dir"] / name).unlink()
    with pytest.raises(InputNotFoundError, match=re.escape(name)):
        export(inputs, tmp_path / "package")


def test_missing_sequences_are_named(inputs: dict[str, Path], tmp_path: Path) -> None:
    (inputs["sequences_dir"] / "test.parquet").unlink()
    with pytest.raises(InputNotFoundError, match="test.parquet"):
        export(inputs, tmp_path / "package")


def test_empty_test_split_is_refused(inputs: dict[str, Path], tmp_path: Path) -> None:
    write_sequences_dir(inputs["sequences_dir"], [])
    with pytest.raises(SchemaError, match="no rows"):
        export(inputs, tmp_path / "package")


def test_other_model_kind_is_refused(inputs: dict[str, Path]) -> None:
    config_path = inputs["train_dir"] / "model_config.json"
    config_path.write_text(json.dumps({"model": "bst", **ARCH}))
    with pytest.raises(SchemaError, match="'bst'"):
        load_sequence_model(inputs["train_dir"])


def test_weights_of_another_architecture_are_refused(inputs: dict[str, Path]) -> None:
    config_path = inputs["train_dir"] / "model_config.json"
    config_path.write_text(json.dumps({"model": "sasrec", **ARCH, "num_blocks": 3}))
    with pytest.raises(SchemaError, match="does not fit"):
        load_sequence_model(inputs["train_dir"])


def test_loaded_model_scores_like_the_saved_one(inputs: dict[str, Path]) -> None:
    model, model_config = load_sequence_model(inputs["train_dir"])
    assert model_config == {"model": "sasrec", **ARCH} and not model.training
    history = pad_histories(random_histories(8, 3), ARCH["max_length"])
    with torch.no_grad():
        torch.testing.assert_close(model(history), make_model()(history), rtol=0, atol=0)


def test_item_vocabulary_must_fit_the_model(inputs: dict[str, Path], tmp_path: Path) -> None:
    transform = json.loads(inputs["transform_path"].read_text())
    transform["sparse"][ITEM_FIELD]["values"].pop()
    inputs["transform_path"].write_text(json.dumps(transform))
    with pytest.raises(SchemaError, match="49 indices but the model has num_items=50"):
        export(inputs, tmp_path / "package")
