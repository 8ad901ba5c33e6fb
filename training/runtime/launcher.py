"""Rank launcher shared by every stage that runs DeepSpeed ranks.

Runs `deepspeed.launcher.runner` in its own process group, streams the ranks' output
(progress, resume and error records, which `is_protocol_line` tells from text for
people), reaps an earlier attempt's orphaned ranks, unlinks the shared-memory buffers
DeepSpeed's CPU ranks leave behind and turns the ranks' error reports into typed errors.
Every line is redacted (`redact_line`) before it reaches the launcher log, a caller or an
error message: DeepSpeed's pdsh runner prints the `export NAME=VALUE;` command it sends
every host, `.deepspeed_env` included.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from artifacts.errors import (
    ConfigError,
    DataError,
    DeterministicError,
    InputNotFoundError,
    TransientError,
)
from data_prep.errors import SchemaError
from training.errors import Preempted, TrainingCrashed
from training.runtime.files import (
    LAUNCH_FILE,
    LAUNCHER_LOG_FILE,
    SUMMARY_FILE,
    WEIGHTS_FILE,
)
from training.runtime.hosts import host_problem, not_a_host
from training.runtime.memory import MemoryPlan

# The machine protocol between the ranks and the launcher: one line, a prefix and a JSON
# object. Rank 0 prints a progress record every train.log_every steps and a resume record
# when it continues from a checkpoint; any rank prints an error record before it fails.
PROGRESS_PREFIX = "RECFORGE_PROGRESS "


ERROR_PREFIX = "RECFORGE_ERROR "


RESUME_PREFIX = "RECFORGE_RESUME "


PROTOCOL_PREFIXES = (PROGRESS_PREFIX, RESUME_PREFIX, ERROR_PREFIX)


# Fields that change how a run reports or saves, not what it computes: a retry may
# change them and still resume.
TRAIN_RANK_ERRORS: dict[str, type[DeterministicError]] = {
    "ConfigError": ConfigError,
    "DataError": DataError,
    "SchemaError": SchemaError,
    "CheckpointCorrupt": DataError,
}


_PREEMPTED = "Preempted"


_TAIL_LINES = 20


_KILL_GRACE_S = 10.0


# How long stopped ranks get before SIGKILL: with resume checkpoints on, SIGTERM makes
# them save one at their next step. DeepSpeed's launcher itself waits 30 s for its ranks
# once it gets SIGTERM.
_STOP_GRACE_S = 60.0


# DeepSpeed's CPU communication op maps one ~66 MiB tmpfs file per rank, named after
# the rendezvous address and port, and never unlinks it: every run would leak that much
# RAM until reboot (a test suite's runs fill /dev/shm and the OOM killer ends the job).
SHM_DIR = Path("/dev/shm")


# Fault injection for the chaos tests, read from the `env` a caller passes (never from
# this process's environment) into the launch spec's "chaos"; unset in real runs.
# "POINT@STEP": rank 0 SIGKILLs its launch while saving the checkpoint of step STEP, at
# POINT: "mid-file" (DeepSpeed's files and rank 0's embedding shard written, its
# rank-RRRRR.pt not yet; for an asynchronous delta, inside the background writer) or one of
# `artifacts.checkpoints.FAULT_POINTS`.
CHAOS_CHECKPOINT_FAULT = "RECFORGE_CHAOS_CHECKPOINT_FAULT"


# "rng", "reader" or both, comma-separated: resume without restoring them (the negative
# control that shows the resume test would catch a missing restore).
CHAOS_SKIP_RESTORE = "RECFORGE_CHAOS_SKIP_RESTORE"


# N: consolidate the sharded table in chunks of N rows instead of 64 MiB, so that a
# test's small table still has chunks for every rank to write (`training.runtime.consolidate`).
CHAOS_CONSOLIDATION_CHUNK_ROWS = "RECFORGE_CHAOS_CONSOLIDATION_CHUNK_ROWS"


_SHM_BUFFER = "deepspeed_allreduce_buffer"


# Environment variables whose values never reach a log: names holding one of these words
# (any case), and the named ones that hold none.
SECRET_NAME_WORDS = ("KEY", "SECRET", "TOKEN", "PASSWORD", "PASSWD", "CREDENTIAL")
SECRET_NAMES = frozenset({"PREFECT_API_AUTH_STRING", "PREFECT_SERVER_API_AUTH_STRING"})
REDACTED = "***"

# NAME=VALUE as DeepSpeed logs it (`export NAME=VALUE;`, `NAME=VALUE` per launch): the
# value runs to a space, ';' or the line's end, or is one quoted string.
_ASSIGNMENT = re.compile(r"""(?<!\w)([A-Za-z_][A-Za-z0-9_]*)=("[^"]*"|'[^']*'|[^\s;"']*)""")

# Values shorter than this are not searched for by value (a "1" would blank every digit).
_MIN_REDACTED_VALUE = 6


# The package root, put on the ranks' PYTHONPATH so they import this very `training`.
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class TrainResult:
    """What a training run produced.

    Attributes:
        out_dir: The output directory (weights in `out_dir / "model.safetensors"`).
        final_loss: Mean train loss over the last logging window, averaged over ranks.
        steps: Optimizer steps taken.
        samples_per_s: Training throughput over all ranks.
        seconds: Wall-clock seconds of the whole launch, process start-up included.
        step_ms: Mean milliseconds per step in each phase (data, lookup, dense,
            optimizer), averaged over ranks.
        memory_plan: The planner's per-rank memory estimate.
        resumed_from_step: The checkpoint step the run continued from, None if fresh.
        world_size: The ranks that trained.
        resumed_from_world_size: The ranks that wrote the checkpoint resumed from.
        startup_s: Rank 0's seconds from its process start to the first step, by phase
            (imports, rendezvous, table_init, engine, reader, resume); empty where the
            model family does not report it.
        table_precision: How the sharded embedding rows were stored (CTR models with
            embeddings: sharded); None where the run had no sharded table.
        comm_precision: How those rows and their gradients travelled between ranks;
            None where the run had no sharded table.
        wire_bytes_per_sample: Bytes all ranks sent each other per sample, by kind
            (total, ids, rows, row_grads, dense_allreduce); None where the model family
            does not count them.
    """

    out_dir: Path
    final_loss: float
    steps: int
    samples_per_s: float
    seconds: float
    step_ms: dict[str, float]
    memory_plan: MemoryPlan
    resumed_from_step: int | None = None
    world_size: int | None = None
    resumed_from_world_size: int | None = None
    startup_s: dict[str, float] = field(default_factory=dict)
    table_precision: str | None = None
    comm_precision: str | None = None
    wire_bytes_per_sample: dict[str, float] | None = None


def chaos_settings(env: Mapping[str, str]) -> dict[str, Any]:
    """The launch spec's "chaos" from the caller's `env` (see `CHAOS_CHECKPOINT_FAULT`)."""
    settings: dict[str, Any] = {}
    if env.get(CHAOS_CHECKPOINT_FAULT):
        settings["checkpoint_fault"] = env[CHAOS_CHECKPOINT_FAULT]
    if env.get(CHAOS_SKIP_RESTORE):
        settings["skip_restore"] = [s for s in env[CHAOS_SKIP_RESTORE].split(",") if s]
    if env.get(CHAOS_CONSOLIDATION_CHUNK_ROWS):
        settings["consolidation_chunk_rows"] = int(env[CHAOS_CONSOLIDATION_CHUNK_ROWS])
    return settings


@dataclass(frozen=True)
class NodeLaunch:
    """Where a launch on more than one node starts its ranks (DeepSpeed's launcher terms).

    Attributes:
        hostfile: DeepSpeed's hostfile (`host slots=N` lines); its first `nodes` hosts.
        nodes: Nodes the ranks run on.
        ranks_per_node: Ranks started on each node.
        master_addr: Node 0's address, the rendezvous.
        node_rank: launcher 'per_node': the node this call starts (`--no_ssh
            --node_rank`); None: launcher 'ssh' starts every node (pdsh over ssh).
        ssh_port: launcher 'ssh': the hosts' ssh port, None for 22.
        exchange: launcher 'per_node': the scratch URL through which nodes that share
            no disk trade checkpoint files (`training.runtime.exchange`); None: they
            share the checkpoint and output directories.
    """

    hostfile: Path
    nodes: int
    ranks_per_node: int
    master_addr: str
    node_rank: int | None = None
    ssh_port: int | None = None
    exchange: str | None = None

    def __post_init__(self) -> None:
        # It reaches the launcher's command line (and pdsh's remote shell command) as is.
        problem = host_problem(self.master_addr)
        if problem is not None:
            raise ConfigError(f"master_addr {not_a_host(self.master_addr, problem)}")


def is_secret_name(name: str) -> bool:
    """Whether an environment variable's value must never be logged (`SECRET_NAME_WORDS`)."""
    upper = name.upper()
    return upper in SECRET_NAMES or any(word in upper for word in SECRET_NAME_WORDS)


def redact_line(line: str, secrets: tuple[str, ...] = ()) -> str:
    """`line` with the value of every secret-looking `NAME=VALUE` and every one of
    `secrets` (the values of the launch environment's secret variables) replaced by ***.

    Args:
        line: A line of the launcher's or a rank's output.
        secrets: Values to blank wherever they appear (`secret_values`).
    """
    for value in secrets:
        line = line.replace(value, REDACTED)
    return _ASSIGNMENT.sub(
        lambda m: f"{m.group(1)}={REDACTED}" if is_secret_name(m.group(1)) else m.group(0), line
    )


def secret_values(env: Mapping[str, str]) -> tuple[str, ...]:
    """The values of `env`'s secret variables, longest first, for `redact_line`."""
    values = {v for k, v in env.items() if is_secret_name(k) and len(v) >= _MIN_REDACTED_VALUE}
    return tuple(sorted(values, key=len, reverse=True))


def launcher_command(
    python: str,
    world_size: int,
    master_port: int,
    module: str,
    spec_path: Path,
    node: NodeLaunch | None = None,
) -> list[str]:
    """The DeepSpeed launcher command that runs `module`.

    Without `node`: `world_size` ranks on this machine. With it: DeepSpeed's multi-node
    launch as its documentation gives it, over ssh (`--hostfile --master_addr`) or one
    node per call (`--no_ssh --node_rank=i`).
    """
    command = [python, "-m", "deepspeed.launcher.runner"]
    if node is None:
        command += ["--num_gpus", str(world_size)]
    else:
        command += [
            "--hostfile",
            str(node.hostfile),
            "--num_nodes",
            str(node.nodes),
            "--num_gpus",
            str(node.ranks_per_node),
            "--master_addr",
            node.master_addr,
        ]
        if node.node_rank is None:
            command += ["--launcher", "pdsh"]
            if node.ssh_port is not None:
                command += ["--ssh_port", str(node.ssh_port)]
        else:
            command += ["--no_ssh", "--node_rank", str(node.node_rank)]
    return [*command, "--master_port", str(master_port), "--module", module, str(spec_path)]


def launch_ranks(
    command: list[str],
    env: dict[str, str],
    out_dir: Path,
    on_log: Callable[[str], None] | None,
    on_progress: Callable[[dict[str, Any]], None] | None,
    owner_file: Path | None = None,
    collects: bool = True,
    stop: threading.Event | None = None,
) -> dict[str, Any] | None:
    """Run the launcher, streaming its output, and return the ranks' train summary.

    `collects` False (a node other than node 0 of a per-node launch): the ranks write
    no summary here; None is returned once they exit 0. Setting `stop` stops the ranks.

    Raises:
        TrainingCrashed: The launcher or a rank exited non-zero (with the ranks' error
            reports and the last lines), or it exited 0 without the summary and weights.
    """
    returncode, tail, rank_errors = run_launcher(
        command, env, out_dir / LAUNCHER_LOG_FILE, on_log, on_progress, owner_file, stop
    )
    if returncode != 0:
        errors = "".join(
            f"\n  rank {report.get('rank')}: {report.get('error')}" for report in rank_errors
        )
        # A rank that refused its input (config, data, checkpoint) fails the same way on
        # every retry: report it as deterministic, not as a crash.
        for report in rank_errors:
            kind, _, message = str(report.get("error", "")).partition(": ")
            if kind in TRAIN_RANK_ERRORS:
                raise TRAIN_RANK_ERRORS[kind](
                    f"rank {report.get('rank')}: {message} (log: {out_dir / LAUNCHER_LOG_FILE})"
                )
        preempted = [r for r in rank_errors if str(r.get("error", "")).startswith(_PREEMPTED)]
        if preempted:
            _, _, message = str(preempted[0]["error"]).partition(": ")
            raise Preempted(f"rank {preempted[0].get('rank')}: {message}; a retry resumes there")
        raise TrainingCrashed(
            f"DeepSpeed launcher exited with code {returncode} (log: "
            f"{out_dir / LAUNCHER_LOG_FILE}); rank errors, first one first:"
            f"{errors or ' none reported'}\nlast lines:\n" + "\n".join(tail)
        )
    if not collects:
        return None
    summary_path = out_dir / SUMMARY_FILE
    if not summary_path.is_file() or not (out_dir / WEIGHTS_FILE).is_file():
        raise TrainingCrashed(
            f"the launcher exited 0 but {summary_path} or {out_dir / WEIGHTS_FILE} is "
            "missing; last lines:\n" + "\n".join(tail)
        )
    return json.loads(summary_path.read_text())


def launcher_env(env: Mapping[str, str], accelerator: str) -> dict[str, str]:
    """The caller's environment plus what the launcher and ranks need."""
    launch_env = dict(env)
    if accelerator == "cpu":
        launch_env["DS_ACCELERATOR"] = "cpu"
    elif accelerator != "cuda":
        raise ConfigError(f"accelerator must be 'cpu' or 'cuda', got {accelerator!r}")
    paths = [str(_PACKAGE_ROOT), *filter(None, launch_env.get("PYTHONPATH", "").split(":"))]
    launch_env["PYTHONPATH"] = ":".join(dict.fromkeys(paths))
    # Progress lines must arrive while training runs, not when a buffer fills.
    launch_env["PYTHONUNBUFFERED"] = "1"
    # torch's CPU allocator backs allocations of 2 MB and more with transparent huge
    # pages: the sparse step's random row reads and writes into a GB-sized table miss
    # the TLB far less (the row update ~1.6x faster at 20M rows on this machine).
    # The caller's setting wins.
    launch_env.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    # Arrow's own allocator (mimalloc/jemalloc) keeps ~30 MB of freed decode buffers
    # per rank; the reader decodes ahead in small slices, where malloc returns them.
    launch_env.setdefault("ARROW_DEFAULT_MEMORY_POOL", "system")
    return launch_env


def run_launcher(
    command: list[str],
    env: dict[str, str] | None,
    log_path: Path,
    on_log: Callable[[str], None] | None,
    on_progress: Callable[[dict[str, Any]], None] | None,
    owner_file: Path | None = None,
    stop: threading.Event | None = None,
) -> tuple[int, list[str], list[dict[str, Any]]]:
    """Run the launcher in its own process group, streaming its merged output.

    `env` is the launcher's whole environment; None inherits this process's. Every line
    goes to `log_path` and to `on_log`, protocol records included (callers and tests read
    them there); a caller that shows the lines to people drops those with
    `is_protocol_line` and reads the records with `parse_record`. Lines, tail and error
    reports are redacted first (`redact_line`): no secret of the environment is kept.

    With `owner_file`, the ranks' process group is recorded there first, and whatever
    is left of the group an earlier attempt recorded is killed: when the process that
    ran the flow died, its ranks (in a session of their own) live on, and must not write
    into the checkpoints this attempt resumes from.

    Setting `stop` SIGTERMs the ranks' group (then SIGKILL after the grace), as Ctrl-C
    would: another node of the same run failed, and these ranks would wait for it.

    Returns:
        (exit code, the last output lines, the ranks' error reports in arrival order).
    """
    tail: deque[str] = deque(maxlen=_TAIL_LINES)
    rank_errors: list[dict[str, Any]] = []
    master_port = int(command[command.index("--master_port") + 1])
    secrets = secret_values(os.environ if env is None else env)
    if owner_file is not None:
        _reap_previous_ranks(owner_file)
    with log_path.open("w") as log_file:
        process = subprocess.Popen(
            command,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            bufsize=1,
            start_new_session=True,
        )
        if owner_file is not None:
            owner_file.parent.mkdir(parents=True, exist_ok=True)
            record = {"pgid": process.pid, "master_port": master_port}
            # By rename: a reader (the next attempt's reaper) never sees it half written.
            partial = owner_file.with_name(owner_file.name + ".tmp")
            partial.write_text(json.dumps(record) + "\n")
            os.replace(partial, owner_file)
        if stop is not None:
            threading.Thread(
                target=_stop_when_set, args=(stop, process), daemon=True, name="launcher-stop"
            ).start()
        try:
            assert process.stdout is not None  # stdout=PIPE above
            for raw_line in process.stdout:
                # Records parse from the line as printed (redacting inside their JSON
                # could break it); an error report's text is redacted on its own.
                line = redact_line(raw_line.rstrip("\n"), secrets)
                tail.append(line)
                log_file.write(line + "\n")
                log_file.flush()
                if on_log is not None:
                    on_log(line)
                if on_progress is not None:
                    progress = parse_record(raw_line, PROGRESS_PREFIX)
                    if progress is not None:
                        on_progress(progress)
                error = parse_record(raw_line, ERROR_PREFIX)
                if error is not None:
                    if isinstance(error.get("error"), str):
                        error["error"] = redact_line(error["error"], secrets)
                    rank_errors.append(error)
            returncode = process.wait()
        finally:
            # On success this only reaps stragglers; on an exception or Ctrl-C it stops
            # the launcher and every rank, which share the launcher's process group.
            _kill_group(process)
            release_shm_buffers(master_port)
    return returncode, list(tail), rank_errors


def _stop_when_set(stop: threading.Event, process: subprocess.Popen[str]) -> None:
    """SIGTERM the launcher's group once `stop` is set, unless it exited first."""
    while process.poll() is None:
        if stop.wait(timeout=1.0):
            try:
                os.killpg(process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass  # exited meanwhile
            return


def release_shm_buffers(master_port: int) -> list[Path]:
    """Unlink the shared-memory buffers DeepSpeed's ranks of `master_port` left behind.

    Call it once those ranks are gone (a live rank keeps its mapping, but a rank still
    starting up would not find its peers' buffers). Returns the files removed.
    """
    pattern = f"{_SHM_BUFFER}_{os.getuid()}_*_{master_port}_*"
    removed = []
    for path in SHM_DIR.glob(pattern):
        try:
            path.unlink()
        except FileNotFoundError:
            continue  # removed meanwhile
        removed.append(path)
    return removed


def _group_members(pgid: int) -> list[tuple[int, bytes]]:
    """(pid, command line) of the live (not zombie) processes in process group `pgid`."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue  # exited meanwhile
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append((int(stat.parent.name), cmdline))
    return members


def unmapped_shm_buffers(min_age_s: float = 60.0) -> list[Path]:
    """This user's DeepSpeed shared-memory buffers that no live process has mapped.

    A rank maps its buffer once it has written it (~66 MiB, which takes a moment) and
    keeps it mapped until it exits, so a buffer unmapped and older than `min_age_s` is
    a leftover of a finished or killed run, safe to unlink.
    """
    cutoff = time.time() - min_age_s
    buffers = set()
    for path in SHM_DIR.glob(f"{_SHM_BUFFER}_{os.getuid()}_*"):
        try:
            if path.stat().st_mtime < cutoff:
                buffers.add(path)
        except FileNotFoundError:
            continue  # removed meanwhile
    if not buffers:
        return []
    mapped = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:
            continue  # exited meanwhile, or not ours to read
        if _SHM_BUFFER in text:
            mapped.update(p for p in buffers if str(p) in text)
    return sorted(buffers - mapped)


def _reap_previous_ranks(owner_file: Path) -> None:
    """SIGKILL the process group an earlier attempt recorded, if any of it is alive.

    Only a group whose members run DeepSpeed (checked in /proc) is killed, so a reused
    group id of an unrelated process is left alone.
    """
    try:
        record = json.loads(owner_file.read_text())
        pgid = int(record["pgid"])
    except (OSError, ValueError, KeyError, TypeError):
        return  # no earlier attempt, or nothing usable recorded
    try:
        _kill_recorded_group(pgid)
    finally:
        if isinstance(record.get("master_port"), int):
            release_shm_buffers(record["master_port"])


def _kill_recorded_group(pgid: int) -> None:
    """SIGKILL process group `pgid` if DeepSpeed ranks are in it, and wait for them."""
    ours = (b"deepspeed", b"training.")
    members = [pid for pid, cmdline in _group_members(pgid) if any(m in cmdline for m in ours)]
    if not members:
        return
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + _KILL_GRACE_S
    while time.monotonic() < deadline and any(Path(f"/proc/{pid}").exists() for pid in members):
        time.sleep(0.1)


def is_protocol_line(line: str) -> bool:
    """Whether `line` is (or holds) a machine record rather than text for people.

    Found anywhere in the line, as `parse_record` finds it: another rank's output can run
    into a record, and even an unparsable record is not for people (the launcher log
    keeps it).
    """
    return any(prefix in line for prefix in PROTOCOL_PREFIXES)


def parse_record(line: str, prefix: str) -> dict[str, Any] | None:
    """The JSON object after `prefix` in a line, or None.

    Args:
        line: One output line of the launcher or a rank.
        prefix: `PROGRESS_PREFIX`, `RESUME_PREFIX` or `ERROR_PREFIX`.

    Returns:
        The record, or None if the line holds no such record or it does not parse.
    """
    start = line.find(prefix)
    if start < 0:
        return None
    try:
        record = json.loads(line[start + len(prefix) :])
    except json.JSONDecodeError:
        # Another rank's output can interleave with a record line; skip it.
        return None
    return record if isinstance(record, dict) else None


def _kill_group(process: subprocess.Popen[str]) -> None:
    """SIGTERM the launcher's process group, then SIGKILL whatever is left of it.

    The whole group gets the grace, not only the launcher: ranks that checkpoint on
    SIGTERM outlive the launcher's own exit.
    """
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        process.wait()
        return  # the group is empty: nothing left to stop
    deadline = time.monotonic() + _STOP_GRACE_S
    while time.monotonic() < deadline and _group_members(process.pid):
        time.sleep(0.1)
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # every member exited on SIGTERM
    process.wait()


# Fault injection for the chaos tests, read from the `env` a caller passes (never from
# this process's environment) into the launch spec's "chaos"; unset in real runs.
# "R": rank R SIGKILLs itself before scoring, as the out-of-memory killer would.
CHAOS_KILL_RANK = "RECFORGE_CHAOS_EVALUATE_KILL_RANK"


# A rank's error that fails the same way on every retry comes back as its own type; any
# other failure of the ranks (one killed, a peer's broken connection) is transient.
EVALUATE_RANK_ERRORS: dict[str, type[Exception]] = {
    "ConfigError": ConfigError,
    "DataError": DataError,
    "InputNotFoundError": InputNotFoundError,
    "SchemaError": SchemaError,
    "ValueError": ValueError,
}


def launch_evaluate_ranks(
    spec: dict[str, Any],
    world_size: int,
    result_file: Path,
    module: str,
    deterministic: Mapping[str, type[Exception]],
    doing: str,
    advice: str,
    env: dict[str, str] | None,
    master_port: int,
    python: str,
    on_log: Callable[[str], None] | None,
    chaos: dict[str, Any],
) -> Path:
    """Run an evaluate rank module under the launcher; the result file rank 0 wrote.

    Shared by the CTR and the sequence evaluation. The launch spec (`spec` plus
    `world_size`, `result_file` and `chaos`) and the launcher's log go next to
    `result_file`; an earlier call's result is removed first, never taken for this one's.

    Args:
        doing: What the ranks do, for messages ("scoring split 'test' of DIR").
        advice: The other field to lower when a rank dies (besides evaluate.workers).

    Raises:
        One of `deterministic`'s types: A rank refused its input (the message names the
            rank and the launcher log).
        TransientError: A rank died, or the launcher failed or left no result.
    """
    ranks_dir = result_file.parent
    ranks_dir.mkdir(parents=True, exist_ok=True)
    result_file.unlink(missing_ok=True)
    spec = {
        **spec,
        "world_size": world_size,
        "result_file": str(result_file.resolve()),
        "chaos": chaos,
    }
    spec_path = ranks_dir / LAUNCH_FILE
    spec_path.write_text(json.dumps(spec, indent=2, sort_keys=True) + "\n")
    command = launcher_command(python, world_size, master_port, module, spec_path)
    log_path = ranks_dir / LAUNCHER_LOG_FILE
    returncode, tail, rank_errors = run_launcher(command, env, log_path, on_log, None)
    if returncode != 0:
        for report in rank_errors:
            kind, _, message = str(report.get("error", "")).partition(": ")
            if kind in deterministic:
                raise deterministic[kind](
                    f"evaluate rank {report.get('rank')} of {world_size}: {message} "
                    f"(log: {log_path})"
                )
        errors = "".join(
            f"\n  rank {report.get('rank')}: {report.get('error')}" for report in rank_errors
        )
        raise TransientError(
            f"an evaluate rank died while {doing} (launcher exit code {returncode}: killed, "
            f"or out of memory); lower evaluate.workers or {advice}. Log: {log_path}; rank "
            f"errors, first one first:{errors or ' none reported'}\nlast lines:\n" + "\n".join(tail)
        )
    if not result_file.is_file():
        raise TransientError(
            f"the evaluate launcher exited 0 but rank 0 wrote no {result_file} while "
            f"{doing}; log: {log_path}, last lines:\n" + "\n".join(tail)
        )
    return result_file


def evaluate_chaos_settings(env: Mapping[str, str]) -> dict[str, Any]:
    """The launch spec's "chaos" from the caller's `env` (see `CHAOS_KILL_RANK`)."""
    setting = env.get(CHAOS_KILL_RANK, "")
    if not setting:
        return {}
    if not setting.isdigit():
        raise ConfigError(f"{CHAOS_KILL_RANK}={setting!r}: expected a rank number")
    return {"kill_rank": int(setting)}


def free_port() -> int:
    """A TCP port that is free right now, for the ranks' rendezvous."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
