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


# The artifact store's manifest of a published stage output (`artifacts.store`): the sha256
# of every file, written last.
OUTPUT_MANIFEST = "_manifest.json"


def data_identity(path: Path) -> str:
    """What a resume checks the training data by: its content where known, else its path.

    Inside a published stage output (a manifest in `path` or up to two directories
    above), the sha256 of what the manifest lists under `path`: the same data has the
    same identity on every machine and in every cache directory, so a run resumes on
    another node or after `RECFORGE_CACHE_DIR` moved. Elsewhere (a library call on a
    directory of its own) the resolved path.
    """
    path = Path(path).resolve()
    for root in (path, *list(path.parents)[:2]):
        manifest_file = root / OUTPUT_MANIFEST
        if not manifest_file.is_file():
            continue
        try:
            files = json.loads(manifest_file.read_text())["files"]
        except (OSError, ValueError, KeyError, TypeError):
            break
        prefix = "" if root == path else f"{path.relative_to(root).as_posix()}"
        listed = {
            rel: entry.get("sha256")
            for rel, entry in sorted(files.items())
            if not prefix or rel == prefix or rel.startswith(prefix + "/")
        }
        if listed:
            return "sha256:" + json.dumps(listed, sort_keys=True)
        break
    return str(path)
