"""CTR models: DLRM with a dot-product or a DCN-v2 cross interaction.

The module takes plain typed arguments. `model_config_from` turns the train config
and the dataset description into a JSON-able dict of exactly those arguments
(saved as `model_config.json` next to the weights), and `build_model` rebuilds
the module from that dict, so evaluation and export never need the train config.

Shapes: B = batch, F = sparse features, Dn = dense features, D = embedding_dim.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from data_prep.errors import InputNotFoundError
from training.config import TrainConfig
from training.data import DatasetMeta

MODEL_CONFIG_FILE = "model_config.json"
WEIGHTS_FILE = "model.safetensors"

_MODEL_ARGS = (
    "num_embeddings",
    "num_dense",
    "embedding_dim",
    "bottom_mlp",
    "top_mlp",
    "interaction",
    "num_cross_layers",
)


def _mlp(in_features: int, sizes: list[int]) -> nn.Sequential:
    """Linear + ReLU for every size in `sizes`."""
    layers: list[nn.Module] = []
    for size in sizes:
        layers += [nn.Linear(in_features, size), nn.ReLU()]
        in_features = size
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    """DLRM-style CTR model: embeddings + bottom MLP -> interaction -> top MLP -> logit.

    Dot interaction (DLRM): the bottom MLP output and the F embeddings, F + 1 vectors
    of width D, interact through their pairwise dot products (upper triangle without
    the diagonal), which are concatenated with the bottom output.
    Cross interaction (DCN-v2): x0 = [bottom output, all embeddings] passes through
    `num_cross_layers` layers x_{l+1} = x0 * (W_l x_l + b_l) + x_l.

    Args:
        num_embeddings: Table size of each sparse feature (F tables of width D).
        num_dense: Number of dense features Dn.
        embedding_dim: Embedding width D.
        bottom_mlp: Layer sizes of the MLP over the dense features; the last must be D
            for the dot interaction.
        top_mlp: Hidden layer sizes after the interaction; a 1-unit layer is appended.
        interaction: "dot" or "cross".
        num_cross_layers: Number of cross layers ("cross" only).

    Raises:
        ValueError: An argument is out of range or the sizes do not fit together.
    """

    def __init__(
        self,
        num_embeddings: list[int],
        num_dense: int,
        embedding_dim: int,
        bottom_mlp: list[int],
        top_mlp: list[int],
        interaction: str,
        num_cross_layers: int,
    ) -> None:
        super().__init__()
        if not num_embeddings:
            raise ValueError("num_embeddings: need at least one sparse feature")
        if not bottom_mlp:
            raise ValueError("bottom_mlp: need at least one layer")
        if interaction not in ("dot", "cross"):
            raise ValueError(f"interaction must be 'dot' or 'cross', got {interaction!r}")
        if interaction == "dot" and bottom_mlp[-1] != embedding_dim:
            raise ValueError(
                f"bottom_mlp[-1] ({bottom_mlp[-1]}) must equal embedding_dim "
                f"({embedding_dim}) for the dot interaction"
            )
        self.interaction = interaction
        num_sparse = len(num_embeddings)

        self.embeddings = nn.ModuleList(nn.Embedding(n, embedding_dim) for n in num_embeddings)
        self.bottom = _mlp(num_dense, bottom_mlp)

        if interaction == "dot":
            vectors = num_sparse + 1
            rows, cols = torch.triu_indices(vectors, vectors, offset=1)
            # Flat positions of the upper triangle in the (F+1) x (F+1) Gram matrix.
            # Not persistent: it is derived from the shapes, not learned.
            self.register_buffer("pair_index", rows * vectors + cols, persistent=False)
            interaction_width = bottom_mlp[-1] + vectors * (vectors - 1) // 2
            self.cross = nn.ModuleList()
        else:
            interaction_width = bottom_mlp[-1] + num_sparse * embedding_dim
            self.cross = nn.ModuleList(
                nn.Linear(interaction_width, interaction_width) for _ in range(num_cross_layers)
            )
        self.top = _mlp(interaction_width, top_mlp)
        self.head = nn.Linear(top_mlp[-1] if top_mlp else interaction_width, 1)
        self._init_embeddings()

    def _init_embeddings(self) -> None:
        # DLRM reference init: U(-1/sqrt(n), 1/sqrt(n)); N(0, 1) would swamp the MLPs.
        for table in self.embeddings:
            bound = 1.0 / math.sqrt(table.num_embeddings)
            nn.init.uniform_(table.weight, -bound, bound)

    def forward(self, sparse: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        """Score a batch.

        Args:
            sparse: (B, F) int64 indices, column i in [0, num_embeddings[i]).
            dense: (B, Dn) floats, in the dtype of the parameters.

        Returns:
            (B,) logits.
        """
        bottom = self.bottom(dense)  # (B, Db)
        embedded = [table(sparse[:, i]) for i, table in enumerate(self.embeddings)]  # F x (B, D)
        if self.interaction == "dot":
            vectors = torch.stack([bottom, *embedded], dim=1)  # (B, F+1, D)
            gram = torch.bmm(vectors, vectors.transpose(1, 2))  # (B, F+1, F+1)
            pairs = gram.flatten(1)[:, self.pair_index]  # (B, (F+1)F/2)
            features = torch.cat([bottom, pairs], dim=1)
        else:
            x0 = torch.cat([bottom, *embedded], dim=1)  # (B, Db + F*D)
            x = x0
            for layer in self.cross:
                x = x0 * layer(x) + x
            features = x
        return self.head(self.top(features)).squeeze(1)  # (B,)


def model_config_from(train_config: TrainConfig, dataset_meta: DatasetMeta) -> dict[str, Any]:
    """The `DLRM` constructor arguments for a train config and a dataset.

    Args:
        train_config: The train section.
        dataset_meta: The shard directory's description (feature order and sizes).

    Returns:
        A JSON-able dict with exactly the `DLRM.__init__` arguments.
    """
    return {
        "num_embeddings": dataset_meta.num_embeddings,
        "num_dense": len(dataset_meta.dense),
        "embedding_dim": train_config.embedding_dim,
        "bottom_mlp": list(train_config.bottom_mlp),
        "top_mlp": list(train_config.top_mlp),
        "interaction": train_config.interaction,
        "num_cross_layers": train_config.num_cross_layers,
    }


def build_model(model_config: Mapping[str, Any]) -> DLRM:
    """Build a freshly initialised `DLRM` from a `model_config_from` dict.

    Args:
        model_config: The constructor arguments (e.g. read from model_config.json).

    Returns:
        The model, in fp32 on the CPU.

    Raises:
        ValueError: Keys are missing or unknown.
    """
    missing = sorted(set(_MODEL_ARGS) - set(model_config))
    unknown = sorted(set(model_config) - set(_MODEL_ARGS))
    if missing or unknown:
        raise ValueError(f"model config: missing keys {missing}, unknown keys {unknown}")
    return DLRM(**{name: model_config[name] for name in _MODEL_ARGS})


def load_model(train_dir: Path) -> tuple[DLRM, dict[str, Any]]:
    """Rebuild a trained model from `model_config.json` and `model.safetensors`.

    Args:
        train_dir: The train stage's output directory.

    Returns:
        (model in fp32 eval mode, its model config dict).

    Raises:
        InputNotFoundError: One of the two files is missing.
    """
    config_path = Path(train_dir) / MODEL_CONFIG_FILE
    weights_path = Path(train_dir) / WEIGHTS_FILE
    for path in (config_path, weights_path):
        if not path.is_file():
            raise InputNotFoundError(f"{path} does not exist; run the train stage first")
    model_config = json.loads(config_path.read_text())
    model = build_model(model_config)
    model.load_state_dict(load_file(weights_path))
    return model.float().eval(), model_config
