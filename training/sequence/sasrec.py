"""SASRec: a causal Transformer over a user's item sequence, and its pipeline form.

Reads nothing and writes nothing: modules, losses and the DeepSpeed pipeline layers.

The data come from `data_prep.sequences`: a train row's `history` holds up to
`max_length + 1` item indices, oldest first; `next_item_batch` left-pads them and
splits them into the model's input (the first `max_length` items) and the next item
at every position. Item index 0 is padding (and out-of-vocabulary).

Model (pre-LN, as in SASRec with the usual LayerNorm-first fix):

    x = item_embedding(history) * sqrt(D) + position_embedding   # (B, L, D), dropout
    for each block:
        x = x + attention(LayerNorm(x))   # causal, padding keys masked
        x = x + ffn(LayerNorm(x))         # position-wise, ReLU
    hidden = LayerNorm(x)                 # (B, L, D)
    score(item) = <hidden, item_embedding[item]>   # the input table, tied

Padding positions (history == 0) are masked as attention keys, their hidden states
are zeroed after every block, and they are excluded from the losses.

Pipeline form (`build_pipeline_layers`): the same function as a list of
`deepspeed.pipe` layer specs. Stages pass tuples of tensors only:

    layer 0           TiedLayerSpec "item_embedding"  (history, positives, negatives)
                                                 -> (item_vectors, history, positives, negatives)
    layer 1           SequenceInputPipe   -> (hidden, history, positives, negatives)
    layers 2..2+K-1   TransformerBlockPipe (one per block, same tuple)
    layer 2+K         FinalNormPipe       -> (hidden, history, positives, negatives)
    layer 3+K         TiedLayerSpec "item_embedding" (scoring) -> logits (B, L, 1 + N),
                                                 0 where positives is 0 (not scored)

The integer tensors ride along unchanged (DeepSpeed sends no gradient for them); only
`hidden` carries a gradient between stages. The loss function of the PipelineModule
is `bce_loss` or `sampled_softmax_loss`: `loss_fn(logits, positives)`. One micro batch
for `engine.train_batch(data_iter)` is the tuple `((history, positives, negatives),
positives)`: inputs for the first stage, labels for the last (see `pipeline_batch`).

Shapes: B = batch, L = sequence length (<= max_length), D = hidden_dim,
H = num_heads, N = negatives per position, C = candidate items, V = num_items.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, TiedLayerSpec
from torch import nn

from artifacts.errors import ConfigError

PADDING_ITEM = 0
TIED_KEY = "item_embedding"
# The prefix a PipelineModule's own state_dict gives the tied item table's tensors.
_TIED_PREFIX = f"tied_modules.{TIED_KEY}."


def init_item_table(weight: torch.Tensor) -> None:
    """Initialise an item table in place: N(0, 1/D) rows, the padding row zero.

    With the input scaled by sqrt(D), inputs have unit scale, and a dot product of a
    LayerNorm'd hidden state with a row starts with unit-scale logits.

    Args:
        weight: (V, D) the table.
    """
    with torch.no_grad():
        nn.init.normal_(weight, std=weight.shape[1] ** -0.5)
        weight[PADDING_ITEM].zero_()


def score_items(
    weight: torch.Tensor, hidden: torch.Tensor, items: torch.Tensor | None = None
) -> torch.Tensor:
    """Dot products of hidden states with item vectors.

    Args:
        weight: (V, D) item table.
        hidden: (..., D) hidden states, e.g. (B, D) or (B, L, D).
        items: (..., C) candidate item indices, broadcastable against `hidden`'s
            leading dims (e.g. (B, C) with (B, D), (B, L, C) with (B, L, D), or (C,)
            shared by every row); None scores every item.

    Returns:
        (..., C) scores, or (..., V) when `items` is None.
    """
    if items is None:
        return hidden @ weight.T  # (..., V)
    vectors = F.embedding(items, weight, padding_idx=PADDING_ITEM)  # (..., C, D)
    return (vectors * hidden.unsqueeze(-2)).sum(dim=-1)  # (..., C)


class ItemFeatures(nn.Module):
    """Side features of items (e.g. category), added to the item vectors.

    Each feature f has an embedding table (its vocabulary, index 0 = unknown) and a
    fixed lookup `index_f` (V,) from item index to the feature's index, set from the
    data with `set_index` and saved in the state dict (a buffer, not trained). An
    item's vector is its own row plus the rows of its features, so items that share a
    category share part of their vector, which helps rarely seen items.

    Args:
        num_items: V.
        hidden_dim: D.
        feature_sizes: Feature name -> number of indices (vocabulary size + 1); may be
            empty (then `vectors` is the item table alone).
    """

    def __init__(self, num_items: int, hidden_dim: int, feature_sizes: Mapping[str, int]) -> None:
        super().__init__()
        self.names = sorted(feature_sizes)
        self.tables = nn.ModuleDict()
        for name in self.names:
            table = nn.Embedding(int(feature_sizes[name]), hidden_dim)
            init_item_table(table.weight)
            self.tables[name] = table
            self.register_buffer(_index_buffer(name), torch.zeros(num_items, dtype=torch.int64))

    def set_index(self, index: Mapping[str, torch.Tensor]) -> None:
        """Set every feature's item -> index lookup.

        Args:
            index: Feature name -> (V,) int64 indices (0 for unknown and the padding item).

        Raises:
            ValueError: A feature is missing, or a lookup has the wrong shape or range.
        """
        for name in self.names:
            if name not in index:
                raise ValueError(f"no item -> {name} index given; features: {self.names}")
            values = torch.as_tensor(index[name], dtype=torch.int64)
            buffer = getattr(self, _index_buffer(name))
            size = self.tables[name].num_embeddings
            if values.shape != buffer.shape or values.min() < 0 or values.max() >= size:
                raise ValueError(
                    f"item feature {name}: need {tuple(buffer.shape)} indices in [0, {size}), "
                    f"got shape {tuple(values.shape)} in [{int(values.min())}, "
                    f"{int(values.max())}]"
                )
            buffer.copy_(values)

    def add_to(self, vectors: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        """vectors (..., D) of `items` (...) plus their features' rows."""
        for name in self.names:
            index = getattr(self, _index_buffer(name))[items]  # (...)
            vectors = vectors + self.tables[name](index)
        return vectors


def _index_buffer(name: str) -> str:
    return f"index_{name}"


def candidates_of(positives: torch.Tensor, negatives: torch.Tensor) -> torch.Tensor:
    """The positive first, then the negatives: (B, L) and (B, L, N) -> (B, L, 1 + N)."""
    return torch.cat([positives.unsqueeze(-1), negatives], dim=-1)


class MaskDropout(nn.Module):
    """Inverted dropout whose keep mask comes from `torch.rand_like(x) >= p`.

    The same distribution as `nn.Dropout` (each element kept with probability 1 - p and
    scaled by 1 / (1 - p)) from the same generator, but about a third cheaper on CPU:
    torch's `bernoulli_` draws a random number per element through a slow generic
    path, and it is the largest single cost of a SASRec step there (`bench/sequence.py`).
    The masks drawn differ from `nn.Dropout`'s for the same seed; in eval mode, or with
    p = 0, the input is returned as is.

    Args:
        p: Probability of zeroing an element.
    """

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = float(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Args: x (...). Returns x with dropout applied in training mode, (...)."""
        if not self.training or self.p == 0.0:
            return x
        keep = (torch.rand_like(x) >= self.p).to(x.dtype).mul_(1.0 / (1.0 - self.p))  # (...)
        return x * keep

    def extra_repr(self) -> str:
        return f"p={self.p}"


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position i sees positions <= i that are not padding.

    A padding query would see no key at all (NaN softmax); every position may
    therefore also see itself. Padding outputs are discarded by the caller.

    Args:
        hidden_dim: D, divisible by num_heads.
        num_heads: H.
        dropout: Dropout on the attention weights and the output.
    """

    def __init__(self, hidden_dim: int, num_heads: int, dropout: float) -> None:
        super().__init__()
        if hidden_dim % num_heads:
            raise ConfigError(
                f"hidden_dim={hidden_dim} is not divisible by num_heads={num_heads}; "
                "change one of them"
            )
        self.num_heads = num_heads
        self.dropout = dropout
        self.qkv = nn.Linear(hidden_dim, 3 * hidden_dim)
        self.out = nn.Linear(hidden_dim, hidden_dim)
        self.out_dropout = MaskDropout(dropout)
        self.weights_dropout = MaskDropout(dropout)

    def forward(self, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Attend.

        Args:
            x: (B, L, D) normalised inputs.
            valid: (B, L) bool, False at padding.

        Returns:
            (B, L, D).
        """
        return self.out_dropout(self.out(self.attend(self.qkv(x), valid)))

    def attend(self, qkv: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """The attention of projected inputs, before the output projection.

        Args:
            qkv: (B, L, 3D) queries, keys and values (`self.qkv` of the normalised input).
            valid: (B, L) bool, False at padding.

        Returns:
            (B, L, D) the heads' outputs side by side.
        """
        batch, length, dim = qkv.shape[0], qkv.shape[1], qkv.shape[2] // 3
        q, k, v = qkv.split(dim, dim=-1)  # 3 x (B, L, D)
        # (B, H, L, D/H)
        q, k, v = (t.view(batch, length, self.num_heads, -1).transpose(1, 2) for t in (q, k, v))
        causal = torch.ones(length, length, dtype=torch.bool, device=qkv.device).tril()  # (L, L)
        # A float identity compared to 0: onnxruntime has no EyeLike kernel for bool.
        eye = torch.eye(length, device=qkv.device) > 0
        allowed = (causal & (valid.unsqueeze(1) | eye)).unsqueeze(1)  # (B, 1, L, L): query, key
        if self.training and self.dropout > 0.0:
            # On CPU, scaled_dot_product_attention with dropout runs its math path, whose
            # bernoulli_ mask is slow; the same softmax(q k^T / sqrt(D/H)) v spelled out
            # with the cheaper MaskDropout. No row is fully masked (the diagonal is
            # allowed), so the softmax needs no NaN guard.
            scores = (q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)  # (B, H, L, L)
            weights = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
            attended = self.weights_dropout(weights) @ v  # (B, H, L, D/H)
        else:
            attended = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        return attended.transpose(1, 2).reshape(batch, length, dim)


class TransformerBlock(nn.Module):
    """Pre-LN block: x + attention(LN(x)), then x + FFN(LN(x)); padding rows zeroed.

    Args:
        hidden_dim: D.
        num_heads: H.
        dropout: Dropout in attention and FFN.
        pack_valid_rows: In training, run the position-wise parts on the non-padding
            positions only (`_forward_valid_rows`): the same function, other float
            rounding. SASRec's; BST keeps the full computation, whose 1-stage and
            2-stage runs its tests pin to 1e-5 at a learning rate that amplifies any
            rounding change.
    """

    def __init__(
        self, hidden_dim: int, num_heads: int, dropout: float, pack_valid_rows: bool = False
    ) -> None:
        super().__init__()
        self.pack_valid_rows = pack_valid_rows
        self.attention_norm = nn.LayerNorm(hidden_dim)
        self.attention = CausalSelfAttention(hidden_dim, num_heads, dropout)
        self.ffn_norm = nn.LayerNorm(hidden_dim)
        # Position-wise FFN of width D, as in SASRec (not 4D as in GPT).
        self.ffn = nn.Sequential(
            nn.Linear(hidden_dim, hidden_dim),
            nn.ReLU(),
            MaskDropout(dropout),
            nn.Linear(hidden_dim, hidden_dim),
            MaskDropout(dropout),
        )

    def forward(self, x: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
        """Args: x (B, L, D); history (B, L) item indices. Returns (B, L, D)."""
        valid = history != PADDING_ITEM  # (B, L)
        if self.training and self.pack_valid_rows:
            return self._forward_valid_rows(x, valid)
        # Eval (and the exported graphs): static shapes, every position computed.
        x = x + self.attention(self.attention_norm(x), valid)
        x = x + self.ffn(self.ffn_norm(x))
        return x * valid.unsqueeze(-1)

    def _forward_valid_rows(self, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """The same function, position-wise parts on the M non-padding positions only.

        About half of a left-padded batch is padding, whose outputs are zeroed anyway
        and which attention never reads (padding keys are masked): norms, projections,
        FFN and their dropout run on (M, D) rows, only attention on (B, L, .).
        """
        batch, length, dim = x.shape
        kept = valid.nonzero(as_tuple=True)  # 2 x (M,)
        rows = x[kept]  # (M, D)
        qkv_rows = self.attention.qkv(self.attention_norm(rows))  # (M, 3D)
        qkv = x.new_zeros(batch, length, 3 * dim).index_put(kept, qkv_rows)  # (B, L, 3D)
        attended = self.attention.attend(qkv, valid)[kept]  # (M, D)
        rows = rows + self.attention.out_dropout(self.attention.out(attended))
        rows = rows + self.ffn(self.ffn_norm(rows))
        return x.new_zeros(batch, length, dim).index_put(kept, rows)  # (B, L, D)


class SequenceInput(nn.Module):
    """Scaled item vectors plus learned positions, dropout, padding rows zeroed.

    Args:
        max_length: Longest sequence (rows of the position table).
        hidden_dim: D.
        dropout: Dropout on the sum.
    """

    def __init__(self, max_length: int, hidden_dim: int, dropout: float) -> None:
        super().__init__()
        self.position_embedding = nn.Embedding(max_length, hidden_dim)
        self.dropout = MaskDropout(dropout)
        self.scale = math.sqrt(hidden_dim)

    def forward(self, item_vectors: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
        """Args: item_vectors (B, L, D); history (B, L). Returns (B, L, D).

        Raises:
            ValueError: L is longer than max_length.
        """
        length = history.shape[1]
        if length > self.position_embedding.num_embeddings:
            raise ValueError(
                f"sequence length {length} exceeds max_length="
                f"{self.position_embedding.num_embeddings}; truncate the history"
            )
        positions = torch.arange(length, device=history.device)  # (L,)
        x = item_vectors * self.scale + self.position_embedding(positions)  # (B, L, D)
        return self.dropout(x) * (history != PADDING_ITEM).unsqueeze(-1)


class SASRec(nn.Module):
    """Self-attentive sequential recommendation (Kang & McAuley, 2018), pre-LN.

    Args:
        num_items: V, item indices 0..V-1, 0 the padding item.
        max_length: Longest input sequence L.
        hidden_dim: D, the item embedding and model width.
        num_blocks: Transformer blocks.
        num_heads: Attention heads (divide hidden_dim).
        dropout: Dropout probability.
        item_features: Optional side features of items: name -> number of indices
            (see `ItemFeatures`; set their item lookups with `item_features.set_index`).

    Raises:
        ConfigError: hidden_dim is not divisible by num_heads, or num_items < 2.
    """

    def __init__(
        self,
        num_items: int,
        max_length: int,
        hidden_dim: int,
        num_blocks: int,
        num_heads: int,
        dropout: float,
        item_features: Mapping[str, int] | None = None,
    ) -> None:
        super().__init__()
        _check_model_args(num_items, max_length, num_blocks)
        self.item_embedding = nn.Embedding(num_items, hidden_dim, padding_idx=PADDING_ITEM)
        init_item_table(self.item_embedding.weight)
        self.item_features = ItemFeatures(num_items, hidden_dim, item_features or {})
        self.input = SequenceInput(max_length, hidden_dim, dropout)
        self.blocks = nn.ModuleList(
            TransformerBlock(hidden_dim, num_heads, dropout, pack_valid_rows=True)
            for _ in range(num_blocks)
        )
        self.final_norm = nn.LayerNorm(hidden_dim)

    def forward(self, history: torch.Tensor) -> torch.Tensor:
        """Hidden states of every position.

        Args:
            history: (B, L) int64 item indices, left-padded with 0, L <= max_length.

        Returns:
            (B, L, D); position t has seen history[:, : t + 1] only.
        """
        vectors = self.item_features.add_to(self.item_embedding(history), history)  # (B, L, D)
        x = self.input(vectors, history)  # (B, L, D)
        for block in self.blocks:
            x = block(x, history)
        return self.final_norm(x)

    def item_table(self) -> torch.Tensor:
        """(V, D) every item's vector: its row of the tied table plus its side features."""
        items = torch.arange(
            self.item_embedding.num_embeddings, device=self.item_embedding.weight.device
        )
        return self.item_features.add_to(self.item_embedding.weight, items)

    def score(self, hidden: torch.Tensor, items: torch.Tensor | None = None) -> torch.Tensor:
        """Scores of candidate items with the tied item table (see `score_items`).

        Args:
            hidden: (B, D) or (B, L, D).
            items: (..., C) candidates broadcastable against `hidden`; None for all items.

        Returns:
            (..., C) scores, or (..., V) for all items.
        """
        if not self.item_features.names:
            return score_items(self.item_embedding.weight, hidden, items)
        if items is None:
            return hidden @ self.item_table().T  # (..., V)
        vectors = self.item_features.add_to(self.item_embedding(items), items)  # (..., C, D)
        return (vectors * hidden.unsqueeze(-2)).sum(dim=-1)


def _check_model_args(num_items: int, max_length: int, num_blocks: int) -> None:
    if num_items < 2:
        raise ConfigError(f"num_items={num_items}: need the padding item 0 and at least one item")
    if max_length < 1 or num_blocks < 1:
        raise ConfigError(
            f"max_length={max_length}, num_blocks={num_blocks}: both must be at least 1"
        )


# --- batches, negatives and losses -------------------------------------------------


def next_item_batch(
    sequences: list[list[int]], max_length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-item targets from train `history` lists (oldest first).

    Args:
        sequences: B lists of item indices; the last `max_length + 1` of each are used.
        max_length: L.

    Returns:
        history (B, L) int64, left-padded with 0; positives (B, L) int64, the item that
        follows each position, 0 where the input is padding (excluded from the loss).
    """
    padded = torch.zeros(len(sequences), max_length + 1, dtype=torch.int64)  # (B, L + 1)
    for row, items in enumerate(sequences):
        kept = list(items)[-(max_length + 1) :]
        if kept:
            padded[row, -len(kept) :] = torch.as_tensor(kept, dtype=torch.int64)
    history = padded[:, :-1]
    positives = padded[:, 1:].masked_fill(history == PADDING_ITEM, PADDING_ITEM)
    return history.contiguous(), positives.contiguous()


def sample_negatives(
    positives: torch.Tensor,
    num_items: int,
    num_negatives: int,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Uniform negatives from [1, num_items) for every position (0 where positives is 0).

    A negative may coincide with the positive or the history, as in uniform sampling
    generally; with many items this is rare.

    Args:
        positives: (B, L) int64 targets, 0 at excluded positions.
        num_items: V.
        num_negatives: N (1 for the original BCE loss).
        generator: Random source; pass a seeded one for reproducible draws.

    Returns:
        (B, L, N) int64.
    """
    negatives = torch.randint(
        1, num_items, (*positives.shape, num_negatives), generator=generator, dtype=torch.int64
    )
    return negatives.masked_fill(positives.unsqueeze(-1) == PADDING_ITEM, PADDING_ITEM)


def sample_shared_negatives(
    num_items: int, num_negatives: int, generator: torch.Generator | None = None
) -> torch.Tensor:
    """N uniform negatives from [1, num_items) that every position of a micro batch shares.

    One (M, D) x (D, N) product scores them all, so N can be in the thousands at the
    cost of a few per-position negatives. Uniform draws need no logQ correction (every
    candidate's would be the same constant); a draw equal to a position's positive is
    masked out of that position's softmax (`score_candidates_pipe`).

    Returns:
        (N,) int64.
    """
    return torch.randint(1, num_items, (num_negatives,), generator=generator, dtype=torch.int64)


def bce_loss(logits: torch.Tensor, positives: torch.Tensor) -> torch.Tensor:
    """SASRec's loss: -log s(pos) - sum_n log(1 - s(neg_n)), averaged over valid positions.

    With N = 1 this is the original SASRec objective (one sampled negative per position).

    Args:
        logits: (B, L, 1 + N) scores of the positive (first) and the negatives, as from
            `score(hidden, candidates_of(positives, negatives))` or the pipeline.
        positives: (B, L) int64, 0 at positions excluded from the loss.

    Returns:
        Scalar fp32 loss (0 if no position is valid).
    """
    logits = logits.float()
    valid = positives != PADDING_ITEM  # (B, L)
    targets = torch.zeros_like(logits)
    targets[..., 0] = 1.0
    per_position = F.binary_cross_entropy_with_logits(logits, targets, reduction="none").sum(-1)
    return (per_position * valid).sum() / valid.sum().clamp(min=1)


def sampled_softmax_loss(logits: torch.Tensor, positives: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the positive against its N sampled negatives, over valid positions.

    Args:
        logits: (B, L, 1 + N), the positive first; or, with negatives shared by the
            micro batch, (M, 1 + N) at the M positions with a positive, in row order.
        positives: (B, L) int64, 0 at positions excluded from the loss.

    Returns:
        Scalar fp32 loss (0 if no position is valid).
    """
    logits = logits.float()
    if logits.dim() == 2:  # shared negatives: the rows are the valid positions
        if logits.shape[0] == 0:
            return logits.sum() * 0.0
        # The fused log-softmax: cheaper than logsumexp - logits[:, 0] on (M, 1 + N).
        first = torch.zeros(logits.shape[0], dtype=torch.int64, device=logits.device)
        return F.cross_entropy(logits, first)
    valid = positives != PADDING_ITEM  # (B, L)
    per_position = torch.logsumexp(logits, dim=-1) - logits[..., 0]  # (B, L)
    return (per_position * valid).sum() / valid.sum().clamp(min=1)


def softmax_loss(logits: torch.Tensor, positives: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of each scored position's positive over the whole catalogue.

    Args:
        logits: (M, V) scores of every item at the M positions with a positive, in row
            order (`score_candidates_pipe` without negatives); the padding item's are -inf.
        positives: (B, L) int64, 0 at positions excluded from the loss.

    Returns:
        Scalar fp32 loss (0 if no position is valid).
    """
    targets = positives[positives != PADDING_ITEM]  # (M,), row order as the logits
    if targets.numel() == 0:
        return logits.float().sum() * 0.0
    return F.cross_entropy(logits.float(), targets)


LOSSES = {"bce": bce_loss, "sampled_softmax": sampled_softmax_loss, "softmax": softmax_loss}


# --- pipeline form -------------------------------------------------------------------


class ItemEmbeddingPipe(nn.Module):
    """The tied item table as the first pipeline layer; scoring is `score_candidates_pipe`.

    A module of its own (not an nn.Embedding) so that its forward takes the pipeline
    tuple and DeepSpeed saves it as layer 0 of a pipeline checkpoint.

    Args:
        num_items: V.
        hidden_dim: D.
        item_features: As `SASRec`; the feature tables are tied too.
    """

    def __init__(
        self, num_items: int, hidden_dim: int, item_features: Mapping[str, int] | None = None
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_items, hidden_dim))
        init_item_table(self.weight)
        self.item_features = ItemFeatures(num_items, hidden_dim, item_features or {})

    def vectors(self, items: torch.Tensor) -> torch.Tensor:
        """(..., D) vectors of `items` (...): table rows plus side features."""
        rows = F.embedding(items, self.weight, padding_idx=PADDING_ITEM)
        return self.item_features.add_to(rows, items)

    def forward(
        self, inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, ...]:
        """(history (B, L), positives (B, L), negatives (B, L, N)) -> (vectors (B, L, D), ...)."""
        history, positives, negatives = inputs
        return self.vectors(history), history, positives, negatives  # vectors (B, L, D)


def score_candidates_pipe(
    table: ItemEmbeddingPipe, inputs: tuple[torch.Tensor, ...]
) -> torch.Tensor:
    """Last pipeline layer: (hidden, history, positives, negatives) -> logits (B, L, 1 + N).

    With no negatives (N = 0, loss 'softmax'): (M, V), every item scored at the M
    positions with a positive, in row order, the padding item's scores -inf. With
    negatives shared by the micro batch ((N,), `sample_shared_negatives`): (M, 1 + N).

    Only the M positions with a positive are scored (about half of a left-padded
    MovieLens batch); the others, which every loss ignores, get logits 0. The candidates'
    vectors are gathered for those M positions only: (M, 1 + N, D) instead of
    (B, L, 1 + N, D).
    """
    hidden, _, positives, negatives = inputs
    scored = (positives != PADDING_ITEM).nonzero(as_tuple=True)  # 2 x (M,)
    if negatives.dim() == 1:
        # Negatives shared by the micro batch: (M, 1 + N), a draw equal to the row's
        # positive masked (it would count the positive against itself).
        targets, states = positives[scored], hidden[scored]  # (M,), (M, D)
        positive = (states * table.vectors(targets)).sum(dim=-1, keepdim=True)  # (M, 1)
        shared = states @ table.vectors(negatives).T  # (M, N)
        # In place on the product's output (its backward does not read it), at the
        # few hits only: cheaper than a masked copy of the (M, N) logits.
        hits = (negatives.unsqueeze(0) == targets.unsqueeze(1)).nonzero(as_tuple=True)
        shared = shared.index_put_(hits, shared.new_tensor(float("-inf")))
        return torch.cat([positive, shared], dim=-1)
    if negatives.shape[-1] == 0:
        # loss 'softmax': every item is a candidate; (M, V), the padding item excluded.
        items = torch.arange(table.weight.shape[0], device=hidden.device)
        logits = hidden[scored] @ table.vectors(items).T  # (M, V)
        return logits.index_fill(-1, items[:1], float("-inf"))
    candidates = candidates_of(positives[scored], negatives[scored])  # (M, 1 + N)
    vectors = table.vectors(candidates)  # (M, 1 + N, D)
    logits = (vectors * hidden[scored].unsqueeze(-2)).sum(dim=-1)  # (M, 1 + N)
    out = hidden.new_zeros(*positives.shape, candidates.shape[-1])  # (B, L, 1 + N)
    return out.index_put(scored, logits)


class SequenceInputPipe(nn.Module):
    """`SequenceInput` on the pipeline tuple (args as SequenceInput)."""

    def __init__(self, max_length: int, hidden_dim: int, dropout: float) -> None:
        super().__init__()
        self.input = SequenceInput(max_length, hidden_dim, dropout)

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """(vectors, history, positives, negatives) -> (hidden (B, L, D), history, ...)."""
        vectors, history, *rest = inputs
        return self.input(vectors, history), history, *rest


class TransformerBlockPipe(nn.Module):
    """`TransformerBlock` on the pipeline tuple (args as TransformerBlock)."""

    def __init__(
        self, hidden_dim: int, num_heads: int, dropout: float, pack_valid_rows: bool = False
    ) -> None:
        super().__init__()
        self.block = TransformerBlock(hidden_dim, num_heads, dropout, pack_valid_rows)

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """(hidden, history, positives, negatives) -> the same with hidden updated."""
        hidden, history, *rest = inputs
        return self.block(hidden, history), history, *rest


class FinalNormPipe(nn.Module):
    """The final LayerNorm on the pipeline tuple."""

    def __init__(self, hidden_dim: int) -> None:
        super().__init__()
        self.final_norm = nn.LayerNorm(hidden_dim)

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """(hidden, history, positives, negatives) -> the same with hidden normalised."""
        hidden, *rest = inputs
        return self.final_norm(hidden), *rest


def build_pipeline_layers(
    num_items: int,
    max_length: int,
    hidden_dim: int,
    num_blocks: int,
    num_heads: int,
    dropout: float,
    item_features: Mapping[str, int] | None = None,
) -> list[LayerSpec]:
    """SASRec as `deepspeed.pipe` layer specs (see the module docstring for the tuples).

    `PipelineModule(layers=..., num_stages=S, loss_fn=bce_loss or sampled_softmax_loss)`
    computes `loss_fn(SASRec.score(SASRec(history), candidates_of(positives,
    negatives)), positives)` for the same weights (`pipeline_state_to_sasrec`). The item
    table is one `TiedLayerSpec` key used by the first and the last layer; DeepSpeed
    keeps one copy per stage that uses it, all-reduces its gradient, and broadcasts
    stage 0's initial copy.

    The side feature tables (if any) are tied the same way; their item lookups are
    buffers, which the caller sets on every stage's copy (`tied_item_features`).

    Args:
        num_items, max_length, hidden_dim, num_blocks, num_heads, dropout,
            item_features: as `SASRec`.

    Returns:
        num_blocks + 4 specs: item table, input, blocks, final norm, scoring.

    Raises:
        ConfigError: As `SASRec`.
    """
    _check_model_args(num_items, max_length, num_blocks)
    if hidden_dim % num_heads:
        raise ConfigError(
            f"hidden_dim={hidden_dim} is not divisible by num_heads={num_heads}; change one of them"
        )
    features = dict(item_features or {})
    tied = ["weight", *(f"item_features.tables.{name}.weight" for name in sorted(features))]
    return [
        TiedLayerSpec(
            TIED_KEY, ItemEmbeddingPipe, num_items, hidden_dim, features, tied_weight_attr=tied
        ),
        LayerSpec(SequenceInputPipe, max_length, hidden_dim, dropout),
        *(
            LayerSpec(TransformerBlockPipe, hidden_dim, num_heads, dropout, True)
            for _ in range(num_blocks)
        ),
        LayerSpec(FinalNormPipe, hidden_dim),
        TiedLayerSpec(
            TIED_KEY,
            ItemEmbeddingPipe,
            num_items,
            hidden_dim,
            features,
            forward_fn=score_candidates_pipe,
            tied_weight_attr=tied,
        ),
    ]


def pipeline_batch(
    history: torch.Tensor, positives: torch.Tensor, negatives: torch.Tensor
) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """One micro batch as `PipelineEngine.train_batch` pulls it from its iterator.

    The first stage reads the inputs, the last stage the labels; with several stages
    both ranks must iterate over the same micro batches.

    Args:
        history: (B, L) int64.
        positives: (B, L) int64.
        negatives: (B, L, N) int64.

    Returns:
        ((history, positives, negatives), positives).
    """
    return (history, positives, negatives), positives


def pipeline_state_to_sasrec(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map pipeline layer names back to `SASRec` names.

    Accepts `PipelineModule.state_dict()` of one or more stages merged (the table as
    `tied_modules.item_embedding.weight`, layers as `<index>.<name>`) and per-layer
    checkpoint files merged with the layer index as prefix (`0.weight` for the table).
    The number of blocks is read from the layer indices.

    Args:
        state: Pipeline names -> tensors.

    Returns:
        A state dict for `SASRec.load_state_dict`.

    Raises:
        ValueError: A name fits no pipeline layer, or a layer is missing.
    """
    tied, by_layer = split_pipeline_state(state, "SASRec")
    indices = sorted(by_layer)
    # Layers 1..K+2 carry parameters: input, K blocks, final norm (the last layer,
    # the scoring, shares the table and is never saved on its own).
    if not indices or indices != list(range(1, indices[-1] + 1)) or len(indices) < 3:
        raise ValueError(f"pipeline layers {indices} are not the contiguous range 1..K+2")
    num_blocks = len(indices) - 2
    result = {"item_embedding.weight": tied.pop("weight")}
    for name, tensor in tied.items():
        if not name.startswith("item_features."):
            raise ValueError(f"{name!r} is not a parameter of the item table layer")
        result[name] = tensor  # "item_features.tables.<f>.weight", "item_features.index_<f>"
    for index in indices:
        for name, tensor in by_layer[index].items():
            if index == 1:
                target = name  # "input.position_embedding.weight"
            elif index == num_blocks + 2:
                target = name  # "final_norm.weight"
            else:
                target = block_parameter_name(index, name)
            result[target] = tensor
    return result


def split_pipeline_state(
    state: Mapping[str, torch.Tensor], model: str
) -> tuple[dict[str, torch.Tensor], dict[int, dict[str, torch.Tensor]]]:
    """Group pipeline state names into the tied item table's and each layer's.

    Accepts `PipelineModule.state_dict()` names (`tied_modules.item_embedding.<name>`,
    `<index>.<name>`) and per-layer checkpoint names prefixed with the layer index (the
    table as layer 0).

    Args:
        state: Pipeline names -> tensors.
        model: The model's name, for messages.

    Returns:
        (the table layer's tensors by name, including "weight"; layer index -> its
        tensors by name, layer 0 excluded).

    Raises:
        ValueError: A name fits no pipeline layer, or there is no item table.
    """
    by_layer: dict[int, dict[str, torch.Tensor]] = {}
    tied: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name.startswith(_TIED_PREFIX):
            tied[name.removeprefix(_TIED_PREFIX)] = tensor
            continue
        match = re.fullmatch(r"(\d+)\.(.+)", name)
        if match is None:
            raise ValueError(f"{name!r} is not a {model} pipeline parameter name")
        by_layer.setdefault(int(match.group(1)), {})[match.group(2)] = tensor
    if 0 in by_layer:
        tied = by_layer.pop(0)
    if "weight" not in tied:
        raise ValueError("the pipeline state has no item table (layer 0 or the tied module)")
    return tied, by_layer


def block_parameter_name(index: int, name: str) -> str:
    """The model's name of a `TransformerBlockPipe` parameter at pipeline layer `index`.

    Blocks start at layer 2 (after the table and the input layer).

    Raises:
        ValueError: `name` is not a block parameter.
    """
    if not name.startswith("block."):
        raise ValueError(f"layer {index}: {name!r} is not a transformer block name")
    return f"blocks.{index - 2}.{name.removeprefix('block.')}"


# --- the registry's view: one signature per role (see training.sequence.registry) -----

# The constructor arguments every sequence model shares, in their order.
ARCHITECTURE_ARGS = ("num_items", "max_length", "hidden_dim", "num_blocks", "num_heads", "dropout")


def architecture_args(model_config: Mapping[str, Any]) -> tuple[Any, ...]:
    """The shared constructor arguments of a `model_config.json` dict, in their order."""
    return tuple(model_config[name] for name in ARCHITECTURE_ARGS)


def build_sasrec(model_config: Mapping[str, Any]) -> SASRec:
    """SASRec from its `model_config.json` arguments (see `training.sequence.train`)."""
    return SASRec(*architecture_args(model_config), dict(model_config.get("item_features") or {}))


def build_sasrec_pipeline_layers(model_config: Mapping[str, Any]) -> list[LayerSpec]:
    """`build_pipeline_layers` from the `model_config.json` arguments."""
    features = dict(model_config.get("item_features") or {})
    return build_pipeline_layers(*architecture_args(model_config), features)


def sasrec_micro_batch(
    rows: list[list[int]],
    max_length: int,
    num_items: int,
    num_negatives: int,
    generator: torch.Generator,
    shared: bool = False,
) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """One pipeline micro batch of train rows: ((history, positives, negatives), positives).

    Args:
        rows: B item lists, oldest first.
        max_length: L.
        num_items: V.
        num_negatives: N negatives per position (per micro batch when shared).
        generator: The negatives' random source.
        shared: One set of N negatives for the whole micro batch.

    Returns:
        history (B, L), positives (B, L), negatives (B, L, N) or shared (N,); positives
        again as labels.
    """
    history, positives = next_item_batch(rows, max_length)  # (B, L) each
    if shared:
        negatives = sample_shared_negatives(num_items, num_negatives, generator)  # (N,)
    else:
        negatives = sample_negatives(positives, num_items, num_negatives, generator)
    return pipeline_batch(history, positives, negatives)


def sasrec_model_options(mlp: list[int], item_features: Mapping[str, int]) -> dict[str, Any]:
    """SASRec's own `model_config.json` arguments: the item side features (no head MLP)."""
    return {"item_features": dict(item_features)}


def sasrec_activation_shape(
    batch_size: int, max_length: int, num_negatives: int
) -> tuple[int, int, int]:
    """(rows, positions, candidates per position) a micro batch of sequences runs.

    Every position scores its positive and its N negatives.
    """
    return batch_size, max_length, 1 + num_negatives
