"""Exceptions that carry a one-line, user-facing message and an exit code.

The CLI prints `marscli: error: <message>` on stderr and exits with `exit_code`; nothing else
turns these into tracebacks.
"""

from __future__ import annotations

import signal

EXIT_OK = 0
EXIT_RUNTIME = 1
EXIT_USAGE = 2
EXIT_RECORDS_FAILED = 3
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143


class Stop(BaseException):
    """Raised by the SIGINT/SIGTERM handler of a generate run (marscli.jobs.generate) so one
    cleanup path saves every finished result. A BaseException, like KeyboardInterrupt, so
    `except Exception` in loaders and in the per-record error handling lets it through."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


#: The exit code of a run a signal stopped.
EXIT_FOR_SIGNAL = {signal.SIGINT: EXIT_INTERRUPTED, signal.SIGTERM: EXIT_TERMINATED}


class MarscliError(Exception):
    """Base class: a failure the user can act on, described in one line."""

    exit_code = EXIT_RUNTIME


class UsageError(MarscliError):
    """Bad command-line options, configuration or profile."""

    exit_code = EXIT_USAGE


class ModelLoadError(MarscliError):
    """A model or tokenizer could not be found or loaded."""

    exit_code = EXIT_USAGE


class VocabMismatchError(ModelLoadError):
    """Draft and target do not share a vocabulary."""


class InputError(MarscliError):
    """The input file as a whole is unusable (e.g. duplicate ids)."""

    exit_code = EXIT_USAGE


class OutputInUseError(UsageError):
    """Another run holds the output's lock (marscli.io.results.OutputLock)."""
