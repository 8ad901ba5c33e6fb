"""`recforge deploy`: the served deployments as a prefect.yaml, for workers in a work pool.

`recforge serve` runs flow runs in its own process. Teams that run workers write the
same two deployments (the pipeline and the per-stage rerun flow, same names, typed
parameters, schedules) into a prefect.yaml and apply it with `prefect deploy --all`.
The pull step sets the working directory to this checkout, so a worker on the same
machine (or one with the checkout at the same path) can import the flows; replace it
with a `git_clone` step for workers elsewhere.
"""

import subprocess
import sys
from pathlib import Path

import prefect
import yaml

from artifacts.errors import ConfigError
from artifacts.locations import is_remote

REPO = Path(__file__).resolve().parent.parent
ENTRYPOINTS = {"pipeline": "flows/pipeline.py:pipeline", "rerun": "flows/pipeline.py:rerun"}


def prefect_yaml(
    config: str,
    root: str,
    name: str,
    pool: str,
    cron: str | None,
    rerun_cron: str | None = None,
    rerun_stage: str | None = None,
    overrides: list[str] | None = None,
) -> dict:
    """The prefect.yaml document (see `flows.pipeline.deployments` for the arguments)."""
    if rerun_cron and rerun_stage is None:
        raise ConfigError("a rerun schedule needs the stage it reruns: pass --rerun-stage")
    defaults = {
        "config": str(Path(config).absolute()),
        "root": root if is_remote(root) else str(Path(root).absolute()),
        "overrides": list(overrides or []),
    }

    def deployment(flow: str, schedule: str | None, parameters: dict, description: str) -> dict:
        return {
            "name": name,
            "entrypoint": ENTRYPOINTS[flow],
            "description": description,
            "tags": ["recforge"],
            "parameters": parameters,
            "enforce_parameter_schema": True,
            "schedules": [{"cron": schedule, "timezone": "UTC"}] if schedule else [],
            "work_pool": {"name": pool, "work_queue_name": None, "job_variables": {}},
        }

    return {
        "name": "recforge",
        "prefect-version": prefect.__version__,
        "build": None,
        "push": None,
        "pull": [{"prefect.deployments.steps.set_working_directory": {"directory": str(REPO)}}],
        "deployments": [
            deployment(
                "pipeline",
                cron,
                defaults,
                "recforge: ingest -> preprocess -> shard -> train -> evaluate -> export",
            ),
            deployment(
                "rerun",
                rerun_cron,
                {**defaults, **({"stage": rerun_stage} if rerun_stage else {})},
                "recforge: rerun one stage (and later ones), reusing earlier outputs",
            ),
        ],
    }


def write_prefect_yaml(out: Path, *args, **kwargs) -> Path:
    """Write `prefect_yaml(*args, **kwargs)` to `out` (replaced whole); returns its path."""
    document = prefect_yaml(*args, **kwargs)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.with_name(f".{out.name}.tmp")
    staging.write_text(
        "# Written by `recforge deploy`; apply with `prefect deploy --all`.\n"
        + yaml.safe_dump(document, sort_keys=False)
    )
    staging.replace(out)
    return out


def apply_prefect_yaml(path: Path) -> int:
    """`prefect --no-prompt deploy --all` on the file, from the repository root.

    Returns:
        Its exit status.
    """
    command = [sys.executable, "-m", "prefect", "--no-prompt", "deploy", "--all"]
    command += ["--prefect-file", str(Path(path).absolute())]
    return subprocess.call(command, cwd=REPO)
