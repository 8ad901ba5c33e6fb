import json

import pytest
import torch

from training.config import TrainConfig
from training.ctr.data import DatasetMeta
from training.ctr.model import CTRModel, build_arch, build_model, model_config_from

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
