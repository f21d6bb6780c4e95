"""Exceptions that carry a one-line, user-facing message and an exit code.

The CLI prints `marscli: error: <message>` on stderr and exits with `exit_code`; nothing else
turns these into tracebacks.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_RUNTIME = 1
EXIT_USAGE = 2
EXIT_RECORDS_FAILED = 3
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143


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
