"""JSONL in and out: record validation, ordered result writing, atomic file writes.

Input is read line by line in binary mode, so a huge file never sits in memory and a bad byte
sequence on one line cannot spoil the others. Every non-blank line becomes exactly one
`Request` or one `RecordError`; bad content never raises (the CLI turns a `RecordError` into a
result with an `error` object and goes on).

Accepted record formats (one JSON object per line):

- ``{"id"?: ..., "prompt": "..."}`` with optional sampling overrides at top level.
- ``{"id"?: ..., "messages": [{"role": ..., "content": ...}, ...]}`` with optional overrides.
- OpenAI batch lines: ``{"custom_id": "...", "method": "POST", "url": "/v1/chat/completions"
  | "/v1/completions", "body": {...}}``; the body carries ``messages`` (chat) or ``prompt``
  (completions) and the overrides; ``max_completion_tokens`` is accepted as ``max_tokens``;
  ``model`` and other body keys are ignored. The result echoes ``custom_id``.
- Benchmark prompt sets (MT-Bench style): ``{"question_id": ..., "category": ..., "turns":
  [...]}``. Only the FIRST turn is used, as a single user message; the id is the question_id.

Overrides: ``max_tokens`` (int >= 1), ``temperature`` (finite number >= 0), ``top_p`` (number in
(0, 1]), ``top_k`` (int >= 0), ``seed`` (int in [0, 2**63)), ``stop`` (a string or a list of at
most 16 non-empty strings; normalised to a list). JSON booleans are never numbers here. An
override given as ``null`` counts as absent (OpenAI clients often serialise unset fields so).
Unknown top-level keys are ignored: users keep their own metadata in the lines.

Ids: ``id`` (or ``custom_id`` / ``question_id``) may be a string or an integer and is kept as a
string. A record without one gets ``str(index)``, its 0-based position among the records, which
is stable across runs of the same file (so it can clash with an explicit id "3";
`find_duplicate_ids` reports that like any other clash).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
import os
import re
import shutil
import sys
import tempfile
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, BinaryIO, TextIO

from marscli.config import Request, RecordError
from marscli.errors import InputError, MarscliError, UsageError

#: Longest accepted input line, newline excluded. Longer lines become `line_too_long` errors
#: and are skipped in chunks, so memory stays bounded whatever the input.
MAX_LINE_BYTES = 8 * 1024 * 1024
#: Chunk size used to skip the rest of an over-long line.
_DISCARD_CHUNK = 1024 * 1024
_MAX_STOP = 16
_SEED_LIMIT = 2**63
_ROLES = ("system", "user", "assistant")
_BATCH_URLS = {"/v1/chat/completions": "messages", "/v1/completions": "prompt"}
_OVERRIDE_KEYS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop")
_UTF8_BOM = b"\xef\xbb\xbf"
# bytes.strip() strips ASCII whitespace only: a line of these is blank, not a record.
_ASCII_WS = b" \t\n\r\x0b\x0c"

ERR_ENCODING = "invalid_encoding"
ERR_TOO_LONG = "line_too_long"
ERR_JSON = "invalid_json"
ERR_RECORD = "invalid_record"


class _Invalid(Exception):
    """Internal: a record failed validation; `args[0]` is the one-line message."""


# --------------------------------------------------------------------------------------------
# Reading


def read_requests(source: str | os.PathLike | BinaryIO) -> Iterator[Request | RecordError]:
    """Yield one `Request` or `RecordError` per non-blank line of a JSONL input.

    `source` is a path, ``"-"`` for standard input, or a binary file object (left open).
    A missing or unreadable file raises `InputError` here, at call time, not on first
    iteration. Lines are 1-based; blank lines are skipped but still counted. `index` is the
    0-based position among records (good and bad alike), i.e. the output order.
    """
    if isinstance(source, (str, os.PathLike)) and os.fspath(source) == "-":
        return _iter_records(sys.stdin.buffer, close=False)
    if isinstance(source, (str, os.PathLike)):
        return _iter_records(open_input(os.fspath(source)), close=True)
    return _iter_records(_binary(source), close=False)


def open_input(path: str) -> BinaryIO:
    try:
        return open(path, "rb")
    except FileNotFoundError:
        raise InputError(f"input file not found: {path}") from None
    except IsADirectoryError:
        raise InputError(f"input is a directory, not a file: {path}") from None
    except OSError as e:
        raise InputError(f"cannot read input file {path}: {e.strerror or e}") from None


class _HashingReader:
    """A binary stream wrapper that hashes every byte read through it (readline only)."""

    def __init__(self, fh: BinaryIO) -> None:
        self._fh = fh
        self._hash = hashlib.sha256()

    def readline(self, size: int = -1) -> bytes:
        chunk = self._fh.readline(size)
        self._hash.update(chunk)
        return chunk

    def hexdigest_to_end(self) -> str:
        """The sha256 of the whole stream: what was read plus the rest, read now."""
        while chunk := self._fh.read(_DISCARD_CHUNK):
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
            for item in _iter_records(reader, close=False):  # type: ignore[arg-type]
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


def _binary(stream: Any) -> BinaryIO:
    """The byte stream under a text stream (e.g. sys.stdin), or the stream itself."""
    if isinstance(stream, io.TextIOBase):
        buf = getattr(stream, "buffer", None)
        if buf is None:
            raise TypeError("read_requests needs a binary stream, got a text stream")
        return buf
    return stream


def _iter_records(fh: BinaryIO, *, close: bool) -> Iterator[Request | RecordError]:
    try:
        index = 0
        for line_no, offset, raw, too_long in _read_lines(fh):
            if too_long:
                item: Request | RecordError = RecordError(
                    index, line_no, str(index), ERR_TOO_LONG,
                    f"line is longer than the limit of {MAX_LINE_BYTES} bytes",
                )
            else:
                item = _parse_line(raw, index, line_no, offset)
            yield item
            index += 1
    finally:
        if close:
            fh.close()


def _read_lines(fh: BinaryIO) -> Iterator[tuple[int, int, bytes, bool]]:
    """Yield (line number, file offset, bytes without newline, too_long) per non-blank line.

    For an over-long line the bytes are empty and too_long is True; the rest of the line is
    read and dropped in bounded chunks.
    """
    line_no = 0
    offset = 0
    while True:
        chunk = fh.readline(MAX_LINE_BYTES + 1)
        if not chunk:
            return
        line_no += 1
        start = offset
        offset += len(chunk)
        if chunk.endswith(b"\n") or len(chunk) <= MAX_LINE_BYTES:
            # Whole line (the newline itself does not count against the limit).
            body = chunk[:-1] if chunk.endswith(b"\n") else chunk
            if line_no == 1 and body.startswith(_UTF8_BOM):
                body = body[len(_UTF8_BOM):]
                start += len(_UTF8_BOM)
            if body.strip(_ASCII_WS):
                yield line_no, start, body, False
            continue
        # Over-long: drop the rest, remembering whether it was all whitespace (still blank).
        blank = not chunk.strip(_ASCII_WS)
        while True:
            rest = fh.readline(_DISCARD_CHUNK)
            offset += len(rest)
            if not rest:
                break
            if blank and rest.strip(_ASCII_WS):
                blank = False
            if rest.endswith(b"\n"):
                break
        if not blank:
            yield line_no, start, b"", True


def _parse_line(raw: bytes, index: int, line: int, offset: int) -> Request | RecordError:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        bad = raw[e.start : e.start + 1].hex()
        return RecordError(
            index, line, str(index), ERR_ENCODING,
            f"line is not valid UTF-8: {e.reason} (byte 0x{bad}) at byte offset "
            f"{offset + e.start} of the input ({e.start} into the line)",
        )
    try:
        obj = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        return RecordError(
            index, line, str(index), ERR_JSON,
            f"invalid JSON: {e.msg} at column {e.colno}",
        )
    except RecursionError:
        return RecordError(index, line, str(index), ERR_JSON, "invalid JSON: nested too deeply")
    except ValueError as e:  # NaN/Infinity, or an integer with too many digits
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        return RecordError(index, line, str(index), ERR_JSON, f"invalid JSON: {msg}")
    return _validate(obj, index, line)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed (JSON has no NaN or Infinity)")


def _validate(obj: Any, index: int, line: int) -> Request | RecordError:
    """Turn one decoded JSON value into a Request, or a RecordError naming the problem."""
    if not isinstance(obj, dict):
        return RecordError(
            index, line, str(index), ERR_RECORD, f"expected a JSON object, got {_json_type(obj)}"
        )
    has_prompt = "prompt" in obj
    has_messages = "messages" in obj
    is_batch = "body" in obj or ("custom_id" in obj and not has_prompt and not has_messages)
    is_bench = not is_batch and not has_prompt and not has_messages and "turns" in obj
    id_key = "custom_id" if is_batch else "id"
    rid = str(index)
    try:
        if is_batch:
            rid = _batch_id(obj)
            prompt, messages, overrides = _batch_body(obj)
        elif is_bench:
            rid = _bench_id(obj, index)
            messages = [{"role": "user", "content": _first_turn(obj)}]
            prompt, overrides = None, _overrides(obj, "")
        else:
            rid = _plain_id(obj, index)
            prompt, messages = _prompt_or_messages(obj, "")
            overrides = _overrides(obj, "")
    except _Invalid as e:
        return RecordError(index, line, rid, ERR_RECORD, e.args[0], id_key=id_key)
    return Request(
        index=index, line=line, id=rid, prompt=prompt, messages=messages,
        overrides=overrides, id_key=id_key,
    )


def _plain_id(obj: dict, index: int) -> str:
    if "id" not in obj:
        return str(index)
    return _id_value(obj["id"], "id")


def _bench_id(obj: dict, index: int) -> str:
    if "question_id" in obj:
        return _id_value(obj["question_id"], "question_id")
    return _plain_id(obj, index)


def _batch_id(obj: dict) -> str:
    if "custom_id" not in obj:
        raise _Invalid("OpenAI batch line has no 'custom_id'")
    cid = obj["custom_id"]
    if not isinstance(cid, str) or not cid:
        raise _Invalid(f"'custom_id' must be a non-empty string, got {_show(cid)}")
    _check_text("custom_id", cid)
    return cid


def _id_value(value: Any, key: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise _Invalid(f"'{key}' must be a string or an integer, got {_show(value)}")
    if isinstance(value, str):
        _check_text(key, value)
    return str(value)


def _batch_body(obj: dict) -> tuple[str | None, list[dict[str, str]] | None, dict[str, Any]]:
    method = obj.get("method", "POST")
    if method != "POST":
        raise _Invalid(f"'method' must be \"POST\", got {_show(method)}")
    url = obj.get("url")
    if url is not None and url not in _BATCH_URLS:
        raise _Invalid(
            f"unsupported 'url' {_show(url)}: expected \"/v1/chat/completions\" or "
            "\"/v1/completions\""
        )
    if "body" not in obj:
        raise _Invalid("OpenAI batch line has no 'body'")
    body = obj["body"]
    if not isinstance(body, dict):
        raise _Invalid(f"'body' must be a JSON object, got {_json_type(body)}")
    prompt, messages = _prompt_or_messages(body, "body.")
    if url is not None:
        want = _BATCH_URLS[url]
        got = "prompt" if prompt is not None else "messages"
        if want != got:
            raise _Invalid(f"'body.{got}' does not fit url {_show(url)}, which needs '{want}'")
    overrides = _overrides(body, "body.")
    mct = body.get("max_completion_tokens")
    if mct is not None:
        if "max_tokens" in overrides:
            raise _Invalid("give only one of 'body.max_tokens' and 'body.max_completion_tokens'")
        overrides["max_tokens"] = _int_at_least(mct, "body.max_completion_tokens", 1)
    return prompt, messages, overrides


def _first_turn(obj: dict) -> str:
    turns = obj["turns"]
    if not isinstance(turns, list) or not turns:
        raise _Invalid(f"'turns' must be a non-empty array of strings, got {_show(turns)}")
    first = turns[0]
    if not isinstance(first, str):
        raise _Invalid(f"turns[0] must be a string, got {_show(first)}")
    if not first.strip():
        raise _Invalid("turns[0] must not be empty or whitespace-only")
    _check_text("turns[0]", first)
    return first


def _prompt_or_messages(
    obj: dict, prefix: str
) -> tuple[str | None, list[dict[str, str]] | None]:
    has_prompt = "prompt" in obj
    has_messages = "messages" in obj
    if has_prompt and has_messages:
        raise _Invalid(f"record has both '{prefix}prompt' and '{prefix}messages'; give one")
    if has_prompt:
        return _prompt(obj["prompt"], f"{prefix}prompt"), None
    if has_messages:
        return None, _messages(obj["messages"], f"{prefix}messages")
    raise _Invalid(f"record has neither '{prefix}prompt' nor '{prefix}messages'")


def _prompt(value: Any, key: str) -> str:
    if not isinstance(value, str):
        raise _Invalid(f"'{key}' must be a non-empty string, got {_show(value)}")
    if not value.strip():
        raise _Invalid(f"'{key}' must not be empty or whitespace-only")
    _check_text(key, value)
    return value


def _messages(value: Any, key: str) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise _Invalid(f"'{key}' must be a non-empty array of message objects, got {_show(value)}")
    out = []
    for i, msg in enumerate(value):
        where = f"{key}[{i}]"
        if not isinstance(msg, dict):
            raise _Invalid(f"{where} must be an object, got {_json_type(msg)}")
        if "role" not in msg:
            raise _Invalid(f"{where}.role is missing")
        role = msg["role"]
        if not isinstance(role, str):
            raise _Invalid(f"{where}.role must be a string, got {_show(role)}")
        if role not in _ROLES:
            raise _Invalid(
                f"{where}.role: unknown role {_show(role)} (expected system, user or assistant)"
            )
        if "content" not in msg:
            raise _Invalid(f"{where}.content is missing")
        content = msg["content"]
        if not isinstance(content, str):
            raise _Invalid(f"{where}.content must be a string, got {_show(content)}")
        _check_text(f"{where}.content", content)
        # Only role and content go on: extra keys (name, tool_calls...) are not supported.
        out.append({"role": role, "content": content})
    return out


def _overrides(obj: dict, prefix: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in _OVERRIDE_KEYS:
        value = obj.get(key)
        if value is None:
            continue
        name = prefix + key
        if key == "max_tokens":
            out[key] = _int_at_least(value, name, 1)
        elif key == "top_k":
            out[key] = _int_at_least(value, name, 0)
        elif key == "seed":
            if _is_int(value) and 0 <= value < _SEED_LIMIT:
                out[key] = value
            else:
                raise _Invalid(f"'{name}' must be an integer in [0, 2**63), got {_show(value)}")
        elif key == "temperature":
            if _is_number(value) and value >= 0:
                out[key] = float(value)
            else:
                raise _Invalid(f"'{name}' must be a number >= 0, got {_show(value)}")
        elif key == "top_p":
            if _is_number(value) and 0 < value <= 1:
                out[key] = float(value)
            else:
                raise _Invalid(f"'{name}' must be a number in (0, 1], got {_show(value)}")
        else:  # stop
            out[key] = _stop(value, name)
    return out


def _stop(value: Any, name: str) -> list[str]:
    items = [value] if isinstance(value, str) else value
    if (
        not isinstance(items, list)
        or len(items) > _MAX_STOP
        or not all(isinstance(s, str) and s for s in items)
    ):
        raise _Invalid(
            f"'{name}' must be a string or a list of at most {_MAX_STOP} non-empty strings, "
            f"got {_show(value)}"
        )
    for s in items:
        _check_text(name, s)
    return list(items)


def _int_at_least(value: Any, name: str, low: int) -> int:
    if _is_int(value) and value >= low:
        return value
    raise _Invalid(f"'{name}' must be an integer >= {low}, got {_show(value)}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return math.isfinite(value)  # 1e999 parses to inf


def _check_text(key: str, value: str) -> None:
    """Reject lone surrogates ("\\ud800" escapes): they cannot be tokenized or written back."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise _Invalid(
            f"'{key}' contains an unpaired surrogate \\u{ord(value[e.start]):04x}"
        ) from None


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _show(value: Any, limit: int = 40) -> str:
    """A short, one-line rendering of a user value for an error message."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        # repr escapes newlines, control characters and lone surrogates: one printable line.
        return repr(value) if len(value) <= limit else repr(value[:limit]) + "..."
    if isinstance(value, (int, float)):
        text = repr(value) if isinstance(value, float) else str(value)
        return text if len(text) <= limit else text[:limit] + "..."
    return f"an {_json_type(value)}" if isinstance(value, (list, dict)) else _json_type(value)


def find_duplicate_ids(items: Iterable[Request | RecordError]) -> tuple[str, int, int] | None:
    """The first id seen twice, as (id, first line, second line), or None.

    Requests and RecordErrors both count: results are matched back to inputs by id.
    """
    seen: dict[str, int] = {}
    for item in items:
        if item.id in seen:
            return item.id, seen[item.id], item.line
        seen[item.id] = item.line
    return None


# --------------------------------------------------------------------------------------------
# Writing


def dump_json_line(obj: Any) -> str:
    """One JSONL line (no newline): UTF-8 text, keys in insertion order, no NaN/Infinity."""
    return json.dumps(obj, ensure_ascii=False, separators=(", ", ": "), allow_nan=False)


class ResultWriter:
    """Writes results as JSONL in input order, whatever order they arrive in.

    ``write(index, result)`` buffers a result until every lower index (from ``start_index``)
    has been written or is in ``skip`` (indices already present in the output when resuming),
    then emits it and flushes, so an interrupted run leaves a clean, ordered prefix.

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
    ) -> None:
        self.broken_pipe = False
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
        while self._next in self._pending and not self.broken_pipe:
            self._emit(self._pending.pop(self._next))
            self._next += 1
            self._advance_over_skipped()

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

        Results stuck behind a gap are NOT written (the output stays an ordered prefix);
        see `pending`. With ``strict=True`` a gap raises RuntimeError: indices below the
        highest buffered one, or below `total` when given, that never arrived.
        """
        if self._closed:
            return
        self._closed = True
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
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
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
# Resumable runs: the output file, its sidecar and the run fingerprint
#
# `-o results.jsonl` gets a sidecar `results.jsonl.marscli.json` holding the run's fingerprint:
# everything that decides the bytes of the results (input, models, drafter, verification,
# sampling, output options, profile). `--resume` keeps the complete lines of an existing
# output, cuts a torn last line, and appends the records whose ids are not there yet; it is
# refused when the fingerprint differs. Every record is generated from its own seed, so a
# resumed file is byte for byte the file an uninterrupted run would have written.

SIDECAR_SUFFIX = ".marscli.json"
SIDECAR_FORMAT = 1
#: Fingerprint components known only once the models are loaded, so compared only then: the
#: model identities, and the verification and profile, which a profile matched to the loaded
#: target can decide.
LOADED_COMPONENTS = ("target", "draft_model", "verify", "profile")
#: Identity keys of a loaded model that change results ("device" is reduced to its type).
#: "fingerprint" is a model folder's content fingerprint where models.py records one (folders
#: have no sha256): with it, weights changed in place between a crash and a resume are caught.
_MODEL_KEYS = ("name", "source", "kind", "sha256", "fingerprint", "revision", "dtype",
               "quantization", "device")


def sidecar_path(output: str | os.PathLike) -> str:
    return os.fspath(output) + SIDECAR_SUFFIX


def run_fingerprint(
    cfg: Any,
    target_identity: dict[str, Any] | None,
    draft_identity: dict[str, Any] | None,
    extra: dict[str, Any],
    *,
    verify: Any = None,
) -> dict[str, Any]:
    """The named components that decide a run's result bytes (JSON values only).

    cfg: a GenerateConfig; the identities come from LoadedModel.identity (None before the
    models are loaded: see LOADED_COMPONENTS); extra: further components, which replace
    those of the same name, e.g. {"profile": {"name": ..., "sha256": ...} or None,
    "input": {"sha256": ...}}; verify: the VerifyConfig the run really uses when it differs
    from cfg.verify (a profile applied). Left out on purpose: --limit (may grow on resume),
    --quiet, progress, --fail-fast.
    """
    d = cfg.draft
    drafter: dict[str, Any] = {"kind": d.kind}
    if d.kind != "none":
        drafter.update(num_draft_tokens=d.num_draft_tokens, adaptive=d.adaptive)
    if d.kind == "ngram":
        drafter.update(ngram_max=d.ngram_max, ngram_min=d.ngram_min)
    if getattr(d, "tree", False):
        drafter.update(tree={"depth": d.tree_depth, "top_k": d.tree_top_k, "tokens": d.tree_tokens})
    v = verify if verify is not None else cfg.verify
    s = cfg.sampling
    fp: dict[str, Any] = {
        "target": _model_fingerprint(target_identity),
        "drafter": drafter,
        "draft_model": _model_fingerprint(draft_identity),
        "verify": {
            "mode": v.mode,
            "theta": None if v.mode == "strict" else v.theta,
            "margin": v.margin,
        },
        "sampling": {
            "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k,
            "max_tokens": s.max_tokens, "seed": s.seed, "stop": list(s.stop),
        },
        "truncate_prompt": cfg.truncate_prompt,
        "output": {"timing": cfg.timing, "token_ids": cfg.token_ids},
        "profile": None,
    }
    fp.update(extra)
    return json.loads(json.dumps(fp))  # plain JSON values, as read back from a sidecar


def _model_fingerprint(identity: dict[str, Any] | None) -> dict[str, Any] | None:
    if identity is None:
        return None
    out = {k: identity.get(k) for k in _MODEL_KEYS}
    if isinstance(out["device"], str):  # cuda:0 and cuda:1 compute alike
        out["device"] = out["device"].split(":")[0]
    return out


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
    return _is_number(a) and _is_number(b) and a == b


def _render(value: Any, limit: int = 80) -> str:
    if value is _ABSENT:
        return "(absent)"
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= limit else text[: limit - 3] + "..."


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
        return None, f"a JSON {_json_type(obj)}, not an object"
    for key in ("id", "custom_id"):
        if isinstance(obj.get(key), str):
            return obj[key], ""
    return None, "no string 'id' or 'custom_id'"


def _has_error(raw: bytes) -> bool:
    return json.loads(raw.decode("utf-8")).get("error") is not None


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
        obj = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise UsageError(f"{bad}: {str(e).splitlines()[0] if str(e) else 'invalid JSON'}") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("fingerprint"), dict):
        raise UsageError(f"{bad}: expected an object with a 'fingerprint' object")
    if obj.get("format") != SIDECAR_FORMAT:
        raise UsageError(f"{bad}: format {_show(obj.get('format'))}, expected {SIDECAR_FORMAT}")
    return obj["fingerprint"]


def write_sidecar(path: str | os.PathLike, fingerprint: dict[str, Any], *, note: str = "") -> None:
    from marscli import __version__

    doc = {"format": SIDECAR_FORMAT, "written_by": f"marscli {__version__}", "note": note,
           "fingerprint": fingerprint}
    try:
        atomic_write_text(path, json.dumps(doc, indent=2, ensure_ascii=False) + "\n")
    except OSError as e:
        raise MarscliError(f"cannot write run sidecar {os.fspath(path)}: {e.strerror or e}") from None


# Data-parallel runs (marscli.distributed) write one part file per process beside the output,
# `results.jsonl.rank1-of-8.part`: plain result lines in the order that process finished them.
# The parts live under the output's sidecar like the output itself: a fresh run removes stale
# parts before writing its sidecar, --resume counts the ids in the output AND in every part as
# done (whichever run or rank wrote them), and the end of a run merges everything into the
# output in input order (`merge_results`) and removes the parts.

PART_SUFFIX = ".part"
_PART_NAME = re.compile(r"\.rank(\d+)-of-(\d+)" + re.escape(PART_SUFFIX))


def part_path(output: str | os.PathLike, rank: int, world_size: int) -> str:
    return f"{os.fspath(output)}.rank{rank}-of-{world_size}{PART_SUFFIX}"


def find_parts(output: str | os.PathLike) -> list[str]:
    """The part files beside `output` (any number of processes), ordered by (world, rank)."""
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
    return [p for _, p in sorted(found)]


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


class RunOutput:
    """Where a run's results go: stdout, or `-o FILE` with its sidecar; fresh or resumed.

    Use in three steps so every check that can fail does so as early as it can:
    construct before reading input and loading models (a bad path or an output that cannot
    be resumed fails at once); `check(fp, ignore=LOADED_COMPONENTS)` once the input is read;
    `open(fp, items)` once models are loaded: it refuses a resume whose fingerprint differs,
    then truncates (fresh) or cuts the torn tail (resume), writes the sidecar, and returns
    the ResultWriter. If `needs_merge(items)` after the run, `merge(items)` puts the output in
    input order (a resume over part files, or over an output with gaps).

    A data-parallel run instead calls `prepare_parts` on the main process, `open_part` on
    every process, and `merge` on the main process at the end.
    """

    def __init__(self, path: str | None, *, resume: bool, input_path: str | None = None):
        self.path = None if path is None or path == "-" else path
        self.resume = resume
        self.previous: dict[str, Any] | None = None  # the existing run's fingerprint
        self.scan = OutputScan()
        self.part_scans: dict[str, OutputScan] = {}  # resume: the parts found beside the output
        self.parts_base: str | None = self.path  # part files are named after it
        self._done: dict[str, bool] | None = None
        self._temp_dir: str | None = None
        if self.path is None:
            if resume:
                raise UsageError("--resume needs -o FILE: results written to stdout cannot be resumed")
            return
        _check_writable(self.path, input_path)
        if resume:
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
        writer = ResultWriter(self.path)
        try:
            remove_parts(self.path)
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
            return ResultWriter(self.path, append=True, skip=skip)
        return self._start_fresh(fingerprint)

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


def _check_writable(path: str, input_path: str | None) -> None:
    """Fail now, not after loading models, if results could not be written to `path`."""
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
    existed = os.path.exists(path)
    try:
        open(path, "ab").close()  # append mode: nothing is truncated yet
    except OSError as e:
        raise UsageError(f"cannot write output file {path}: {e.strerror or e}") from None
    if not existed:
        os.unlink(path)
