"""Preemption's per-step agreement: SIGTERM on any rank, and rank 0's checkpoint timer."""

import json
import os
import signal
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from training.runtime.rank import Preemption

EVERY_S = 10.0
STEPS = 8
# Rank 0's clock at each step (4 s a step); rank 1's runs far ahead and must not count.
CLOCKS = {0: 4.0, 1: 1000.0}
TERM_AT = {1: 7}  # rank 1 is sent SIGTERM before step 7


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _rank_main(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    now = [0.0]
    timed = Preemption(torch.device("cpu"), EVERY_S, clock=lambda: now[0])
    decisions = []
    for step in range(1, STEPS + 1):
        now[0] = CLOCKS[rank] * step
        if TERM_AT.get(rank) == step:
            os.kill(os.getpid(), signal.SIGTERM)  # the handler only sets a flag
        decision = timed.agreed()
        if decision.timed:
            timed.saved()
        decisions.append([decision.stop, decision.timed])
    untimed = Preemption(torch.device("cpu"), 0.0, clock=lambda: now[0])
    now[0] = 1e9
    decisions.append([untimed.agreed().timed])
    Path(out, f"rank{rank}.json").write_text(json.dumps(decisions))
    dist.destroy_process_group()


@pytest.mark.slow
def test_every_rank_takes_rank_0s_timer_and_any_ranks_sigterm_at_the_same_step(
    tmp_path: Path,
) -> None:
    # Fresh interpreters, not forks (see tests/training/ctr/test_embedding.py).
    context = mp.get_context("spawn")
    port = _free_port()
    processes = [
        context.Process(target=_rank_main, args=(rank, port, str(tmp_path))) for rank in range(2)
    ]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=120)
        assert process.exitcode == 0
    zero, one = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert zero == one
    # Rank 0 saw 12 s at step 3, then 12 s after that save at step 6; SIGTERM from step 7.
    expected = [[step >= 7, step in (3, 6)] for step in range(1, STEPS + 1)]
    assert zero[:STEPS] == expected
    assert zero[STEPS] == [False]  # checkpoint_every_s 0: never timed
