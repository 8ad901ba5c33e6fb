"""One DeepSpeed training rank: `python -m training.worker LAUNCH.json` under the launcher.

Reads the launch spec written by `training.train` (train config, model config,
DeepSpeed config, paths, step plan) and the train split of the shard directory.
Writes, into the spec's `out_dir`:

- `checkpoints/final/`: the DeepSpeed checkpoint (every rank writes its part);
- `model.safetensors`: consolidated fp32 weights (rank 0);
- `train_log.jsonl`: one progress record per logging step (rank 0), also printed as
  `RECFORGE_PROGRESS {...}` lines for the parent to stream;
- `train_summary.json`: final loss, steps, throughput, seconds (rank 0).

The only environment this process reads is what the launcher sets for
`deepspeed.init_distributed` (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ...).
Any exception prints one `RECFORGE_ERROR {"rank": r, "error": "..."}` line and exits
non-zero; the launcher then stops the other ranks.
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import deepspeed
import deepspeed.comm as dist
import numpy as np
import torch
import torch.nn.functional as F
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from safetensors.torch import save_file

from data_prep.errors import ConfigError
from training.config import TrainConfig
from training.data import iter_batches, load_dataset_meta, steps_per_epoch
from training.model import WEIGHTS_FILE, build_model
from training.train import (
    CHECKPOINT_DIR,
    CHECKPOINT_TAG,
    ERROR_PREFIX,
    PROGRESS_PREFIX,
    SUMMARY_FILE,
    TRAIN_LOG_FILE,
    TRAIN_SPLIT,
)


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch; every rank uses the same seed, so the same init."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def run(spec: dict[str, Any]) -> None:
    """Train one rank according to a launch spec.

    Args:
        spec: The parsed launch.json.

    Raises:
        ConfigError: The launcher started a different number of ranks than configured.
    """
    config = TrainConfig.model_validate(spec["train_config"])
    shards_dir = Path(spec["shards_dir"])
    out_dir = Path(spec["out_dir"])
    total_steps = int(spec["total_steps"])
    seed_everything(config.seed)

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if world_size != config.world_size:
        raise ConfigError(
            f"train.world_size={config.world_size} but the launcher started {world_size} ranks"
        )

    model = build_model(spec["model_config"])
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=spec["ds_config"]
    )
    # bf16 engines hold bf16 weights: the dense input must match them. The loss is fp32.
    input_dtype = torch.bfloat16 if config.precision == "bf16" else torch.float32

    meta = load_dataset_meta(shards_dir)
    micro_per_epoch = steps_per_epoch(meta, TRAIN_SPLIT, world_size, config.batch_size)
    micro_total = total_steps * config.grad_accum_steps
    samples_per_micro = config.batch_size * world_size

    log_file = (out_dir / TRAIN_LOG_FILE).open("a") if rank == 0 else None
    window_loss = torch.zeros((), dtype=torch.float32, device=engine.device)
    window_micro = 0
    final_loss = float("nan")
    micro_done = 0
    step = 0
    engine.train()
    started = window_started = time.monotonic()
    while micro_done < micro_total:
        batches = iter_batches(
            shards_dir,
            meta,
            TRAIN_SPLIT,
            rank,
            world_size,
            config.batch_size,
            num_steps=min(micro_per_epoch, micro_total - micro_done),
        )
        for sparse, dense, label in batches:
            sparse = sparse.to(engine.device)
            dense = dense.to(engine.device, dtype=input_dtype)
            label = label.to(engine.device)
            logits = engine(sparse, dense)  # (B,)
            loss = F.binary_cross_entropy_with_logits(logits.float(), label)
            engine.backward(loss)
            engine.step()
            window_loss += loss.detach()
            window_micro += 1
            micro_done += 1
            if micro_done % config.grad_accum_steps:
                continue
            step += 1
            if step % config.log_every and step != total_steps:
                continue
            # Every rank reaches this all-reduce at the same step: same step counts.
            count = torch.tensor(float(window_micro), device=engine.device)
            totals = torch.stack([window_loss, count])
            dist.all_reduce(totals)
            final_loss = float(totals[0] / totals[1])
            now = time.monotonic()
            record = {
                "step": step,
                "total_steps": total_steps,
                "loss": final_loss,
                "samples_per_s": window_micro * samples_per_micro / max(now - window_started, 1e-9),
                "epoch": micro_done / micro_per_epoch,
            }
            if log_file is not None:
                print(PROGRESS_PREFIX + json.dumps(record), flush=True)
                log_file.write(json.dumps(record) + "\n")
                log_file.flush()
            window_loss.zero_()
            window_micro = 0
            window_started = now
    seconds = time.monotonic() - started

    checkpoint_dir = out_dir / CHECKPOINT_DIR
    engine.save_checkpoint(
        str(checkpoint_dir),
        tag=CHECKPOINT_TAG,
        client_state={"train_config": spec["train_config"], "model_config": spec["model_config"]},
    )
    dist.barrier()  # every rank's checkpoint part is on disk
    if rank == 0:
        state = _fp32_state_dict(engine, checkpoint_dir, config.zero_stage)
        save_file(
            {name: tensor.float().contiguous() for name, tensor in state.items()},
            str(out_dir / WEIGHTS_FILE),
        )
        summary = {
            "final_loss": final_loss,
            "steps": step,
            "micro_steps": micro_done,
            "samples": micro_done * samples_per_micro,
            "samples_per_s": micro_done * samples_per_micro / max(seconds, 1e-9),
            "seconds": seconds,
            "world_size": world_size,
        }
        (out_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    if log_file is not None:
        log_file.close()
    dist.barrier()  # rank 0's files are written before any rank reports success


def _fp32_state_dict(
    engine: deepspeed.DeepSpeedEngine, checkpoint_dir: Path, zero_stage: int
) -> dict[str, torch.Tensor]:
    """The model's fp32 weights: the optimizer's fp32 master copies where there are any.

    ZeRO 1-3 consolidate the ranks' master partitions from the checkpoint. Stage 0
    reads the module; with bf16 its weights are bf16, so they are replaced by the fp32
    masters of DeepSpeed's bf16 wrapper (FP16_UnfusedOptimizer: `fp16_groups` holds the
    module's parameters, `fp32_groups` their masters, in the same order). Should a
    DeepSpeed version hold them elsewhere, the bf16 weights are saved upcast.
    """
    if zero_stage > 0:
        return get_fp32_state_dict_from_zero_checkpoint(str(checkpoint_dir), tag=CHECKPOINT_TAG)
    state = {name: tensor.detach().cpu() for name, tensor in engine.module.state_dict().items()}
    low_groups = getattr(engine.optimizer, "fp16_groups", None)
    master_groups = getattr(engine.optimizer, "fp32_groups", None)
    if low_groups is None or master_groups is None:
        return state
    names = {id(param): name for name, param in engine.module.named_parameters()}
    for low_group, master_group in zip(low_groups, master_groups, strict=True):
        for low, master in zip(low_group, master_group, strict=True):
            state[names[id(low)]] = master.detach().cpu()
    return state


def main(argv: list[str] | None = None) -> int:
    """Entry point: `python -m training.worker LAUNCH.json` (other launcher args ignored)."""
    args = sys.argv[1:] if argv is None else argv
    spec_args = [arg for arg in args if arg.endswith(".json")]
    if len(spec_args) != 1:
        raise SystemExit(f"usage: python -m training.worker LAUNCH.json (got {args})")
    try:
        run(json.loads(Path(spec_args[0]).read_text()))
    except Exception as error:
        # One parseable line per failing rank, so the parent can name the root cause
        # among the other ranks' follow-on errors (a peer's closed connection).
        rank = dist.get_rank() if dist.is_initialized() else None
        report = {"rank": rank, "error": f"{type(error).__name__}: {error}"[:2000]}
        print(ERROR_PREFIX + json.dumps(report), flush=True)
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
