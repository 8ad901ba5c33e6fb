import json

import pytest
import torch

from training.config import TrainConfig
from training.data import DatasetMeta
from training.model import DLRM, build_model, model_config_from

NUM_EMBEDDINGS = [20, 7, 5]
NUM_DENSE = 3


def make_model(interaction: str) -> DLRM:
    torch.manual_seed(0)
    bottom = [16, 8] if interaction == "dot" else [16, 6]
    return DLRM(NUM_EMBEDDINGS, NUM_DENSE, 8, bottom, [12], interaction, num_cross_layers=2)


def make_inputs(batch: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    sparse = torch.stack(
        [torch.randint(0, n, (batch,), generator=generator) for n in NUM_EMBEDDINGS], dim=1
    )
    return sparse, torch.randn(batch, NUM_DENSE, generator=generator)


@pytest.mark.parametrize("interaction", ["dot", "cross"])
def test_forward_gives_one_logit_per_row_and_gradients_reach_every_parameter(
    interaction: str,
) -> None:
    model = make_model(interaction)
    sparse, dense = make_inputs()
    logits = model(sparse, dense)
    assert logits.shape == (5,)
    logits.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_dot_interaction_matches_explicit_pairwise_products() -> None:
    model = make_model("dot")
    sparse, dense = make_inputs()
    with torch.no_grad():
        bottom = model.bottom(dense)  # (B, D)
        vectors = [bottom] + [table(sparse[:, i]) for i, table in enumerate(model.embeddings)]
        pairs = [
            (vectors[i] * vectors[j]).sum(dim=1)
            for i in range(len(vectors))
            for j in range(i + 1, len(vectors))
        ]
        assert len(pairs) == 6  # (F+1)F/2 with F = 3
        features = torch.cat([bottom, torch.stack(pairs, dim=1)], dim=1)
        expected = model.head(model.top(features)).squeeze(1)
        torch.testing.assert_close(model(sparse, dense), expected)


def test_cross_interaction_matches_dcn_v2_formula() -> None:
    model = make_model("cross")
    sparse, dense = make_inputs()
    with torch.no_grad():
        embedded = [table(sparse[:, i]) for i, table in enumerate(model.embeddings)]
        x0 = torch.cat([model.bottom(dense), *embedded], dim=1)
        assert x0.shape == (5, 6 + 3 * 8)
        x = x0
        for layer in model.cross:
            x = x0 * (x @ layer.weight.T + layer.bias) + x
        expected = model.head(model.top(x)).squeeze(1)
        torch.testing.assert_close(model(sparse, dense), expected)


def test_dot_interaction_rejects_bottom_mlp_not_ending_at_embedding_dim() -> None:
    with pytest.raises(ValueError, match="embedding_dim"):
        DLRM(NUM_EMBEDDINGS, NUM_DENSE, 8, [16, 6], [12], "dot", 2)


@pytest.mark.parametrize("interaction", ["dot", "cross"])
def test_model_config_round_trips_through_json(interaction: str) -> None:
    bottom = [16, 8] if interaction == "dot" else [16, 4]
    config = TrainConfig(interaction=interaction, embedding_dim=8, bottom_mlp=bottom, top_mlp=[12])
    meta = DatasetMeta.model_validate(
        {
            "label": "click",
            "sparse": [
                {"name": f"f{i}", "num_embeddings": n} for i, n in enumerate(NUM_EMBEDDINGS)
            ],
            "dense": [f"d{i}" for i in range(NUM_DENSE)],
            "splits": {},
        }
    )
    model_config = model_config_from(config, meta)
    assert model_config == json.loads(json.dumps(model_config))
    trained = build_model(model_config)
    rebuilt = build_model(json.loads(json.dumps(model_config)))
    rebuilt.load_state_dict(trained.state_dict())  # strict: same names and shapes
    sparse, dense = make_inputs()
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(sparse, dense), trained(sparse, dense))


def test_build_model_rejects_unknown_and_missing_keys() -> None:
    config = {
        "num_embeddings": NUM_EMBEDDINGS,
        "num_dense": NUM_DENSE,
        "embedding_dim": 8,
        "bottom_mlp": [8],
        "top_mlp": [4],
        "interaction": "dot",
        "num_cross_layers": 1,
    }
    build_model(config)
    with pytest.raises(ValueError, match="unknown keys \\['dropout'\\]"):
        build_model({**config, "dropout": 0.1})
    with pytest.raises(ValueError, match="missing keys \\['top_mlp'\\]"):
        build_model({k: v for k, v in config.items() if k != "top_mlp"})


@pytest.mark.parametrize("interaction", ["dot", "cross"])
def test_traced_model_handles_other_batch_sizes(interaction: str) -> None:
    model = make_model(interaction).eval()
    traced = torch.jit.trace(model, make_inputs(2))
    sparse, dense = make_inputs(9)
    with torch.no_grad():
        torch.testing.assert_close(traced(sparse, dense), model(sparse, dense))
