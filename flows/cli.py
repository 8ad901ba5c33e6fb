"""The `recforge` command line: run, generate, serve, ui, models."""

import argparse
import json
import os
import signal
import subprocess
import sys
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

from artifacts.errors import ConfigError, InputNotFoundError, RecforgeError
from artifacts.store import DEFAULT_ROOT, STAGES

if TYPE_CHECKING:  # imported where used: the registry is only needed by `models`
    from artifacts.registry import Registry

# tasks.common.STAGES, spelled out so argument errors need no Prefect import (a test keeps
# them equal).


def _stages(value: str) -> list[str]:
    names = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [n for n in names if n not in STAGES]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown stage(s) {unknown}; choose from {', '.join(STAGES)}"
        )
    return names


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="recforge", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="run the pipeline; prints the run record path last")
    run.add_argument("config", help="pipeline YAML, e.g. configs/demo.yaml")
    run.add_argument(
        "--root",
        default=DEFAULT_ROOT,
        help=f"artifact store root: a directory (default ./{DEFAULT_ROOT}) or an fsspec URL, "
        "e.g. s3://bucket/prefix (needs pip install -e '.[s3]')",
    )
    selection = run.add_mutually_exclusive_group()
    selection.add_argument("--from", dest="from_stage", choices=STAGES, help="rerun from here")
    selection.add_argument("--only", type=_stages, default=[], help="rerun only these stages (a,b)")
    run.add_argument("--force", type=_stages, default=[], help="rerun these even if cached (a,b)")
    run.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field, e.g. --set train.lr=0.01",
    )
    run.add_argument(
        "--verbose",
        action="store_true",
        help="on failure, print the traceback above the one-line error",
    )
    run.add_argument(
        "--hostfile",
        default=None,
        metavar="PATH",
        help="DeepSpeed hostfile (`host slots=N` lines) for train.launcher ssh or per_node: "
        "where the ranks run, like --root (the same as --set train.hostfile=PATH)",
    )
    run.add_argument(
        "--workers",
        type=int,
        default=None,
        help="threads that map the data stages over input files (default: Prefect's)",
    )
    run.add_argument(
        "--dask",
        default=None,
        metavar="ADDRESS|local:N",
        help="map the data stages over a Dask cluster: a scheduler address (tcp://host:8786), "
        "or local:N for a LocalCluster of N worker processes. With an object-store --root the "
        "workers share no disk with this process: they read and write only under the root "
        "(with their own credentials), and ingest.path must be a URL they can read. A "
        "scheduler on another machine needs tls:// (tcp:// neither encrypts nor "
        "authenticates), or --dask-insecure",
    )
    run.add_argument(
        "--dask-insecure",
        action="store_true",
        help="allow a plain tcp:// (or ws://) scheduler on another machine: only on a "
        "network where nobody else can reach the scheduler and its workers",
    )

    backfill = commands.add_parser(
        "backfill",
        help="run the pipeline for each day from --from to --to, in order; stop at a failure",
    )
    backfill.add_argument("config", help="pipeline YAML")
    backfill.add_argument("--from", dest="first", required=True, metavar="YYYY-MM-DD")
    backfill.add_argument("--to", dest="last", required=True, metavar="YYYY-MM-DD")
    backfill.add_argument("--root", default=DEFAULT_ROOT, help="artifact store root")
    backfill.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field on every day; {scheduled_date} is the day "
        "(default partition: --set ingest.partition=dt={scheduled_date})",
    )
    generate = commands.add_parser("generate", help="write the synthetic default dataset")
    generate.add_argument("config", help="pipeline YAML with a `generate` section")
    generate.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field",
    )

    serve = commands.add_parser(
        "serve",
        help="serve the pipeline and the per-stage rerun flow as deployments (runs them here)",
    )
    deploy = commands.add_parser(
        "deploy", help="write (and --apply) a prefect.yaml of the same deployments for work pools"
    )
    for sub in (serve, deploy):
        sub.add_argument("config", help="pipeline YAML")
        sub.add_argument("--cron", default=None, help="the pipeline's schedule, e.g. '0 3 * * *'")
        sub.add_argument("--rerun-cron", default=None, help="the rerun flow's schedule (optional)")
        sub.add_argument(
            "--rerun-stage", choices=STAGES, default=None, help="stage a scheduled rerun runs"
        )
        sub.add_argument("--root", default=DEFAULT_ROOT, help="artifact store root")
        sub.add_argument("--name", default=None, help="deployment name (default: config's name)")
        sub.add_argument(
            "--set",
            dest="overrides",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="a default config override of every run, e.g. --set ingest.path=/data/logs",
        )
    deploy.add_argument("--pool", required=True, help="work pool the deployments run in")
    deploy.add_argument(
        "--out", default="prefect.yaml", help="where to write (default ./prefect.yaml)"
    )
    deploy.add_argument(
        "--apply", action="store_true", help="then run `prefect deploy --all` on it (needs the API)"
    )

    node = commands.add_parser(
        "node-worker",
        help="on a training node: serve that node's train runs (train.launcher: per_node, "
        "node_dispatch: workers), taken from the Prefect server at PREFECT_API_URL",
    )
    node.add_argument(
        "--node-rank", type=int, required=True, help="the node this machine is (0: master_addr)"
    )
    node.add_argument(
        "--root",
        required=True,
        help="the artifact root the flow uses; this worker serves node runs under it only",
    )

    ui = commands.add_parser("ui", help="start a local Prefect server (SQLite) and print its URL")
    ui.add_argument("--port", type=int, default=4200)

    models = commands.add_parser("models", help="the model registry: versions and champion")
    models.add_argument("--root", default=DEFAULT_ROOT, help="artifact store root")
    models.add_argument("--model", default="ctr", help="model name (export.model_name)")
    actions = models.add_subparsers(dest="action", required=True)
    actions.add_parser("list", help="every version, the champion marked")
    show = actions.add_parser(
        "show", help="one version: package, decision, weights and embedding table size"
    )
    show.add_argument("version", nargs="?", help="default: the champion")
    promote = actions.add_parser("promote", help="make a version the champion (by hand)")
    promote.add_argument("version")
    promote.add_argument("--reason", default="promoted by hand", help="kept in the history")
    rollback = actions.add_parser("rollback", help="make the previous champion the champion")
    rollback.add_argument("--reason", default="rollback", help="kept in the history")

    gc = commands.add_parser(
        "gc",
        help="delete what no kept run record, registry version or running flow needs; prints "
        "what it frees per category, in bytes",
    )
    gc.add_argument("root", help="artifact store root: a directory or an fsspec URL")
    gc.add_argument(
        "--keep-runs",
        type=int,
        default=10,
        metavar="N",
        help="keep the newest N run records and what they name (default 10), and every run "
        "record younger than --older-than",
    )
    gc.add_argument(
        "--older-than",
        default="7d",
        metavar="DURATION",
        help="delete nothing last written more recently than this: 30m, 12h, 7d (default 7d)",
    )
    gc.add_argument(
        "--lease-stale-after",
        default="90s",
        metavar="DURATION",
        help="a running flow's lease whose heartbeat is older than this is stale (default "
        "90s, three heartbeats)",
    )
    gc.add_argument("--dry-run", action="store_true", help="print what would go; delete nothing")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # Prefect's temporary server gets 20 s to start by default; on a busy 2-core machine
    # that is not always enough, and a run should not fail for it.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
    try:
        if args.command == "run":
            return _run(args)
        if args.command == "generate":
            return _generate(args)
        if args.command == "backfill":
            return _backfill(args)
        if args.command == "serve":
            return _serve(args)
        if args.command == "deploy":
            return _deploy(args)
        if args.command == "models":
            return _models(args)
        if args.command == "node-worker":
            return _node_worker(args)
        if args.command == "gc":
            return _gc(args)
        return _ui(args)
    except RecforgeError as err:
        # The last line is the message a person reads; the traceback only on request
        # (a failed flow's is in the Prefect log too).
        if getattr(args, "verbose", False):
            traceback.print_exc()
        print(f"recforge: error: {err}", file=sys.stderr)
        return 2


def _exit_on_sigterm(signum: int, frame: object) -> None:
    """SIGTERM (preemption, `kill`) as an orderly exit: `finally` blocks run.

    The train stage's then stops its ranks with SIGTERM, and they save a resume
    checkpoint before exiting; the rerun continues from it. Prefect records the run as
    crashed.
    """
    raise SystemExit(128 + signum)


def _node_worker(args: argparse.Namespace) -> int:
    """Serve node `--node-rank`'s train runs until interrupted (`tasks.train_nodes`)."""
    if not os.environ.get("PREFECT_API_URL"):
        raise ConfigError(
            "recforge node-worker: set PREFECT_API_URL to the Prefect server the flow runs "
            "against (its workers and the flow must share one)"
        )
    if args.node_rank < 0:
        raise ConfigError(f"--node-rank {args.node_rank}: a node rank is 0 or more")
    from artifacts.signing import HOW_TO_SET, KEY_BLOCK_ENV, keyring

    if not os.environ.get(KEY_BLOCK_ENV) and keyring() is None:
        # Node runs come from shared storage; without the run key nothing read from
        # there could be told from a forgery.
        raise ConfigError(f"recforge node-worker: no signing key; {HOW_TO_SET}")
    check_prefect_api("recforge node-worker")
    check_root(args.root)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    from tasks.train_nodes import serve_node_worker

    serve_node_worker(args.node_rank, args.root)
    return 0


def _run(args: argparse.Namespace) -> int:
    from flows.config import load_config

    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    if args.hostfile is not None:
        # A flag (where things run, docs/architecture.md); the train section carries it.
        args.overrides = [*args.overrides, f"train.hostfile={Path(args.hostfile).resolve()}"]

    # Validate before Prefect starts: a bad config or root fails in seconds, with no
    # retries and no Prefect log above the message.
    load_config(args.config, args.overrides)
    if args.root is not None:
        check_root(args.root)
    if args.dask is not None:
        check_dask_address(args.dask, insecure=args.dask_insecure)
    from flows.pipeline import RunParams, pipeline

    params = RunParams(
        config=args.config,
        root=args.root,
        from_stage=args.from_stage,
        only=args.only,
        force=args.force,
        overrides=args.overrides,
    )
    try:
        path = pipeline.with_options(task_runner=task_runner(args.workers, args.dask))(
            **params.model_dump()
        )
    except RecforgeError:
        raise
    except Exception as err:  # a failed flow: one line, not a traceback
        if args.verbose:
            traceback.print_exc()
        print(f"recforge: error: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    from artifacts.locations import read_text_or_none

    record = json.loads(read_text_or_none(path) or "{}")
    metrics = ", ".join(
        f"{k}={v:.4f}" for k, v in record["metrics"].items() if isinstance(v, float)
    )
    statuses = ", ".join(f"{stage}={info['status']}" for stage, info in record["stages"].items())
    print(f"stages: {statuses}")
    print(f"metrics: {metrics}")
    print(f"model: {record['model']}")
    print(path)
    return 0


def _backfill(args: argparse.Namespace) -> int:
    """`recforge backfill`: one pipeline run per day; prints each day's outcome."""
    from artifacts.locations import read_text_or_none
    from flows.config import backfill_days, backfill_overrides, load_config

    days = backfill_days(args.first, args.last)
    load_config(args.config, backfill_overrides(args.overrides, days[0]))
    check_root(args.root)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    from flows.pipeline import backfill

    records = backfill(args.config, args.first, args.last, args.root, args.overrides)
    for day, path in zip(days, records, strict=True):
        record = json.loads(read_text_or_none(path) or "{}")
        auc = record.get("metrics", {}).get("auc")
        print(
            f"{day.date()}: {record.get('status')}, "
            f"{record.get('promotion', {}).get('status', 'no gate')}, "
            f"auc={auc if auc is None else round(auc, 4)}, model={record.get('model')}"
        )
    for path in records:
        print(path)
    return 0


# How long `recforge node-worker` waits for the Prefect API to answer at start.
API_PROBE_TIMEOUT_S = 10.0


def check_prefect_api(who: str) -> None:
    """The Prefect API at PREFECT_API_URL answers an authenticated read, within seconds.

    Raises:
        ConfigError: It does not answer, or refuses this process's credentials; names
            the URL and the variables to check.
    """
    import httpx
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    try:
        with get_client(sync_client=True, httpx_settings={"timeout": API_PROBE_TIMEOUT_S}) as api:
            api.read_flows(limit=1)
    except (httpx.HTTPError, OSError) as err:
        status = getattr(getattr(err, "response", None), "status_code", None)
        why = (
            "refused this process's credentials (set PREFECT_API_AUTH_STRING to the "
            "server's user:password)"
            if status in (401, 403)
            else f"did not answer ({type(err).__name__}); check that PREFECT_API_URL is the "
            "server the flow uses and that this machine can reach it"
        )
        raise ConfigError(f"{who}: the Prefect API at {url} {why}") from None


# How long `recforge run` waits for an object-store root to answer before Prefect starts.
ROOT_PROBE_TIMEOUT_S = 5.0


def check_root(root: str) -> None:
    """The artifact root, checked before Prefect starts: its form, the run key, the store.

    Raises:
        ConfigError: A malformed or unknown URL (with a "did you mean" line), or a remote
            root without a signing key.
        StoreUnreachable: The bucket is missing, credentials are refused, or the endpoint
            does not answer within `ROOT_PROBE_TIMEOUT_S`.
    """
    from artifacts.signing import KEY_BLOCK_ENV
    from artifacts.store import ArtifactStore

    store = ArtifactStore(root)
    if not os.environ.get(KEY_BLOCK_ENV):  # a block needs Prefect: the plan task
        store.require_key()
    store.check_reachable(timeout_s=ROOT_PROBE_TIMEOUT_S)


def _models(args: argparse.Namespace) -> int:
    from artifacts.registry import Registry

    registry = Registry(args.root, args.model)
    if args.action == "list":
        versions = registry.versions()
        if not versions:
            print(f"no versions of {args.model!r} under {registry.url}")
            return 0
        for version in versions:
            blessed = {True: "blessed", False: "not blessed", None: "-"}[version.blessed]
            marker = "*" if version.champion else " "
            print(f"{marker} {version.name}  {version.created}  {blessed}  {version.path}")
        return 0
    if args.action == "show":
        name = args.version or registry.champion()
        if name is None:
            raise InputNotFoundError(f"{args.model!r} has no champion yet; name a version")
        path = registry.location(name)
        info = {
            "version": name,
            "path": str(path),
            "champion": name == registry.champion(),
            "decision": registry.decision(name),
            **_package_weights(registry, name),
        }
        print(json.dumps(info, indent=2))
        return 0
    before = registry.champion()
    if args.action == "promote":
        record = registry.promote(args.version, args.reason)
    else:
        record = registry.rollback(args.reason)
    print(f"champion of {args.model}: {record['version']} (was {before})")
    return 0


def _package_weights(registry: "Registry", version: str) -> dict:
    """What `models show` tells of a version's weights, from its signed manifest and
    its model_config.json (checked against it; the weights file itself is not read):

    - `weights_bytes`: the size of its `model.safetensors`;
    - `table` (CTR packages): the embedding table's `precision` (train.table_precision:
      the package keeps the rows at it), `rows`, `embedding_dim` and `bytes`.
    """
    from training.ctr.model import table_footprint
    from training.runtime.files import MODEL_CONFIG_FILE, WEIGHTS_FILE

    figures: dict = {}
    weights = registry.manifest(version)["files"].get(WEIGHTS_FILE)
    if weights is not None:
        figures["weights_bytes"] = weights["bytes"]
    model_config = registry.package_json(version, MODEL_CONFIG_FILE)
    if model_config is not None and "table_sizes" in model_config:  # a CTR model
        try:
            figures["table"] = table_footprint(model_config)
        except (KeyError, TypeError, ValueError) as err:
            raise ConfigError(
                f"{registry.model_name} {version}: its {MODEL_CONFIG_FILE} does not describe "
                f"an embedding table ({err}); export the version again"
            ) from err
    return figures


def _gc(args: argparse.Namespace) -> int:
    """`recforge gc ROOT`: collect the root's garbage (`artifacts.gc`), print the report."""
    from artifacts.gc import collect_garbage, parse_duration
    from artifacts.signing import KEY_BLOCK_ENV
    from artifacts.store import ArtifactStore

    older_than = parse_duration(args.older_than, "--older-than")
    stale_after = parse_duration(args.lease_stale_after, "--lease-stale-after")
    if args.keep_runs < 0:
        raise ConfigError(f"--keep-runs {args.keep_runs}: keep 0 or more run records")
    store = ArtifactStore(args.root)
    if store.remote:
        if os.environ.get(KEY_BLOCK_ENV):
            from tasks.common import load_run_key  # the key from a Prefect Secret block

            load_run_key(store)
        store.check_reachable(timeout_s=ROOT_PROBE_TIMEOUT_S)
    report = collect_garbage(
        args.root, args.keep_runs, older_than, dry_run=args.dry_run, stale_after_s=stale_after
    )
    print("\n".join(report.lines()))
    return 0


# Dask schedulers by how they are reached: TLS (the `distributed` security config), or
# plain sockets that neither encrypt nor authenticate (no scheme is tcp://).
SECURE_DASK_SCHEMES = ("tls", "wss")
PLAIN_DASK_SCHEMES = ("tcp", "ws", "ucx")


def check_dask_address(address: str, insecure: bool = False) -> None:
    """Refuse a `--dask` scheduler that would carry the run in the clear to another machine.

    Accepted: `local:N` (N >= 1), a `tls://` or `wss://` address, and a `tcp://`,
    `ws://` or `ucx://` address (or one without a scheme) on this machine's loopback. A
    plain one on another machine only with `insecure`, and then with a warning on stderr:
    whoever reaches an unauthenticated scheduler runs code on its workers, which hold the
    run key and the root's credentials.

    Args:
        address: The `--dask` value.
        insecure: `--dask-insecure`.

    Raises:
        ConfigError: Naming the address and what to pass instead.
    """
    import ipaddress
    from urllib.parse import urlsplit

    shown = repr(address[:200])
    if address.startswith("local:"):
        count = address.removeprefix("local:")
        if not (count.isdigit() and int(count) >= 1):
            raise ConfigError(f"--dask {shown}: local:N needs a number of workers N >= 1")
        return
    scheme, sep, _ = address.partition("://")
    scheme = scheme.lower() if sep else "tcp"
    if scheme in SECURE_DASK_SCHEMES:
        return
    if scheme not in PLAIN_DASK_SCHEMES:
        raise ConfigError(
            f"--dask {shown}: not a Dask scheduler address; pass tls://host:port (or "
            "tcp://127.0.0.1:port for one on this machine), or local:N"
        )
    try:
        host = urlsplit(address if sep else f"tcp://{address}").hostname or ""
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name, or a malformed port
        loopback = False
    if loopback:
        return
    if not insecure:
        raise ConfigError(
            f"--dask {shown}: a {scheme}:// scheduler on another machine neither encrypts "
            "nor authenticates, so whoever reaches it runs code on its workers (which "
            "hold the run key); use tls:// with the distributed security config "
            "(docs/security.md), or pass --dask-insecure on a network only you reach"
        )
    print(
        f"recforge: warning: --dask-insecure: sending the run to {shown} over plain "
        f"{scheme}:// (no encryption, no authentication)",
        file=sys.stderr,
    )


def task_runner(workers: int | None, dask: str | None):
    """Threads by default; a Dask cluster (prefect-dask) when asked for.

    A cluster at an address gets nothing from this process but the tasks: with an
    object-store root the ingest task first checks that every worker reaches the root
    and runs this code (`tasks.ingest.check_workers`) and that ingest.path is a URL.
    """
    if dask is None:
        from prefect.task_runners import ThreadPoolTaskRunner

        return ThreadPoolTaskRunner(max_workers=workers)
    from prefect_dask import DaskTaskRunner

    if dask.startswith("local:"):
        workers = int(dask.removeprefix("local:"))
        return DaskTaskRunner(
            cluster_kwargs={
                "n_workers": workers,
                "threads_per_worker": 1,
                "processes": True,
                "dashboard_address": None,
            }
        )
    return DaskTaskRunner(address=dask)


def _generate(args: argparse.Namespace) -> int:
    from artifacts.errors import ConfigError
    from data_prep.synthetic import generate_logs
    from flows.config import load_config

    config = load_config(args.config, args.overrides)
    if config.generate is None:
        raise ConfigError(f"{args.config} has no `generate` section to make data from.")
    result = generate_logs(config.generate)
    print(
        f"wrote {result.num_rows:,} rows ({result.num_malformed:,} malformed) to "
        f"{result.out_dir}; Bayes-optimal AUC {result.bayes_auc:.4f} "
        f"(test portion {result.bayes_auc_test:.4f})"
    )
    return 0


def _serve(args: argparse.Namespace) -> int:
    from flows.config import load_config

    # A bad config or override fails here, not in every scheduled run.
    config = load_config(args.config, args.overrides)
    from prefect import serve

    from flows.deploy import ALLOWED_ROOTS_ENV, allowed_roots
    from flows.pipeline import deployments

    name = args.name or config.name
    built = deployments(
        args.config,
        args.root,
        name,
        args.cron,
        args.rerun_cron,
        args.rerun_stage,
        args.overrides,
    )
    # The runs start in this process: pin their allowed roots to this command's, so
    # that editing the deployment's default root through the API cannot widen them.
    os.environ.setdefault(ALLOWED_ROOTS_ENV, ",".join(allowed_roots(args.root)))
    serve(*built)
    return 0


def _deploy(args: argparse.Namespace) -> int:
    from flows.config import load_config
    from flows.deploy import apply_prefect_yaml, write_prefect_yaml

    config = load_config(args.config, args.overrides)
    path = write_prefect_yaml(
        Path(args.out),
        args.config,
        args.root,
        args.name or config.name,
        args.pool,
        args.cron,
        args.rerun_cron,
        args.rerun_stage,
        args.overrides,
    )
    print(f"wrote {path}")
    if args.apply:
        return apply_prefect_yaml(path)
    print(f"apply it with: prefect --no-prompt deploy --all --prefect-file {path}")
    return 0


def _ui(args: argparse.Namespace) -> int:
    url = f"http://127.0.0.1:{args.port}"
    print(f"Prefect UI: {url}  (set PREFECT_API_URL={url}/api to send runs there)", flush=True)
    command = [
        sys.executable,
        "-m",
        "prefect",
        "server",
        "start",
        "--host",
        "127.0.0.1",
        "--port",
        str(args.port),
    ]
    # The UI asks the API at PREFECT_UI_API_URL, which defaults to port 4200 whatever
    # --port says: without this the UI on another port shows "Can't connect".
    env = {**os.environ, "PREFECT_UI_API_URL": f"{url}/api"}
    return subprocess.call(command, env=env)


if __name__ == "__main__":
    sys.exit(main())
