"""bench/vs_torchrec.py's --quick mode, run so that the peer bench cannot rot.

recforge's side always runs (the 2-rank wide cell: the exchange and 100 slots, in
~20 s; and `--via-cli --table-precision fp16` through `recforge run`, ~1 min); TorchRec's
side only where the `peers` extra is installed (`make peers`), which a fresh clone's
`make test` does not do. Checked without training, fast: the pipeline config `--via-cli`
writes, the embedding width and comm precision reaching both engines' configs, TorchRec's
wire-byte arithmetic, and `--link`'s refusal without root.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
import pytest

from flows.config import load_config

BENCH = Path(__file__).resolve().parents[3] / "bench" / "vs_torchrec.py"
PHASES = {"data", "lookup", "dense", "optimizer", "total"}
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


def load_bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("vs_torchrec", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # @dataclass looks the module up while it runs (for its string annotations).
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def run_quick(workdir: Path, *flags: str) -> dict:
    result = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--no-warmup", "--workdir", str(workdir), *flags],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_quick_recforge_side_reports_every_figure(tmp_path: Path) -> None:
    cells = ["1000slots_2ranks"]
    figures = run_quick(tmp_path, "--recforge-only", "--cells", ",".join(cells))
    for cell in cells:
        # No peer ran: the ratios are null, never a made-up number.
        assert figures[f"vs_torchrec_{cell}"] is None
        assert figures[f"rss_ratio_vs_torchrec_{cell}"] is None
        recforge = figures["cells"][cell]["recforge"]
        assert recforge["samples_per_s"] > 0
        assert set(recforge["step_ms"]) == PHASES
        assert recforge["step_ms"]["total"] > 0
        assert len(recforge["peak_rss_mb"]) == 2 and min(recforge["peak_rss_mb"]) > 0
        # 2 ranks share the machine's cores equally (1 each on the 2-core build machine).
        assert recforge["threads_per_rank"] == max(1, (os.cpu_count() or 1) // 2)
        startup = recforge["rank0_startup_s"]
        assert {"imports", "rendezvous", "table_init", "engine", "reader"} <= set(startup)
        assert 0 < recforge["time_to_first_step_s"] < recforge["launch_to_exit_s"]
    assert figures["cells"]["1000slots_2ranks"]["rows"] == 100 * 2000


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("torchrec") is None or importlib.util.find_spec("fbgemm_gpu") is None,
    reason="the peers extra (make peers) is not installed",
)
@pytest.mark.parametrize(("precision", "dtype"), [("fp32", "float32"), ("fp16", "float16")])
def test_quick_against_torchrec_gives_ratios(tmp_path: Path, precision: str, dtype: str) -> None:
    figures = run_quick(tmp_path, "--cells", "1m_1proc", "--table-precision", precision)
    assert figures["vs_torchrec_1m_1proc"] > 0
    assert figures["rss_ratio_vs_torchrec_1m_1proc"] > 0
    assert figures["table_precision"] == precision
    cell = figures["cells"]["1m_1proc"]
    torchrec = cell["torchrec"]
    assert torchrec["samples_per_s"] > 0 and torchrec["tables_per_rank"] == [8]
    # Both engines held their rows at the precision asked for, not just configured it.
    assert torchrec["table_dtype"] == [dtype]
    assert cell["recforge"]["table_precision"] == precision


def test_via_cli_config_is_the_shipped_one_with_the_bench_model(tmp_path: Path) -> None:
    bench = load_bench()
    sizes = bench.split_rows(1000, 3)
    data_dir = bench.write_shard_dir(tmp_path / "data" / "d", sizes, 64)
    cell = bench.Cell("1m_2ranks", tuple(sizes), 2, 8, data_dir)
    events = bench.write_raw_logs(data_dir, tmp_path / "raw")
    overrides = bench.cli_train_overrides(cell, 10, 5, "fp16", None)
    config = load_config(
        bench.write_pipeline_config(cell, events, overrides, tmp_path / "pipeline.yaml")
    )
    shipped = load_config(bench.SHIPPED_CTR_CONFIG)

    # One hashed field per feature, its buckets the cell's table size: no OOV row.
    sparse = config.schema_.by_role("sparse")
    assert [f.name for f in sparse] == ["f0", "f1", "f2"]
    assert [f.hash_buckets for f in sparse] == [334, 333, 333]
    assert [f.name for f in config.schema_.by_role("dense")] == ["d0", "d1"]
    assert config.ingest.path == str(events)
    train = config.train
    assert (train.interaction, train.embedding_dim, train.bottom_mlp, train.top_mlp) == (
        "dot",
        16,
        [32, 16],
        [64, 32],
    )
    assert (train.batch_size, train.world_size, train.max_steps, train.log_every) == (8, 2, 10, 5)
    assert (train.lr, train.sparse_lr, train.table_precision) == (1e-3, 0.05, "fp16")
    # What the bench does not set is what a user gets: the ZeRO stage above all.
    for field in ("zero_stage", "precision", "checkpoint_every", "tensorboard", "seed"):
        assert getattr(train, field) == getattr(shipped.train, field), field
    assert train.threads_per_rank == shipped.train.threads_per_rank
    assert (config.preprocess, config.shard) == (shipped.preprocess, shipped.shard)

    # The raw logs are every row of the shard directory, in order, timestamped.
    raw = [pa_csv.read_csv(path) for path in sorted(events.glob("*.csv"))]
    shards = [pq.read_table(path) for path in sorted(data_dir.glob("*.parquet"))]
    assert len(raw) == len(shards) == 4
    for csv_table, shard in zip(raw, shards, strict=True):
        assert csv_table.column_names == ["ts", "f0", "f1", "f2", "d0", "d1", "click"]
        assert csv_table["f1"].to_pylist() == shard["f1"].to_pylist()
        assert csv_table["click"].to_pylist() == [int(c) for c in shard["click"].to_pylist()]
    ts = [t for table in raw for t in table["ts"].to_pylist()]
    assert ts == sorted(set(ts)) and len(ts) == 64
    # Written once per data directory: a second call finds them.
    written = {path: path.stat().st_mtime_ns for path in events.glob("*.csv")}
    assert bench.write_raw_logs(data_dir, tmp_path / "raw") == events
    assert {path: path.stat().st_mtime_ns for path in events.glob("*.csv")} == written


@pytest.mark.slow
def test_quick_via_cli_trains_through_recforge_run(tmp_path: Path) -> None:
    cell = "1m_2ranks"
    figures = run_quick(
        tmp_path, "--via-cli", "--table-precision", "fp16", "--recforge-only", "--cells", cell
    )
    assert figures["recforge_entry"] == "recforge run (configs/demo.yaml)"
    assert figures["table_precision"] == "fp16"
    assert figures[f"vs_torchrec_{cell}"] is None
    recforge = figures["cells"][cell]["recforge"]
    # A fresh root: every stage ran, train from the run record's own output.
    assert {stage: info["status"] for stage, info in recforge["stages"].items()} == dict.fromkeys(
        ("ingest", "preprocess", "shard", "train", "evaluate", "export"), "ran"
    )
    assert recforge["samples_per_s"] > 0 and recforge["summary_samples_per_s"] > 0
    assert len(recforge["peak_rss_mb"]) == 2 and min(recforge["peak_rss_mb"]) > 0
    assert recforge["table_precision"] == "fp16" and recforge["time_to_first_step_s"] is None
    assert 0 < recforge["metrics"]["auc"] < 1
    record = json.loads(Path(recforge["run_record"]).read_text())
    assert record["status"] == "completed"
    assert record["stages"]["train"]["table_precision"] == "fp16"
    # The shipped ZeRO stage, or what its planner picked.
    shipped_stage = load_config(load_bench().SHIPPED_CTR_CONFIG).train.zero_stage
    assert recforge["zero_stage"] == shipped_stage or (
        shipped_stage == "auto" and recforge["zero_stage"] in (0, 1, 2, 3)
    )


def test_torchrec_wire_bytes_from_the_tensors_each_collective_sends() -> None:
    bench = load_bench()
    # B = 2 samples per rank, rank 0 owns 3 of the F = 4 tables, rank 1 owns 1; D = 4.
    wire = bench.torchrec_wire_bytes(2, [3, 1], 4, dense_params=10)
    samples = 2 * 2
    # ids: rank 0 sends its 2 samples' 1 foreign id, rank 1 their 3: (2 + 6) x (8 + 4) B.
    assert wire["ids"] == (2 * 1 + 2 * 3) * 12 / samples
    # rows: rank 0's 3 pooled vectors for rank 1's 2 samples, rank 1's 1 for rank 0's.
    assert wire["rows"] == (3 * 2 + 1 * 2) * 4 * 4 / samples
    # row_grads: the gradients of the vectors each rank received go back to their owner.
    assert wire["row_grads"] == (2 * 1 + 2 * 3) * 4 * 4 / samples
    # dense: a ring all-reduce sends 2 (W - 1) / W of the 40 gradient bytes per rank.
    assert wire["dense_allreduce"] == 2 * (2 * 1 / 2 * 10 * 4) / samples
    assert wire["total"] == 24 + 32 + 32 + 20
    # QComms fp16: the pooled values and gradients at 2 bytes, the rest unchanged.
    fp16 = bench.torchrec_wire_bytes(2, [3, 1], 4, dense_params=10, value_bytes=2)
    assert (fp16["rows"], fp16["row_grads"], fp16["ids"]) == (16, 16, 24)
    assert fp16["total"] == 24 + 16 + 16 + 20
    # One process sends nothing.
    assert set(bench.torchrec_wire_bytes(2, [4], 4, 10).values()) == {0}


def test_link_utilisation_and_wire_totals() -> None:
    bench = load_bench()
    run = {"samples_per_s": 1000, "wire_bytes_per_sample": {"total": 125.0, "ids": 125.0}}
    # 125 B x 1,000 samples/s x 8 = 1 Mbit/s: a 1 Mbit/s link full, a 4 Mbit/s one a quarter.
    assert bench.link_utilisation(run, 1_000_000) == 1.0
    assert bench.link_utilisation(run, 4_000_000) == 0.25
    assert bench.link_utilisation(run, None) is None
    # A tree whose train stage does not count the bytes yet: null, never 0.
    uncounted = {"samples_per_s": 1000, "wire_bytes_per_sample": None}
    assert bench.link_utilisation(uncounted, 1_000_000) is None
    assert bench.wire_total({"wire_bytes_per_sample": None}) is None
    assert bench.wire_total(None) is None
    assert bench.wire_total(run) == 125.0


def test_embedding_dim_and_comm_precision_reach_both_engines(tmp_path: Path) -> None:
    bench = load_bench()
    args = argparse.Namespace(
        cells="1m_2ranks",
        batch_size=4,
        features=2,
        small_rows=100,
        large_rows=200,
        wide_features=3,
        wide_rows_per_table=10,
        wide_batch_size=2,
        workdir=tmp_path,
        embedding_dim=8,
    )
    (cell,) = bench.build_cells(args, 2)
    assert cell.embedding_dim == 8
    overrides = bench.cli_train_overrides(cell, 10, 5, "fp32", None, "bf16")
    # The bottom MLP's output is one more vector of the dot interaction: D wide.
    assert (overrides["embedding_dim"], overrides["bottom_mlp"]) == (8, [32, 8])
    assert overrides["comm_precision"] == "bf16"
    # Not asked for: the shipped config's (or TrainConfig's) default stands.
    assert "comm_precision" not in bench.cli_train_overrides(cell, 10, 5, "fp32", None)
    spec = bench.torchrec_spec(cell, 10, 5, 5, 1, "fp32", tmp_path / "out", True)
    assert (spec["embedding_dim"], spec["qcomms"], spec["batch_size"]) == (8, True, 4)
    # Without the flag the bench's model is the one it has always measured.
    assert bench.Cell("c", (1,), 1, 1, tmp_path).embedding_dim == 16


def test_rank_error_names_the_rank_that_failed_first(tmp_path: Path) -> None:
    bench = load_bench()
    (tmp_path / "rank-0.error").write_text("RuntimeError: Connection closed by peer\n")
    (tmp_path / "rank-1.error").write_text("NotImplementedError: fp16 all-to-all on gloo\n")
    error = bench.RankFailedError("TorchRec rank 1 exited with 1 (log x):\ntail", 1)
    assert bench.rank_error(tmp_path, error) == "NotImplementedError: fp16 all-to-all on gloo"
    # A rank killed before it wrote one: the parent's own first line.
    empty = tmp_path / "empty"
    empty.mkdir()
    assert bench.rank_error(empty, error) == "TorchRec rank 1 exited with 1 (log x):"


def test_link_refuses_a_bad_rate_and_no_root_in_process(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    bench = load_bench()
    monkeypatch.delenv(bench.shaped_link.LINK_ENV, raising=False)
    argv = ["vs_torchrec.py", "--workdir", str(tmp_path), "--recforge-only", "--link"]
    monkeypatch.setattr(sys, "argv", [*argv, "fast"])
    with pytest.raises(SystemExit) as exited:
        bench.main()
    assert exited.value.code == 2
    assert "--link: link rate 'fast'" in capsys.readouterr().err

    monkeypatch.setattr(bench.shaped_link.os, "geteuid", lambda: 1000)

    def no_exec(*args: object) -> None:
        raise AssertionError(f"--link executed {args} without root")

    monkeypatch.setattr(bench.shaped_link.os, "execvpe", no_exec)
    monkeypatch.setattr(sys, "argv", [*argv, "1gbit"])
    with pytest.raises(SystemExit) as exited:
        bench.main()
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "--link needs root to make a network namespace" in err and "or drop --link" in err
    # Refused before anything ran: no data written.
    assert list(tmp_path.iterdir()) == []


def test_link_refuses_a_non_root_user(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        prefix: list[str] = []
    elif shutil.which("setpriv") is not None:
        prefix = NOBODY
    else:
        pytest.skip("root without setpriv (util-linux): no way to run as another user here")
    # A folder nobody can write: the bench must refuse before it would write its data.
    workdir = tmp_path / "work"
    env = {k: v for k, v in os.environ.items() if k != "RECFORGE_SHAPED_LINK"}
    result = subprocess.run(
        [*prefix, sys.executable, str(BENCH), "--link", "1gbit", "--recforge-only"]
        + ["--quick", "--cells", "1m_2ranks", "--workdir", str(workdir)],
        capture_output=True,
        text=True,
        cwd="/",
        env=env,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert "--link needs root to make a network namespace (unshare -n)" in result.stderr
    assert not workdir.exists()
