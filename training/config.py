"""Typed config sections of the train, evaluate and export stages.

Pydantic only (no torch), so the flow layer and the CLI can parse and validate a
pipeline config without importing the training stack. Every model is frozen and
rejects unknown keys; derived values (the global batch) are methods, never fields.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class TrainConfig(BaseModel):
    """The `train` section: model architecture, optimisation and parallelism."""

    model_config = ConfigDict(frozen=True, extra="forbid")

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
        0.0, ge=0, description="Clip the global gradient norm to this value; 0 disables."
    )
    zero_stage: Literal[0, 1, 2, 3] = Field(0, description="DeepSpeed ZeRO stage.")
    precision: Literal["fp32", "bf16"] = Field(
        "fp32", description="Training precision of the dense side; the loss is always fp32."
    )
    world_size: int = Field(2, ge=1, description="Number of training ranks (processes).")
    seed: int = Field(0, description="Seed of python, numpy and torch on every rank.")
    log_every: int = Field(20, ge=1, description="Report progress every this many steps.")

    @model_validator(mode="after")
    def _check_layer_sizes(self) -> TrainConfig:
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
        return self

    def global_batch_size(self, world_size: int | None = None) -> int:
        """Samples per optimizer step over all ranks.

        Args:
            world_size: Number of ranks; defaults to `self.world_size`.

        Returns:
            batch_size * grad_accum_steps * world_size.
        """
        ranks = self.world_size if world_size is None else world_size
        return self.batch_size * self.grad_accum_steps * ranks


class EvaluateConfig(BaseModel):
    """The `evaluate` section: which split to score and how."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    batch_size: int = Field(8192, ge=1, description="Rows scored per forward pass.")
    split: Literal["test", "valid"] = Field("test", description="Split to evaluate on.")


class ExportConfig(BaseModel):
    """The `export` section: package name and the parity check."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model_name: str = Field("ctr", min_length=1, description="Name of the exported model.")
    parity_rows: int = Field(
        1000, ge=1, description="Test rows scored by torch, ONNX and TorchScript for parity."
    )
    parity_atol: float = Field(
        1e-5, gt=0, description="Largest allowed absolute score difference in the parity check."
    )
    opset: int = Field(17, ge=9, description="ONNX opset version.")
