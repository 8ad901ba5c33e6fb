"""Chaos: training runs killed mid-way resume from their newest valid checkpoint."""

import json
import os
import random
import shutil
import signal
import socket
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from artifacts.checkpoints import CHAIN, MANIFEST, CheckpointStore
from artifacts.errors import ConfigError
from training.config import TrainConfig, resume_layout
from training.ctr.train import train_model
from training.errors import Preempted, TrainingCrashed
from training.runtime.files import RANKS_FILE
from training.runtime.launcher import CHAOS_CHECKPOINT_FAULT, CHAOS_SKIP_RESTORE

pytestmark = [pytest.mark.slow, pytest.mark.chaos]

# Lazy Adam rows, AdamW with warmup and decay on ZeRO-2, dropout (the RNG matters),
# gradient clipping, fp16 rows with stochastic rounding (its bits follow the step and
# the global row), an fp16 exchange: every piece of state counts. fp32 rows resume bitwise in
# tests/flows (test_chaos, test_elastic).
CONFIG = {
    "embedding_dim": 8,
    "bottom_mlp": [16, 8],
    "top_mlp": [16],
    "dropout": 0.1,
    "batch_size": 32,
    "max_steps": 16,
    "warmup_steps": 4,
    "zero_stage": 2,
    # The rows' gradient norms are ~3e-4 (median) to ~2e-3 on these shards, the dense
    # global norm ~1e-2 to 1e-1: both clips act at every step.
    "grad_clip": 5e-4,
    "sparse_optimizer": "lazy_adam",
    "table_precision": "fp16",
    # fp16 rows and scaled fp16 gradients between the ranks: rounded to nearest, so a
    # resume reproduces them bitwise too.
    "comm_precision": "fp16",
    "world_size": 2,
    "checkpoint_every": 4,
    # Differential chains (a base, then up to 8 asynchronous deltas) however much of
    # these small tables (119 rows) 4 steps touch: by default a chain holding more than
    # half the rows is followed by a base, written in the foreground.
    "checkpoint_rebase_share": 1000.0,
    "log_every": 1,
    "tensorboard": False,
}
# Long enough that a kill at a random step lands before the run ends.
LONG = {**CONFIG, "max_steps": 32}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def env(**extra: str) -> dict[str, str]:
    return {**os.environ, "DS_ACCELERATOR": "cpu", **extra}


def signal_at(step: int, root: Path, signum: int = signal.SIGKILL):
    """A progress callback that sends `signum` to the ranks' process group at `step`.

    SIGKILL is a node dying: the launcher and every rank at once, mid-step or mid-save.
    The group is the one the launch recorded in `root` for reaping.
    """
    sent = []

    def on_progress(record: dict) -> None:
        if record["step"] >= step and not sent:
            os.killpg(json.loads((root / RANKS_FILE).read_text())["pgid"], signum)
            sent.append(record["step"])

    return on_progress


def weights(train_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(train_dir / "model.safetensors")


def assert_bitwise_equal(expected: dict, actual: dict) -> None:
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name


@pytest.fixture(scope="module")
def reference(module_shards: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """Shards and the weights of one uninterrupted run of `LONG` on them."""
    out = tmp_path_factory.mktemp("reference") / "clean"
    clean = train_model(TrainConfig(**LONG), module_shards, out, "cpu", free_port(), env())
    assert clean.resumed_from_step is None
    return module_shards, weights(out)


def test_sigkilled_at_three_random_steps_resumes_to_bitwise_the_same_weights(
    reference: tuple[Path, dict], tmp_path: Path
) -> None:
    shards_dir, expected = reference
    seed = int(os.environ.get("RECFORGE_CHAOS_SEED", random.SystemRandom().randrange(2**31)))
    # From step 6 on, the checkpoint of step 4 is committed: every run leaves one.
    points = sorted(random.Random(seed).sample(range(6, 25), 3))
    print(f"kill points {points} (RECFORGE_CHAOS_SEED={seed} repeats them)")
    root = tmp_path / "resume"
    config = TrainConfig(**LONG)
    for attempt, step in enumerate(points):
        with pytest.raises(TrainingCrashed, match="exited with code"):
            train_model(
                config, shards_dir, tmp_path / f"killed{attempt}", "cpu", free_port(), env(),
                on_progress=signal_at(step, root), checkpoint_root=root,
            )  # fmt: skip
    committed = sorted(p.name for p in root.glob("step-*"))
    assert committed and all((root / name / MANIFEST).is_file() for name in committed)
    resumed = train_model(
        config, shards_dir, tmp_path / "resumed", "cpu", free_port(), env(), checkpoint_root=root
    )
    assert resumed.resumed_from_step is not None and resumed.resumed_from_step >= 4
    assert_bitwise_equal(expected, weights(tmp_path / "resumed"))
    summary = json.loads((tmp_path / "resumed" / "train_summary.json").read_text())
    assert summary["steps"] == 32 and summary["resumed_from_step"] == resumed.resumed_from_step


@pytest.mark.parametrize("skipped", ["rng", "reader"])
def test_negative_control_without_a_restore_the_weights_differ(
    reference: tuple[Path, dict], tmp_path: Path, skipped: str
) -> None:
    """The bitwise test above would catch a resume that forgot RNG states or position."""
    shards_dir, expected = reference
    root = tmp_path / "resume"
    config = TrainConfig(**LONG)
    with pytest.raises(TrainingCrashed):
        train_model(
            config, shards_dir, tmp_path / "killed", "cpu", free_port(), env(),
            on_progress=signal_at(10, root), checkpoint_root=root,
        )  # fmt: skip
    resumed = train_model(
        config, shards_dir, tmp_path / "resumed", "cpu", free_port(),
        env(**{CHAOS_SKIP_RESTORE: skipped}), checkpoint_root=root,
    )  # fmt: skip
    assert resumed.resumed_from_step is not None
    actual = weights(tmp_path / "resumed")
    assert any(not torch.equal(expected[name], actual[name]) for name in expected)


def test_sigterm_saves_a_checkpoint_at_the_next_step_and_the_retry_resumes(
    reference: tuple[Path, dict], tmp_path: Path
) -> None:
    shards_dir, expected = reference
    root = tmp_path / "resume"
    # No periodic checkpoint would land before the end: the one found is SIGTERM's.
    config = TrainConfig(**{**LONG, "checkpoint_every": 1000})
    with pytest.raises(Preempted, match="stopped by SIGTERM after step") as error:
        train_model(
            config, shards_dir, tmp_path / "preempted", "cpu", free_port(), env(),
            on_progress=signal_at(6, root, signal.SIGTERM), checkpoint_root=root,
        )  # fmt: skip
    assert isinstance(error.value, TrainingCrashed)  # retried by the train task
    (checkpoint,) = root.glob("step-*")
    step = int(checkpoint.name.removeprefix("step-"))
    assert 6 <= step < 32 and f"after step {step}" in str(error.value)
    resumed = train_model(
        config, shards_dir, tmp_path / "resumed", "cpu", free_port(), env(), checkpoint_root=root
    )
    assert resumed.resumed_from_step == step
    assert_bitwise_equal(expected, weights(tmp_path / "resumed"))


def test_a_bf16_exchange_resumes_to_bitwise_the_same_weights(
    module_shards: Path, tmp_path: Path
) -> None:
    """The other half-precision exchange (CONFIG's is fp16), on fp32 rows at ZeRO 0."""
    config = TrainConfig(
        **{**CONFIG, "comm_precision": "bf16", "table_precision": "fp32", "zero_stage": 0}
    )
    clean = train_model(config, module_shards, tmp_path / "clean", "cpu", free_port(), env())
    summary = json.loads((tmp_path / "clean" / "train_summary.json").read_text())
    assert (clean.comm_precision, summary["comm_precision"]) == ("bf16", "bf16")
    wire = summary["wire_bytes_per_sample"]
    assert min(wire[k] for k in ("ids", "rows", "row_grads", "dense_allreduce")) > 0
    assert wire["total"] == pytest.approx(sum(v for k, v in wire.items() if k != "total"))
    assert clean.wire_bytes_per_sample == wire
    root = tmp_path / "resume"
    with pytest.raises(Preempted):
        train_model(
            config, module_shards, tmp_path / "preempted", "cpu", free_port(), env(),
            on_progress=signal_at(6, root, signal.SIGTERM), checkpoint_root=root,
        )  # fmt: skip
    resumed = train_model(
        config, module_shards, tmp_path / "resumed", "cpu", free_port(), env(),
        checkpoint_root=root,
    )  # fmt: skip
    assert resumed.resumed_from_step is not None
    assert_bitwise_equal(weights(tmp_path / "clean"), weights(tmp_path / "resumed"))


def test_a_crash_at_each_point_of_a_save_resumes_from_the_last_committed_checkpoint(
    reference: tuple[Path, dict], tmp_path: Path
) -> None:
    """Each run dies saving step 8 at another point; the next one resumes and goes on."""
    shards_dir, expected = reference
    root = tmp_path / "resume"
    config = TrainConfig(**LONG)
    # Until the rename, step 8 is not committed: the resume is from step 4. From
    # "before-pointer" on it is (the pointer is only a hint), and the run goes on from 8.
    crashes = [("mid-file", 4), ("after-files", 4), ("mid-manifest", 4),
               ("before-rename", 4), ("before-pointer", 8)]  # fmt: skip
    resumed_from: list[int | None] = []
    for attempt, (point, _) in enumerate(crashes):
        lines: list[str] = []
        with pytest.raises(TrainingCrashed, match="exited with code"):
            train_model(
                config, shards_dir, tmp_path / f"crashed{attempt}", "cpu", free_port(),
                env(**{CHAOS_CHECKPOINT_FAULT: f"{point}@8"}), on_log=lines.append,
                checkpoint_root=root,
            )  # fmt: skip
        resumes = [json.loads(line.split("RECFORGE_RESUME ", 1)[1]) for line in lines
                   if "RECFORGE_RESUME " in line]  # fmt: skip
        resumed_from.append(resumes[0]["step"] if resumes else None)
        assert CheckpointStore(root).latest_valid(strict=True).step == (
            8 if point == "before-pointer" else 4
        ), point
    # The first run started fresh; each later one resumed from what the crash before left.
    assert resumed_from == [None, 4, 4, 4, 4]
    resumed = train_model(
        config, shards_dir, tmp_path / "resumed", "cpu", free_port(), env(), checkpoint_root=root
    )
    assert resumed.resumed_from_step == 8
    assert_bitwise_equal(expected, weights(tmp_path / "resumed"))


def kill_at(step: int, root: Path):
    return signal_at(step, root)


def test_timed_checkpoints_alone_save_mid_run_and_a_default_run_resumes_from_one(
    reference: tuple[Path, dict], tmp_path: Path
) -> None:
    """checkpoint_every_s with no step trigger; then the defaults resume, saving no more."""
    shards_dir, expected = reference
    root = tmp_path / "resume"
    # Neither trigger is part of the fingerprint: both runs resume what the other wrote.
    # 0.1 ms: due at every step, however fast (fp16 steps with the compiled row update
    # can take under 10 ms here, and 0.01 s then skipped step 6 in one run).
    # Whole checkpoints (no deltas), so that retention keeps two and no chain.
    timed = TrainConfig(
        **{**LONG, "checkpoint_every": 0, "checkpoint_every_s": 0.0001, "checkpoint_max_deltas": 0}
    )
    with pytest.raises(TrainingCrashed, match="exited with code"):
        train_model(
            timed, shards_dir, tmp_path / "killed", "cpu", free_port(), env(),
            on_progress=kill_at(6, root), checkpoint_root=root,
        )  # fmt: skip
    committed = sorted(p.name for p in root.glob("step-*"))
    newest = CheckpointStore(root).latest_valid(strict=True)
    # Step 6's was committed before its progress record; keep_checkpoints=2 kept two of
    # the timer's saves (so it fired again after a save).
    assert len(committed) == 2 and newest is not None and newest.step >= 6
    defaults = TrainConfig(**{**LONG, "checkpoint_every": 0})
    assert defaults.checkpoint_every_s == TrainConfig().checkpoint_every_s > 60
    resumed = train_model(
        defaults, shards_dir, tmp_path / "resumed", "cpu", free_port(), env(),
        checkpoint_root=root,
    )  # fmt: skip
    assert resumed.resumed_from_step == newest.step
    assert_bitwise_equal(expected, weights(tmp_path / "resumed"))
    # A run this short saves no resume checkpoint by default; the final one is where it was.
    assert sorted(p.name for p in root.glob("step-*")) == committed
    assert (tmp_path / "resumed" / "checkpoints" / "final").is_dir()


def test_a_corrupt_newest_checkpoint_falls_back_and_another_config_is_refused(
    shards_dir: Path, tmp_path: Path
):
    config = TrainConfig(**{**CONFIG, "max_steps": 12})
    root = tmp_path / "resume"
    with pytest.raises(TrainingCrashed):
        train_model(
            config,
            shards_dir,
            tmp_path / "killed",
            "cpu",
            free_port(),
            env(),
            on_progress=kill_at(10, root),
            checkpoint_root=root,
        )
    newest = CheckpointStore(root).latest_valid()
    assert newest is not None and newest.step == 8
    # Flip one byte of the newest checkpoint's embedding shard (a delta on step 4's
    # base): it must not be used, and the log names it.
    assert newest.chain == (root / "step-00000004",)
    victim = newest.path / "sparse-delta-rank-00000-of-00002.safetensors"
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    lines: list[str] = []
    resumed = train_model(
        config,
        shards_dir,
        tmp_path / "resumed",
        "cpu",
        free_port(),
        env(),
        on_log=lines.append,
        checkpoint_root=root,
    )
    assert resumed.resumed_from_step == 4
    assert any("step-00000008" in line and f"sha256 of {victim.name}" in line for line in lines)

    # A finished run leaves its checkpoints; another learning rate must not resume them.
    with pytest.raises(ConfigError, match="another train config"):
        train_model(
            TrainConfig(**{**CONFIG, "max_steps": 12, "lr": 0.05}),
            shards_dir,
            tmp_path / "other",
            "cpu",
            free_port(),
            env(),
            checkpoint_root=root,
        )


# 2 -> 1 ranks under ZeRO-2 and ZeRO-3 with grad_accum_steps 2 go through `recforge run`
# in tests/flows/test_elastic.py; here the other directions, and 2 -> 1 with one micro
# batch of twice the rows.
# Each at one table precision: the rows move between shards in their stored form.
@pytest.mark.parametrize(
    ("before", "after", "zero_stage", "precision"),
    [(2, 1, 2, "fp16"), (1, 2, 0, "int8"), (1, 2, 3, "bf16")],
    ids=[
        "2-to-1-ranks-zero2-universal-fp16",
        "1-to-2-ranks-zero0-int8",
        "1-to-2-ranks-zero3-universal-bf16",
    ],
)
def test_a_checkpoint_resumes_on_another_world_size(
    make_shards, tmp_path: Path, before: int, after: int, zero_stage: int, precision: str
):
    shards_dir = make_shards(rows_per_file=1024)
    # Fixed data streams and global batch: every world size sees the same batches. No
    # dropout: its masks are drawn per rank, so they depend on the world size.
    common = {
        **CONFIG,
        # Only an exchange rounds: another world size would round other values.
        "comm_precision": "fp32",
        "dropout": 0.0,
        "max_steps": 28,
        "checkpoint_every": 8,
        "keep_checkpoints": 3,
        # Step 8's checkpoint is a base, 16's and 24's deltas on it, whatever they hold.
        "checkpoint_rebase_share": 1.0,
        "log_every": 1,
        "data_streams": 2,
        "zero_stage": zero_stage,
        "table_precision": precision,
    }

    def config(world_size: int) -> TrainConfig:
        return TrainConfig(**{**common, "world_size": world_size, "batch_size": 64 // world_size})

    reference: list[dict] = []
    root = tmp_path / "resume"
    train_model(
        config(before), shards_dir, tmp_path / "ref", "cpu", free_port(), env(),
        on_progress=reference.append, checkpoint_root=root,
    )  # fmt: skip
    # As if the run had died after committing step 16 (the checkpoint of step 24 did not
    # happen), which the uninterrupted run's losses go on from. Step 16 is a delta: the
    # new world size reads step 8's shards, then 16's changed rows, keyed by global row.
    shutil.rmtree(root / "step-00000024")
    meta = json.loads((root / "step-00000016" / MANIFEST).read_text())["meta"]
    assert [member["step"] for member in meta[CHAIN]] == [8] and meta["delta_rows"] > 0
    assert list((root / "step-00000016").glob("sparse-delta-rank-*"))
    assert resume_layout(config(after), meta) == config(after)
    continued: list[dict] = []
    resumed = train_model(
        config(after), shards_dir, tmp_path / "resumed", "cpu", free_port(), env(),
        on_progress=continued.append, checkpoint_root=root,
    )  # fmt: skip
    assert resumed.resumed_from_step == 16
    assert (resumed.resumed_from_world_size, resumed.world_size) == (before, after)
    assert [r["step"] for r in continued] == list(range(17, 29))  # the next 12 steps
    expected = {r["step"]: r["loss"] for r in reference}
    for record in continued:
        assert record["loss"] == pytest.approx(expected[record["step"]], rel=1e-5), record
    if zero_stage:
        assert (root / "universal" / "step-00000016" / "dense").is_dir()
