"""Fixtures of the training tests: a fabricated shard directory with random data."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

SPARSE = {"user_id": 101, "city": 11, "category": 7}
DENSE = ["price", "position"]


def write_shards(
    root: Path,
    split_files: dict[str, int] | None = None,
    rows_per_file: int = 256,
    row_group_size: int = 64,
    oracle: bool = True,
    seed: int = 0,
    multi_hot: dict[str, int] | None = None,
    extra_labels: list[str] | None = None,
    max_list_length: int = 4,
) -> Path:
    """Fabricate a shard directory: dataset.json plus Parquet files of random rows.

    Labels are drawn from a known logistic model, stored as the oracle column
    `p_true`, so the oracle AUC is meaningful and a model can learn something.

    Args:
        root: Directory to create.
        split_files: Number of files per split; default train 4, valid 1, test 2.
        rows_per_file: Rows in each file.
        row_group_size: Parquet row group size (small, to exercise streaming).
        oracle: Write the `p_true` column and name it in dataset.json.
        seed: Random seed.
        multi_hot: Multi-hot features to add, name -> num_embeddings: list<int64>
            columns of 0..max_list_length ids; every 7th row's list is empty and every
            11th is null. Listed under "multi_hot" in dataset.json.
        extra_labels: More float32 0/1 label columns (e.g. ["purchase"]) beside `click`;
            with them or with multi_hot, dataset.json lists "labels".
        max_list_length: Longest multi-hot list.

    Returns:
        `root`.
    """
    split_files = split_files or {"train": 4, "valid": 1, "test": 2}
    rng = np.random.default_rng(seed)
    weights = {name: rng.normal(0, 1.0, size=n) for name, n in SPARSE.items()}
    dense_weights = rng.normal(0, 1.0, size=len(DENSE))
    root.mkdir(parents=True, exist_ok=True)
    splits = {}
    for split, num_files in split_files.items():
        files = []
        for index in range(num_files):
            columns: dict[str, np.ndarray] = {}
            logit = np.full(rows_per_file, -0.5)
            for name, n in SPARSE.items():
                ids = rng.integers(0, n, size=rows_per_file, dtype=np.int64)
                columns[name] = ids
                logit += weights[name][ids]
            for i, name in enumerate(DENSE):
                values = rng.normal(0, 1, size=rows_per_file).astype(np.float32)
                columns[name] = values
                logit += dense_weights[i] * values
            p_true = 1 / (1 + np.exp(-logit))
            columns["click"] = (rng.random(rows_per_file) < p_true).astype(np.float32)
            for label in extra_labels or []:
                columns[label] = (rng.random(rows_per_file) < 0.3).astype(np.float32)
            for name, n in (multi_hot or {}).items():
                columns[name] = _random_lists(rng, rows_per_file, n, max_list_length)
            if oracle:
                columns["p_true"] = p_true.astype(np.float64)
            columns["ts"] = np.arange(rows_per_file, dtype=np.int64) + index * rows_per_file
            name = f"{split}-{index:05d}-of-{num_files:05d}.parquet"
            pq.write_table(pa.table(columns), root / name, row_group_size=row_group_size)
            files.append({"path": name, "rows": rows_per_file})
        splits[split] = {"files": files, "rows": rows_per_file * num_files}
    meta = {
        "label": "click",
        "sparse": [{"name": name, "num_embeddings": n} for name, n in SPARSE.items()],
        "dense": DENSE,
        "oracle": "p_true" if oracle else None,
        "splits": splits,
    }
    if multi_hot is not None or extra_labels is not None:
        meta["labels"] = ["click", *(extra_labels or [])]
        meta["multi_hot"] = [
            {"name": name, "num_embeddings": n} for name, n in (multi_hot or {}).items()
        ]
    (root / "dataset.json").write_text(json.dumps(meta, indent=2))
    return root


def _random_lists(
    rng: np.random.Generator, rows: int, num_embeddings: int, max_length: int
) -> pa.ListArray:
    """`rows` lists of random ids; row i is empty when i % 7 == 3 and null when i % 11 == 5."""
    lengths = rng.integers(1, max_length + 1, size=rows)
    lengths[np.arange(rows) % 7 == 3] = 0
    lengths[np.arange(rows) % 11 == 5] = 0
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    values = pa.array(rng.integers(0, num_embeddings, size=int(offsets[-1]), dtype=np.int64))
    mask = pa.array(np.arange(rows) % 11 == 5)
    return pa.ListArray.from_arrays(pa.array(offsets), values, mask=mask)


@pytest.fixture
def make_shards(tmp_path: Path) -> Callable[..., Path]:
    """Factory: `make_shards(name="shards", **write_shards_kwargs)` -> shard directory."""

    def make(name: str = "shards", **kwargs: object) -> Path:
        return write_shards(tmp_path / name, **kwargs)

    return make


@pytest.fixture(scope="module")
def module_shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The `shards_dir` data, written once for a test module's tests to share."""
    return write_shards(tmp_path_factory.mktemp("module") / "shards")


@pytest.fixture
def shards_dir(make_shards: Callable[..., Path]) -> Path:
    """A default fabricated shard directory (4 train, 1 valid, 2 test files of 256 rows)."""
    return make_shards()


def write_random_train_dir(
    train_dir: Path, shards_dir: Path, interaction: str = "dot", **train_overrides: object
) -> Path:
    """A train stage output holding a randomly initialised model (no training run).

    Args:
        train_dir: Directory to create.
        shards_dir: The shard directory the model is built for.
        interaction: "dot" or "cross".
        **train_overrides: Other TrainConfig fields (e.g. tasks, pooling).

    Returns:
        `train_dir`, with model_config.json, model.safetensors and train_config.json.
    """
    import torch
    from safetensors.torch import save_file

    from training.config import TrainConfig
    from training.ctr.data import load_dataset_meta
    from training.ctr.model import build_model, model_config_from

    config = TrainConfig(
        interaction=interaction,
        embedding_dim=8,
        bottom_mlp=[16, 8],
        top_mlp=[16],
        **train_overrides,
    )
    model_config = model_config_from(config, load_dataset_meta(shards_dir))
    torch.manual_seed(0)
    model = build_model(model_config)
    train_dir.mkdir(parents=True, exist_ok=True)
    (train_dir / "model_config.json").write_text(json.dumps(model_config))
    (train_dir / "train_config.json").write_text(config.model_dump_json())
    save_file(model.state_dict(), str(train_dir / "model.safetensors"))
    return train_dir


@pytest.fixture
def make_train_dir(tmp_path: Path) -> Callable[..., Path]:
    """Factory: `make_train_dir(shards_dir, interaction="dot", name="train")` -> train dir."""

    def make(
        shards_dir: Path, interaction: str = "dot", name: str = "train", **overrides: object
    ) -> Path:
        return write_random_train_dir(tmp_path / name, shards_dir, interaction, **overrides)

    return make


@pytest.fixture
def random_train_dir(make_train_dir: Callable[..., Path], shards_dir: Path) -> Path:
    """A train output with a randomly initialised dot-interaction model for `shards_dir`."""
    return make_train_dir(shards_dir)
