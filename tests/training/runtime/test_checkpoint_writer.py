"""The background writer of asynchronous resume checkpoints: one save in flight, its
failure re-raised on the training thread, and a peer's failure ending rank 0's wait."""

import threading
import time
from pathlib import Path

import pytest

from training.runtime.rank import CheckpointChain, CheckpointWriter, done_marker


def test_a_save_due_while_one_is_writing_waits_for_it_and_says_so() -> None:
    lines: list[str] = []
    writer = CheckpointWriter(log=lines.append)
    release = threading.Event()
    writer.start(8, release.wait)
    threading.Timer(0.1, release.set).start()
    writer.wait(due_at=16)
    assert writer.waits == 1 and writer.wait_s > 0.05
    assert lines == [
        "checkpoint of step 16 is due while step 8's is still being written; waiting for "
        "it (at most one save is in flight)"
    ]
    writer.start(16, lambda: None)
    time.sleep(0.05)
    writer.wait(due_at=24)  # finished already: no wait counted
    assert writer.waits == 1 and writer.write_s_max >= 0.1


def test_a_failed_background_save_is_raised_on_the_training_thread() -> None:
    writer = CheckpointWriter(log=print)

    def fail() -> None:
        raise OSError("No space left on device")

    writer.start(8, fail)
    with pytest.raises(RuntimeError, match="step 8 failed: No space left on device"):
        writer.wait()
    writer.wait()  # raised once; nothing in flight now


def test_rank_0_stops_waiting_when_another_rank_failed_to_write(tmp_path: Path) -> None:
    writer = CheckpointWriter(log=print, poll_s=0.001)
    done = [done_marker(tmp_path, r) for r in range(2)]
    failed = [done_marker(tmp_path, r, failed=True) for r in range(2)]
    done[0].touch()
    failed[1].touch()
    with pytest.raises(RuntimeError, match=r"another rank's write failed \(.failed-rank-00001\)"):
        writer.await_files(done, failed)
    done[1].touch()
    failed[1].unlink()
    writer.await_files(done, failed)


@pytest.mark.parametrize(
    ("members", "dirty", "expected"),
    [
        ([], 1, False),  # the first checkpoint is a base
        ([0], 10, True),
        ([0], 51, False),  # more than half the table's 100 rows
        ([0, 30], 20, True),  # 50 rows in the chain: at the share
        ([0, 30], 21, False),
        ([0, 1, 1], 1, False),  # max_deltas 2 reached
    ],
)
def test_a_base_follows_the_deltas_limit_and_the_rows_share(
    members: list[int], dirty: int, expected: bool
) -> None:
    entries = [{"step": i, "files_sha256": "", "rows": r, "world_size": 1} for i, r in
               enumerate(members)]  # fmt: skip
    chain = CheckpointChain(max_deltas=2, rebase_share=0.5, members=entries)
    assert chain.next_is_delta(dirty, num_rows=100) is expected
