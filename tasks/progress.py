"""Terminal progress bars for long stage steps (rich)."""

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn


@contextmanager
def terminal_progress(description: str, total: float | None) -> Iterator[Callable[[float], None]]:
    """Show a bar while the block runs; yields ``advance_to(completed)``."""
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed:,.0f}"),
        TimeElapsedColumn(),
        transient=False,
    ) as progress:
        bar = progress.add_task(description, total=total)
        yield lambda completed: progress.update(bar, completed=completed)
