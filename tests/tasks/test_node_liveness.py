"""Liveness of per-node train runs: heartbeats, the lost-node verdict, failed attempts.

The verdict is the train task's, by its own clock: a node is lost when its signed
heartbeat number has not risen for the timeout. Someone who can write to the bucket
must not keep a dead node alive (a forged or replayed heartbeat) nor kill a live one.
"""

import json
import uuid
from pathlib import Path

import pytest

from artifacts.errors import ConfigError
from artifacts.signing import digest, keyring, place, sign
from training.config import TrainConfig
from training.runtime.nodes import (
    Liveness,
    NodeLost,
    NodeRunSpec,
    attempts_file,
    beat_interval_s,
    heartbeat_location,
    read_failed_attempts,
    read_heartbeat,
    record_failed_attempt,
    surviving_layout,
    write_heartbeat,
)

TIMEOUT_S = 30.0


@pytest.fixture
def exchange(tmp_path: Path) -> str:
    """An attempt's exchange on a local root."""
    where = tmp_path / "checkpoints" / "train" / ("a" * 64) / "exchange" / uuid.uuid4().hex
    where.mkdir(parents=True)
    return str(where)


def test_a_node_that_beats_is_alive_and_one_that_stops_is_lost_after_the_timeout(exchange):
    liveness = Liveness(exchange, TIMEOUT_S)
    liveness.started(1, now=0.0)
    assert liveness.lost(1, now=TIMEOUT_S - 1) is None  # silent, but not for long enough
    write_heartbeat(exchange, 1, 0)
    assert liveness.lost(1, now=TIMEOUT_S + 5) is None  # a new beat restarts the clock
    write_heartbeat(exchange, 1, 1)
    assert liveness.lost(1, now=50.0) is None
    lost = liveness.lost(1, now=50.0 + TIMEOUT_S)
    assert isinstance(lost, NodeLost)
    assert "node 1: lost, no heartbeat for 30 s" in str(lost)
    assert "its last heartbeat was #1" in str(lost)


def test_a_node_that_never_beats_is_lost_a_timeout_after_it_started(exchange):
    liveness = Liveness(exchange, TIMEOUT_S)
    liveness.started(0, now=100.0)
    assert liveness.lost(0, now=100.0 + TIMEOUT_S - 0.5) is None
    assert "it never beat" in str(liveness.lost(0, now=100.0 + TIMEOUT_S))


def test_a_replayed_heartbeat_does_not_keep_a_dead_node_alive(exchange):
    liveness = Liveness(exchange, TIMEOUT_S)
    liveness.started(1, now=0.0)
    write_heartbeat(exchange, 1, 7)
    assert liveness.lost(1, now=1.0) is None
    # The node died; someone rewrites its last heartbeat, byte for byte, again and again.
    text = Path(heartbeat_location(exchange, 1)).read_text()
    for now in (10.0, 20.0, 30.0):
        Path(heartbeat_location(exchange, 1)).write_text(text)
        assert liveness.lost(1, now=now) is None
    assert isinstance(liveness.lost(1, now=1.0 + TIMEOUT_S), NodeLost)


def test_a_forged_or_misplaced_heartbeat_counts_as_none(exchange, tmp_path, caplog):
    where = Path(heartbeat_location(exchange, 1))
    bound = place("heartbeat", attempt=exchange, node=1)
    # Without the key: a plausible record, badly signed.
    where.write_text(json.dumps({"seq": 99, "place": bound, "signature": "x"}))
    assert read_heartbeat(exchange, 1) is None
    # Signed with the key but node 0's, copied over node 1's: refused too.
    node_zero = place("heartbeat", attempt=exchange, node=0)
    where.write_text(json.dumps(sign({"seq": 99}, place=node_zero)))
    assert read_heartbeat(exchange, 1) is None
    # Another attempt's heartbeat of node 1.
    other = place("heartbeat", attempt=exchange + "0", node=1)
    where.write_text(json.dumps(sign({"seq": 99}, place=other)))
    assert read_heartbeat(exchange, 1) is None
    # Signed, but bound to no place (written before records were bound).
    unbound = {"exchange": exchange, "node": 1, "seq": 99}
    keys = keyring()
    signature = {"key_id": keys.key_id, "hmac": digest(keys.current, unbound)}
    where.write_text(json.dumps({**unbound, "signature": signature}))
    assert read_heartbeat(exchange, 1) is None
    write_heartbeat(exchange, 1, 3)
    assert read_heartbeat(exchange, 1) == 3
    # So the forged ones cannot keep a node alive either.
    liveness = Liveness(exchange, TIMEOUT_S)
    liveness.started(2, now=0.0)
    Path(heartbeat_location(exchange, 2)).write_text(
        json.dumps({"seq": 5, "place": place("heartbeat", attempt=exchange, node=2)})
    )
    assert isinstance(liveness.lost(2, now=TIMEOUT_S), NodeLost)


def test_the_beat_is_several_times_per_timeout_and_at_most_every_20_s():
    assert beat_interval_s(12.0) == 2.0
    assert beat_interval_s(120.0) == 20.0
    assert beat_interval_s(3600.0) == 20.0


def test_failed_attempts_are_kept_for_the_attempt_that_succeeds(tmp_path):
    work = tmp_path / "nodes" / "train" / "k"
    run = "flow-run-1"
    assert read_failed_attempts(work, run) == []
    lost = {1: "node 1: lost, no heartbeat"}
    record_failed_attempt(work, run, NodeLost("node 1: lost"), lost)
    record_failed_attempt(work, run, RuntimeError("store hiccup"), {})
    with attempts_file(work, run).open("a") as handle:
        handle.write('{"cut short')  # a crash while appending
    assert read_failed_attempts(work, "another-flow-run") == []  # a new run: every node
    first, second = read_failed_attempts(work, run)
    assert first["error"] == "NodeLost" and first["lost_nodes"] == [
        {"node": 1, "why": "node 1: lost, no heartbeat"}
    ]
    assert second["error"] == "RuntimeError" and second["lost_nodes"] == []
    assert first["at"].endswith("+00:00")


WORKERS = {"launcher": "per_node", "node_dispatch": "workers", "nodes": 3, "world_size": 6}


def lost(*nodes: int) -> list[dict]:
    return [{"lost_nodes": [{"node": node, "why": "no heartbeat"} for node in nodes]}]


def test_with_min_nodes_a_retry_goes_on_with_the_workers_that_are_left():
    config = TrainConfig(**WORKERS, min_nodes=2)
    smaller, workers, line = surviving_layout(config, lost(1))
    assert (smaller.nodes, smaller.world_size, smaller.node_ranks()) == (2, 4, 2)
    assert workers == [0, 2] and "without lost node(s) [1]" in line
    # Node 1 of this attempt is worker 2; worker 1 has no node in it.
    spec = NodeRunSpec(
        config=smaller, inputs={}, root="r", fp="k", exchange="e",
        hosts=[], port=1, workers=workers,
    )  # fmt: skip
    assert [spec.worker_of(node) for node in range(2)] == [0, 2]
    assert spec.node_of(2) == 1
    with pytest.raises(ConfigError, match="worker 1 has no node in this attempt"):
        spec.node_of(1)


@pytest.mark.parametrize(
    ("min_nodes", "gone", "why"),
    [
        (None, (1,), "waiting for every node again (lost before: [1])"),
        (2, (0,), "node 0 holds the rendezvous"),
        (3, (2,), "2 are left, fewer than train.min_nodes=3"),
    ],
)
def test_otherwise_the_retry_waits_for_every_node(min_nodes, gone, why):
    config = TrainConfig(**WORKERS, min_nodes=min_nodes)
    same, workers, line = surviving_layout(config, lost(*gone))
    assert same is config and workers is None and why in line
    assert surviving_layout(config, []) == (config, None, "")
