"""train.init: the ranks warm-start from a parent model, on any world size."""

import json
import os
import shutil
import socket
from functools import partial
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from artifacts.errors import ConfigError, DataError
from artifacts.store import ArtifactStore
from training.config import TrainConfig
from training.ctr.data import load_dataset_meta
from training.ctr.model import model_config_from
from training.ctr.train import train_model, warm_start_spec

pytestmark = pytest.mark.slow

CONFIG = {
    "embedding_dim": 8,
    "bottom_mlp": [16, 8],
    "top_mlp": [16],
    "dropout": 0.0,  # dropout masks are drawn per rank
    "comm_precision": "fp32",  # only a wire rounds: 1 and 2 ranks must agree exactly
    "zero_stage": 0,
    "data_streams": 2,
    "checkpoint_every": 0,
    "log_every": 1,
    "tensorboard": False,
    "sparse_optimizer": "rowwise_adagrad",
}
GROWN = {"user_id": 131}  # 30 new user rows in the child's table
RESET = {"user_id": [3, 7], "city": [2]}  # rows whose id changed: evicted or reused
PARENT_FP = "b" * 64


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def config(world_size: int, **extra: object) -> TrainConfig:
    return TrainConfig(
        **{**CONFIG, "world_size": world_size, "batch_size": 64 // world_size, **extra}
    )


def grown_shards(shards: Path, out: Path) -> Path:
    """The same rows, described with larger tables: a day whose vocabularies grew."""
    shutil.copytree(shards, out)
    meta = json.loads((out / "dataset.json").read_text())
    for feature in meta["sparse"]:
        feature["num_embeddings"] = GROWN.get(feature["name"], feature["num_embeddings"])
    (out / "dataset.json").write_text(json.dumps(meta))
    return out


def extending_transform(parent_shards: Path, path: Path) -> Path:
    """The parts of an extended transform (`data_prep.idmap`) a warm start reads."""
    meta = load_dataset_meta(parent_shards)
    path.write_text(
        json.dumps(
            {
                "parent_sizes": {f.name: f.num_embeddings for f in meta.sparse},
                "changes": {name: {"reset_rows": rows} for name, rows in RESET.items()},
            }
        )
    )
    return path


def test_a_warm_start_on_another_world_size_equals_one_on_the_same_after_a_step(
    module_shards: Path, tmp_path: Path
) -> None:
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    # The parent is a published train output: the ranks verify it against its manifest.
    store = ArtifactStore(tmp_path / "root")
    staging = store.new_staging("train", PARENT_FP)
    train_model(config(2, max_steps=3), module_shards, staging, "cpu", free_port(), env)
    store.publish("train", PARENT_FP, staging, {})
    parent = store.output_dir("train", PARENT_FP)
    child_shards = grown_shards(module_shards, tmp_path / "day2")
    transform = extending_transform(module_shards, tmp_path / "transform.json")
    warm = partial(warm_start_spec, parent, 2, transform)

    outputs = {}
    for world_size in (2, 1):
        out = tmp_path / f"child-{world_size}"
        train_model(
            config(world_size, max_steps=1), child_shards, out, "cpu", free_port(), env,
            warm_start=warm,
        )  # fmt: skip
        outputs[world_size] = load_file(out / "model.safetensors")
        summary = json.loads((out / "train_summary.json").read_text())
        assert summary["warm_start"] == {
            "parent_world_size": 2, "reset_rows": 3, "new_rows": 30, "dense_optimizer": "carried",
            "table_rows": "carried",
        }  # fmt: skip
    same, other = outputs[2], outputs[1]
    assert same.keys() == other.keys()
    for name in same:
        torch.testing.assert_close(other[name], same[name], atol=1e-6, rtol=0, msg=name)

    # It did start from the parent: the rows one step left alone are the parent's, the
    # reset and new rows are not.
    before = load_file(parent / "model.safetensors")["embedding.weight"]
    after = same["embedding.weight"]
    users = before[:101]  # user_id is the first table
    untouched = (after[:101] == users).all(dim=1)
    assert untouched.float().mean() > 0.3
    assert not untouched[[3, 7]].any()  # reset rows start afresh
    assert after.shape[0] == before.shape[0] + 30
    for name in same:
        if name.startswith("arch.") and name != "arch.default_rows":
            parent_tensor = load_file(parent / "model.safetensors")[name]
            assert (same[name] - parent_tensor).abs().max() < 0.05, name

    # A child at another table precision converts the parent's rows (rounded to nearest)
    # and says so.
    out = tmp_path / "child-bf16"
    train_model(
        config(1, max_steps=1, table_precision="bf16"), child_shards, out, "cpu", free_port(),
        env, warm_start=warm,
    )  # fmt: skip
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["warm_start"]["table_rows"] == "converted fp32 -> bf16 (rounded to nearest)"
    assert summary["table_precision"] == "bf16"
    rows = load_file(out / "checkpoints" / "final" / "sparse-rank-00000-of-00001.safetensors")
    assert rows["weight"].dtype == torch.bfloat16 and rows["sum_sq"].dtype == torch.float32
    converted = load_file(out / "model.safetensors")["embedding.weight"][:101]
    kept = (converted == users.bfloat16().float()).all(dim=1)
    assert kept.float().mean() > 0.3 and not kept[[3, 7]].any()

    # A parent of another architecture, or of other tables, is refused by name before
    # anything is launched.
    meta = load_dataset_meta(child_shards)
    wider = model_config_from(config(1, top_mlp=[32]), meta)
    with pytest.raises(ConfigError, match=r"top_mlp \(\[16\], here \[32\]\)"):
        warm_start_spec(parent, 2, transform, meta, wider)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"parent_sizes": {"user_id": 5}, "changes": {}}))
    with pytest.raises(ConfigError, match="user_id"):
        warm_start_spec(parent, 2, other, meta, model_config_from(config(1), meta))

    # The attack: a writer to the store swaps the parent's DeepSpeed checkpoint (which
    # DeepSpeed's loader unpickles) after the task verified it. Rank 0 checks the
    # output against its signed manifest again before any rank opens a file.
    tampered = next((parent / "checkpoints" / "final").glob("mp_rank_00_model_states.pt"))
    tampered.write_bytes(tampered.read_bytes() + b"payload")
    with pytest.raises(DataError, match="changed since it was verified"):
        train_model(
            config(2, max_steps=1), child_shards, tmp_path / "after-tamper", "cpu",
            free_port(), env, warm_start=warm,
        )  # fmt: skip
