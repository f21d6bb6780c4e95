"""Input records: JSONL lines -> validated `Request`s, or `RecordError`s naming the problem.

This module reads and validates records: `read_requests` (a path, "-" or a binary stream ->
one `Request` or `RecordError` per non-blank line), `open_input`, `located_records` (the
records with where each line lies) and `parse_line` (one line's bytes -> its record), the
record formats, overrides and limits below, and the JSON value helpers results and resume
share (`json_type`, `show_value`, `is_number`, `reject_constant`). Reading a whole input (its
digest, `--limit`, duplicate ids) and the input index of a generate run are in
`marscli.io.input_index`, which builds on this module.

Input is read line by line in binary mode, so a huge file never sits in memory and a bad byte
sequence on one line cannot spoil the others. Every non-blank line becomes exactly one
`Request` or one `RecordError`; bad content never raises (the CLI turns a `RecordError` into a
result with an `error` object and goes on).

Accepted record formats (one JSON object per line):

- ``{"id"?: ..., "prompt": "..."}`` with optional sampling overrides at top level.
- ``{"id"?: ..., "messages": [{"role": ..., "content": ...}, ...]}`` with optional overrides.
  ``content`` is a string, or an array of OpenAI content parts of which only text parts
  (``{"type": "text", "text": ...}``) are supported; their texts are joined by a newline.
- OpenAI batch lines: ``{"custom_id": "...", "method": "POST", "url": "/v1/chat/completions"
  | "/v1/completions", "body": {...}}``; the body carries ``messages`` (chat) or ``prompt``
  (completions) and the overrides; ``max_completion_tokens`` is accepted as ``max_tokens``.
  The result echoes ``custom_id``.
- Benchmark prompt sets (MT-Bench style): ``{"question_id": ..., "category": ..., "turns":
  [...]}``. Only the FIRST turn is used, as a single user message; the id is the question_id.

Overrides: ``max_tokens`` (int >= 1), ``temperature`` (finite number >= 0), ``top_p`` (number in
(0, 1]), ``top_k`` (int >= 0), ``seed`` (int in [0, 2**63)), ``stop`` (a string or a list of at
most 16 non-empty strings; normalised to a list), ``n`` (int in [1, 128]: completions per
request), ``logprobs`` / ``top_logprobs`` (OpenAI chat semantics: a boolean and an int in
[0, 20]; in a ``/v1/completions`` body ``logprobs`` is the int, as OpenAI's completions take
it). JSON booleans are never numbers here. An override given as ``null`` counts as absent
(OpenAI clients often serialise unset fields so).

Keys marscli does not act on are never dropped without a word: each lands in
``Request.ignored`` (a key path such as ``body.tools``), which the result reports as a warning
(or, with --strict-keys, turns into an error result). In an OpenAI batch body every key but
those marscli acts on and the identifying ones (``IDENTIFYING_KEYS``: model, user, metadata)
is reported. In plain records unknown top-level keys stay the user's metadata, quietly, except
the OpenAI request parameters of ``OPENAI_PARAMETERS``. A key at its neutral value
(``presence_penalty: 0``, ``stream: false``, ``logit_bias: {}``, ...: ``NEUTRAL_VALUES``)
changes nothing and is accepted quietly. Message keys other than role and content (``name``,
``tool_calls``...) are reported too.

Ids: ``id`` (or ``custom_id`` / ``question_id``) may be a string or an integer and is kept as a
string. A record without one gets ``str(index)``, its 0-based position among the records, which
is stable across runs of the same file (so it can clash with an explicit id "3";
`marscli.io.input_index.find_duplicate_ids` reports that like any other clash).
"""

from __future__ import annotations

import io
import json
import math
import os
import sys
from collections.abc import Iterator
from typing import Any, BinaryIO

from marscli.config import RecordError, Request, SamplingOptions
from marscli.errors import InputError

#: Longest accepted input line, newline excluded. Longer lines become `line_too_long` errors
#: and are skipped in chunks, so memory stays bounded whatever the input.
MAX_LINE_BYTES = 8 * 1024 * 1024
#: Chunk size used to skip the rest of an over-long line.
DISCARD_CHUNK = 1024 * 1024
_MAX_STOP = 16
_SEED_LIMIT = 2**63
_ROLES = ("system", "user", "assistant")
_BATCH_URLS = {"/v1/chat/completions": "messages", "/v1/completions": "prompt"}
#: What a record may override: the sampling group of the options (config.SamplingOptions).
_OVERRIDE_KEYS = SamplingOptions.group("sampling")
#: The most completions one request may ask for (OpenAI's own limit for chat).
MAX_N = 128
#: The most alternatives per token `top_logprobs` (or a completions body's `logprobs`) may ask
#: for (OpenAI's chat limit).
MAX_TOP_LOGPROBS = 20
#: Keys of an OpenAI request body that marscli acts on (besides prompt / messages).
ACTED_ON_KEYS = frozenset(_OVERRIDE_KEYS) | {"max_completion_tokens", "n", "logprobs",
                                             "top_logprobs", "prompt", "messages"}
#: Keys that only identify a request or its caller: accepted quietly, never change a result.
IDENTIFYING_KEYS = frozenset({"model", "user", "metadata"})
#: OpenAI (and vLLM) request parameters that change what a user gets and that marscli does
#: not implement. In a batch body any unknown key is reported; in a plain record only these
#: are (other top-level keys are the user's own metadata).
OPENAI_PARAMETERS = frozenset({
    "response_format", "tools", "tool_choice", "functions", "function_call",
    "parallel_tool_calls", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "logit_bias", "min_p", "min_tokens", "best_of", "echo", "suffix", "stream",
    "stream_options", "reasoning_effort", "modalities", "audio", "prediction", "service_tier",
    "store", "web_search_options", "guided_json", "guided_regex", "guided_choice",
    "structured_outputs", "ignore_eos", "length_penalty", "use_beam_search",
})
#: Values at which a parameter changes nothing: given so, the key is accepted quietly.
NEUTRAL_VALUES: dict[str, tuple] = {
    "presence_penalty": (0,), "frequency_penalty": (0,), "repetition_penalty": (1,),
    "logit_bias": ({},), "min_p": (0,), "min_tokens": (0,), "best_of": (1,), "echo": (False,),
    "stream": (False,), "tools": ([],), "functions": ([],), "ignore_eos": (False,),
    "use_beam_search": (False,), "store": (False,), "suffix": ("",),
}
#: The one OpenAI chat content part type marscli reads (image_url, input_audio, file... need a
#: multimodal target).
_TEXT_PART = "text"
#: What joins the text parts of one message. OpenAI does not document how its own servers join
#: them; the open servers that take OpenAI requests for models whose chat template wants a
#: string join them with a newline: vLLM (entrypoints/chat_utils.py, "\n".join(texts)) and
#: llama.cpp (common/chat.cpp, concat_typed_text). Joining as they do gives a batch file the
#: same prompt here as there.
_PART_SEPARATOR = "\n"
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
        for item, _offset, _length in located_records(fh):
            yield item
    finally:
        if close:
            fh.close()


def located_records(fh: BinaryIO) -> Iterator[tuple[Request | RecordError, int, int]]:
    """(record, offset, length) per non-blank line: the record and where the bytes it was
    parsed from lie in the stream (the line without its newline, nor a leading BOM)."""
    index = 0
    for line_no, offset, raw, too_long in _read_lines(fh):
        if too_long:
            item: Request | RecordError = RecordError(
                index, line_no, str(index), ERR_TOO_LONG,
                f"line is longer than the limit of {MAX_LINE_BYTES} bytes",
            )
        else:
            item = parse_line(raw, index, line_no, offset)
        yield item, offset, len(raw)
        index += 1


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
            rest = fh.readline(DISCARD_CHUNK)
            offset += len(rest)
            if not rest:
                break
            if blank and rest.strip(_ASCII_WS):
                blank = False
            if rest.endswith(b"\n"):
                break
        if not blank:
            yield line_no, start, b"", True


def parse_line(raw: bytes, index: int, line: int, offset: int) -> Request | RecordError:
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
        obj = json.loads(text, parse_constant=reject_constant)
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


def reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed (JSON has no NaN or Infinity)")


def _validate(obj: Any, index: int, line: int) -> Request | RecordError:
    """Turn one decoded JSON value into a Request, or a RecordError naming the problem."""
    if not isinstance(obj, dict):
        return RecordError(
            index, line, str(index), ERR_RECORD, f"expected a JSON object, got {json_type(obj)}"
        )
    has_prompt = "prompt" in obj
    has_messages = "messages" in obj
    is_batch = "body" in obj or ("custom_id" in obj and not has_prompt and not has_messages)
    is_bench = not is_batch and not has_prompt and not has_messages and "turns" in obj
    id_key = "custom_id" if is_batch else "id"
    rid = str(index)
    ignored: list[str] = []
    try:
        if is_batch:
            rid = _batch_id(obj)
            prompt, messages, overrides = _batch_body(obj, ignored)
        elif is_bench:
            rid = _bench_id(obj, index)
            messages = [{"role": "user", "content": _first_turn(obj)}]
            prompt, overrides = None, _overrides(obj, "")
            overrides.update(_choice_options(obj, "", completions=False))
            ignored += _reported_keys(obj, "", body=False)
        else:
            rid = _plain_id(obj, index)
            prompt, messages = _prompt_or_messages(obj, "", ignored)
            overrides = _overrides(obj, "")
            overrides.update(_choice_options(obj, "", completions=False))
            ignored += _reported_keys(obj, "", body=False)
    except _Invalid as e:
        return RecordError(index, line, rid, ERR_RECORD, e.args[0], id_key=id_key)
    return Request(
        index=index, line=line, id=rid, prompt=prompt, messages=messages,
        overrides=overrides, id_key=id_key, ignored=ignored,
    )


def _reported_keys(obj: dict, prefix: str, *, body: bool,
                   acted: frozenset[str] = ACTED_ON_KEYS) -> list[str]:
    """The keys of `obj` that would change a result but that marscli does not act on, as
    key paths (`body.tools`). body: `obj` is an OpenAI request body (every unknown key counts),
    else a plain record (only OPENAI_PARAMETERS count: the rest is the user's metadata)."""
    out = []
    for key, value in obj.items():
        if key in acted or key in IDENTIFYING_KEYS or value is None:
            continue
        if not body and key not in OPENAI_PARAMETERS:
            continue
        if any(_same_value(value, v) for v in NEUTRAL_VALUES.get(key, ())):
            continue
        out.append(prefix + key)
    return out


def _same_value(a: Any, b: Any) -> bool:
    """JSON equality that keeps booleans apart from numbers (false is not 0)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    return a == b


def _choice_options(obj: dict, prefix: str, *, completions: bool) -> dict[str, Any]:
    """`n`, `logprobs` and `top_logprobs` -> overrides n, logprobs (bool), top_logprobs.

    Chat semantics (plain records, chat bodies): ``logprobs`` is a boolean and
    ``top_logprobs`` an int in [0, 20] that needs ``logprobs`` not false. A /v1/completions
    body takes ``logprobs`` as the int (the alternatives per token), as OpenAI's completions
    do; a plain record accepts that form too.
    """
    out: dict[str, Any] = {}
    n = obj.get("n")
    if n is not None:
        if not (_is_int(n) and 1 <= n <= MAX_N):
            raise _Invalid(f"'{prefix}n' must be an integer in [1, {MAX_N}], got {show_value(n)}")
        out["n"] = n
    lp = obj.get("logprobs")
    top = None if completions else obj.get("top_logprobs")
    if lp is not None:
        if isinstance(lp, bool) and not completions:
            out["logprobs"] = lp
        elif _is_int(lp) and 0 <= lp <= MAX_TOP_LOGPROBS:
            out["logprobs"], out["top_logprobs"] = True, lp
        else:
            want = (f"an integer in [0, {MAX_TOP_LOGPROBS}]" if completions
                    else f"a boolean (or an integer in [0, {MAX_TOP_LOGPROBS}])")
            raise _Invalid(f"'{prefix}logprobs' must be {want}, got {show_value(lp)}")
    if top is not None:
        if not (_is_int(top) and 0 <= top <= MAX_TOP_LOGPROBS):
            raise _Invalid(f"'{prefix}top_logprobs' must be an integer in "
                           f"[0, {MAX_TOP_LOGPROBS}], got {show_value(top)}")
        if lp is False:
            raise _Invalid(f"'{prefix}top_logprobs' needs '{prefix}logprobs': true")
        out["logprobs"], out["top_logprobs"] = True, top
    return out


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
        raise _Invalid(f"'custom_id' must be a non-empty string, got {show_value(cid)}")
    _check_text("custom_id", cid)
    return cid


def _id_value(value: Any, key: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise _Invalid(f"'{key}' must be a string or an integer, got {show_value(value)}")
    if isinstance(value, str):
        _check_text(key, value)
    return str(value)


def _batch_body(obj: dict, ignored: list[str]) -> tuple[str | None, list[dict[str, str]] | None,
                                                         dict[str, Any]]:
    method = obj.get("method", "POST")
    if method != "POST":
        raise _Invalid(f"'method' must be \"POST\", got {show_value(method)}")
    url = obj.get("url")
    if url is not None and url not in _BATCH_URLS:
        raise _Invalid(
            f"unsupported 'url' {show_value(url)}: expected \"/v1/chat/completions\" or "
            "\"/v1/completions\""
        )
    if "body" not in obj:
        raise _Invalid("OpenAI batch line has no 'body'")
    body = obj["body"]
    if not isinstance(body, dict):
        raise _Invalid(f"'body' must be a JSON object, got {json_type(body)}")
    prompt, messages = _prompt_or_messages(body, "body.", ignored)
    if url is not None:
        want = _BATCH_URLS[url]
        got = "prompt" if prompt is not None else "messages"
        if want != got:
            raise _Invalid(f"'body.{got}' does not fit url {show_value(url)}, which needs '{want}'")
    overrides = _overrides(body, "body.")
    mct = body.get("max_completion_tokens")
    if mct is not None:
        if "max_tokens" in overrides:
            raise _Invalid("give only one of 'body.max_tokens' and 'body.max_completion_tokens'")
        overrides["max_tokens"] = _int_at_least(mct, "body.max_completion_tokens", 1)
    completions = url == "/v1/completions" or (url is None and prompt is not None)
    overrides.update(_choice_options(body, "body.", completions=completions))
    # top_logprobs is a chat key: a completions body asks with its int logprobs.
    acted = ACTED_ON_KEYS - {"top_logprobs"} if completions else ACTED_ON_KEYS
    ignored += _reported_keys(body, "body.", body=True, acted=acted)
    return prompt, messages, overrides


def _first_turn(obj: dict) -> str:
    turns = obj["turns"]
    if not isinstance(turns, list) or not turns:
        raise _Invalid(f"'turns' must be a non-empty array of strings, got {show_value(turns)}")
    first = turns[0]
    if not isinstance(first, str):
        raise _Invalid(f"turns[0] must be a string, got {show_value(first)}")
    if not first.strip():
        raise _Invalid("turns[0] must not be empty or whitespace-only")
    _check_text("turns[0]", first)
    return first


def _prompt_or_messages(
    obj: dict, prefix: str, ignored: list[str] | None = None
) -> tuple[str | None, list[dict[str, str]] | None]:
    has_prompt = "prompt" in obj
    has_messages = "messages" in obj
    if has_prompt and has_messages:
        raise _Invalid(f"record has both '{prefix}prompt' and '{prefix}messages'; give one")
    if has_prompt:
        return _prompt(obj["prompt"], f"{prefix}prompt"), None
    if has_messages:
        return None, _messages(obj["messages"], f"{prefix}messages", ignored)
    raise _Invalid(f"record has neither '{prefix}prompt' nor '{prefix}messages'")


def _prompt(value: Any, key: str) -> str:
    if not isinstance(value, str):
        raise _Invalid(f"'{key}' must be a non-empty string, got {show_value(value)}")
    if not value.strip():
        raise _Invalid(f"'{key}' must not be empty or whitespace-only")
    _check_text(key, value)
    return value


def _messages(value: Any, key: str, ignored: list[str] | None = None) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise _Invalid(
            f"'{key}' must be a non-empty array of message objects, got {show_value(value)}"
        )
    out = []
    for where, msg in _objects(value, key, "an object"):
        role = _string_field(msg, "role", where)
        if role not in _ROLES:
            raise _Invalid(
                f"{where}.role: unknown role {show_value(role)} "
                "(expected system, user or assistant)"
            )
        if "content" not in msg:
            raise _Invalid(f"{where}.content is missing")
        content = _content(msg["content"], f"{where}.content")
        # Only role and content go on: extra keys (name, tool_calls...) are reported.
        if ignored is not None:
            ignored += [f"{where}.{k}" for k, v in msg.items()
                        if k not in ("role", "content") and v is not None]
        out.append({"role": role, "content": content})
    return out


def _objects(items: list, where: str, what: str) -> Iterator[tuple[str, dict]]:
    """(its path, the item) for each item of a JSON array that must hold objects (``what``
    names one in the error: "an object", "a content part object")."""
    for i, item in enumerate(items):
        at = f"{where}[{i}]"
        if not isinstance(item, dict):
            raise _Invalid(f"{at} must be {what}, got {json_type(item)}")
        yield at, item


def _string_field(obj: dict, key: str, where: str) -> str:
    """obj[key], which must be there and be a string (errors name `where`.key)."""
    if key not in obj:
        raise _Invalid(f"{where}.{key} is missing")
    value = obj[key]
    if not isinstance(value, str):
        raise _Invalid(f"{where}.{key} must be a string, got {show_value(value)}")
    return value


def _content(value: Any, where: str) -> str:
    """A message's content: a string, or OpenAI content parts whose text parts are joined.

    Real OpenAI batch files often send ``[{"type": "text", "text": "..."}, ...]``. Only text
    parts are supported (an image or audio part needs a multimodal target); any other part is
    an error naming its position and type.
    """
    if isinstance(value, str):
        _check_text(where, value)
        return value
    if not isinstance(value, list):
        raise _Invalid(
            f"{where} must be a string, got {show_value(value)} (or an array of content parts)"
        )
    if not value:
        raise _Invalid(f"{where} must be a string or a non-empty array of content parts, "
                       "got an empty array")
    texts = []
    for at, part in _objects(value, where, "a content part object"):
        kind = _string_field(part, "type", at)
        if kind != _TEXT_PART:
            raise _Invalid(f"{at}: part type {show_value(kind)} is not supported (text only)")
        text = _string_field(part, "text", at)
        _check_text(f"{at}.text", text)
        texts.append(text)
    return _PART_SEPARATOR.join(texts)


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
                raise _Invalid(
                    f"'{name}' must be an integer in [0, 2**63), got {show_value(value)}"
                )
        elif key == "temperature":
            if is_number(value) and value >= 0:
                out[key] = float(value)
            else:
                raise _Invalid(f"'{name}' must be a number >= 0, got {show_value(value)}")
        elif key == "top_p":
            if is_number(value) and 0 < value <= 1:
                out[key] = float(value)
            else:
                raise _Invalid(f"'{name}' must be a number in (0, 1], got {show_value(value)}")
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
            f"got {show_value(value)}"
        )
    for s in items:
        _check_text(name, s)
    return list(items)


def _int_at_least(value: Any, name: str, low: int) -> int:
    if _is_int(value) and value >= low:
        return value
    raise _Invalid(f"'{name}' must be an integer >= {low}, got {show_value(value)}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
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


def json_type(value: Any) -> str:
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


def show_value(value: Any, limit: int = 40) -> str:
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
    return f"an {json_type(value)}" if isinstance(value, (list, dict)) else json_type(value)
