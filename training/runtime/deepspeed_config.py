"""The DeepSpeed config dict, built in exactly one place from the typed train config.

Both model families call `build_deepspeed_config`: the CTR ranks with every rank a
data-parallel replica and AdamW, the sequence pipeline with world_size /
pipeline_stages replicas and its own Adam betas (`AdamSettings`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from training.config import TrainConfig


@dataclass(frozen=True)
class AdamSettings:
    """The dense optimizer a model family trains with (DeepSpeed's "Adam"/"AdamW").

    DeepSpeed builds torch's AdamW for both names unless `adam_w_mode` is set false, so
    `train.weight_decay` is decoupled weight decay either way.

    Attributes:
        type: DeepSpeed's optimizer name.
        betas: Adam's (beta1, beta2).
    """

    type: Literal["Adam", "AdamW"]
    betas: tuple[float, float]


# The CTR models: AdamW with torch's default betas.
CTR_ADAM = AdamSettings(type="AdamW", betas=(0.9, 0.999))


def build_deepspeed_config(
    config: TrainConfig,
    world_size: int,
    total_steps: int | None = None,
    adam: AdamSettings = CTR_ADAM,
) -> dict[str, Any]:
    """The DeepSpeed config dict; the only place one is built.

    Args:
        config: The train config.
        world_size: Data-parallel degree: the number of ranks of a CTR run, the
            replicas (ranks / pipeline_stages) of a pipeline run.
        total_steps: Optimizer steps of the run; with warmup_steps > 0 the learning rate
            warms up linearly then decays linearly to 0 at this step (without it, it
            stays at its peak after warmup).
        adam: The family's optimizer name and betas.

    Returns:
        A JSON-able DeepSpeed config.

    Raises:
        ValueError: `config.zero_stage` is still "auto": the family's train stage resolves
            it against the memory plan before it builds the launch spec, so that the
            ranks, train_config.json, a resume and a warm start see one stage.
    """
    if config.zero_stage == "auto":
        raise ValueError(
            "train.zero_stage is 'auto': resolve it first (training.ctr.train."
            "resolve_zero_stage, training.sequence.train.resolve_sequence_zero_stage), or "
            "set zero_stage: 0, 1, 2 or 3"
        )
    ds_config: dict[str, Any] = {
        "train_batch_size": config.global_batch_size(world_size),
        "train_micro_batch_size_per_gpu": config.batch_size,
        "gradient_accumulation_steps": config.grad_accum_steps,
        "optimizer": {
            "type": adam.type,
            "params": {
                "lr": config.lr,
                "betas": list(adam.betas),
                "eps": 1e-8,
                "weight_decay": config.weight_decay,
                # torch's AdamW: DeepSpeed's fused Adam would be compiled at first use.
                "torch_adam": True,
            },
        },
        "gradient_clipping": config.grad_clip,
        "zero_optimization": {"stage": config.zero_stage},
        "bf16": {"enabled": config.precision == "bf16"},
        "fp16": {
            "enabled": config.precision == "fp16",
            # 0 = dynamic loss scaling (DeepSpeed's default initial scale 2^16).
            "loss_scale": config.loss_scale,
            "initial_scale_power": 16,
        },
        # Progress is reported by the worker; silence DeepSpeed's own step prints.
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if config.offload_optimizer:
        ds_config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        # Keep torch's AdamW on the offloaded state: DeepSpeedCPUAdam would be compiled.
        ds_config["zero_force_ds_cpu_optimizer"] = False
    if config.warmup_steps > 0:
        warmup = {
            "warmup_min_lr": 0.0,
            "warmup_max_lr": config.lr,
            "warmup_num_steps": config.warmup_steps,
            "warmup_type": "linear",
        }
        if total_steps is None:
            ds_config["scheduler"] = {"type": "WarmupLR", "params": warmup}
        else:
            ds_config["scheduler"] = {
                "type": "WarmupDecayLR",
                "params": {**warmup, "total_num_steps": total_steps},
            }
    return ds_config
