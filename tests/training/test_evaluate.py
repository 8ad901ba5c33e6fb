import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from sklearn.metrics import log_loss, roc_auc_score

from training.config import EvaluateConfig
from training.data import load_dataset_meta
from training.evaluate import evaluate_model
from training.model import load_model


def reference_scores(train_dir: Path, shards_dir: Path, split: str) -> tuple[np.ndarray, ...]:
    """Labels, model probabilities and oracle of a split, computed in one pass."""
    meta = load_dataset_meta(shards_dir)
    table = pq.read_table([shards_dir / f.path for f in meta.split(split).files])
    sparse = torch.from_numpy(np.stack([table.column(n).to_numpy() for n in meta.sparse_names], 1))
    dense = torch.from_numpy(np.stack([table.column(n).to_numpy() for n in meta.dense], 1))
    model, _ = load_model(train_dir)
    with torch.no_grad():
        probabilities = torch.sigmoid(model(sparse, dense)[:, 0].double()).numpy()
    return table.column("click").to_numpy(), probabilities, table.column("p_true").to_numpy()


def test_metrics_match_sklearn_on_the_whole_split(
    shards_dir: Path, random_train_dir: Path, tmp_path: Path
) -> None:
    # 512 test rows in batches of 100: the last, partial batch must be scored too.
    result = evaluate_model(EvaluateConfig(batch_size=100), random_train_dir, shards_dir, tmp_path)
    labels, probabilities, oracle = reference_scores(random_train_dir, shards_dir, "test")
    assert result.num_rows == 512
    assert result.auc == pytest.approx(roc_auc_score(labels, probabilities), abs=1e-9)
    assert result.logloss == pytest.approx(log_loss(labels, probabilities), abs=1e-6)
    assert result.click_rate == pytest.approx(labels.mean())
    assert result.mean_prediction == pytest.approx(probabilities.mean(), abs=1e-6)
    assert result.bayes_auc == pytest.approx(roc_auc_score(labels, oracle), abs=1e-12)
    written = json.loads(result.metrics_path.read_text())
    assert written["auc"] == result.auc and written["split"] == "test"
    assert written["bayes_auc"] == result.bayes_auc


def test_no_oracle_means_no_bayes_auc(
    make_shards: Callable[..., Path], make_train_dir: Callable[..., Path], tmp_path: Path
) -> None:
    shards_dir = make_shards(oracle=False)
    train_dir = make_train_dir(shards_dir, interaction="cross")
    result = evaluate_model(EvaluateConfig(split="valid"), train_dir, shards_dir, tmp_path / "e")
    assert result.bayes_auc is None and result.num_rows == 256
    assert "bayes_auc" not in json.loads(result.metrics_path.read_text())


def test_multi_task_metrics_per_label_match_sklearn(
    make_shards: Callable[..., Path], make_train_dir: Callable[..., Path], tmp_path: Path
) -> None:
    from training.data import iter_tables, model_columns, to_batch

    shards = make_shards("mt", multi_hot={"tags": 12}, extra_labels=["purchase"])
    train_dir = make_train_dir(shards, tasks=["click", "purchase"], pooling="sum")
    result = evaluate_model(EvaluateConfig(batch_size=64), train_dir, shards, tmp_path / "mt")
    written = json.loads(result.metrics_path.read_text())
    meta = load_dataset_meta(shards)
    model, _ = load_model(train_dir)
    tasks = ["click", "purchase"]
    tables = iter_tables(shards, meta, "test", 0, 1, 10_000, model_columns(meta, tasks), False)
    batch = to_batch(next(iter(tables)), meta, tasks)
    with torch.no_grad():
        p = torch.sigmoid(model(batch.sparse, batch.dense, *batch.multi_hot).double()).numpy()
    for t, task in enumerate(tasks):
        y = batch.labels[:, t].numpy()
        assert written[f"auc/{task}"] == pytest.approx(roc_auc_score(y, p[:, t]), abs=1e-9)
        assert written[f"logloss/{task}"] == pytest.approx(log_loss(y, p[:, t]), abs=1e-6)
    assert written["auc"] == written["auc/click"]
