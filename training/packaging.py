"""The export skeleton both model families fill in: runtimes, parity and package files.

A family describes its served graph (`ServedGraph`: the scoring module, the parity
sample, the reference outputs) and its signature and model card; `write_package` does
the rest, the same way for every model:

- `model.onnx` (`torch.onnx.export`, checked by `onnx.checker`) and `model.ts`
  (`torch.jit.trace`), both traced on `ServedGraph.example`;
- parity: onnxruntime and TorchScript score the parity sample; outputs named in
  `ServedGraph.exact` must equal the reference row for row, the others within `atol`,
  else ParityError (nothing of the parity sample is written then, so a failed staging
  directory never looks whole);
- `parity/inputs.npz` (keys = the ONNX input names) and one `parity/<name>.npy` per
  reference array; copies of `model.safetensors`, `model_config.json` and the fitted
  transform (`transform.json`); `signature.json`.

The family then adds its own files and the model card (`model_card` frames it). A new
export format is one more step here, for every model at once.

Reads `<train_dir>/model_config.json`, `<train_dir>/model.safetensors` and the
transform file; writes only into the package directory.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from artifacts.errors import InputNotFoundError
from training.errors import ParityError
from training.runtime.files import MODEL_CONFIG_FILE, WEIGHTS_FILE

PARITY_SPLIT = "test"
PARITY_DIR = "parity"
PARITY_INPUTS_FILE = "inputs.npz"
ONNX_FILE = "model.onnx"
TORCHSCRIPT_FILE = "model.ts"
TRANSFORM_FILE = "transform.json"
SIGNATURE_FILE = "signature.json"
MODEL_CARD_FILE = "model_card.md"
# What every signature's "files" entry lists (a family may add its own files).
RUNTIME_FILES = {"onnx": ONNX_FILE, "torchscript": TORCHSCRIPT_FILE, "transform": TRANSFORM_FILE}


def max_abs_diff(expected: np.ndarray, actual: np.ndarray) -> float:
    """Largest |expected - actual| in float64; inf when the shapes differ, NaN stays NaN.

    Args:
        expected: The reference array.
        actual: The array to compare, of the same shape.

    Returns:
        The largest absolute difference.
    """
    if expected.shape != actual.shape:
        return float("inf")
    return float(np.max(np.abs(expected.astype(np.float64) - actual.astype(np.float64))))


def rows_differing(expected: Sequence[np.ndarray], actual: Sequence[np.ndarray]) -> int:
    """Rows where any of the arrays differs from its reference (all rows, if a shape does).

    Args:
        expected: Reference arrays, each (N, ...).
        actual: The arrays to compare, in the same order.

    Returns:
        How many of the N rows are not equal in every array.
    """
    if not expected:
        return 0
    rows = len(expected[0])
    differ = np.zeros(rows, dtype=bool)
    for reference, other in zip(expected, actual, strict=True):
        if reference.shape != other.shape:
            return rows
        differ |= (reference != other).reshape(rows, -1).any(axis=1)
    return int(differ.sum())


def check_files_exist(*paths: Path | None) -> None:
    """Refuse a missing input file before anything is written (None means not given).

    Args:
        *paths: The files to check.

    Raises:
        InputNotFoundError: One of them does not exist.
    """
    for path in paths:
        if path is not None and not Path(path).is_file():
            raise InputNotFoundError(f"{path} does not exist")


def read_model_files(train_dir: Path) -> tuple[dict[str, Any], Path, Path]:
    """The train output's model config and where its config and weights are.

    Args:
        train_dir: The train stage's output directory.

    Returns:
        (model config as parsed JSON, model_config.json path, model.safetensors path).

    Raises:
        InputNotFoundError: One of the two files is missing.
    """
    config_path = Path(train_dir) / MODEL_CONFIG_FILE
    weights_path = Path(train_dir) / WEIGHTS_FILE
    for path in (config_path, weights_path):
        if not path.is_file():
            raise InputNotFoundError(f"{path} does not exist; run the train stage first")
    return json.loads(config_path.read_text()), config_path, weights_path


def read_metrics(metrics_path: Path | None) -> dict[str, Any] | None:
    """The evaluation's metrics.json for the model card, or None when not given."""
    return json.loads(Path(metrics_path).read_text()) if metrics_path is not None else None


@dataclass(frozen=True)
class ServedGraph:
    """What a family hands the skeleton: the graph to serve and its parity sample.

    Attributes:
        module: The scoring module in eval mode; its forward takes `sample`'s tensors
            in order and returns one tensor or a tuple of them (one per output name).
        input_names: The ONNX input names, one per tensor of `sample`.
        output_names: The ONNX output names, in the order `module` returns them.
        sample: The parity sample, each (N, ...).
        expected: The reference output of each output name on `sample`, in order:
            the trained model's answer the runtimes must reproduce.
        example: The tracing input; smaller than `sample` along its dynamic axes, so
            scoring the sample also checks that those axes are really dynamic.
        dynamic_axes: `torch.onnx.export`'s dynamic_axes (name -> {axis: label}).
        exact: Output names compared exactly (every row must match); the others are
            compared within the tolerance.
    """

    module: nn.Module
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    sample: tuple[torch.Tensor, ...]
    expected: tuple[np.ndarray, ...]
    example: tuple[torch.Tensor, ...]
    dynamic_axes: dict[str, dict[int, str]]
    exact: frozenset[str] = field(default_factory=frozenset)

    def inputs(self) -> dict[str, np.ndarray]:
        """The parity sample keyed by ONNX input name (what onnxruntime takes)."""
        return {
            name: tensor.numpy() for name, tensor in zip(self.input_names, self.sample, strict=True)
        }


@dataclass(frozen=True)
class Parity:
    """How the exported runtimes compare with the reference on the parity sample.

    Attributes:
        rows: Rows in the parity sample.
        max_abs_diff_onnx: Largest |reference - onnxruntime| over the tolerance outputs.
        max_abs_diff_torchscript: The same for TorchScript.
        rows_differing_onnx: Rows where an exact output of onnxruntime differs.
        rows_differing_torchscript: The same for TorchScript.
    """

    rows: int
    max_abs_diff_onnx: float
    max_abs_diff_torchscript: float
    rows_differing_onnx: int
    rows_differing_torchscript: int

    def passed(self, atol: float) -> bool:
        """Whether every exact output matches and every other is within `atol`."""
        close = self.max_abs_diff_onnx <= atol and self.max_abs_diff_torchscript <= atol
        # A NaN difference compares False above, so it fails too.
        return close and self.rows_differing_onnx == 0 and self.rows_differing_torchscript == 0


@dataclass(frozen=True)
class ExportResult:
    """An exported model package and its parity figures (every family's export returns one).

    Attributes:
        out_dir: The package directory.
        parity: How onnxruntime and TorchScript compared with the reference.
        files: The package's files, relative to out_dir, sorted.
        infra_validation: The infra validation report without its scores, for a package
            that was infra-validated (CTR: `training.ctr.package.infra_validate`), else None.
    """

    out_dir: Path
    parity: Parity
    files: list[str]
    infra_validation: dict[str, Any] | None = None

    @property
    def parity_rows(self) -> int:
        """Rows in the parity sample."""
        return self.parity.rows

    @property
    def parity_max_abs_diff_onnx(self) -> float:
        """Largest |reference - onnxruntime| over the outputs compared within tolerance."""
        return self.parity.max_abs_diff_onnx

    @property
    def parity_max_abs_diff_torchscript(self) -> float:
        """Largest |reference - TorchScript| over the outputs compared within tolerance."""
        return self.parity.max_abs_diff_torchscript

    @property
    def top_k_match_onnx(self) -> float:
        """Share of parity rows whose exact outputs (a top-K recommender's item ids)
        onnxruntime reproduced: 1.0 in a package that passed, and where none are exact."""
        return 1.0 - self.parity.rows_differing_onnx / self.parity.rows

    @property
    def top_k_match_torchscript(self) -> float:
        """The same share for TorchScript."""
        return 1.0 - self.parity.rows_differing_torchscript / self.parity.rows


def write_package(
    graph: ServedGraph,
    out_dir: Path,
    *,
    opset: int,
    atol: float,
    describe_failure: Callable[[Parity], str],
    parity_files: Mapping[str, np.ndarray],
    train_dir: Path,
    transform_path: Path,
    signature: Mapping[str, Any],
    model_config: Mapping[str, Any] | None = None,
) -> Parity:
    """Export the runtimes, check their parity, then write the package's common files.

    Args:
        graph: The served graph and its parity sample.
        out_dir: The package directory; created if missing.
        opset: The ONNX opset.
        atol: The largest allowed |reference - runtime| of a tolerance output.
        describe_failure: The ParityError message for a failed check (say what was
            compared and what to change).
        parity_files: `parity/<name>.npy` files to write once parity holds.
        train_dir: The train output (model.safetensors, model_config.json are copied).
        transform_path: The fitted transform, copied as transform.json.
        signature: The signature.json content.
        model_config: Written as model_config.json (indent 2) when given; None copies
            the train output's file as it is.

    Returns:
        The parity figures.

    Raises:
        ParityError: A runtime's output differs from the reference (see `Parity.passed`).
    """
    out_dir = Path(out_dir)
    (out_dir / PARITY_DIR).mkdir(parents=True, exist_ok=True)
    export_runtimes(graph, out_dir, opset)
    parity = check_parity(graph, out_dir)
    if not parity.passed(atol):
        raise ParityError(describe_failure(parity))
    np.savez(out_dir / PARITY_DIR / PARITY_INPUTS_FILE, **graph.inputs())
    for name, array in parity_files.items():
        np.save(out_dir / PARITY_DIR / f"{name}.npy", array)
    shutil.copyfile(Path(train_dir) / WEIGHTS_FILE, out_dir / WEIGHTS_FILE)
    if model_config is None:
        shutil.copyfile(Path(train_dir) / MODEL_CONFIG_FILE, out_dir / MODEL_CONFIG_FILE)
    else:
        (out_dir / MODEL_CONFIG_FILE).write_text(json.dumps(model_config, indent=2) + "\n")
    shutil.copyfile(transform_path, out_dir / TRANSFORM_FILE)
    (out_dir / SIGNATURE_FILE).write_text(json.dumps(signature, indent=2) + "\n")
    return parity


def export_runtimes(graph: ServedGraph, out_dir: Path, opset: int) -> None:
    """Write `model.onnx` (checked by onnx.checker) and `model.ts`, traced on the example.

    Args:
        graph: The served graph.
        out_dir: The package directory (exists).
        opset: The ONNX opset.
    """
    # Imported here, not at the top: training ranks import this module (through the
    # model's `read_model_files`), and onnx costs them ~1 s and ~20 MB each at start-up.
    import onnx

    onnx_path = Path(out_dir) / ONNX_FILE
    torch.onnx.export(
        graph.module,
        graph.example,
        str(onnx_path),
        input_names=list(graph.input_names),
        output_names=list(graph.output_names),
        dynamic_axes=graph.dynamic_axes,
        opset_version=opset,
        dynamo=False,
    )
    onnx.checker.check_model(str(onnx_path))
    with torch.no_grad():
        traced = torch.jit.trace(graph.module, graph.example)
    torch.jit.save(traced, str(Path(out_dir) / TORCHSCRIPT_FILE))


def check_parity(graph: ServedGraph, out_dir: Path) -> Parity:
    """Score the parity sample with the package's onnxruntime and TorchScript files.

    Args:
        graph: The served graph (its `expected` is the reference).
        out_dir: The package directory holding model.onnx and model.ts.

    Returns:
        The parity figures (see `Parity.passed` for the verdict).
    """
    import onnxruntime  # not at the top: see export_runtimes

    session = onnxruntime.InferenceSession(
        str(Path(out_dir) / ONNX_FILE), providers=["CPUExecutionProvider"]
    )
    onnx_outputs = tuple(session.run(list(graph.output_names), graph.inputs()))
    with torch.no_grad():
        scripted = torch.jit.load(str(Path(out_dir) / TORCHSCRIPT_FILE))(*graph.sample)
    scripted = scripted if isinstance(scripted, tuple) else (scripted,)
    ts_outputs = tuple(tensor.numpy() for tensor in scripted)
    return Parity(
        rows=len(graph.sample[0]),
        max_abs_diff_onnx=_tolerance_diff(graph, onnx_outputs),
        max_abs_diff_torchscript=_tolerance_diff(graph, ts_outputs),
        rows_differing_onnx=_exact_rows_differing(graph, onnx_outputs),
        rows_differing_torchscript=_exact_rows_differing(graph, ts_outputs),
    )


def _tolerance_diff(graph: ServedGraph, outputs: tuple[np.ndarray, ...]) -> float:
    """Largest difference over the outputs not compared exactly (NaN if any is NaN)."""
    diffs = [
        max_abs_diff(expected, actual)
        for name, expected, actual in zip(graph.output_names, graph.expected, outputs, strict=True)
        if name not in graph.exact
    ]
    # max() would hide a NaN behind a larger number; NaN must fail the check.
    return float(np.max(diffs)) if diffs else 0.0


def _exact_rows_differing(graph: ServedGraph, outputs: tuple[np.ndarray, ...]) -> int:
    pairs = [
        (expected, actual)
        for name, expected, actual in zip(graph.output_names, graph.expected, outputs, strict=True)
        if name in graph.exact
    ]
    return rows_differing([e for e, _ in pairs], [a for _, a in pairs])


def package_files(out_dir: Path) -> list[str]:
    """The package's files, relative to out_dir, sorted."""
    return sorted(
        p.relative_to(out_dir).as_posix() for p in Path(out_dir).rglob("*") if p.is_file()
    )


def metrics_lines(metrics: Mapping[str, Any] | None) -> list[str]:
    """The model card's metrics as markdown table lines ("Not evaluated." without any)."""
    if metrics is None:
        return ["Not evaluated."]
    return ["| metric | value |", "|---|---|", *(f"| {k} | {v} |" for k, v in metrics.items())]


def parity_table(parity: Parity, opset: int, exact_column: str | None = None) -> list[str]:
    """The model card's parity table: one row per runtime.

    Args:
        parity: The parity figures.
        opset: The ONNX opset, named in the onnxruntime row.
        exact_column: The header of a column of rows whose exact outputs match (e.g.
            "rows with identical top-K"); None for a table of differences only.

    Returns:
        Markdown table lines.
    """
    if exact_column is None:
        return [
            "| runtime | max abs diff |",
            "|---|---|",
            f"| onnxruntime (opset {opset}) | {parity.max_abs_diff_onnx:.3g} |",
            f"| TorchScript | {parity.max_abs_diff_torchscript:.3g} |",
        ]
    rows = parity.rows
    return [
        f"| runtime | {exact_column} | max abs score diff |",
        "|---|---|---|",
        f"| onnxruntime (opset {opset}) | {rows - parity.rows_differing_onnx} / {rows} "
        f"| {parity.max_abs_diff_onnx:.3g} |",
        f"| TorchScript | {rows - parity.rows_differing_torchscript} / {rows} "
        f"| {parity.max_abs_diff_torchscript:.3g} |",
    ]


def model_section(description: str, model_config: Mapping[str, Any]) -> list[str]:
    """The model card's "Model" section body: a description and the model config."""
    return [description, "", "```json", json.dumps(model_config, indent=2), "```"]


def model_card(model_name: str, sections: Sequence[tuple[str, Sequence[str]]]) -> str:
    """A model card: the model's name, then one `## title` section per (title, lines).

    Args:
        model_name: The registry name, the card's title.
        sections: (title, body lines) in order.

    Returns:
        The markdown text.
    """
    lines = [f"# {model_name}", ""]
    for title, body in sections:
        lines += [f"## {title}", "", *body, ""]
    return "\n".join(lines)
