"""CTR models: DLRM (dot interaction) and DCN-v2 (cross network), multi-hot, multi-task.

The modules take plain typed arguments. `model_config_from` turns the train config
and the dataset description into a JSON-able dict of exactly the `CTRModel`
arguments (saved as `model_config.json` next to the weights), and `build_model`
rebuilds the module from that dict, so evaluation and export never need the train
config.

Shapes: B = batch, F = sparse features (Fs single-valued, then multi-hot), L = ids of
a multi-hot feature in the batch, Dn = dense features, D = embedding_dim, T = tasks,
U = embedding rows the batch reads.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from training.config import TrainConfig
from training.ctr.consolidate import TABLE_NAME
from training.ctr.data import DatasetMeta
from training.ctr.embedding import init_rows, table_offsets
from training.packaging import read_model_files
from training.runtime.files import MODEL_CONFIG_FILE

_MODEL_ARGS = (
    "table_sizes",
    "num_multi_hot",
    "num_dense",
    "embedding_dim",
    "bottom_mlp",
    "top_mlp",
    "interaction",
    "num_cross_layers",
    "tasks",
    "pooling",
    "dropout",
)


# Arguments added after models were first exported, with the value older models had.
_ARG_DEFAULTS = {"dropout": 0.0}


def _mlp(in_features: int, sizes: list[int], dropout: float = 0.0) -> nn.Sequential:
    """Linear + ReLU (+ dropout, when above 0) for every size in `sizes`."""
    layers: list[nn.Module] = []
    for size in sizes:
        layers += [nn.Linear(in_features, size), nn.ReLU()]
        if dropout > 0:
            layers.append(nn.Dropout(dropout))
        in_features = size
    return nn.Sequential(*layers)


class CTRArch(nn.Module):
    """Everything of a CTR model but the embedding table: pooling, MLPs, interaction, heads.

    It reads embeddings from a `rows` tensor through index tensors, so the same module
    runs on a full table (scoring, and training with dense embeddings) and on the
    unique rows a sharded lookup fetched for one batch (training with the sharded
    store, where DeepSpeed wraps this module alone).

    Dot interaction (DLRM): the bottom MLP output and the F pooled embeddings, F + 1
    vectors of width D, interact through their pairwise dot products (upper triangle
    without the diagonal), concatenated with the bottom output.
    Cross interaction (DCN-v2): x0 = [bottom output, all embeddings] passes through
    `num_cross_layers` layers x_{l+1} = x0 * (W_l x_l + b_l) + x_l.
    One linear head per task on the top MLP's output.

    Args:
        num_features: F, single-valued plus multi-hot features.
        num_dense: Dn.
        embedding_dim: D.
        bottom_mlp: Layer sizes over the dense features; the last must be D for "dot".
        top_mlp: Hidden layer sizes after the interaction.
        interaction: "dot" or "cross".
        num_cross_layers: Cross layers ("cross" only).
        num_tasks: T heads.
        pooling: "sum" or "mean" over a multi-hot feature's ids.
        dropout: Dropout probability after every hidden layer of both MLPs (training
            only: scoring and export run in eval mode).

    Raises:
        ValueError: An argument is out of range or the sizes do not fit together.
    """

    def __init__(
        self,
        num_features: int,
        num_dense: int,
        embedding_dim: int,
        bottom_mlp: list[int],
        top_mlp: list[int],
        interaction: str,
        num_cross_layers: int,
        num_tasks: int,
        pooling: str,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        if not 0 <= dropout < 1:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        if num_features < 1:
            raise ValueError("num_features: need at least one sparse feature")
        if not bottom_mlp:
            raise ValueError("bottom_mlp: need at least one layer")
        if interaction not in ("dot", "cross"):
            raise ValueError(f"interaction must be 'dot' or 'cross', got {interaction!r}")
        if pooling not in ("sum", "mean"):
            raise ValueError(f"pooling must be 'sum' or 'mean', got {pooling!r}")
        if interaction == "dot" and bottom_mlp[-1] != embedding_dim:
            raise ValueError(
                f"bottom_mlp[-1] ({bottom_mlp[-1]}) must equal embedding_dim "
                f"({embedding_dim}) for the dot interaction"
            )
        self.interaction = interaction
        self.pooling = pooling
        # Shared row of each feature for ids not (yet) admitted by frequency admission.
        self.default_rows = nn.Parameter(torch.zeros(num_features, embedding_dim))
        self.bottom = _mlp(num_dense, bottom_mlp, dropout)
        if interaction == "dot":
            vectors = num_features + 1
            rows, cols = torch.triu_indices(vectors, vectors, offset=1)
            # Flat positions of the upper triangle in the (F+1) x (F+1) Gram matrix.
            # Not persistent: it is derived from the shapes, not learned.
            self.register_buffer("pair_index", rows * vectors + cols, persistent=False)
            interaction_width = bottom_mlp[-1] + vectors * (vectors - 1) // 2
            self.cross = nn.ModuleList()
        else:
            interaction_width = bottom_mlp[-1] + num_features * embedding_dim
            self.cross = nn.ModuleList(
                nn.Linear(interaction_width, interaction_width) for _ in range(num_cross_layers)
            )
        self.top = _mlp(interaction_width, top_mlp, dropout)
        self.heads = nn.Linear(top_mlp[-1] if top_mlp else interaction_width, num_tasks)

    def forward(
        self,
        rows: torch.Tensor,
        sparse_index: torch.Tensor,
        dense: torch.Tensor,
        multi_index: list[torch.Tensor],
        row_admitted: torch.Tensor | None = None,
        row_feature: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Score a batch.

        Args:
            rows: (U, D) embedding rows.
            sparse_index: (B, Fs) int64 row of each single-valued feature in `rows`.
            dense: (B, Dn) dense features, in the dtype of the parameters.
            multi_index: One (B, L) int64 per multi-hot feature: rows in `rows`, -1 pads.
            row_admitted: (U,) bool; rows not admitted are replaced by the default row
                of their feature. None: all admitted.
            row_feature: (U,) int64 feature of each row (needed with row_admitted).

        Returns:
            (B, T) logits.
        """
        rows = rows.to(dense.dtype)
        if row_admitted is not None:
            defaults = self.default_rows[row_feature]  # (U, D)
            rows = torch.where(row_admitted[:, None], rows, defaults)
        # index_select, not rows[index]: its backward is one index_add_ (advanced
        # indexing's is a slower accumulating index_put_).
        pooled = [_take(rows, sparse_index)]  # (B, Fs, D)
        for index in multi_index:
            valid = (index >= 0).to(rows.dtype)[..., None]  # (B, L, 1)
            summed = (_take(rows, index.clamp(min=0)) * valid).sum(dim=1)  # (B, D)
            if self.pooling == "mean":
                summed = summed / valid.sum(dim=1).clamp(min=1.0)
            pooled.append(summed[:, None, :])
        embedded = torch.cat(pooled, dim=1)  # (B, F, D)
        bottom = self.bottom(dense)  # (B, Db)
        if self.interaction == "dot":
            vectors = torch.cat([bottom[:, None, :], embedded], dim=1)  # (B, F+1, D)
            gram = torch.bmm(vectors, vectors.transpose(1, 2))  # (B, F+1, F+1)
            pairs = gram.flatten(1)[:, self.pair_index]  # (B, (F+1)F/2)
            features = torch.cat([bottom, pairs], dim=1)
        else:
            x0 = torch.cat([bottom, embedded.flatten(1)], dim=1)  # (B, Db + F*D)
            x = x0
            for layer in self.cross:
                x = x0 * layer(x) + x
            features = x
        return self.heads(self.top(features))  # (B, T)


def _take(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """rows[index] for an int64 index of any shape: (*index.shape, D)."""
    return rows.index_select(0, index.reshape(-1)).view(*index.shape, rows.shape[1])


class CTRModel(nn.Module):
    """A CTR model with its whole fused embedding table: the scoring (and export) form.

    Feature f's id i is row `offsets[f] + i` of the table (single-valued features
    first, then multi-hot ones). Trained with `embeddings: dense`, this is also the
    DeepSpeed module (nn.Embedding and dense AdamW); the sharded engine trains a bare
    `CTRArch` and writes the consolidated table into this form.

    Args:
        table_sizes: Rows per feature.
        num_multi_hot: How many of the last features are multi-hot.
        num_dense, embedding_dim, bottom_mlp, top_mlp, interaction, num_cross_layers,
        pooling, dropout: See `CTRArch`.
        tasks: Label of each head, in output order.
    """

    def __init__(
        self,
        table_sizes: list[int],
        num_multi_hot: int,
        num_dense: int,
        embedding_dim: int,
        bottom_mlp: list[int],
        top_mlp: list[int],
        interaction: str,
        num_cross_layers: int,
        tasks: list[str],
        pooling: str,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        if not 0 <= num_multi_hot <= len(table_sizes):
            raise ValueError(f"num_multi_hot={num_multi_hot} out of [0, {len(table_sizes)}]")
        self.num_multi_hot = num_multi_hot
        self.tasks = list(tasks)
        # The engine's init, independent of the world size; the worker reseeds it.
        weight = init_rows(table_sizes, embedding_dim, seed=0)
        self.embedding = nn.Embedding(sum(table_sizes), embedding_dim, _weight=weight)
        self.register_buffer("offsets", table_offsets(table_sizes)[:-1], persistent=False)
        self.arch = CTRArch(
            len(table_sizes),
            num_dense,
            embedding_dim,
            bottom_mlp,
            top_mlp,
            interaction,
            num_cross_layers,
            len(tasks),
            pooling,
            dropout,
        )

    def forward(
        self, sparse: torch.Tensor, dense: torch.Tensor, *multi_hot: torch.Tensor
    ) -> torch.Tensor:
        """Score a batch.

        Args:
            sparse: (B, Fs) int64 ids, column f in [0, table_sizes[f]).
            dense: (B, Dn) floats, in the dtype of the parameters.
            *multi_hot: One (B, L) int64 per multi-hot feature, padded with -1.

        Returns:
            (B, T) logits.
        """
        num_single = self.offsets.shape[0] - self.num_multi_hot
        sparse_index = sparse + self.offsets[:num_single]
        multi_index = [
            torch.where(ids >= 0, ids + self.offsets[num_single + i], ids)
            for i, ids in enumerate(multi_hot)
        ]
        return self.arch(self.embedding.weight, sparse_index, dense, multi_index)


def model_config_from(train_config: TrainConfig, dataset_meta: DatasetMeta) -> dict[str, Any]:
    """The `CTRModel` constructor arguments for a train config and a dataset.

    Args:
        train_config: The train section.
        dataset_meta: The shard directory's description (feature order and sizes).

    Returns:
        A JSON-able dict with exactly the `CTRModel.__init__` arguments.
    """
    return {
        "table_sizes": dataset_meta.table_sizes,
        "num_multi_hot": len(dataset_meta.multi_hot),
        "num_dense": len(dataset_meta.dense),
        "embedding_dim": train_config.embedding_dim,
        "bottom_mlp": list(train_config.bottom_mlp),
        "top_mlp": list(train_config.top_mlp),
        "interaction": train_config.interaction,
        "num_cross_layers": train_config.num_cross_layers,
        "tasks": dataset_meta.task_labels(train_config.tasks),
        "pooling": train_config.pooling,
        "dropout": train_config.dropout,
    }


def _with_defaults(model_config: Mapping[str, Any]) -> dict[str, Any]:
    """`model_config` with the arguments older models lack filled in; keys checked."""
    model_config = {**_ARG_DEFAULTS, **model_config}
    _check_keys(model_config)
    return model_config


def _check_keys(model_config: Mapping[str, Any]) -> None:
    missing = sorted(set(_MODEL_ARGS) - set(model_config))
    unknown = sorted(set(model_config) - set(_MODEL_ARGS))
    if missing or unknown:
        raise ValueError(f"model config: missing keys {missing}, unknown keys {unknown}")


def build_model(model_config: Mapping[str, Any]) -> CTRModel:
    """Build a freshly initialised `CTRModel` from a `model_config_from` dict.

    Args:
        model_config: The constructor arguments (e.g. read from model_config.json).

    Returns:
        The model, in fp32 on the CPU.

    Raises:
        ValueError: Keys are missing or unknown.
    """
    model_config = _with_defaults(model_config)
    return CTRModel(**{name: model_config[name] for name in _MODEL_ARGS})


def build_arch(model_config: Mapping[str, Any]) -> CTRArch:
    """Build the `CTRArch` (no table) of a `model_config_from` dict, for sharded training."""
    model_config = _with_defaults(model_config)
    return CTRArch(
        len(model_config["table_sizes"]),
        model_config["num_dense"],
        model_config["embedding_dim"],
        model_config["bottom_mlp"],
        model_config["top_mlp"],
        model_config["interaction"],
        model_config["num_cross_layers"],
        len(model_config["tasks"]),
        model_config["pooling"],
        model_config["dropout"],
    )


def load_model(train_dir: Path) -> tuple[CTRModel, dict[str, Any]]:
    """Rebuild a trained model from `model_config.json` and `model.safetensors`.

    Args:
        train_dir: The train stage's output directory.

    Returns:
        (model in fp32 eval mode, its model config dict).

    Raises:
        InputNotFoundError: One of the two files is missing.
    """
    model_config, _, weights_path = read_model_files(train_dir)
    model = build_model(model_config)
    model.load_state_dict(load_file(weights_path))
    return model.float().eval(), model_config


def extension_resets(old_sizes: list[int], transform: dict, meta: DatasetMeta) -> list[list[int]]:
    """Per table (the shards' order), the rows an extended transform reset, after checking
    that it extends tables of `old_sizes` into the shards' (`data_prep.idmap`).

    Args:
        old_sizes: The parent model's rows per table.
        transform: The extending transform (with `parent_sizes` and `changes`).
        meta: The shards' description under that transform.

    Raises:
        ValueError: It extends other tables (another parent, other features): names the
            feature.
    """
    names = [feature.name for feature in (*meta.sparse, *meta.multi_hot)]
    recorded = transform.get("parent_sizes")
    if recorded is None or len(old_sizes) != len(names):
        raise ValueError(
            "the transform extends no model with these tables (its features or vocabularies differ)"
        )
    for name, old, new in zip(names, old_sizes, meta.table_sizes, strict=True):
        if recorded.get(name, old) != old or new < old:
            raise ValueError(
                f"feature {name!r} has {old} rows in the parent, but the transform extends a "
                f"table of {recorded.get(name)} rows into {new}"
            )
    changes = transform.get("changes", {})
    return [list(changes.get(name, {}).get("reset_rows", [])) for name in names]


def lay_onto_transform(package: Path, transform: dict, meta: DatasetMeta, out_dir: Path) -> Path:
    """A parent model laid onto the rows of a transform that extends its own.

    An incremental day's transform (`data_prep.idmap.extend_transform`) keeps every known
    id's row, appends rows for new ids and reuses evicted ids' rows. The parent model
    scores an id it does not know through its feature's out-of-vocabulary row 0, so on
    the new rows it is that row: kept rows are copied, new and reset rows take row 0 of
    their feature. The result scores this transform's shards exactly as the parent's own
    package scores the raw records, which is how the gate compares a day's model with
    the champion on the same test data.

    Args:
        package: The parent's model directory (`model_config.json`, `model.safetensors`).
        transform: The extending transform (with `parent_sizes` and `changes`).
        meta: The shards' description under that transform (tables' order and sizes).
        out_dir: Receives `model_config.json` and `model.safetensors` of the view.

    Returns:
        `out_dir`.

    Raises:
        ValueError: The transform does not extend the parent's tables (`extension_resets`).
    """
    model_config, _, weights_path = read_model_files(package)
    weights = load_file(weights_path)
    old_sizes = [int(size) for size in model_config["table_sizes"]]
    resets = extension_resets(old_sizes, transform, meta)
    table = weights[TABLE_NAME]
    old_offsets = table_offsets(old_sizes)
    parts = []
    for f, (new_size, reset) in enumerate(zip(meta.table_sizes, resets, strict=True)):
        rows = table[old_offsets[f] : old_offsets[f + 1]]
        part = rows[0:1].expand(new_size, -1).clone()  # unknown ids: the OOV row
        part[: old_sizes[f]] = rows
        if reset:
            part[torch.tensor(reset, dtype=torch.int64)] = rows[0]
        parts.append(part)
    weights[TABLE_NAME] = torch.cat(parts)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out_dir / weights_path.name))
    (out_dir / MODEL_CONFIG_FILE).write_text(
        json.dumps({**model_config, "table_sizes": meta.table_sizes}, indent=2) + "\n"
    )
    return out_dir
