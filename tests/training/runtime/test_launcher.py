"""The launcher's line loop, driven by a fake launcher: every line logged, records parsed."""

import json
import sys
from pathlib import Path

import pytest

from training.runtime.launcher import (
    ERROR_PREFIX,
    PROGRESS_PREFIX,
    RESUME_PREFIX,
    is_protocol_line,
    parse_record,
    run_launcher,
)

PROGRESS = {"step": 20, "total_steps": 40, "loss": 0.5, "samples_per_s": 100.0}
RESUME = {"step": 8, "checkpoint": "/ck/step-00000008", "from_world_size": 2}
ERROR = {"rank": 1, "error": "DataError: shard 3 is empty"}

# Prints what ranks print: their own text (stdout and stderr), the three kinds of record,
# and a record another rank's output broke; then fails as a crashed rank does.
FAKE_RANKS = f"""
import json, sys
print("hello from rank 0", flush=True)
print({PROGRESS_PREFIX!r} + json.dumps({PROGRESS!r}), flush=True)
print({RESUME_PREFIX!r} + json.dumps({RESUME!r}), flush=True)
print("a warning on stderr", file=sys.stderr, flush=True)
print("noise " + {PROGRESS_PREFIX!r} + '{{"step": 4', flush=True)
print({ERROR_PREFIX!r} + json.dumps({ERROR!r}), flush=True)
sys.exit(3)
"""


@pytest.mark.parametrize(
    ("line", "protocol"),
    [
        (PROGRESS_PREFIX + json.dumps(PROGRESS), True),
        (RESUME_PREFIX + json.dumps(RESUME), True),
        (ERROR_PREFIX + json.dumps(ERROR), True),
        ('noise RECFORGE_PROGRESS {"step": 4', True),
        ("[INFO] [launch.py:256:main] process 4242 spawned", False),
        ("RECFORGE_PROGRESS", False),  # the prefix ends with a space
        ("", False),
    ],
)
def test_protocol_lines_are_told_from_text_for_people(line, protocol):
    assert is_protocol_line(line) is protocol


def test_a_record_parses_wherever_it_starts_and_a_broken_one_is_none():
    assert parse_record("noise " + RESUME_PREFIX + json.dumps(RESUME), RESUME_PREFIX) == RESUME
    assert parse_record(RESUME_PREFIX + json.dumps(RESUME), PROGRESS_PREFIX) is None
    assert parse_record('RECFORGE_PROGRESS {"step": 4', PROGRESS_PREFIX) is None
    assert parse_record("RECFORGE_PROGRESS [1, 2]", PROGRESS_PREFIX) is None


def test_every_line_reaches_the_log_file_and_on_log_and_records_are_parsed(tmp_path: Path):
    command = [sys.executable, "-c", FAKE_RANKS, "--master_port", "0"]
    log_path = tmp_path / "launcher.log"
    lines: list[str] = []
    progress: list[dict] = []
    returncode, tail, rank_errors = run_launcher(
        command, None, log_path, lines.append, progress.append
    )
    assert returncode == 3
    assert progress == [PROGRESS]
    assert rank_errors == [ERROR]
    # The launcher log is the raw record: every line, protocol included, as on_log saw it.
    assert log_path.read_text().splitlines() == lines == tail
    assert len(lines) == 6
    assert [line for line in lines if not is_protocol_line(line)] == [
        "hello from rank 0",
        "a warning on stderr",
    ]
