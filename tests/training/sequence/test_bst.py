import json
import math
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from sklearn.metrics import roc_auc_score

from artifacts.errors import ConfigError
from training.sequence.bst import (
    BST,
    bst_batch,
    bst_loss,
    bst_pipeline_batch,
    bst_pipeline_state_to_model,
    build_bst_pipeline_layers,
    score_candidates,
)

REPO = Path(__file__).resolve().parents[3]
ARGS = {
    "num_items": 40,
    "max_length": 6,
    "hidden_dim": 8,
    "num_blocks": 2,
    "num_heads": 2,
    "dropout": 0.0,
    "mlp": [16, 8],
}
HISTORY = torch.tensor([[3, 4, 5, 6, 7, 8], [0, 0, 0, 11, 12, 13], [0, 0, 0, 0, 0, 20]])
TARGET = torch.tensor([9, 14, 21])


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Run these tiny models on one thread: on a loaded machine two intra-op threads
    waiting on each other made the training test 8x slower (53 s against 7 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_model(**overrides: object) -> BST:
    torch.manual_seed(0)
    return BST(**{**ARGS, **overrides}).eval()


def walks(num_items: int, max_length: int, count: int, seed: int) -> list[list[int]]:
    """Learnable sequences: every item is the previous one plus 1 (wrapping in 1..V-1)."""
    rng = np.random.default_rng(seed)
    sequences = []
    for _ in range(count):
        start, length = int(rng.integers(1, num_items)), int(rng.integers(2, max_length + 2))
        sequences.append([1 + (start - 1 + i) % (num_items - 1) for i in range(length)])
    return sequences


def test_shapes_and_argument_checks() -> None:
    model = tiny_model()
    assert model(HISTORY, TARGET).shape == (3,)
    assert score_candidates(model, HISTORY, torch.tensor([[1, 2], [3, 4], [5, 6]])).shape == (3, 2)
    with pytest.raises(ValueError, match="max_length=6"):
        model(torch.ones(1, 7, dtype=torch.int64), torch.ones(1, dtype=torch.int64))
    for overrides, message in (
        ({"num_heads": 3}, "num_heads=3"),
        ({"num_items": 1}, "num_items=1"),
        ({"mlp": [4, 0]}, "mlp="),
    ):
        with pytest.raises(ConfigError, match=message):
            BST(**{**ARGS, **overrides})
        with pytest.raises(ConfigError, match=message):
            build_bst_pipeline_layers(**{**ARGS, **overrides})
    assert tiny_model(mlp=[])(HISTORY, TARGET).shape == (3,)  # a linear head


def test_forward_by_hand_uses_one_table_for_history_and_target() -> None:
    model = tiny_model()
    tables = [p for p in model.parameters() if p.shape == (ARGS["num_items"], ARGS["hidden_dim"])]
    assert len(tables) == 1 and tables[0] is model.item_embedding.weight
    table = model.item_embedding.weight
    sequence = torch.cat([HISTORY, TARGET.unsqueeze(1)], dim=1)  # (B, L + 1)
    with torch.no_grad():
        x = model.input(table[sequence], sequence)
        for block in model.blocks:
            x = block(x, sequence)
        query = model.final_norm(x)[:, -1]  # (B, D)
        item = table[TARGET] * math.sqrt(ARGS["hidden_dim"])  # the same table as the input
        expected = model.head(torch.cat([query, item, query * item], dim=-1)).squeeze(-1)
        torch.testing.assert_close(model(HISTORY, TARGET), expected, rtol=0, atol=0)

    # The gradient reaches exactly the table rows of the history and the target.
    model(HISTORY[1:2], TARGET[1:2]).sum().backward()
    touched = (table.grad.abs().sum(dim=1) > 0).nonzero().flatten().tolist()
    assert touched == [11, 12, 13, 14]


def test_padding_is_invisible() -> None:
    model = tiny_model()
    with torch.no_grad():
        before = model(HISTORY, TARGET)
        # Whatever the padding row holds, it never reaches the output.
        model.item_embedding.weight[0] = torch.randn(ARGS["hidden_dim"]) * 10
        torch.testing.assert_close(model(HISTORY, TARGET), before, rtol=0, atol=0)
        # A shorter history is left-padded: the same items keep the same positions.
        torch.testing.assert_close(model(HISTORY[1:, 3:], TARGET[1:]), before[1:], rtol=0, atol=0)

        # Padding keys are masked: a model with max_length 3 whose position table is the
        # long model's last 4 rows scores [11, 12, 13] as the long one scores it behind
        # 3 padding slots (unmasked padding keys would shift the attention weights).
        short = BST(**{**ARGS, "max_length": 3}).eval()
        state = model.state_dict()
        state["input.position_embedding.weight"] = state["input.position_embedding.weight"][3:]
        short.load_state_dict(state, strict=True)
        torch.testing.assert_close(short(HISTORY[1:2, 3:], TARGET[1:2]), before[1:2])

        # Not vacuous: a history item and the target do change the logit.
        changed = HISTORY.clone()
        changed[1, 4] = 30
        assert (model(changed, TARGET)[1] - before[1]).abs() > 1e-4
        assert (model(HISTORY, TARGET + 1) - before).abs().min() > 1e-4


def test_bst_batch_is_reproducible_and_labelled() -> None:
    sequences = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [10, 11], [12], [13, 14, 15]]
    first = bst_batch(sequences, 4, 40, 3, torch.Generator().manual_seed(7))
    again = bst_batch(sequences, 4, 40, 3, torch.Generator().manual_seed(7))
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    history, target, label = first
    # [12] has no cut point: 3 usable sequences x (1 positive + 3 negatives).
    assert history.shape == (12, 4) and target.shape == label.shape == (12,)
    assert history.dtype == target.dtype == torch.int64 and label.dtype == torch.float32
    assert label.tolist() == [1.0, 0.0, 0.0, 0.0] * 3
    assert ((target >= 1) & (target < 40)).all()
    for group, items in enumerate([sequences[0], sequences[1], sequences[3]]):
        rows = history[4 * group : 4 * group + 4]
        assert (rows == rows[0]).all()  # negatives share the positive's history
        kept = rows[0][rows[0] > 0].tolist()
        cut = items.index(int(target[4 * group]))
        assert cut >= 1 and kept == items[max(0, cut - 4) : cut]
        assert history[4 * group, : 4 - len(kept)].eq(0).all()  # left padding

    cuts = set()
    for seed in range(50):
        history, target, _ = bst_batch(
            [sequences[0]], 4, 40, 0, torch.Generator().manual_seed(seed)
        )
        cuts.add(int(target[0]) - 1)
    assert cuts == set(range(1, 9))  # every cut point 1..len-1 occurs
    other = bst_batch(sequences, 4, 40, 3, torch.Generator().manual_seed(8))
    assert not all(torch.equal(a, b) for a, b in zip(first, other, strict=True))
    with pytest.raises(ValueError, match="has 2 items"):
        bst_batch([[1], []], 4, 40, 1, torch.Generator())
    with pytest.raises(ValueError, match="negatives_per_positive=-1"):
        bst_batch(sequences, 4, 40, -1, torch.Generator())


def test_bst_loss_by_hand() -> None:
    logits = torch.tensor([2.0, -1.0, 0.5], dtype=torch.bfloat16)
    labels = torch.tensor([1.0, 0.0, 0.0])

    def softplus(x: float) -> float:
        return math.log1p(math.exp(x))

    expected = (softplus(-2.0) + softplus(-1.0) + softplus(0.5)) / 3
    loss = bst_loss(logits, labels)
    assert loss.dtype == torch.float32 and loss.item() == pytest.approx(expected, rel=1e-6)


def run_layers(
    layers: list, inputs: tuple[torch.Tensor, ...]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Build the specs and chain them in one process (eval mode), tying the table by hand."""
    torch.manual_seed(1)
    table = layers[0].build()
    modules = {index: spec.build().eval() for index, spec in enumerate(layers) if index}
    # What PipelineModule does for the second TiedLayerSpec: the first one's module.
    modules[len(layers) - 2] = partial(layers[-2].forward_fn, table)
    x = table(inputs)
    for index in range(1, len(layers)):
        x = modules[index](x)
    state = {f"0.{name}": tensor for name, tensor in table.state_dict().items()}
    for index, module in modules.items():
        if isinstance(module, torch.nn.Module):
            state.update({f"{index}.{k}": v for k, v in module.state_dict().items()})
    return x, state


def test_pipeline_layers_compute_bst() -> None:
    args = {**ARGS, "dropout": 0.1}  # dropout layers present, off in eval mode
    layers = build_bst_pipeline_layers(**args)
    assert len(layers) == ARGS["num_blocks"] + 5
    assert layers[0].key == layers[-2].key == "item_embedding"
    assert layers[-2].typename is layers[0].typename and layers[-2].tied_weight_attr == ["weight"]
    assert layers[0].module_args == layers[-2].module_args  # each stage builds the same table
    micro_batch = bst_pipeline_batch(HISTORY, TARGET, torch.tensor([1.0, 0.0, 1.0]))
    (history, target), labels = micro_batch
    with torch.no_grad():
        logits, state = run_layers(layers, (history, target))
    assert logits.shape == (3,)
    assert sorted({int(name.split(".")[0]) for name in state}) == [0, 1, 2, 3, 4, 6]

    model = BST(**args).eval()
    converted = bst_pipeline_state_to_model(state)
    model.load_state_dict(converted, strict=True)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, converted[name]), name
    with torch.no_grad():
        expected = model(history, target)
        torch.testing.assert_close(logits, expected, rtol=0, atol=0)
        torch.testing.assert_close(bst_loss(logits, labels), bst_loss(expected, labels))
        # A shorter history is padded by the first layer as by BST.
        short, _ = run_layers(layers, (history[1:, 3:], target[1:]))
        torch.testing.assert_close(short, expected[1:], rtol=0, atol=0)

    # PipelineModule.state_dict() names the table after its tie key.
    module_state = {k: v for k, v in state.items() if not k.startswith("0.")}
    module_state["tied_modules.item_embedding.weight"] = state["0.weight"]
    assert bst_pipeline_state_to_model(module_state).keys() == converted.keys()
    with pytest.raises(ValueError, match="item table"):
        bst_pipeline_state_to_model({k: v for k, v in state.items() if k != "0.weight"})
    for missing in ("2.", "6."):
        with pytest.raises(ValueError, match="not 1..K"):
            bst_pipeline_state_to_model(
                {k: v for k, v in state.items() if not k.startswith(missing)}
            )
    with pytest.raises(ValueError, match="not a BST pipeline"):
        bst_pipeline_state_to_model({**state, "head.0.weight": state["6.head.0.weight"]})


def test_score_candidates_matches_one_forward_per_candidate() -> None:
    model = tiny_model()
    candidates = torch.tensor([[1, 2, 3, 39], [14, 5, 6, 7], [21, 22, 1, 2]])  # (B, C)
    with torch.no_grad():
        scores = score_candidates(model, HISTORY, candidates)
        one_by_one = torch.stack(
            [model(HISTORY, candidates[:, c]) for c in range(candidates.shape[1])], dim=1
        )
    assert scores.shape == (3, 4)
    torch.testing.assert_close(scores, one_by_one, rtol=1e-6, atol=1e-6)


def test_training_learns_the_next_item() -> None:
    args = {**ARGS, "num_items": 30, "max_length": 5, "hidden_dim": 16, "num_blocks": 1}
    torch.manual_seed(0)
    model = BST(**args)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(0)
    train = walks(30, 5, 4000, seed=0)
    losses = []
    for step in range(120):
        rows = train[(step * 64) % len(train) :][:64]
        history, target, label = bst_batch(rows, 5, 30, 1, generator)
        loss = bst_loss(model(history, target), label)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert sum(losses[-10:]) / 10 < 0.6 * sum(losses[:10]) / 10

    history, target, label = bst_batch(
        walks(30, 5, 500, seed=1), 5, 30, 1, torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        scores = model.eval()(history, target)
    assert roc_auc_score(label.numpy(), scores.numpy()) > 0.9


# --- a real 2-rank pipeline run --------------------------------------------------------

WORKER = '''
"""One rank of a BST pipeline run for the test: python worker.py SPEC.json."""
import itertools
import json
import sys
from pathlib import Path

import deepspeed
import deepspeed.comm as dist
import numpy as np
import torch
from deepspeed.pipe import PipelineModule
from safetensors.torch import save_file

from training.sequence.bst import bst_batch, bst_loss, bst_pipeline_batch, build_bst_pipeline_layers
from training.sequence.pipeline_worker import layer_base_seed, seed_layer

spec = json.loads(Path([a for a in sys.argv[1:] if a.endswith(".json")][0]).read_text())
# The layouts are compared bit for bit: every rank runs the same kernels on one thread.
torch.set_num_threads(1)
deepspeed.init_distributed(dist_backend="gloo")
model_args = {k: spec[k] for k in ("num_items", "max_length", "hidden_dim", "num_blocks",
                                    "num_heads", "dropout", "mlp")}
module = PipelineModule(
    layers=build_bst_pipeline_layers(**model_args),
    num_stages=spec["num_stages"],
    loss_fn=bst_loss,
    seed_layers=True,
    seed_fn=seed_layer,
    base_seed=layer_base_seed(spec["seed"]),
)
engine, _, _, _ = deepspeed.initialize(
    model=module,
    model_parameters=[p for p in module.parameters() if p.requires_grad],
    config={
        "train_batch_size": spec["micro_batch_size"] * spec["gradient_accumulation_steps"],
        "train_micro_batch_size_per_gpu": spec["micro_batch_size"],
        "gradient_accumulation_steps": spec["gradient_accumulation_steps"],
        "optimizer": {"type": "Adam", "params": {"lr": spec["lr"], "torch_adam": True}},
        "steps_per_print": 10**9,
    },
)


def micro_batches():
    # Seeded identically on every rank: the first and last stage see the same batches.
    # Micro batch k of a step walks its own block of the table, items k * I + 1..(k + 1) * I
    # (see SPEC), so that a table row's gradient in a step comes from one micro batch.
    rng = np.random.default_rng(spec["seed"])
    generator = torch.Generator().manual_seed(spec["seed"])
    blocks = spec["gradient_accumulation_steps"]
    items, length = (spec["num_items"] - 1) // blocks, spec["max_length"]
    for index in itertools.count():
        rows = []
        for _ in range(spec["micro_batch_size"] // 2):  # 1 positive + 1 negative each
            start, n = int(rng.integers(1, items + 1)), int(rng.integers(2, length + 2))
            rows.append([1 + (start - 1 + i) % items for i in range(n)])
        history, target, label = bst_batch(rows, length, items + 1, 1, generator)
        offset = items * (index % blocks)  # padding (0) stays 0
        yield bst_pipeline_batch(history + offset * (history > 0), target + offset, label)


data = micro_batches()
losses = [float(engine.train_batch(data_iter=data)) for _ in range(spec["steps"])]
if engine.grid.get_data_parallel_rank() == 0:
    state = {k: t.detach().float().contiguous() for k, t in module.state_dict().items()}
    save_file(state, str(Path(spec["weights_dir"]) / f"stage-{engine.stage_id:02d}.safetensors"))
if dist.get_rank() == 0:
    record = {"losses": losses, "parts": [int(part) for part in module.parts]}
    Path(spec["out"]).write_text(json.dumps(record))
dist.barrier()
'''

# Why the two layouts agree bit for bit, not just to a tolerance: the tied table's gradient
# is a float sum whose order depends on the layout. One stage sums it as (t1 + e1) + (t2 + e2)
# over the micro batches 1, 2 of a step (e: layer 0's lookup of history and target, t: the
# target features' lookup); two stages as (e1 + e2) + (t1 + t2), stage 0's part all-reduced
# with stage 1's. Float addition is not associative: with rows shared between the micro
# batches the two differed by an ulp after step 1 and by 3e-5 (the key bias by 3e-3, Adam's
# lr-sized steps on noise) after 60, which tolerances met only by chance. So each micro batch
# of a step walks its own block of 14 items (2 x 14 + the padding row): a row's gradient is
# t + e on one stage, e + t on two, and those are equal. Everything else is summed alike.
SPEC = {
    **ARGS,
    "num_items": 29,
    "max_length": 5,
    "hidden_dim": 16,
    "micro_batch_size": 32,
    "gradient_accumulation_steps": 2,
    "steps": 60,
    "lr": 0.01,
    "seed": 3,
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(num_stages: int, tmp_path: Path) -> tuple[dict, list[dict[str, torch.Tensor]]]:
    """One real DeepSpeed launch of the test's worker on `num_stages` CPU ranks."""
    name = f"stages-{num_stages}"
    weights_dir = tmp_path / f"{name}-weights"
    weights_dir.mkdir()
    spec = {
        **SPEC,
        "num_stages": num_stages,
        "out": str(tmp_path / f"{name}.json"),
        "weights_dir": str(weights_dir),
    }
    (tmp_path / f"{name}-spec.json").write_text(json.dumps(spec))
    (tmp_path / "worker.py").write_text(WORKER)
    paths = [str(REPO), *filter(None, os.environ.get("PYTHONPATH", "").split(":"))]
    env = {
        **os.environ,
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",  # two ranks on a small machine; see one_thread
        "PYTHONPATH": ":".join(paths),
        "TORCH_EXTENSIONS_DIR": os.environ.get(
            "TORCH_EXTENSIONS_DIR", str(REPO / ".venv" / "torch_extensions")
        ),
    }
    command = [
        sys.executable,
        "-m",
        "deepspeed.launcher.runner",
        "--num_gpus",
        str(num_stages),
        "--master_port",
        str(free_port()),
        str(tmp_path / "worker.py"),
        str(tmp_path / f"{name}-spec.json"),
    ]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    stages = [load_file(path) for path in sorted(weights_dir.glob("stage-*.safetensors"))]
    return json.loads(Path(spec["out"]).read_text()), stages


@pytest.mark.slow
def test_one_stage_and_two_stages_train_the_same_bst(tmp_path: Path) -> None:
    one, one_stages = launch(1, tmp_path)
    two, two_stages = launch(2, tmp_path)
    assert len(one["losses"]) == SPEC["steps"] and len(two["parts"]) == 3
    for step, (a, b) in enumerate(zip(one["losses"], two["losses"], strict=True)):
        assert b == a, f"step {step}: {a} vs {b}"  # bit for bit, see SPEC
    # The walks are learnt: the first 10 steps average 0.696, the last 10 0.359
    # (deterministic for the seed; noisy step to step, hence the averages).
    assert sum(one["losses"][-10:]) / 10 < 0.7 * sum(one["losses"][:10]) / 10

    # The tied table is on both stages (layer 0 and the target features layer) and
    # stays one table: its gradients are all-reduced between them.
    tied = "tied_modules.item_embedding.weight"
    assert len(two_stages) == 2 and all(tied in stage for stage in two_stages)
    torch.testing.assert_close(two_stages[0][tied], two_stages[1][tied], rtol=0, atol=0)

    weights = [bst_pipeline_state_to_model(s[0] | s[-1]) for s in (one_stages, two_stages)]
    model = BST(**{k: SPEC[k] for k in ARGS})
    model.load_state_dict(weights[1], strict=True)
    # Bit for bit (see SPEC), the key bias too: its gradient is float noise around an exact
    # zero (softmax ignores a constant shift), which Adam turns into lr-sized steps, but
    # the same noise on both layouts.
    for name, tensor in weights[0].items():
        torch.testing.assert_close(weights[1][name], tensor, rtol=0, atol=0, msg=name)
