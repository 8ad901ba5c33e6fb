"""The export skeleton on toy modules: runtimes, parity verdicts, package files, card frame."""

import json
from pathlib import Path

import numpy as np
import onnxruntime
import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from artifacts.errors import InputNotFoundError
from training.errors import ParityError
from training.packaging import (
    ExportResult,
    Parity,
    ServedGraph,
    check_files_exist,
    max_abs_diff,
    metrics_lines,
    model_card,
    model_section,
    package_files,
    parity_table,
    read_model_files,
    rows_differing,
    write_package,
)


class Linear2(nn.Module):
    """Two outputs: the top-2 column indices of a linear map (exact) and their scores."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(4, 6)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores, items = torch.topk(self.linear(x), 2, dim=1)  # (B, 2) each
        return items, scores


def make_graph(module: nn.Module, rows: int = 9) -> ServedGraph:
    x = torch.randn(rows, 4, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        items, scores = module(x)
    return ServedGraph(
        module=module.eval(),
        input_names=("x",),
        output_names=("items", "scores"),
        sample=(x,),
        expected=(items.numpy(), scores.numpy()),
        example=(x[:2],),
        dynamic_axes={name: {0: "batch"} for name in ("x", "items", "scores")},
        exact=frozenset({"items"}),
    )


@pytest.fixture
def train_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "train"
    directory.mkdir()
    save_file(Linear2().state_dict(), str(directory / "model.safetensors"))
    (directory / "model_config.json").write_text('{"model":"toy"}')
    return directory


def package(graph: ServedGraph, train_dir: Path, out_dir: Path, **overrides: object) -> Parity:
    transform = train_dir.parent / "transform.json"
    transform.write_text('{"sparse": {}}')
    arguments = {
        "opset": 17,
        "atol": 1e-5,
        "describe_failure": lambda parity: f"toy differs: {parity}",
        "parity_files": {"items": graph.expected[0], "scores": graph.expected[1]},
        "train_dir": train_dir,
        "transform_path": transform,
        "signature": {"model_name": "toy", "b": 1, "a": 2},
    }
    return write_package(graph, out_dir, **{**arguments, **overrides})


def test_max_abs_diff_and_rows_differing() -> None:
    a = np.array([[1.0, 2.0], [3.0, 4.0]], dtype=np.float32)
    assert max_abs_diff(a, a + np.float32(0.5)) == 0.5
    assert max_abs_diff(a, a[:1]) == float("inf")  # another shape never passes
    assert np.isnan(max_abs_diff(a, np.full_like(a, np.nan)))
    ids = np.array([[1, 2], [3, 4], [5, 6]])
    other = ids.copy()
    other[1, 1] = 9
    assert rows_differing([ids], [ids]) == 0
    assert rows_differing([ids], [other]) == 1
    assert rows_differing([ids], [ids[:2]]) == 3  # another shape: every row differs
    assert rows_differing([], []) == 0


def test_parity_verdict() -> None:
    def parity(onnx: float, ts: float, differ: int = 0) -> Parity:
        return Parity(10, onnx, ts, differ, 0)

    assert parity(1e-6, 1e-6).passed(1e-5)
    assert not parity(2e-5, 1e-6).passed(1e-5)
    assert not parity(1e-6, float("nan")).passed(1e-5)  # NaN fails, never passes
    assert not parity(0.0, 0.0, differ=1).passed(1e-5)  # an exact output differs
    result = ExportResult(Path("p"), Parity(10, 1e-6, 2e-6, 2, 5), ["a"])
    assert (result.parity_rows, result.parity_max_abs_diff_torchscript) == (10, 2e-6)
    assert (result.top_k_match_onnx, result.top_k_match_torchscript) == (0.8, 0.5)


def test_write_package_writes_runtimes_that_score_like_the_module(
    train_dir: Path, tmp_path: Path
) -> None:
    graph = make_graph(Linear2())
    out_dir = tmp_path / "pkg"
    parity = package(graph, train_dir, out_dir)

    assert parity.rows == 9 and parity.passed(1e-5)
    assert parity.rows_differing_onnx == parity.rows_differing_torchscript == 0
    assert package_files(out_dir) == [
        "model.onnx",
        "model.safetensors",
        "model.ts",
        "model_config.json",
        "parity/inputs.npz",
        "parity/items.npy",
        "parity/scores.npy",
        "signature.json",
        "transform.json",
    ]
    # The batch axis is dynamic: traced on 2 rows, the runtimes score 9 and 5.
    session = onnxruntime.InferenceSession(str(out_dir / "model.onnx"))
    x = np.load(out_dir / "parity" / "inputs.npz")["x"][:5]
    items, scores = session.run(["items", "scores"], {"x": x})
    np.testing.assert_array_equal(items, graph.expected[0][:5])
    np.testing.assert_allclose(scores, graph.expected[1][:5], atol=1e-6)
    scripted = torch.jit.load(str(out_dir / "model.ts"))
    np.testing.assert_array_equal(scripted(torch.from_numpy(x))[0].numpy(), items)
    # Copies as they are; the signature in the order given, not sorted.
    assert (out_dir / "model_config.json").read_text() == '{"model":"toy"}'
    assert list(json.loads((out_dir / "signature.json").read_text())) == ["model_name", "b", "a"]


def test_model_config_is_rewritten_when_given(train_dir: Path, tmp_path: Path) -> None:
    package(make_graph(Linear2()), train_dir, tmp_path / "pkg", model_config={"model": "toy"})
    text = (tmp_path / "pkg" / "model_config.json").read_text()
    assert text == '{\n  "model": "toy"\n}\n'


def test_an_exact_output_that_differs_fails_and_writes_no_parity_sample(
    train_dir: Path, tmp_path: Path
) -> None:
    graph = make_graph(Linear2())
    items, scores = graph.expected
    wrong = items.copy()
    wrong[3] = wrong[3, ::-1]  # one row's ids swapped
    bad = ServedGraph(**{**graph.__dict__, "expected": (wrong, scores)})
    with pytest.raises(ParityError, match="toy differs") as caught:
        package(bad, train_dir, tmp_path / "pkg")
    assert "rows_differing_onnx=1" in str(caught.value)
    assert "rows_differing_torchscript=1" in str(caught.value)
    assert not (tmp_path / "pkg" / "parity" / "inputs.npz").exists()  # nothing looks whole


def test_a_tolerance_output_beyond_atol_fails(train_dir: Path, tmp_path: Path) -> None:
    graph = make_graph(Linear2())
    items, scores = graph.expected
    shifted = ServedGraph(**{**graph.__dict__, "expected": (items, scores + np.float32(1e-3))})
    with pytest.raises(ParityError, match=r"max_abs_diff_onnx=0\.00(0999|100)") as caught:
        package(shifted, train_dir, tmp_path / "pkg")
    assert "rows_differing_onnx=0" in str(caught.value)  # the ids still agree
    # The same shift passes a looser tolerance.
    assert package(shifted, train_dir, tmp_path / "ok", atol=1e-2).max_abs_diff_onnx < 1.1e-3


def test_input_checks_name_the_file(tmp_path: Path) -> None:
    check_files_exist(None)  # not given: nothing to check
    with pytest.raises(InputNotFoundError, match="nope.json"):
        check_files_exist(tmp_path / "nope.json")
    with pytest.raises(InputNotFoundError, match="model_config.json.*run the train stage"):
        read_model_files(tmp_path)


def test_model_card_frame() -> None:
    parity = Parity(4, 1.5e-7, 2e-7, 0, 1)
    card = model_card(
        "toy",
        [
            ("Model", model_section("A toy.", {"a": 1})),
            ("Metrics", metrics_lines(None)),
            ("Parity", parity_table(parity, 17, exact_column="rows with identical ids")),
        ],
    )
    assert card == "\n".join(
        [
            "# toy",
            "",
            "## Model",
            "",
            "A toy.",
            "",
            "```json",
            "{",
            '  "a": 1',
            "}",
            "```",
            "",
            "## Metrics",
            "",
            "Not evaluated.",
            "",
            "## Parity",
            "",
            "| runtime | rows with identical ids | max abs score diff |",
            "|---|---|---|",
            "| onnxruntime (opset 17) | 4 / 4 | 1.5e-07 |",
            "| TorchScript | 3 / 4 | 2e-07 |",
            "",
        ]
    )
    assert metrics_lines({"auc": 0.7}) == ["| metric | value |", "|---|---|", "| auc | 0.7 |"]
    assert parity_table(parity, 17)[2:] == [
        "| onnxruntime (opset 17) | 1.5e-07 |",
        "| TorchScript | 2e-07 |",
    ]
