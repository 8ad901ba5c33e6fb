"""Progress for people: terminal bars for long stage steps (rich) and training's log lines.

Training's ranks report progress to the launcher as machine records
(`training.runtime.launcher`); `TrainProgress` turns the parsed records into a bar in the
terminal and a human line in the Prefect log. This module imports no library code: every
stage's task uses it, and a stage's fingerprint covers only what its own task imports.
"""

import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from prefect.logging.handlers import PrefectConsoleHandler
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.theme import Theme
from rich.themes import DEFAULT

# At most one progress line in the Prefect log per this many seconds (the first and the
# last step always get one). Time, not steps: train.log_every sets how finely the loss
# curve is recorded (the artifact table, TensorBoard) and can be every step, while people
# read at a steady pace whatever the step time; 10 s keeps a long run's log to a few
# lines a minute and still shows a stalled run within seconds.
LOG_INTERVAL_S = 10.0

# Prefect's console handler prints with its own theme, which lacks rich's bar styles.
_BAR_STYLES = Theme(
    {
        name: style
        for name, style in DEFAULT.styles.items()
        if name.startswith(("bar.", "progress."))
    },
    inherit=False,
)


def format_duration(seconds: float) -> str:
    """A duration as people read it: "45s", "1m05s", "2h03m"."""
    total = max(0, round(seconds))
    if total < 60:
        return f"{total}s"
    if total < 3600:
        return f"{total // 60}m{total % 60:02d}s"
    return f"{total // 3600}h{total % 3600 // 60:02d}m"


def format_progress_line(record: Mapping[str, Any], eta_s: float | None) -> str:
    """One human line for a progress record.

    Args:
        record: A `RECFORGE_PROGRESS` record (step, total_steps, loss, samples_per_s, ...).
        eta_s: Seconds left, None while unknown.

    Returns:
        E.g. "train step 200/1000 (20%) loss 0.4512 · 1,234 samples/s · ETA 1m05s".
    """
    step, total = int(record["step"]), int(record["total_steps"])
    # Rounded down: a run one step short of the end does not read "100%".
    percent = math.floor(100 * step / total) if total > 0 else 100
    eta = "?" if eta_s is None else format_duration(eta_s)
    return (
        f"train step {step:,}/{total:,} ({percent}%) loss {float(record['loss']):.4f} · "
        f"{float(record['samples_per_s']):,.0f} samples/s · ETA {eta}"
    )


def format_resume_line(record: Mapping[str, Any]) -> str:
    """One human line for a `RECFORGE_RESUME` record (step, checkpoint, from_world_size)."""
    line = f"train resumed at step {int(record['step']):,} from {record.get('checkpoint')}"
    if record.get("from_world_size") is not None:
        line += f" (saved by {record['from_world_size']} ranks)"
    return line


def _log_console() -> Console | None:
    """The console Prefect's log handler prints with, if one is installed.

    A bar drawn on another console is torn by every log line printed meanwhile (the line
    lands after the bar, the bar's next redraw is below it); on the same console rich
    prints the line above the bar.
    """
    for logger in (logging.getLogger("prefect"), logging.getLogger()):
        for handler in logger.handlers:
            if isinstance(handler, PrefectConsoleHandler):
                return handler.console
    return None


@contextmanager
def _bar(console: Console | None, *columns: Any) -> Iterator[Progress]:
    """A live progress display on `console` (default: Prefect's log console, else stdout).

    Off a terminal (CI, a Prefect worker) rich draws nothing while it runs and prints
    the final bar once, as one plain line.
    """
    console = console or _log_console()
    if console is None:
        with Progress(*columns) as progress:
            yield progress
        return
    with console.use_theme(_BAR_STYLES), Progress(*columns, console=console) as progress:
        yield progress


@contextmanager
def terminal_progress(description: str, total: float | None) -> Iterator[Callable[[float], None]]:
    """Show a bar while the block runs; yields ``advance_to(completed)``."""
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed:,.0f}"),
        TimeElapsedColumn(),
    )
    with _bar(None, *columns) as progress:
        bar = progress.add_task(description, total=total)
        yield lambda completed: progress.update(bar, completed=completed)


class TrainProgress:
    """What people see of a training launch's progress: a bar, and lines in the log.

    Pass `on_progress` to the train function: each record moves the bar, and at most
    every `LOG_INTERVAL_S` (and at the last step) one line goes to the log.

    Args:
        logger: Where the lines go (the Prefect run logger).
        progress: The bar's display.
        clock: Seconds, monotonic; the ETA and the log interval are measured with it.
        log_interval_s: Least seconds between two progress lines.
    """

    def __init__(
        self,
        logger: logging.Logger | logging.LoggerAdapter,
        progress: Progress,
        clock: Callable[[], float] = time.monotonic,
        log_interval_s: float = LOG_INTERVAL_S,
    ) -> None:
        self._logger = logger
        self._progress = progress
        self._bar = progress.add_task("train", total=None, steps="", loss="", speed="", eta="")
        self._clock = clock
        self._log_interval_s = log_interval_s
        # (step, time) of the first record of this launch: the ETA is this launch's
        # mean pace, which covers checkpoint saves and the launcher's own overhead.
        self._origin: tuple[int, float] | None = None
        self._last_logged: float | None = None

    def on_progress(self, record: Mapping[str, Any]) -> None:
        """Take one progress record: move the bar, and log a line when one is due."""
        now = self._clock()
        step, total = int(record["step"]), int(record["total_steps"])
        eta_s = self.eta_seconds(record, now)
        eta = "?" if eta_s is None else format_duration(eta_s)
        self._progress.update(
            self._bar,
            completed=step,
            total=total,
            steps=f"{step:,}/{total:,} steps",
            loss=f"loss {float(record['loss']):.4f}",
            speed=f"{float(record['samples_per_s']):,.0f} samples/s",
            eta=f"ETA {eta}",
        )
        due = self._last_logged is None or now - self._last_logged >= self._log_interval_s
        if due or step >= total:
            self._logger.info(format_progress_line(record, eta_s))
            self._last_logged = now

    def eta_seconds(self, record: Mapping[str, Any], now: float) -> float | None:
        """Seconds until the last step at this launch's pace so far, None if unknown.

        Before two records have arrived there is no pace yet; the ranks' own step time
        (`step_ms`, the sum of its phases) stands in for it.
        """
        step, total = int(record["step"]), int(record["total_steps"])
        if self._origin is None:
            self._origin = (step, now)
        first_step, first_time = self._origin
        if step > first_step:
            seconds_per_step = (now - first_time) / (step - first_step)
        else:
            step_ms = record.get("step_ms") or {}
            if not step_ms:
                return None
            seconds_per_step = sum(float(ms) for ms in step_ms.values()) / 1000.0
        return max(total - step, 0) * seconds_per_step


@contextmanager
def train_progress(
    logger: logging.Logger | logging.LoggerAdapter,
    console: Console | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> Iterator[TrainProgress]:
    """A training bar (steps, loss, samples/s, ETA) for the block; yields its `TrainProgress`.

    Args:
        logger: Where the human lines go (the Prefect run logger).
        console: Where the bar is drawn; default Prefect's log console, else stdout.
        clock: Seconds, monotonic (tests pass a fake one).
    """
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.fields[steps]}"),
        TextColumn("{task.fields[loss]}"),
        TextColumn("{task.fields[speed]}"),
        TextColumn("{task.fields[eta]}"),
    )
    with _bar(console, *columns) as progress:
        yield TrainProgress(logger, progress, clock)
