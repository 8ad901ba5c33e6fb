"""Names of the files a train output directory holds, shared by both model families."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

RESUME_DIR = "resume"


RANKS_FILE = ".ranks.json"


LAUNCH_FILE = "launch.json"


TRAIN_CONFIG_FILE = "train_config.json"


TRAIN_LOG_FILE = "train_log.jsonl"


SUMMARY_FILE = "train_summary.json"


LAUNCHER_LOG_FILE = "launcher.log"


CHECKPOINT_DIR = "checkpoints"


CHECKPOINT_TAG = "final"


TENSORBOARD_DIR = "tensorboard"


MEMORY_PLAN_FILE = "memory_plan.json"


def write_json(path: Path, payload: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")


# Where the ranks' launch spec, the launcher's output and rank 0's merged result go.
RANKS_DIR = "ranks"


MODEL_CONFIG_FILE = "model_config.json"


WEIGHTS_FILE = "model.safetensors"
