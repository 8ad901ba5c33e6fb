"""What people see of training: the human lines, their throttle, the bar's output, and
the train task's filter that keeps the ranks' machine records out of the log."""

import io
import logging

import pytest
from prefect.logging.handlers import PrefectConsoleHandler
from rich.console import Console
from rich.theme import Theme

from tasks.progress import (
    format_duration,
    format_progress_line,
    format_resume_line,
    terminal_progress,
    train_progress,
)
from tasks.train_nodes import log_launcher_line


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def record(step: int, total: int = 100, **fields: object) -> dict:
    return {
        "step": step,
        "total_steps": total,
        "loss": 0.5,
        "samples_per_s": 1000.0,
        "step_ms": {"data": 10.0, "dense": 40.0},
        **fields,
    }


@pytest.fixture
def log(caplog: pytest.LogCaptureFixture) -> logging.Logger:
    caplog.set_level(logging.INFO, logger="test-train")
    return logging.getLogger("test-train")


def quiet() -> Console:
    """A console that is not a terminal, as under CI or a Prefect worker."""
    return Console(file=io.StringIO(), force_terminal=False, width=120)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0s"),
        (-3, "0s"),
        (45.4, "45s"),
        (59.6, "1m00s"),
        (65, "1m05s"),
        (3599, "59m59s"),
        (3600, "1h00m"),
        (7380, "2h03m"),
        (100 * 3600 + 59, "100h00m"),
    ],
)
def test_durations_read_as_people_write_them(seconds, text):
    assert format_duration(seconds) == text


def test_the_progress_line_has_steps_percent_loss_throughput_and_eta():
    line = format_progress_line(
        {"step": 200, "total_steps": 1000, "loss": 0.451249, "samples_per_s": 1234.4}, 65.0
    )
    assert line == "train step 200/1,000 (20%) loss 0.4512 · 1,234 samples/s · ETA 1m05s"


def test_the_percent_is_rounded_down_and_an_unknown_eta_says_so():
    line = format_progress_line(
        {"step": 9999, "total_steps": 10000, "loss": 1.0, "samples_per_s": 12345678.9}, None
    )
    assert line == "train step 9,999/10,000 (99%) loss 1.0000 · 12,345,679 samples/s · ETA ?"


def test_the_resume_line_names_step_checkpoint_and_ranks():
    resume = {"step": 250, "checkpoint": "/ck/step-00000250", "from_world_size": 2}
    assert format_resume_line(resume) == (
        "train resumed at step 250 from /ck/step-00000250 (saved by 2 ranks)"
    )


def test_eta_is_the_launch_pace_so_far_and_the_ranks_step_time_before_that(log):
    clock = FakeClock()
    with train_progress(log, console=quiet(), clock=clock) as shown:
        # One record: no pace yet, the ranks' step time stands in (10 + 40 ms a step).
        assert shown.eta_seconds(record(20), clock()) == pytest.approx(80 * 0.05)
        # 20 more steps in 2 s: 0.1 s a step for the 60 left.
        clock.now += 2.0
        assert shown.eta_seconds(record(40), clock()) == pytest.approx(60 * 0.1)
        # The pace is measured from the first record, not the last window.
        clock.now += 6.0
        assert shown.eta_seconds(record(60), clock()) == pytest.approx(40 * 0.2)
        assert shown.eta_seconds(record(100), clock()) == 0.0


def test_eta_is_unknown_without_pace_or_step_time(log):
    with train_progress(log, console=quiet(), clock=FakeClock()) as shown:
        assert shown.eta_seconds(record(20, step_ms={}), 100.0) is None


def test_progress_lines_are_throttled_to_one_per_interval_plus_the_last(log, caplog):
    clock = FakeClock()
    with train_progress(log, console=quiet(), clock=clock) as shown:
        for step, at in [(10, 0.0), (20, 3.0), (30, 9.9), (40, 10.0), (50, 12.0), (100, 13.0)]:
            clock.now = 100.0 + at
            shown.on_progress(record(step))
    logged = [r.getMessage() for r in caplog.records]
    assert [line.split(" (")[0] for line in logged] == [
        "train step 10/100",
        "train step 40/100",
        "train step 100/100",
    ]
    # 30 steps in 10 s: 60 left at 1/3 s each.
    assert logged[1].endswith("ETA 20s") and logged[2].endswith("ETA 0s")


# The train task's on_log, here beside the progress lines it complements.
def test_protocol_lines_never_reach_the_log_and_rank_output_does(log, caplog):
    lines = [
        "[INFO] [launch.py:256:main] process 4242 spawned with command: ...",
        'RECFORGE_PROGRESS {"step": 20, "total_steps": 100, "loss": 0.5}',
        'RECFORGE_RESUME {"step": 8, "checkpoint": "/ck/step-00000008", "from_world_size": 2}',
        "rank 1: epoch 0 reader ready",
        # Another rank's output ran into a record, which then does not parse.
        'noise RECFORGE_PROGRESS {"step": 4',
        'RECFORGE_ERROR {"rank": 1, "error": "DataError: shard 3 is empty"}',
        "Traceback (most recent call last):",
    ]
    for line in lines:
        log_launcher_line(log, line)
    logged = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert logged == [
        (logging.INFO, lines[0]),
        (logging.INFO, "train resumed at step 8 from /ck/step-00000008 (saved by 2 ranks)"),
        (logging.INFO, lines[3]),
        (logging.WARNING, "train rank 1 failed: DataError: shard 3 is empty"),
        (logging.INFO, lines[6]),
    ]
    assert not any("RECFORGE_" in message for _, message in logged)


def test_off_a_terminal_the_bar_prints_its_final_state_once_as_plain_text(log):
    console = quiet()
    clock = FakeClock()
    with train_progress(log, console=console, clock=clock) as shown:
        for step in (20, 40, 60):
            clock.now += 1.0
            shown.on_progress(record(step, total=60))
    output = console.file.getvalue()
    assert "\x1b" not in output and "\r" not in output
    (line,) = output.splitlines()
    assert line.startswith("train ")
    assert line.endswith("60/60 steps loss 0.5000 1,000 samples/s ETA 0s")


def test_the_bar_draws_on_a_console_whose_theme_lacks_rich_styles(log):
    # Prefect's log console has its own theme without rich's bar.* and progress.* styles.
    console = Console(file=io.StringIO(), force_terminal=True, theme=Theme({}, inherit=False))
    with train_progress(log, console=console, clock=FakeClock()) as shown:
        shown.on_progress(record(100))
    assert "100/100 steps" in console.file.getvalue()


def test_bars_draw_on_prefects_log_console_so_log_lines_go_above_them(monkeypatch):
    stream = io.StringIO()
    monkeypatch.setattr(logging.getLogger(), "handlers", [PrefectConsoleHandler(stream=stream)])
    monkeypatch.setattr(logging.getLogger("prefect"), "handlers", [])
    with terminal_progress("shard rows", 10) as advance:
        advance(10)
    (line,) = stream.getvalue().splitlines()
    assert line.startswith("shard rows ") and " 10 " in line
