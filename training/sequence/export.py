"""Export stage for SASRec: package a next-item model as a top-K recommender, prove parity.

Reads `<train_dir>/model_config.json` (`{"model": "sasrec", "num_items", "max_length",
"hidden_dim", "num_blocks", "num_heads", "dropout"}`), `<train_dir>/model.safetensors`
(`SASRec.state_dict()` in fp32), the fitted transform file (the item field's entry
under `"sparse"`), the first rows of `<sequences_dir>/test.parquet` (column `history`)
and optionally the evaluation's metrics.json. Writes into `out_dir`:

- `model.safetensors`, `model_config.json`: copies of the trained model;
- `transform.json`: a copy of the fitted transform (raw ids -> item indices);
- `model.onnx`: input `history` int64 (B, max_length), the user's item indices oldest
  first, left-padded with 0; outputs `items` int64 (B, K), the K highest-scoring items
  best first, never item 0 nor an item of the history, and `scores` float32 (B, K),
  their scores; the batch axis is dynamic;
- `model.ts`: the same graph as TorchScript (torch.jit.trace);
- `item_ids.json` (vocabulary item fields only): the raw item id of index i at position
  i, null at index 0 (padding / out of vocabulary);
- `signature.json`: input/output names, dtypes, shapes, K, max_length, the padding item
  and how item indices map to raw ids;
- `parity/inputs.npz` (key `history`), `parity/items.npy` (N, K) int64 and
  `parity/scores.npy` (N, K) float32: the trained model's top K on the first
  N = min(parity_rows, test rows) test histories, for checks at serving time;
- `model_card.md`.

Parity: the top K is computed from the torch model by an independent numpy path
(`reference_top_k`); onnxruntime and TorchScript must return the same item ids for every
row and scores within `parity_atol`, or ParityError is raised (the files written so far
stay in `out_dir`, which the caller treats as a failed staging directory).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import torch
from safetensors.torch import load_file
from torch import nn

from artifacts.errors import ConfigError, InputNotFoundError
from data_prep.errors import SchemaError
from training.config import ExportConfig
from training.packaging import (
    MODEL_CARD_FILE,
    PARITY_SPLIT,
    RUNTIME_FILES,
    ExportResult,
    Parity,
    ServedGraph,
    check_files_exist,
    metrics_lines,
    model_card,
    model_section,
    package_files,
    parity_table,
    read_metrics,
    read_model_files,
    write_package,
)
from training.sequence.registry import SEQUENCE_MODEL_REGISTRY
from training.sequence.sasrec import PADDING_ITEM, SASRec

MODEL_KIND = "sasrec"
INPUT_NAME = "history"
OUTPUT_NAMES = ("items", "scores")
ITEM_IDS_FILE = "item_ids.json"


def load_sequence_model(
    train_dir: Path, kind: str | None = MODEL_KIND
) -> tuple[Any, dict[str, Any]]:
    """Rebuild a trained sequence model from `model_config.json` and `model.safetensors`.

    Args:
        train_dir: The train stage's output directory.
        kind: The model the caller handles ("sasrec", "bst": a name of
            `SEQUENCE_MODEL_REGISTRY`), or None for whichever registered model the
            config describes.

    Returns:
        (model in fp32 eval mode, its model config dict).

    Raises:
        InputNotFoundError: One of the two files is missing.
        SchemaError: The config describes another model, has missing or unknown keys,
            or the weights do not fit it.
        ConfigError: The config's architecture is invalid (see `SASRec`, `BST`).
    """
    model_config, config_path, weights_path = read_model_files(train_dir)
    found = model_config.get("model") if isinstance(model_config, dict) else None
    wanted = [kind] if kind is not None else sorted(SEQUENCE_MODEL_REGISTRY)
    if found not in wanted:
        expected = repr(kind) if kind is not None else f"one of {wanted}"
        raise SchemaError(
            f"{config_path} describes model {found!r}, not {expected}; export CTR models "
            "with training.ctr.export.export_model, BST with training.sequence.bst_export"
        )
    entry = SEQUENCE_MODEL_REGISTRY[found]
    required, optional = entry.config_keys, entry.optional_config_keys
    missing = {"model", *required} - set(model_config)
    unknown = set(model_config) - {"model", *required, *optional}
    if missing or unknown:
        raise SchemaError(
            f"{config_path}: missing keys {sorted(missing)}, unknown keys {sorted(unknown)}; "
            f"it holds {sorted(required)} and optionally {sorted(optional)}"
        )
    model = entry.build_model(model_config)
    try:
        model.load_state_dict(load_file(weights_path), strict=True)
    except RuntimeError as error:
        raise SchemaError(
            f"{weights_path} does not fit {config_path}: {error}; export the weights and the "
            "config of the same train run"
        ) from error
    return model.float().eval(), model_config


def _check_k(k: int, num_items: int, max_length: int) -> None:
    """Refuse a K that could force masked items (padding, history) into the top K."""
    # At most 1 + max_length items are masked per row, so this many always remain.
    most = num_items - 1 - max_length
    if not 1 <= k <= most:
        raise ConfigError(
            f"k={k}: need 1 <= k <= num_items - 1 - max_length = {most}, so that K items "
            "remain once padding and the history are excluded; lower k"
        )


class TopKScorer(nn.Module):
    """The served graph: a SASRec's K best next items for each user, seen items excluded.

    Exactly tied scores: ONNX TopK returns the lower item index first (as
    `reference_top_k`); torch.topk, and so the TorchScript package, promises no order.

    Args:
        model: The trained model (put it in eval mode before tracing or exporting).
        k: K, at most num_items - 1 - max_length.

    Raises:
        ConfigError: k is out of range.
    """

    def __init__(self, model: SASRec, k: int) -> None:
        super().__init__()
        _check_k(
            k, model.item_embedding.num_embeddings, model.input.position_embedding.num_embeddings
        )
        self.model = model
        self.k = k

    def forward(self, history: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-K items after the history.

        Args:
            history: (B, L) int64 item indices, oldest first, left-padded with 0.

        Returns:
            items (B, K) int64, best first; scores (B, K) float32, descending.
        """
        hidden = self.model(history)[:, -1]  # (B, D): the state after the newest item
        scores = self.model.score(hidden)  # (B, V)
        # Serving never recommends padding or what the user already interacted with;
        # masking before topk (not filtering after) keeps K real items in every row.
        excluded = torch.cat([torch.zeros_like(history[:, :1]), history], dim=1)  # (B, 1 + L)
        scores = scores.scatter(1, excluded, float("-inf"))
        top_scores, items = torch.topk(scores, self.k, dim=1)  # (B, K) each, sorted
        return items, top_scores


def reference_top_k(model: SASRec, history: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The top K of `TopKScorer`, computed on another path: torch scores, numpy ranking.

    Ties are broken by the lower item index first (a stable sort), as ONNX TopK does.

    Args:
        model: The trained model, in eval mode.
        history: (N, L) int64 item indices, oldest first, left-padded with 0.
        k: K, at most num_items - 1 - max_length.

    Returns:
        items (N, K) int64 and scores (N, K) float32, best first.

    Raises:
        ValueError: The model is in training mode (dropout would make it random).
        ConfigError: k is out of range.
    """
    if model.training:
        raise ValueError("reference_top_k needs the model in eval mode; call model.eval()")
    _check_k(k, model.item_embedding.num_embeddings, model.input.position_embedding.num_embeddings)
    with torch.no_grad():
        scores = model.score(model(history)[:, -1]).numpy().astype(np.float32)  # (N, V), a copy
    scores[:, PADDING_ITEM] = -np.inf
    np.put_along_axis(scores, history.numpy(), -np.inf, axis=1)
    order = np.argsort(-scores, axis=1, kind="stable")[:, :k]  # (N, K)
    return order.astype(np.int64), np.take_along_axis(scores, order, axis=1)


def pad_histories(histories: list[list[int]], max_length: int) -> torch.Tensor:
    """Left-pad with 0 (or keep the newest `max_length` items of) each history.

    Args:
        histories: N lists of item indices, oldest first; may be empty.
        max_length: L.

    Returns:
        (N, L) int64; the newest item of each history at position L - 1.

    Raises:
        ValueError: max_length < 1.
    """
    if max_length < 1:
        raise ValueError(f"max_length={max_length} must be at least 1")
    padded = torch.zeros(len(histories), max_length, dtype=torch.int64)
    for row, items in enumerate(histories):
        kept = list(items)[-max_length:]
        if kept:
            padded[row, -len(kept) :] = torch.as_tensor(kept, dtype=torch.int64)
    return padded


def export_sequence_model(
    config: ExportConfig,
    train_dir: Path,
    transform_path: Path,
    sequences_dir: Path,
    item_field: str,
    metrics_path: Path | None,
    out_dir: Path,
    k: int = 10,
) -> ExportResult:
    """Write the top-K package and check that ONNX and TorchScript rank like the model.

    Args:
        config: The export config (model_name, parity_rows, parity_atol, opset).
        train_dir: The train stage's output (model_config.json, model.safetensors).
        transform_path: The fitted transform file of the preprocess stage.
        sequences_dir: The preprocess stage's sequence directory (test.parquet).
        item_field: The item's sparse field in the transform (raw ids of item indices).
        metrics_path: The evaluation's metrics.json for the model card, or None.
        out_dir: The package directory; created if missing.
        k: K, the recommendations per user.

    Returns:
        The package and its parity figures (`top_k_match_*`: the share of parity rows
        whose top-K item ids the runtime reproduced exactly).

    Raises:
        InputNotFoundError: A model file, the transform, test.parquet or the metrics is
            missing.
        SchemaError: The model config is not SASRec's, the transform has no usable entry
            for item_field or its size disagrees with num_items, or test.parquet has no
            `history` column, no rows or item indices outside [0, num_items).
        ConfigError: k is out of range.
        ParityError: ONNX or TorchScript return other top-K items than the reference for
            some row, or scores further than parity_atol from it.
    """
    out_dir = Path(out_dir)
    inputs = load_package_inputs(
        config, train_dir, transform_path, sequences_dir, item_field, metrics_path, MODEL_KIND
    )
    graph = _served_graph(inputs.model, inputs.history, k)
    parity = write_package(
        graph,
        out_dir,
        opset=config.opset,
        atol=config.parity_atol,
        describe_failure=lambda parity: _parity_failure(parity, k, config.parity_atol),
        parity_files=dict(zip(OUTPUT_NAMES, graph.expected, strict=True)),
        train_dir=Path(train_dir),
        transform_path=transform_path,
        signature=_signature(config, inputs.model_config, k, inputs.items),
    )
    description = _model_description(inputs.model_config, k)
    parity_lines = [
        f"Top {k} on the first {parity.rows} {PARITY_SPLIT} histories (`parity/`), compared "
        f"with the trained torch model: item ids exactly, scores within {config.parity_atol:g}.",
        "",
        *parity_table(parity, config.opset, exact_column="rows with identical top-K"),
    ]
    card = sequence_model_card(config, inputs, description, parity_lines)
    return ExportResult(out_dir, parity, finish_package(out_dir, inputs.items, card))


def _served_graph(model: SASRec, history: torch.Tensor, k: int) -> ServedGraph:
    """The top-K scorer on the parity histories, with the independent reference top K."""
    scorer = TopKScorer(model, k).eval()
    expected_items, expected_scores = reference_top_k(model, history, k)  # (N, K) each
    return ServedGraph(
        module=scorer,
        input_names=(INPUT_NAME,),
        output_names=OUTPUT_NAMES,
        sample=(history,),
        expected=(expected_items, expected_scores),
        # Trace on 2 rows (repeated if the sample has 1), fewer than the parity sample in
        # general, so scoring the sample also checks that the batch axis is really dynamic.
        example=(history[torch.arange(2) % len(history)],),
        dynamic_axes={name: {0: "batch"} for name in (INPUT_NAME, *OUTPUT_NAMES)},
        exact=frozenset({OUTPUT_NAMES[0]}),
    )


def _parity_failure(parity: Parity, k: int, atol: float) -> str:
    return (
        f"exported top-{k} lists disagree with the trained model on the {parity.rows} "
        f"{PARITY_SPLIT} histories checked: ONNX {parity.rows_differing_onnx} rows with other "
        f"item ids, max |score diff| {parity.max_abs_diff_onnx:.3g}; TorchScript "
        f"{parity.rows_differing_torchscript} rows, max |score diff| "
        f"{parity.max_abs_diff_torchscript:.3g} (parity_atol {atol:g}); check the model for "
        "ops that export changes, or for near-tied scores"
    )


@dataclass(frozen=True)
class ItemIndex:
    """How a sequence model's item indices map to the raw ids of the item field.

    Attributes:
        field: The schema's item field.
        kind: "vocab" (index i >= 1 is the vocabulary's value i - 1) or "hash".
        ids: The raw id of every index (None at index 0) for a vocabulary, else None.
    """

    field: str
    kind: str
    ids: list[Any] | None

    def description(self) -> str:
        """The model card's and signature's sentence about the item indices."""
        if self.kind == "vocab":
            return (
                f"Item indices are the vocabulary of `{self.field}` in transform.json: index "
                f"i >= 1 is raw id `item_ids.json[i]` (= `sparse.{self.field}.values[i - 1]`); "
                "index 0 is padding and out-of-vocabulary."
            )
        return (
            f"Item indices are hash buckets of `{self.field}` (see `hash` in transform.json); "
            "several raw ids may share a bucket and there is no inverse mapping. Index 0 is "
            "padding."
        )

    def signature(self) -> dict[str, Any]:
        """The signature's "items" entry."""
        return {
            "field": self.field,
            "kind": self.kind,
            "index_to_id": ITEM_IDS_FILE if self.kind == "vocab" else None,
            "description": self.description(),
        }


@dataclass(frozen=True)
class PackageInputs:
    """What a sequence package is made from, loaded and checked (`load_package_inputs`).

    Attributes:
        model: The trained model, fp32, eval mode.
        model_config: Its model_config.json.
        items: The item field's index -> raw id mapping.
        history: (N, max_length) int64 parity histories, left-padded with 0.
        metrics: The evaluation's metrics, or None.
    """

    model: Any
    model_config: dict[str, Any]
    items: ItemIndex
    history: torch.Tensor
    metrics: dict[str, Any] | None


def load_package_inputs(
    config: ExportConfig,
    train_dir: Path,
    transform_path: Path,
    sequences_dir: Path,
    item_field: str,
    metrics_path: Path | None,
    kind: str,
) -> PackageInputs:
    """Load the model, the item mapping, the parity histories and the metrics.

    Args:
        config: The export config (parity_rows).
        train_dir: The train stage's output.
        transform_path: The fitted transform file.
        sequences_dir: Preprocess's `sequences/` (test.parquet).
        item_field: The schema's item field.
        metrics_path: The evaluation's metrics.json, or None.
        kind: The model the caller packages (a `SEQUENCE_MODEL_REGISTRY` name).

    Returns:
        The loaded inputs.

    Raises:
        InputNotFoundError: A model file, the transform, the metrics or test.parquet is
            missing.
        SchemaError: The model is not `kind`, or the transform, the sequences and the
            model disagree (see `load_sequence_model`, `parity_histories`).
    """
    check_files_exist(transform_path, metrics_path)
    model, model_config = load_sequence_model(Path(train_dir), kind=kind)
    num_items, max_length = model_config["num_items"], model_config["max_length"]
    transform = json.loads(Path(transform_path).read_text())
    ids = _item_ids(transform, item_field, num_items, Path(transform_path))
    items = ItemIndex(item_field, transform["sparse"][item_field]["kind"], ids)
    history = parity_histories(Path(sequences_dir), config.parity_rows, max_length, num_items)
    return PackageInputs(model, model_config, items, history, read_metrics(metrics_path))


def sequence_model_card(
    config: ExportConfig,
    inputs: PackageInputs,
    description: str,
    parity_lines: list[str],
) -> str:
    """A sequence package's model card: model, items, metrics, parity.

    Args:
        config: The export config (model_name).
        inputs: The package's inputs (model config, items, metrics).
        description: The "Model" section's sentence.
        parity_lines: The "Parity" section.

    Returns:
        The markdown text.
    """
    return model_card(
        config.model_name,
        [
            ("Model", model_section(description, inputs.model_config)),
            ("Items", [inputs.items.description()]),
            ("Metrics", metrics_lines(inputs.metrics)),
            ("Parity", parity_lines),
        ],
    )


def finish_package(out_dir: Path, items: ItemIndex, card: str) -> list[str]:
    """Write item_ids.json (vocabulary items) and model_card.md; the package's files."""
    if items.ids is not None:
        (out_dir / ITEM_IDS_FILE).write_text(json.dumps(items.ids) + "\n")
    (out_dir / MODEL_CARD_FILE).write_text(card)
    return package_files(out_dir)


def _item_ids(
    transform: dict[str, Any], item_field: str, num_items: int, transform_path: Path
) -> list[Any] | None:
    """Raw id of every item index (None at index 0) for a vocabulary field, None for a hash."""
    entry = transform.get("sparse", {}).get(item_field)
    if entry is None:
        raise SchemaError(
            f"{transform_path} has no sparse field {item_field!r} (it has "
            f"{sorted(transform.get('sparse', {}))}); pass the item field the sequences use"
        )
    kind = entry.get("kind")
    if kind == "vocab":
        size = len(entry["values"]) + 1
    elif kind == "hash":
        size = entry.get("num_embeddings", num_items)
    else:
        raise SchemaError(
            f"{transform_path}: field {item_field!r} has kind {kind!r}, not 'vocab' or 'hash'"
        )
    if size != num_items:
        raise SchemaError(
            f"{transform_path}: field {item_field!r} has {size} indices but the model has "
            f"num_items={num_items}; export the transform the model was trained with"
        )
    return [None, *entry["values"]] if kind == "vocab" else None


def parity_histories(
    sequences_dir: Path, rows: int, max_length: int, num_items: int
) -> torch.Tensor:
    """The first `rows` test histories, padded: (N, max_length) int64, N >= 1.

    Raises:
        InputNotFoundError: test.parquet is missing.
        SchemaError: It has no history column, no rows, or item indices outside
            [0, num_items).
    """
    path = sequences_dir / f"{PARITY_SPLIT}.parquet"
    if not path.is_file():
        raise InputNotFoundError(f"{path} does not exist; run the preprocess stage first")
    parquet = pq.ParquetFile(path)
    if INPUT_NAME not in parquet.schema_arrow.names:
        raise SchemaError(
            f"{path} has no {INPUT_NAME!r} column (columns: {parquet.schema_arrow.names})"
        )
    histories: list[list[int]] = []
    # Read batch by batch: the test split can be large and parity needs its head only.
    for batch in parquet.iter_batches(batch_size=rows, columns=[INPUT_NAME]):
        histories += [items or [] for items in batch.column(0).to_pylist()]
        if len(histories) >= rows:
            break
    if not histories:
        raise SchemaError(f"{path} has no rows for the parity check")
    history = pad_histories(histories[:rows], max_length)
    if history.min() < 0 or history.max() >= num_items:
        raise SchemaError(
            f"{path}: item indices span [{int(history.min())}, {int(history.max())}], outside "
            f"[0, num_items={num_items}); export the sequences the model was trained on"
        )
    return history


def _model_description(model_config: dict[str, Any], k: int) -> str:
    max_length = model_config["max_length"]
    return (
        f"SASRec next-item recommender ({model_config['num_blocks']} causal Transformer "
        f"blocks over the last {max_length} items, {model_config['num_items']} item indices). "
        f"Input `{INPUT_NAME}` int64 (B, {max_length}): item indices oldest first, left-padded "
        f"with {PADDING_ITEM}. Outputs `items` int64 (B, {k}) and `scores` float32 (B, {k}): "
        "the top items best first, excluding padding and the items of the history."
    )


def _signature(
    config: ExportConfig, model_config: dict[str, Any], k: int, items: ItemIndex
) -> dict[str, Any]:
    max_length = model_config["max_length"]
    return {
        "model_name": config.model_name,
        "model": MODEL_KIND,
        "inputs": [
            {
                "name": INPUT_NAME,
                "dtype": "int64",
                "shape": ["batch", max_length],
                "description": "item indices the user interacted with, oldest first, the "
                f"newest {max_length} kept, left-padded with {PADDING_ITEM}",
                "num_items": model_config["num_items"],
                "padding": PADDING_ITEM,
            }
        ],
        "outputs": [
            {
                "name": OUTPUT_NAMES[0],
                "dtype": "int64",
                "shape": ["batch", k],
                "description": "the k highest-scoring next items, best first; never the "
                "padding item nor an item of the history",
            },
            {
                "name": OUTPUT_NAMES[1],
                "dtype": "float32",
                "shape": ["batch", k],
                "description": "their scores (dot products with the user state), descending",
            },
        ],
        "k": k,
        "max_length": max_length,
        "padding_item": PADDING_ITEM,
        "items": items.signature(),
        "files": dict(RUNTIME_FILES),
    }
