"""bench/table_precision.py's --quick mode, run so that the bench cannot rot.

Two smoke runs of its parts: the train-stage parts (bytes, speed with its resume
checkpoints, the largest table) at fp32 and int8, and the `recforge run` part (test AUC
through the CLI's entry, the data stages cached for the second run) at fp32 and fp16.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[3] / "bench" / "table_precision.py"


def run_quick(workdir: Path, *flags: str) -> dict:
    result = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--workdir", str(workdir), *flags],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_quick_train_stage_parts_measure_int8_rows(tmp_path: Path) -> None:
    figures = run_quick(tmp_path, "--parts", "bytes,speed,largest", "--precisions", "fp32,int8")
    details = figures["details"]
    # fp32: 16 x 4-byte values + the fp32 Adagrad sum; int8: 16 codes + (scale, bias) + sum.
    assert details["bytes_per_row"]["fp32"] == {"weight": 64.0, "sum_sq": 4.0, "total": 68.0}
    assert details["bytes_per_row"]["int8"] == {
        "weight": 16.0,
        "sum_sq": 4.0,
        "scale_bias": 8.0,
        "total": 28.0,
    }
    assert figures["bytes_per_row_ratio_int8"] == round(28 / 68, 4)
    speed = details["speed"]
    assert speed["order"] == ["fp32", "int8"]
    int8 = speed["by_precision"]["int8"]
    # The resume checkpoint's shard holds the same per-row tensors as the live table.
    assert int8["checkpoint_bytes_per_row"] == {"weight": 16.0, "sum_sq": 4.0, "scale_bias": 8.0}
    assert 28 / 68 <= figures["checkpoint_bytes_ratio_int8"] < 0.45
    assert figures["speed_ratio_int8"] > 0 and int8["samples_per_s"] > 0

    assert figures["largest_rows"] == 400_000 and figures["largest_steps"] == 20
    assert figures["largest_peak_rss_gb"] >= figures["largest_train_rss_gb"] > 0
    planner, peak = figures["largest_planner_gb"], figures["largest_peak_rss_gb"]
    assert figures["planner_rss_error"] == pytest.approx(abs(planner - peak) / peak, abs=2e-3)
    table = figures["largest_planner_vs_measured_gb"]["table_and_state"]
    assert table["measured"] == round(400_000 * 36 / 1e9, 3)
    largest = tmp_path / "runs" / "largest"
    assert (largest / "train_summary.json").is_file()
    assert not (largest / "model.safetensors").exists()  # GBs at full size: deleted
    assert set(figures["seconds"]) == {"bytes", "speed", "largest", "total"}


@pytest.mark.slow
def test_quick_recforge_runs_give_auc_deltas(tmp_path: Path) -> None:
    figures = run_quick(tmp_path, "--parts", "quality", "--precisions", "fp32,fp16")
    runs = figures["details"]["quality"]["runs"]
    assert [(r["seed"], r["precision"]) for r in runs] == [(0, "fp32"), (0, "fp16")]
    assert runs[0]["stages"]["shard"] == "ran"
    # The second run reuses the data stages and trains and evaluates again.
    assert {k: runs[1]["stages"][k] for k in ("ingest", "preprocess", "shard", "train")} == {
        "ingest": "cached",
        "preprocess": "cached",
        "shard": "cached",
        "train": "ran",
    }
    assert all(0.5 < r["auc"] < 1 and r["test_rows"] > 0 for r in runs)
    assert figures["auc_delta_fp16"] == pytest.approx(runs[1]["auc"] - runs[0]["auc"], abs=1e-5)
