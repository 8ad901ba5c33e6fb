"""The DeepSpeed config dict, built in exactly one place from the typed train config."""

from __future__ import annotations

from typing import Any

from training.config import TrainConfig


def build_deepspeed_config(
    config: TrainConfig, world_size: int, total_steps: int | None = None
) -> dict[str, Any]:
    """The DeepSpeed config dict; the only place one is built.

    Args:
        config: The train config.
        world_size: Number of ranks (data-parallel degree).
        total_steps: Optimizer steps of the run; with warmup_steps > 0 the learning rate
            warms up linearly then decays linearly to 0 at this step (without it, it
            stays at its peak after warmup).

    Returns:
        A JSON-able DeepSpeed config.
    """
    ds_config: dict[str, Any] = {
        "train_batch_size": config.global_batch_size(world_size),
        "train_micro_batch_size_per_gpu": config.batch_size,
        "gradient_accumulation_steps": config.grad_accum_steps,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": config.lr,
                "betas": [0.9, 0.999],
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
