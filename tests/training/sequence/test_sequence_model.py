import json
import math
import os
import socket
import subprocess
import sys
from functools import partial
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

from artifacts.errors import ConfigError
from training.config import TrainConfig, check_pipeline_config
from training.runtime.consolidate import create_file, finish_file, plan_layout, write_dense
from training.sequence.pipeline_worker import (
    PipelineSpec,
    ShuffledHistories,
    build_model,
    load_spec,
    micro_batches,
    write_model_weights,
)
from training.sequence.sasrec import (
    ItemEmbeddingPipe,
    MaskDropout,
    SASRec,
    bce_loss,
    build_pipeline_layers,
    candidates_of,
    next_item_batch,
    pipeline_state_to_sasrec,
    sample_negatives,
    sample_shared_negatives,
    sampled_softmax_loss,
    sasrec_micro_batch,
    score_candidates_pipe,
    softmax_loss,
)
from training.sequence.train import (
    build_pipeline_spec,
    sequence_fingerprint,
    sequence_model_config,
)

REPO = Path(__file__).resolve().parents[3]
ARGS = {
    "num_items": 50,
    "max_length": 6,
    "hidden_dim": 8,
    "num_blocks": 2,
    "num_heads": 2,
    "dropout": 0.0,
}


def tiny_model(**overrides: float) -> SASRec:
    torch.manual_seed(0)
    return SASRec(**{**ARGS, **overrides}).eval()


def tiny_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    history, positives = next_item_batch([[3, 4, 5, 6, 7, 8, 9], [11, 12, 13], [20, 21]], 6)
    negatives = sample_negatives(positives, 50, 3, torch.Generator().manual_seed(1))
    return history, positives, negatives


def test_next_item_batch_left_pads_and_shifts() -> None:
    history, positives = next_item_batch([[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11]], 4)
    assert history.tolist() == [[4, 5, 6, 7], [0, 0, 9, 10]]
    assert positives.tolist() == [[5, 6, 7, 8], [0, 0, 10, 11]]
    assert history.dtype == positives.dtype == torch.int64


def test_shapes() -> None:
    model = tiny_model()
    history, positives, negatives = tiny_batch()
    hidden = model(history)
    assert hidden.shape == (3, 6, 8)
    assert model.score(hidden, candidates_of(positives, negatives)).shape == (3, 6, 4)
    last = hidden[:, -1]  # (B, D)
    assert model.score(last, torch.tensor([[1, 2], [3, 4], [5, 6]])).shape == (3, 2)
    assert model.score(last, torch.tensor([1, 2, 3, 4, 5])).shape == (3, 5)
    assert model.score(last).shape == (3, 50)
    assert torch.allclose(model.score(last)[:, [1, 2]], model.score(last, torch.tensor([1, 2])))
    with pytest.raises(ValueError, match="max_length=6"):
        model(torch.ones(1, 7, dtype=torch.int64))


def test_causality() -> None:
    model = tiny_model()
    history = torch.tensor([[5, 6, 7, 8, 9, 10]])
    changed = history.clone()
    changed[0, 3] = 42
    before, after = model(history), model(changed)
    torch.testing.assert_close(after[:, :3], before[:, :3], rtol=0, atol=0)
    assert (after[:, 3:] - before[:, 3:]).abs().amax(dim=-1).min() > 1e-4


def test_padding_is_masked_as_keys_and_excluded_from_the_loss() -> None:
    model = tiny_model()
    # Whatever the padding row holds, valid positions never see it.
    with torch.no_grad():
        model.item_embedding.weight[0] = torch.randn(8) * 10
    history = torch.tensor([[0, 0, 0, 3, 4, 5], [0, 0, 0, 0, 0, 0]])
    hidden = model(history)
    assert torch.isfinite(hidden).all()  # an all-padding row attends to itself, no NaN
    block = model.blocks[0]
    x = torch.randn(1, 6, 8)
    noisy = x.clone()
    noisy[0, :3] = torch.randn(3, 8) * 100  # the padding slots' inputs
    valid = history[:1] != 0
    out, noisy_out = block.attention(x, valid), block.attention(noisy, valid)
    torch.testing.assert_close(noisy_out[0, 3:], out[0, 3:])
    # Padding positions' logits do not enter the loss.
    positives = torch.tensor([[0, 0, 0, 4, 5, 6]])
    logits = torch.randn(1, 6, 2)
    moved = logits.clone()
    moved[0, :3] = 50.0
    assert bce_loss(moved, positives) == bce_loss(logits, positives)
    assert sampled_softmax_loss(moved, positives) == sampled_softmax_loss(logits, positives)


def test_the_item_embedding_is_tied() -> None:
    model = tiny_model()
    tables = [p for p in model.parameters() if p.shape == (50, 8)]
    assert len(tables) == 1 and tables[0] is model.item_embedding.weight
    hidden = torch.randn(2, 8)
    model.score(hidden, torch.tensor([[1, 2], [3, 4]])).sum().backward()
    grad = model.item_embedding.weight.grad
    torch.testing.assert_close(grad[1], hidden[0])
    torch.testing.assert_close(grad[4], hidden[1])
    assert model.item_embedding.weight[0].abs().sum() == 0  # the padding row


def test_sample_negatives() -> None:
    positives = torch.tensor([[0, 3, 4], [5, 6, 7]])
    negatives = sample_negatives(positives, 10, 4, torch.Generator().manual_seed(0))
    assert negatives.shape == (2, 3, 4) and negatives.dtype == torch.int64
    assert (negatives[0, 0] == 0).all()
    assert ((negatives[positives != 0] >= 1) & (negatives[positives != 0] < 10)).all()
    again = sample_negatives(positives, 10, 4, torch.Generator().manual_seed(0))
    assert torch.equal(negatives, again)
    many = sample_negatives(torch.ones(100, 100, dtype=torch.int64), 10, 1)
    assert set(many.unique().tolist()) == set(range(1, 10))


def test_bce_loss_by_hand() -> None:
    positives = torch.tensor([[0, 5, 7]])  # the first position is excluded
    logits = torch.tensor([[[9.0, -9.0], [2.0, -1.0], [0.5, 1.5]]])  # (1, 3, 1 + 1)

    def softplus(x: float) -> float:
        return math.log1p(math.exp(x))

    # -log s(p) = softplus(-p); -log(1 - s(n)) = softplus(n)
    expected = (softplus(-2.0) + softplus(-1.0) + softplus(-0.5) + softplus(1.5)) / 2
    assert bce_loss(logits, positives).item() == pytest.approx(expected, rel=1e-6)
    assert bce_loss(logits, torch.zeros(1, 3, dtype=torch.int64)).item() == 0.0


def test_sampled_softmax_loss_by_hand() -> None:
    positives = torch.tensor([[4, 0]])
    logits = torch.tensor([[[1.0, 2.0, 0.0], [5.0, 5.0, 5.0]]])  # (1, 2, 1 + 2)
    expected = math.log(math.e + math.e**2 + 1.0) - 1.0
    assert sampled_softmax_loss(logits, positives).item() == pytest.approx(expected, rel=1e-6)


def test_loss_from_the_model_matches_a_hand_computation() -> None:
    model = tiny_model()
    history, positives, negatives = tiny_batch()
    with torch.no_grad():
        hidden = model(history)  # (B, L, D)
        logits = model.score(hidden, candidates_of(positives, negatives[..., :1]))
    table = model.item_embedding.weight.detach()
    total, count = 0.0, 0
    for b in range(3):
        for t in range(6):
            if positives[b, t] == 0:
                continue
            pos = float(hidden[b, t] @ table[positives[b, t]])
            neg = float(hidden[b, t] @ table[negatives[b, t, 0]])
            total += -math.log(1 / (1 + math.exp(-pos))) - math.log(1 - 1 / (1 + math.exp(-neg)))
            count += 1
    assert bce_loss(logits, positives).item() == pytest.approx(total / count, rel=1e-5)


def run_layers(
    layers: list, inputs: tuple[torch.Tensor, ...]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Build the specs and chain them in one process (eval mode), tying the table by hand."""
    torch.manual_seed(1)
    table = layers[0].build()
    modules = [table, *(spec.build().eval() for spec in layers[1:-1])]
    score = partial(layers[-1].forward_fn, table)  # what PipelineModule does for a TiedLayerSpec
    x = inputs
    for module in [*modules, score]:
        x = module(x)
    state = {
        f"{index}.{name}": tensor
        for index, module in enumerate(modules)
        for name, tensor in module.state_dict().items()
    }
    return x, state


def test_pipeline_layers_compute_sasrec() -> None:
    args = {**ARGS, "dropout": 0.1}  # dropout layers present, off in eval mode
    layers = build_pipeline_layers(**args)
    assert len(layers) == ARGS["num_blocks"] + 4
    assert layers[0].key == layers[-1].key == "item_embedding"
    assert layers[-1].tied_weight_attr == ["weight"]
    history, positives, negatives = tiny_batch()
    with torch.no_grad():
        logits, state = run_layers(layers, (history, positives, negatives))
    assert logits.shape == (3, 6, 4)

    model = SASRec(**args).eval()
    model.load_state_dict(pipeline_state_to_sasrec(state), strict=True)
    with torch.no_grad():
        expected = model.score(model(history), candidates_of(positives, negatives))
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)
    for loss in (bce_loss, sampled_softmax_loss):
        torch.testing.assert_close(loss(logits, positives), loss(expected, positives))


def test_the_softmax_loss_ranks_the_positive_against_every_item() -> None:
    """loss 'softmax': the pipeline scores every item at each positive's position; the
    loss is the cross-entropy over the catalogue less the padding item, by hand."""
    layers = build_pipeline_layers(**ARGS)
    history, positives, _ = tiny_batch()
    no_negatives = positives.new_zeros(*positives.shape, 0)
    with torch.no_grad():
        logits, state = run_layers(layers, (history, positives, no_negatives))
    scored = positives != 0
    assert logits.shape == (int(scored.sum()), ARGS["num_items"])
    assert torch.all(logits[:, 0] == float("-inf"))

    model = SASRec(**ARGS).eval()
    model.load_state_dict(pipeline_state_to_sasrec(state), strict=True)
    with torch.no_grad():
        every = model.score(model(history), None)[scored]  # (M, V)
    torch.testing.assert_close(logits[:, 1:], every[:, 1:], rtol=0, atol=1e-6)
    targets = positives[scored]
    by_hand = torch.stack(
        [torch.logsumexp(row[1:], 0) - row[t] for row, t in zip(every, targets, strict=True)]
    ).mean()
    torch.testing.assert_close(softmax_loss(logits, positives), by_hand, rtol=1e-6, atol=1e-6)
    empty = torch.zeros(0, ARGS["num_items"])
    assert softmax_loss(empty, torch.zeros_like(positives)).item() == 0.0


def test_shared_negatives_rank_each_positive_against_one_set_per_micro_batch() -> None:
    """shared_negatives: (M, 1 + N) logits, the positive first, a draw equal to the
    row's positive masked; the loss is the cross-entropy over that row, by hand."""
    layers = build_pipeline_layers(**ARGS)
    history, positives, _ = tiny_batch()
    scored = positives != 0
    targets = positives[scored]
    shared = torch.cat([targets[:2], torch.tensor([1, 2, 49])])  # two accidental hits
    with torch.no_grad():
        logits, state = run_layers(layers, (history, positives, shared))
    assert logits.shape == (int(scored.sum()), 1 + len(shared))

    model = SASRec(**ARGS).eval()
    model.load_state_dict(pipeline_state_to_sasrec(state), strict=True)
    with torch.no_grad():
        every = model.score(model(history), None)[scored]  # (M, V)
    by_hand_rows = []
    for row, target, got in zip(every, targets, logits, strict=True):
        kept = shared[shared != target]
        assert got[0].item() == pytest.approx(row[target].item(), abs=1e-5)
        hits = (shared == target).nonzero().flatten() + 1
        assert torch.all(got[hits] == float("-inf"))
        candidates = torch.cat([row[target].view(1), row[kept]])
        by_hand_rows.append(torch.logsumexp(candidates, 0) - row[target])
    by_hand = torch.stack(by_hand_rows).mean()
    torch.testing.assert_close(sampled_softmax_loss(logits, positives), by_hand, atol=1e-5, rtol=0)
    assert sampled_softmax_loss(torch.zeros(0, 6), torch.zeros_like(positives)).item() == 0.0


def test_shared_negatives_are_one_uniform_draw_per_micro_batch() -> None:
    generator = torch.Generator().manual_seed(0)
    (history, positives, negatives), labels = sasrec_micro_batch(
        [[1, 2, 3], [4, 5, 6, 7]], 6, 30, 500, generator, shared=True
    )
    assert negatives.shape == (500,) and history.shape == positives.shape == (2, 6)
    assert negatives.min() >= 1 and negatives.max() < 30 and len(negatives.unique()) == 29
    again = sample_shared_negatives(30, 500, torch.Generator().manual_seed(0))
    # next_item_batch draws nothing: the same seed gives the same shared set
    assert torch.equal(again, negatives)


def test_mask_dropout_keeps_with_probability_1_minus_p_and_rescales() -> None:
    dropout = MaskDropout(0.25)
    torch.manual_seed(0)
    out = dropout(torch.ones(200_000))
    kept = out != 0
    assert abs(kept.float().mean().item() - 0.75) < 0.005
    torch.testing.assert_close(out[kept], torch.full_like(out[kept], 1 / 0.75))
    x = torch.randn(4, 5)
    assert dropout.eval()(x) is x
    assert MaskDropout(0.0)(x) is x


def test_training_attention_is_sdpa_when_its_dropout_draws_keep_everything() -> None:
    """The hand-written training path (dropout on) against scaled_dot_product_attention."""
    model = tiny_model(dropout=0.1)
    for module in model.modules():
        if isinstance(module, MaskDropout):
            module.p = 0.0  # attention keeps its dropout=0.1: the training path runs
    history, _, _ = tiny_batch()
    with torch.no_grad():
        expected = model.eval()(history)
        got = model.train()(history)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_pipeline_scoring_equals_the_full_gather_at_scored_positions() -> None:
    """Only positions with a positive are scored; values and gradients as the full gather."""
    torch.manual_seed(0)
    table = ItemEmbeddingPipe(50, 8, {"category": 5})
    table.item_features.set_index({"category": CATEGORY})
    with torch.no_grad():
        table.weight[0] = 0.0
        table.item_features.tables["category"].weight[0] = 1.0  # nonzero for the padding item
    history, positives, negatives = tiny_batch()
    hidden = torch.randn(*history.shape, 8, requires_grad=True)  # (B, L, D)

    logits = score_candidates_pipe(table, (hidden, history, positives, negatives))
    loss = sampled_softmax_loss(logits, positives)
    grads = torch.autograd.grad(loss, [hidden, table.weight])

    vectors = table.vectors(candidates_of(positives, negatives))  # (B, L, 1 + N, D)
    reference = (vectors * hidden.unsqueeze(-2)).sum(dim=-1)  # (B, L, 1 + N)
    expected_loss = sampled_softmax_loss(reference, positives)
    expected_grads = torch.autograd.grad(expected_loss, [hidden, table.weight])

    scored = positives != 0
    torch.testing.assert_close(logits[scored], reference[scored], rtol=0, atol=1e-6)
    assert torch.all(logits[~scored] == 0) and torch.any(reference[~scored] != 0)
    torch.testing.assert_close(loss, expected_loss, rtol=0, atol=1e-6)
    for got, expected in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


CATEGORY = torch.tensor([0, *[1 + item % 4 for item in range(1, 50)]])  # (V,) item -> category


def test_side_features_are_shared_by_items_and_tied_in_the_pipeline() -> None:
    args = {**ARGS, "item_features": {"category": 5}}
    layers = build_pipeline_layers(**args)
    assert layers[0].tied_weight_attr == ["weight", "item_features.tables.category.weight"]
    torch.manual_seed(1)
    table = layers[0].build()
    table.item_features.set_index({"category": CATEGORY})
    modules = [table, *(spec.build().eval() for spec in layers[1:-1])]
    history, positives, negatives = tiny_batch()
    x = (history, positives, negatives)
    with torch.no_grad():
        for module in [*modules, partial(layers[-1].forward_fn, table)]:
            x = module(x)
    state = {
        f"{index}.{name}": tensor
        for index, module in enumerate(modules)
        for name, tensor in module.state_dict().items()
    }
    assert torch.equal(state["0.item_features.index_category"], CATEGORY)
    model = SASRec(**args).eval()
    model.load_state_dict(pipeline_state_to_sasrec(state), strict=True)  # lookups included
    with torch.no_grad():
        expected = model.score(model(history), candidates_of(positives, negatives))
        torch.testing.assert_close(x, expected, rtol=0, atol=0)
        # An item's vector is its row plus its category's row: moving category 2's row
        # moves the items of category 2 (and only those) in the output table.
        before = model.item_table().clone()
        model.item_features.tables["category"].weight[2] += 1.0
        moved = (model.item_table() - before).abs().sum(dim=1) > 0  # (V,)
        assert torch.equal(moved, CATEGORY == 2)
        full = model.score(model(history)[:, -1])  # (B, V)
        some = model.score(model(history)[:, -1], torch.tensor([3, 7, 8]))
        torch.testing.assert_close(full[:, [3, 7, 8]], some)
    with pytest.raises(ValueError, match="in \\[0, 5\\)"):
        model.item_features.set_index({"category": CATEGORY + 1})


def test_pipeline_state_round_trips() -> None:
    layers = build_pipeline_layers(**ARGS)
    history, positives, negatives = tiny_batch()
    with torch.no_grad():
        logits, state = run_layers(layers, (history, positives, negatives))
    converted = pipeline_state_to_sasrec(state)
    model = SASRec(**ARGS)
    model.load_state_dict(converted, strict=True)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, converted[name]), name
    with torch.no_grad():
        expected = model.eval().score(model(history), candidates_of(positives, negatives))
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)
    # PipelineModule.state_dict() names the table after its tie key.
    module_state = {k: v for k, v in state.items() if not k.startswith("0.")}
    module_state["tied_modules.item_embedding.weight"] = state["0.weight"]
    assert pipeline_state_to_sasrec(module_state).keys() == converted.keys()
    with pytest.raises(ValueError, match="item table"):
        pipeline_state_to_sasrec({k: v for k, v in state.items() if k != "0.weight"})
    with pytest.raises(ValueError, match="contiguous"):
        pipeline_state_to_sasrec({k: v for k, v in state.items() if not k.startswith("2.")})


def test_check_pipeline_config() -> None:
    check_pipeline_config(world_size=4, num_stages=2, zero_stage=1)
    check_pipeline_config(world_size=1, num_stages=1, zero_stage=0)
    with pytest.raises(ConfigError, match=r"train.pipeline_stages=3 .*train.world_size=4"):
        check_pipeline_config(world_size=4, num_stages=3, zero_stage=0)
    with pytest.raises(ConfigError, match=r"train.zero_stage=2 .*ZeRO stage 0 or 1"):
        check_pipeline_config(world_size=2, num_stages=2, zero_stage=2)
    with pytest.raises(ConfigError, match="train.pipeline_stages=0"):
        check_pipeline_config(world_size=2, num_stages=0, zero_stage=0)


def test_model_args_are_checked() -> None:
    with pytest.raises(ConfigError, match="num_heads=3"):
        SASRec(**{**ARGS, "num_heads": 3})
    with pytest.raises(ConfigError, match="num_heads=3"):
        build_pipeline_layers(**{**ARGS, "num_heads": 3})
    with pytest.raises(ConfigError, match="num_items=1"):
        SASRec(**{**ARGS, "num_items": 1})


# The data-derived sizes and the train section of the pipeline runs below.
SIZES = {"num_items": 200, "max_length": 16}
TRAIN = {
    "model": "sasrec",
    "sequence": {
        "hidden_dim": 32,
        "num_blocks": 2,
        "num_heads": 2,
        "dropout": 0.0,
        "partition_method": "uniform",
    },
    "batch_size": 8,
    "grad_accum_steps": 2,
    "lr": 0.01,
    "seed": 3,
    "log_every": 5,
}
STEPS = 20


def pipeline_spec(
    out_dir: Path,
    num_stages: int = 1,
    world_size: int | None = None,
    sizes: dict | None = None,
    steps: int = STEPS,
    sequences_dir: Path | None = None,
    **train: object,
) -> PipelineSpec:
    """The spec the train stage would write for TRAIN (synthetic data unless sequences_dir)."""
    sequence = {**TRAIN["sequence"], **train.pop("sequence", {})}
    # The train stage resolves zero_stage: auto before it builds a spec (0 for these).
    train.setdefault("zero_stage", 0)
    config = TrainConfig(
        **{**TRAIN, "sequence": sequence, **train},
        pipeline_stages=num_stages,
        world_size=world_size or num_stages,
    )
    model_config = sequence_model_config(config, sizes or SIZES)
    return build_pipeline_spec(config, model_config, steps, out_dir, sequences_dir=sequences_dir)


def test_spec_refuses_unknown_keys_and_batches_are_reproducible(tmp_path: Path) -> None:
    spec = pipeline_spec(tmp_path)
    path = tmp_path / "spec.json"
    path.write_text(json.dumps({**spec.model_dump(mode="json"), "stages": 2}))
    with pytest.raises(ConfigError, match="stages"):
        load_spec(path)
    path.write_text(json.dumps(spec.model_dump(mode="json")))
    assert load_spec(path) == spec
    first, second = micro_batches(spec), micro_batches(spec)
    for _ in range(3):
        (inputs, labels), (inputs_again, labels_again) = next(first), next(second)
        assert all(torch.equal(a, b) for a, b in zip(inputs, inputs_again, strict=True))
        assert torch.equal(labels, inputs[1]) and torch.equal(labels, labels_again)
        history, positives, negatives = inputs
        assert history.shape == (8, 16) and negatives.shape == (8, 16, 1)
        assert (history[:, -1] > 0).all() and (positives[history == 0] == 0).all()


def test_the_spec_carries_the_resolved_train_and_deepspeed_configs(tmp_path: Path) -> None:
    spec = pipeline_spec(
        tmp_path, num_stages=2, world_size=4, zero_stage=1, grad_clip=0.5, warmup_steps=3
    )
    # One builder for both families: grad_clip, warmup (with the total steps) and weight
    # decay reach the pipeline engine; the global batch counts the 2 replicas only.
    assert spec.ds_config["gradient_clipping"] == 0.5
    assert spec.ds_config["scheduler"]["type"] == "WarmupDecayLR"
    assert spec.ds_config["scheduler"]["params"]["total_num_steps"] == STEPS
    assert spec.ds_config["train_batch_size"] == 8 * 2 * 2
    assert spec.ds_config["optimizer"]["type"] == "Adam"
    assert spec.ds_config["optimizer"]["params"]["betas"] == [0.9, 0.98]
    assert spec.ds_config["zero_optimization"] == {"stage": 1}
    assert spec.train_config.pipeline_stages == 2 and spec.architecture["num_items"] == 200
    # What a resume must match changes with what is trained, not with where it is written.
    moved = pipeline_spec(
        tmp_path / "elsewhere",
        num_stages=2,
        world_size=4,
        zero_stage=1,
        grad_clip=0.5,
        warmup_steps=3,
        log_every=7,
    )
    assert moved.config_fingerprint == spec.config_fingerprint
    other = pipeline_spec(tmp_path, num_stages=2, world_size=4, zero_stage=1, grad_clip=0.25)
    assert other.config_fingerprint != spec.config_fingerprint
    # The layout over the ranks is not: 1 replica x 4 micro batches is the same global
    # batch (find_resume_point decides which layouts load the checkpoint).
    fewer = pipeline_spec(
        tmp_path, num_stages=2, world_size=2, zero_stage=1, grad_clip=0.5, warmup_steps=3,
        grad_accum_steps=4,
    )  # fmt: skip
    assert fewer.config_fingerprint == spec.config_fingerprint
    threads = fewer.model_copy(update={"intra_op_threads": 3})  # follows the world size
    assert sequence_fingerprint(threads) == spec.config_fingerprint
    smaller = pipeline_spec(
        tmp_path, num_stages=2, world_size=2, zero_stage=1, grad_clip=0.5, warmup_steps=3
    )
    assert smaller.config_fingerprint != spec.config_fingerprint
    with pytest.raises(ValueError, match="architecture.model='bst'"):
        PipelineSpec(**{**spec.model_dump(), "architecture": {**spec.architecture, "model": "bst"}})


def test_a_step_draws_the_same_micro_batches_however_it_is_split_over_replicas(
    tmp_path: Path,
) -> None:
    histories = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10, 11], [12], [3, 4, 5, 6]]
    path = tmp_path / "train.parquet"
    pq.write_table(pa.table({"user": list(range(6)), "history": histories}), path)
    sizes = {"num_items": 14, "max_length": 3}

    def spec(world_size: int, grad_accum_steps: int, data: Path | None = tmp_path) -> PipelineSpec:
        return pipeline_spec(
            tmp_path, world_size=world_size, sizes=sizes, batch_size=2,
            grad_accum_steps=grad_accum_steps, sequences_dir=data,
        )  # fmt: skip

    def tensors(batch: tuple) -> list[torch.Tensor]:
        (inputs, labels) = batch
        return [*inputs, labels]

    def same(a: tuple, b: tuple) -> bool:
        return all(torch.equal(x, y) for x, y in zip(tensors(a), tensors(b), strict=True))

    for data in (tmp_path, None):  # Parquet rows, then synthetic sequences
        one, two = spec(1, 4, data), spec(2, 2, data)
        alone = micro_batches(one)
        replicas = [micro_batches(two, replica, 2) for replica in (0, 1)]
        for _ in range(2):  # steps 0 and 1: replica r runs micro batches 2r, 2r + 1
            step = [next(alone) for _ in range(4)]
            split = [next(replicas[r]) for r in (0, 1) for _ in range(2)]
            assert all(same(a, b) for a, b in zip(step, split, strict=True))
        # A resumed run starts at its step without replaying the ones before.
        again = micro_batches(one, first_step=1)
        assert all(same(a, b) for a, b in zip([next(again) for _ in range(4)], step, strict=True))

    # Three micro batches of 2 are one epoch: every history once, in a seeded order.
    epoch = [next(micro_batches(spec(3, 1), replica, 3)) for replica in range(3)]
    rows = sorted(row for batch in epoch for row in batch[0][0].tolist())
    assert rows == sorted(next_item_batch(histories, 3)[0].tolist())
    with pytest.raises(ConfigError, match="none of its 6 histories has 5 item"):
        ShuffledHistories(path, seed=0, min_items=5)


def test_pipeline_weights_are_streamed_with_integer_buffers_kept(tmp_path: Path) -> None:
    spec = pipeline_spec(tmp_path)
    model = build_model(spec)
    state = {name: t.detach().clone() for name, t in model.state_dict().items()}
    state["item_embedding.weight"] = state["item_embedding.weight"].bfloat16()  # a bf16 run
    path = tmp_path / "model.safetensors"
    write_model_weights(state, spec, path)
    loaded = load_file(str(path))
    assert loaded.keys() == state.keys()
    assert all(t.dtype == torch.float32 for t in loaded.values())
    assert torch.equal(loaded["item_embedding.weight"], state["item_embedding.weight"].float())
    model.load_state_dict(loaded, strict=True)

    # A side feature's item -> index lookup is int64 and stays int64.
    big = torch.tensor([0, 2**24 + 1, 3])
    assert torch.equal(load_file(str(_one_int_file(tmp_path, big)))["index"], big)

    with pytest.raises(ValueError, match=r"missing \['final_norm.weight'\]"):
        write_model_weights(
            {k: v for k, v in state.items() if k != "final_norm.weight"}, spec, tmp_path / "x"
        )
    assert not (tmp_path / "x").exists()


def _one_int_file(tmp_path: Path, values: torch.Tensor) -> Path:
    layout = plan_layout({"index": tuple(values.shape)}, dtypes={"index": values.dtype})
    path = tmp_path / "index.safetensors"
    with open(create_file(path, layout), "r+b") as file:
        write_dense(file, layout, {"index": values}, 2)
    finish_file(path, layout)
    return path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(spec: PipelineSpec, tmp_path: Path, name: str) -> dict:
    """One real DeepSpeed launch of training.sequence.pipeline_worker on CPU ranks."""
    out = tmp_path / f"{name}.json"
    spec_path = tmp_path / f"{name}-spec.json"
    outputs = {
        "out": out,
        "checkpoint_dir": tmp_path / f"{name}-checkpoints",
        "weights_file": tmp_path / f"{name}.safetensors",
        "train_log": tmp_path / f"{name}-log.jsonl",
    }
    spec_path.write_text(spec.model_copy(update=outputs).model_dump_json())
    world_size = spec.train_config.world_size
    paths = [str(REPO), *filter(None, os.environ.get("PYTHONPATH", "").split(":"))]
    env = {
        **os.environ,
        "DS_ACCELERATOR": "cpu",
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
        str(world_size),
        "--master_port",
        str(free_port()),
        "--module",
        "training.sequence.pipeline_worker",
        str(spec_path),
    ]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    return json.loads(out.read_text())


def consolidated(tmp_path: Path, name: str) -> dict[str, torch.Tensor]:
    """The weights rank 0 consolidated from the stages' DeepSpeed layer checkpoints."""
    layers = sorted(p.name for p in (tmp_path / f"{name}-checkpoints" / "final").glob("layer_*"))
    # Layers 0 (the tied table) .. 4 (final norm); the scoring layer 5 shares layer 0.
    assert layers == [f"layer_{i:02d}-model_states.pt" for i in range(5)]
    return load_file(tmp_path / f"{name}.safetensors")


@pytest.mark.slow
def test_one_stage_and_two_stages_train_the_same_model(tmp_path: Path) -> None:
    one = launch(pipeline_spec(tmp_path), tmp_path, "one")
    # "blocks" balances the Transformer blocks (DeepSpeed's "type:" partition).
    blocks = {"partition_method": "blocks"}
    two = launch(pipeline_spec(tmp_path, num_stages=2, sequence=blocks), tmp_path, "two")
    # "parameters" splits this model as "uniform" does, but takes DeepSpeed's other
    # code path (numpy-integer layer bounds handed to the seed function).
    parameters = {"partition_method": "parameters"}
    balanced = launch(
        pipeline_spec(tmp_path, num_stages=2, sequence=parameters), tmp_path, "balanced"
    )
    assert one["parts"] == [0, 6] and two["parts"] == balanced["parts"] == [0, 3, 6]
    assert len(one["losses"]) == 20
    assert one["steps"] == 20 and one["samples_per_s"] > 0
    progress = [json.loads(line) for line in (tmp_path / "two-log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in progress] == [5, 10, 15, 20]
    assert progress[-1]["loss"] == pytest.approx(sum(two["losses"][-5:]) / 5)
    assert len(progress[-1]["rss_mb"]) == 2 and min(progress[-1]["rss_mb"]) > 0
    for run in (two, balanced):
        for step, (a, b) in enumerate(zip(one["losses"], run["losses"], strict=True)):
            assert b == pytest.approx(a, rel=1e-4), f"step {step}: {a} vs {b}"
    losses = one["losses"]
    assert sum(losses[-5:]) / 5 < 0.9 * sum(losses[:5]) / 5  # it learns the synthetic walk

    weights = {name: consolidated(tmp_path, name) for name in ("one", "two", "balanced")}
    model = SASRec(**{**ARGS, **SIZES, "hidden_dim": 32})
    model.load_state_dict(weights["two"], strict=True)
    dim = TRAIN["sequence"]["hidden_dim"]
    for name, tensor in weights["one"].items():
        for other in ("two", "balanced"):
            moved = weights[other][name].clone()
            expected = tensor.clone()
            if name.endswith("attention.qkv.bias"):
                # The key bias has an exactly-zero gradient (softmax ignores a constant
                # shift), so Adam turns float noise into lr-sized steps: not compared.
                moved[dim : 2 * dim] = expected[dim : 2 * dim] = 0
            torch.testing.assert_close(moved, expected, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.slow
def test_shared_negatives_train_the_same_on_one_stage_and_on_two(tmp_path: Path) -> None:
    # The (N,) shared set travels between the stages with the activations; the last
    # stage scores it. Both layouts draw the same sets, so the losses agree.
    shared = {"loss": "sampled_softmax", "num_negatives": 64, "shared_negatives": True}
    one = launch(pipeline_spec(tmp_path, steps=8, sequence=shared), tmp_path, "one")
    two = launch(
        pipeline_spec(
            tmp_path, num_stages=2, steps=8, sequence={**shared, "partition_method": "blocks"}
        ),
        tmp_path,
        "two",
    )
    assert len(one["losses"]) == 8 and two["parts"] == [0, 3, 6]
    for step, (a, b) in enumerate(zip(one["losses"], two["losses"], strict=True)):
        assert b == pytest.approx(a, rel=1e-4), f"step {step}: {a} vs {b}"
    assert sum(one["losses"][-3:]) < sum(one["losses"][:3])


@pytest.mark.slow
def test_pipeline_with_zero1_data_parallel_replicas_trains_like_data_parallel_alone(
    tmp_path: Path,
) -> None:
    # Hybrid: 2 stages x 2 data-parallel replicas (ZeRO-1) on 4 ranks, against the same 2
    # replicas without a pipeline on 2 ranks. Replica r runs the same micro batches of the
    # global stream in both, so the global batches and hence the losses agree.
    flat = launch(pipeline_spec(tmp_path, 1, 2, steps=8, zero_stage=1), tmp_path, "flat")
    blocks = {"partition_method": "blocks"}
    hybrid = launch(
        pipeline_spec(tmp_path, 2, 4, steps=8, zero_stage=1, sequence=blocks), tmp_path, "hybrid"
    )
    assert flat["world_size"] == 2 and hybrid["world_size"] == 4
    assert hybrid["num_stages"] == 2 and hybrid["samples"] == flat["samples"] == 8 * 8 * 2 * 2
    for step, (a, b) in enumerate(zip(flat["losses"], hybrid["losses"], strict=True)):
        assert b == pytest.approx(a, rel=1e-4), f"step {step}: {a} vs {b}"
    model = SASRec(**{**ARGS, **SIZES, "hidden_dim": 32})
    model.load_state_dict(consolidated(tmp_path, "hybrid"), strict=True)
