"""Resumable runs: the output file, its sidecar, and the checks that make --resume safe.

`-o results.jsonl` gets a sidecar `results.jsonl.marscli.json` holding the run's fingerprint:
everything that decides the bytes of the results (input, models, drafter, verification,
sampling, output options, profile). The fingerprint is plain JSON data that the caller
makes (marscli.jobs.fingerprint); this module stores and compares it and knows nothing of
the settings behind it. `--resume` keeps the complete lines of an existing output, cuts a
torn last line, and appends the records whose ids are not there yet; it is refused when the
fingerprint differs. Every record is generated from its own seed, so a resumed file is byte
for byte the file an uninterrupted run would have written.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterable
from typing import Any, BinaryIO

from marscli._version import __version__
from marscli.config import RecordError, Request
from marscli.errors import MarscliError, UsageError
from marscli.io.records import MAX_LINE_BYTES, is_number, reject_constant, show_value
from marscli.io.results import (
    MergeReport,
    OutputLock,
    OutputScan,
    PartWriter,
    ResultWriter,
    atomic_write_text,
    find_parts,
    held_path,
    merge_results,
    part_path,
    remove_parts,
    scan_output,
)

SIDECAR_SUFFIX = ".marscli.json"
SIDECAR_FORMAT = 1


def sidecar_path(output: str | os.PathLike) -> str:
    return os.fspath(output) + SIDECAR_SUFFIX


def fingerprint_diff(
    old: dict[str, Any], new: dict[str, Any], *, ignore: Iterable[str] = ()
) -> list[str]:
    """One "path: old in the existing run, new now" line per differing leaf, in key order."""
    skip = set(ignore)
    out: list[str] = []

    def walk(a: Any, b: Any, path: str) -> None:
        if path in skip:
            return
        if isinstance(a, dict) and isinstance(b, dict):
            for key in list(a) + [k for k in b if k not in a]:
                walk(a.get(key, _ABSENT), b.get(key, _ABSENT), f"{path}.{key}" if path else key)
        elif a != b or type(a) is not type(b) and not _same_number(a, b):
            out.append(f"{path}: {_render(a)} in the existing run, {_render(b)} now")

    walk(old, new, "")
    return out


_ABSENT = object()


def _same_number(a: Any, b: Any) -> bool:
    # 1 and 1.0 are the same setting (JSON does not keep the difference reliably).
    return is_number(a) and is_number(b) and a == b


def _render(value: Any, limit: int = 80) -> str:
    if value is _ABSENT:
        return "(absent)"
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= limit else text[: limit - 3] + "..."



def read_sidecar(path: str | os.PathLike) -> dict[str, Any] | None:
    """The fingerprint stored in a sidecar, or None if there is no sidecar.

    The file is untrusted: anything but a sidecar this version wrote is a UsageError.
    """
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_LINE_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise UsageError(f"cannot read run sidecar {path}: {e.strerror or e}") from None
    bad = f"run sidecar {path} is unreadable"
    try:
        obj = json.loads(raw.decode("utf-8"), parse_constant=reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise UsageError(f"{bad}: {str(e).splitlines()[0] if str(e) else 'invalid JSON'}") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("fingerprint"), dict):
        raise UsageError(f"{bad}: expected an object with a 'fingerprint' object")
    if obj.get("format") != SIDECAR_FORMAT:
        raise UsageError(f"{bad}: format {show_value(obj.get('format'))}, expected {SIDECAR_FORMAT}")
    return obj["fingerprint"]


def write_sidecar(path: str | os.PathLike, fingerprint: dict[str, Any], *, note: str = "") -> None:

    doc = {"format": SIDECAR_FORMAT, "written_by": f"marscli {__version__}", "note": note,
           "fingerprint": fingerprint}
    try:
        atomic_write_text(path, json.dumps(doc, indent=2, ensure_ascii=False) + "\n")
    except OSError as e:
        raise MarscliError(f"cannot write run sidecar {os.fspath(path)}: {e.strerror or e}") from None


class RunOutput:
    """Where a run's results go: stdout, or `-o FILE` with its sidecar; fresh or resumed.

    Use in three steps so every check that can fail does so as early as it can:
    construct before reading input and loading models (a bad path, an output another run is
    writing, or an output that cannot be resumed fails at once); `check(fp, ignore=...)` once
    the input is read, ignoring the components known only once the models are loaded;
    `open(fp, items)` once models are loaded: it refuses a resume whose fingerprint differs,
    then truncates (fresh) or cuts the torn tail (resume), writes the sidecar, and returns
    the ResultWriter (which journals results that finished ahead of an earlier record in the
    held file). `finish(items)` after a complete run puts the output in input order (a resume
    over part files, a held file, or an output with gaps) or removes the emptied held file.
    `close()` at the very end, after any merge, releases the output.

    A data-parallel run instead calls `prepare_parts` on the main process, `open_part` on
    every process, and `merge` on the main process at the end.

    lock: hold the output's `OutputLock` from construction to `close()` (a second run on the
    same file is refused with OutputInUseError, exit 2). Only the process that owns the
    output locks it: False on the other ranks of a data-parallel run, which write only their
    part files. Results on stdout take no lock.
    """

    def __init__(self, path: str | None, *, resume: bool, input_path: str | None = None,
                 lock: bool = True):
        self.path = None if path is None or path == "-" else path
        self.resume = resume
        self.previous: dict[str, Any] | None = None  # the existing run's fingerprint
        self.scan = OutputScan()
        self.part_scans: dict[str, OutputScan] = {}  # resume: the parts found beside the output
        self.parts_base: str | None = self.path  # part files are named after it
        self._done: dict[str, bool] | None = None
        self._temp_dir: str | None = None
        self._lock: OutputLock | None = None
        if self.path is None:
            if resume:
                raise UsageError("--resume needs -o FILE: results written to stdout cannot be resumed")
            return
        _check_output_path(self.path, input_path)
        # Locked before anything reads or touches the output (the write probe, the resume scan).
        self._lock = OutputLock.acquire(self.path) if lock else None
        try:
            _probe_writable(self.path)
            if resume:
                self._scan_previous()
        except BaseException:
            self.close()
            raise

    def _scan_previous(self) -> None:
        """--resume: read what the output and its parts already hold, and its sidecar."""
        assert self.path is not None
        if os.path.exists(self.path):
            self.scan = scan_output(self.path)
        for p in find_parts(self.path):
            self.part_scans[p] = scan_output(p)
        if os.path.exists(self.path) or self.part_scans:
            self.previous = read_sidecar(sidecar_path(self.path))
        if self.previous is None and (self.scan.done or any(s.done for s in self.part_scans.values())):
            raise UsageError(
                f"cannot resume {self.path}: its sidecar {sidecar_path(self.path)} is "
                "missing, so nothing says which settings made it; run without --resume "
                "to start over (this overwrites the file)"
            )

    def close(self) -> None:
        """Release the output's lock (after the last write and merge); safe to call twice."""
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def __enter__(self) -> RunOutput:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def resuming(self) -> bool:
        """True when there are finished results to keep."""
        return self.previous is not None and bool(self._all_done())

    @property
    def done(self) -> dict[str, bool]:
        """Ids already in the output or its parts (resume) -> whether that result is an error."""
        return self._all_done() if self.previous is not None else {}

    def _all_done(self) -> dict[str, bool]:
        if self._done is None:
            done = dict(self.scan.done)
            for s in self.part_scans.values():
                for rid, err in s.done.items():
                    done.setdefault(rid, err)
            self._done = done
        return self._done

    @property
    def torn_bytes(self) -> int:
        return self.scan.torn_bytes + sum(s.torn_bytes for s in self.part_scans.values())

    def check(self, fingerprint: dict[str, Any], *, ignore: Iterable[str] = ()) -> None:
        if not self.resuming:
            return
        assert self.previous is not None
        diffs = fingerprint_diff(self.previous, fingerprint, ignore=ignore)
        if diffs:
            raise UsageError(
                f"cannot resume {self.path}: it was made with other settings ({'; '.join(diffs)}); "
                "rerun with the original settings, or without --resume to start over "
                "(this overwrites the file)"
            )

    def _cut_torn_tail(self) -> None:
        if self.path is not None and os.path.exists(self.path):
            try:
                os.truncate(self.path, self.scan.keep_bytes)  # drop a torn last line
            except OSError as e:
                raise MarscliError(f"cannot resume {self.path}: {e.strerror or e}") from None

    def _start_fresh(self, fingerprint: dict[str, Any]) -> ResultWriter:
        # Output first, parts second, sidecar last: a crash in between leaves an empty output
        # (and maybe stale parts made under the old sidecar, which a resume may use as they
        # are: the old sidecar describes them), never old results under a new fingerprint.
        assert self.path is not None
        writer = ResultWriter(self.path, held=held_path(self.path))  # opens the held file lazily
        try:
            remove_parts(self.path)  # a stale held file included
            write_sidecar(sidecar_path(self.path), fingerprint,
                          note=f"settings of the run that writes {os.path.basename(self.path)}; "
                               "used by --resume")
        except BaseException:
            writer.close()
            raise
        return writer

    def open(self, fingerprint: dict[str, Any], items: Iterable[Request | RecordError]) -> ResultWriter:
        if self.path is None:
            return ResultWriter(None)
        self.check(fingerprint)
        if self.resuming:
            self._cut_torn_tail()
            done = self.done
            skip = [it.index for it in items if it.id in done]
            return ResultWriter(self.path, append=True, skip=skip, held=held_path(self.path))
        return self._start_fresh(fingerprint)

    def finish(self, items: list[Request | RecordError]) -> None:
        """A single-process run that wrote every result (its writer closed): put the output
        in input order if a resume left it otherwise, else remove the held file, whose
        results the writer has all emitted since."""
        if self.path is None:
            return
        if self.needs_merge(items):
            self.merge(items)
        else:  # no part of another rank can be here: only this run's held file
            remove_parts(self.path)

    def needs_merge(self, items: list[Request | RecordError]) -> bool:
        """After a resume: is the output not simply in input order (parts, or gaps)?"""
        if self.path is None or not self.resuming:
            return False
        if self.part_scans:
            return True
        have = list(self.scan.done)
        return have != [it.id for it in items[: len(have)]]

    # ------------------------------------------------------------------ data-parallel runs

    def prepare_parts(self, fingerprint: dict[str, Any]) -> tuple[str, str]:
        """Main process, before any part is written: start fresh (empty output, no stale
        parts, new sidecar) or keep what a resume found; returns (parts_base, probe), where
        probe is a file every process must see (a check for a shared filesystem)."""
        if self.path is None:  # stdout: the parts go to a temporary folder
            self._temp_dir = tempfile.mkdtemp(prefix="marscli-parts-")
            self.parts_base = os.path.join(self._temp_dir, "results.jsonl")
        else:
            self.check(fingerprint)
            if self.resuming:
                self._cut_torn_tail()
            else:
                self._start_fresh(fingerprint).close()
        assert self.parts_base is not None
        probe = f"{self.parts_base}.probe-{uuid.uuid4().hex[:12]}"
        try:
            open(probe, "wb").close()
        except OSError as e:
            raise MarscliError(f"cannot write beside {self.parts_base}: {e.strerror or e}") from None
        return self.parts_base, probe

    def open_part(self, rank: int, world_size: int) -> PartWriter:
        """This process's part file, appended to (a resumed part keeps its complete lines)."""
        assert self.parts_base is not None
        path = part_path(self.parts_base, rank, world_size)
        scan = self.part_scans.get(path)
        if scan is not None and scan.torn_bytes:
            try:
                os.truncate(path, scan.keep_bytes)
            except OSError as e:
                raise MarscliError(f"cannot resume {path}: {e.strerror or e}") from None
        return PartWriter(path, append=True)

    def merge(self, items: list[Request | RecordError], stream: BinaryIO | None = None) -> MergeReport:
        """Merge the output and every part into the output (or `stream` for stdout runs) in
        input order, then remove the parts."""
        assert self.parts_base is not None
        sources = find_parts(self.parts_base)
        if self.path is not None and os.path.exists(self.path):
            sources.insert(0, self.path)
        report = merge_results(sources, items, self.path if self.path is not None else stream)
        if self.path is not None:
            remove_parts(self.path)
        self.cleanup()
        return report

    def cleanup(self) -> None:
        """Remove a stdout run's temporary part folder."""
        if self._temp_dir is not None:
            shutil.rmtree(self._temp_dir, ignore_errors=True)
            self._temp_dir = None

    def write_empty(self) -> None:
        """An input without records: a fresh run leaves an empty output and no sidecar."""
        if self.path is None or self.resume:
            return
        ResultWriter(self.path).close()
        remove_parts(self.path)
        try:
            os.unlink(sidecar_path(self.path))
        except FileNotFoundError:
            pass
        except OSError as e:
            raise MarscliError(f"cannot remove stale sidecar: {e.strerror or e}") from None


def _check_output_path(path: str, input_path: str | None) -> None:
    """Fail now, not after loading models, if `path` cannot be an output (nothing written)."""
    if os.path.isdir(path):
        raise UsageError(f"output {path} is a directory, not a file")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UsageError(f"output folder {folder} does not exist")
    if input_path not in (None, "-") and os.path.exists(path):
        try:
            same = os.path.samefile(path, input_path)
        except OSError:
            same = False
        if same:
            raise UsageError(f"output {path} is the input file; write results elsewhere")


def _probe_writable(path: str) -> None:
    """Fail now, not after loading models, if results could not be written to `path`.

    An existing output is opened for appending (nothing is truncated yet); a new one is probed
    by a temporary file beside it, never by creating and removing the output itself: a watcher
    (tail -F, a test polling for the first line) must not see a file appear and vanish before
    the run has written anything."""
    try:
        if os.path.exists(path):
            open(path, "ab").close()
        else:
            with tempfile.NamedTemporaryFile(dir=os.path.dirname(os.path.abspath(path)),
                                             prefix=".marscli-", suffix=".probe"):
                pass
    except OSError as e:
        raise UsageError(f"cannot write output file {path}: {e.strerror or e}") from None
