"""The sequence models, by `train.model` name: what train (and later evaluate/export) needs.

Reads and writes nothing. A new sequence model is one module (the `nn.Module`, its
pipeline layers, loss and batches, as `training.sequence.sasrec` and `bst`) plus one
`SequenceModel` entry in `SEQUENCE_MODEL_REGISTRY`; the pipeline worker, the memory
plan and the model config look the model up here instead of branching on its name.

Every builder takes the `model_config.json` dict that `training.sequence.train`
writes: the shared architecture (`num_items`, `max_length`, `hidden_dim`,
`num_blocks`, `num_heads`, `dropout`) plus the model's own options
(`SequenceModel.model_options`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from deepspeed.pipe import LayerSpec
from torch import nn

from artifacts.errors import ConfigError
from training.runtime.deepspeed_config import AdamSettings
from training.sequence.bst import (
    bst_activation_shape,
    bst_loss,
    bst_micro_batch,
    bst_model_options,
    bst_pipeline_state_to_model,
    build_bst,
    build_bst_pipeline_layers_from,
)
from training.sequence.ranking import ScoreFn, candidate_score_fn, state_score_fn
from training.sequence.sasrec import (
    ARCHITECTURE_ARGS,
    LOSSES,
    build_sasrec,
    build_sasrec_pipeline_layers,
    pipeline_state_to_sasrec,
    sasrec_activation_shape,
    sasrec_micro_batch,
    sasrec_model_options,
)

# (logits, labels) -> scalar loss, as DeepSpeed's PipelineModule calls its loss_fn.
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# (rows, max_length, num_items, num_negatives, generator, shared) -> (inputs, labels).
MicroBatchFn = Callable[
    [list[list[int]], int, int, int, torch.Generator, bool],
    tuple[tuple[torch.Tensor, ...], torch.Tensor],
]


@dataclass(frozen=True)
class SequenceModel:
    """One sequence model's pieces, each a plain function of plain arguments.

    Attributes:
        name: The `train.model` value (also `model_config.json`'s "model").
        build_model: model_config dict -> the whole `nn.Module` (what the consolidated
            weights load into, and what evaluate/export score with).
        build_pipeline_layers: model_config dict -> `deepspeed.pipe` layer specs.
        losses: `train.sequence.loss` values this model trains with -> the
            PipelineModule's loss function; other values are refused.
        micro_batch: (train rows, L, V, negatives, generator, shared negatives) -> one
            pipeline micro batch `(inputs, labels)` as `engine.train_batch` pulls it.
        pipeline_state_to_model: Merged per-layer checkpoint tensors (`<layer>.<name>`)
            -> the model's state dict.
        min_items: Train histories with fewer items are skipped by the reader.
        model_options: (train.sequence.mlp, preprocess's item features {name: size}) ->
            the model's own `model_config.json` arguments beyond the shared ones;
            raises ConfigError for inputs the model cannot take.
        activation_shape: (sequences per micro batch, L, negatives) -> (rows, positions,
            candidate vectors gathered per position), for the memory plan.
        adam: The dense optimizer's DeepSpeed name and betas
            (`training.runtime.deepspeed_config.build_deepspeed_config`).

    Evaluate and export:
        config_keys: The `model_config.json` keys besides "model" the model needs;
            loading refuses a config without one of them.
        optional_config_keys: Keys it may also have; any other key is refused.
        ranking_score_fn: (model in eval mode, (U, L) histories, first row number,
            rows per block) -> the leave-one-out protocols' score_fn
            (`training.sequence.ranking`).
        full_ranking: Whether the model scores every item of a user at once (a user
            state against the item table): evaluate's full-ranking protocol runs and
            export packages a top-K recommender; else only sampled candidates are
            ranked and export packages a candidate scorer.
    """

    name: str
    build_model: Callable[[Mapping[str, Any]], nn.Module]
    build_pipeline_layers: Callable[[Mapping[str, Any]], list[LayerSpec]]
    losses: Mapping[str, LossFn]
    micro_batch: MicroBatchFn
    pipeline_state_to_model: Callable[[Mapping[str, torch.Tensor]], dict[str, torch.Tensor]]
    min_items: int
    model_options: Callable[[list[int], Mapping[str, int]], dict[str, Any]]
    activation_shape: Callable[[int, int, int], tuple[int, int, int]]
    adam: AdamSettings
    # Evaluate and export.
    config_keys: tuple[str, ...]
    optional_config_keys: tuple[str, ...]
    ranking_score_fn: Callable[[Any, torch.Tensor, int, int], ScoreFn]
    full_ranking: bool


# SASRec's Adam (Kang & McAuley, 2018: beta2 = 0.98); BST trains with the same.
TRANSFORMER_ADAM = AdamSettings(type="Adam", betas=(0.9, 0.98))


SEQUENCE_MODEL_REGISTRY: Mapping[str, SequenceModel] = {
    "sasrec": SequenceModel(
        name="sasrec",
        build_model=build_sasrec,
        build_pipeline_layers=build_sasrec_pipeline_layers,
        losses=LOSSES,
        micro_batch=sasrec_micro_batch,
        pipeline_state_to_model=pipeline_state_to_sasrec,
        min_items=1,
        model_options=sasrec_model_options,
        activation_shape=sasrec_activation_shape,
        adam=TRANSFORMER_ADAM,
        # Evaluate and export.
        config_keys=ARCHITECTURE_ARGS,
        optional_config_keys=("item_features",),
        ranking_score_fn=state_score_fn,
        full_ranking=True,
    ),
    "bst": SequenceModel(
        name="bst",
        build_model=build_bst,
        build_pipeline_layers=build_bst_pipeline_layers_from,
        # BST's labels are the clicks of its sampled targets: always BCE.
        losses={"bce": bst_loss},
        micro_batch=bst_micro_batch,
        pipeline_state_to_model=bst_pipeline_state_to_model,
        # A history and a target.
        min_items=2,
        model_options=bst_model_options,
        activation_shape=bst_activation_shape,
        adam=TRANSFORMER_ADAM,
        # Evaluate and export.
        config_keys=(*ARCHITECTURE_ARGS, "mlp"),
        optional_config_keys=(),
        # One Transformer pass per (user, candidate): ranking every item is too dear.
        ranking_score_fn=candidate_score_fn,
        full_ranking=False,
    ),
}


def sequence_model(name: str) -> SequenceModel:
    """The registry entry of a `train.model` name.

    Raises:
        ConfigError: No sequence model has that name (the message lists them).
    """
    try:
        return SEQUENCE_MODEL_REGISTRY[name]
    except KeyError:
        raise ConfigError(
            f"train.model={name!r} is not a sequence model; use one of "
            f"{sorted(SEQUENCE_MODEL_REGISTRY)}"
        ) from None
