import json
import math
import mmap
import os
import socket
import stat
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from safetensors.torch import load_file

from artifacts.errors import ConfigError, InputNotFoundError
from training.config import EvaluateConfig, ExportConfig, TrainConfig
from training.ctr.data import load_dataset_meta
from training.ctr.embedding import init_rows
from training.ctr.evaluate import evaluate_model
from training.ctr.export import export_model
from training.ctr.model import build_model
from training.ctr.train import plan_total_steps, train_model
from training.errors import TrainingCrashed
from training.runtime.deepspeed_config import build_deepspeed_config
from training.runtime.launcher import (
    CHAOS_CONSOLIDATION_CHUNK_ROWS,
    SHM_DIR,
    release_shm_buffers,
    unmapped_shm_buffers,
)

TINY = {"embedding_dim": 8, "bottom_mlp": [16, 8], "top_mlp": [16], "batch_size": 32}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def fake_python(tmp_path: Path, script: str) -> str:
    """An executable standing in for the interpreter that would run the launcher."""
    path = tmp_path / "fake_python"
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_deepspeed_config_comes_from_the_train_config() -> None:
    config = TrainConfig(
        batch_size=64,
        grad_accum_steps=2,
        zero_stage=2,
        precision="bf16",
        grad_clip=1.0,
        lr=3e-4,
        weight_decay=0.01,
        warmup_steps=10,
    )
    ds_config = build_deepspeed_config(config, world_size=4, total_steps=100)
    assert ds_config["train_micro_batch_size_per_gpu"] == 64
    assert ds_config["gradient_accumulation_steps"] == 2
    assert ds_config["train_batch_size"] == 64 * 2 * 4
    assert ds_config["optimizer"]["params"]["torch_adam"] is True
    assert ds_config["optimizer"]["params"]["lr"] == 3e-4
    assert ds_config["optimizer"]["params"]["weight_decay"] == 0.01
    assert ds_config["zero_optimization"] == {"stage": 2}
    assert ds_config["bf16"] == {"enabled": True}
    assert ds_config["gradient_clipping"] == 1.0
    assert ds_config["scheduler"]["type"] == "WarmupDecayLR"
    assert ds_config["scheduler"]["params"]["total_num_steps"] == 100
    assert ds_config["scheduler"]["params"]["warmup_num_steps"] == 10
    assert json.loads(json.dumps(ds_config)) == ds_config


def test_deepspeed_config_defaults_keep_the_learning_rate_constant() -> None:
    ds_config = build_deepspeed_config(TrainConfig(zero_stage=0), world_size=2)
    assert "scheduler" not in ds_config
    assert ds_config["bf16"] == {"enabled": False}
    assert ds_config["zero_optimization"] == {"stage": 0}
    warmup = TrainConfig(warmup_steps=5, zero_stage=0)
    assert build_deepspeed_config(warmup, 2)["scheduler"]["type"] == "WarmupLR"
    # train.zero_stage: auto (the default) is resolved by the train stage, never passed on.
    with pytest.raises(ValueError, match="zero_stage is 'auto'"):
        build_deepspeed_config(TrainConfig(), world_size=2)


def test_step_plan(shards_dir: Path) -> None:
    meta = load_dataset_meta(shards_dir)  # 4 x 256 train rows: 16 micro batches of 32 per rank
    assert plan_total_steps(TrainConfig(**TINY), meta) == 16
    assert plan_total_steps(TrainConfig(**TINY, epochs=2.5, grad_accum_steps=3), meta) == 13
    assert plan_total_steps(TrainConfig(**TINY, max_steps=100), meta) == 100
    with pytest.raises(ConfigError, match="batch_size"):
        plan_total_steps(TrainConfig(**{**TINY, "batch_size": 1024}), meta)
    with pytest.raises(ConfigError, match="epochs"):
        plan_total_steps(TrainConfig(**TINY, epochs=0.01), meta)


def test_missing_dataset_json_fails_before_launching(tmp_path: Path) -> None:
    with pytest.raises(InputNotFoundError, match=str(tmp_path / "empty" / "dataset.json")):
        train_model(TrainConfig(), tmp_path / "empty", tmp_path / "out", "cpu", 1, env={})


def test_launcher_output_is_streamed_and_a_failure_raises(shards_dir: Path, tmp_path: Path) -> None:
    python = fake_python(
        tmp_path,
        'echo \'RECFORGE_PROGRESS {"step": 1, "total_steps": 2, "loss": 0.7}\'\n'
        "echo 'RECFORGE_PROGRESS {truncated'\n"
        'echo \'RECFORGE_ERROR {"rank": 1, "error": "ValueError: bad"}\'\n'
        'echo "accelerator=$DS_ACCELERATOR"\n'
        "echo boom >&2\n"
        "exit 3\n",
    )
    lines: list[str] = []
    progress: list[dict] = []
    with pytest.raises(TrainingCrashed, match="code 3") as error:
        train_model(
            TrainConfig(**TINY),
            shards_dir,
            tmp_path / "out",
            "cpu",
            1,
            env={},
            on_log=lines.append,
            on_progress=progress.append,
            python=python,
        )
    assert "boom" in str(error.value) and "rank 1: ValueError: bad" in str(error.value)
    assert progress == [{"step": 1, "total_steps": 2, "loss": 0.7}]
    assert "accelerator=cpu" in lines and "boom" in lines
    out = tmp_path / "out"
    assert "boom" in (out / "launcher.log").read_text()
    launch = json.loads((out / "launch.json").read_text())
    assert launch["total_steps"] == 16 and launch["ds_config"]["optimizer"]["params"]["torch_adam"]
    # train.zero_stage: auto (no budget here) was resolved to 0 before anything was
    # written: the ranks, train_config.json and the log line all say 0.
    assert launch["ds_config"]["zero_optimization"] == {"stage": 0}
    assert launch["train_config"]["zero_stage"] == 0
    assert json.loads((out / "train_config.json").read_text())["zero_stage"] == 0
    assert lines[0].startswith("train.zero_stage: auto -> 0")


def test_the_launch_spec_names_the_root_so_a_rank_on_shared_storage_needs_the_key(
    shards_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 38: without the key a rank would verify nothing it reads from the bucket."""
    from artifacts.errors import ConfigError
    from artifacts.signing import KEY_BLOCK_ENV, KEY_ENV, KEY_FILE_ENV
    from training.runtime.rank import require_rank_key

    with pytest.raises(TrainingCrashed):
        train_model(
            TrainConfig(**TINY),
            shards_dir,
            tmp_path / "out",
            "cpu",
            1,
            env={},
            python=fake_python(tmp_path, "exit 3\n"),
            artifact_root="s3://bucket/recforge",
        )
    launch = json.loads((tmp_path / "out" / "launch.json").read_text())
    assert launch["artifact_root"] == "s3://bucket/recforge"
    for name in (KEY_ENV, KEY_FILE_ENV, KEY_BLOCK_ENV):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError, match=KEY_ENV):
        require_rank_key(launch)


def test_exit_zero_without_weights_is_a_crash(shards_dir: Path, tmp_path: Path) -> None:
    python = fake_python(tmp_path, "exit 0\n")
    with pytest.raises(TrainingCrashed, match="missing"):
        train_model(TrainConfig(**TINY), shards_dir, tmp_path / "o", "cpu", 1, {}, python=python)


def test_an_interrupted_caller_leaves_no_orphans(shards_dir: Path, tmp_path: Path) -> None:
    python = fake_python(tmp_path, 'sleep 120 &\necho "child $!"\nwait\n')
    children: list[int] = []

    def on_log(line: str) -> None:
        if not line.startswith("child "):  # the planner's line (train.zero_stage: auto)
            return
        children.append(int(line.split()[1]))
        raise KeyboardInterrupt

    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        train_model(
            TrainConfig(**TINY),
            shards_dir,
            tmp_path / "o",
            "cpu",
            1,
            {},
            on_log=on_log,
            python=python,
        )
    assert time.monotonic() - started < 10
    (child,) = children
    for _ in range(50):  # the orphaned sleep is reaped by init shortly after it dies
        status = Path(f"/proc/{child}/stat")
        if not status.exists() or status.read_text().split(") ")[1].startswith("Z"):
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"process {child} of the launcher's group survived")


def deepspeed_env() -> dict[str, str]:
    return {**os.environ, "DS_ACCELERATOR": "cpu"}


# Each case is one real 2-rank DeepSpeed launch (about 15 s): together they cover the
# ZeRO stages, the precisions, both embedding engines and both sparse optimizers.
ENGINE_CASES = {
    "zero2-fp32-sharded-adagrad-multihot-multitask": {
        "zero_stage": 2,
        "tasks": ["click", "purchase"],
        "pooling": "sum",
    },
    "zero0-bf16-sharded-bf16rows-lazyadam-admission": {
        "zero_stage": 0,
        "precision": "bf16",
        "table_precision": "bf16",
        "sparse_optimizer": "lazy_adam",
        "admission_min_count": 3,
    },
    "zero3-bf16-dense": {"zero_stage": 3, "precision": "bf16", "embeddings": "dense"},
    "zero1-offload-sharded-fp16rows": {
        "zero_stage": 1,
        "offload_optimizer": True,
        "table_precision": "fp16",
    },
    # ZeRO-3 arch partitions streamed lazily, the table's chunks written by both ranks.
    "zero3-sharded-admission": {"zero_stage": 3, "admission_min_count": 2},
}
# Chunks of 10 rows: the tiny table is many chunks, written alternately by the 2 ranks.
CASE_ENV = {"zero3-sharded-admission": {CHAOS_CONSOLIDATION_CHUNK_ROWS: "10"}}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(ENGINE_CASES))
def test_train_with_deepspeed_on_two_cpu_ranks(
    case: str, make_shards: Callable[..., Path], tmp_path: Path
) -> None:
    overrides = ENGINE_CASES[case]
    shards_dir = make_shards(multi_hot={"tags": 12}, extra_labels=["purchase"])
    config = TrainConfig(
        **TINY,
        epochs=0.5,
        log_every=3,
        warmup_steps=2,
        world_size=2,
        **overrides,
    )
    progress: list[dict] = []
    out = tmp_path / "train"
    port = free_port()
    env = {**deepspeed_env(), **CASE_ENV.get(case, {})}
    result = train_model(config, shards_dir, out, "cpu", port, env, on_progress=progress.append)
    # DeepSpeed's ranks leave a tmpfs buffer each behind; the launch removes them.
    assert not list(SHM_DIR.glob(f"deepspeed_allreduce_buffer_*_{port}_*"))

    assert result.steps == 8  # half of 16 micro batches per rank
    assert math.isfinite(result.final_loss) and result.samples_per_s > 0
    assert [p["step"] for p in progress] == [3, 6, 8]
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert log == progress and log[-1]["loss"] == result.final_loss
    assert set(log[-1]["step_ms"]) == {"data", "lookup", "dense", "optimizer"}
    assert len(log[-1]["rss_mb"]) == 2 and min(log[-1]["rss_mb"]) > 100
    assert (out / "checkpoints" / "final").is_dir()
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    plan = json.loads((out / "memory_plan.json").read_text())
    assert plan["total_per_rank_bytes"] == sum(plan["per_rank_bytes"].values())

    weights = load_file(out / "model.safetensors")
    assert all(t.is_contiguous() for t in weights.values())
    # The dense part is fp32; the table keeps train.table_precision.
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    assert weights["embedding.weight"].dtype == dtype[config.table_precision]
    assert all(t.dtype == torch.float32 for n, t in weights.items() if n != "embedding.weight")
    model_config = json.loads((out / "model_config.json").read_text())
    assert model_config["tasks"] == overrides.get("tasks", ["click"])
    model = build_model(model_config)
    model.load_state_dict(weights)  # strict: every parameter, nothing else
    initial = init_rows(model_config["table_sizes"], 8, seed=config.seed)
    assert not torch.equal(weights["embedding.weight"], initial)  # the table trained
    prefix = "arch." if config.embeddings == "sharded" else ""
    if config.zero_stage > 0:
        # The streamed file holds what DeepSpeed's own consolidation assembles in memory.
        whole = get_fp32_state_dict_from_zero_checkpoint(str(out / "checkpoints"), tag="final")
        assert {prefix + name for name in whole} <= set(weights)
        for name, tensor in whole.items():
            assert torch.equal(weights[prefix + name], tensor.float()), name
    if config.embeddings == "sharded":
        shards = sorted((out / "checkpoints" / "final").glob("sparse-rank-*.safetensors"))
        assert [s.name for s in shards] == [
            "sparse-rank-00000-of-00002.safetensors",
            "sparse-rank-00001-of-00002.safetensors",
        ]
        summary = json.loads((out / "train_summary.json").read_text())
        assert summary["table_precision"] == config.table_precision
        assert result.table_precision == config.table_precision
        for rank, shard in enumerate(shards):  # row g of the table is row g // 2 of shard g % 2
            rows = load_file(shard)
            # The checkpoint keeps the table's precision; the optimizer state is fp32.
            assert rows["weight"].dtype == dtype[config.table_precision]
            assert all(rows[k].dtype == torch.float32 for k in ("sum_sq", "exp_avg") if k in rows)
            counts = rows.get("counts", torch.zeros(len(rows["weight"])))  # admission only
            admitted = counts >= config.admission_min_count
            # model.safetensors holds the rows as the shards store them.
            assert torch.equal(
                weights["embedding.weight"][rank::2][admitted], rows["weight"][admitted]
            )
    if config.precision == "bf16":
        # The fp32 master weights were saved, not the bf16 working copy.
        arch = [t for name, t in weights.items() if name.startswith("arch.bottom")]
        assert any((t != t.bfloat16().float()).any() for t in arch)
    if config.admission_min_count:
        # Ids seen fewer than 3 times read their feature's default row (rounded to
        # nearest at the table's precision).
        table = weights["embedding.weight"]
        default = weights["arch.default_rows"][0].to(table.dtype)
        assert any(torch.equal(row, default) for row in table[:101])

    metrics = evaluate_model(EvaluateConfig(), out, shards_dir, tmp_path / "eval")
    assert metrics.num_rows == 512 and 0 <= metrics.auc <= 1
    if config.table_precision == "fp16":
        # The package holds the 2-byte rows as they are: its ONNX and TorchScript models
        # decode them after the gather and match the trained one as any package's do.
        transform = tmp_path / "transform.json"
        transform.write_text(json.dumps({"user_id": {"vocabulary": ["a", "b"]}}))
        package = export_model(
            ExportConfig(parity_rows=64), out, transform, shards_dir,
            tmp_path / "eval" / "metrics.json", tmp_path / "package",
        )  # fmt: skip
        assert package.parity_max_abs_diff_onnx <= 1e-5
        assert package.parity_max_abs_diff_torchscript <= 1e-5
        packaged = load_file(tmp_path / "package" / "model.safetensors")
        assert torch.equal(packaged["embedding.weight"], weights["embedding.weight"])


@pytest.mark.slow
def test_one_rank_and_two_ranks_train_the_same_model(
    make_shards: Callable[..., Path], tmp_path: Path
) -> None:
    """Same data streams and global batch: W=1 (batch 64) and W=2 (batch 32) agree."""
    shards_dir = make_shards(rows_per_file=1024)
    # An exact exchange: a half-precision one rounds only where there is a wire.
    common = {
        **TINY, "max_steps": 40, "data_streams": 2, "zero_stage": 2, "lr": 0.01,
        "comm_precision": "fp32",
    }  # fmt: skip
    results = {}
    for world_size, batch_size in ((1, 64), (2, 32)):
        config = TrainConfig(**{**common, "batch_size": batch_size, "world_size": world_size})
        out = tmp_path / f"w{world_size}"
        train_model(config, shards_dir, out, "cpu", free_port(), deepspeed_env())
        metrics = evaluate_model(EvaluateConfig(), out, shards_dir, tmp_path / f"e{world_size}")
        results[world_size] = (load_file(out / "model.safetensors"), metrics.auc)
    (one, auc_one), (two, auc_two) = results[1], results[2]
    assert auc_one > 0.6  # it learned something
    assert abs(auc_one - auc_two) < 0.002
    initial = init_rows([101, 11, 7], 8, seed=0)
    moved = (one["embedding.weight"] - initial).abs().max()
    assert moved > 1e-2
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=1e-3, atol=1e-4)


@pytest.mark.slow
def test_overlapped_and_waited_gradient_exchanges_train_bitwise_the_same_model(
    make_shards: Callable[..., Path], tmp_path: Path
) -> None:
    """train.overlap_exchange on (the default) and off: the same bits, fp32 on the wire.

    Two micro batches a step: a micro batch's exchange is still in flight when the next
    one's lookup starts, which must wait for it on the shard's own process group.
    """
    shards_dir = make_shards(rows_per_file=1024)
    common = {**TINY, "max_steps": 12, "zero_stage": 0, "world_size": 2, "grad_accum_steps": 2}
    models = {}
    for overlap in (True, False):
        config = TrainConfig(**common, overlap_exchange=overlap, comm_precision="fp32")
        out = tmp_path / f"overlap-{overlap}"
        train_model(config, shards_dir, out, "cpu", free_port(), deepspeed_env())
        models[overlap] = load_file(out / "model.safetensors")
    assert models[True].keys() == models[False].keys()
    for name in models[True]:
        assert torch.equal(models[True][name], models[False][name]), name
    initial = init_rows([101, 11, 7], 8, seed=0)
    assert not torch.equal(models[True]["embedding.weight"], initial)  # the rows trained


def test_fp16_on_cpu_is_refused_before_launch(shards_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="precision: bf16"):
        train_model(
            TrainConfig(**TINY, precision="fp16"), shards_dir, tmp_path / "o", "cpu", 1, env={}
        )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp16_with_loss_scaling_on_gpu(make_shards: Callable[..., Path], tmp_path: Path) -> None:
    shards_dir = make_shards()
    config = TrainConfig(
        **TINY, max_steps=8, precision="fp16", zero_stage=2, world_size=1, log_every=4
    )
    result = train_model(config, shards_dir, tmp_path / "t", "cuda", free_port(), dict(os.environ))
    assert math.isfinite(result.final_loss)
    metrics = evaluate_model(EvaluateConfig(), tmp_path / "t", shards_dir, tmp_path / "e")
    assert 0 <= metrics.auc <= 1


def test_a_config_that_cannot_fit_is_refused_before_launch(
    shards_dir: Path, tmp_path: Path
) -> None:
    config = TrainConfig(**TINY, memory_per_rank_gb=0.25, world_size=2)
    with pytest.raises(ConfigError, match="train.memory_per_rank_gb") as error:
        train_model(config, shards_dir, tmp_path / "out", "cpu", free_port(), deepspeed_env())
    assert "world_size" in str(error.value) or "memory_per_rank_gb" in str(error.value)
    assert not (tmp_path / "out" / "launch.json").exists()


@pytest.mark.slow
def test_a_crashing_rank_raises_training_crashed(shards_dir: Path, tmp_path: Path) -> None:
    # Only rank 0 reads this file; rank 1 must not be left waiting in a collective.
    (shards_dir / "train-00000-of-00004.parquet").write_bytes(b"not parquet at all")
    started = time.monotonic()
    port = free_port()
    with pytest.raises(TrainingCrashed, match="exited with code") as error:
        train_model(
            TrainConfig(**TINY, max_steps=4),
            shards_dir,
            tmp_path / "train",
            "cpu",
            port,
            deepspeed_env(),
        )
    assert not list(SHM_DIR.glob(f"deepspeed_allreduce_buffer_*_{port}_*"))
    # The root cause, rank 0's, is named first; rank 1 only lost its peer.
    assert "rank errors, first one first:\n  rank 0: ArrowInvalid: Parquet magic bytes" in str(
        error.value
    )
    assert time.monotonic() - started < 90


def test_release_shm_buffers_removes_only_that_ports_buffers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("training.runtime.launcher.SHM_DIR", tmp_path)
    uid = os.getuid()
    ours = [tmp_path / f"deepspeed_allreduce_buffer_{uid}_127.0.0.1_29500_{r}" for r in (0, 1)]
    others = [
        tmp_path / f"deepspeed_allreduce_buffer_{uid}_127.0.0.1_29501_0",  # another run
        tmp_path / f"deepspeed_allreduce_buffer_{uid + 1}_127.0.0.1_29500_0",  # another user
        tmp_path / "unrelated_29500_0",
    ]
    for path in ours + others:
        path.write_bytes(b"x")
    assert sorted(release_shm_buffers(29500)) == sorted(ours)
    assert [path.exists() for path in ours + others] == [False, False, True, True, True]
    assert release_shm_buffers(29500) == []


def test_unmapped_shm_buffers_leaves_the_ones_in_use(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("training.runtime.launcher.SHM_DIR", tmp_path)
    uid = os.getuid()
    live, leaked = (tmp_path / f"deepspeed_allreduce_buffer_{uid}_127.0.0.1_1_{r}" for r in (0, 1))
    for path in (live, leaked):
        path.write_bytes(b"\0" * 4096)
    with live.open("r+b") as handle, mmap.mmap(handle.fileno(), 4096):  # as a rank maps it
        assert unmapped_shm_buffers(min_age_s=0) == [leaked]
    assert unmapped_shm_buffers(min_age_s=0) == sorted([live, leaked])
    assert unmapped_shm_buffers() == []  # just written: maybe a rank still writing it


def test_the_machine_budget_suggests_fewer_ranks_and_names_features(
    make_shards: Callable[..., Path], tmp_path: Path
) -> None:
    shards_dir = make_shards()
    meta_path = shards_dir / "dataset.json"
    meta = json.loads(meta_path.read_text())
    meta["sparse"][0]["num_embeddings"] = 400_000_000  # user_id: a 25 GB table at dim 16
    meta_path.write_text(json.dumps(meta))
    config = TrainConfig(**{**TINY, "embedding_dim": 16, "bottom_mlp": [16, 16]})
    budget = (8 * 2**30, "85% of this machine's 20.0 GiB / 2 ranks")
    with pytest.raises(ConfigError) as error:
        train_model(config, shards_dir, tmp_path / "o", "cpu", 1, env={}, memory_budget=budget)
    message = str(error.value)
    assert "85% of this machine's 20.0 GiB / 2 ranks" in message
    assert "user_id" in message and "embedding_dim" in message
    # 2-byte rows: 200M local rows x 16 x 2 B fit where 4 B do not.
    assert "train.table_precision: bf16" in message
