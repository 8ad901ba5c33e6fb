"""Export stage for BST: package a CTR sequence model as a candidate scorer, prove parity.

BST scores one (history, candidate) pair per Transformer pass, so the served graph
scores the candidates a retrieval stage hands it rather than ranking every item.

Reads `<train_dir>/model_config.json` (`{"model": "bst", ...}`), `model.safetensors`,
the fitted transform file, the first rows of `<sequences_dir>/test.parquet` (`history`,
`target`) and optionally metrics.json. Writes into `out_dir`:

- `model.safetensors`, `model_config.json`, `transform.json`: copies;
- `model.onnx`: inputs `history` int64 (B, max_length), item indices oldest first,
  left-padded with 0, and `candidates` int64 (B, C); output `scores` float32 (B, C), the
  click probability of each candidate as the next item; batch and C are dynamic;
- `model.ts`: the same graph as TorchScript;
- `item_ids.json` (vocabulary item fields): the raw id of index i at position i;
- `signature.json`, `model_card.md`;
- `parity/inputs.npz` (keys `history`, `candidates`: each parity row's test target and
  `PARITY_NEGATIVES` seeded uniform items), `parity/scores.npy`: the trained model's
  probabilities, which onnxruntime and TorchScript must match within `parity_atol`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import torch
from torch import nn

from training.config import ExportConfig
from training.packaging import (
    PARITY_SPLIT,
    RUNTIME_FILES,
    ExportResult,
    Parity,
    ServedGraph,
    parity_table,
    write_package,
)
from training.sequence.bst import BST, score_candidates
from training.sequence.export import (
    ItemIndex,
    finish_package,
    load_package_inputs,
    sequence_model_card,
)

MODEL_KIND = "bst"
INPUT_NAMES = ("history", "candidates")
OUTPUT_NAME = "scores"
PARITY_NEGATIVES = 20
_PARITY_SEED = 0


class CandidateScorer(nn.Module):
    """The served graph: click probabilities of each candidate after the history.

    Args:
        model: The trained BST.
    """

    def __init__(self, model: BST) -> None:
        super().__init__()
        self.model = model

    def forward(self, history: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """Args: history (B, L) int64, left-padded; candidates (B, C) int64.

        Returns:
            (B, C) float32 probabilities.
        """
        return torch.sigmoid(score_candidates(self.model, history, candidates))


def export_bst_model(
    config: ExportConfig,
    train_dir: Path,
    transform_path: Path,
    sequences_dir: Path,
    item_field: str,
    metrics_path: Path | None,
    out_dir: Path,
) -> ExportResult:
    """Write the BST package and check that ONNX and TorchScript match torch.

    Args:
        config: The export config (parity_rows, parity_atol, opset, model_name).
        train_dir: The train stage's output (a BST).
        transform_path: The fitted transform file.
        sequences_dir: Preprocess's `sequences/` (test.parquet for the parity sample).
        item_field: The schema's item field (for item_ids.json).
        metrics_path: The evaluation's metrics.json, or None.
        out_dir: The package directory; created if missing.

    Returns:
        The package and its parity figures.

    Raises:
        InputNotFoundError: A model file, the transform, the metrics or test.parquet is
            missing.
        SchemaError: The model is not a BST, or the transform, the sequences and the
            model disagree.
        ParityError: ONNX or TorchScript probabilities differ by more than parity_atol.
    """
    out_dir = Path(out_dir)
    inputs = load_package_inputs(
        config, train_dir, transform_path, sequences_dir, item_field, metrics_path, MODEL_KIND
    )
    num_items = inputs.model_config["num_items"]
    candidates = _parity_candidates(Path(sequences_dir), len(inputs.history), num_items)
    graph = _served_graph(inputs.model, inputs.history, candidates)
    parity = write_package(
        graph,
        out_dir,
        opset=config.opset,
        atol=config.parity_atol,
        describe_failure=lambda parity: _parity_failure(
            parity, candidates.shape[1], config.parity_atol
        ),
        parity_files={OUTPUT_NAME: graph.expected[0]},
        train_dir=Path(train_dir),
        transform_path=transform_path,
        signature=_signature(config, inputs.model_config, inputs.items),
    )
    card = sequence_model_card(
        config,
        inputs,
        _model_description(inputs.model_config),
        _parity_lines(config, parity),
    )
    return ExportResult(out_dir, parity, finish_package(out_dir, inputs.items, card))


def _served_graph(model: BST, history: torch.Tensor, candidates: torch.Tensor) -> ServedGraph:
    """The candidate scorer on the parity sample, with the trained model's probabilities."""
    scorer = CandidateScorer(model).eval()
    with torch.no_grad():
        expected = scorer(history, candidates).numpy()  # (N, C) float32
    return ServedGraph(
        module=scorer,
        input_names=INPUT_NAMES,
        output_names=(OUTPUT_NAME,),
        sample=(history, candidates),
        expected=(expected,),
        # Traced on 2 rows and 3 candidates: scoring the parity sample checks both
        # dynamic axes.
        example=(history[torch.arange(2) % len(history)], candidates[:1, :3].expand(2, 3)),
        dynamic_axes={
            "history": {0: "batch"},
            "candidates": {0: "batch", 1: "candidates"},
            OUTPUT_NAME: {0: "batch", 1: "candidates"},
        },
    )


def _parity_failure(parity: Parity, num_candidates: int, atol: float) -> str:
    return (
        f"exported BST differs from the trained model on {parity.rows} {PARITY_SPLIT} "
        f"histories x {num_candidates} candidates: max |diff| ONNX "
        f"{parity.max_abs_diff_onnx:.3g}, TorchScript {parity.max_abs_diff_torchscript:.3g} "
        f"> parity_atol {atol:g}"
    )


def _parity_candidates(sequences_dir: Path, rows: int, num_items: int) -> torch.Tensor:
    """(rows, 1 + PARITY_NEGATIVES): each row's test target, then seeded uniform items."""
    path = sequences_dir / f"{PARITY_SPLIT}.parquet"
    targets: list[int] = []
    for batch in pq.ParquetFile(path).iter_batches(batch_size=rows, columns=["target"]):
        targets += batch.column(0).to_pylist()
        if len(targets) >= rows:
            break
    generator = torch.Generator().manual_seed(_PARITY_SEED)
    others = torch.randint(1, num_items, (rows, PARITY_NEGATIVES), generator=generator)
    return torch.cat([torch.as_tensor(targets[:rows]).unsqueeze(1), others], dim=1)


def _signature(
    config: ExportConfig, model_config: dict[str, Any], items: ItemIndex
) -> dict[str, Any]:
    max_length = model_config["max_length"]
    return {
        "model_name": config.model_name,
        "model": MODEL_KIND,
        "inputs": [
            {
                "name": "history",
                "dtype": "int64",
                "shape": ["batch", max_length],
                "description": "item indices the user interacted with, oldest first, the "
                f"newest {max_length} kept, left-padded with 0",
            },
            {
                "name": "candidates",
                "dtype": "int64",
                "shape": ["batch", "candidates"],
                "description": "item indices to score as the user's next item",
            },
        ],
        "outputs": [
            {
                "name": OUTPUT_NAME,
                "dtype": "float32",
                "shape": ["batch", "candidates"],
                "description": "click probability of each candidate",
            }
        ],
        "max_length": max_length,
        "padding_item": 0,
        "items": items.signature(),
        "files": dict(RUNTIME_FILES),
    }


def _model_description(model_config: dict[str, Any]) -> str:
    return (
        f"BST (Behavior Sequence Transformer) candidate scorer: {model_config['num_blocks']} "
        f"Transformer blocks over the last {model_config['max_length']} items with the "
        "candidate appended; inputs `history` and `candidates`, output `scores` "
        "(click probabilities)."
    )


def _parity_lines(config: ExportConfig, parity: Parity) -> list[str]:
    return [
        f"{parity.rows} {PARITY_SPLIT} histories x {1 + PARITY_NEGATIVES} candidates "
        f"(`parity/`), compared with the trained torch model (tolerance {config.parity_atol:g}).",
        "",
        *parity_table(parity, config.opset),
    ]
