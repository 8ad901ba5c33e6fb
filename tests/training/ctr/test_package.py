"""The CTR package travels alone: parity sample, raw-record scorer, infra validation.

One module-scoped fixture runs the real data stages (synthetic logs -> ingest ->
preprocess -> shard) on a few thousand rows, builds a randomly initialised model for the
shards, evaluates it and exports it with the ingest and evaluate outputs, so the raw
records are real clean events and evaluate's scores are the reference.
"""

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

from artifacts.errors import ConfigError, DataError, InputNotFoundError
from data_prep.ingest import IngestConfig, ingest_logs
from data_prep.preprocess import PreprocessConfig, preprocess_events
from data_prep.schema import FieldSpec, SchemaConfig
from data_prep.shard import ShardConfig, write_shards
from data_prep.synthetic import GenerateConfig, generate_logs
from data_prep.transform import (
    TransformApplier,
    collect_stats,
    empty_stats,
    fit_transform,
    load_transform,
    merge_stats,
)
from training.config import EvaluateConfig, ExportConfig
from training.ctr.data import iter_tables, load_dataset_meta, model_columns, pad_multi_hot, to_batch
from training.ctr.evaluate import evaluate_model
from training.ctr.export import ScoringModule, export_model
from training.ctr.model import load_model
from training.ctr.package import (
    SCORER_SOURCE,
    infra_validate,
    raw_test_records,
    with_unseen_records,
)
from training.errors import ParityError

RECFORGE = ("training", "data_prep", "tasks", "flows")
TEST_ROWS, UNSEEN = 120, 9

# Every kind of feature the transform has: int and string vocabularies (one with top_k),
# int and string hashing, a log-scaled clipped dense feature and a bucketized one.
SCHEMA = SchemaConfig(
    user_key="user_id",
    item_key="item_id",
    fields=[
        FieldSpec(name="ts", dtype="int64", role="timestamp"),
        FieldSpec(name="user_id", dtype="int64", role="sparse"),
        FieldSpec(name="item_id", dtype="int64", role="sparse", hash_buckets=64),
        FieldSpec(name="city", dtype="string", role="sparse"),
        FieldSpec(name="device", dtype="string", role="sparse", hash_buckets=16),
        FieldSpec(name="hour", dtype="int64", role="sparse"),
        FieldSpec(name="category", dtype="string", role="sparse", top_k=12),
        FieldSpec(name="price", dtype="float64", role="dense", log=True, clip=(0.0, 60.0)),
        FieldSpec(name="position", dtype="int64", role="dense", bucketize=[1.5, 3.5]),
        FieldSpec(name="click", dtype="int64", role="label"),
        FieldSpec(name="p_true", dtype="float64", role="oracle", required=False),
    ],
)

# Scores the parity sample in an interpreter that imports no recforge code.
PARITY_CHECK = """
import json, sys
import numpy as np
import onnxruntime

session = onnxruntime.InferenceSession("model.onnx", providers=["CPUExecutionProvider"])
inputs = dict(np.load("parity/inputs.npz"))
scores = session.run(["score"], inputs)[0]
expected = np.load("parity/scores.npy")
print(json.dumps({
    "keys": sorted(inputs), "onnx_inputs": sorted(i.name for i in session.get_inputs()),
    "shape": list(scores.shape), "expected_shape": list(expected.shape),
    "max_abs_diff": float(np.max(np.abs(scores.astype(np.float64) - expected))),
    "modules": sorted({m.split(".")[0] for m in sys.modules}),
}))
"""


def _random_train_dir(train_dir: Path, shards_dir: Path, table_precision: str = "fp32") -> Path:
    from safetensors.torch import save_file

    from training.config import TrainConfig
    from training.ctr.model import build_model, model_config_from

    config = TrainConfig(
        interaction="dot",
        embedding_dim=8,
        bottom_mlp=[16, 8],
        top_mlp=[16],
        table_precision=table_precision,
    )
    model_config = model_config_from(config, load_dataset_meta(shards_dir))
    torch.manual_seed(0)
    model = build_model(model_config)
    train_dir.mkdir(parents=True)
    (train_dir / "model_config.json").write_text(json.dumps(model_config))
    (train_dir / "train_config.json").write_text(config.model_dump_json())
    save_file(model.state_dict(), str(train_dir / "model.safetensors"))
    return train_dir


@pytest.fixture(scope="module")
def stages(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Real ingest, preprocess and shard outputs of 3000 synthetic rows, and a package."""
    root = tmp_path_factory.mktemp("package")
    raw = root / "raw"
    generate_logs(
        GenerateConfig(
            out=str(raw), format="jsonl", num_rows=3000, num_users=150, num_items=80,
            num_files=2, chunk_rows=1500, seed=3,
        )
    )  # fmt: skip
    ingest_logs(IngestConfig(path=str(raw)), SCHEMA, root / "ingest")
    preprocess_events(
        PreprocessConfig(batch_rows=700), SCHEMA, root / "ingest" / "events", root / "pre"
    )
    write_shards(ShardConfig(num_train_shards=2, num_eval_shards=2), root / "pre", root / "shards")
    train_dir = _random_train_dir(root / "train", root / "shards")
    # Batches of 50 and two workers: evaluate's row order and batching differ from export's.
    evaluate_model(
        EvaluateConfig(batch_size=50, workers=2),
        train_dir,
        root / "shards",
        root / "evaluate",
        root / "pre" / "transform.json",
    )
    config = ExportConfig(
        parity_rows=200,
        infra_validation_rows=TEST_ROWS,
        infra_validation_unseen=UNSEEN,
        infra_validation_repetitions=30,
    )
    result = export_model(
        config,
        train_dir,
        root / "pre" / "transform.json",
        root / "shards",
        None,
        root / "out",
        events_dir=root / "ingest" / "events",
        evaluate_dir=root / "evaluate",
    )
    return {
        "events": root / "ingest" / "events",
        "transform": root / "pre" / "transform.json",
        "shards": root / "shards",
        "train": train_dir,
        "evaluate": root / "evaluate",
        "config": config,  # type: ignore[dict-item]
        "package": result.out_dir,
        "result": result,  # type: ignore[dict-item]
    }


def _load_scorer(path: Path) -> ModuleType:
    """A package's score.py (or its source) as a module of this process."""
    if path.is_dir():
        path = path / "score.py"
    spec = importlib.util.spec_from_file_location(f"score_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _records(stages: dict) -> list[dict]:
    meta = load_dataset_meta(stages["shards"])
    transform = load_transform(stages["transform"])
    test, _ = raw_test_records(stages["events"], stages["shards"], meta, transform, TEST_ROWS)
    return with_unseen_records(test, transform, UNSEEN)


def test_parity_sample_repeats_in_a_process_without_recforge(stages: dict) -> None:
    check = subprocess.run(
        [sys.executable, "-I", "-c", PARITY_CHECK],
        cwd=stages["package"],
        capture_output=True,
        text=True,
        check=True,
    )
    report = json.loads(check.stdout.strip().splitlines()[-1])
    assert report["keys"] == report["onnx_inputs"] == ["dense", "sparse"]
    assert report["shape"] == report["expected_shape"] == [200]
    assert report["max_abs_diff"] <= 1e-5
    assert not set(report["modules"]) & {*RECFORGE, "torch"}, report["modules"]
    signature = json.loads((stages["package"] / "signature.json").read_text())
    assert signature["parity"]["input_keys"] == ["sparse", "dense"]
    assert signature["parity"]["rows"] == 200 and signature["parity"]["atol"] <= 1e-5
    assert signature["files"]["scorer"] == "score.py"


def test_raw_records_score_like_the_trained_model(stages: dict) -> None:
    records = _records(stages)
    assert len(records) == TEST_ROWS + UNSEEN
    score = _load_scorer(stages["package"])
    scorer = score.PackageScorer(stages["package"])
    actual = scorer.score(records)  # (N,)

    # The trained model on the shard rows themselves: independent of any transform code.
    meta = load_dataset_meta(stages["shards"])
    model, _ = load_model(stages["train"])
    module = ScoringModule(model).eval()
    table = next(iter_tables(stages["shards"], meta, "test", 0, 1, TEST_ROWS, model_columns(meta)))
    shard_batch = to_batch(table, meta)
    with torch.no_grad():
        on_shards = module(shard_batch.sparse, shard_batch.dense).numpy()
    assert np.max(np.abs(actual[:TEST_ROWS] - on_shards)) <= 1e-5
    np.testing.assert_array_equal(scorer.inputs(records[:TEST_ROWS])["sparse"], shard_batch.sparse)
    np.testing.assert_array_equal(scorer.inputs(records[:TEST_ROWS])["dense"], shard_batch.dense)

    # The unseen records: data_prep's transform, then the trained model.
    schema = pq.read_schema(sorted(stages["events"].glob("*.parquet"))[0])
    nullable = pa.schema([f.with_nullable(True) for f in schema])
    unseen = TransformApplier(load_transform(stages["transform"]))(
        pa.Table.from_pylist(records[TEST_ROWS:], schema=nullable)
    )
    unseen_batch = to_batch(unseen, meta)
    with torch.no_grad():
        expected = module(unseen_batch.sparse, unseen_batch.dense).numpy()
    assert np.max(np.abs(actual[TEST_ROWS:] - expected)) <= 1e-5
    # They really are out of vocabulary: user_id, city, hour and category map to 0.
    sparse = scorer.inputs(records[TEST_ROWS:])["sparse"]
    for name in ("user_id", "city", "hour", "category"):
        assert (sparse[:, meta.sparse_names.index(name)] == 0).all(), name
    assert (scorer.inputs(records[:TEST_ROWS])["sparse"] != 0).any(axis=0).all()


def test_cli_scores_and_benchmarks_jsonl(stages: dict, tmp_path: Path) -> None:
    records = _records(stages)[-20:]
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    package = stages["package"]
    scored = subprocess.run(
        [sys.executable, "-I", str(package / "score.py"), str(path)],
        capture_output=True,
        text=True,
        check=True,
    )
    lines = [json.loads(line) for line in scored.stdout.splitlines()]
    expected = _load_scorer(package).score_records(records, package)
    assert [list(line) for line in lines] == [["click"]] * 20
    np.testing.assert_allclose([line["click"] for line in lines], expected, rtol=0, atol=1e-7)
    timed = subprocess.run(
        [sys.executable, "-I", str(package / "score.py"), str(path), "--benchmark", "10"],
        capture_output=True,
        text=True,
        check=True,
    )
    figures = json.loads(timed.stdout)
    assert figures["rows"] == 20 and figures["repetitions"] == 10
    assert 0 < figures["p50_ms"] <= figures["p99_ms"]
    assert 0 < figures["batch_p50_ms"] <= figures["batch_p99_ms"]


def test_export_writes_the_infra_validation_report(stages: dict) -> None:
    result = stages["result"]
    package = stages["package"]
    assert {"score.py", "infra_validation.json"} <= set(result.files)
    assert (package / "score.py").read_bytes() == SCORER_SOURCE.read_bytes()
    report = json.loads((package / "infra_validation.json").read_text())
    assert report["rows"] == TEST_ROWS + UNSEEN == len(report["scores"])
    assert report["test_records"] == TEST_ROWS and report["unseen_records"] == UNSEEN
    assert 0 < report["p50_ms"] <= report["p99_ms"]
    assert 0 < report["batch_p50_ms"] <= report["batch_p99_ms"]
    assert report["max_abs_diff"] <= 1e-5 and report["leaked_modules"] == []
    assert report["ok"] is True  # what the registry checks before a promotion
    assert result.infra_validation["p50_ms"] == report["p50_ms"]
    assert "scores" not in result.infra_validation
    card = (package / "model_card.md").read_text()
    assert "Infra validation" in card and "one record per call" in card


def test_infra_validation_fails_clearly_on_a_broken_package(stages: dict, tmp_path: Path) -> None:
    records = _records(stages)[:10]
    good = infra_validate(stages["package"], records, repetitions=3)
    assert good["rows"] == 10 and 0 < good["p50_ms"] <= good["p99_ms"]

    no_model = shutil.copytree(stages["package"], tmp_path / "no-model")
    (no_model / "model.onnx").unlink()
    with pytest.raises(ParityError, match="model.onnx is missing"):
        infra_validate(no_model, records, repetitions=3)

    leaky = shutil.copytree(stages["package"], tmp_path / "leaky")
    scorer = leaky / "score.py"
    scorer.write_text(scorer.read_text() + "\nimport data_prep.transform  # noqa\n")
    with pytest.raises(ParityError, match=r"imported \['data_prep'"):
        infra_validate(leaky, records, repetitions=3)

    expected = np.asarray(good["scores"])
    with pytest.raises(ParityError, match="differ from the trained model"):
        infra_validate(stages["package"], records, expected + 1e-3, repetitions=3)
    with pytest.raises(ParityError, match="could not start"):
        infra_validate(tmp_path / "nowhere", records, repetitions=3)


def test_raw_test_records_need_the_matching_events(stages: dict, tmp_path: Path) -> None:
    meta = load_dataset_meta(stages["shards"])
    transform = load_transform(stages["transform"])
    records, rows = raw_test_records(stages["events"], stages["shards"], meta, transform, 50)
    assert [r["ts"] for r in records] == rows.column("ts").to_pylist()
    assert all(r["ts"] >= transform["split"]["test_start_ts"] for r in records)
    # Events that are not the ones the shards came from: the sample is refused.
    other = tmp_path / "events"
    other.mkdir()
    table = pq.read_table(sorted(stages["events"].glob("*.parquet"))[-1])
    prices = pa.array([p + 1.0 for p in table.column("price").to_pylist()])
    pq.write_table(table.set_column(table.schema.get_field_index("price"), "price", prices),
                   other / "part-0.parquet")  # fmt: skip
    with pytest.raises(DataError, match="ingest output these shards were made from"):
        raw_test_records(other, stages["shards"], meta, transform, 50)


def _fitted(schema: SchemaConfig, table: pa.Table) -> dict:
    stats = merge_stats(empty_stats(schema), collect_stats(schema, table))
    transform = fit_transform(stats, schema, default_min_count=2)
    transform["split"] = {"method": "time"}
    return transform


def test_record_transform_is_data_preps_mapping() -> None:
    """The package's transform and data_prep's agree on every kind of feature, on many
    values: known, unseen, missing, multi-hot lists with unseen elements, clipped."""
    schema = SchemaConfig(
        fields=[
            FieldSpec(name="ts", dtype="int64", role="timestamp"),
            FieldSpec(name="uid", dtype="int64", role="sparse"),
            FieldSpec(name="wide", dtype="int64", role="sparse", min_count=1),
            FieldSpec(name="city", dtype="string", role="sparse", top_k=5),
            FieldSpec(name="hid", dtype="int64", role="sparse", hash_buckets=1000),
            FieldSpec(name="hs", dtype="string", role="sparse", hash_buckets=97),
            FieldSpec(name="tags", dtype="string", role="sparse", multi_hot=True),
            FieldSpec(name="ids", dtype="int64", role="sparse", multi_hot=True, hash_buckets=50),
            FieldSpec(name="price", dtype="float64", role="dense", log=True, clip=(0.0, 50.0)),
            FieldSpec(name="raw", dtype="float64", role="dense", standardize=False, fill=-1.0),
            FieldSpec(name="pos", dtype="int64", role="dense", bucketize=[1.0, 2.5, 10.0]),
            FieldSpec(name="click", dtype="int64", role="label"),
        ]
    )
    rng = np.random.default_rng(7)

    def events(n: int, shift: int) -> list[dict]:
        rows = []
        for i in range(n):
            rows.append(
                {
                    "ts": i,
                    "uid": int(rng.integers(0, 400)) + shift,
                    "wide": int(rng.integers(-(2**62), 2**62)) if i % 5 else i,
                    "city": f"c{int(rng.integers(0, 12)) + shift}" if i % 13 else None,
                    "hid": int(rng.integers(-(2**63), 2**63 - 1)) if i % 17 else None,
                    "hs": f"s{int(rng.integers(0, 1000))}" if i % 19 else None,
                    "tags": None
                    if i % 11 == 5
                    else [f"t{int(t) + shift}" for t in rng.integers(0, 9, size=i % 4)],
                    "ids": [int(t) for t in rng.integers(-5, 10**12, size=i % 3)],
                    "price": float(rng.lognormal(2, 1.5)) if i % 7 else None,
                    "raw": float(rng.normal(0, 3)) if i % 9 else None,
                    "pos": int(rng.integers(0, 13)) if i % 8 else None,
                    "click": int(rng.random() < 0.3),
                }
            )
        return rows

    types = pa.schema(
        [
            ("ts", pa.int64()),
            ("uid", pa.int64()),
            ("wide", pa.int64()),
            ("city", pa.string()),
            ("hid", pa.int64()),
            ("hs", pa.string()),
            ("tags", pa.list_(pa.string())),
            ("ids", pa.list_(pa.int64())),
            ("price", pa.float64()),
            ("raw", pa.float64()),
            ("pos", pa.int64()),
            ("click", pa.int64()),
        ]
    )
    transform = _fitted(schema, pa.Table.from_pylist(events(600, 0), schema=types))
    assert 0 < len(transform["sparse"]["uid"]["values"]) < 400
    # Shifted ids and strings: about half of them never seen in train.
    served = events(400, 0) + events(400, 30)
    expected = TransformApplier(transform)(pa.Table.from_pylist(served, schema=types))

    score = _load_scorer(SCORER_SOURCE)  # the file export copies into packages as score.py
    mapping = score.RecordTransform(transform)
    assert mapping.sparse == ["uid", "wide", "city", "hid", "hs", "pos"]
    assert mapping.dense == ["price", "raw"] and mapping.multi_hot == ["tags", "ids"]
    for name in [*mapping.sparse, *mapping.dense]:
        np.testing.assert_array_equal(
            mapping.column(name, [r.get(name) for r in served]),
            expected.column(name).to_numpy(),
            err_msg=name,
        )
    inputs = mapping(served)
    for name in mapping.multi_hot:
        np.testing.assert_array_equal(
            inputs[f"multi_hot_{name}"], pad_multi_hot(expected.column(name), name), err_msg=name
        )
    unseen = inputs["sparse"][:, :3]  # vocabulary features: some unseen rows map to 0
    assert (unseen == 0).any(axis=0).all() and (unseen != 0).any(axis=0).all()
    assert (inputs["multi_hot_tags"] == 0).any()
    # Raw values as text logs hold them map the same way; wrong types are refused.
    as_text = [{"uid": str(r["uid"]), "pos": f" {r['pos']} " if r["pos"] is not None else ""}
               for r in served[:50]]  # fmt: skip
    np.testing.assert_array_equal(
        mapping.column("uid", [r["uid"] for r in as_text]), expected.column("uid").to_numpy()[:50]
    )
    np.testing.assert_array_equal(
        mapping.column("pos", [r["pos"] for r in as_text]), expected.column("pos").to_numpy()[:50]
    )
    with pytest.raises(ValueError, match="'uid'"):
        mapping([{"uid": "abc"}])
    with pytest.raises(ValueError, match="'tags'"):
        mapping([{"tags": "a|b"}])


def test_raw_records_through_the_package_score_like_the_evaluate_stage(stages: dict) -> None:
    """The acceptance check: the evaluate stage's scores are the reference."""
    evaluated = np.load(stages["evaluate"] / "scores_head.npy")  # (256,) first test rows
    assert evaluated.shape == (256,) and evaluated.dtype == np.float32
    meta = load_dataset_meta(stages["shards"])
    transform = load_transform(stages["transform"])
    records, _ = raw_test_records(stages["events"], stages["shards"], meta, transform, 256)
    assert len(records) == 256 and all("click" in record for record in records)
    score = _load_scorer(stages["package"])
    actual = score.PackageScorer(stages["package"]).score(records)  # (256,)
    diff = float(np.max(np.abs(actual.astype(np.float64) - evaluated)))
    print(f"package vs evaluate on 256 raw records: max abs diff {diff:.3g}")
    assert diff <= 1e-5
    # Export checked the same, and recorded it.
    report = json.loads((stages["package"] / "infra_validation.json").read_text())
    assert report["max_abs_diff_vs_evaluate"] <= 1e-5
    assert report["evaluate_rows"] == TEST_ROWS and report["evaluate_split"] == "test"
    np.testing.assert_allclose(report["scores"][:TEST_ROWS], evaluated[:TEST_ROWS], atol=1e-5)
    assert (
        stages["result"].infra_validation["max_abs_diff_vs_evaluate"]
        == (report["max_abs_diff_vs_evaluate"])
    )
    assert "vs the evaluate stage" in (stages["package"] / "model_card.md").read_text()


def test_a_mismatched_evaluate_reference_fails_export(stages: dict, tmp_path: Path) -> None:
    tampered = shutil.copytree(stages["evaluate"], tmp_path / "evaluate")
    head = np.load(tampered / "scores_head.npy")
    head[7] += 1e-3  # one row, above the 1e-5 tolerance
    np.save(tampered / "scores_head.npy", head)

    def export(evaluate_dir: Path, out: str, **overrides: object) -> None:
        export_model(
            stages["config"].model_copy(update=overrides),
            stages["train"],
            stages["transform"],
            stages["shards"],
            None,
            tmp_path / out,
            events_dir=stages["events"],
            evaluate_dir=evaluate_dir,
        )

    with pytest.raises(ParityError, match=r"differ from the evaluate stage's.*max \|diff\| 0\.001"):
        export(tampered, "bad")
    assert not (tmp_path / "bad" / "infra_validation.json").exists()
    # Evaluate saved fewer rows than infra validation scores: the fields are named.
    with pytest.raises(ConfigError, match="evaluate.score_sample_rows.*infra_validation_rows"):
        export(stages["evaluate"], "short", infra_validation_rows=300)
    (tampered / "scores_head.npy").unlink()
    with pytest.raises(InputNotFoundError, match="run evaluate"):
        export(tampered, "missing")


@pytest.mark.parametrize("precision", ["fp16", "int8"])
def test_a_compact_table_package_passes_infra_validation_against_evaluate(
    stages: dict, precision: str, tmp_path: Path
) -> None:
    """train.table_precision: evaluate scores the model with its compact table, export
    keeps the table compact, and the package's score.py reproduces evaluate's scores."""
    train_dir = _random_train_dir(tmp_path / "train", stages["shards"], precision)
    evaluated = evaluate_model(
        EvaluateConfig(batch_size=50), train_dir, stages["shards"], tmp_path / "evaluate"
    )
    assert evaluated.table_precision == precision
    metrics = json.loads(evaluated.metrics_path.read_text())
    assert metrics["table_precision"] == precision
    result = export_model(
        stages["config"],
        train_dir,
        stages["transform"],
        stages["shards"],
        evaluated.metrics_path,
        tmp_path / "package",
        events_dir=stages["events"],
        evaluate_dir=tmp_path / "evaluate",
    )
    assert result.parity_max_abs_diff_onnx <= 1e-5
    infra = result.infra_validation
    assert infra is not None and infra["max_abs_diff_vs_evaluate"] <= 1e-5
    assert infra["max_abs_diff"] <= 1e-5 and infra["unseen_records"] == UNSEEN
    weights = load_file(str(result.out_dir / "model.safetensors"))
    dtype = {"fp16": torch.float16, "int8": torch.uint8}[precision]
    assert weights["embedding.weight"].dtype == dtype
    packaged_config = json.loads((result.out_dir / "model_config.json").read_text())
    assert packaged_config["table_precision"] == precision
