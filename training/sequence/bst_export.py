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

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime
import pyarrow.parquet as pq
import torch
from torch import nn

from data_prep.errors import InputNotFoundError, ParityError
from training.config import ExportConfig
from training.packaging import PARITY_SPLIT, max_abs_diff
from training.runtime.files import MODEL_CONFIG_FILE, WEIGHTS_FILE
from training.sequence.bst import BST, score_candidates
from training.sequence.export import (
    ITEM_IDS_FILE,
    _index_meaning,
    _item_ids,
    _parity_histories,
    load_sequence_model,
    metrics_lines,
)

INPUT_NAMES = ("history", "candidates")
OUTPUT_NAME = "scores"
PARITY_NEGATIVES = 20
_PARITY_SEED = 0


@dataclass(frozen=True)
class BSTExportResult:
    """An exported BST candidate scorer.

    Attributes:
        out_dir: The package directory.
        parity_rows: Test histories in the parity sample.
        parity_max_abs_diff_onnx: Largest |torch - onnxruntime| probability.
        parity_max_abs_diff_torchscript: Largest |torch - TorchScript| probability.
        files: The package's files, relative to out_dir, sorted.
    """

    out_dir: Path
    parity_rows: int
    parity_max_abs_diff_onnx: float
    parity_max_abs_diff_torchscript: float
    files: list[str]


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
) -> BSTExportResult:
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
    train_dir, out_dir = Path(train_dir), Path(out_dir)
    for path in (transform_path, metrics_path):
        if path is not None and not Path(path).is_file():
            raise InputNotFoundError(f"{path} does not exist")
    model, model_config = load_sequence_model(train_dir, kind="bst")
    num_items, max_length = model_config["num_items"], model_config["max_length"]
    transform = json.loads(Path(transform_path).read_text())
    item_ids = _item_ids(transform, item_field, num_items, Path(transform_path))
    history = _parity_histories(Path(sequences_dir), config.parity_rows, max_length, num_items)
    candidates = _parity_candidates(Path(sequences_dir), len(history), num_items)
    scorer = CandidateScorer(model).eval()
    with torch.no_grad():
        expected = scorer(history, candidates).numpy()  # (N, C)

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "parity").mkdir(exist_ok=True)
    # Traced on 2 rows and 3 candidates: scoring the parity sample checks both dynamic axes.
    example = (history[torch.arange(2) % len(history)], candidates[:1, :3].expand(2, 3))
    onnx_path = out_dir / "model.onnx"
    torch.onnx.export(
        scorer,
        example,
        str(onnx_path),
        input_names=list(INPUT_NAMES),
        output_names=[OUTPUT_NAME],
        dynamic_axes={
            "history": {0: "batch"},
            "candidates": {0: "batch", 1: "candidates"},
            OUTPUT_NAME: {0: "batch", 1: "candidates"},
        },
        opset_version=config.opset,
        dynamo=False,
    )
    onnx.checker.check_model(str(onnx_path))
    with torch.no_grad():
        traced = torch.jit.trace(scorer, example)
    ts_path = out_dir / "model.ts"
    torch.jit.save(traced, str(ts_path))

    inputs = {"history": history.numpy(), "candidates": candidates.numpy()}
    session = onnxruntime.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    onnx_scores = session.run([OUTPUT_NAME], inputs)[0]
    with torch.no_grad():
        ts_scores = torch.jit.load(str(ts_path))(history, candidates).numpy()
    diff_onnx = max_abs_diff(expected, onnx_scores)
    diff_ts = max_abs_diff(expected, ts_scores)
    if not (diff_onnx <= config.parity_atol and diff_ts <= config.parity_atol):
        raise ParityError(
            f"exported BST differs from the trained model on {len(history)} {PARITY_SPLIT} "
            f"histories x {candidates.shape[1]} candidates: max |diff| ONNX {diff_onnx:.3g}, "
            f"TorchScript {diff_ts:.3g} > parity_atol {config.parity_atol:g}"
        )

    np.savez(out_dir / "parity" / "inputs.npz", **inputs)
    np.save(out_dir / "parity" / "scores.npy", expected.astype(np.float32))
    shutil.copyfile(train_dir / WEIGHTS_FILE, out_dir / WEIGHTS_FILE)
    shutil.copyfile(train_dir / MODEL_CONFIG_FILE, out_dir / MODEL_CONFIG_FILE)
    shutil.copyfile(transform_path, out_dir / "transform.json")
    if item_ids is not None:
        (out_dir / ITEM_IDS_FILE).write_text(json.dumps(item_ids) + "\n")
    item_kind = transform["sparse"][item_field]["kind"]
    signature = _signature(config, model_config, item_field, item_kind)
    (out_dir / "signature.json").write_text(json.dumps(signature, indent=2) + "\n")
    metrics = json.loads(Path(metrics_path).read_text()) if metrics_path is not None else None
    card = _model_card(config, model_config, signature, metrics, len(history), diff_onnx, diff_ts)
    (out_dir / "model_card.md").write_text(card)
    files = sorted(p.relative_to(out_dir).as_posix() for p in out_dir.rglob("*") if p.is_file())
    return BSTExportResult(
        out_dir=out_dir,
        parity_rows=len(history),
        parity_max_abs_diff_onnx=diff_onnx,
        parity_max_abs_diff_torchscript=diff_ts,
        files=files,
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
    config: ExportConfig, model_config: dict[str, Any], item_field: str, item_kind: str
) -> dict[str, Any]:
    max_length = model_config["max_length"]
    return {
        "model_name": config.model_name,
        "model": "bst",
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
        "items": {
            "field": item_field,
            "kind": item_kind,
            "index_to_id": ITEM_IDS_FILE if item_kind == "vocab" else None,
            "description": _index_meaning(item_field, item_kind),
        },
        "files": {"onnx": "model.onnx", "torchscript": "model.ts", "transform": "transform.json"},
    }


def _model_card(
    config: ExportConfig,
    model_config: dict[str, Any],
    signature: dict[str, Any],
    metrics: dict[str, Any] | None,
    parity_rows: int,
    diff_onnx: float,
    diff_ts: float,
) -> str:
    lines = [
        f"# {config.model_name}",
        "",
        "## Model",
        "",
        f"BST (Behavior Sequence Transformer) candidate scorer: {model_config['num_blocks']} "
        f"Transformer blocks over the last {model_config['max_length']} items with the "
        "candidate appended; inputs `history` and `candidates`, output `scores` "
        "(click probabilities).",
        "",
        "```json",
        json.dumps(model_config, indent=2),
        "```",
        "",
        "## Items",
        "",
        signature["items"]["description"],
        "",
        "## Metrics",
        "",
    ]
    lines += metrics_lines(metrics)
    lines += [
        "",
        "## Parity",
        "",
        f"{parity_rows} {PARITY_SPLIT} histories x {1 + PARITY_NEGATIVES} candidates "
        f"(`parity/`), compared with the trained torch model (tolerance {config.parity_atol:g}).",
        "",
        "| runtime | max abs diff |",
        "|---|---|",
        f"| onnxruntime (opset {config.opset}) | {diff_onnx:.3g} |",
        f"| TorchScript | {diff_ts:.3g} |",
        "",
    ]
    return "\n".join(lines)
