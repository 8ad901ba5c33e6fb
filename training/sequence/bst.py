"""BST: the Behavior Sequence Transformer (Chen et al., 2019) for CTR, and its pipeline form.

Reads nothing and writes nothing: the module, CTR samples from train sequences, the
loss, the DeepSpeed pipeline layers and candidate scoring.

The data are the train rows of `data_prep.sequences` (a user's items, oldest first;
item index 0 is padding). `bst_batch` turns them into implicit-feedback CTR samples:
a history, a target item and a 0/1 label.

Model (the SASRec blocks of `training.sequence.sasrec`, pre-LN):

    sequence = [history (left-padded to L), target]         # (B, L + 1)
    x = item_embedding(sequence) * sqrt(D) + position_embedding   # (B, L + 1, D)
    for each block:
        x = x + attention(LayerNorm(x))   # causal, padding keys masked
        x = x + ffn(LayerNorm(x))
    query = LayerNorm(x)[:, -1]                              # (B, D) the target position
    item = item_embedding(target) * sqrt(D)                  # (B, D) the same table
    logit = MLP([query, item, query * item])                 # (B,)

Differences from the paper: the attention is causal rather than bidirectional. The
target is the last position, so it still attends to the whole history in every block;
only the history positions no longer see the target, which with more than one block
is a (slightly) different function. Positions are learned per slot, right-aligned
(the target is always slot L), instead of the paper's time-difference encoding, and
there are no user or context features besides the sequence.

Pipeline form (`build_bst_pipeline_layers`): stages pass tuples of tensors only.

    layer 0           TiedLayerSpec "item_embedding"  (history (B, L), target (B,))
                                                -> (item_vectors (B, L + 1, D), sequence)
    layer 1           SequenceInputPipe     -> (hidden (B, L + 1, D), sequence)
    layers 2..2+K-1   TransformerBlockPipe (one per block, same tuple)
    layer 2+K         FinalNormPipe         -> (hidden, sequence)
    layer 3+K         TiedLayerSpec "item_embedding" (target features) -> features (B, 3D)
    layer 4+K         BSTHeadPipe           -> logits (B,)

`sequence` (B, L + 1) int64 is the padded history with the target appended; it rides
along unchanged (DeepSpeed sends no gradient for integer tensors). The loss function
of the PipelineModule is `bst_loss(logits, labels)`; one micro batch for
`engine.train_batch(data_iter)` is `((history, target), label)` (see
`bst_pipeline_batch`).

Shapes: B = batch, L = max_length (history length), D = hidden_dim, K = num_blocks,
C = candidate items, N = negatives per positive, V = num_items.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, TiedLayerSpec
from torch import nn

from artifacts.errors import ConfigError
from training.sequence.sasrec import (
    PADDING_ITEM,
    TIED_KEY,
    FinalNormPipe,
    SequenceInput,
    SequenceInputPipe,
    TransformerBlock,
    TransformerBlockPipe,
    architecture_args,
    block_parameter_name,
    init_item_table,
    split_pipeline_state,
)


def _check_bst_args(
    num_items: int,
    max_length: int,
    hidden_dim: int,
    num_blocks: int,
    num_heads: int,
    mlp: list[int],
) -> None:
    if num_items < 2:
        raise ConfigError(f"num_items={num_items}: need the padding item 0 and at least one item")
    if max_length < 1 or num_blocks < 1:
        raise ConfigError(
            f"max_length={max_length}, num_blocks={num_blocks}: both must be at least 1"
        )
    if hidden_dim % num_heads:
        raise ConfigError(
            f"hidden_dim={hidden_dim} is not divisible by num_heads={num_heads}; change one of them"
        )
    if any(size < 1 for size in mlp):
        raise ConfigError(f"mlp={mlp}: every hidden layer size must be at least 1")


def target_sequence(history: torch.Tensor, target: torch.Tensor, max_length: int) -> torch.Tensor:
    """The model's input sequence: the history left-padded to max_length, then the target.

    Padding a shorter history on the left keeps the target in the last position slot
    whatever the history length, so the same items get the same positions.

    Args:
        history: (B, L_h) int64, left-padded with 0, L_h <= max_length.
        target: (B,) int64 target items (>= 1).
        max_length: L.

    Returns:
        (B, L + 1) int64.

    Raises:
        ValueError: The history is longer than max_length.
    """
    length = history.shape[1]
    if length > max_length:
        raise ValueError(
            f"history length {length} exceeds max_length={max_length}; truncate the history"
        )
    history = F.pad(history, (max_length - length, 0), value=PADDING_ITEM)  # (B, L)
    return torch.cat([history, target.unsqueeze(1)], dim=1)  # (B, L + 1)


def target_features(
    weight: torch.Tensor, hidden: torch.Tensor, target: torch.Tensor
) -> torch.Tensor:
    """The MLP input: [query, item, query * item] from the final states and the table.

    The item vector is scaled by sqrt(D) as at the input, so that it has the unit
    scale of the LayerNorm'd query and the product is not ~1/D smaller than both.

    Args:
        weight: (V, D) item table.
        hidden: (B, L + 1, D) final (normalised) hidden states; the target is last.
        target: (B,) int64 target items.

    Returns:
        (B, 3 D).
    """
    query = hidden[:, -1]  # (B, D)
    item = F.embedding(target, weight, padding_idx=PADDING_ITEM) * math.sqrt(weight.shape[1])
    return torch.cat([query, item, query * item], dim=-1)  # (B, 3D)


def _build_head(hidden_dim: int, mlp: list[int], dropout: float) -> nn.Sequential:
    """The CTR head, (B, 3D) -> (B, 1): Linear + LeakyReLU (the paper's) + dropout per size."""
    layers: list[nn.Module] = []
    width = 3 * hidden_dim
    for size in mlp:
        layers += [nn.Linear(width, size), nn.LeakyReLU(), nn.Dropout(dropout)]
        width = size
    layers.append(nn.Linear(width, 1))
    return nn.Sequential(*layers)


class BST(nn.Module):
    """Behavior Sequence Transformer (Chen et al., 2019): click logit of a target item.

    Attention is causal (the blocks of `training.sequence.sasrec`): the target, in the
    last position, attends to the whole history, while history positions do not see
    the target (the paper's encoder is bidirectional; see the module docstring).
    History and target share one item table.

    Args:
        num_items: V, item indices 0..V-1, 0 the padding item.
        max_length: L, the history length (the position table has L + 1 rows).
        hidden_dim: D, the item embedding and model width.
        num_blocks: Transformer blocks.
        num_heads: Attention heads (divide hidden_dim).
        dropout: Dropout probability (input, blocks, head).
        mlp: Hidden layer sizes of the head, e.g. [64, 32].

    Raises:
        ConfigError: hidden_dim is not divisible by num_heads, num_items < 2,
            max_length or num_blocks < 1, or an mlp size < 1.
    """

    def __init__(
        self,
        num_items: int,
        max_length: int,
        hidden_dim: int,
        num_blocks: int,
        num_heads: int,
        dropout: float,
        mlp: list[int],
    ) -> None:
        super().__init__()
        _check_bst_args(num_items, max_length, hidden_dim, num_blocks, num_heads, mlp)
        self.max_length = max_length
        self.item_embedding = nn.Embedding(num_items, hidden_dim, padding_idx=PADDING_ITEM)
        init_item_table(self.item_embedding.weight)
        self.input = SequenceInput(max_length + 1, hidden_dim, dropout)
        self.blocks = nn.ModuleList(
            TransformerBlock(hidden_dim, num_heads, dropout) for _ in range(num_blocks)
        )
        self.final_norm = nn.LayerNorm(hidden_dim)
        self.head = _build_head(hidden_dim, mlp, dropout)

    def forward(self, history: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Click logits.

        Args:
            history: (B, L_h) int64 item indices, left-padded with 0, L_h <= max_length
                (a shorter history is left-padded to max_length).
            target: (B,) int64 target items, >= 1 (a padding target is masked like
                padding and its logit is meaningless).

        Returns:
            (B,) logits.

        Raises:
            ValueError: The history is longer than max_length.
        """
        sequence = target_sequence(history, target, self.max_length)  # (B, L + 1)
        x = self.input(self.item_embedding(sequence), sequence)  # (B, L + 1, D)
        for block in self.blocks:
            x = block(x, sequence)
        features = target_features(self.item_embedding.weight, self.final_norm(x), target)
        return self.head(features).squeeze(-1)  # (B,)


# --- samples and loss ----------------------------------------------------------------


def bst_batch(
    sequences: list[list[int]],
    max_length: int,
    num_items: int,
    negatives_per_positive: int,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Implicit-feedback CTR samples from train sequences (oldest item first).

    For each sequence one cut point t in [1, len - 1] is drawn uniformly: the items
    before t (the last max_length of them) are the history, item t is a positive
    target (label 1), and `negatives_per_positive` items drawn uniformly from
    [1, num_items) are negative targets (label 0) with the same history. As in uniform
    sampling generally, a negative may coincide with the positive or the history.

    Sequences with fewer than 2 items have no cut point and are skipped (and draw
    nothing from the generator). Rows are grouped per sequence: the positive, then its
    negatives.

    Args:
        sequences: Item index lists, e.g. `data_prep.sequences` train `history` rows.
        max_length: L.
        num_items: V; negatives come from 1..V-1.
        negatives_per_positive: N >= 0.
        generator: The random source of cut points and negatives; a seeded one makes
            the batch reproducible.

    Returns:
        history (B', L) int64 left-padded with 0, target (B',) int64, label (B',)
        float32, with B' = (1 + N) x the number of sequences with at least 2 items.

    Raises:
        ValueError: N < 0, num_items < 2, max_length < 1, or no sequence has 2 items.
    """
    if negatives_per_positive < 0 or num_items < 2 or max_length < 1:
        raise ValueError(
            f"negatives_per_positive={negatives_per_positive}, num_items={num_items}, "
            f"max_length={max_length}: need N >= 0, num_items >= 2 and max_length >= 1"
        )
    histories: list[list[int]] = []
    positives: list[int] = []
    for items in sequences:
        if len(items) < 2:
            continue
        cut = int(torch.randint(1, len(items), (1,), generator=generator))
        histories.append(list(items[max(0, cut - max_length) : cut]))
        positives.append(int(items[cut]))
    if not positives:
        raise ValueError(
            f"none of the {len(sequences)} sequences has 2 items; a CTR sample needs a "
            "history item and a target"
        )
    count, group = len(positives), 1 + negatives_per_positive
    history = torch.zeros(count, max_length, dtype=torch.int64)  # (S, L)
    for row, kept in enumerate(histories):
        history[row, max_length - len(kept) :] = torch.as_tensor(kept, dtype=torch.int64)
    negatives = torch.randint(
        1, num_items, (count, negatives_per_positive), generator=generator, dtype=torch.int64
    )  # (S, N)
    target = torch.cat([torch.as_tensor(positives).unsqueeze(1), negatives], dim=1)  # (S, 1+N)
    label = torch.zeros(count, group, dtype=torch.float32)
    label[:, 0] = 1.0
    return (
        history.repeat_interleave(group, dim=0),  # (S (1 + N), L)
        target.reshape(-1),
        label.reshape(-1),
    )


def bst_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean binary cross-entropy with logits, computed in fp32 (also under bf16).

    Args:
        logits: (B,) click logits.
        labels: (B,) 0/1 labels.

    Returns:
        Scalar fp32 loss.
    """
    return F.binary_cross_entropy_with_logits(logits.float(), labels.float())


def score_candidates(model: BST, history: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """Logits of every candidate as the target of its row's history, in one forward.

    The B x C forwards run as one batch of B * C rows, so memory grows with B * C;
    call it on blocks of users. Mode (eval) and grad (no_grad) are the caller's.

    Args:
        model: The BST.
        history: (B, L_h) int64, left-padded, L_h <= max_length.
        candidates: (B, C) int64 candidate items (>= 1).

    Returns:
        (B, C) logits.

    Raises:
        ValueError: The history is longer than the model's max_length.
    """
    batch, num_candidates = candidates.shape
    repeated = history.repeat_interleave(num_candidates, dim=0)  # (B C, L_h), row-major
    return model(repeated, candidates.reshape(-1)).view(batch, num_candidates)


# --- pipeline form -------------------------------------------------------------------


class BSTItemEmbeddingPipe(nn.Module):
    """The tied item table as the first pipeline layer; the target lookup is
    `target_features_pipe`.

    Args:
        num_items: V.
        max_length: L (the history is left-padded to it).
        hidden_dim: D.
    """

    def __init__(self, num_items: int, max_length: int, hidden_dim: int) -> None:
        super().__init__()
        self.max_length = max_length
        self.weight = nn.Parameter(torch.empty(num_items, hidden_dim))
        init_item_table(self.weight)

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """(history (B, L_h), target (B,)) -> (vectors (B, L + 1, D), sequence (B, L + 1)).

        Raises:
            ValueError: The history is longer than max_length.
        """
        history, target = inputs
        sequence = target_sequence(history, target, self.max_length)  # (B, L + 1)
        vectors = F.embedding(sequence, self.weight, padding_idx=PADDING_ITEM)
        return vectors, sequence


def target_features_pipe(
    table: BSTItemEmbeddingPipe, inputs: tuple[torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """Tied pipeline layer: (hidden (B, L + 1, D), sequence) -> features (B, 3D)."""
    hidden, sequence = inputs
    return target_features(table.weight, hidden, sequence[:, -1])


class BSTHeadPipe(nn.Module):
    """The CTR head as the last pipeline layer (args as `BST`: D, hidden sizes, dropout)."""

    def __init__(self, hidden_dim: int, mlp: list[int], dropout: float) -> None:
        super().__init__()
        self.head = _build_head(hidden_dim, mlp, dropout)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """features (B, 3D) -> logits (B,)."""
        return self.head(features).squeeze(-1)


def build_bst_pipeline_layers(
    num_items: int,
    max_length: int,
    hidden_dim: int,
    num_blocks: int,
    num_heads: int,
    dropout: float,
    mlp: list[int],
) -> list[LayerSpec]:
    """BST as `deepspeed.pipe` layer specs (see the module docstring for the tuples).

    `PipelineModule(layers=..., num_stages=S, loss_fn=bst_loss)` computes
    `bst_loss(BST(history, target), label)` for the same weights
    (`bst_pipeline_state_to_model`). The item table is one `TiedLayerSpec` key used by
    the first layer (history and target embedded as one sequence) and by the target
    features layer; DeepSpeed keeps one copy per stage that uses it, all-reduces its
    gradient, and broadcasts stage 0's initial copy.

    Args:
        num_items, max_length, hidden_dim, num_blocks, num_heads, dropout, mlp: as `BST`.

    Returns:
        num_blocks + 5 specs: item table, input, blocks, final norm, target features, head.

    Raises:
        ConfigError: As `BST`.
    """
    _check_bst_args(num_items, max_length, hidden_dim, num_blocks, num_heads, mlp)
    table_args = (TIED_KEY, BSTItemEmbeddingPipe, num_items, max_length, hidden_dim)
    return [
        TiedLayerSpec(*table_args, tied_weight_attr="weight"),
        LayerSpec(SequenceInputPipe, max_length + 1, hidden_dim, dropout),
        *(
            LayerSpec(TransformerBlockPipe, hidden_dim, num_heads, dropout)
            for _ in range(num_blocks)
        ),
        LayerSpec(FinalNormPipe, hidden_dim),
        TiedLayerSpec(*table_args, forward_fn=target_features_pipe, tied_weight_attr="weight"),
        LayerSpec(BSTHeadPipe, hidden_dim, list(mlp), dropout),
    ]


def bst_pipeline_batch(
    history: torch.Tensor, target: torch.Tensor, label: torch.Tensor
) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """One micro batch as `PipelineEngine.train_batch` pulls it from its iterator.

    The first stage reads the inputs, the last stage the labels; with several stages
    both ranks must iterate over the same micro batches.

    Args:
        history: (B, L) int64.
        target: (B,) int64.
        label: (B,) float32.

    Returns:
        ((history, target), label).
    """
    return (history, target), label


def bst_pipeline_state_to_model(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map pipeline layer names back to `BST` names.

    Accepts `PipelineModule.state_dict()` of one or more stages merged (the table as
    `tied_modules.item_embedding.weight`, layers as `<index>.<name>`) and per-layer
    checkpoint files merged with the layer index as prefix (`0.weight` for the table).
    The number of blocks is read from the layer indices: with K blocks, layers 1..K+2
    (input, blocks, final norm) and K+4 (head) carry parameters; K+3, the target
    features, shares the table and is never saved on its own.

    Args:
        state: Pipeline names -> tensors.

    Returns:
        A state dict for `BST.load_state_dict`.

    Raises:
        ValueError: A name fits no pipeline layer, or a layer is missing.
    """
    tied, by_layer = split_pipeline_state(state, "BST")
    if set(tied) != {"weight"}:
        raise ValueError(f"the BST item table layer holds {sorted(tied)}, not just its weight")
    table = tied["weight"]
    indices = sorted(by_layer)
    num_blocks = indices[-1] - 4 if indices else 0
    expected = [*range(1, num_blocks + 3), num_blocks + 4]
    if num_blocks < 1 or indices != expected:
        raise ValueError(
            f"pipeline layers {indices} are not 1..K+2 and K+4 (input, K >= 1 blocks, "
            "final norm, head)"
        )
    result = {"item_embedding.weight": table}
    for index in indices:
        for name, tensor in by_layer[index].items():
            if index in (1, num_blocks + 2, num_blocks + 4):
                target = name  # "input.*", "final_norm.*", "head.*" as in BST
            else:
                target = block_parameter_name(index, name)
            result[target] = tensor
    return result


# --- the registry's view: one signature per role (see training.sequence.registry) -----


def build_bst(model_config: Mapping[str, Any]) -> BST:
    """BST from its `model_config.json` arguments (see `training.sequence.train`)."""
    return BST(*architecture_args(model_config), list(model_config["mlp"]))


def build_bst_pipeline_layers_from(model_config: Mapping[str, Any]) -> list[LayerSpec]:
    """`build_bst_pipeline_layers` from the `model_config.json` arguments."""
    return build_bst_pipeline_layers(*architecture_args(model_config), list(model_config["mlp"]))


def bst_micro_batch(
    rows: list[list[int]],
    max_length: int,
    num_items: int,
    num_negatives: int,
    generator: torch.Generator,
    shared: bool = False,
) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """One pipeline micro batch of train rows: ((history, target), label).

    Args:
        rows: Item lists, oldest first (each of at least 2 items).
        max_length: L.
        num_items: V.
        num_negatives: Negative targets per positive.
        generator: The cut points' and negatives' random source.
        shared: Must be False: each BST negative is a target of its own pass
            (`train.sequence.shared_negatives` is refused for BST).

    Returns:
        history (B', L), target (B',), label (B',) with B' = len(rows) x (1 + N).
    """
    if shared:
        raise ValueError("BST scores each negative in a pass of its own; it shares none")
    samples = bst_batch(rows, max_length, num_items, num_negatives, generator)
    return bst_pipeline_batch(*samples)


def bst_model_options(mlp: list[int], item_features: Mapping[str, int]) -> dict[str, Any]:
    """BST's own `model_config.json` arguments: the head MLP.

    Raises:
        ConfigError: Preprocess wrote item side features, which BST does not take.
    """
    if item_features:
        raise ConfigError(
            f"train.model=bst takes no item side features, but preprocess wrote "
            f"{sorted(item_features)} (preprocess.sequence_item_features); remove them or use "
            "train.model: sasrec"
        )
    return {"mlp": list(mlp)}


def bst_activation_shape(
    batch_size: int, max_length: int, num_negatives: int
) -> tuple[int, int, int]:
    """(rows, positions, candidates per position) a micro batch of sequences runs.

    Each sequence becomes 1 + N rows of L + 1 positions (history and target); the
    head scores one target per row, so no candidate vectors are gathered.
    """
    return batch_size * (1 + num_negatives), max_length + 1, 0
