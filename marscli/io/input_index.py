"""The streamed input of a generate run: an input read once, whole, into an index.

`marscli generate` never holds the records' text: `index_input` reads the input once (the
sha256, the ids, duplicate ids rejected up front) and keeps per record a `RecordRef` (index,
line, id, where the line lies, its ignored keys; a `RecordError` is kept whole, it is already
a result). `InputIndex.requests(refs)` parses the referenced lines again, one at a time, into
the very `Request`s `read_requests` gives. Standard input, which cannot seek, is copied to an
anonymous temporary file while it is indexed. `read_input` still returns whole lists, for the
small inputs of calibration and the lab scripts. Both honour a limit (the first N records)
and can hash the whole input (the digest a resume compares); `find_duplicate_ids` is their
duplicate-id check.

Parsing and validating one record (the formats, overrides, ids) is `marscli.io.records`'s;
this module builds on it and never the reverse.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
from collections.abc import Iterable, Iterator
from typing import BinaryIO

from marscli.config import RecordError, Request
from marscli.errors import InputError
from marscli.io.records import DISCARD_CHUNK, located_records, open_input, parse_line, read_requests


class _HashingReader:
    """A binary stream wrapper that hashes every byte read through it (readline only), and
    copies those bytes to `copy` when given (the spool of standard input)."""

    def __init__(self, fh: BinaryIO, copy: BinaryIO | None = None) -> None:
        self._fh = fh
        self._hash = hashlib.sha256()
        self._copy = copy

    def readline(self, size: int = -1) -> bytes:
        chunk = self._fh.readline(size)
        self._hash.update(chunk)
        if self._copy is not None:
            self._copy.write(chunk)
        return chunk

    def hexdigest_to_end(self) -> str:
        """The sha256 of the whole stream: what was read plus the rest, read now."""
        while chunk := self._fh.read(DISCARD_CHUNK):
            self._hash.update(chunk)
        return self._hash.hexdigest()


def read_input(
    source: str, *, limit: int | None = None, digest: bool = False
) -> tuple[list[Request | RecordError], str | None]:
    """Every record of an input (the first `limit` with a limit) -> (items, sha256 or None).

    The whole input is read before generating so that duplicate ids reject the run up front
    (InputError naming both lines). With ``digest`` the sha256 covers the WHOLE input, also
    past `limit`, so a resume may raise --limit over the same file; for stdin that means
    reading it to the end.
    """
    path = os.fspath(source)
    fh = sys.stdin.buffer if path == "-" else open_input(path)
    reader = _HashingReader(fh)
    try:
        items: list[Request | RecordError] = []
        if limit is None or limit > 0:
            for item in read_requests(reader):  # type: ignore[arg-type]
                items.append(item)
                if limit is not None and len(items) >= limit:
                    break
        sha = reader.hexdigest_to_end() if digest else None
    finally:
        if fh is not sys.stdin.buffer:
            fh.close()
    dup = find_duplicate_ids(items)
    if dup is not None:
        raise InputError(f"{path}: duplicate id {dup[0]!r} on lines {dup[1]} and {dup[2]}")
    return items, sha


class RecordRef:
    """A good record of an `InputIndex`: where its line lies, not what it says.

    It carries the attributes of a `Request` that the bookkeeping of a run reads (index,
    line, id, and the ignored key paths for the run's note), so resume, merging, sharding
    and id checks take refs as they take Requests; `InputIndex.requests` gives the Request.
    """

    __slots__ = ("index", "line", "id", "offset", "length", "ignored")

    def __init__(self, index: int, line: int, id: str, offset: int, length: int,
                 ignored: list[str] | tuple = ()) -> None:
        self.index = index
        self.line = line
        self.id = id
        self.offset = offset  # byte offset of the line's body in the input (after a BOM)
        self.length = length  # bytes of the body, newline excluded
        self.ignored = ignored

    def __repr__(self) -> str:
        return (f"RecordRef(index={self.index}, line={self.line}, id={self.id!r}, "
                f"offset={self.offset}, length={self.length})")


class InputIndex:
    """An input read once: its records as `RecordRef`s (good ones) or `RecordError`s (kept
    whole), in input order, and the whole input's sha256 when asked for; built by
    `index_input`. It keeps the input open (standard input: a spooled copy) to parse a
    record again when it is needed; close it at the end (or use it as a context manager).
    """

    def __init__(self, path: str, fh: BinaryIO | None, items: list[RecordRef | RecordError],
                 sha256: str | None) -> None:
        self.path = path
        self.items = items
        self.sha256 = sha256
        self._fh = fh

    def __enter__(self) -> InputIndex:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the input (a spool of stdin is deleted); safe to call twice."""
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def request(self, ref: RecordRef | RecordError) -> Request | RecordError:
        """The record as `read_requests` gives it: parsed again from its line (a RecordError
        is its own record)."""
        if not isinstance(ref, RecordRef):
            return ref
        if self._fh is None:
            raise ValueError("the input index is closed")
        self._fh.seek(ref.offset)
        raw = self._fh.read(ref.length)
        item = parse_line(raw, ref.index, ref.line, ref.offset)
        if len(raw) != ref.length or isinstance(item, RecordError) or item.id != ref.id:
            raise InputError(f"{self.path}: line {ref.line} is not what it was when the input "
                             "was read: the input file changed during the run")
        return item

    def requests(self, refs: Iterable[RecordRef | RecordError]) -> Iterator[Request | RecordError]:
        """The records of `refs`, in their order, parsed one at a time as they are pulled."""
        for ref in refs:
            yield self.request(ref)


def index_input(source: str, *, limit: int | None = None, digest: bool = False) -> InputIndex:
    """`read_input` without the records' text: the same checks (duplicate ids: InputError
    naming both lines), limit and digest, but an `InputIndex` of refs, so memory does not
    grow with the prompts. Standard input ("-") is copied to an anonymous temporary file as
    it is read (the records read back from there)."""
    path = os.fspath(source)
    stdin = path == "-"
    fh = sys.stdin.buffer if stdin else open_input(path)
    spool = tempfile.TemporaryFile() if stdin else None  # noqa: SIM115 - the index closes it
    keep: BinaryIO = spool if spool is not None else fh
    reader = _HashingReader(fh, copy=spool)
    try:
        items: list[RecordRef | RecordError] = []
        if limit is None or limit > 0:
            for item, offset, length in located_records(reader):  # type: ignore[arg-type]
                if isinstance(item, RecordError):
                    items.append(item)
                else:
                    items.append(RecordRef(item.index, item.line, item.id, offset, length,
                                           item.ignored or ()))
                if limit is not None and len(items) >= limit:
                    break
        sha = reader.hexdigest_to_end() if digest else None
        dup = find_duplicate_ids(items)
        if dup is not None:
            raise InputError(f"{path}: duplicate id {dup[0]!r} on lines {dup[1]} and {dup[2]}")
    except BaseException:
        keep.close()
        raise
    if spool is not None:
        spool.flush()
    return InputIndex(path, keep, items, sha)


def find_duplicate_ids(items: Iterable[Request | RecordError | RecordRef]) -> tuple[str, int, int] | None:
    """The first id seen twice, as (id, first line, second line), or None.

    Requests (or their `RecordRef`s) and RecordErrors all count: results are matched back to
    inputs by id.
    """
    seen: dict[str, int] = {}
    for item in items:
        if item.id in seen:
            return item.id, seen[item.id], item.line
        seen[item.id] = item.line
    return None
