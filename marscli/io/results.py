"""Results out: JSONL lines in input order, files replaced atomically, part files and merging.

`ResultWriter` writes one line per finished record, in input order, flushed as it is written,
so an interrupted run leaves a clean, ordered prefix; a result that finished ahead of an
earlier one is also journalled at once in a held file beside the output, so a killed run
loses none of its finished results. `atomic_file` / `atomic_write_text`
replace a file whole (profiles, reports, sidecars, merged outputs). `scan_output` reads back
what a writer wrote (which ids are done, where each line sits) for --resume and for
`merge_results`, which puts the part files of a data-parallel run into one output in input
order. `OutputLock` keeps a second run off an output for the whole of a run.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import json
import os
import re
import socket
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, BinaryIO, TextIO

from marscli.config import RecordError, Request
from marscli.errors import MarscliError, OutputInUseError, UsageError
from marscli.io.records import json_type

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: runs go unlocked
    fcntl = None  # type: ignore[assignment]

# --------------------------------------------------------------------------------------------
# Writing in input order


def dump_json_line(obj: Any) -> str:
    """One JSONL line (no newline): UTF-8 text, keys in insertion order, no NaN/Infinity."""
    return json.dumps(obj, ensure_ascii=False, separators=(", ", ": "), allow_nan=False)


class ResultWriter:
    """Writes results as JSONL in input order, whatever order they arrive in.

    ``write(index, result)`` buffers a result until every lower index (from ``start_index``)
    has been written or is in ``skip`` (indices already present in the output when resuming),
    then emits it and flushes, so an interrupted run leaves a clean, ordered prefix.

    ``held``: a file (`held_path(output)`) to which a result that has to wait behind a gap is
    appended and flushed the moment it arrives. Batched decoding finishes records out of
    order; without the journal a killed run (SIGKILL, the end of a session) would lose every
    finished result still waiting for a slower, earlier record. The held file has the part
    file's form (`find_parts` lists it), so --resume counts its ids as done and merges them
    in; a run that ends with nothing pending has emitted all of them, and its owner removes
    the file (`RunOutput.finish`).

    A closed pipe on the output (``marscli run ... | head``) sets ``broken_pipe`` and silences
    later writes instead of raising; the CLI checks the flag and exits quietly. (Python may
    still complain when it flushes ``sys.stdout`` at exit; the CLI should point stdout at
    os.devnull then, as the Python docs on SIGPIPE advise.)
    """

    def __init__(
        self,
        dest: str | os.PathLike | TextIO | None,
        *,
        append: bool = False,
        start_index: int = 0,
        skip: Iterable[int] = (),
        held: str | os.PathLike | None = None,
    ) -> None:
        self.broken_pipe = False
        self._held_path = None if held is None else os.fspath(held)
        self._held: TextIO | None = None
        self.written = 0
        self._pending: dict[int, dict] = {}
        self._skip = frozenset(skip)
        self._closed = False
        if dest is None or (isinstance(dest, (str, os.PathLike)) and os.fspath(dest) == "-"):
            self._stream: TextIO = sys.stdout
            self._owned = False
        elif isinstance(dest, (str, os.PathLike)):
            path = os.fspath(dest)
            try:
                # newline="" keeps "\n" line ends on every platform.
                self._stream = open(  # noqa: SIM115 - closed in close()
                    path, "a" if append else "w", encoding="utf-8", newline=""
                )
            except OSError as e:
                raise MarscliError(
                    f"cannot write output file {path}: {e.strerror or e}"
                ) from None
            self._owned = True
        else:
            self._stream = dest
            self._owned = False
        self._next = start_index
        self._advance_over_skipped()

    @property
    def next_index(self) -> int:
        """The index the writer waits for next."""
        return self._next

    @property
    def pending(self) -> list[int]:
        """Indices buffered behind a gap, in order."""
        return sorted(self._pending)

    def write(self, index: int, result: dict) -> None:
        """Queue `result` for input position `index`; emit whatever is now in order."""
        if self._closed:
            raise ValueError("ResultWriter is closed")
        if self.broken_pipe:
            return
        if index < self._next or index in self._pending or index in self._skip:
            raise ValueError(f"result index {index} was already written or skipped")
        self._pending[index] = result
        if index != self._next and self._held_path is not None:
            self._journal(result)
        while self._next in self._pending and not self.broken_pipe:
            self._emit(self._pending.pop(self._next))
            self._next += 1
            self._advance_over_skipped()

    def _journal(self, result: dict) -> None:
        """Append a result that waits behind a gap to the held file, flushed."""
        assert self._held_path is not None
        try:
            if self._held is None:
                self._held = open(self._held_path, "a", encoding="utf-8", newline="")  # noqa: SIM115
            self._held.write(dump_json_line(result) + "\n")
            self._held.flush()
        except OSError as e:
            raise MarscliError(f"cannot write {self._held_path}: {e.strerror or e}") from None

    def _advance_over_skipped(self) -> None:
        while self._next in self._skip:
            self._next += 1

    def _emit(self, result: dict) -> None:
        line = dump_json_line(result) + "\n"
        try:
            self._stream.write(line)
            self._stream.flush()
        except BrokenPipeError:
            self.broken_pipe = True
            return
        except OSError as e:  # disk full, I/O error: what is flushed stays, resumable
            raise MarscliError(f"cannot write results: {e.strerror or e}") from None
        self.written += 1

    def close(self, *, strict: bool = False, total: int | None = None) -> None:
        """Flush and release the output.

        Results stuck behind a gap are NOT written to the output (it stays an ordered prefix);
        see `pending`; they are in the held file, when there is one. With ``strict=True`` a
        gap raises RuntimeError: indices below the highest buffered one, or below `total`
        when given, that never arrived.
        """
        if self._closed:
            return
        self._closed = True
        if self._held is not None:
            try:
                self._held.flush()
                os.fsync(self._held.fileno())
            except OSError:
                pass
            finally:
                self._held.close()
        try:
            if not self.broken_pipe:
                try:
                    self._stream.flush()
                except BrokenPipeError:
                    self.broken_pipe = True
        finally:
            if self._owned:
                try:
                    # Flushed lines survive a killed process; fsync makes them survive a
                    # crash of the machine too, once per run rather than once per line.
                    os.fsync(self._stream.fileno())
                except OSError:
                    pass
                try:
                    self._stream.close()
                except BrokenPipeError:
                    self.broken_pipe = True
        if strict and not self.broken_pipe:
            end = max([*self._pending, (total or 0) - 1], default=-1) + 1
            missing = [i for i in range(self._next, end) if i not in self._pending
                       and i not in self._skip]
            if missing:
                shown = ", ".join(map(str, missing[:10])) + (" ..." if len(missing) > 10 else "")
                raise RuntimeError(f"results missing for indices {shown}")

    def __enter__(self) -> ResultWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write `text` (UTF-8) to `path` so readers see the old file or the new one, never half."""
    if not isinstance(text, str):
        raise TypeError(f"atomic_write_text needs str, got {type(text).__name__}")
    with atomic_file(path) as f:
        f.write(text.encode("utf-8"))


def usual_file_mode() -> int:
    """The mode open() gives a new file under the process's umask (0o666 & ~umask): for files
    written through a temp file or by a library that makes them 0600 (safetensors)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """A binary file that replaces `path` when the block ends without an error.

    The temp file sits in the same directory (os.replace must not cross filesystems) and is
    removed if anything fails. The new file keeps the old one's permissions, or gets the
    usual umask-based ones (tempfile alone would leave it 0600).
    """
    path = os.fspath(path)
    directory, name = os.path.split(os.path.abspath(path))
    try:
        mode = os.stat(path).st_mode & 0o7777
    except FileNotFoundError:
        mode = usual_file_mode()
    tmp = tempfile.NamedTemporaryFile(  # noqa: SIM115 - closed below
        "wb", delete=False, dir=directory, prefix=f".{name}.", suffix=".tmp",
    )
    try:
        with tmp:
            yield tmp  # type: ignore[misc]
            tmp.flush()
            os.fsync(tmp.fileno())
        os.chmod(tmp.name, mode)
        os.replace(tmp.name, path)
    except BaseException:
        try:
            os.unlink(tmp.name)
        except OSError:
            pass
        raise


# --------------------------------------------------------------------------------------------
# Reading results back: what an existing output (or part file) already holds


@dataclass
class OutputScan:
    """What an existing results file already holds."""

    done: dict[str, bool] = field(default_factory=dict)  # id -> its result carries an error
    keep_bytes: int = 0  # length of the prefix made of complete lines
    torn_bytes: int = 0  # bytes after it: a last line cut short by a crash, dropped on resume
    spans: dict[str, tuple[int, int]] = field(default_factory=dict)  # id -> (offset, length)


def scan_output(path: str | os.PathLike) -> OutputScan:
    """Read an existing results file for --resume; UsageError if it is not one marscli wrote.

    Only newline-terminated lines count: results are written a line at a time, so a crash can
    tear the last line only. A complete line that is not a result with an id, or an id seen
    twice, means the file was changed by hand (or is another file): refuse rather than guess.
    """
    path = os.fspath(path)
    scan = OutputScan()
    try:
        fh = open(path, "rb")  # noqa: SIM115 - closed below
    except OSError as e:
        raise UsageError(f"cannot read {path} to resume it: {e.strerror or e}") from None
    with fh:
        for line_no, raw in enumerate(fh, 1):
            if not raw.endswith(b"\n"):
                scan.torn_bytes = len(raw)
                break
            rid, why = _result_id(raw)
            if rid is None:
                raise UsageError(
                    f"cannot resume {path}: line {line_no} is not a marscli result ({why}); "
                    "run without --resume to start over (this overwrites the file)"
                )
            if rid in scan.done:
                raise UsageError(
                    f"cannot resume {path}: id {rid!r} appears twice (line {line_no}); "
                    "run without --resume to start over (this overwrites the file)"
                )
            scan.done[rid] = _has_error(raw)
            scan.spans[rid] = (scan.keep_bytes, len(raw))
            scan.keep_bytes += len(raw)
    return scan


def _result_id(raw: bytes) -> tuple[str | None, str]:
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None, "not valid JSON"
    if not isinstance(obj, dict):
        return None, f"a JSON {json_type(obj)}, not an object"
    # custom_id first: an OpenAI-format line's `id` is its batch request id, not the record's.
    for key in ("custom_id", "id"):
        if isinstance(obj.get(key), str):
            return obj[key], ""
    return None, "no string 'id' or 'custom_id'"


def _has_error(raw: bytes) -> bool:
    return json.loads(raw.decode("utf-8")).get("error") is not None


# --------------------------------------------------------------------------------------------
# Part files and merging
#
# Data-parallel runs (marscli.io.distributed) write one part file per process beside the output,
# `results.jsonl.rank1-of-8.part`: plain result lines in the order that process finished them.
# The parts live under the output's sidecar like the output itself: a fresh run removes stale
# parts before writing its sidecar, --resume counts the ids in the output AND in every part as
# done (whichever run or rank wrote them), and the end of a run merges everything into the
# output in input order (`merge_results`) and removes the parts.

PART_SUFFIX = ".part"
_PART_NAME = re.compile(r"\.rank(\d+)-of-(\d+)" + re.escape(PART_SUFFIX))
HELD_SUFFIX = ".held" + PART_SUFFIX


def held_path(output: str | os.PathLike) -> str:
    """A single process's journal of results that finished ahead of an earlier record
    (`ResultWriter(held=...)`): `results.jsonl.held.part`, a part file like the others."""
    return f"{os.fspath(output)}{HELD_SUFFIX}"


def part_path(output: str | os.PathLike, rank: int, world_size: int) -> str:
    return f"{os.fspath(output)}.rank{rank}-of-{world_size}{PART_SUFFIX}"


def find_parts(output: str | os.PathLike) -> list[str]:
    """The part files beside `output` (any number of processes), ordered by (world, rank),
    then the held file of a single-process run, if there is one."""
    output = os.fspath(output)
    folder = os.path.dirname(output) or "."
    name = os.path.basename(output)
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    found = []
    for n in names:
        m = _PART_NAME.fullmatch(n[len(name):]) if n.startswith(name) else None
        if m is not None:
            found.append(((int(m.group(2)), int(m.group(1))), os.path.join(folder, n)))
    parts = [p for _, p in sorted(found)]
    if os.path.isfile(held_path(output)):
        parts.append(held_path(output))
    return parts


def remove_parts(output: str | os.PathLike) -> None:
    for p in find_parts(output):
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise MarscliError(f"cannot remove part file {p}: {e.strerror or e}") from None


@dataclass
class MergeReport:
    """What `merge_results` wrote."""

    written: int = 0
    failed: int = 0  # results that carry an error
    missing: list[str] = field(default_factory=list)  # ids of records with no result (in order)
    broken_pipe: bool = False


def merge_results(sources: list[str], items: Iterable[Request | RecordError],
                  dest: str | BinaryIO) -> MergeReport:
    """Write every result found in `sources` to `dest` in input order, once per id.

    sources: result files (the output, then parts), earlier ones winning when an id appears in
    several (a merge cut short between replacing the output and removing the parts). Only
    complete lines count. dest: a path, replaced atomically (it may be one of the sources), or
    a binary stream (stdout). Lines whose id is no record of `items` (a --limit lowered since)
    are kept after the others, in source order.
    """
    where: dict[str, tuple[int, int, int]] = {}  # id -> (source, offset, length)
    errors: dict[str, bool] = {}
    for n, src in enumerate(sources):
        scan = scan_output(src)
        for rid, (offset, length) in scan.spans.items():
            if rid not in where:
                where[rid] = (n, offset, length)
                errors[rid] = scan.done[rid]
    report = MergeReport()
    order: list[str] = []
    for it in items:
        if it.id in where:
            order.append(it.id)
        else:
            report.missing.append(it.id)
    listed = set(order)
    order += [rid for rid in where if rid not in listed]
    report.failed = sum(errors[rid] for rid in order)

    def copy(out: BinaryIO) -> None:
        handles = [open(src, "rb") for src in sources]  # noqa: SIM115 - closed below
        try:
            for rid in order:
                n, offset, length = where[rid]
                handles[n].seek(offset)
                out.write(handles[n].read(length))
                report.written += 1
        finally:
            for h in handles:
                h.close()

    if isinstance(dest, (str, os.PathLike)):
        try:
            with atomic_file(dest) as f:
                copy(f)
        except OSError as e:
            raise MarscliError(f"cannot write merged results to {os.fspath(dest)}: "
                               f"{e.strerror or e}") from None
    else:
        try:
            copy(dest)
            dest.flush()
        except BrokenPipeError:
            report.broken_pipe = True
    return report


class PartWriter(ResultWriter):
    """One process's part file: appends each result the moment it is finished (any order),
    flushed line by line; merge_results puts them in input order later."""

    def write(self, index: int, result: dict) -> None:
        if self._closed:
            raise ValueError("PartWriter is closed")
        self._emit(result)


# --------------------------------------------------------------------------------------------
# One run per output
#
# Two runs writing one output would interleave their lines into a file neither could resume.
# The run that owns an output (the single process, or rank 0 of a data-parallel run; the other
# ranks write only their own part files) holds an exclusive flock for its whole length, resume
# and final merge included. The lock is on a file BESIDE the output: the output and its sidecar
# are replaced with os.replace (merge, sidecar), and a lock on a replaced inode excludes nobody.

LOCK_SUFFIX = ".marscli.lock"
#: Locking errors that mean "this filesystem cannot lock", not "someone holds it": the run goes
#: on unlocked there, as it did before marscli locked outputs.
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
#: Tries at taking the lock while other runs replace the lock file under us (see acquire).
_LOCK_TRIES = 20
#: A holder writes who it is right after locking: how long a refused run waits to read it.
_HOLDER_WAIT_S = 0.5
_HOLDER_POLL_S = 0.02
_HOLDER_MAX_BYTES = 4096


def lock_path(output: str | os.PathLike) -> str:
    return os.fspath(output) + LOCK_SUFFIX


class OutputLock:
    """An exclusive lock on an output, held from `acquire` to `release`.

    The kernel drops a flock when its process dies, however it dies, so a crashed run never
    leaves the output locked; a lock file left behind by one is simply taken over. The file
    holds its holder's pid, host and start time, which a refused run names.
    """

    def __init__(self, output: str | os.PathLike) -> None:
        self.output = os.fspath(output)
        self.path = lock_path(output)
        self._fd: int | None = None

    @classmethod
    def acquire(cls, output: str | os.PathLike) -> OutputLock:
        """Lock `output`, or raise OutputInUseError naming the run that holds it."""
        lock = cls(output)
        if fcntl is not None:
            lock._acquire()
        return lock

    @property
    def held(self) -> bool:
        return self._fd is not None

    def _acquire(self) -> None:
        for _ in range(_LOCK_TRIES):
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
            except OSError as e:
                raise UsageError(f"cannot lock output {self.output}: cannot create {self.path}: "
                                 f"{e.strerror or e}") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if not self._still_at_path(fd):  # its holder just released and removed it
                    os.close(fd)
                    continue
                holder = _read_holder(fd)
                os.close(fd)
                raise OutputInUseError(
                    f"output {self.output} is in use by another marscli run ({holder}); wait "
                    "for it to end or write elsewhere") from None
            except OSError as e:
                os.close(fd)
                if e.errno in _NO_LOCKS:
                    return
                raise MarscliError(f"cannot lock output {self.output}: {e.strerror or e}") from None
            # A holder removes the file when it releases: if it did so between our open and our
            # flock, we locked a file nobody else will open, and must lock the one at the path.
            if self._still_at_path(fd):
                self._fd = fd
                self._write_holder()
                return
            os.close(fd)
        raise MarscliError(f"cannot lock output {self.output}: {self.path} keeps being replaced")

    def _still_at_path(self, fd: int) -> bool:
        try:
            return os.path.samestat(os.fstat(fd), os.stat(self.path))
        except FileNotFoundError:
            return False

    def _write_holder(self) -> None:
        assert self._fd is not None
        started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        doc = {"pid": os.getpid(), "host": socket.gethostname(), "started": started}
        try:
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, (json.dumps(doc) + "\n").encode(), 0)
        except OSError:
            pass  # who holds it is a courtesy to the refused run; the lock itself is held

    def release(self) -> None:
        """Remove the lock file, then unlock; safe to call twice."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        # Unlink while still locked: a run that opened the file meanwhile sees it gone once it
        # gets the flock (the inode check in _acquire) and locks a new file instead.
        try:
            os.unlink(self.path)
        except OSError:
            pass
        os.close(fd)

    def __enter__(self) -> OutputLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _read_holder(fd: int) -> str:
    """'pid P on host H, started T' from a held lock file (untrusted: any bytes)."""
    deadline = time.monotonic() + _HOLDER_WAIT_S
    while True:
        try:
            doc = json.loads(os.pread(fd, _HOLDER_MAX_BYTES, 0).decode("utf-8"))
        except (OSError, UnicodeDecodeError, ValueError, RecursionError):
            doc = None
        if isinstance(doc, dict) or time.monotonic() > deadline:
            break
        time.sleep(_HOLDER_POLL_S)  # locked, but who holds it is not written yet
    if not isinstance(doc, dict):
        return "it has not said who it is"
    return (f"pid {_printable(doc.get('pid'))} on host {_printable(doc.get('host'))}, "
            f"started {_printable(doc.get('started'))}")


def _printable(value: Any, limit: int = 64) -> str:
    text = str(value)[:limit]
    return "".join(c if c.isprintable() else "?" for c in text)
