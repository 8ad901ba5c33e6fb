"""`recforge deploy`: the served deployments as a prefect.yaml, for workers in a work pool.

`recforge serve` runs flow runs in its own process. Teams that run workers write the
same two deployments (the pipeline and the per-stage rerun flow, same names, typed
parameters, schedules) into a prefect.yaml and apply it with `prefect deploy --all`.
The pull step sets the working directory to this checkout, so a worker on the same
machine (or one with the checkout at the same path) can import the flows; replace it
with a `git_clone` step for workers elsewhere.

Whoever reaches the Prefect API can start a deployment run with parameters of their
choosing, and the threat model does not trust them (docs/security.md). So a deployment
run is held to what its operator allowed (`check_deployment_run`, at flow start, before
anything is read or written):

- `root` must lie under one of $RECFORGE_ALLOWED_ROOTS (comma-separated paths or URL
  prefixes; default: the root the deployment was created with);
- `config` must resolve, symlinks followed, under $RECFORGE_CONFIG_DIR (default: this
  checkout's configs/);
- the fields that say where data is read or written or where ranks run
  (`LOCATION_FIELDS`) and the ones that decide which model may replace a champion
  (`GATE_FIELDS`: `bless.*`, `export.model_name`, `train.init`, `name`) are pinned
  (`PINNED_FIELDS`): a run's overrides of them, or of a section above them, must be
  exactly the deployment's own default overrides of them, in the same order (Prefect
  replaces the whole `overrides` list, so leaving one out would be an override too);
  everything else is validated by the config as for `recforge run`.

Set both variables where the flows run: in the environment of `recforge serve`, or of
the work pool's workers.
"""

import os
import subprocess
import sys
from pathlib import Path
from uuid import UUID

import prefect
import yaml
from prefect import runtime

from artifacts.errors import ConfigError
from artifacts.locations import check_location, is_remote
from flows.config import SHOWN_CHARS, clipped, override_key

REPO = Path(__file__).resolve().parent.parent
ENTRYPOINTS = {"pipeline": "flows/pipeline.py:pipeline", "rerun": "flows/pipeline.py:rerun"}

ALLOWED_ROOTS_ENV = "RECFORGE_ALLOWED_ROOTS"
CONFIG_DIR_ENV = "RECFORGE_CONFIG_DIR"
DEFAULT_CONFIG_DIR = REPO / "configs"

# Overrides that point a stage at other data, another output or other machines; from a
# deployment run they may only repeat the deployment's own (the config file is checked).
LOCATION_FIELDS = (
    "ingest.path",
    "generate.out",
    "train.hostfile",
    "train.master_addr",
    "train.master_port",
    "train.ssh_port",
)
# Overrides that decide which model may replace a champion: the gate itself, the model
# whose CHAMPION a run moves, the model a warm start loads, and the pipeline's `latest/`
# pointers (the drift baseline). Pinned like the locations.
GATE_FIELDS = ("bless", "export.model_name", "train.init", "name")
# Why each pinned field is pinned, for the message.
PINNED_FIELDS = {
    **dict.fromkeys(LOCATION_FIELDS, "says where data is read or written or where ranks run"),
    "bless": "decides whether a model may replace the champion",
    "export.model_name": "names the model whose champion a run may replace",
    "train.init": "names the model a warm start loads",
    "name": "names the pipeline's latest/ pointers and runs",
}


def check_deployment_run(config: str, root: str, overrides: list[str]) -> None:
    """Refuse a deployment run's parameters outside what its operator allowed.

    Nothing to check outside a deployment run (`recforge run`: whoever types it runs
    the flow as themselves).

    Raises:
        ConfigError: Naming the parameter and what is allowed (see the module docstring).
    """
    deployment_id = runtime.deployment.id
    if deployment_id is None:
        return
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        defaults = client.read_deployment(UUID(str(deployment_id))).parameters or {}
    check_root(root, allowed_roots(defaults.get("root")))
    check_config_path(config, config_dir())
    check_overrides(overrides, list(defaults.get("overrides") or []))


def allowed_roots(default: str | None) -> list[str]:
    """$RECFORGE_ALLOWED_ROOTS, or else `default` (the deployment's root), normalized."""
    configured = os.environ.get(ALLOWED_ROOTS_ENV, "")
    roots = [r.strip() for r in configured.split(",") if r.strip()] or [default or ""]
    return [_normal_root(r, ALLOWED_ROOTS_ENV) for r in roots if r]


def _normal_root(root: str, what: str) -> str:
    """A URL without its trailing slash; a path absolute, symlinks resolved."""
    location = check_location(root, what)
    return str(location.resolve()) if isinstance(location, Path) else location


def check_root(root: str, allowed: list[str]) -> None:
    """Refuse `root` unless it is one of `allowed` or lies under one.

    Raises:
        ConfigError: It lies elsewhere, or a URL has an empty, '.' or '..' segment.
    """
    normal = _normal_root(root, "deployment parameter root")
    segments = normal.partition("://")[2].split("/") if is_remote(normal) else []
    if not any(s in ("", ".", "..") for s in segments) and any(
        normal == prefix or normal.startswith(prefix.rstrip("/") + "/") for prefix in allowed
    ):
        return
    raise ConfigError(
        f"deployment parameter root={root[:200]!r} is not under the roots this deployment "
        f"may use ({', '.join(allowed) or 'none'}); to allow it, set {ALLOWED_ROOTS_ENV} "
        "(comma-separated paths or URL prefixes) where the flows run"
    )


def config_dir() -> Path:
    """$RECFORGE_CONFIG_DIR, or this checkout's configs/, symlinks resolved."""
    return Path(os.environ.get(CONFIG_DIR_ENV) or DEFAULT_CONFIG_DIR).resolve()


def check_config_path(config: str, directory: Path) -> None:
    """Refuse a config file unless it resolves (symlinks followed) under `directory`.

    Raises:
        ConfigError: A URL, a `..` segment, or a file elsewhere.
    """
    path = Path(config)
    inside = path.resolve().is_relative_to(directory) and path.resolve() != directory
    if "://" in config or ".." in path.parts or not inside:
        raise ConfigError(
            f"deployment parameter config={config[:200]!r}: a deployment run reads config "
            f"files only under {directory} ({CONFIG_DIR_ENV}); put the file there, or set "
            f"{CONFIG_DIR_ENV} where the flows run"
        )


def pinned_field(key: str) -> str | None:
    """The `PINNED_FIELDS` field an override of `key` sets, or None.

    `key` sets a pinned field when it is the field, a section above it (`train` sets
    `train.init`) or a key inside it (`bless.thresholds.auc` sets `bless`).
    """
    return next(
        (
            field
            for field in PINNED_FIELDS
            if key == field or field.startswith(key + ".") or key.startswith(field + ".")
        ),
        None,
    )


def check_overrides(overrides: list[str], defaults: list[str]) -> None:
    """Refuse a run's overrides of `PINNED_FIELDS` unless they are exactly `defaults`' own.

    Args:
        overrides: The run's overrides.
        defaults: The deployment's own default overrides.

    Raises:
        ConfigError: An override of a pinned field (or its section) that the deployment
            does not have, naming the field and the deployment's own value for it; or the
            deployment's own overrides of pinned fields are not all repeated, in order.
    """
    pinned = [o for o in overrides if pinned_field(override_key(o))]
    own = [d for d in defaults if pinned_field(override_key(d))]
    for override in pinned:
        if override in own:
            continue
        key = clipped(override_key(override), SHOWN_CHARS)
        field = pinned_field(override_key(override))
        same = [d for d in own if pinned_field(override_key(d)) == field] or ["none"]
        raise ConfigError(
            f"deployment parameter overrides: {key} {PINNED_FIELDS[field]}, so a "
            f"deployment run may set it only as the deployment does "
            f"({clipped(', '.join(same), 2 * SHOWN_CHARS)}); put it in the config file "
            f"under {config_dir()}, or create the deployment with --set {key}=..."
        )
    if pinned != own:
        raise ConfigError(
            "deployment parameter overrides: this deployment sets "
            f"{clipped(', '.join(own) or 'none', 2 * SHOWN_CHARS)}, which say where data is "
            "read or written or decide which model may replace a champion; a deployment "
            "run must repeat these overrides in the same order (pinned: "
            f"{', '.join(PINNED_FIELDS)}), and may add overrides of any other field"
        )


def check_deployment_defaults(config: str, root: str) -> None:
    """Refuse to create a deployment whose own runs `check_deployment_run` would refuse.

    Raises:
        ConfigError: The config is outside the config directory, or the root outside
            $RECFORGE_ALLOWED_ROOTS (when set).
    """
    check_config_path(config, config_dir())
    check_root(root, allowed_roots(root))


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
    check_deployment_defaults(config, root)
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
