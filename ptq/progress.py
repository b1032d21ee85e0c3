"""Progress bars for long work (model passes over windows), on stderr so stdout stays clean."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

stderr = Console(stderr=True)
QUIET = False  # set by the CLI's --quiet
# notes said once the command has run (ptq.cli.main): before a user mistake's one-line error they
# would make it two
NOTES: list[str] = []


def note_at_end(text: str) -> None:
    NOTES.append(text)


def print_notes() -> None:
    for text in NOTES:
        stderr.print(f"note: {text}", highlight=False, soft_wrap=True)
    NOTES.clear()


@contextmanager
def progress(
    description: str, total: int, tokens_per_step: int = 0
) -> Iterator[Callable[[int], None]]:
    """Yield `advance(steps)`; shows steps done, tokens/s (with tokens_per_step) and time left."""
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn()]
    if tokens_per_step:
        columns.append(TextColumn("{task.fields[rate]}"))
    columns += [TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn()]
    with Progress(*columns, console=stderr, disable=QUIET, transient=False) as bar:
        task = bar.add_task(description, total=total, rate="")

        def advance(steps: int = 1) -> None:
            bar.advance(task, steps)
            t = bar.tasks[task]
            if tokens_per_step and t.elapsed:
                bar.update(task, rate=f"{t.completed * tokens_per_step / t.elapsed:,.0f} tok/s")

        yield advance
