"""bench/comm_precision.py: its figures from fake runs, its run order and its checks.

Fast: no training. The figures (`summarize`) are computed from made-up run results with
known answers; `measure_runs` and `run_demo` run with `recforge` and the data generator
replaced, to check the order of the runs, the stage selection of each, and the refusal
of a run that exchanged nothing. One slow test runs the bench for real at a tiny size
(40k rows, fp32 and bf16, one seed: ~80 s on a busy 2-core box).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from flows.config import load_config

REPO = Path(__file__).resolve().parents[3]
BENCH = REPO / "bench" / "comm_precision.py"


def load_bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("comm_precision", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_bench()


def wire(rows: float, ids: float = 2.0, dense: float = 100.0, scale: float = 0.0) -> dict:
    """A `wire_bytes_per_sample` dict whose rows and row gradients are `rows` bytes each."""
    parts = {"ids": ids, "rows": rows, "row_grads": rows + scale, "dense_allreduce": dense}
    return {"total": sum(parts.values()), **parts}


def fake_run(seed: int, precision: str, auc: float, samples_per_s: float, rows: float) -> dict:
    return {
        "seed": seed,
        "precision": precision,
        "auc": auc,
        "samples_per_s": samples_per_s,
        "wire_bytes_per_sample": wire(rows, scale=2.0 if precision == "fp16" else 0.0),
    }


def test_summarize_pairs_each_precision_with_fp32_at_the_same_seed(bench: ModuleType) -> None:
    runs = [
        fake_run(0, "fp32", 0.8000, 100.0, 64.0),
        fake_run(0, "bf16", 0.7990, 120.0, 32.0),
        fake_run(0, "fp16", 0.8004, 90.0, 32.0),
        # The second seed in the bench's palindrome order; its wire bytes differ a little
        # (other batches) and must not be the ones reported.
        fake_run(1, "fp16", 0.8112, 150.0, 30.0),
        fake_run(1, "bf16", 0.8080, 180.0, 30.0),
        fake_run(1, "fp32", 0.8100, 300.0, 60.0),
    ]
    figures = bench.summarize(runs, ["fp32", "bf16", "fp16"], [0, 1])

    # bf16: (-0.0010 + -0.0020) / 2; fp16: (+0.0004 + +0.0012) / 2.
    assert figures["auc_delta_bf16"] == pytest.approx(-0.0015, abs=1e-9)
    assert figures["auc_delta_fp16"] == pytest.approx(0.0008, abs=1e-9)
    assert figures["auc_deltas"]["bf16"] == pytest.approx([-0.001, -0.002], abs=1e-9)
    assert figures["auc_deltas"]["fp16"] == pytest.approx([0.0004, 0.0012], abs=1e-9)
    assert figures["auc_by_precision"] == {"fp32": 0.805, "bf16": 0.8035, "fp16": 0.8058}

    # Seed 0's: fp32 2 + 64 + 64 + 100 = 230; bf16 2 + 32 + 32 + 100 = 166; fp16 + 2.
    assert figures["wire_bytes_per_sample_fp32"] == wire(64.0)
    assert figures["wire_bytes_per_sample_bf16"] == wire(32.0)
    assert figures["wire_bytes_per_sample_fp16"]["total"] == 168.0
    assert figures["wire_bytes_ratio_vs_fp32_bf16"] == round(166 / 230, 4)
    assert figures["wire_bytes_ratio_vs_fp32_fp16"] == round(168 / 230, 4)

    # Means over the seeds: fp32 200, bf16 150, fp16 120.
    assert figures["speed_ratio_bf16"] == 0.75
    assert figures["speed_ratio_fp16"] == 0.6
    assert "auc_delta_fp32" not in figures and "speed_ratio_fp32" not in figures


def test_summarize_with_fp32_and_one_precision(bench: ModuleType) -> None:
    runs = [fake_run(3, "fp32", 0.7, 10.0, 64.0), fake_run(3, "fp16", 0.7005, 10.0, 32.0)]
    figures = bench.summarize(runs, ["fp32", "fp16"], [3])
    assert figures["auc_delta_fp16"] == 0.0005
    assert figures["speed_ratio_fp16"] == 1.0
    assert "auc_delta_bf16" not in figures and "wire_bytes_per_sample_bf16" not in figures
    # A delta that rounds to zero from below is reported as 0.0, not -0.0.
    runs[1]["auc"] = 0.699997
    assert json.dumps(bench.summarize(runs, ["fp32", "fp16"], [3])["auc_delta_fp16"]) == "0.0"


def test_nothing_sent_gives_no_ratio_rather_than_a_division_by_zero(bench: ModuleType) -> None:
    runs = [fake_run(0, p, 0.7, 10.0, 0.0) for p in ("fp32", "bf16")]
    for run in runs:
        run["wire_bytes_per_sample"] = dict.fromkeys(bench.WIRE_KINDS, 0.0)
    assert bench.summarize(runs, ["fp32", "bf16"], [0])["wire_bytes_ratio_vs_fp32_bf16"] is None


def test_summarize_refuses_a_missing_or_repeated_run(bench: ModuleType) -> None:
    runs = [fake_run(0, "fp32", 0.7, 10.0, 64.0), fake_run(0, "bf16", 0.7, 10.0, 32.0)]
    with pytest.raises(ValueError, match=r"no run at \(seed, precision\) \[\(1, 'fp32'\)"):
        bench.summarize(runs, ["fp32", "bf16"], [0, 1])
    with pytest.raises(ValueError, match="two runs at seed 0, bf16"):
        bench.summarize([*runs, runs[1]], ["fp32", "bf16"], [0])


def test_argument_defaults(bench: ModuleType) -> None:
    args = bench.parse_args([])
    # make demo's data as it is: configs/demo.yaml's size.
    assert args.auc_rows == load_config(bench.DEMO_CONFIG).generate.num_rows == 4_000_000
    assert args.seeds == [0, 1]
    assert args.precisions == ["fp32", "bf16", "fp16"]
    assert args.workdir == REPO / ".bench" / "comm_precision"


def test_arguments_put_fp32_first_and_refuse_a_comparison_without_it(
    bench: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    args = bench.parse_args(["--precisions", "fp16,fp32", "--seeds", "4", "--auc-rows", "5000"])
    assert (args.precisions, args.seeds, args.auc_rows) == (["fp32", "fp16"], [4], 5000)
    for bad in (["--precisions", "bf16,fp16"], ["--precisions", "fp32,int8"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)
        assert "--precisions: fp32 and any of" in capsys.readouterr().err
    for seeds in ("0,x", "1,1", ","):
        with pytest.raises(SystemExit):
            bench.parse_args(["--seeds", seeds])
        assert "--seeds:" in capsys.readouterr().err


def test_runs_go_in_a_palindrome_with_only_the_first_forcing_train(
    bench: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    calls: list[tuple[int, str, list[str]]] = []

    def fake_run_demo(
        store: Path, raw: Path, seed: int, precision: str, selection: list[str], log: Path
    ) -> dict[str, Any]:
        assert (store, raw) == (tmp_path / "store", tmp_path / "raw")
        calls.append((seed, precision, selection))
        return {"seed": seed, "precision": precision}

    monkeypatch.setattr(bench, "generate_demo", lambda raw, rows, log: {"num_rows": rows})
    monkeypatch.setattr(bench, "run_demo", fake_run_demo)
    runs, bayes = bench.measure_runs(tmp_path, ["fp32", "bf16", "fp16"], [0, 1, 2], 1000)
    assert bayes == {"num_rows": 1000}
    assert [(s, p) for s, p, _ in calls] == [
        (0, "fp32"), (0, "bf16"), (0, "fp16"),
        (1, "fp16"), (1, "bf16"), (1, "fp32"),
        (2, "fp32"), (2, "bf16"), (2, "fp16"),
    ]  # fmt: skip
    assert calls[0][2] == ["--force", "train"]
    assert all(selection == ["--only", "train,evaluate"] for _, _, selection in calls[1:])
    assert runs == [{"seed": s, "precision": p} for s, p, _ in calls]


def fake_record(tmp_path: Path, comm_precision: str | None, world_size: int) -> Path:
    train = {
        "status": "ran",
        "world_size": world_size,
        "steps": 10,
        "seconds": 3.0,
        "samples_per_s": 1234.5,
        "wire_bytes_per_sample": wire(32.0),
        **({"comm_precision": comm_precision} if comm_precision else {}),
    }
    stages = {name: {"status": "cached"} for name in ("ingest", "preprocess", "shard")}
    record = {
        "stages": {**stages, "train": train, "evaluate": {"status": "ran"}},
        "metrics": {"auc": 0.81, "logloss": 0.4, "num_rows": 100},
    }
    path = tmp_path / "summary.json"
    path.write_text(json.dumps(record))
    return path


def test_run_demo_reads_the_run_record(
    bench: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    record = fake_record(tmp_path, "bf16", 2)
    argvs: list[list[str]] = []

    def fake_recforge(argv: list[str], log: Path) -> str:
        argvs.append(argv)
        return f"progress\n{record}\n"

    monkeypatch.setattr(bench, "recforge", fake_recforge)
    run = bench.run_demo(
        tmp_path / "store", tmp_path / "raw", 7, "bf16", ["--only", "train,evaluate"], tmp_path
    )
    assert argvs[0][:4] == ["run", str(bench.DEMO_CONFIG), "--root", str(tmp_path / "store")]
    assert "train.comm_precision=bf16" in argvs[0] and "train.seed=7" in argvs[0]
    assert argvs[0][-2:] == ["--only", "train,evaluate"]
    assert {k: run[k] for k in ("seed", "precision", "auc", "samples_per_s", "test_rows")} == {
        "seed": 7,
        "precision": "bf16",
        "auc": 0.81,
        "samples_per_s": 1234,
        "test_rows": 100,
    }
    assert run["wire_bytes_per_sample"] == wire(32.0)
    assert run["stages"]["shard"] == "cached" and run["record"] == str(record)


@pytest.mark.parametrize(("comm_precision", "world_size"), [("bf16", 1), ("fp32", 2), (None, 2)])
def test_run_demo_refuses_a_run_that_did_not_exchange_at_the_asked_precision(
    bench: ModuleType,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    comm_precision: str | None,
    world_size: int,
) -> None:
    record = fake_record(tmp_path, comm_precision, world_size)
    monkeypatch.setattr(bench, "recforge", lambda argv, log: f"{record}\n")
    with pytest.raises(RuntimeError, match="this bench needs 'bf16' on 2 or more ranks"):
        bench.run_demo(tmp_path, tmp_path, 0, "bf16", [], tmp_path)


@pytest.mark.slow
def test_tiny_bench_runs_through_recforge(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable, str(BENCH), "--workdir", str(tmp_path),
            "--auc-rows", "40000", "--seeds", "0", "--precisions", "fp32,bf16",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    runs = figures["runs"]
    assert [(r["precision"], r["world_size"]) for r in runs] == [("fp32", 2), ("bf16", 2)]
    assert runs[1]["stages"]["shard"] == "cached" and runs[1]["stages"]["train"] == "ran"
    fp32, bf16 = figures["wire_bytes_per_sample_fp32"], figures["wire_bytes_per_sample_bf16"]
    # Only the rows and their gradients change size: half of fp32's bytes at bf16.
    assert bf16["rows"] == pytest.approx(fp32["rows"] / 2, rel=1e-3) and fp32["rows"] > 0
    assert bf16["row_grads"] == pytest.approx(fp32["row_grads"] / 2, rel=1e-3)
    assert (bf16["ids"], bf16["dense_allreduce"]) == (fp32["ids"], fp32["dense_allreduce"])
    assert 0.5 < figures["wire_bytes_ratio_vs_fp32_bf16"] < 1
    assert figures["auc_delta_bf16"] == pytest.approx(runs[1]["auc"] - runs[0]["auc"], abs=1e-5)
