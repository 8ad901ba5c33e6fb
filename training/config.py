"""Typed config sections of the train, evaluate and export stages.

Pydantic only (no torch), so the flow layer and the CLI can parse and validate a
pipeline config without importing the training stack. Every model is frozen and
rejects unknown keys; derived values (the global batch) are methods, never fields.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from artifacts.errors import ConfigError
from training.runtime.hosts import host_problem, not_a_host

SEQUENCE_MODELS = ("sasrec", "bst")

# Train fields that say where the ranks run, not what they train: the same model comes
# out of 1 node x 2 ranks and 2 nodes x 1 rank, so neither the stage's cache key nor a
# resume depends on them.
WHERE_FIELDS = (
    "nodes",
    "ranks_per_node",
    "launcher",
    "hostfile",
    "master_addr",
    "master_port",
    "ssh_port",
    "node_dispatch",
    "node_pickup_timeout_s",
    "node_heartbeat_timeout_s",
    "min_nodes",
)

# One plain name: a registry version (the export stage's fingerprint prefix, or any name
# `recforge models` shows), a model name, a pipeline name. Each becomes one segment of a
# path under the root, so no '/', no leading '.' (never '.' or '..'), and bounded.
PLAIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")

# Train fields a resume may change: the layout (and what follows it to keep the global
# batch), and how the run saves and reports. They do not name the resume checkpoints.
RESUME_FREE_FIELDS = (
    "world_size",
    "batch_size",
    "grad_accum_steps",
    "data_streams",
    "pipeline_stages",
    "checkpoint_every",
    "keep_checkpoints",
    "log_every",
    "tensorboard",
    "prefetch_batches",
    "memory_per_rank_gb",
)


def check_plain_name(value: str, field: str, use: str) -> str:
    """`value`, refused unless it is one plain name (`PLAIN_NAME`).

    Args:
        value: The name from the config or an override.
        field: The field, as the user writes it (``export.model_name``).
        use: What the name becomes, for the message.

    Returns:
        `value`, unchanged.

    Raises:
        ValueError: Naming the field, a bounded view of the value, and the rule.
    """
    if PLAIN_NAME.fullmatch(value):
        return value
    raise ValueError(
        f"{field}={value[:80]!r}{'…' if len(value) > 80 else ''} is not one plain name: "
        f"{use} is a directory under the root, so use letters, digits, '_', '.' and '-' "
        "only, starting with a letter or digit, at most 128 characters"
    )


# Train fields that say how a run saves or runs on its machine, not what it trains; left
# out of the stage's cache key besides WHERE_FIELDS (added later than the key, so that
# the keys of outputs written before them stay as they were).
# `init` names where the weights come from ("champion" is another model every day): the
# train task keys the resolved parent's version and transform instead (`tasks.incremental`).
NOT_IN_CACHE_KEY = (
    "checkpoint_every_s",
    "checkpoint_max_deltas",
    "checkpoint_rebase_share",
    "checkpoint_async",
    "threads_per_rank",
    "init",
)

# How long a node's task run waits for its task worker by default (dispatch 'workers').
NODE_PICKUP_TIMEOUT_S = 600.0

# How long a started node may go without a heartbeat before it is declared lost.
NODE_HEARTBEAT_TIMEOUT_S = 120.0


class SequenceModelConfig(BaseModel):
    """The `train.sequence` section: SASRec/BST architecture and next-item objective.

    The micro batch is `train.batch_size` sequences per data-parallel replica and
    `train.grad_accum_steps` is the number of micro batches a pipeline step runs.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_length: int | None = Field(
        None,
        ge=1,
        description="Items of history the model reads; default preprocess.sequence_length "
        "(it may not exceed it).",
    )
    hidden_dim: int = Field(64, ge=1, description="Item embedding width and model width D.")
    num_blocks: int = Field(2, ge=1, description="Transformer blocks.")
    num_heads: int = Field(1, ge=1, description="Attention heads; must divide hidden_dim.")
    dropout: float = Field(0.2, ge=0.0, lt=1.0, description="Dropout probability.")
    loss: Literal["bce", "sampled_softmax", "softmax"] = Field(
        "bce",
        description="'bce': SASRec's binary cross-entropy with num_negatives sampled "
        "negatives per position (the paper uses 1); 'sampled_softmax': softmax of the "
        "positive against num_negatives sampled negatives; 'softmax' (SASRec): "
        "cross-entropy over the whole catalogue, every item a negative (no sampling).",
    )
    num_negatives: int = Field(
        1,
        ge=1,
        description="Uniformly sampled negative items per position ('bce', 'sampled_softmax'), "
        "or per micro batch with shared_negatives.",
    )
    shared_negatives: bool = Field(
        False,
        description="'sampled_softmax' only: one set of num_negatives uniform items per micro "
        "batch, shared by every position and scored by one matrix product (thousands cost "
        "what a few per position do); a draw equal to a position's positive is masked.",
    )

    @model_validator(mode="after")
    def _check_negatives(self) -> SequenceModelConfig:
        if self.loss == "softmax" and self.num_negatives != 1:
            raise ValueError(
                f"train.sequence.num_negatives={self.num_negatives}: loss 'softmax' scores "
                "every item and samples none; remove it (or use loss: sampled_softmax)"
            )
        if self.shared_negatives and self.loss != "sampled_softmax":
            raise ValueError(
                f"train.sequence.shared_negatives with loss {self.loss!r}: only "
                "'sampled_softmax' shares its negatives across a micro batch; remove "
                "shared_negatives or set loss: sampled_softmax"
            )
        return self

    mlp: list[int] = Field(
        default_factory=lambda: [64, 32],
        description="BST only: hidden sizes of the MLP over the target's hidden state.",
    )
    partition_method: Literal["blocks", "uniform", "parameters"] = Field(
        "blocks",
        description="How DeepSpeed assigns layers to pipeline stages: 'blocks' (the same "
        "number of Transformer blocks per stage), 'uniform' (layer count) or 'parameters' "
        "(parameter count; the item table then outweighs every block).",
    )


def check_pipeline_config(
    world_size: int, num_stages: int, zero_stage: int | Literal["auto"]
) -> None:
    """Refuse a pipeline layout DeepSpeed cannot run.

    Args:
        world_size: Ranks launched.
        num_stages: Pipeline stages; world_size / num_stages is the data-parallel degree.
        zero_stage: ZeRO stage of the DeepSpeed config; "auto" passes (the train stage
            then picks 0 or 1, `TrainConfig.zero_stages`).

    Raises:
        ConfigError: num_stages < 1, num_stages does not divide world_size, or ZeRO
            stage 2/3 (DeepSpeed's pipeline engine supports ZeRO 0 and 1 only).
    """
    if num_stages < 1 or world_size < 1:
        raise ConfigError(
            f"train.pipeline_stages={num_stages}, train.world_size={world_size}: both must "
            "be at least 1"
        )
    if world_size % num_stages:
        raise ConfigError(
            f"train.pipeline_stages={num_stages} does not divide train.world_size="
            f"{world_size}: every data-parallel replica needs all stages; choose a "
            "world_size that is a multiple of pipeline_stages"
        )
    if zero_stage not in (0, 1, "auto"):
        raise ConfigError(
            f"train.zero_stage={zero_stage} with train.pipeline_stages={num_stages}: "
            "DeepSpeed pipeline parallelism supports ZeRO stage 0 or 1 only; set "
            "zero_stage to 0, 1 or auto"
        )


# Fields only the CTR models (train.model: dlrm) read, with what a sequence model takes
# instead (shown before "remove it").
_CTR_ONLY_FIELDS = {
    "interaction": "",
    "embedding_dim": "the item table's width is train.sequence.hidden_dim; ",
    "bottom_mlp": "",
    "top_mlp": "BST's head is train.sequence.mlp; ",
    "num_cross_layers": "",
    "dropout": "the sequence models take train.sequence.dropout; ",
    "offload_optimizer": "the pipeline engine keeps its optimizer state on the rank; ",
    "embeddings": "the item table is a tied pipeline layer; ",
    "table_precision": "the item table trains with the dense side at train.precision; ",
    "comm_precision": "the item table is a tied pipeline layer, not exchanged by row; ",
    "overlap_exchange": "the item table is a tied pipeline layer, not exchanged by row; ",
    "sparse_optimizer": "the item table is trained by the dense optimizer (train.lr); ",
    "sparse_lr": "the item table is trained by the dense optimizer (train.lr); ",
    "sparse_weight_decay": "the item table takes train.weight_decay; ",
    "admission_min_count": "preprocess.min_count sets the item vocabulary; ",
    "pooling": "",
    "tasks": "",
    "data_streams": "the sequence models draw every step from one seeded stream; ",
    "prefetch_batches": "",
    "checkpoint_max_deltas": "the sequence models' resume checkpoints are whole; ",
    "checkpoint_rebase_share": "the sequence models' resume checkpoints are whole; ",
    "checkpoint_async": "the sequence models' resume checkpoints are whole; ",
}
# Fields only the sequence models read.
_SEQUENCE_ONLY_FIELDS = {
    "sequence": "",
    "pipeline_stages": f"it splits the sequence models {list(SEQUENCE_MODELS)} into stages; ",
    "eval_every_epochs": "the CTR models train for train.epochs and are evaluated after; ",
    "patience": "the CTR models have no in-training validation; ",
    "select_metric": "the CTR models have no in-training validation; ",
    "valid_num_negatives": "the CTR models have no in-training validation; ",
    "valid_negatives_seed": "the CTR models have no in-training validation; ",
}
# Fields that only mean something with in-training validation (train.eval_every_epochs).
_VALIDATION_FIELDS = ("patience", "select_metric", "valid_num_negatives", "valid_negatives_seed")
# What train.select_metric may name: a ranking metric of `training.sequence.ranking`.
SELECT_METRIC_PATTERN = re.compile(r"(?:(?:hr|ndcg)@([1-9][0-9]*)|mrr)_(sampled|full)")


def _other_family_fields(model: str) -> dict[str, str]:
    """The fields `model` does not use -> the hint of what it takes instead."""
    return _CTR_ONLY_FIELDS if model in SEQUENCE_MODELS else _SEQUENCE_ONLY_FIELDS


def _shown_default(value: object) -> object:
    """A field's value as an error message shows it (a section as its dict)."""
    return value.model_dump() if isinstance(value, BaseModel) else value


class TrainConfig(BaseModel):
    """The `train` section: model architecture, optimisation and parallelism."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: Literal["dlrm", "sasrec", "bst"] = Field(
        "dlrm",
        description="'dlrm': the CTR model over the shards (DLRM/DCN-v2, sharded "
        "embeddings). 'sasrec': next-item Transformer over preprocess's per-user sequences. "
        "'bst': Behavior Sequence Transformer, the target item appended to the history. "
        "The sequence models train as a DeepSpeed PipelineModule (see `sequence`).",
    )
    sequence: SequenceModelConfig = Field(
        default_factory=SequenceModelConfig,
        description="Architecture and objective of the sequence models.",
    )
    pipeline_stages: int = Field(
        1,
        ge=1,
        description="Sequence models: pipeline-parallel stages; world_size / pipeline_stages "
        "ranks form the data-parallel (ZeRO-1) replicas.",
    )
    interaction: Literal["dot", "cross"] = Field(
        "dot",
        description="Feature interaction: 'dot' (DLRM pairwise dot products) or "
        "'cross' (DCN-v2 cross layers).",
    )
    embedding_dim: int = Field(16, ge=1, description="Width of every sparse embedding table.")
    bottom_mlp: list[int] = Field(
        default_factory=lambda: [64, 16],
        min_length=1,
        description="Layer sizes of the MLP over the dense features; for the 'dot' "
        "interaction the last size must equal embedding_dim.",
    )
    top_mlp: list[int] = Field(
        default_factory=lambda: [64, 32],
        description="Hidden layer sizes of the MLP after the interaction (a final "
        "1-unit logit layer is always added).",
    )
    num_cross_layers: int = Field(
        2, ge=1, description="Number of DCN-v2 cross layers (used by the 'cross' interaction)."
    )
    dropout: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="Dropout probability after every hidden layer of the bottom and top "
        "MLPs, in training only.",
    )
    batch_size: int = Field(512, ge=1, description="Micro batch size per rank.")
    grad_accum_steps: int = Field(
        1, ge=1, description="Micro batches accumulated per optimizer step."
    )
    epochs: float = Field(
        1.0, gt=0, description="Passes over the train split; may be fractional (0.5 = half)."
    )
    max_steps: int | None = Field(
        None,
        ge=1,
        description="Optimizer steps to train; when set it overrides epochs (the data "
        "is cycled as often as needed).",
    )
    lr: float = Field(1e-3, gt=0, description="Peak learning rate of AdamW.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW decoupled weight decay.")
    warmup_steps: int = Field(
        0,
        ge=0,
        description="Linear warmup steps, then linear decay to 0 at the last step; "
        "0 keeps the learning rate constant.",
    )
    grad_clip: float = Field(
        0.0,
        ge=0,
        description="Gradient clipping; 0 disables. The dense parameters (DeepSpeed's "
        "gradient_clipping): their global L2 norm, over all ranks, is scaled down to this "
        "value. They include the sequence models' item and feature tables (pipeline "
        "layers; the tied item table counted once), the CTR admission default rows and, "
        "with embeddings: dense, the CTR table. With embeddings: sharded, each updated "
        "row's gradient (summed over ranks and micro steps) is also scaled down to L2 norm "
        "<= this value, row by row, before the sparse weight decay and the row-wise "
        "optimizer (training.ctr.embedding.clip_row_norms).",
    )
    zero_stage: Literal[0, 1, 2, 3, "auto"] = Field(
        "auto",
        description="DeepSpeed ZeRO stage of the dense side. 'auto': the train stage picks, "
        "before launch, the lowest stage whose memory plan fits the per-rank budget "
        "(`TrainConfig.zero_stages` lists the stages it may pick) and logs why. The lowest "
        "is the fastest: the CTR step ran at 1.10x TorchRec's speed under ZeRO 0 and "
        "0.78-0.96x under ZeRO 2 (dense phase 9.1 vs 12.8 ms, 2-rank optimizer phase 7.7 vs "
        "14.9 ms), as ZeRO 1-3 add partitioned optimizer steps and collectives. The "
        "resolved stage is what the ranks, train_config.json, a resume and a warm start see.",
    )
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32",
        description="Training precision of the dense side (fp16 uses loss scaling). The "
        "sharded embedding rows take train.table_precision; their optimizer state and the "
        "loss are always fp32.",
    )
    table_precision: Literal["fp32", "fp16", "bf16", "int8"] = Field(
        "fp32",
        description="How the sharded embedding rows are stored (embeddings: sharded only): "
        "fp16 and bf16 halve the bytes of each row; int8 stores 8-bit codes with a per-row "
        "fp32 scale and bias (FBGEMM's row-wise 8-bit layout). Each update is computed in "
        "fp32 and rounded back stochastically, with random bits that are a function of "
        "(seed, step, global row, column), so runs are reproducible, a resume is bitwise and "
        "the world size does not change the result. The row-wise optimizer state stays "
        "fp32, and lookups upcast (decode) the rows. fp16 works on CPU too: the rows never "
        "go through DeepSpeed. Checkpoints, model.safetensors and the exported package keep "
        "this precision; the ONNX and TorchScript models decode the rows after the gather. "
        "A resume cannot change it; a warm start converts.",
    )
    comm_precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp16",
        description="How the sharded embedding rows sent forward and their gradients sent "
        "back travel between ranks (embeddings: sharded, world_size >= 2): bf16 and fp16 "
        "halve those bytes, rounded to nearest; fp16 gradients carry a per-row power-of-"
        "two scale so that small ones survive. Ids always travel as the owner's local row "
        "in the narrowest integer type that holds it. Owners sum and update in fp32, and "
        "the table keeps train.table_precision. With one rank nothing is sent or rounded, "
        "so at fp16 (the default; bench/comm_precision.py: test AUC within 0.00001 of "
        "fp32) 1 and 2 ranks train slightly different models, and a resume on another "
        "world size continues close to, not bitwise on, the uninterrupted run: fp32 "
        "makes both exact. train_summary.json's wire_bytes_per_sample counts the bytes "
        "by kind.",
    )
    overlap_exchange: bool = Field(
        True,
        description="Hide the sharded table's exchanges behind compute (embeddings: "
        "sharded, world_size >= 2), on a process group of their own: the next batch's ids "
        "go to their owners while the current batch computes, and the rows' gradients go "
        "as soon as the backward has them while the dense all-reduce and step run. A "
        "resume checkpoint leaves the batch in flight unconsumed. The model is bitwise "
        "the same either way; false waits for each exchange.",
    )
    loss_scale: float = Field(
        0.0, ge=0, description="fp16 only: a static loss scale, or 0 for dynamic loss scaling."
    )
    offload_optimizer: bool = Field(
        False,
        description="Keep the dense optimizer state (and fp32 masters) in CPU memory "
        "(DeepSpeed ZeRO-Offload); needs zero_stage >= 1.",
    )
    embeddings: Literal["sharded", "dense"] = Field(
        "sharded",
        description="'sharded': fused tables with rows sharded across ranks, exchanged by "
        "all-to-all and updated by a row-wise sparse optimizer (the parameter-server role). "
        "'dense': nn.EmbeddingBag inside the DeepSpeed module with dense AdamW, for small "
        "tables and as a baseline.",
    )
    sparse_optimizer: Literal["rowwise_adagrad", "lazy_adam"] = Field(
        "rowwise_adagrad",
        description="Optimizer of the sharded embedding rows: 'rowwise_adagrad' (one "
        "accumulator per row) or 'lazy_adam' (Adam moments per element, updated only for "
        "the rows in the batch).",
    )
    sparse_lr: float = Field(0.05, gt=0, description="Learning rate of the embedding rows.")
    sparse_weight_decay: float = Field(
        0.0,
        ge=0,
        description="L2 penalty on the embedding rows, applied to a row when it is updated "
        "(lazy, so rarely seen rows are not decayed between sightings).",
    )
    admission_min_count: int = Field(
        0,
        ge=0,
        description="Frequency admission: an id gets its own row only once it has been seen "
        "this many times; until then it shares its feature's default row. 0 or 1 admits all.",
    )
    pooling: Literal["sum", "mean"] = Field(
        "mean", description="How the embeddings of a multi-hot feature's ids are pooled."
    )
    tasks: list[str] | None = Field(
        None,
        min_length=1,
        description="Labels to train one head each for (multi-task, e.g. [click, purchase]); "
        "the losses are summed. Default: the dataset's primary label only.",
    )
    data_streams: int | None = Field(
        None,
        ge=1,
        description="Partitions of the train split read in lock step; each step takes the "
        "same rows from every stream. Fix it (a multiple of world_size) to make the global "
        "batches independent of world_size. Default: world_size.",
    )
    prefetch_batches: int = Field(
        4, ge=1, description="Batches each rank's reader decodes ahead in the background."
    )
    memory_per_rank_gb: float | None = Field(
        None,
        gt=0,
        description="Memory budget of one rank in GiB for the memory planner. Default: "
        "85% of this machine's memory divided by the ranks (of the GPU's memory on GPUs).",
    )
    tensorboard: bool = Field(
        True, description="Write TensorBoard event files to <train output>/tensorboard."
    )
    checkpoint_every: int = Field(
        0,
        ge=0,
        description="Save a crash-safe resume checkpoint every this many optimizer steps "
        "(0: no step trigger; see checkpoint_every_s). A retry of the train stage resumes "
        "from the newest valid checkpoint (same world_size).",
    )
    checkpoint_every_s: float = Field(
        120.0,
        ge=0,
        description="Also save a resume checkpoint at the first optimizer step at least this "
        "many seconds (rank 0's clock) after the run started or last saved one (0: no time "
        "trigger). With either trigger on (the default), the ranks resume from the newest "
        "valid checkpoint and SIGTERM saves one and stops; with both 0, neither.",
    )
    keep_checkpoints: int = Field(
        2,
        ge=1,
        description="Valid resume checkpoints kept (older ones are deleted; the best "
        "validation checkpoint is kept besides them).",
    )
    checkpoint_max_deltas: int = Field(
        8,
        ge=0,
        description="Sharded embeddings: resume checkpoints are differential. A base "
        "holds every row of the table; each delta after it only the rows changed since "
        "the checkpoint before (rows, optimizer state, admission counts, keyed by global "
        "row), with the dense part, RNG and reader position whole. A base is written "
        "first and after this many deltas (0: every checkpoint is a base). A resume "
        "reads the base and its deltas in order, on any world size; retention keeps the "
        "chains of the checkpoints it keeps.",
    )
    checkpoint_async: bool = Field(
        True,
        description="Sharded embeddings: write each delta resume checkpoint in the "
        "background. At the step the ranks save the dense part and copy the changed "
        "rows, RNG states and reader position, then train on while a thread writes them; "
        "rank 0's commits (manifest last) once every rank's files are on disk, so a crash "
        "mid-write leaves the previous checkpoint the newest. At most one is in flight: "
        "one due while the last is writing waits for it (train_summary.json's "
        "resume_checkpoints counts those). Bases, the checkpoint SIGTERM saves, and runs "
        "whose nodes share no disk write in the foreground.",
    )
    checkpoint_rebase_share: float = Field(
        0.5,
        gt=0,
        description="Sharded embeddings: write a base instead of the next delta once "
        "the chain's deltas would hold more rows than this share of the table's (so a "
        "resume never reads much more than two bases' bytes). Where an interval touches "
        "much of the table (small tables, uniform ids) most checkpoints are then bases: "
        "a shorter checkpoint_every_s makes smaller deltas. Above 1 a chain may hold more "
        "rows than a base (a resume reads them all).",
    )
    eval_every_epochs: float = Field(
        0.0,
        ge=0,
        description="Sequence models: rank the valid split every this many epochs (passes "
        "over the train sequences) inside training, keep the best weights (crash-safe, in "
        "the resume checkpoints) and consolidate those, not the last; also at the last "
        "step. 0: no in-training validation, the last weights are the model.",
    )
    patience: int = Field(
        0,
        ge=0,
        description="Sequence models with eval_every_epochs: stop after this many "
        "validations in a row without a better select_metric. 0: train every step (the "
        "best validation's weights are still the model).",
    )
    select_metric: str = Field(
        "ndcg@10_sampled",
        description="Sequence models with eval_every_epochs: the valid-split metric that "
        "picks the best weights (higher is better): hr@K_P, ndcg@K_P or mrr_P with P "
        "'sampled' (evaluate's seeded negatives protocol) or 'full' (SASRec only).",
    )
    valid_num_negatives: int = Field(
        100,
        ge=1,
        description="Sequence models with eval_every_epochs: negatives of the sampled "
        "protocol on the valid split; keep it equal to evaluate.num_negatives, so that the "
        "weights are picked under the protocol they are tested with.",
    )
    valid_negatives_seed: int = Field(
        0,
        ge=0,
        description="Sequence models with eval_every_epochs: seed of the valid split's "
        "negatives; keep it equal to evaluate.negatives_seed.",
    )
    world_size: int = Field(
        2,
        ge=1,
        description="Number of training ranks (processes), over all nodes; nodes * "
        "ranks_per_node. Default: 2, or nodes * ranks_per_node when ranks_per_node is set.",
    )
    nodes: int = Field(
        1,
        ge=1,
        description="Machines the ranks run on; more than 1 needs launcher 'ssh' or "
        "'per_node'. Where the ranks run, not what they train: 2 nodes x 1 rank train the "
        "same model as 1 node x 2 ranks.",
    )
    ranks_per_node: int | None = Field(
        None,
        ge=1,
        description="Ranks on each node; default world_size / nodes (which must divide).",
    )
    launcher: Literal["local", "ssh", "per_node"] = Field(
        "local",
        description="'local': DeepSpeed's launcher starts every rank on this machine. "
        "'ssh': `deepspeed --hostfile` starts them on the hostfile's first `nodes` hosts "
        "over ssh (DeepSpeed's pdsh launcher); the paths must be on a filesystem every node "
        "shares. 'per_node': one Prefect task run per node launches that node's ranks "
        "(`deepspeed --no_ssh --node_rank=i`); nodes share nothing but the artifact root "
        "(object storage), through which their checkpoint files travel.",
    )
    hostfile: str | None = Field(
        None,
        description="DeepSpeed hostfile (`host slots=N` lines): required by launcher 'ssh' "
        "(its first `nodes` hosts run the ranks); with 'per_node' it names the nodes "
        "(default node-0 .. node-N-1).",
    )
    master_addr: str = Field(
        "127.0.0.1",
        description="Rendezvous address: node 0's address that every node can reach, a "
        "hostname or an IP address; rank 0's rendezvous store listens on it only.",
    )
    master_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="Rendezvous TCP port on master_addr; default a port free on this "
        "machine when the train stage starts (set it for a cluster's firewall).",
    )
    ssh_port: int | None = Field(
        None, ge=1, le=65535, description="launcher 'ssh': the hosts' ssh port (default 22)."
    )
    node_dispatch: Literal["local", "workers"] = Field(
        "local",
        description="launcher 'per_node': where the node task runs go. 'local': threads of "
        "the train task on this machine (one machine, tests). 'workers': Prefect task "
        "workers, one on each node (`recforge node-worker --node-rank I --root ROOT`, same "
        "PREFECT_API_URL; node 0's on master_addr); needs an object-store root and a "
        "Prefect server.",
    )
    node_pickup_timeout_s: float | None = Field(
        None,
        gt=0,
        description="node_dispatch 'workers': seconds a node's task run may wait for its "
        "worker before the train stage fails naming the node "
        f"(default {NODE_PICKUP_TIMEOUT_S:.0f}).",
    )
    min_nodes: int | None = Field(
        None,
        ge=1,
        description="node_dispatch 'workers': when an attempt lost nodes (no heartbeat), "
        "the retry goes on with the workers that are left if they are at least this many "
        "and include node 0 (the rendezvous on master_addr): world_size becomes their "
        "count x ranks_per_node and the run resumes its checkpoint on that layout. "
        "Default: nodes (every retry waits for all of them).",
    )
    node_heartbeat_timeout_s: float = Field(
        NODE_HEARTBEAT_TIMEOUT_S,
        ge=5,
        description="launcher 'per_node': a started node whose heartbeat (a signed object "
        "it writes to the attempt's exchange every timeout/6 s, at most every 20 s) does "
        "not advance for this many seconds, by the train task's own clock, is declared "
        "lost: the other nodes are stopped and the attempt fails as transient, so the "
        "retry resumes from the last checkpoint.",
    )
    threads_per_rank: int | None = Field(
        None,
        ge=1,
        description="CPU ranks: torch intra-op (OpenMP) threads of each rank. Default: the "
        "machine's cores divided by the ranks that share it (world_size on one machine, "
        "ranks_per_node on each node of a cluster), so that ranks never oversubscribe "
        "the cores.",
    )
    seed: int = Field(0, description="Seed of python, numpy and torch on every rank.")
    init: str | None = Field(
        None,
        description="Incremental training: 'champion' or a registry version to warm-start "
        "from (its embedding rows, sparse optimizer state and dense weights, mapped through "
        "the id changes of the extended transform; needs ingest.partition). With "
        "'champion' and no champion yet, the chain starts from scratch. None: from scratch.",
    )
    log_every: int = Field(20, ge=1, description="Report progress every this many steps.")

    @field_validator("master_addr")
    @classmethod
    def _check_master_addr(cls, value: str) -> str:
        # It reaches DeepSpeed's launcher command line, and with launcher 'ssh' the shell
        # command pdsh runs on every host.
        problem = host_problem(value)
        if problem is not None:
            raise ValueError(
                f"train.master_addr={not_a_host(value, problem)}; set node 0's hostname or "
                "IP address"
            )
        return value

    @model_validator(mode="before")
    @classmethod
    def _derive_world_size(cls, data: object) -> object:
        # ranks_per_node without world_size: world_size follows from the layout.
        if isinstance(data, dict) and data.get("ranks_per_node") and "world_size" not in data:
            return {**data, "world_size": int(data.get("nodes", 1)) * int(data["ranks_per_node"])}
        return data

    @model_validator(mode="after")
    def _check_layer_sizes(self) -> TrainConfig:
        # Every field is either read by the model family's ranks or refused here: a
        # setting that would be silently ignored is a setting the user thinks is in effect.
        for name, hint in _other_family_fields(self.model).items():
            default = TrainConfig.model_fields[name].get_default(call_default_factory=True)
            value = getattr(self, name)
            if value != default:
                shown = _shown_default(value)
                raise ValueError(
                    f"train.{name}={shown!r} does not apply to train.model={self.model}; "
                    f"{hint}remove it (default {_shown_default(default)})"
                )
        self._check_nodes()
        if self.model in SEQUENCE_MODELS:
            self._check_sequence_model()
        self._check_init()
        if any(size < 1 for size in self.bottom_mlp):
            raise ValueError(f"train.bottom_mlp: layer sizes must be >= 1, got {self.bottom_mlp}")
        if any(size < 1 for size in self.top_mlp):
            raise ValueError(f"train.top_mlp: layer sizes must be >= 1, got {self.top_mlp}")
        if self.interaction == "dot" and self.bottom_mlp[-1] != self.embedding_dim:
            raise ValueError(
                f"train.bottom_mlp: the last layer size ({self.bottom_mlp[-1]}) must equal "
                f"train.embedding_dim ({self.embedding_dim}) for interaction='dot'; "
                f"set bottom_mlp to e.g. {[*self.bottom_mlp[:-1], self.embedding_dim]}"
            )
        if self.offload_optimizer and self.zero_stage == 0:
            raise ValueError(
                "train.offload_optimizer needs train.zero_stage >= 1 (ZeRO-Offload partitions "
                "the optimizer state); set zero_stage: 1, 2, 3 or auto, or "
                "offload_optimizer: false"
            )
        if self.table_precision != "fp32" and self.embeddings == "dense":
            raise ValueError(
                f"train.table_precision={self.table_precision} applies to embeddings: "
                "sharded; a dense table trains at train.precision: remove it or set "
                "embeddings: sharded"
            )
        chain_fields = ("checkpoint_max_deltas", "checkpoint_rebase_share", "checkpoint_async")
        defaults = TrainConfig.model_fields
        changed = [f for f in chain_fields if getattr(self, f) != defaults[f].default]
        if changed and self.embeddings == "dense":
            raise ValueError(
                f"train.{changed[0]} applies to embeddings: sharded (a dense table's resume "
                "checkpoints are DeepSpeed's, whole): remove it or set embeddings: sharded"
            )
        # Any value but the default is refused with a dense table, as for another family.
        comm_default = TrainConfig.model_fields["comm_precision"].default
        if self.comm_precision != comm_default and self.embeddings == "dense":
            raise ValueError(
                f"train.comm_precision={self.comm_precision} applies to embeddings: "
                "sharded (the rows and gradients the ranks exchange); a dense table's "
                "gradients are all-reduced by DeepSpeed at train.precision: remove it or set "
                "embeddings: sharded"
            )
        if self.loss_scale and self.precision != "fp16":
            raise ValueError(
                f"train.loss_scale={self.loss_scale} only applies to precision: fp16; "
                "remove it or set precision: fp16"
            )
        streams = self.num_data_streams()
        if streams % self.world_size:
            raise ValueError(
                f"train.data_streams={streams} must be a multiple of train.world_size="
                f"{self.world_size}; every rank reads the same number of streams"
            )
        if self.global_batch_size() // self.grad_accum_steps % streams:
            raise ValueError(
                f"train.data_streams={streams} must divide the rows of one micro step over "
                f"all ranks (batch_size * world_size = {self.batch_size * self.world_size}); "
                "change batch_size or data_streams"
            )
        return self

    def _check_nodes(self) -> None:
        """The node layout and its launcher (ValueError naming the field)."""
        if self.ranks_per_node is not None and self.nodes * self.ranks_per_node != self.world_size:
            raise ValueError(
                f"train.world_size={self.world_size} is not train.nodes={self.nodes} x "
                f"train.ranks_per_node={self.ranks_per_node}; set world_size: "
                f"{self.nodes * self.ranks_per_node} or remove it"
            )
        if self.world_size % self.nodes:
            raise ValueError(
                f"train.nodes={self.nodes} does not divide train.world_size={self.world_size}: "
                "every node runs the same number of ranks; set train.ranks_per_node"
            )
        if self.nodes > 1 and self.launcher == "local":
            raise ValueError(
                f"train.nodes={self.nodes} needs train.launcher: ssh (with a hostfile) or "
                "per_node; launcher 'local' starts every rank on this machine"
            )
        if self.launcher == "ssh" and not self.hostfile:
            raise ValueError(
                "train.launcher=ssh needs train.hostfile (DeepSpeed's `host slots=N` lines)"
            )
        if self.launcher == "ssh" and self.nodes > 1 and self.master_addr == "127.0.0.1":
            raise ValueError(
                "train.launcher=ssh with train.nodes > 1: set train.master_addr to node 0's "
                "address that every host can reach (127.0.0.1 is each host itself)"
            )
        if self.launcher == "local" and self.hostfile:
            raise ValueError(
                f"train.hostfile={self.hostfile!r} applies to launcher 'ssh' or 'per_node'; "
                "remove it or set train.launcher"
            )
        if self.launcher != "ssh" and self.ssh_port:
            raise ValueError(
                f"train.ssh_port={self.ssh_port} applies to launcher 'ssh' only; remove it"
            )
        if self.node_dispatch != "local" and self.launcher != "per_node":
            raise ValueError(
                f"train.node_dispatch={self.node_dispatch} applies to launcher 'per_node' only; "
                "remove it or set train.launcher: per_node"
            )
        if self.min_nodes is not None and (
            self.node_dispatch != "workers" or self.min_nodes > self.nodes
        ):
            raise ValueError(
                f"train.min_nodes={self.min_nodes} needs node_dispatch 'workers' and at most "
                f"train.nodes={self.nodes}; remove it or set node_dispatch: workers"
            )
        if self.node_pickup_timeout_s is not None and self.node_dispatch != "workers":
            raise ValueError(
                f"train.node_pickup_timeout_s={self.node_pickup_timeout_s} applies to "
                "node_dispatch 'workers' only; remove it or set train.node_dispatch: workers"
            )
        stages = self.pipeline_stages
        if self.nodes > 1 and stages > 1 and self.nodes % stages and stages % self.nodes:
            # DeepSpeed places a stage's data-parallel ranks next to each other (rank =
            # stage * replicas + replica): node borders fall on stage borders only when
            # every node holds whole stages or every stage whole nodes.
            raise ValueError(
                f"train.nodes={self.nodes} x ranks_per_node={self.world_size // self.nodes} "
                f"does not divide train.pipeline_stages={stages}: a stage would straddle two "
                "nodes; choose nodes that divide pipeline_stages, or a multiple of it"
            )

    def _check_init(self) -> None:
        """train.init (ValueError naming the field and what is missing)."""
        if self.init is None:
            return
        if self.init != "champion" and not PLAIN_NAME.fullmatch(self.init):
            raise ValueError(
                f"train.init={self.init[:80]!r} is neither 'champion' nor a registry version "
                "name (letters, digits, '_', '.', '-'); `recforge models list` shows them"
            )
        if self.model in SEQUENCE_MODELS:
            raise ValueError(
                f"train.init={self.init!r}: train.model={self.model} cannot warm-start yet: "
                "its item table is not carried through a grown item vocabulary, and its "
                "pipeline-parallel "
                "checkpoint has no per-row mapping (only CTR models, train.model: dlrm, do); "
                "remove train.init to train it from scratch on the partition"
            )
        if self.launcher == "per_node":
            raise ValueError(
                f"train.init={self.init!r} with train.launcher: per_node is not supported yet "
                "(every node would need the parent's checkpoint); use launcher local or ssh, "
                "or remove train.init"
            )
        if self.embeddings != "sharded":
            raise ValueError(
                "train.init needs train.embeddings: sharded (a warm start maps the sharded "
                "table's rows and their optimizer state); remove train.init or set it"
            )

    def fingerprinted(self) -> dict:
        """What the train stage's cache key covers: every field but `WHERE_FIELDS` and
        `NOT_IN_CACHE_KEY` (checkpoint_every_s, the checkpoint chain's fields,
        threads_per_rank, init).

        checkpoint_every_s and the chain's fields say when and how a run saves, not what
        it trains, and keeping them out leaves the keys of outputs written before the
        fields existed as they were.
        (checkpoint_every has always been in the key; taking it out would change them.)
        """
        return self.model_dump(exclude={*WHERE_FIELDS, *NOT_IN_CACHE_KEY})

    def saves_resume_checkpoints(self) -> bool:
        """Whether the ranks keep resume checkpoints: a step or a time trigger is on."""
        return bool(self.checkpoint_every or self.checkpoint_every_s)

    def resume_keyed(self) -> dict:
        """What names the train stage's resume checkpoints: `fingerprinted` less the layout.

        A rerun or retry on another layout (world size, and the per-rank batch, gradient
        accumulation and stream count that follow it) finds the same checkpoints; the
        ranks then check what must still match (the global batch, the model, the data)
        and convert the rest (`training.runtime.rank.find_resume_point`). How a run saves
        and reports plays no part either.
        """
        return {
            key: value
            for key, value in self.fingerprinted().items()
            if key not in RESUME_FREE_FIELDS
        }

    def intra_op_threads(self, cores: int) -> int:
        """CPU ranks: torch threads per rank, `threads_per_rank` or an equal share of the
        `cores` of the machine among the ranks that run on it."""
        if self.threads_per_rank is not None:
            return self.threads_per_rank
        one_machine = self.launcher == "local" or (
            self.launcher == "per_node" and self.node_dispatch == "local"
        )
        sharing = self.world_size if one_machine else self.node_ranks()
        return max(1, cores // sharing)

    def pickup_timeout_s(self) -> float:
        """node_dispatch 'workers': seconds a node run may wait for its task worker."""
        return self.node_pickup_timeout_s or NODE_PICKUP_TIMEOUT_S

    def node_ranks(self) -> int:
        """Ranks on each node: `ranks_per_node`, or world_size / nodes."""
        return self.world_size // self.nodes

    def _check_sequence_model(self) -> None:
        """The pipeline layout and the sequence section (ValueError naming the field)."""
        try:
            check_pipeline_config(self.world_size, self.pipeline_stages, self.zero_stage)
        except ConfigError as error:
            raise ValueError(str(error)) from None
        if self.sequence.hidden_dim % self.sequence.num_heads:
            raise ValueError(
                f"train.sequence.hidden_dim={self.sequence.hidden_dim} is not divisible "
                f"by train.sequence.num_heads={self.sequence.num_heads}; change one"
            )
        if self.precision == "fp16":
            raise ValueError(
                f"train.precision=fp16: train.model={self.model} trains in fp32 or bf16; set "
                "precision: fp32 or bf16"
            )
        if self.model == "bst" and self.sequence.loss != "bce":
            raise ValueError(
                f"train.sequence.loss={self.sequence.loss!r}: BST trains on click labels with "
                "BCE only; remove it or use train.model: sasrec"
            )
        self._check_validation()
        if self.model == "sasrec" and self.sequence.mlp != SequenceModelConfig().mlp:
            raise ValueError(
                f"train.sequence.mlp={self.sequence.mlp} is BST's head; SASRec scores items "
                "by a dot product and has no head MLP: remove it or use train.model: bst"
            )

    def _check_validation(self) -> None:
        """The in-training validation fields (ValueError naming the field)."""
        if not self.eval_every_epochs:
            for name in _VALIDATION_FIELDS:
                default = TrainConfig.model_fields[name].get_default()
                if getattr(self, name) != default:
                    # Without validation it would be silently ignored.
                    raise ValueError(
                        f"train.{name}={getattr(self, name)!r} needs in-training validation; "
                        "set train.eval_every_epochs (e.g. 1) or remove it"
                    )
        match = SELECT_METRIC_PATTERN.fullmatch(self.select_metric)
        if match is None:
            raise ValueError(
                f"train.select_metric={self.select_metric!r} is not a ranking metric; use "
                "hr@K_sampled, ndcg@K_sampled or mrr_sampled (or _full), e.g. ndcg@10_sampled"
            )
        if match.group(2) == "full" and self.model == "bst":
            raise ValueError(
                f"train.select_metric={self.select_metric!r}: BST ranks sampled negatives "
                "only (a full ranking takes one pass per item); use a _sampled metric"
            )

    def select_metric_protocol(self) -> tuple[int | None, str]:
        """(K of HR@K/NDCG@K, None for MRR; "sampled" or "full") of `select_metric`."""
        match = SELECT_METRIC_PATTERN.fullmatch(self.select_metric)
        if match is None:  # refused at parse time; here for the type checker
            raise ConfigError(f"train.select_metric={self.select_metric!r} is not a metric")
        return (int(match.group(1)) if match.group(1) else None), match.group(2)

    def num_data_streams(self) -> int:
        """Streams the train split is read as: `data_streams`, or `world_size` if unset."""
        return self.world_size if self.data_streams is None else self.data_streams

    def data_parallel_size(self, world_size: int | None = None) -> int:
        """Data-parallel replicas: world_size / pipeline_stages (1 stage: every rank)."""
        ranks = self.world_size if world_size is None else world_size
        return ranks // self.pipeline_stages

    def zero_stages(self) -> tuple[int, ...]:
        """The ZeRO stages this config may train with, fastest first.

        An explicit `zero_stage` is the only one. 'auto' leaves the train stage's planner
        to pick the first that fits the memory budget: the sequence models' pipeline
        engine runs ZeRO 0 or 1 only; offload_optimizer needs a partitioned optimizer
        (1 or more); the CTR models may take any of 0-3. Where the ranks run (nodes)
        does not enter: a resume must not depend on it. Over several nodes without a
        shared disk set the stage to 1 or more: a 2-node ZeRO-0 run, killed and
        resumed, failed its final checkpoint's exchange (DeepSpeed's
        mp_rank_00_model_states.pt "written by two nodes with different sizes"; found
        when auto became the default, not yet pinned down).
        """
        if self.zero_stage != "auto":
            return (self.zero_stage,)
        if self.model in SEQUENCE_MODELS:
            return (0, 1)
        return (1, 2, 3) if self.offload_optimizer else (0, 1, 2, 3)

    def global_batch_size(self, world_size: int | None = None) -> int:
        """Samples per optimizer step over all ranks.

        Args:
            world_size: Number of ranks; defaults to `self.world_size`.

        Returns:
            batch_size * grad_accum_steps * world_size.
        """
        ranks = self.world_size if world_size is None else world_size
        return self.batch_size * self.grad_accum_steps * ranks

    def checkpoint_layout(self) -> dict[str, int | None]:
        """How a resume checkpoint of this config was laid out (its manifest's meta).

        `resume_layout` reads it back to fit another world size to the same steps.

        Returns:
            {"world_size", "pipeline_stages", "batch_size", "grad_accum_steps",
            "global_batch_size": sequences or rows per optimizer step over the
            data-parallel replicas, "data_streams": the CTR reader's streams (None for the
            sequence models, which draw every step from one stream)}.
        """
        sequence = self.model in SEQUENCE_MODELS
        return {
            "world_size": self.world_size,
            "pipeline_stages": self.pipeline_stages,
            "batch_size": self.batch_size,
            "grad_accum_steps": self.grad_accum_steps,
            "global_batch_size": self.global_batch_size(self.data_parallel_size()),
            "data_streams": None if sequence else self.num_data_streams(),
        }


def resume_layout(config: TrainConfig, meta: dict) -> TrainConfig:
    """`config` refitted to resume a checkpoint on its own world size with the same steps.

    A checkpoint resumes on another world size only with the global batch (and, for
    the CTR models, the data streams) it was written with. This keeps `config`'s
    world_size and pipeline_stages and sets grad_accum_steps (or, for the CTR models when
    batch_size does not divide a replica's share, batch_size) so that the global batch
    and data_streams are the checkpoint's. The sequence models take the checkpoint's
    batch_size: their loss is a mean over each micro batch's positions, so another micro
    batch would train other steps (`find_resume_point` refuses it).

    Args:
        config: The train config of the run about to start.
        meta: The checkpoint manifest's meta (`checkpoint_layout` plus the counters); a
            checkpoint written before the layout was recorded returns `config` as is.

    Returns:
        The config to launch with (`config` itself when nothing changes).

    Raises:
        ConfigError: The layout cannot be fitted (the message names the fields and what
            to set): another pipeline_stages, data-parallel replicas that do not divide
            the global batch (for a sequence model: its micro batches), or data_streams
            that are no multiple of world_size.
    """
    if "global_batch_size" not in meta:
        return config
    target = int(meta["global_batch_size"])
    stages = int(meta.get("pipeline_stages", 1))
    if stages != config.pipeline_stages:
        raise ConfigError(
            f"the checkpoint was written with train.pipeline_stages={stages} and this run has "
            f"{config.pipeline_stages}: a pipeline checkpoint holds its optimizer state per "
            f"stage; set pipeline_stages: {stages} (world_size a multiple of it)"
        )
    replicas = config.data_parallel_size()
    if target % replicas:
        raise ConfigError(
            f"train.world_size={config.world_size} gives {replicas} data-parallel replicas, "
            f"which do not divide the checkpoint's global batch of {target}; choose a "
            f"world_size whose replicas divide {target}"
        )
    share = target // replicas  # samples per replica and step
    update: dict[str, int | None] = {}
    if config.model in SEQUENCE_MODELS:
        batch = int(meta["batch_size"])
        if share % batch:
            raise ConfigError(
                f"train.world_size={config.world_size} gives {replicas} data-parallel replicas, "
                f"which do not divide the checkpoint's {target // batch} micro batches of "
                f"{batch} sequences per step (batch_size stays: a micro batch's loss is a mean "
                "over its positions); choose a world_size whose replicas divide "
                f"{target // batch}"
            )
        update.update(batch_size=batch, grad_accum_steps=share // batch)
    elif share % config.batch_size == 0:
        update["grad_accum_steps"] = share // config.batch_size
    elif share % config.grad_accum_steps == 0:
        update["batch_size"] = share // config.grad_accum_steps
    else:
        update.update(batch_size=share, grad_accum_steps=1)
    streams = meta.get("data_streams")
    if streams is not None and config.model not in SEQUENCE_MODELS:
        update["data_streams"] = int(streams)
    changed = {k: v for k, v in update.items() if getattr(config, k) != v}
    if not changed:
        return config
    try:
        return TrainConfig.model_validate({**config.model_dump(), **changed})
    except ValueError as error:
        raise ConfigError(
            f"resuming the checkpoint (global batch {target}, data_streams {streams}) on "
            f"train.world_size={config.world_size} needs {changed}, which the config "
            f"refuses: {error}"
        ) from None


class EvaluateConfig(BaseModel):
    """The `evaluate` section: which split to score and how.

    A field the chosen `train.model` does not read (its description names the models
    that do) is refused by the pipeline config (`evaluate_export_problems`).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    batch_size: int = Field(
        8192,
        ge=1,
        description="CTR models: rows scored per forward pass (the sequence models score "
        "ranking_block_users users at once).",
    )
    split: Literal["test", "valid"] = Field("test", description="Split to evaluate on.")
    ks: list[int] = Field(
        default_factory=lambda: [10],
        min_length=1,
        description="Sequence models: cutoffs K of HR@K and NDCG@K.",
    )
    num_negatives: int = Field(
        100,
        ge=1,
        description="Sequence models: negatives sampled per user from the items it has not "
        "interacted with (protocol (a), the SASRec paper's 100).",
    )
    negatives_seed: int = Field(
        0, ge=0, description="Sequence models: seed of the sampled negatives."
    )
    full_ranking: bool = Field(
        True,
        description="SASRec: also rank the target against every item (b). BST scores given "
        "candidates and ranks the sampled negatives only.",
    )
    ranking_block_users: int = Field(
        512,
        ge=1,
        description="Sequence models: users scored at once; full ranking holds "
        "block x num_items scores.",
    )
    auc_mode: Literal["auto", "exact", "bucketed"] = Field(
        "auto",
        description="CTR models: AUC counting. exact keeps every score (16 bytes a row); "
        "bucketed counts scores in auc_buckets probability buckets and reports an error "
        "bound; auto is exact up to exact_auc_max_rows rows, bucketed above.",
    )
    auc_buckets: int = Field(
        2**16,
        ge=1,
        le=2**24,
        description="CTR models: probability buckets of the bucketed AUC (memory 16 bytes "
        "each, per AUC computed: every task, the oracle and every slice).",
    )
    exact_auc_max_rows: int = Field(
        1_000_000,
        ge=0,
        description="CTR models: auc_mode auto counts exactly up to this many rows.",
    )
    slice_by: list[str] = Field(
        default_factory=list,
        description="CTR models: single-valued sparse features to report metrics per value "
        "of (e.g. [city, device]); keys slice/<feature>=<value>/<metric>.",
    )
    calibration_bins: int = Field(
        10,
        ge=1,
        description="CTR models: equal-width probability bins of calibration.json.",
    )
    user_key: str | None = Field(
        None,
        description="CTR models: shard column that identifies the user, for GAUC; None "
        "takes dataset.json's user_key, and without one GAUC is not reported.",
    )
    score_sample_rows: int = Field(
        256,
        ge=1,
        description="CTR models: the first rows of the split whose scores evaluate saves "
        "(scores_head.npy), the reference export's infra validation compares the package's "
        "raw-record scores with; at least export.infra_validation_rows.",
    )
    workers: int = Field(
        1,
        ge=1,
        description="Ranks scoring the split (DeepSpeed's launcher, gloo); rank 0 merges "
        "their parts, so the metrics equal one process's and this field is not part of "
        "evaluate's cache key. CTR models: each rank every workers-th shard file, at most "
        "min(workers, files of the split) ranks (write more eval shards, "
        "shard.num_eval_shards, to use more). Sequence models: contiguous runs of whole "
        "ranking_block_users blocks, at most min(workers, blocks) ranks (lower "
        "ranking_block_users to use more). 1, or a split of one file or block, scores in "
        "this process. Each rank uses cpu_count // ranks torch threads.",
    )

    @model_validator(mode="after")
    def _check_ks(self) -> EvaluateConfig:
        if any(k < 1 for k in self.ks):
            raise ValueError(f"evaluate.ks: cutoffs must be >= 1, got {self.ks}")
        return self

    @model_validator(mode="after")
    def _check_slice_by(self) -> EvaluateConfig:
        repeated = sorted({name for name in self.slice_by if self.slice_by.count(name) > 1})
        if repeated or any(not name for name in self.slice_by):
            raise ValueError(
                f"evaluate.slice_by: feature names must be non-empty and listed once, got "
                f"{self.slice_by}"
            )
        return self


class ExportConfig(BaseModel):
    """The `export` section: package name and the parity check.

    A field the chosen `train.model` does not read (its description names the models
    that do) is refused by the pipeline config (`evaluate_export_problems`).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    model_name: str = Field(
        "ctr",
        description="Name of the exported model: its registry directory (registry/<name>/, "
        "with its CHAMPION), so one plain name (letters, digits, '_', '.', '-').",
    )
    parity_rows: int = Field(
        1000, ge=1, description="Test rows scored by torch, ONNX and TorchScript for parity."
    )
    parity_atol: float = Field(
        1e-5, gt=0, description="Largest allowed absolute score difference in the parity check."
    )
    opset: int = Field(17, ge=9, description="ONNX opset version.")
    top_k: int = Field(
        10,
        ge=1,
        description="SASRec: items the exported top-K recommender returns. BST exports a "
        "candidate scorer, which scores the candidates it is given.",
    )
    infra_validation_rows: int = Field(
        256,
        ge=1,
        description="CTR models: first test rows whose raw events (the ingest output) the "
        "package's own score.py scores in a fresh interpreter, compared with the trained model "
        "within parity_atol.",
    )
    infra_validation_unseen: int = Field(
        8,
        ge=0,
        description="CTR models: records with ids and strings never seen in train added to "
        "the infra validation sample.",
    )
    infra_validation_repetitions: int = Field(
        200,
        ge=1,
        description="CTR models: timed calls behind each infra validation latency figure "
        "(one-record calls and whole-sample calls).",
    )

    @field_validator("model_name")
    @classmethod
    def _check_model_name(cls, value: str) -> str:
        # registry/<model_name>/ holds the model's versions and its CHAMPION: a path
        # here would promote into another model's directory, or outside the root.
        return check_plain_name(value, "export.model_name", "the model's registry name")


# Evaluate fields only the CTR models read, with what a sequence model takes instead
# (shown before "remove it").
_CTR_ONLY_EVALUATE_FIELDS = {
    "batch_size": "the sequence models score evaluate.ranking_block_users users at once; ",
    "auc_mode": "the sequence models report ranking metrics (HR@K, NDCG@K, MRR), not AUC; ",
    "auc_buckets": "the sequence models report ranking metrics (HR@K, NDCG@K, MRR), not AUC; ",
    "exact_auc_max_rows": "the sequence models report ranking metrics (HR@K, NDCG@K, MRR), "
    "not AUC; ",
    "slice_by": "",
    "calibration_bins": "",
    "user_key": "",
    "score_sample_rows": "it is the reference of the CTR export's infra validation; ",
}
# Evaluate fields only the sequence models read.
_SEQUENCE_ONLY_EVALUATE_FIELDS = {
    "ks": "the CTR models report AUC and logloss, not ranking metrics; ",
    "num_negatives": "the CTR models report AUC and logloss, not ranking metrics; ",
    "negatives_seed": "the CTR models report AUC and logloss, not ranking metrics; ",
    "full_ranking": "the CTR models report AUC and logloss, not ranking metrics; ",
    "ranking_block_users": "the CTR models score evaluate.batch_size rows at once; ",
}
# Export fields only the CTR models read: the sequence packages are checked by parity only.
_CTR_ONLY_EXPORT_FIELDS = {
    "infra_validation_rows": "the sequence packages are checked by parity (parity_rows); ",
    "infra_validation_unseen": "the sequence packages are checked by parity (parity_rows); ",
    "infra_validation_repetitions": "the sequence packages are checked by parity (parity_rows); ",
}
# BST scores the candidates it is given: no full ranking, no top-K recommender.
_BST_CANDIDATES = "BST scores given candidates, "
# model -> section -> the fields it never reads -> the hint of what it takes instead.
_UNREAD_STAGE_FIELDS: dict[str, dict[str, dict[str, str]]] = {
    "dlrm": {
        "evaluate": _SEQUENCE_ONLY_EVALUATE_FIELDS,
        "export": {"top_k": "the CTR package scores records and recommends no items; "},
    },
    "sasrec": {"evaluate": _CTR_ONLY_EVALUATE_FIELDS, "export": _CTR_ONLY_EXPORT_FIELDS},
    "bst": {
        "evaluate": {
            **_CTR_ONLY_EVALUATE_FIELDS,
            "full_ranking": f"{_BST_CANDIDATES}so it ranks the sampled negatives only; ",
        },
        "export": {
            **_CTR_ONLY_EXPORT_FIELDS,
            "top_k": f"{_BST_CANDIDATES}so it exports a candidate scorer, not a top-K "
            "recommender; ",
        },
    },
}


def evaluate_export_problems(
    model: str, evaluate: EvaluateConfig, export: ExportConfig
) -> list[str]:
    """The evaluate and export settings that `model` would silently ignore.

    Every field is either read by the chosen model's evaluate and export or refused,
    as train fields are (`TrainConfig`): a setting that would be ignored is a setting
    the user thinks is in effect. A field at its default is no problem. Called by the
    pipeline config, the one place that sees train.model beside these sections.

    Args:
        model: `train.model`.
        evaluate: The evaluate section.
        export: The export section.

    Returns:
        One message per field set to a non-default value that `model` does not read,
        naming the field, its value and its default; empty when every setting applies.
    """
    problems = []
    for section, config in (("evaluate", evaluate), ("export", export)):
        for name, hint in _UNREAD_STAGE_FIELDS[model][section].items():
            default = type(config).model_fields[name].get_default(call_default_factory=True)
            value = getattr(config, name)
            if value != default:
                problems.append(
                    f"{section}.{name}={value!r} does not apply to train.model={model}; "
                    f"{hint}remove it (default {default})"
                )
    return problems
