"""What a job says on stderr: narration (Log) and progress (Progress), one implementation
for generate, calibrate and bench.

stdout carries data only. A rich bar is drawn only when stderr is a terminal
(`Console(stderr=True)`, `redirect_stdout=False`); otherwise a plain line every
PLAIN_EVERY_S seconds; --quiet silences both.
"""

from __future__ import annotations

import os
import sys
import threading
import time

from rich.console import Console

#: Seconds between two plain progress lines when stderr is not a terminal.
PLAIN_EVERY_S = 10.0
#: Progress counted in records (generate, calibrate: with a token rate) or in runs (bench).
UNIT_RECORDS = "records"
UNIT_RUNS = "runs"
#: Progress counted in anything else (train-head: answer tokens collected, training steps).
UNIT_COUNT = "count"


def stderr_console() -> Console:
    return Console(stderr=True, highlight=False)


def who() -> str:
    """'marscli', or 'marscli (rank N)' in a process other than the main one of a launch."""
    rank = os.environ.get("RANK", "0")
    if os.environ.get("WORLD_SIZE", "1") not in ("", "1") and rank not in ("", "0"):
        return f"marscli (rank {rank})"
    return "marscli"


def silence_stdout() -> None:
    """The reader went away (e.g. `| head`): make the interpreter's final flush a no-op."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


class Log:
    """Narration on stderr; silent with --quiet."""

    def __init__(self, quiet: bool = False):
        self.quiet = quiet
        self.muted = False
        self.notes = not quiet
        self.console = stderr_console()

    def mute(self) -> None:
        """Processes other than the main one of a launch say nothing but errors and notes about
        their own records: the main process speaks for the run."""
        self.notes = not self.quiet
        self.quiet = self.muted = True

    def note(self, msg: str) -> None:
        """A note about one record, which only the process that ran it knows."""
        if self.notes:
            self.console.print(f"{who()}: {msg}", markup=False, soft_wrap=True)

    def info(self, msg: str) -> None:
        if not self.quiet:
            self.always(msg)

    def always(self, msg: str) -> None:
        """What the user must see even with --quiet (how to finish an interrupted run)."""
        if not self.muted:
            self.console.print(f"marscli: {msg}", markup=False, soft_wrap=True)


class Progress:
    """A rich bar on a terminal, a plain line every PLAIN_EVERY_S otherwise, nothing if quiet.

    generate and calibrate count records and tokens (`advance`, or `set` with a data-parallel
    run's summed counters); bench counts runs of a total it learns as it goes (`update`).
    """

    def __init__(self, log: Log, total: int | None = None, label: str = "generating",
                 unit: str = UNIT_RECORDS):
        self.log = log
        self.total = total
        self.unit = unit
        self.label = label
        self.done = 0
        self.tokens = 0
        self.t0 = self.last = time.perf_counter()
        self.bar = None
        self._lock = threading.Lock()
        if not log.quiet and log.console.is_terminal:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                TextColumn,
                TimeElapsedColumn,
            )
            from rich.progress import Progress as Bar

            columns = [TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
            if unit == UNIT_RECORDS:
                columns.append(TextColumn("{task.fields[rate]}"))
            self.bar = Bar(*columns, console=log.console, redirect_stdout=False,
                           redirect_stderr=False, transient=True)
            self.task = self.bar.add_task(label, total=total, rate="")
            self.bar.start()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def advance(self, tokens: int) -> None:
        self.set(self.done + 1, self.tokens + tokens)

    def set(self, done: int, tokens: int) -> None:
        """Absolute progress (a data-parallel run's counters, summed over its processes)."""
        with self._lock:
            self._show(done, tokens)

    def update(self, done: int, total: int) -> None:
        """Runs done out of a total (bench)."""
        with self._lock:
            self.total = total
            if self.bar is not None:
                self.bar.update(self.task, completed=done, total=total)
                self.done = done
            else:
                self._show(done, 0)

    def _show(self, done: int, tokens: int) -> None:
        advance = done - self.done
        if advance <= 0:
            return
        self.done = done
        self.tokens = tokens
        now = time.perf_counter()
        rate = self.tokens / max(now - self.t0, 1e-9)
        if self.bar is not None:
            self.bar.update(self.task, advance=advance, rate=f"{rate:.1f} tok/s")
        elif not self.log.quiet and now - self.last >= PLAIN_EVERY_S:
            self.last = now
            if self.unit == UNIT_RUNS:
                self.log.info(f"{self.done}/{self.total} runs, {now - self.t0:.0f} s")
            elif self.unit == UNIT_COUNT:
                self.log.info(f"{self.label} {self.done}/{self.total}, {now - self.t0:.0f} s")
            else:
                self.log.info(f"{self.done}/{self.total} records, {self.tokens} tokens, {rate:.1f} tok/s")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None
