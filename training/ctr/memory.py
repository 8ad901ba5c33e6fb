"""Pre-launch memory planner: bytes per rank of a training run, and a budget check.

Reads only the train config and a few sizes (embedding table rows, dense features,
dense parameters); touches no file and imports no torch, so a flow can refuse an
impossible run before it launches DeepSpeed ranks, and tell the user what to change.

Notation: N = sum(table_sizes) embedding rows over F sparse features, D = embedding_dim,
W = world_size, B = batch_size (micro batch per rank), P = dense parameters, Dn = dense
features. Every figure is for the worst rank, rank 0: it holds ceil(N / W) embedding
rows (row g lives on rank g % W), the largest ZeRO partition, and the consolidation.

- "sharded" embeddings: one fused table of N x D, row-wise sharded, at
  train.table_precision (`TABLE_BYTES`: 4 bytes a value at fp32, 2 at fp16 and bf16,
  1 at int8, whose rows also keep an fp32 (scale, bias) each: `ROW_BYTES`), plus a
  replicated F x D fp32 table of per-feature default rows (the rows of ids not admitted
  yet); both are trained by the sparse optimizer, whose state per row is 1 fp32
  (rowwise_adagrad) or 2 * D fp32 (lazy_adam: m and v) at every table precision.
  Frequency admission (admission_min_count >= 2) keeps an int64 counter per local row.
  At the end every rank streams its share of the table into model.safetensors, upcast
  to fp32 (`training.runtime.consolidate`): one chunk read and one written,
  2 x min(N x D fp32, CHUNK_BYTES) more, not the table.
- "dense" embeddings: the tables are ordinary parameters of the DeepSpeed module;
  N * D is added to P and they are counted as dense parameters.
- Dense side, AdamW under DeepSpeed, per parameter: fp32 = params 4 B + grads 4 B +
  Adam m, v 8 B; bf16/fp16 = params 2 B + grads 2 B + fp32 master 4 B + Adam 8 B.
  ZeRO stage >= 1 partitions the optimizer state and masters over W, stage >= 2 also
  the grads, stage 3 also the params (the ZeRO paper's accounting). offload_optimizer
  moves the optimizer state and masters to CPU memory (`MemoryPlan.host_offload`): they
  leave an accelerator's budget, but on the CPU accelerator they still use the same
  host memory. With ZeRO 1-2, rank 0 also assembles one fp32 copy of the P dense
  weights when it writes model.safetensors (the partitions are memory-mapped); ZeRO 3
  streams each parameter from the partitions in chunks, min(P fp32, CHUNK_BYTES) more.
- Activations: forward tensors per sample times ACTIVATION_SAFETY_FACTOR, plus, for
  sharded embeddings, the unique rows gathered per step and their gradients (fp32), and
  for a 2-byte or int8 table the fp32 working copy and the random bits of its rounded
  update (int8 also reads and writes the rows' (R, 2) fp32 grid).
- Reader: the prefetched batches and the batch in use. Runtime: RUNTIME_BYTES.

train.zero_stage: auto is resolved here too (`choose_zero_stage`): the lowest stage of
`TrainConfig.zero_stages` whose plan fits the budget, as ZeRO 0 runs the CTR step
fastest. `rows_that_fit` turns the plan around: how many rows of a dim fit a budget at
each table precision, for the plan's report and for sizing a table before a run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

from artifacts.errors import ConfigError
from training.config import TrainConfig
from training.runtime.memory import (
    CHUNK_BYTES,
    COMPONENTS,
    FP32_BYTES,
    INT64_BYTES,
    RUNTIME_BYTES,
    MemoryPlan,
    human_bytes,
    largest,
    machine_memory_bytes,
    smallest,
)

# Activations kept per step relative to one forward pass: autograd saves the inputs
# of most layers (Linear + ReLU keep two tensors per layer) and backward allocates a
# gradient of each, with temporaries on top: about 2-3 copies; 3 to be safe.
ACTIVATION_SAFETY_FACTOR = 3


# Sharded embeddings per step: the gathered unique rows, their gradients, and the
# all-to-all buffers of the rows (and gradients) this rank serves to the others.
GATHER_COPIES = 4


# A 2-byte or int8 table's update per step: the updated rows in fp32 and their int32
# rounding bits (`ShardedEmbedding._subtract_rows`).
ROUNDING_COPIES = 2


# An int8 table's update also handles the updated rows' (R, 2) fp32 grid twice: the
# current (scale, bias) it keeps where the row still fits, and the new one.
GRID_COPIES = 2


# The world_size suggestion looks no further than this many ranks.
MAX_SUGGESTED_WORLD_SIZE = 4096


# Bytes per dense parameter: (param, grad, optimizer state incl. fp32 masters).
_DENSE_BYTES = {"fp32": (4, 4, 8), "bf16": (2, 2, 12), "fp16": (2, 2, 12)}


# The parts of a plan that the ZeRO stage partitions.
_DENSE_PARTS = ("dense_params", "dense_grads", "dense_optimizer")


# Bytes per value of the sharded table's rows, by train.table_precision.
TABLE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "int8": 1}


# Bytes per row beside the values: int8 rows keep an fp32 (scale, bias) each.
ROW_BYTES = {"fp32": 0, "fp16": 0, "bf16": 0, "int8": 2 * FP32_BYTES}


TablePrecision = Literal["fp32", "fp16", "bf16", "int8"]


# The table precisions, widest first (the order of `rows_that_fit`'s answer).
PRECISION_ORDER: tuple[TablePrecision, ...] = ("fp32", "bf16", "fp16", "int8")


_ACCELERATORS = ("cpu", "cuda")


def plan_memory(
    config: TrainConfig,
    table_sizes: list[int],
    num_dense_features: int,
    num_dense_params: int,
    world_size: int,
    accelerator: str = "cpu",
    *,
    feature_names: Sequence[str] | None = None,
) -> MemoryPlan:
    """Plan the memory of the worst rank of a training run.

    Args:
        config: The train section (embeddings mode, optimizers, precision, ZeRO, sizes).
        table_sizes: Rows of each sparse feature's embedding table (F entries).
        num_dense_features: Dense input features Dn.
        num_dense_params: Parameters of the dense module, without embedding tables
            (in "dense" mode the planner adds sum(table_sizes) * embedding_dim).
        world_size: Number of ranks W (used instead of config.world_size, so callers
            can plan other sizes).
        accelerator: "cpu" or "cuda"; decides whether offloaded optimizer state still
            counts against the rank's memory.
        feature_names: Names of the sparse features, in the order of table_sizes; used
            by `check_memory` to name the features to shrink.

    Returns:
        The plan: bytes by component on rank 0, host-offloaded bytes and the total.

    Raises:
        ValueError: An argument is out of range (no tables, a size < 1, world_size < 1,
            an unknown accelerator, or feature_names of the wrong length), or
            config.zero_stage is still "auto" (`choose_zero_stage` resolves it).
    """
    if config.zero_stage == "auto":
        raise ValueError(
            "train.zero_stage is 'auto': plan one stage at a time (choose_zero_stage "
            "resolves it against the budget)"
        )
    if accelerator not in _ACCELERATORS:
        raise ValueError(f"accelerator must be one of {_ACCELERATORS}, got {accelerator!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not table_sizes or min(table_sizes) < 1:
        raise ValueError(f"table_sizes: need at least one table of >= 1 rows, got {table_sizes}")
    if num_dense_features < 0 or num_dense_params < 0:
        raise ValueError(
            f"num_dense_features ({num_dense_features}) and num_dense_params "
            f"({num_dense_params}) must be >= 0"
        )
    names = tuple(feature_names) if feature_names is not None else ()
    if names and len(names) != len(table_sizes):
        raise ValueError(f"feature_names has {len(names)} names for {len(table_sizes)} table_sizes")

    rows = sum(table_sizes)
    features = len(table_sizes)
    dim = config.embedding_dim
    sharded = config.embeddings == "sharded"
    per_rank = dict.fromkeys(COMPONENTS, 0)

    if sharded:
        local_rows = -(-rows // world_size)  # ceil: rank 0 holds the extra rows
        held_rows = local_rows + features  # plus the replicated default rows
        state_per_row = 1 if config.sparse_optimizer == "rowwise_adagrad" else 2 * dim
        # The table's rows at their precision; the default rows are fp32 parameters.
        precision = config.table_precision
        per_rank["embeddings"] = (
            local_rows * (dim * TABLE_BYTES[precision] + ROW_BYTES[precision])
            + features * dim * FP32_BYTES
        )
        per_rank["sparse_optimizer"] = held_rows * state_per_row * FP32_BYTES
        if config.admission_min_count >= 2:
            # `ShardedEmbedding.counts` is int64.
            per_rank["admission"] = local_rows * INT64_BYTES
        per_rank["consolidation"] = 2 * min(rows * dim * FP32_BYTES, CHUNK_BYTES)
        dense_params = num_dense_params
    else:
        dense_params = num_dense_params + rows * dim

    param_bytes, grad_bytes, optimizer_bytes = _DENSE_BYTES[config.precision]
    partition = -(-dense_params // world_size)
    stage = config.zero_stage
    per_rank["dense_params"] = (partition if stage >= 3 else dense_params) * param_bytes
    per_rank["dense_grads"] = (partition if stage >= 2 else dense_params) * grad_bytes
    optimizer = (partition if stage >= 1 else dense_params) * optimizer_bytes
    host_offload = optimizer if config.offload_optimizer else 0
    on_device = not (config.offload_optimizer and accelerator != "cpu")
    per_rank["dense_optimizer"] = optimizer if on_device else 0
    if stage in (1, 2):
        per_rank["consolidation"] += dense_params * FP32_BYTES
    elif stage == 3:
        per_rank["consolidation"] += min(dense_params * FP32_BYTES, CHUNK_BYTES)

    per_rank["activations"] = _activation_bytes(config, features, num_dense_features)
    if sharded:
        unique_rows = min(config.batch_size * features, rows)
        per_rank["activations"] += unique_rows * dim * FP32_BYTES * GATHER_COPIES
        if config.table_precision != "fp32":
            per_rank["activations"] += unique_rows * dim * FP32_BYTES * ROUNDING_COPIES
        if config.table_precision == "int8":
            per_rank["activations"] += unique_rows * 2 * FP32_BYTES * GRID_COPIES
    num_labels = len(config.tasks) if config.tasks else 1
    batch_bytes = config.batch_size * (
        features * INT64_BYTES + num_dense_features * FP32_BYTES + num_labels * FP32_BYTES
    )
    per_rank["reader"] = (config.prefetch_batches + 1) * batch_bytes
    per_rank["runtime"] = RUNTIME_BYTES

    return MemoryPlan(
        world_size=world_size,
        per_rank=per_rank,
        host_offload=host_offload,
        total=sum(per_rank.values()),
        table_sizes=tuple(table_sizes),
        feature_names=names,
        num_dense_features=num_dense_features,
        num_dense_params=num_dense_params,
        accelerator=accelerator,
    )


def _activation_bytes(config: TrainConfig, features: int, num_dense_features: int) -> int:
    """Activation bytes of one micro batch: forward elements x fp32 x safety factor.

    Per sample, the forward pass produces: the dense input (Dn), the bottom MLP outputs
    (sum of bottom_mlp), the pooled embeddings (F * D), the interaction and the top MLP
    outputs plus one logit per task. Dot interaction: the stacked (F+1, D) vectors, the
    (F+1) x (F+1) Gram matrix and the interaction output of width bottom[-1] +
    (F+1)F/2. Cross interaction of width w = bottom[-1] + F * D: x0 plus, per layer,
    W x_l + b and x_{l+1}: w * (1 + 2 * num_cross_layers). Counted in fp32 (also under
    bf16, to be safe).
    """
    dim = config.embedding_dim
    bottom_out = config.bottom_mlp[-1]
    if config.interaction == "dot":
        vectors = features + 1
        width = bottom_out + vectors * (vectors - 1) // 2
        interaction = vectors * dim + vectors * vectors + width
    else:
        width = bottom_out + features * dim
        interaction = width * (1 + 2 * config.num_cross_layers)
    num_labels = len(config.tasks) if config.tasks else 1
    per_sample = (
        num_dense_features
        + sum(config.bottom_mlp)
        + features * dim
        + interaction
        + sum(config.top_mlp)
        + num_labels
    )
    return config.batch_size * per_sample * FP32_BYTES * ACTIVATION_SAFETY_FACTOR


def check_memory(
    plan: MemoryPlan,
    config: TrainConfig,
    budget_bytes: int,
    budget_source: str,
    *,
    split_over_ranks: bool = False,
) -> None:
    """Refuse a run whose worst rank needs more memory than its budget.

    The message gives the need and the budget (and where it came from), the largest
    components and the single changes that would make the plan fit, each re-planned:
    a world_size, an embedding_dim, a row cap on the largest features, rowwise_adagrad,
    sharded embeddings, narrower table rows (the widest precision that fits: bf16/fp16,
    else int8), a higher ZeRO stage or offload_optimizer.

    Args:
        plan: The plan from `plan_memory` for `config`.
        config: The train config the plan was made for.
        budget_bytes: Memory one rank may use.
        budget_source: Where the budget came from, for the message (e.g.
            "train.memory_per_rank_gb" or "24.0 GiB machine memory / 2 ranks").
        split_over_ranks: The budget is one machine's memory divided by the ranks on
            it: a different world_size changes every rank's budget (then fewer ranks is
            what can help). False: every rank keeps `budget_bytes` (own GPU or machine).

    Raises:
        ConfigError: plan.total > budget_bytes.
    """
    if plan.total <= budget_bytes:
        return
    parts = sorted(((size, name) for name, size in plan.per_rank.items() if size), reverse=True)
    largest = parts[:3]
    lines = [
        f"train: the run needs {human_bytes(plan.total)} on its worst rank (rank 0 of "
        f"world_size={plan.world_size}) but the budget is {human_bytes(budget_bytes)} per rank "
        f"(from {budget_source}).",
        "Largest parts: "
        + ", ".join(f"{name} {human_bytes(size)}" for size, name in largest)
        + ".",
    ]
    if plan.table_sizes:
        fits, partial = _suggestions(plan, config, budget_bytes, split_over_ranks)
        if fits:
            lines.append("Any one of these fits:")
            lines += [f"  - {text}" for text in fits]
        elif partial:
            lines.append("No single change fits; these reduce the need, so combine them:")
            lines += [f"  - {text}" for text in partial]
    lines.append(
        f"Or run where each rank has at least {human_bytes(plan.total)} and set "
        "train.memory_per_rank_gb."
    )
    raise ConfigError("\n".join(lines))


def _suggestions(
    plan: MemoryPlan, config: TrainConfig, budget: int, split_over_ranks: bool
) -> tuple[list[str], list[str]]:
    """Single config changes that fit the budget, and ones that only reduce the need."""
    fits: list[str] = []
    partial: list[str] = []

    def replan(
        world_size: int | None = None, table_sizes: list[int] | None = None, **update: object
    ) -> MemoryPlan:
        return plan_memory(
            config.model_copy(update=update),
            table_sizes or list(plan.table_sizes),
            plan.num_dense_features,
            plan.num_dense_params,
            world_size or plan.world_size,
            plan.accelerator,
            feature_names=plan.feature_names or None,
        )

    def offer(text: str, new: MemoryPlan) -> None:
        if new.total <= budget:
            fits.append(f"{text} -> needs {human_bytes(new.total)} per rank")
        elif new.total < plan.total:
            partial.append(f"{text} -> needs {human_bytes(new.total)} per rank")

    # world_size. Totals never grow with more ranks: sharded rows and ZeRO partitions
    # shrink, the rest is per rank. On one shared machine the budget shrinks faster.
    world = plan.world_size
    if split_over_ranks:
        machine = budget * world
        fewer = [w for w in range(world - 1, 0, -1) if replan(w).total <= machine // w]
        if fewer:
            fits.append(
                f"train.world_size: {fewer[0]} (fewer ranks sharing this machine's "
                f"{human_bytes(machine)}: {human_bytes(machine // fewer[0])} each) -> needs "
                f"{human_bytes(replan(fewer[0]).total)} per rank"
            )
    else:
        more = smallest(world + 1, MAX_SUGGESTED_WORLD_SIZE, lambda w: replan(w).total <= budget)
        if more is not None:
            streams = config.data_streams
            also = (
                f", and train.data_streams a multiple of {more}"
                if streams is not None and streams % more
                else ""
            )
            fits.append(
                f"train.world_size: {more} (each rank keeping a {human_bytes(budget)} budget, "
                f"e.g. on more machines{also}) -> needs {human_bytes(replan(more).total)} per rank"
            )

    # embedding_dim: every part grows with it; for 'dot' bottom_mlp[-1] must follow.
    def dim_update(dim: int) -> dict[str, object]:
        if config.interaction == "dot":
            return {"embedding_dim": dim, "bottom_mlp": [*config.bottom_mlp[:-1], dim]}
        return {"embedding_dim": dim}

    def dim_text(dim: int) -> str:
        extra = (
            f" and train.bottom_mlp: {[*config.bottom_mlp[:-1], dim]}"
            if config.interaction == "dot"
            else ""
        )
        return f"train.embedding_dim: {dim}{extra}"

    dim = largest(1, config.embedding_dim - 1, lambda d: replan(**dim_update(d)).total <= budget)
    if dim is not None:
        dim -= dim % 8 if dim >= 8 else 0  # a multiple of 8 suits the kernels; still fits
        offer(dim_text(dim), replan(**dim_update(dim)))
    elif config.embedding_dim > 1:
        half = config.embedding_dim // 2
        offer(dim_text(half), replan(**dim_update(half)))

    # Cap the largest tables at `cap` rows (hashing or a smaller vocabulary).
    sizes = list(plan.table_sizes)

    def capped(cap: int) -> list[int]:
        return [min(size, cap) for size in sizes]

    cap = largest(2, max(sizes) - 1, lambda c: replan(table_sizes=capped(c)).total <= budget)
    if cap is not None:
        cap = _round_down(cap)
        names = plan.feature_names or tuple(f"sparse feature #{i}" for i in range(len(sizes)))
        over = sorted(
            ((size, name) for size, name in zip(sizes, names, strict=True) if size > cap),
            reverse=True,
        )
        listed = ", ".join(f"{name} ({size:,} rows)" for size, name in over[:5])
        if len(over) > 5:
            listed += f" and {len(over) - 5} more"
        offer(
            f"at most {cap:,} rows for {listed}: schema hash_buckets: {cap}, or a smaller "
            f"vocabulary (top_k: {cap - 1} plus the OOV row, or a higher min_count)",
            replan(table_sizes=capped(cap)),
        )

    if config.embeddings == "sharded" and config.sparse_optimizer == "lazy_adam":
        offer("train.sparse_optimizer: rowwise_adagrad", replan(sparse_optimizer="rowwise_adagrad"))
    if config.embeddings == "sharded":
        _offer_table_precision(config, budget, replan, offer)
    if config.embeddings == "dense":
        offer("train.embeddings: sharded", replan(embeddings="sharded"))

    # Dense side: the least invasive ZeRO / offload setting that fits, else the
    # strongest one if it at least reduces the need.
    options: list[tuple[str, dict[str, object]]] = [
        (f"train.zero_stage: {stage}", {"zero_stage": stage})
        for stage in range(config.zero_stage + 1, 4)
    ]
    if not config.offload_optimizer:
        options += [
            (
                f"train.offload_optimizer: true with train.zero_stage: {stage}",
                {"offload_optimizer": True, "zero_stage": stage},
            )
            for stage in range(max(1, config.zero_stage), 4)
        ]
    dense_plans = [(text, replan(**update)) for text, update in options]
    fitting = [(text, new) for text, new in dense_plans if new.total <= budget]
    if fitting:
        offer(*fitting[0])
    elif dense_plans:
        offer(*min(dense_plans, key=lambda option: option[1].total))
    return fits, partial


# What a refusal says of the narrower table precisions it offers: one of each width
# (fp16 takes bf16's bytes; bf16 is named first, as it needs no loss scale).
_PRECISION_TEXT: dict[TablePrecision, str] = {
    "bf16": "train.table_precision: bf16 (or fp16): 2-byte rows with stochastic rounding, "
    "the optimizer state stays fp32",
    "int8": "train.table_precision: int8: 1-byte codes and a per-row fp32 scale and bias, "
    "stochastically rounded updates, the optimizer state stays fp32",
}


def _offer_table_precision(
    config: TrainConfig,
    budget: int,
    replan: Callable[..., MemoryPlan],
    offer: Callable[[str, MemoryPlan], None],
) -> None:
    """Offer the widest narrower table precision that fits, else the narrowest.

    Narrower rows lose precision, so the refusal names the widest that is enough: from
    fp32, bf16 (or fp16) when 2-byte rows fit and int8 when only 1-byte rows do; from
    fp16 or bf16, int8. When none fits alone, the narrowest is offered as a reduction
    to combine with other changes.
    """
    width = TABLE_BYTES[config.table_precision]
    plans = [
        (name, replan(table_precision=name))
        for name in _PRECISION_TEXT
        if TABLE_BYTES[name] < width
    ]
    if not plans:
        return
    fitting = [(name, new) for name, new in plans if new.total <= budget]
    name, new = fitting[0] if fitting else plans[-1]
    offer(_PRECISION_TEXT[name], new)


def choose_zero_stage(
    config: TrainConfig,
    table_sizes: list[int],
    num_dense_features: int,
    num_dense_params: int,
    world_size: int,
    accelerator: str = "cpu",
    budget: tuple[int, str] | None = None,
) -> tuple[int, str]:
    """Resolve train.zero_stage: auto: the lowest stage whose plan fits the budget.

    ZeRO 0 is preferred whenever it fits: measured on the CTR engine, ZeRO 2 ran the
    step at 0.78-0.96x TorchRec's speed and ZeRO 0 at 1.10x (dense phase 12.8 vs 9.1 ms,
    2-rank optimizer phase 14.9 vs 7.7 ms), since ZeRO 1-3 partition the optimizer step
    and add collectives. A higher stage is taken only when the dense state does not fit
    otherwise. When no stage fits, the one with the smallest plan is returned, so that
    `check_memory` refuses it with the changes that would fit at that stage.

    Args:
        config: The train section; an explicit zero_stage is returned as it is.
        table_sizes: Rows of each sparse feature's table (as `plan_memory`).
        num_dense_features: Dense input features.
        num_dense_params: Dense parameters, without embedding tables.
        world_size: Ranks W.
        accelerator: "cpu" or "cuda".
        budget: (bytes per rank, where the figure comes from), or None when there is no
            budget to plan against (the fastest stage is taken then).

    Returns:
        (the stage, one line that says why, for the train stage's log).
    """
    stages = config.zero_stages()
    if config.zero_stage != "auto":
        return stages[0], f"train.zero_stage: {stages[0]} (set in the config)"
    plans = {
        stage: plan_memory(
            config.model_copy(update={"zero_stage": stage}),
            table_sizes,
            num_dense_features,
            num_dense_params,
            world_size,
            accelerator,
        )
        for stage in stages
    }
    first = plans[stages[0]]
    dense = sum(first.per_rank[name] for name in _DENSE_PARTS)
    at_first = (
        f"at ZeRO {stages[0]} the dense state (params, grads, AdamW) needs "
        f"{human_bytes(dense)} per rank and the whole plan {human_bytes(first.total)}"
    )
    if budget is None:
        return stages[0], (
            f"train.zero_stage: auto -> {stages[0]}, the fastest: {at_first}; no memory "
            "budget to plan against (set train.memory_per_rank_gb to plan one)"
        )
    limit, source = budget
    within = f"the budget of {human_bytes(limit)} per rank (from {source})"
    fitting = [stage for stage in stages if plans[stage].total <= limit]
    if fitting and fitting[0] == stages[0]:
        line = f"train.zero_stage: auto -> {stages[0]}, the fastest: {at_first}, within {within}"
        return stages[0], line
    if fitting:
        stage = fitting[0]
        return stage, (
            f"train.zero_stage: auto -> {stage}: {at_first}, over {within}; partitioned by "
            f"ZeRO {stage} over {world_size} ranks the plan needs "
            f"{human_bytes(plans[stage].total)}"
        )
    stage = min(stages, key=lambda s: (plans[s].total, s))
    return stage, (
        f"train.zero_stage: auto -> {stage}: no stage fits {within} ({at_first}); ZeRO "
        f"{stage} needs the least, {human_bytes(plans[stage].total)}"
    )


def rows_that_fit(
    config: TrainConfig,
    budget_bytes: int | None = None,
    embedding_dim: int | None = None,
    *,
    num_tables: int = 1,
    num_dense_features: int = 0,
    num_dense_params: int = 0,
    world_size: int = 1,
    accelerator: str = "cpu",
) -> dict[TablePrecision, int]:
    """How many embedding rows of one dim fit a memory budget, at each table precision.

    The plan turned around: the largest N (rows over all tables, split evenly over
    `num_tables` tables) whose worst-rank plan, `plan_memory` with the config's other
    settings (sparse optimizer, admission, batch, MLPs, ZeRO, runtime), fits
    `budget_bytes`; so it is a prediction of the rank's resident memory, table plus
    optimizer state plus activations, reader and runtime, not of the table alone.
    With train.zero_stage: auto the best stage of `TrainConfig.zero_stages` counts,
    as the train stage would pick it.

    Args:
        config: The train section; its embeddings are taken as "sharded" (the table
            precision applies to those only).
        budget_bytes: Memory of one rank. Default: this machine's whole memory
            (`machine_memory_bytes`, one process); the train stage's own budget is a
            share of it (`training.stages.memory_budget`).
        embedding_dim: D; default config.embedding_dim (with 'dot', bottom_mlp's last
            layer follows it).
        num_tables: Sparse features F the rows are split over.
        num_dense_features: Dense input features.
        num_dense_params: Dense parameters (the model's MLPs; 0 counts none).
        world_size: Ranks W sharing the rows (each with `budget_bytes`).
        accelerator: "cpu" or "cuda".

    Returns:
        {precision: rows} for fp32, bf16, fp16 and int8; 0 where not even one row per
        table fits.

    Raises:
        ValueError: num_tables, world_size or embedding_dim < 1.
        ConfigError: budget_bytes is None and this machine does not report its memory.
    """
    if num_tables < 1 or world_size < 1:
        raise ValueError(f"num_tables ({num_tables}) and world_size ({world_size}) must be >= 1")
    dim = config.embedding_dim if embedding_dim is None else embedding_dim
    if dim < 1:
        raise ValueError(f"embedding_dim must be >= 1, got {dim}")
    budget = machine_memory_bytes() if budget_bytes is None else budget_bytes
    update: dict[str, object] = {"embeddings": "sharded", "embedding_dim": dim}
    if config.interaction == "dot":
        update["bottom_mlp"] = [*config.bottom_mlp[:-1], dim]

    def sizes(rows: int) -> list[int]:
        share, extra = divmod(rows, num_tables)
        return [share + (table < extra) for table in range(num_tables)]

    fit: dict[TablePrecision, int] = {}
    for precision in PRECISION_ORDER:
        best = 0
        for stage in config.zero_stages():
            planned = config.model_copy(
                update={**update, "table_precision": precision, "zero_stage": stage}
            )

            def ok(rows: int, planned: TrainConfig = planned) -> bool:
                plan = plan_memory(
                    planned,
                    sizes(rows),
                    num_dense_features,
                    num_dense_params,
                    world_size,
                    accelerator,
                )
                return plan.total <= budget

            # Every row takes at least 1 byte on one of the W ranks: an upper bound.
            found = largest(num_tables, max(num_tables, budget * world_size), ok)
            best = max(best, found or 0)
        fit[precision] = best
    return fit


def rows_report(fit: dict[TablePrecision, int], embedding_dim: int, where: str) -> str:
    """One line for the plan's report: rows of `embedding_dim` that fit, by precision.

    Args:
        fit: `rows_that_fit`'s answer.
        embedding_dim: The D it was computed for.
        where: The budget and layout it was computed for, e.g. "the 10.00 GiB per-rank
            budget on 2 ranks".
    """
    # fp16 and bf16 rows take the same bytes: one figure for both.
    shown = [("fp32", fit["fp32"]), ("bf16/fp16", fit["bf16"]), ("int8", fit["int8"])]
    return (
        f"Embedding rows of dim {embedding_dim} that fit {where}, by train.table_precision: "
        + ", ".join(f"{name} {rows:,}" for name, rows in shown)
        + "."
    )


def _round_down(value: int) -> int:
    """`value` rounded down to two significant digits (1,234,567 -> 1,200,000)."""
    step = 10 ** max(len(str(value)) - 2, 0)
    return value - value % step
