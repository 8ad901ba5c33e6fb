import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from training.config import TrainConfig
from training.ctr.data import DatasetMeta
from training.ctr.embedding import SCALE_BIAS, TABLE_DTYPES, decode_rows, encode_rows
from training.ctr.model import (
    CompactTable,
    CTRModel,
    build_arch,
    build_model,
    lay_onto_transform,
    load_model,
    model_config_from,
    table_footprint,
)

TABLE_SIZES = [20, 7, 5, 9]  # three single-valued features, then one multi-hot
NUM_DENSE = 3
MODEL_ARGS = {
    "table_sizes": TABLE_SIZES,
    "num_multi_hot": 1,
    "num_dense": NUM_DENSE,
    "embedding_dim": 8,
    "bottom_mlp": [16, 8],
    "top_mlp": [12],
    "interaction": "dot",
    "num_cross_layers": 2,
    "tasks": ["click", "purchase"],
    "pooling": "mean",
}


def make_model(interaction: str, pooling: str = "mean") -> CTRModel:
    torch.manual_seed(0)
    bottom = [16, 8] if interaction == "dot" else [16, 6]
    model = build_model(
        {**MODEL_ARGS, "interaction": interaction, "bottom_mlp": bottom, "pooling": pooling}
    )
    with torch.no_grad():  # default rows start at zero; make them visible to the tests
        model.arch.default_rows.normal_()
    return model


def make_inputs(batch: int = 5) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    sparse = torch.stack(
        [torch.randint(0, n, (batch,), generator=generator) for n in TABLE_SIZES[:3]], dim=1
    )
    multi = torch.randint(0, TABLE_SIZES[3], (batch, 4), generator=generator)
    multi[0, 1:] = -1  # one id
    multi[1, :] = -1  # no ids
    return sparse, torch.randn(batch, NUM_DENSE, generator=generator), multi


def embedded_features(model: CTRModel, sparse: torch.Tensor, multi: torch.Tensor) -> list:
    """Per-feature (B, D) embeddings computed the slow, obvious way."""
    table = model.embedding.weight
    offsets = [0, 20, 27, 32]
    vectors = [table[sparse[:, f] + offsets[f]] for f in range(3)]
    pooled = []
    for row in multi:
        ids = row[row >= 0] + offsets[3]
        pooled.append(table[ids].mean(dim=0) if ids.numel() else torch.zeros(8))
    return [*vectors, torch.stack(pooled)]


@pytest.mark.parametrize("interaction", ["dot", "cross"])
def test_forward_gives_one_logit_per_task_and_gradients_reach_every_parameter(
    interaction: str,
) -> None:
    model = make_model(interaction)
    logits = model(*make_inputs())
    assert logits.shape == (5, 2)
    logits.sum().backward()
    unused = {"arch.default_rows"}  # only read for rows not admitted (sharded training)
    assert all(p.grad is not None for n, p in model.named_parameters() if n not in unused)


def test_dot_interaction_matches_explicit_pairwise_products() -> None:
    model = make_model("dot")
    sparse, dense, multi = make_inputs()
    arch = model.arch
    with torch.no_grad():
        bottom = arch.bottom(dense)  # (B, D)
        vectors = [bottom, *embedded_features(model, sparse, multi)]
        pairs = [
            (vectors[i] * vectors[j]).sum(dim=1)
            for i in range(len(vectors))
            for j in range(i + 1, len(vectors))
        ]
        assert len(pairs) == 10  # (F+1)F/2 with F = 4
        features = torch.cat([bottom, torch.stack(pairs, dim=1)], dim=1)
        expected = arch.heads(arch.top(features))
        torch.testing.assert_close(model(sparse, dense, multi), expected)


def test_cross_interaction_matches_dcn_v2_formula() -> None:
    model = make_model("cross")
    sparse, dense, multi = make_inputs()
    arch = model.arch
    with torch.no_grad():
        x0 = torch.cat([arch.bottom(dense), *embedded_features(model, sparse, multi)], dim=1)
        assert x0.shape == (5, 6 + 4 * 8)
        x = x0
        for layer in arch.cross:
            x = x0 * (x @ layer.weight.T + layer.bias) + x
        expected = arch.heads(arch.top(x))
        torch.testing.assert_close(model(sparse, dense, multi), expected)


def test_sum_pooling_is_mean_times_count() -> None:
    sparse, dense, multi = make_inputs()
    mean_model, sum_model = make_model("cross", "mean"), make_model("cross", "sum")
    with torch.no_grad():
        table = mean_model.embedding.weight
        ids = multi[2][multi[2] >= 0] + 32
        row_mean = table[ids].mean(dim=0)
        row_sum = table[ids].sum(dim=0)
    torch.testing.assert_close(row_sum, row_mean * ids.numel())
    assert not torch.allclose(sum_model(sparse, dense, multi), mean_model(sparse, dense, multi))


def test_arch_on_unique_rows_equals_the_full_model() -> None:
    """The sharded engine feeds CTRArch a batch's unique rows; the result must not change."""
    model = make_model("dot")
    sparse, dense, multi = make_inputs()
    offsets = torch.tensor([0, 20, 27, 32])
    global_single = sparse + offsets[:3]
    global_multi = torch.where(multi >= 0, multi + offsets[3], multi)
    ids = torch.cat([global_single.flatten(), global_multi[global_multi >= 0]])
    unique, inverse = torch.unique(ids, return_inverse=True)
    rows = model.embedding.weight[unique]
    sparse_index = inverse[: global_single.numel()].view_as(sparse)
    multi_index = torch.full_like(multi, -1)
    multi_index[multi >= 0] = inverse[global_single.numel() :]
    with torch.no_grad():
        expected = model(sparse, dense, multi)
        actual = model.arch(rows, sparse_index, dense, [multi_index])
        torch.testing.assert_close(actual, expected)
        # Rows not admitted read their feature's default row instead.
        admitted = torch.ones(unique.numel(), dtype=torch.bool)
        admitted[0] = False
        feature = torch.searchsorted(offsets[1:], unique, right=True)
        swapped = rows.clone()
        swapped[0] = model.arch.default_rows[feature[0]]
        torch.testing.assert_close(
            model.arch(rows, sparse_index, dense, [multi_index], admitted, feature),
            model.arch(swapped, sparse_index, dense, [multi_index]),
        )


def test_dot_interaction_rejects_bottom_mlp_not_ending_at_embedding_dim() -> None:
    with pytest.raises(ValueError, match="embedding_dim"):
        build_model({**MODEL_ARGS, "bottom_mlp": [16, 6]})


@pytest.mark.parametrize("interaction", ["dot", "cross"])
def test_model_config_round_trips_through_json(interaction: str) -> None:
    bottom = [16, 8] if interaction == "dot" else [16, 4]
    config = TrainConfig(interaction=interaction, embedding_dim=8, bottom_mlp=bottom, top_mlp=[12])
    meta = DatasetMeta.model_validate(
        {
            "label": "click",
            "sparse": [{"name": f"f{i}", "num_embeddings": n} for i, n in enumerate([20, 7, 5])],
            "multi_hot": [{"name": "tags", "num_embeddings": 9}],
            "dense": [f"d{i}" for i in range(NUM_DENSE)],
            "splits": {},
        }
    )
    model_config = model_config_from(config, meta)
    assert model_config["table_sizes"] == TABLE_SIZES and model_config["tasks"] == ["click"]
    assert model_config == json.loads(json.dumps(model_config))
    trained = build_model(model_config)
    rebuilt = build_model(json.loads(json.dumps(model_config)))
    rebuilt.load_state_dict(trained.state_dict())  # strict: same names and shapes
    # The arch alone has the same parameters as the model's `arch.` part.
    arch_names = {f"arch.{name}" for name in build_arch(model_config).state_dict()}
    assert arch_names == {name for name in trained.state_dict() if name.startswith("arch.")}
    sparse, dense, multi = make_inputs()
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(sparse, dense, multi), trained(sparse, dense, multi))


def test_build_model_rejects_unknown_and_missing_keys() -> None:
    build_model(MODEL_ARGS)
    with pytest.raises(ValueError, match="unknown keys \\['drop_rate'\\]"):
        build_model({**MODEL_ARGS, "drop_rate": 0.1})
    with pytest.raises(ValueError, match="missing keys \\['top_mlp'\\]"):
        build_model({k: v for k, v in MODEL_ARGS.items() if k != "top_mlp"})
    # Models exported before dropout existed load as dropout 0.
    assert "dropout" not in MODEL_ARGS
    assert not any(isinstance(m, torch.nn.Dropout) for m in build_model(MODEL_ARGS).modules())


def test_dropout_is_active_in_training_only() -> None:
    model = build_model({**MODEL_ARGS, "dropout": 0.5})
    assert sum(isinstance(m, torch.nn.Dropout) for m in model.modules()) == len(
        MODEL_ARGS["bottom_mlp"]
    ) + len(MODEL_ARGS["top_mlp"])
    sparse, dense, multi = make_inputs()
    torch.manual_seed(0)
    first, second = model(sparse, dense, multi), model(sparse, dense, multi)
    assert not torch.equal(first, second)
    model.eval()
    torch.testing.assert_close(model(sparse, dense, multi), model(sparse, dense, multi))
    with pytest.raises(ValueError, match="dropout must be in"):
        build_model({**MODEL_ARGS, "dropout": 1.0})


@pytest.mark.parametrize("interaction", ["dot", "cross"])
def test_traced_model_handles_other_batch_sizes(interaction: str) -> None:
    model = make_model(interaction).eval()
    traced = torch.jit.trace(model, make_inputs(2))
    inputs = make_inputs(9)
    with torch.no_grad():
        torch.testing.assert_close(traced(*inputs), model(*inputs))


# -- table precision: the compact table, decoded after the gather ----------------------

COMPACT = ["fp16", "bf16", "int8"]
META = DatasetMeta.model_validate(
    {
        "label": "click",
        "sparse": [{"name": f"f{i}", "num_embeddings": n} for i, n in enumerate(TABLE_SIZES[:3])],
        "multi_hot": [{"name": "tags", "num_embeddings": TABLE_SIZES[3]}],
        "dense": [f"d{i}" for i in range(NUM_DENSE)],
        "splits": {},
    }
)


def compact_pair(
    precision: str, interaction: str = "dot", pooling: str = "mean"
) -> tuple[CTRModel, CTRModel]:
    """(a model whose table is stored at `precision`, an fp32 model holding that table's
    decoded values and the same dense part); fp32: two equal models."""
    reference = make_model(interaction, pooling).eval()
    stored = encode_rows(reference.embedding.weight.detach(), precision)  # type: ignore[arg-type]
    with torch.no_grad():
        reference.embedding.weight.copy_(decode_rows(stored["weight"], stored.get(SCALE_BIAS)))
    bottom = [16, 8] if interaction == "dot" else [16, 6]
    compact = build_model(
        {
            **MODEL_ARGS,
            "interaction": interaction,
            "bottom_mlp": bottom,
            "pooling": pooling,
            "table_precision": precision,
        }
    ).eval()
    state = {n: t for n, t in reference.state_dict().items() if not n.startswith("embedding.")}
    compact.load_state_dict({**state, **{f"embedding.{n}": t for n, t in stored.items()}})
    return compact, reference


@pytest.mark.parametrize("precision", COMPACT)
@pytest.mark.parametrize(("interaction", "pooling"), [("dot", "mean"), ("cross", "sum")])
def test_a_compact_table_scores_exactly_as_its_decoded_rows(
    precision: str, interaction: str, pooling: str
) -> None:
    compact, reference = compact_pair(precision, interaction, pooling)
    state = compact.state_dict()
    assert state["embedding.weight"].dtype == TABLE_DTYPES[precision]
    assert ("embedding.scale_bias" in state) == (precision == "int8")
    # Buffers, not parameters: nothing trains them and the dense part is what
    # `parameters()` lists.
    assert not any(name.startswith("embedding.") for name, _ in compact.named_parameters())
    sparse, dense, multi = make_inputs(9)
    with torch.no_grad():
        # Gathering compact rows and decoding them gives the decoded table's rows, bitwise.
        assert torch.equal(compact(sparse, dense, multi), reference(sparse, dense, multi))
        index = torch.tensor([[0, 5], [40, 5]])  # rows of the 41
        assert torch.equal(compact.embedding(index), reference.embedding.weight[index])


def test_int8_rows_decode_as_code_times_scale_plus_bias() -> None:
    table = CompactTable(3, 2, "int8")
    with torch.no_grad():
        table.weight.copy_(torch.tensor([[0, 255], [10, 20], [1, 2]], dtype=torch.uint8))
        table.scale_bias.copy_(torch.tensor([[0.5, -1.0], [0.25, 2.0], [0.0, 7.0]]))
    rows = table(torch.tensor([[1, 0], [2, 2]]))  # (2, 2, D)
    expected = torch.tensor([[[4.5, 7.0], [-1.0, 126.5]], [[7.0, 7.0], [7.0, 7.0]]])
    assert rows.dtype == torch.float32 and torch.equal(rows, expected)
    half = CompactTable(2, 2, "fp16")
    with torch.no_grad():
        half.weight.copy_(torch.tensor([[0.1, -2.0], [65504.0, 1e-7]]))
    assert torch.equal(half(torch.tensor([1])), half.weight[1:].float())  # exact upcast
    with pytest.raises(ValueError, match="fp16, bf16 or int8"):
        CompactTable(2, 2, "fp32")
    with pytest.raises(ValueError, match="table_precision must be one of"):
        build_model({**MODEL_ARGS, "table_precision": "int4"})


@pytest.mark.parametrize("precision", COMPACT)
def test_a_traced_compact_model_keeps_the_compact_table(precision: str) -> None:
    compact, _ = compact_pair(precision)
    traced = torch.jit.trace(compact, make_inputs(2))
    buffers = traced.state_dict()
    assert buffers["embedding.weight"].dtype == TABLE_DTYPES[precision]
    rows = sum(TABLE_SIZES)
    # No fp32 copy of the table anywhere in the traced module: only the decoded rows of
    # a batch ever are fp32.
    assert not any(t.dtype == torch.float32 and t.shape == (rows, 8) for t in buffers.values())
    inputs = make_inputs(7)
    with torch.no_grad():
        assert torch.equal(traced(*inputs), compact(*inputs))


def write_model_dir(directory: Path, model: CTRModel, model_config: dict) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "model_config.json").write_text(json.dumps(model_config))
    save_file(model.state_dict(), str(directory / "model.safetensors"))
    return directory


@pytest.mark.parametrize("precision", ["fp32", *COMPACT])
def test_load_model_holds_the_table_as_stored(precision: str, tmp_path: Path) -> None:
    compact, reference = compact_pair(precision)  # fp32: the same model twice
    model_config = {**MODEL_ARGS, "table_precision": precision}
    loaded, config = load_model(write_model_dir(tmp_path / "m", compact, model_config))
    assert loaded.embedding.weight.dtype == TABLE_DTYPES[precision]
    assert config["table_precision"] == loaded.table_precision == precision
    assert all(p.dtype == torch.float32 for p in loaded.parameters())
    sparse, dense, multi = make_inputs()
    with torch.no_grad():
        assert torch.equal(loaded(sparse, dense, multi), reference.eval()(sparse, dense, multi))
    # A config written before table_precision was recorded: the file says which.
    legacy = {k: v for k, v in model_config.items() if k != "table_precision"}
    loaded, config = load_model(write_model_dir(tmp_path / "legacy", compact, legacy))
    assert config["table_precision"] == precision
    assert loaded.embedding.weight.dtype == TABLE_DTYPES[precision]


def test_load_model_refuses_a_config_of_another_precision_than_its_weights(
    tmp_path: Path,
) -> None:
    compact, _ = compact_pair("fp16")
    directory = write_model_dir(tmp_path / "m", compact, {**MODEL_ARGS, "table_precision": "int8"})
    with pytest.raises(ValueError, match="says table_precision 'int8' but .* as fp16 rows"):
        load_model(directory)


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_a_view_on_an_extended_transform_keeps_the_stored_rows(
    precision: str, tmp_path: Path
) -> None:
    model_config = {**MODEL_ARGS, "table_precision": precision}
    package = write_model_dir(tmp_path / "parent", compact_pair(precision)[0], model_config)
    # f0 grows by 5 rows and reuses its row 3 for a new id; the other tables keep theirs.
    new_sizes = [25, *TABLE_SIZES[1:]]
    meta = META.model_copy(
        update={
            "sparse": [
                feature.model_copy(update={"num_embeddings": n})
                for feature, n in zip(META.sparse, new_sizes, strict=False)
            ]
        }
    )
    transform = {
        "parent_sizes": {"f0": 20, "f1": 7, "f2": 5, "tags": 9},
        "changes": {"f0": {"reset_rows": [3]}},
    }
    view = lay_onto_transform(package, transform, meta, tmp_path / "view")
    loaded, config = load_model(view)
    assert config["table_sizes"] == new_sizes and loaded.table_precision == precision
    parent = load_file(str(package / "model.safetensors"))
    weights = load_file(str(view / "model.safetensors"))
    assert weights["embedding.weight"].dtype == TABLE_DTYPES[precision]
    # Every per-row tensor moved alike: (rows, and int8's scale and bias).
    for name in [n for n in parent if n.startswith("embedding.")]:
        old, new = parent[name], weights[name]
        assert new.shape[0] == sum(new_sizes)
        oov = old[0]
        kept = [i for i in range(20) if i != 3]
        assert torch.equal(new[kept], old[kept])
        assert all(torch.equal(new[i], oov) for i in (3, 20, 21, 24))  # the OOV row
        assert torch.equal(new[25:], old[20:])  # the later features, shifted by 5 rows


def test_table_footprint_counts_the_stored_bytes() -> None:
    rows = sum(TABLE_SIZES)
    config = {**MODEL_ARGS, "table_precision": "fp16"}
    assert table_footprint(config) == {
        "precision": "fp16",
        "rows": rows,
        "embedding_dim": 8,
        "bytes": rows * 8 * 2,
    }
    assert table_footprint({**config, "table_precision": "int8"})["bytes"] == rows * (8 + 8)
    assert table_footprint(MODEL_ARGS)["bytes"] == rows * 8 * 4  # recorded before: fp32
    for precision in ["fp32", *COMPACT]:
        model = build_model({**MODEL_ARGS, "table_precision": precision})
        stored = sum(
            t.numel() * t.element_size()
            for n, t in model.state_dict().items()
            if n.startswith("embedding.")
        )
        assert table_footprint({**config, "table_precision": precision})["bytes"] == stored
