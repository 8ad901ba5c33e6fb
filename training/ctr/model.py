"""CTR models: DLRM (dot interaction) and DCN-v2 (cross network), multi-hot, multi-task.

The modules take plain typed arguments. `model_config_from` turns the train config
and the dataset description into a JSON-able dict of exactly the `CTRModel`
arguments (saved as `model_config.json` next to the weights), and `build_model`
rebuilds the module from that dict, so evaluation and export never need the train
config.

Shapes: B = batch, F = sparse features (Fs single-valued, then multi-hot), L = ids of
a multi-hot feature in the batch, Dn = dense features, D = embedding_dim, T = tasks,
U = embedding rows the batch reads.

Table precision: `CTRModel` holds its table as training stored it (`table_precision`
in the model config: fp32, or fp16 / bf16 rows, or int8 codes with a per-row fp32
scale and bias; `training.ctr.embedding`). It gathers the batch's rows at that
precision and decodes only them (`CompactTable`: a cast, and for int8 a multiply and an
add), so the exported ONNX and TorchScript graphs carry the compact table as their
initializer, and a Gather then a Cast, instead of an fp32 copy of it. An admitted row
decodes to exactly what the training lookup fed the model (`decode_rows`); a row never
admitted holds its feature's default row rounded to the table's precision
(`training.ctr.consolidate`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from training.config import TrainConfig
from training.ctr.consolidate import SCALE_BIAS_NAME, TABLE_NAME
from training.ctr.data import DatasetMeta
from training.ctr.embedding import (
    SCALE_BIAS,
    TABLE_DTYPES,
    TablePrecision,
    init_rows,
    init_table,
    precision_of,
    table_offsets,
)
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
    "table_precision",
)


# Arguments added after models were first exported, with the value older models had
# (every table was consolidated to fp32 before `table_precision` was recorded).
_ARG_DEFAULTS = {"dropout": 0.0, "table_precision": "fp32"}


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
        single = _take(rows, sparse_index)  # (B, Fs, D)
        multi = [_take(rows, index.clamp(min=0)) for index in multi_index]  # (B, L, D) each
        return self.score(single, multi, multi_index, dense)

    def score(
        self,
        single: torch.Tensor,
        multi: list[torch.Tensor],
        multi_index: list[torch.Tensor],
        dense: torch.Tensor,
    ) -> torch.Tensor:
        """Score a batch from its gathered embeddings (what `forward` gathers).

        Args:
            single: (B, Fs, D) rows of the single-valued features, in the dtype of dense.
            multi: One (B, L, D) per multi-hot feature: the rows of its ids (any row
                where the id is the -1 padding).
            multi_index: The multi-hot ids or rows, (B, L) each: only where they are -1
                (padding) matters.
            dense: (B, Dn) dense features, in the dtype of the parameters.

        Returns:
            (B, T) logits.
        """
        pooled = [single]  # (B, Fs, D)
        for rows, index in zip(multi, multi_index, strict=True):
            valid = (index >= 0).to(rows.dtype)[..., None]  # (B, L, 1)
            summed = (rows * valid).sum(dim=1)  # (B, D)
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


class CompactTable(nn.Module):
    """The fused table at a compact precision, decoded after the gather.

    Holds `weight` (N, D) as training stored it: float16, bfloat16, or int8's uint8
    codes with `scale_bias` (N, 2) float32 beside them. Both are buffers, not
    parameters: a scoring model never trains them, and `model.parameters()` stays the
    dense part. The state dict names are those of an fp32 `nn.Embedding` table
    (`embedding.weight`, plus `embedding.scale_bias`), which is how the consolidation
    writes them (`training.ctr.consolidate`).

    Args:
        num_embeddings: N.
        embedding_dim: D.
        table_precision: "fp16", "bf16" or "int8".

    Raises:
        ValueError: Another precision (fp32 tables are an `nn.Embedding`).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, table_precision: str) -> None:
        super().__init__()
        if table_precision not in ("fp16", "bf16", "int8"):
            raise ValueError(
                f"table_precision must be fp16, bf16 or int8 for a CompactTable, got "
                f"{table_precision!r} (an fp32 table is an nn.Embedding)"
            )
        self.table_precision = table_precision
        shape = (num_embeddings, embedding_dim)
        self.register_buffer("weight", torch.zeros(shape, dtype=TABLE_DTYPES[table_precision]))
        scale_bias = torch.zeros((num_embeddings, 2)) if table_precision == "int8" else None
        self.register_buffer(SCALE_BIAS, scale_bias)

    def forward(self, index: torch.Tensor) -> torch.Tensor:
        """The float32 values of the rows `index` names: (*index.shape, D).

        The compact rows are gathered first and only they are decoded, as
        `training.ctr.embedding.decode_rows` decodes them (an exact cast; int8: code times
        its row's scale, then plus its bias): the graph never holds an fp32 table.
        """
        rows = _take(self.weight, index).float()  # (..., D): the gather, then the cast
        if self.scale_bias is None:
            return rows
        scale_bias = _take(self.scale_bias, index)  # (..., 2)
        return rows * scale_bias[..., :1] + scale_bias[..., 1:]


class CTRModel(nn.Module):
    """A CTR model with its whole fused embedding table: the scoring (and export) form.

    Feature f's id i is row `offsets[f] + i` of the table (single-valued features
    first, then multi-hot ones). Trained with `embeddings: dense`, this is also the
    DeepSpeed module (nn.Embedding and dense AdamW); the sharded engine trains a bare
    `CTRArch` and writes the consolidated table into this form.

    The table is an `nn.Embedding` at fp32, else a `CompactTable` at the precision the
    sharded engine stored it in; either way the batch's rows are gathered first and
    the rest of the model sees fp32 rows (see the module docstring).

    Args:
        table_sizes: Rows per feature.
        num_multi_hot: How many of the last features are multi-hot.
        num_dense, embedding_dim, bottom_mlp, top_mlp, interaction, num_cross_layers,
        pooling, dropout: See `CTRArch`.
        tasks: Label of each head, in output order.
        table_precision: How the table is held: "fp32", "fp16", "bf16" or "int8"
            (`train.table_precision`).
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
        table_precision: str = "fp32",
    ) -> None:
        super().__init__()
        if not 0 <= num_multi_hot <= len(table_sizes):
            raise ValueError(f"num_multi_hot={num_multi_hot} out of [0, {len(table_sizes)}]")
        if table_precision not in TABLE_DTYPES:
            raise ValueError(
                f"table_precision must be one of {sorted(TABLE_DTYPES)}, got {table_precision!r}"
            )
        self.num_multi_hot = num_multi_hot
        self.tasks = list(tasks)
        self.table_precision = table_precision
        # The engine's init, independent of the world size; the worker reseeds it.
        self.embedding: nn.Embedding | CompactTable
        if table_precision == "fp32":
            weight = init_rows(table_sizes, embedding_dim, seed=0)
            self.embedding = nn.Embedding(sum(table_sizes), embedding_dim, _weight=weight)
        else:
            self.embedding = CompactTable(sum(table_sizes), embedding_dim, table_precision)
            precision = cast(TablePrecision, table_precision)  # checked above
            rows = init_table(table_sizes, embedding_dim, seed=0, precision=precision)
            self.embedding.weight.copy_(rows["weight"])
            if self.embedding.scale_bias is not None:
                self.embedding.scale_bias.copy_(rows[SCALE_BIAS])
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
        sparse_index = sparse + self.offsets[:num_single]  # (B, Fs) table rows
        multi_index = [
            torch.where(ids >= 0, ids + self.offsets[num_single + i], ids)
            for i, ids in enumerate(multi_hot)
        ]  # (B, L) each, -1 pads
        if isinstance(self.embedding, nn.Embedding):
            return self.arch(self.embedding.weight, sparse_index, dense, multi_index)
        # A compact table: gather its rows, then decode them (never the whole table).
        single = self.embedding(sparse_index).to(dense.dtype)  # (B, Fs, D)
        multi = [self.embedding(index.clamp(min=0)).to(dense.dtype) for index in multi_index]
        return self.arch.score(single, multi, multi_index, dense)


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
        # How the table is stored in model.safetensors and the package (fp32 for dense
        # embeddings, which the config refuses at any other precision).
        "table_precision": train_config.table_precision,
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
        The model on the CPU: its dense part fp32, its table at the config's
        `table_precision` (fp32 for a config that predates it).

    Raises:
        ValueError: Keys are missing or unknown, or a value is out of range.
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

    The table is held at the precision the file stores it in (`CTRModel`); models
    exported before `table_precision` was recorded hold fp32 tables and load as such.
    The config's recorded precision must agree with the file: `load_state_dict` would
    otherwise cast the rows into the other dtype silently.

    Args:
        train_dir: The train stage's output directory, or a package.

    Returns:
        (model in eval mode, its dense part fp32; its model config dict, with the
        table's `table_precision` filled in where the file predates it).

    Raises:
        InputNotFoundError: One of the two files is missing.
        ValueError: The recorded table_precision is not the one of the stored table.
    """
    model_config, config_path, weights_path = read_model_files(train_dir)
    weights = load_file(weights_path)
    precision = stored_table_precision(weights, weights_path)
    recorded = model_config.get("table_precision", precision)
    if recorded != precision:
        raise ValueError(
            f"{config_path} says table_precision {recorded!r} but {weights_path} holds "
            f"{TABLE_NAME} as {precision} rows: the two files are of different runs; "
            "take both from the same train output or package"
        )
    model_config = {**model_config, "table_precision": precision}
    model = build_model(model_config)
    model.load_state_dict(weights)
    model.arch.float()  # a compact table keeps its dtype: only the dense part is upcast
    return model.eval(), model_config


def stored_table_precision(weights: Mapping[str, torch.Tensor], source: Path | str) -> str:
    """The table precision of a `CTRModel` state: its TABLE_NAME's dtype (uint8: int8).

    Raises:
        ValueError: There is no table, or it is of no table precision's dtype (names
            `source`).
    """
    if TABLE_NAME not in weights:
        raise ValueError(f"{source} holds no {TABLE_NAME!r}: it is no CTR model's weights")
    state = {"weight": weights[TABLE_NAME]}
    try:
        return precision_of(state)
    except ValueError as error:
        raise ValueError(f"{source}: {TABLE_NAME} {error}") from error


def table_footprint(model_config: Mapping[str, Any]) -> dict[str, Any]:
    """What a model's table takes in `model.safetensors`, from its model config alone.

    Args:
        model_config: A `model_config_from` dict (as read from model_config.json; one
            without `table_precision` predates compact tables and is fp32). Only
            `table_sizes`, `embedding_dim` and `table_precision` are read.

    Returns:
        {"precision", "rows", "embedding_dim", "bytes"}: bytes of the stored rows, with
        int8's (N, 2) float32 scale and bias.

    Raises:
        ValueError: `table_precision` is none of fp32, fp16, bf16, int8.
    """
    precision = str(model_config.get("table_precision", _ARG_DEFAULTS["table_precision"]))
    if precision not in TABLE_DTYPES:
        raise ValueError(
            f"model config: table_precision must be one of {sorted(TABLE_DTYPES)}, "
            f"got {precision!r}"
        )
    rows = sum(int(size) for size in model_config["table_sizes"])
    dim = int(model_config["embedding_dim"])
    nbytes = rows * dim * TABLE_DTYPES[precision].itemsize
    if precision == "int8":
        nbytes += rows * 2 * torch.float32.itemsize
    return {"precision": precision, "rows": rows, "embedding_dim": dim, "bytes": nbytes}


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

    The view keeps the parent's table precision: the rows are copied as stored (an
    int8 row with its scale and bias), so it scores as the parent does, bit for bit.

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
    old_offsets = table_offsets(old_sizes)
    # Every per-row tensor of the table moves alike: the rows (any dtype) and int8's
    # (scale, bias).
    for name in (TABLE_NAME, SCALE_BIAS_NAME):
        if name not in weights:
            continue
        table = weights[name]
        parts = []
        for f, (new_size, reset) in enumerate(zip(meta.table_sizes, resets, strict=True)):
            rows = table[old_offsets[f] : old_offsets[f + 1]]
            part = rows[0:1].expand(new_size, -1).clone()  # unknown ids: the OOV row
            part[: old_sizes[f]] = rows
            if reset:
                part[torch.tensor(reset, dtype=torch.int64)] = rows[0]
            parts.append(part)
        weights[name] = torch.cat(parts)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out_dir / weights_path.name))
    (out_dir / MODEL_CONFIG_FILE).write_text(
        json.dumps({**model_config, "table_sizes": meta.table_sizes}, indent=2) + "\n"
    )
    return out_dir
