"""Tests of marscli.io.input_index.index_input: the input read once into compact refs, records
parsed again on demand into the very Requests read_requests gives."""

from __future__ import annotations

import hashlib
import io
import json
import sys
import types

import pytest

import marscli.io.records as records
from marscli.config import RecordError, Request
from marscli.errors import InputError
from marscli.io.input_index import RecordRef, index_input, read_input
from marscli.io.records import read_requests


def j(obj) -> str:
    return json.dumps(obj)


def varied() -> bytes:
    """Every kind of line: BOM, blank lines, CRLF, bad bytes, bad JSON, an over-long line,
    OpenAI batch lines, messages, overrides, ignored keys, explicit and implicit ids."""
    lines = [
        b"\xef\xbb\xbf" + j({"prompt": "after a BOM"}).encode(),
        b"",
        b"   \t",
        j({"id": "x", "prompt": "p", "max_tokens": 5, "temperature": 0.5, "stop": "."}).encode() + b"\r",
        b'{"prompt": "bad \xff byte"}',
        b'{"prompt": "no end',
        j({"prompt": "c" * 200}).encode(),  # over-long under the test's limit
        j({"custom_id": "req-1", "method": "POST", "url": "/v1/chat/completions",
           "body": {"model": "m", "messages": [{"role": "user", "content": [
               {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
               "max_completion_tokens": 7, "tools": [{"x": 1}]}}).encode(),
        j({"custom_id": "req-2", "body": {"prompt": "complete", "logprobs": 2}}).encode(),
        j({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u",
                                                              "name": "n"}],
           "n": 2, "seed": 3, "presence_penalty": 0.5}).encode(),
        j({"id": 70, "prompt": "int id", "top_k": 4, "logprobs": True, "top_logprobs": 3}).encode(),
        j({"question_id": 81, "category": "c", "turns": ["first", "second"]}).encode(),
        j({"id": "e", "prompt": ""}).encode(),
        j(["not", "an", "object"]).encode(),
        j({"prompt": "ünïcödé ✓ \u2028 line"}).encode(),
        j({"prompt": "last, no newline"}).encode(),
    ]
    return b"\n".join(lines)


@pytest.fixture
def short_lines(monkeypatch):
    monkeypatch.setattr(records, "MAX_LINE_BYTES", 190)
    monkeypatch.setattr(records, "DISCARD_CHUNK", 16)


def test_index_gives_the_requests_read_requests_gives(tmp_path, short_lines):
    data = varied()
    src = tmp_path / "in.jsonl"
    src.write_bytes(data)
    expected = list(read_requests(io.BytesIO(data)))
    assert {type(it) for it in expected} == {Request, RecordError}
    assert {it.type for it in expected if isinstance(it, RecordError)} == {
        "invalid_encoding", "invalid_json", "line_too_long", "invalid_record"}
    with index_input(str(src), digest=True) as index:
        assert [(it.index, it.line, it.id) for it in index.items] == [
            (it.index, it.line, it.id) for it in expected]
        assert list(index.requests(index.items)) == expected
        # Any order, any subset (a rank's shard), one at a time.
        some = index.items[::-3]
        assert list(index.requests(some)) == [expected[it.index] for it in some]
        assert index.sha256 == hashlib.sha256(data).hexdigest()
        # What the run's note needs: the ignored keys, without parsing again.
        assert [it.ignored for it in index.items if isinstance(it, RecordRef) and it.ignored] == [
            it.ignored for it in expected if isinstance(it, Request) and it.ignored]


def test_index_of_stdin_reads_back_from_a_spool(monkeypatch, short_lines):
    data = varied()
    monkeypatch.setattr("sys.stdin", types.SimpleNamespace(buffer=io.BytesIO(data)))
    index = index_input("-", digest=True)
    assert list(index.requests(index.items)) == list(read_requests(io.BytesIO(data)))
    assert index.sha256 == hashlib.sha256(data).hexdigest()
    assert not sys.stdin.buffer.read()  # read to the end, once
    index.close()
    index.close()
    with pytest.raises(ValueError, match="closed"):
        index.request(index.items[0])


def test_index_matches_read_input_limit_and_digest(tmp_path, monkeypatch):
    data = b"".join(f'{{"id": "{i}", "prompt": "p{i}"}}\n'.encode() for i in range(5))
    src = tmp_path / "in.jsonl"
    src.write_bytes(data)
    whole = hashlib.sha256(data).hexdigest()
    for limit in (None, 0, 2, 9):
        items, sha = read_input(str(src), limit=limit, digest=True)
        with index_input(str(src), limit=limit, digest=True) as index:
            assert list(index.requests(index.items)) == items
            assert index.sha256 == sha == whole
    with index_input(str(src)) as index:
        assert index.sha256 is None
    monkeypatch.setattr("sys.stdin", types.SimpleNamespace(buffer=io.BytesIO(data)))
    with index_input("-", limit=1, digest=True) as index:
        assert [r.prompt for r in index.requests(index.items)] == ["p0"]
        assert index.sha256 == whole


def test_duplicate_ids_are_rejected_naming_both_lines(tmp_path, monkeypatch):
    src = tmp_path / "in.jsonl"
    src.write_bytes(b'{"id": "a", "prompt": "x"}\n\n{"id": "a", "prompt": "y"}\n')
    with pytest.raises(InputError, match="duplicate id 'a' on lines 1 and 3"):
        index_input(str(src))
    # An implicit id clashes like any other; a bad record's id counts too.
    src.write_bytes(b'{"prompt": "x"}\n{"id": "0", "prompt": "y"}\n')
    with pytest.raises(InputError, match="duplicate id '0' on lines 1 and 2"):
        index_input(str(src))
    monkeypatch.setattr("sys.stdin", types.SimpleNamespace(
        buffer=io.BytesIO(b'{"id": 1, "prompt": "x"}\n{"id": "1", "prompt": 3}\n')))
    with pytest.raises(InputError, match="duplicate id '1' on lines 1 and 2"):
        index_input("-")
    with pytest.raises(InputError, match="input file not found"):
        index_input(str(tmp_path / "nope.jsonl"))


def test_a_ref_holds_no_record_text(tmp_path):
    prompt = "word " * 2000
    src = tmp_path / "in.jsonl"
    src.write_bytes((j({"id": "r", "prompt": prompt, "messages_note": "m"}) + "\n").encode())
    with index_input(str(src)) as index:
        (ref,) = index.items
        assert isinstance(ref, RecordRef)
        assert not hasattr(ref, "prompt") and not hasattr(ref, "messages")
        assert not hasattr(ref, "__dict__")
        held = sys.getsizeof(ref) + sum(sys.getsizeof(getattr(ref, a)) for a in RecordRef.__slots__)
        assert held < 400 < len(prompt)
        assert next(index.requests([ref])).prompt == prompt


def test_a_changed_input_is_an_input_error(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_bytes(b'{"id": "a", "prompt": "x"}\n{"id": "b", "prompt": "y"}\n')
    with index_input(str(src)) as index:
        src.write_bytes(b'{"id": "z", "prompt": "x"}\n{"id": "b", "prompt": "y"}\n')
        with pytest.raises(InputError, match="line 1 is not what it was"):
            list(index.requests(index.items))
