"""bench/checkpoint.py: its figures from fake checkpoints and summaries, its arguments,
and the skewed ids of bench/vs_torchrec.py's `write_shard_dir` it trains on.

Fast: no training. The checkpoint directories and `train_summary.json` figures are made
up with known answers; the shard directories are tiny.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import save_file

from artifacts.checkpoints import CHAIN, MANIFEST, STAGING
from training.config import TrainConfig

REPO = Path(__file__).resolve().parents[3]
BENCH = REPO / "bench" / "checkpoint.py"
MB = 1e6


def load_bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_checkpoint", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_bench()


@pytest.fixture(scope="module")
def shards(bench: ModuleType) -> ModuleType:
    """bench/vs_torchrec.py, as bench/checkpoint.py imports it."""
    return sys.modules[bench.write_shard_dir.__module__]


# -- skewed ids (bench/vs_torchrec.py's write_shard_dir) ----------------------------------

# sha256 of the f* and d* columns of write_shard_dir(root, [50, 1000, 7], 4000) as it
# wrote them before zipf_exponent existed (the click column is left out: it goes through
# np.sin, whose last bit may differ between CPUs).
UNIFORM_DIGEST = "41528743f716119e3937616986b0f7c1d2b01c0fa7a25ab8e45686d237eec094"


def column_digest(root: Path, skip: tuple[str, ...] = ("click",)) -> str:
    digest = hashlib.sha256()
    for path in sorted(root.glob("*.parquet")):
        table = pq.read_table(path)
        for name in table.column_names:
            if name not in skip:
                digest.update(name.encode())
                digest.update(np.ascontiguousarray(table[name].to_numpy()).tobytes())
    return digest.hexdigest()


def read_ids(root: Path, feature: int) -> np.ndarray:
    return np.concatenate(
        [
            pq.read_table(p, columns=[f"f{feature}"])[0].to_numpy()
            for p in sorted(root.glob("*.parquet"))
        ]
    )


def test_zipf_exponent_zero_writes_the_uniform_directory_as_before(
    shards: ModuleType, tmp_path: Path
) -> None:
    default = shards.write_shard_dir(tmp_path / "default", [50, 1000, 7], 4000)
    zero = shards.write_shard_dir(tmp_path / "zero", [50, 1000, 7], 4000, zipf_exponent=0.0)
    assert column_digest(default) == UNIFORM_DIGEST
    assert column_digest(zero, skip=()) == column_digest(default, skip=())
    dataset = json.loads((zero / "dataset.json").read_text())
    assert (zero / "dataset.json").read_bytes() == (default / "dataset.json").read_bytes()
    assert "zipf_exponent" not in dataset and dataset["splits"]["train"]["rows"] == 4000


def test_zipf_ids_stay_in_their_tables_and_a_few_ids_take_most_draws(
    shards: ModuleType, tmp_path: Path
) -> None:
    sizes = [5000, 20000]
    root = shards.write_shard_dir(tmp_path / "zipf", sizes, 40000, zipf_exponent=1.1)
    assert json.loads((root / "dataset.json").read_text())["zipf_exponent"] == 1.1
    for feature, size in enumerate(sizes):
        ids = read_ids(root, feature)
        assert ids.dtype == np.int64 and len(ids) == 40000
        assert ids.min() >= 0 and ids.max() < size
        counts = np.bincount(ids, minlength=size)
        hottest = np.argsort(counts)[::-1]
        # Bounded Zipf 1.1: the top 1% of ranks hold ~2/3 of the weight (uniform: 1%).
        top = counts[hottest[: size // 100]].sum() / len(ids)
        assert top > 0.5, top
        # Rank 0 alone: 1 / H(n), ~15% at these sizes.
        assert 0.1 < counts[hottest[0]] / len(ids) < 0.25
        # Spread over the table by the permutation, not packed at its start.
        assert hottest[:20].max() > size // 4
    uniform = shards.write_shard_dir(tmp_path / "uniform", sizes, 40000)
    counts = np.bincount(read_ids(uniform, 1), minlength=20000)
    assert np.sort(counts)[::-1][:200].sum() / 40000 < 0.05


def test_zipf_inverse_cdf_at_the_boundaries(shards: ModuleType) -> None:
    # Exponent 1 over 4 rows: weights 1, 1/2, 1/3, 1/4, i.e. 12, 6, 4, 3 of 25.
    cdfs, perms = shards.zipf_tables([4], 1.0)
    np.testing.assert_allclose(cdfs[4], [12 / 25, 18 / 25, 22 / 25, 1.0])
    assert cdfs[4][-1] == 1.0 and cdfs[4].dtype == np.float64
    assert sorted(perms[0].tolist()) == [0, 1, 2, 3]
    below = np.nextafter(cdfs[4][0], 0.0)
    uniform = np.array([[0.0], [below], [cdfs[4][0]], [0.75], [np.nextafter(1.0, 0.0)]])
    ids = shards.zipf_ids(uniform, [4], cdfs, perms)
    assert ids.dtype == np.int64
    assert ids[:, 0].tolist() == [perms[0][r] for r in (0, 0, 1, 2, 3)]


def test_zipf_tables_share_a_cdf_per_size_and_permute_each_table_its_own_way(
    shards: ModuleType,
) -> None:
    cdfs, perms = shards.zipf_tables([1000, 1000, 10], 1.1)
    assert sorted(cdfs) == [10, 1000]
    assert not np.array_equal(perms[0], perms[1])
    assert perms[0].dtype == np.int32
    again = shards.zipf_tables([1000, 1000, 10], 1.1)[1]
    assert all(np.array_equal(a, b) for a, b in zip(perms, again, strict=True))


def test_the_cache_is_keyed_by_the_exponent(shards: ModuleType, tmp_path: Path) -> None:
    root = tmp_path / "d"
    shards.write_shard_dir(root, [100, 100], 400, zipf_exponent=1.1)
    (root / "marker").touch()
    shards.write_shard_dir(root, [100, 100], 400, zipf_exponent=1.1)
    assert (root / "marker").exists()  # kept
    shards.write_shard_dir(root, [100, 100], 400, zipf_exponent=1.2)
    assert not (root / "marker").exists()  # rewritten
    assert json.loads((root / "dataset.json").read_text())["zipf_exponent"] == 1.2
    (root / "marker").touch()
    shards.write_shard_dir(root, [100, 100], 400)
    assert not (root / "marker").exists()
    assert "zipf_exponent" not in json.loads((root / "dataset.json").read_text())
    (root / "marker").touch()
    shards.write_shard_dir(root, [100, 100], 400, zipf_exponent=0.0)
    assert (root / "marker").exists()  # 0 is the uniform directory
    with pytest.raises(ValueError, match="zipf_exponent=-1"):
        shards.write_shard_dir(root, [100, 100], 400, zipf_exponent=-1.0)


# -- the bench's figures --------------------------------------------------------------------


def write_checkpoint(
    root: Path, step: int, sizes: dict[str, int], meta: dict[str, Any] | None = None
) -> int:
    """A committed checkpoint directory of files of `sizes` bytes; its bytes in all."""
    path = root / f"step-{step:08d}"
    for name, size in sizes.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_bytes(b"x" * size)
    (path / MANIFEST).write_text(json.dumps({"meta": {"step": step, **(meta or {})}}))
    return sum(sizes.values()) + (path / MANIFEST).stat().st_size


def test_list_checkpoints_counts_committed_ones_and_tells_deltas_by_their_chain(
    bench: ModuleType, tmp_path: Path
) -> None:
    root = tmp_path / "root"
    base = write_checkpoint(root, 10, {"dense/model_states.pt": 300, "sparse-rank-0.st": 5000})
    chain = {CHAIN: [{"step": 10, "files_sha256": "0" * 64}], "delta_rows": 42}
    delta = write_checkpoint(root, 20, {"dense/model_states.pt": 300, "d.st": 700}, chain)
    (root / "step-00000030").mkdir()  # no manifest: not committed
    (root / STAGING / "step-00000040").mkdir(parents=True)
    (root / STAGING / "step-00000040" / "d.st").write_bytes(b"x" * 9)
    (root / "latest").write_text("step-00000020")
    assert bench.list_checkpoints(root) == [
        {"step": 10, "kind": "full", "bytes": base},
        {"step": 20, "kind": "delta", "delta_rows": 42, "bytes": delta},
    ]


def fake_phase(bench: ModuleType, full: list[int], delta: list[int], summary: dict) -> dict:
    checkpoints = [{"step": i, "kind": "full", "bytes": b} for i, b in enumerate(full)]
    checkpoints += [{"step": 100 + i, "kind": "delta", "bytes": b} for i, b in enumerate(delta)]
    return bench.phase_figures(checkpoints, summary)


def summary(seconds: float, samples_per_s: float, resume_checkpoints: dict | None) -> dict:
    return {
        "steps": 900,
        "seconds": seconds,
        "samples_per_s": samples_per_s,
        "final_loss": 0.123456,
        **({"resume_checkpoints": resume_checkpoints} if resume_checkpoints else {}),
    }


def stalls(count: int, stall_s_max: float) -> dict[str, float]:
    return {"count": count, "stall_s_max": stall_s_max, "stall_s_total": count * stall_s_max}


def test_phase_figures_and_the_headline_ratios(bench: ModuleType) -> None:
    sync = fake_phase(
        bench, [1_000_000_000] * 3, [], summary(120.0, 40_000.0, {"base": stalls(3, 2.0)})
    )
    assert sync["count"] == {"full": 3, "delta": 0}
    assert sync["mean_full_bytes"] == 1e9 and sync["mean_delta_bytes"] is None
    # 3 GB over 2 minutes.
    assert sync["checkpoint_mb_per_min"] == 1500.0
    assert (sync["train_s"], sync["samples_per_s"], sync["final_loss"]) == (120.0, 40000, 0.1235)
    resume = {
        "base": stalls(1, 2.2),
        "delta": stalls(4, 0.1),
        "waited_for_previous": 0,
        "wait_s": 0.0,
        "background_write_s_max": 3.456,
    }
    delta = fake_phase(bench, [1_000_000_000], [150_000_000] * 4, summary(100.0, 44_000.0, resume))
    # 1 GB + 4 x 150 MB over 100 s.
    assert delta["checkpoint_mb_per_min"] == 960.0
    assert delta["mean_delta_bytes"] == 1.5e8

    figures = bench.summarize({"sync_full": sync, "async_delta": delta}, 30.0, None)
    assert figures["delta_bytes_ratio"] == 0.15  # 150 MB / 1 GB
    assert figures["stall_ratio"] == 0.05  # 0.1 s / 2.0 s (the base's of sync_full)
    assert figures["checkpoint_mb_per_min_sync_full"] == 1500.0
    assert figures["checkpoint_mb_per_min_async_delta"] == 960.0
    assert figures["work_lost_on_sigkill_s"] == 33.46  # 30 s + 3.456 s of background write
    assert figures["work_lost_on_sigkill_s_sync_full"] == 30.0
    assert (figures["samples_per_s_sync_full"], figures["samples_per_s_async_delta"]) == (
        40000,
        44000,
    )
    assert figures["speed_ratio_async_vs_sync"] == 1.1
    assert figures["resume_bitwise"] is None and figures["kill_resumed_from_step"] is None

    kill = {"resume_bitwise": True, "resumed_from_step": 80}
    figures = bench.summarize({"sync_full": sync, "async_delta": delta}, 30.0, kill)
    assert figures["resume_bitwise"] is True and figures["kill_resumed_from_step"] == 80


def test_a_run_without_chains_stalls_as_whole_and_no_delta_gives_no_ratio(
    bench: ModuleType,
) -> None:
    sync = fake_phase(bench, [1000] * 2, [], summary(60.0, 10.0, {"whole": stalls(2, 4.0)}))
    assert bench.full_stall(sync["resume_checkpoints"]) == 4.0
    rebased = fake_phase(
        bench,
        [1000] * 2,
        [],
        summary(60.0, 10.0, {"base": stalls(2, 0.5), "background_write_s_max": 0.0}),
    )
    figures = bench.summarize({"sync_full": sync, "async_delta": rebased}, 5.0, None)
    assert figures["delta_bytes_ratio"] is None and figures["stall_ratio"] is None
    assert figures["work_lost_on_sigkill_s"] == 5.0
    assert any("no delta checkpoint" in n for n in bench.notes({"async_delta": rebased}, None))
    no_checkpoints = fake_phase(bench, [], [], summary(60.0, 10.0, None))
    assert bench.full_stall(no_checkpoints["resume_checkpoints"]) is None
    assert no_checkpoints["checkpoint_bytes"] == 0 and no_checkpoints["count"]["full"] == 0


def test_notes_say_when_the_kill_missed_the_background_writer(bench: ModuleType) -> None:
    delta = {"count": {"full": 1, "delta": 3}}
    kill = {"fault_landed_in": "delta", "resumed_from_step": 80, "expected_resume_step": 80}
    assert bench.notes({"async_delta": delta}, kill) == []
    kill |= {"fault_landed_in": "base", "resumed_from_step": 60}
    found = bench.notes({"async_delta": delta}, kill)
    assert len(found) == 2 and "landed in a base" in found[0] and "from step 60" in found[1]


def test_steps_per_s_leaves_out_the_first_window(bench: ModuleType) -> None:
    records = [{"samples_per_s": 100.0}] + [{"samples_per_s": v} for v in (4096.0, 8192.0, 4096.0)]
    assert bench.steps_per_s(records, 4096) == 1.0
    assert bench.steps_per_s(records[:1], 4096) == 100.0 / 4096
    assert bench.phase_steps(0.5, 1.0) == 30
    assert bench.phase_steps(0.5, 1.01) == math.ceil(30 * 1.01)
    assert bench.phase_steps(0.01, 1.0) == 2 * bench.LOG_EVERY


def test_same_weights_compares_bits(bench: ModuleType, tmp_path: Path) -> None:
    tensors = {"table": torch.randn(5, 3), "bias": torch.tensor([float("nan"), 0.0])}
    save_file(tensors, str(tmp_path / "a.safetensors"))
    save_file({k: v.clone() for k, v in tensors.items()}, str(tmp_path / "b.safetensors"))
    assert bench.same_weights(tmp_path / "a.safetensors", tmp_path / "b.safetensors")
    flipped = tensors["table"].clone()
    flipped.view(torch.int32)[2, 1] ^= 1
    save_file({**tensors, "table": flipped}, str(tmp_path / "c.safetensors"))
    assert not bench.same_weights(tmp_path / "a.safetensors", tmp_path / "c.safetensors")
    signed_zero = {**tensors, "bias": torch.tensor([float("nan"), -0.0])}
    save_file(signed_zero, str(tmp_path / "d.safetensors"))
    assert not bench.same_weights(tmp_path / "a.safetensors", tmp_path / "d.safetensors")
    save_file({"table": tensors["table"]}, str(tmp_path / "e.safetensors"))
    assert not bench.same_weights(tmp_path / "a.safetensors", tmp_path / "e.safetensors")
    save_file({**tensors, "table": tensors["table"].double()}, str(tmp_path / "f.safetensors"))
    assert not bench.same_weights(tmp_path / "a.safetensors", tmp_path / "f.safetensors")


def test_fault_landed_in_reads_the_staging_directory(bench: ModuleType, tmp_path: Path) -> None:
    staging = tmp_path / STAGING / "step-00000100"
    assert bench.fault_landed_in(tmp_path, 100) is None  # died before the save
    staging.mkdir(parents=True)
    (staging / bench.sparse_file(0, 2)).touch()
    assert bench.fault_landed_in(tmp_path, 100) == "base"
    (staging / bench.sparse_delta_file(0, 2)).touch()
    assert bench.fault_landed_in(tmp_path, 100) == "delta"
    (staging / MANIFEST).touch()
    assert bench.fault_landed_in(tmp_path, 100) is None  # got as far as its commit


# -- configs and arguments ------------------------------------------------------------------


def test_the_phases_and_the_kill_test_are_valid_train_configs(bench: ModuleType) -> None:
    defaults = TrainConfig.model_fields
    sync = bench.bench_config(2048, 0, **bench.phase_update("sync_full", 30.0, 900))
    assert (sync.checkpoint_max_deltas, sync.checkpoint_async) == (0, False)
    assert (sync.checkpoint_every, sync.checkpoint_every_s, sync.keep_checkpoints) == (0, 30.0, 900)
    assert (sync.world_size, sync.zero_stage, sync.embeddings) == (2, 0, "sharded")
    assert (sync.embedding_dim, sync.batch_size, sync.max_steps) == (16, 2048, 900)
    delta = bench.bench_config(2048, 3, **bench.phase_update("async_delta", 30.0, 900))
    for name in ("checkpoint_max_deltas", "checkpoint_async", "checkpoint_rebase_share"):
        assert getattr(delta, name) == defaults[name].default, name
    assert delta.seed == 3 and delta.checkpoint_every_s == 30.0
    with pytest.raises(ValueError, match="phase 'other'"):
        bench.phase_update("other", 30.0, 900)
    kill = bench.bench_config(2048, 0, **bench.kill_update(20))
    assert (kill.checkpoint_every, kill.checkpoint_every_s, kill.max_steps) == (20, 0.0, 120)
    assert kill.checkpoint_rebase_share == 1000.0
    # A base at K and deltas at 2K..5K: the chain holds them all.
    assert kill.checkpoint_max_deltas >= bench.KILL_FAULT_AT - 1
    assert kill.checkpoint_async


def test_argument_defaults_and_checks(bench: ModuleType) -> None:
    args = bench.parse_args([])
    assert (args.rows, args.minutes, args.interval_s) == (20_000_000, 5.0, 30.0)
    assert (args.batch_size, args.kill_every_steps, args.seed) == (2048, 20, 0)
    assert args.steps is None and not args.skip_kill
    assert args.workdir == (REPO / ".bench" / "checkpoint").resolve()
    args = bench.parse_args(["--rows", "200000", "--minutes", "0.5", "--skip-kill"])
    assert (args.rows, args.minutes, args.skip_kill) == (200_000, 0.5, True)
    for bad in (
        ["--rows", "7"],
        ["--minutes", "0"],
        ["--interval-s", "-1"],
        ["--kill-every-steps", "0"],
        ["--steps", "0"],
        ["--samples", "100"],
    ):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_describe_phase_reads_as_one_line(bench: ModuleType) -> None:
    resume = {"base": stalls(1, 2.25), "delta": stalls(2, 0.05), "background_write_s_max": 1.5}
    phase = fake_phase(bench, [2_000_000], [500_000] * 2, summary(60.0, 1234.0, resume))
    line = bench.describe_phase("async_delta", phase)
    assert "\n" not in line
    assert line.startswith("async_delta: 1 full (2.0 MB each) + 2 delta (0.5 MB each)")
    assert "base stall max 2.25 s, delta stall max 0.05 s" in line
    assert "background write max 1.50 s" in line and "1,234 samples/s" in line
