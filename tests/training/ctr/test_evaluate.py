import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file, save_file
from sklearn.calibration import calibration_curve
from sklearn.metrics import log_loss, roc_auc_score

from artifacts.errors import ConfigError, InputNotFoundError, TransientError
from data_prep.errors import SchemaError
from tasks.common import StageOutput, stage_fingerprint, stage_modules
from tasks.evaluate import evaluate_section
from training.config import EvaluateConfig
from training.ctr.data import load_dataset_meta
from training.ctr.evaluate import (
    _Accumulators,
    _ScoringPlan,
    _slice_metrics,
    _split_metrics,
    evaluate_model,
    read_accumulators,
    write_accumulators,
)
from training.ctr.model import load_model
from training.runtime.files import RANKS_DIR, WEIGHTS_FILE
from training.runtime.launcher import CHAOS_KILL_RANK


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
    from training.ctr.data import iter_tables, model_columns, to_batch

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


def test_above_the_exact_limit_auc_is_bucketed_within_its_bound(
    shards_dir: Path, random_train_dir: Path, tmp_path: Path
) -> None:
    config = EvaluateConfig(batch_size=100, exact_auc_max_rows=150, auc_buckets=64)
    result = evaluate_model(config, random_train_dir, shards_dir, tmp_path)
    labels, probabilities, oracle = reference_scores(random_train_dir, shards_dir, "test")
    written = json.loads(result.metrics_path.read_text())
    assert written["auc_mode"] == "bucketed" and written["auc_error_bound"] > 0
    assert abs(result.auc - roc_auc_score(labels, probabilities)) <= written["auc_error_bound"]
    # The running sums do not depend on the mode.
    assert result.logloss == pytest.approx(log_loss(labels, probabilities), abs=1e-6)
    exact = evaluate_model(EvaluateConfig(batch_size=100), random_train_dir, shards_dir, tmp_path)
    assert json.loads(exact.metrics_path.read_text())["auc_error_bound"] == 0.0


def test_streaming_keys_calibration_and_reliability_bins(
    shards_dir: Path, random_train_dir: Path, tmp_path: Path
) -> None:
    config = EvaluateConfig(batch_size=100, calibration_bins=5)
    result = evaluate_model(config, random_train_dir, shards_dir, tmp_path)
    labels, probabilities, _ = reference_scores(random_train_dir, shards_dir, "test")
    written = json.loads(result.metrics_path.read_text())
    assert written["auc_mode"] == result.auc_mode == "exact"  # 512 rows: auto is exact
    assert written["auc_error_bound"] == 0.0
    # The scored model's table precision (an fp32 table here; see test_package for int8).
    assert written["table_precision"] == result.table_precision == "fp32"
    assert written["calibration"] == pytest.approx(probabilities.mean() / labels.mean(), abs=1e-6)
    assert "gauc" not in written  # the fabricated dataset.json names no user_key
    bins = json.loads((tmp_path / "calibration.json").read_text())
    assert bins["split"] == "test" and bins["num_bins"] == 5 and len(bins["bins"]) == 5
    prob_true, prob_pred = calibration_curve(labels, probabilities, n_bins=5)
    filled = [b for b in bins["bins"] if b["count"]]
    assert [b["observed_rate"] for b in filled] == pytest.approx(prob_true, abs=1e-9)
    assert [b["mean_prediction"] for b in filled] == pytest.approx(prob_pred, abs=1e-6)
    assert sum(b["count"] for b in bins["bins"]) == 512


@pytest.mark.parametrize(
    "settings", [{"auc_mode": "bucketed"}, {"auc_mode": "auto", "exact_auc_max_rows": 300}]
)
def test_bucketed_auc_is_within_its_bound_and_says_so(
    shards_dir: Path, random_train_dir: Path, tmp_path: Path, settings: dict
) -> None:
    config = EvaluateConfig(batch_size=100, auc_buckets=16, **settings)
    result = evaluate_model(config, random_train_dir, shards_dir, tmp_path)
    labels, probabilities, oracle = reference_scores(random_train_dir, shards_dir, "test")
    written = json.loads(result.metrics_path.read_text())
    assert written["auc_mode"] == "bucketed" and written["auc_error_bound"] > 0
    assert abs(written["auc"] - roc_auc_score(labels, probabilities)) <= written["auc_error_bound"]
    assert written["bayes_auc"] == pytest.approx(roc_auc_score(labels, oracle), abs=0.05)
    assert written["logloss"] == pytest.approx(log_loss(labels, probabilities), abs=1e-6)


def test_slices_match_sklearn_per_value(
    shards_dir: Path, random_train_dir: Path, tmp_path: Path
) -> None:
    config = EvaluateConfig(batch_size=100, slice_by=["city", "category"])
    result = evaluate_model(config, random_train_dir, shards_dir, tmp_path)
    written = json.loads(result.metrics_path.read_text())
    labels, probabilities, _ = reference_scores(random_train_dir, shards_dir, "test")
    table = pq.read_table(
        [shards_dir / f.path for f in load_dataset_meta(shards_dir).split("test").files]
    )
    for feature in ("city", "category"):
        ids = table.column(feature).to_numpy()
        for value in np.unique(ids):
            rows = ids == value
            prefix = f"slice/{feature}=#{value}"  # no transform: keyed by index
            assert written[f"{prefix}/num_rows"] == rows.sum()
            assert written[f"{prefix}/click_rate"] == pytest.approx(labels[rows].mean())
            assert written[f"{prefix}/mean_prediction"] == pytest.approx(probabilities[rows].mean())
            assert written[f"{prefix}/logloss"] == pytest.approx(
                log_loss(labels[rows], probabilities[rows], labels=[0, 1]), abs=1e-6
            )
            if 0 < labels[rows].sum() < rows.sum():
                expected = roc_auc_score(labels[rows], probabilities[rows])
                assert written[f"{prefix}/auc"] == pytest.approx(expected, abs=1e-9)
            else:
                assert f"{prefix}/auc" not in written
    slice_rows = [
        v for k, v in written.items() if k.startswith("slice/city=") and k.endswith("/num_rows")
    ]
    assert sum(slice_rows) == 512


def test_slices_are_named_through_the_vocabulary(
    shards_dir: Path, random_train_dir: Path, tmp_path: Path
) -> None:
    from data_prep.transform import TRANSFORM_FORMAT

    cities = [f"city-{i}" for i in range(1, 9)]  # indices 9 and 10 lie past the vocabulary
    transform = {
        "format": TRANSFORM_FORMAT,
        "columns": [],
        "labels": [],
        "sparse": {
            "city": {"kind": "vocab", "dtype": "string", "multi_hot": False, "values": cities},
            "category": {"kind": "hash", "dtype": "string", "multi_hot": False},
        },
        "dense": {},
    }
    transform_path = tmp_path / "transform.json"
    transform_path.write_text(json.dumps(transform))
    config = EvaluateConfig(slice_by=["city", "category"])
    result = evaluate_model(config, random_train_dir, shards_dir, tmp_path / "e", transform_path)
    written = json.loads(result.metrics_path.read_text())
    names = {k.split("/")[1] for k in written if k.startswith("slice/")}
    expected_cities = {"city=<oov>", *(f"city={c}" for c in cities), "city=#9", "city=#10"}
    assert {n for n in names if n.startswith("city=")} == expected_cities
    assert {n for n in names if n.startswith("category=")} == {f"category=#{i}" for i in range(7)}


def test_unknown_slice_feature_names_the_field_and_the_choices(
    shards_dir: Path, random_train_dir: Path, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError) as error:
        evaluate_model(EvaluateConfig(slice_by=["citty"]), random_train_dir, shards_dir, tmp_path)
    message = str(error.value)
    assert "evaluate.slice_by" in message and "'citty'" in message
    assert "['user_id', 'city', 'category']" in message
    with pytest.raises(ValidationError, match="evaluate.slice_by"):
        EvaluateConfig(slice_by=["city", "city"])


def test_gauc_over_the_user_column_matches_per_user_sklearn(
    shards_dir: Path, random_train_dir: Path, tmp_path: Path
) -> None:
    config = EvaluateConfig(batch_size=100, user_key="user_id")
    result = evaluate_model(config, random_train_dir, shards_dir, tmp_path)
    labels, probabilities, _ = reference_scores(random_train_dir, shards_dir, "test")
    table = pq.read_table(
        [shards_dir / f.path for f in load_dataset_meta(shards_dir).split("test").files]
    )
    users = table.column("user_id").to_numpy()
    numerator = denominator = users_counted = 0
    for user in np.unique(users[users != 0]):  # index 0 is the OOV bucket: left out
        rows = users == user
        if 0 < labels[rows].sum() < rows.sum():
            numerator += rows.sum() * roc_auc_score(labels[rows], probabilities[rows])
            denominator += rows.sum()
            users_counted += 1
    written = json.loads(result.metrics_path.read_text())
    assert users_counted > 10
    assert written["gauc"] == pytest.approx(numerator / denominator, abs=1e-9) == result.gauc
    assert written["gauc_users"] == users_counted == result.gauc_users
    with pytest.raises(ConfigError, match="evaluate.user_key"):
        evaluate_model(EvaluateConfig(user_key="price"), random_train_dir, shards_dir, tmp_path)


@pytest.mark.parametrize("click", [0.0, 1.0])
def test_a_single_class_split_is_a_schema_error(
    shards_dir: Path, random_train_dir: Path, tmp_path: Path, click: float
) -> None:
    for entry in load_dataset_meta(shards_dir).split("valid").files:
        table = pq.read_table(shards_dir / entry.path)
        clicks = pa.array(np.full(table.num_rows, click, dtype=np.float32))
        pq.write_table(
            table.set_column(table.schema.get_field_index("click"), "click", clicks),
            shards_dir / entry.path,
        )
    with pytest.raises(SchemaError, match="'valid'.*only one class"):
        evaluate_model(EvaluateConfig(split="valid"), random_train_dir, shards_dir, tmp_path)


def test_an_empty_split_is_a_schema_error(
    make_shards: Callable[..., Path], make_train_dir: Callable[..., Path], tmp_path: Path
) -> None:
    shards_dir = make_shards(split_files={"train": 1, "valid": 1, "test": 0})
    train_dir = make_train_dir(shards_dir)
    with pytest.raises(SchemaError, match="no rows"):
        evaluate_model(EvaluateConfig(), train_dir, shards_dir, tmp_path / "e")


def test_scores_head_holds_the_first_rows_scores_in_split_order(
    shards_dir: Path, random_train_dir: Path, tmp_path: Path
) -> None:
    # 300 rows in batches of 100 over two 256-row files: the head crosses a file.
    config = EvaluateConfig(batch_size=100, score_sample_rows=300)
    result = evaluate_model(config, random_train_dir, shards_dir, tmp_path)
    _, probabilities, _ = reference_scores(random_train_dir, shards_dir, "test")
    head = np.load(result.scores_head_path)
    assert result.scores_head_path == tmp_path / "scores_head.npy"
    assert head.dtype == np.float32 and head.shape == (300,)
    # A GEMM's last bit depends on the batch around a row: the reference is one batch.
    np.testing.assert_allclose(head, probabilities[:300], rtol=0, atol=1e-7)
    # Longer than the split: every row.
    config = EvaluateConfig(score_sample_rows=10_000)
    longer = evaluate_model(config, random_train_dir, shards_dir, tmp_path)
    assert np.load(longer.scores_head_path).shape == (512,)


def _assert_same_metrics(one: dict, many: dict) -> float:
    """Counts, AUCs and strings equal; float sums within 1e-9. Returns the largest diff."""
    assert one.keys() == many.keys()
    worst = 0.0
    for key, value in one.items():
        if isinstance(value, float) and "auc" not in key:
            assert many[key] == pytest.approx(value, rel=0, abs=1e-9), key
            worst = max(worst, abs(many[key] - value))
        else:
            assert many[key] == value, key  # exact and bucketed AUCs, GAUC, counts
    return worst


@pytest.mark.slow
@pytest.mark.parametrize(
    ("test_files", "workers", "settings"),
    [
        (2, 2, {"batch_size": 100}),  # one file per rank; a batch of 100 crosses no file
        (5, 3, {"batch_size": 50, "auc_mode": "bucketed", "auc_buckets": 64}),  # 2, 2, 1 files
        (2, 4, {"batch_size": 64}),  # more workers than files: two ranks run
    ],
)
def test_workers_give_the_metrics_of_one_process(
    make_shards: Callable[..., Path],
    make_train_dir: Callable[..., Path],
    tmp_path: Path,
    test_files: int,
    workers: int,
    settings: dict,
) -> None:
    shards_dir = make_shards(split_files={"train": 1, "valid": 1, "test": test_files})
    train_dir = make_train_dir(shards_dir)
    base = {**settings, "slice_by": ["city"], "user_key": "user_id", "score_sample_rows": 400}
    one = evaluate_model(EvaluateConfig(**base), train_dir, shards_dir, tmp_path / "one")
    many = evaluate_model(
        EvaluateConfig(**base, workers=workers), train_dir, shards_dir, tmp_path / "many"
    )
    metrics_one = json.loads(one.metrics_path.read_text())
    metrics_many = json.loads(many.metrics_path.read_text())
    assert metrics_many["num_rows"] == 256 * test_files and metrics_many["gauc_users"] > 10
    assert metrics_many["auc_mode"] == ("bucketed" if "auc_mode" in settings else "exact")
    assert any(key.startswith("slice/city=") for key in metrics_many)
    worst = _assert_same_metrics(metrics_one, metrics_many)
    print(f"workers={workers}: largest float diff {worst:.3g}")
    bins_one = json.loads(one.calibration_path.read_text())["bins"]
    bins_many = json.loads(many.calibration_path.read_text())["bins"]
    assert [b["count"] for b in bins_one] == [b["count"] for b in bins_many]
    np.testing.assert_array_equal(np.load(one.scores_head_path), np.load(many.scores_head_path))
    # The ranks ran under the launcher: min(workers, files) of them, in one process group.
    spec = json.loads((tmp_path / "many" / RANKS_DIR / "launch.json").read_text())
    assert spec["world_size"] == min(workers, test_files)
    assert not (tmp_path / "one" / RANKS_DIR).exists()  # one process: no launcher
    assert not list((tmp_path / "many" / RANKS_DIR).glob("merged.npz*"))


def _nan_model(train_dir: Path) -> None:
    """Make every weight of the model in `train_dir` NaN: it predicts NaN everywhere."""
    weights = load_file(str(train_dir / WEIGHTS_FILE))
    save_file(
        {n: torch.full_like(t, float("nan")) for n, t in weights.items()},
        str(train_dir / WEIGHTS_FILE),
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fault", "error_type", "message"),
    [
        # Rank 1 reads file 1 of the two: its error names the rank and the file.
        ("missing_file", InputNotFoundError, r"evaluate rank 1 of 2: .*test-00001-of-00002"),
        ("nan_model", ValueError, r"evaluate rank [01] of 2: .*predicts NaN"),
    ],
)
def test_a_rank_error_comes_back_as_its_type_naming_the_rank(
    make_shards: Callable[..., Path],
    make_train_dir: Callable[..., Path],
    tmp_path: Path,
    fault: str,
    error_type: type[Exception],
    message: str,
) -> None:
    shards_dir = make_shards(split_files={"train": 1, "valid": 1, "test": 2})
    train_dir = make_train_dir(shards_dir)
    if fault == "missing_file":
        (shards_dir / load_dataset_meta(shards_dir).split("test").files[1].path).unlink()
    else:
        _nan_model(train_dir)
    out_dir = tmp_path / "e"
    with pytest.raises(error_type, match=message):
        evaluate_model(EvaluateConfig(workers=2), train_dir, shards_dir, out_dir)
    assert not (out_dir / "metrics.json").exists()


@pytest.mark.slow
@pytest.mark.chaos
def test_a_killed_rank_is_transient_and_writes_no_metrics(
    make_shards: Callable[..., Path], make_train_dir: Callable[..., Path], tmp_path: Path
) -> None:
    shards_dir = make_shards(split_files={"train": 1, "valid": 1, "test": 2})
    train_dir = make_train_dir(shards_dir)
    out_dir = tmp_path / "e"
    env = {**os.environ, CHAOS_KILL_RANK: "1"}  # rank 1 SIGKILLs itself, as the OOM killer
    with pytest.raises(TransientError, match="evaluate rank died") as error:
        evaluate_model(EvaluateConfig(workers=2), train_dir, shards_dir, out_dir, env=env)
    assert "evaluate.workers" in str(error.value)  # says what to change
    assert not (out_dir / "metrics.json").exists()
    assert not list((out_dir / RANKS_DIR).glob("merged.npz*"))


def test_workers_are_not_part_of_evaluates_cache_key() -> None:
    upstream = [StageOutput(stage="train", fingerprint="t", output="/t", status="ran")]

    def key(config: EvaluateConfig) -> str:
        return stage_fingerprint("evaluate", evaluate_section(config), upstream)

    assert key(EvaluateConfig(workers=1)) == key(EvaluateConfig(workers=4))
    assert key(EvaluateConfig(batch_size=64)) != key(EvaluateConfig())  # a real change counts
    assert "workers" not in evaluate_section(EvaluateConfig(workers=3))
    # The rank module's code changes rerun the stage.
    assert "training/ctr/evaluate_worker.py" in stage_modules("evaluate")


def test_workers_must_be_positive() -> None:
    with pytest.raises(ValidationError, match="workers"):
        EvaluateConfig(workers=0)


@pytest.mark.parametrize("auc_mode", ["exact", "bucketed", "auto"])
def test_merged_accumulators_round_trip_without_pickle(auc_mode: str, tmp_path: Path) -> None:
    """The ranks' result file (npz + JSON skeleton) gives the metrics of the merged state."""
    # auto with a 150-row limit: one part stays exact, the merge turns bucketed.
    config = EvaluateConfig(
        auc_mode=auc_mode, auc_buckets=64, exact_auc_max_rows=150, slice_by=["city"]
    )
    plan = _ScoringPlan(config, tmp_path, tmp_path, ["click", "buy"], [], "user_id", False, 30)
    rng = np.random.default_rng(0)
    parts = []
    for part_index in range(2):
        part = _Accumulators(plan, oracle=True)
        for batch in range(4):
            labels = rng.integers(0, 2, (25, 2)).astype(np.float32)
            scores = rng.random((25, 2))
            for t in range(2):
                part.aucs[t].update(labels[:, t], scores[:, t])
                part.stats[t].update(labels[:, t], scores[:, t])
            part.oracle_auc.update(labels[:, 0], rng.random(25))
            part.reliability.update(labels[:, 0], scores[:, 0])
            part.gauc.update(rng.integers(0, 6, 25), labels[:, 0], scores[:, 0])
            part.slices["city"].update(rng.integers(0, 3, 25), labels[:, 0], scores[:, 0])
            start = 100 * part_index + 25 * batch
            if start < plan.head_rows:
                part.head.append((np.arange(start, start + 5), scores[:5].astype(np.float32)))
        parts.append(part)
    merged = parts[0]
    merged.merge(parts[1])
    path = tmp_path / "merged.npz"
    with path.open("wb") as file:
        write_accumulators(file, merged)
    with np.load(path, allow_pickle=False) as saved:  # arrays and a string only
        assert all(saved[name].dtype != object for name in saved.files)
    restored = read_accumulators(path)
    assert _split_metrics(plan, restored) == _split_metrics(plan, merged)
    assert _slice_metrics(restored.slices, None) == _slice_metrics(merged.slices, None)
    assert restored.reliability.bins() == merged.reliability.bins()
    assert restored.aucs[0].mode == merged.aucs[0].mode
    assert len(restored.head) == len(merged.head)
    for (pos_a, scores_a), (pos_b, scores_b) in zip(restored.head, merged.head, strict=True):
        np.testing.assert_array_equal(pos_a, pos_b)
        np.testing.assert_array_equal(scores_a, scores_b)


def test_an_accumulators_file_naming_another_class_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "merged.npz"
    skeleton = json.dumps({"object": "Popen", "fields": {"args": ["touch", "x"]}})
    with path.open("wb") as file:
        np.savez(file, skeleton=np.array(skeleton))
    with pytest.raises(ValueError, match="not an evaluate accumulators file"):
        read_accumulators(path)
