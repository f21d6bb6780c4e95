"""Tests of marscli.io: record validation, reading, ordered writing, atomic writes."""

from __future__ import annotations

import io
import json
import os
import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import marscli.io as mio
from marscli.config import RecordError, Request, SamplingParams
from marscli.errors import InputError, MarscliError
from marscli.io import (
    ResultWriter,
    atomic_write_text,
    dump_json_line,
    find_duplicate_ids,
    read_requests,
)


def read_bytes(data: bytes) -> list[Request | RecordError]:
    return list(read_requests(io.BytesIO(data)))


def read_one(line: str | bytes) -> Request | RecordError:
    raw = line.encode("utf-8") if isinstance(line, str) else line
    items = read_bytes(raw + b"\n")
    assert len(items) == 1
    return items[0]


def j(obj) -> str:
    return json.dumps(obj)


# ---------------------------------------------------------------------------------------------
# Error cases: (line, type, message fragment)

ERROR_CASES = [
    # encoding / JSON
    (b'{"prompt": "caf\xe9"}', "invalid_encoding", "UTF-8"),
    (b'{"prompt": "caf\xe9"}', "invalid_encoding", "byte offset 15"),
    ('{"prompt": "hi"', "invalid_json", "Expecting"),
    ("not json", "invalid_json", "Expecting value"),
    ('{"prompt": "hi", "temperature": NaN}', "invalid_json", "NaN"),
    ('{"prompt": "hi", "temperature": Infinity}', "invalid_json", "Infinity"),
    ('{"prompt": "hi", "temperature": -Infinity}', "invalid_json", "Infinity"),
    ("[" * 100_000, "invalid_json", "invalid JSON"),
    ('{"prompt": "hi", "x": ' + "9" * 5000 + "}", "invalid_json", "invalid JSON"),
    # shape
    ('["prompt", "hi"]', "invalid_record", "expected a JSON object, got array"),
    ('"hello"', "invalid_record", "expected a JSON object, got string"),
    ("42", "invalid_record", "expected a JSON object, got number"),
    ("null", "invalid_record", "expected a JSON object, got null"),
    ("true", "invalid_record", "expected a JSON object, got boolean"),
    ("{}", "invalid_record", "record has neither 'prompt' nor 'messages'"),
    ('{"id": "a", "text": "hi"}', "invalid_record", "neither 'prompt' nor 'messages'"),
    (j({"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}),
     "invalid_record", "both 'prompt' and 'messages'"),
    # prompt
    (j({"prompt": 42}), "invalid_record", "'prompt' must be a non-empty string, got 42"),
    (j({"prompt": None}), "invalid_record", "'prompt' must be a non-empty string, got null"),
    (j({"prompt": ["a"]}), "invalid_record", "'prompt'"),
    (j({"prompt": ""}), "invalid_record", "'prompt' must not be empty"),
    (j({"prompt": " \n\t "}), "invalid_record", "'prompt' must not be empty"),
    ('{"prompt": "bad \\ud800 surrogate"}', "invalid_record", "'prompt' contains an unpaired"),
    # messages
    (j({"messages": []}), "invalid_record", "'messages' must be a non-empty array"),
    (j({"messages": "hi"}), "invalid_record", "'messages' must be a non-empty array"),
    (j({"messages": {"role": "user"}}), "invalid_record", "'messages'"),
    (j({"messages": ["hi"]}), "invalid_record", "messages[0] must be an object, got string"),
    (j({"messages": [{"content": "hi"}]}), "invalid_record", "messages[0].role is missing"),
    (j({"messages": [{"role": "user"}]}), "invalid_record", "messages[0].content is missing"),
    (j({"messages": [{"role": 1, "content": "hi"}]}), "invalid_record",
     "messages[0].role must be a string, got 1"),
    (j({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                     {"role": "bot", "content": "c"}]}),
     "invalid_record", "messages[2].role: unknown role 'bot'"),
    (j({"messages": [{"role": "user", "content": None}]}), "invalid_record",
     "messages[0].content must be a string, got null"),
    (j({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}),
     "invalid_record", "messages[0].content must be a string, got an array"),
    # overrides
    (j({"prompt": "hi", "max_tokens": 0}), "invalid_record",
     "'max_tokens' must be an integer >= 1, got 0"),
    (j({"prompt": "hi", "max_tokens": True}), "invalid_record",
     "'max_tokens' must be an integer >= 1, got true"),
    (j({"prompt": "hi", "max_tokens": 5.0}), "invalid_record", "'max_tokens'"),
    (j({"prompt": "hi", "max_tokens": "5"}), "invalid_record", "got '5'"),
    (j({"prompt": "hi", "temperature": "hot"}), "invalid_record",
     "'temperature' must be a number >= 0, got 'hot'"),
    (j({"prompt": "hi", "temperature": -0.1}), "invalid_record", "'temperature'"),
    (j({"prompt": "hi", "temperature": False}), "invalid_record", "'temperature'"),
    ('{"prompt": "hi", "temperature": 1e999}', "invalid_record", "'temperature'"),
    (j({"prompt": "hi", "top_p": 0}), "invalid_record", "'top_p' must be a number in (0, 1]"),
    (j({"prompt": "hi", "top_p": 1.5}), "invalid_record", "'top_p'"),
    (j({"prompt": "hi", "top_p": True}), "invalid_record", "'top_p'"),
    (j({"prompt": "hi", "top_k": -1}), "invalid_record", "'top_k' must be an integer >= 0"),
    (j({"prompt": "hi", "top_k": 2.5}), "invalid_record", "'top_k'"),
    (j({"prompt": "hi", "seed": -1}), "invalid_record", "'seed' must be an integer in [0, 2**63)"),
    (j({"prompt": "hi", "seed": 2**63}), "invalid_record", "'seed'"),
    (j({"prompt": "hi", "seed": True}), "invalid_record", "'seed'"),
    (j({"prompt": "hi", "stop": ""}), "invalid_record", "'stop' must be a string or a list"),
    (j({"prompt": "hi", "stop": ["a", ""]}), "invalid_record", "'stop'"),
    (j({"prompt": "hi", "stop": ["a", 1]}), "invalid_record", "'stop'"),
    (j({"prompt": "hi", "stop": 5}), "invalid_record", "'stop'"),
    (j({"prompt": "hi", "stop": ["x"] * 17}), "invalid_record", "at most 16"),
    # ids
    (j({"id": True, "prompt": "hi"}), "invalid_record", "'id' must be a string or an integer"),
    (j({"id": 1.5, "prompt": "hi"}), "invalid_record", "'id'"),
    (j({"id": None, "prompt": "hi"}), "invalid_record", "got null"),
    (j({"id": ["a"], "prompt": "hi"}), "invalid_record", "got an array"),
    # OpenAI batch lines
    (j({"method": "POST", "url": "/v1/chat/completions",
        "body": {"messages": [{"role": "user", "content": "hi"}]}}),
     "invalid_record", "no 'custom_id'"),
    (j({"custom_id": 7, "body": {"prompt": "hi"}}), "invalid_record",
     "'custom_id' must be a non-empty string, got 7"),
    (j({"custom_id": "r1", "method": "GET", "body": {"prompt": "hi"}}), "invalid_record",
     "'method'"),
    (j({"custom_id": "r1", "url": "/v1/embeddings", "body": {"prompt": "hi"}}),
     "invalid_record", "unsupported 'url'"),
    (j({"custom_id": "r1", "url": "/v1/chat/completions"}), "invalid_record", "no 'body'"),
    (j({"custom_id": "r1", "body": "hi"}), "invalid_record", "'body' must be a JSON object"),
    (j({"custom_id": "r1", "body": {}}), "invalid_record",
     "neither 'body.prompt' nor 'body.messages'"),
    (j({"custom_id": "r1", "url": "/v1/chat/completions", "body": {"prompt": "hi"}}),
     "invalid_record", "needs 'messages'"),
    (j({"custom_id": "r1", "url": "/v1/completions",
        "body": {"messages": [{"role": "user", "content": "hi"}]}}),
     "invalid_record", "needs 'prompt'"),
    (j({"custom_id": "r1", "body": {"messages": [{"role": "bot", "content": "x"}]}}),
     "invalid_record", "body.messages[0].role: unknown role 'bot'"),
    (j({"custom_id": "r1", "body": {"prompt": "hi", "temperature": "hot"}}),
     "invalid_record", "'body.temperature' must be a number >= 0"),
    (j({"custom_id": "r1", "body": {"prompt": "hi", "max_completion_tokens": 0}}),
     "invalid_record", "'body.max_completion_tokens' must be an integer >= 1"),
    (j({"custom_id": "r1", "body": {"prompt": "hi", "max_tokens": 5,
                                     "max_completion_tokens": 6}}),
     "invalid_record", "only one of"),
    (j({"custom_id": "r1", "body": {"prompt": ["a", "b"]}}), "invalid_record",
     "'body.prompt' must be a non-empty string, got an array"),
    # benchmark prompt sets
    (j({"question_id": 81, "category": "writing", "turns": []}), "invalid_record", "'turns'"),
    (j({"question_id": 81, "category": "writing", "turns": "hi"}), "invalid_record", "'turns'"),
    (j({"question_id": 81, "turns": [3]}), "invalid_record", "turns[0] must be a string"),
    (j({"question_id": 81, "turns": ["  "]}), "invalid_record", "turns[0] must not be empty"),
    (j({"question_id": True, "turns": ["hi"]}), "invalid_record", "'question_id'"),
]


@pytest.mark.parametrize(("line", "etype", "fragment"), ERROR_CASES)
def test_error_cases(line, etype, fragment):
    item = read_one(line)
    assert isinstance(item, RecordError), item
    assert item.type == etype
    assert fragment in item.message
    assert "\n" not in item.message
    assert len(item.message) < 300
    assert item.index == 0 and item.line == 1
    assert item.as_error() == {"type": etype, "message": item.message, "line": 1}


@pytest.mark.parametrize(
    ("line", "rid", "id_key"),
    [
        (j({"id": "abc", "prompt": 42}), "abc", "id"),
        (j({"id": 17, "prompt": "hi", "top_p": 2}), "17", "id"),
        (j({"custom_id": "req-9", "body": {"prompt": ""}}), "req-9", "custom_id"),
        (j({"custom_id": 5, "body": {"prompt": "hi"}}), "0", "custom_id"),
        (j({"question_id": 81, "turns": []}), "81", "id"),
        ("not json", "0", "id"),
        (j({"id": True, "prompt": "hi"}), "0", "id"),
    ],
)
def test_record_error_keeps_id_when_known(line, rid, id_key):
    item = read_one(line)
    assert isinstance(item, RecordError)
    assert (item.id, item.id_key) == (rid, id_key)


# ---------------------------------------------------------------------------------------------
# Valid formats


def test_prompt_record_with_overrides():
    item = read_one(j({
        "id": "q1", "prompt": "Hello", "max_tokens": 12, "temperature": 0.7, "top_p": 0.9,
        "top_k": 40, "seed": 2**63 - 1, "stop": "\n\n", "meta": {"anything": [1, 2]},
    }))
    assert isinstance(item, Request)
    assert item.id == "q1" and item.id_key == "id"
    assert item.prompt == "Hello" and item.messages is None
    assert item.overrides == {
        "max_tokens": 12, "temperature": 0.7, "top_p": 0.9, "top_k": 40,
        "seed": 2**63 - 1, "stop": ["\n\n"],
    }
    params = SamplingParams().with_overrides(item.overrides)
    assert params.stop == ("\n\n",) and params.max_tokens == 12


def test_integer_numbers_and_nulls():
    item = read_one(j({"id": 5, "prompt": "x", "temperature": 1, "top_p": 1, "seed": None,
                       "stop": None, "max_tokens": None}))
    assert isinstance(item, Request)
    assert item.id == "5"
    assert item.overrides == {"temperature": 1.0, "top_p": 1.0}
    assert isinstance(item.overrides["temperature"], float)


def test_messages_record_keeps_only_role_and_content():
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi", "name": "bob"},
        {"role": "assistant", "content": ""},
    ]
    item = read_one(j({"messages": msgs, "stop": ["a", "b"]}))
    assert isinstance(item, Request)
    assert item.prompt is None
    assert item.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": ""},
    ]
    assert item.overrides == {"stop": ["a", "b"]}
    assert item.id == "0"


def test_openai_chat_batch_line():
    item = read_one(j({
        "custom_id": "request-1", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": "gpt-4o", "messages": [{"role": "user", "content": "Hi"}],
                 "max_completion_tokens": 33, "temperature": 0, "n": 1},
    }))
    assert isinstance(item, Request)
    assert (item.id, item.id_key) == ("request-1", "custom_id")
    assert item.messages == [{"role": "user", "content": "Hi"}]
    assert item.overrides == {"max_tokens": 33, "temperature": 0.0}


def test_openai_completions_batch_line_without_url():
    item = read_one(j({"custom_id": "c", "body": {"prompt": "Once", "max_tokens": 4,
                                                   "seed": 3, "stop": ["."]}}))
    assert isinstance(item, Request)
    assert item.prompt == "Once"
    assert item.overrides == {"max_tokens": 4, "seed": 3, "stop": ["."]}


def test_benchmark_prompt_set_uses_first_turn():
    item = read_one(j({"question_id": 81, "category": "writing",
                       "turns": ["Write a poem.", "Now shorter."], "reference": ["x"]}))
    assert isinstance(item, Request)
    assert item.id == "81" and item.id_key == "id"
    assert item.messages == [{"role": "user", "content": "Write a poem."}]
    assert item.prompt is None


def test_unknown_keys_ignored_and_misspellings_not_special():
    item = read_one(j({"prompt": "x", "temprature": "hot", "maxtokens": -1}))
    assert isinstance(item, Request) and item.overrides == {}


def test_bom_on_first_line_is_ignored():
    items = read_bytes(b"\xef\xbb\xbf" + j({"prompt": "x"}).encode() + b"\n")
    assert isinstance(items[0], Request)


def test_line_numbers_indices_and_blank_lines():
    data = (
        b"\n"
        + j({"prompt": "a"}).encode() + b"\n"
        + b"   \t \r\n"
        + b"oops\n"
        + b"\n"
        + j({"prompt": "c"}).encode() + b"\r\n"
        + j({"prompt": "d"}).encode()  # no final newline
    )
    items = read_bytes(data)
    assert [(it.index, it.line) for it in items] == [(0, 2), (1, 4), (2, 6), (3, 7)]
    assert [type(it).__name__ for it in items] == ["Request", "RecordError", "Request", "Request"]
    assert [it.id for it in items] == ["0", "1", "2", "3"]


def test_invalid_utf8_does_not_spoil_other_lines():
    data = b'{"prompt": "a"}\n{"prompt": "\xff\xfe"}\n{"prompt": "b"}\n'
    items = read_bytes(data)
    assert [type(it).__name__ for it in items] == ["Request", "RecordError", "Request"]
    err = items[1]
    assert err.type == "invalid_encoding" and err.line == 2
    # file offset: 16 bytes of line 1, then 12 bytes into line 2
    assert "byte offset 28" in err.message and "12 into the line" in err.message


def test_long_line(monkeypatch):
    monkeypatch.setattr(mio, "MAX_LINE_BYTES", 32)
    monkeypatch.setattr(mio, "_DISCARD_CHUNK", 7)
    ok = j({"prompt": "a" * 10}).encode()  # 24 bytes
    exact = j({"prompt": "b" * 18}).encode()  # 32 bytes: at the limit, accepted
    long = j({"prompt": "c" * 200}).encode()
    data = b"\n".join([ok, long, exact, b" " * 100, long, ok]) + b"\n"
    items = read_bytes(data)
    assert [(type(it).__name__, it.line) for it in items] == [
        ("Request", 1), ("RecordError", 2), ("Request", 3), ("RecordError", 5), ("Request", 6),
    ]
    assert len(exact) == 32
    assert items[1].type == "line_too_long" and "32 bytes" in items[1].message
    assert items[2].prompt == "b" * 18
    # over-long final line without newline
    items = read_bytes(ok + b"\n" + long)
    assert items[-1].type == "line_too_long" and items[-1].line == 2


def test_long_line_memory_is_bounded(monkeypatch):
    calls = []

    class Spy(io.BytesIO):
        def readline(self, size=-1):
            calls.append(size)
            return super().readline(size)

    monkeypatch.setattr(mio, "MAX_LINE_BYTES", 100)
    items = list(read_requests(Spy(b"x" * 10_000 + b"\n" + j({"prompt": "a"}).encode())))
    assert [type(it).__name__ for it in items] == ["RecordError", "Request"]
    assert all(0 < size <= mio._DISCARD_CHUNK for size in calls)


def test_path_source(tmp_path):
    p = tmp_path / "in.jsonl"
    p.write_bytes(b'{"prompt": "a"}\n\n{"prompt": "b"}\n')
    for src in (p, str(p)):
        items = list(read_requests(src))
        assert [it.prompt for it in items] == ["a", "b"]
        assert [it.line for it in items] == [1, 3]


def test_missing_file_raises_input_error_at_call(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(InputError, match="input file not found: .*nope.jsonl"):
        read_requests(missing)  # no iteration needed
    with pytest.raises(InputError, match="directory"):
        read_requests(tmp_path)


def test_stdin_dash(monkeypatch):
    buf = io.BytesIO(b'{"prompt": "from stdin"}\n')
    monkeypatch.setattr("sys.stdin", types.SimpleNamespace(buffer=buf))
    items = list(read_requests("-"))
    assert [it.prompt for it in items] == ["from stdin"]


def test_text_stream_uses_its_buffer():
    text = io.TextIOWrapper(io.BytesIO(b'{"prompt": "t"}\n'), encoding="utf-8")
    assert [it.prompt for it in read_requests(text)] == ["t"]
    with pytest.raises(TypeError):
        list(read_requests(io.StringIO('{"prompt": "t"}\n')))


def test_find_duplicate_ids():
    data = "\n".join([
        j({"id": "a", "prompt": "x"}),
        j({"id": "b", "prompt": "x"}),
        "",
        "bad json",  # index 2 -> id "2"
        j({"id": "b", "prompt": "y"}),
        j({"id": 2, "prompt": "z"}),
    ]).encode()
    items = read_bytes(data)
    assert find_duplicate_ids(items) == ("b", 2, 5)
    assert find_duplicate_ids(items[:3] + items[4:]) == ("2", 4, 6)
    assert find_duplicate_ids(items[:2]) is None
    assert find_duplicate_ids([]) is None


# ---------------------------------------------------------------------------------------------
# Property test: nothing on a line makes the reader raise


def _json_values():
    keys = st.sampled_from([
        "id", "prompt", "messages", "role", "content", "max_tokens", "temperature", "top_p",
        "top_k", "seed", "stop", "custom_id", "method", "url", "body", "max_completion_tokens",
        "question_id", "turns", "/v1/chat/completions",
    ]) | st.text(max_size=8)
    scalars = (st.none() | st.booleans() | st.integers() | st.floats()
               | st.sampled_from(["user", "POST", "/v1/completions", "bot", "", " "])
               | st.text(max_size=12))
    return st.recursive(
        scalars,
        lambda children: st.lists(children, max_size=5)
        | st.dictionaries(keys, children, max_size=6),
        max_leaves=25,
    )


def _expected_record_lines(data: bytes) -> list[int]:
    parts = data.split(b"\n")
    if parts and parts[-1] == b"":
        parts.pop()
    out = []
    for n, part in enumerate(parts, 1):
        if n == 1 and part.startswith(b"\xef\xbb\xbf"):
            part = part[3:]
        if part.strip():
            out.append(n)
    return out


def _check_items(items, lines):
    assert [it.line for it in items] == lines
    assert [it.index for it in items] == list(range(len(lines)))
    for it in items:
        assert isinstance(it, (Request, RecordError))
        assert isinstance(it.id, str)
        if isinstance(it, RecordError):
            assert it.message and "\n" not in it.message
            json.dumps(it.as_error())
        else:
            assert (it.prompt is None) != (it.messages is None)
            SamplingParams().with_overrides(it.overrides)
            dump_json_line({"id": it.id, "prompt": it.prompt, "messages": it.messages}).encode()


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=300))
def test_arbitrary_bytes_never_raise(data):
    items = list(read_requests(io.BytesIO(data)))
    _check_items(items, _expected_record_lines(data))


@settings(max_examples=250, deadline=None)
@given(st.lists(_json_values(), max_size=6), st.booleans())
def test_arbitrary_json_never_raises(values, ascii_only):
    lines = [json.dumps(v, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")
             for v in values]
    data = b"\n".join(lines)
    items = list(read_requests(io.BytesIO(data)))
    assert len(items) == len(values)
    _check_items(items, list(range(1, len(values) + 1)))


# ---------------------------------------------------------------------------------------------
# Writing


class FlushSpy(io.StringIO):
    def __init__(self):
        super().__init__()
        self.flushed: list[str] = []

    def flush(self):
        super().flush()
        self.flushed.append(self.getvalue())


def test_dump_json_line():
    assert dump_json_line({"b": 1, "a": "é", "c": [1, 2]}) == '{"b": 1, "a": "é", "c": [1, 2]}'
    with pytest.raises(ValueError):
        dump_json_line({"x": float("nan")})


def test_writer_reorders_and_flushes_per_line():
    out = FlushSpy()
    w = ResultWriter(out)
    w.write(2, {"i": 2})
    w.write(1, {"i": 1})
    assert out.getvalue() == ""
    assert w.pending == [1, 2]
    w.write(0, {"i": 0})
    assert out.getvalue() == '{"i": 0}\n{"i": 1}\n{"i": 2}\n'
    assert out.flushed[:3] == ['{"i": 0}\n', '{"i": 0}\n{"i": 1}\n',
                               '{"i": 0}\n{"i": 1}\n{"i": 2}\n']
    assert w.written == 3 and w.next_index == 3
    w.close(strict=True, total=3)
    assert not out.closed  # a stream we did not open stays open


def test_writer_start_index_and_skip():
    out = io.StringIO()
    w = ResultWriter(out, start_index=5, skip={6, 8})
    w.write(7, {"i": 7})
    assert out.getvalue() == ""
    w.write(5, {"i": 5})
    assert [json.loads(x)["i"] for x in out.getvalue().splitlines()] == [5, 7]
    assert w.next_index == 9
    for bad in (4, 5, 6, 8):
        with pytest.raises(ValueError):
            w.write(bad, {})
    w.close(strict=True)


def test_writer_skip_at_start():
    out = io.StringIO()
    w = ResultWriter(out, skip=[0, 1])
    assert w.next_index == 2
    w.write(2, {"i": 2})
    assert out.getvalue() == '{"i": 2}\n'


def test_writer_close_strict_reports_gaps():
    out = io.StringIO()
    w = ResultWriter(out)
    w.write(0, {})
    w.write(2, {})
    with pytest.raises(RuntimeError, match="missing for indices 1"):
        w.close(strict=True)
    assert out.getvalue() == "{}\n"  # results behind a gap are not written

    w = ResultWriter(io.StringIO())
    w.write(0, {})
    with pytest.raises(RuntimeError, match="1, 2"):
        w.close(strict=True, total=3)

    w = ResultWriter(io.StringIO())
    w.write(1, {})
    w.close()  # not strict: no error
    with pytest.raises(ValueError):
        w.write(0, {})


def test_writer_file_dest_and_append(tmp_path):
    p = tmp_path / "out.jsonl"
    with ResultWriter(p) as w:
        w.write(0, {"id": "a", "text": "ü"})
    with ResultWriter(str(p), append=True, start_index=1) as w:
        w.write(1, {"id": "b"})
    assert p.read_bytes() == '{"id": "a", "text": "ü"}\n{"id": "b"}\n'.encode()
    with ResultWriter(p) as w:
        w.write(0, {"id": "c"})
    assert p.read_text(encoding="utf-8") == '{"id": "c"}\n'
    with pytest.raises(MarscliError, match="cannot write output file"):
        ResultWriter(tmp_path / "no" / "such" / "dir.jsonl")


@pytest.mark.parametrize("dest", [None, "-"])
def test_writer_stdout(dest, capsys):
    with ResultWriter(dest) as w:
        w.write(0, {"ok": True})
    assert capsys.readouterr().out == '{"ok": true}\n'


class BrokenStream(io.StringIO):
    def __init__(self, fail_after: int):
        super().__init__()
        self.fail_after = fail_after
        self.writes = 0

    def write(self, s):
        self.writes += 1
        if self.writes > self.fail_after:
            raise BrokenPipeError(32, "Broken pipe")
        return super().write(s)


def test_writer_broken_pipe_is_quiet():
    out = BrokenStream(fail_after=1)
    w = ResultWriter(out)
    w.write(0, {"i": 0})
    assert not w.broken_pipe
    w.write(1, {"i": 1})  # raises inside, swallowed
    assert w.broken_pipe
    w.write(2, {"i": 2})  # silently dropped
    w.write(5, {"i": 5})
    assert out.writes == 2 and w.written == 1
    w.close(strict=True)  # no exception after a broken pipe
    assert out.getvalue() == '{"i": 0}\n'


def test_writer_broken_pipe_on_stdout(monkeypatch):
    class BrokenFlush(io.StringIO):
        def flush(self):
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr("sys.stdout", BrokenFlush())
    with ResultWriter("-") as w:
        w.write(0, {})
        w.write(1, {})
    assert w.broken_pipe


# ---------------------------------------------------------------------------------------------
# Atomic writes


def test_atomic_write_text_replaces_and_leaves_no_temp(tmp_path):
    p = tmp_path / "profile.yaml"
    atomic_write_text(p, "a: 1\n")
    assert p.read_text(encoding="utf-8") == "a: 1\n"
    os.chmod(p, 0o640)
    atomic_write_text(str(p), "a: 2\nb: é\n")
    assert p.read_bytes() == "a: 2\nb: é\n".encode()
    assert os.stat(p).st_mode & 0o777 == 0o640
    assert sorted(os.listdir(tmp_path)) == ["profile.yaml"]


def test_atomic_write_text_new_file_gets_umask_mode(tmp_path):
    old = os.umask(0o022)
    try:
        atomic_write_text(tmp_path / "r.json", "{}")
    finally:
        os.umask(old)
    assert os.stat(tmp_path / "r.json").st_mode & 0o777 == 0o644


def test_atomic_write_text_cleans_up_on_error(tmp_path, monkeypatch):
    p = tmp_path / "report.json"
    p.write_text("old", encoding="utf-8")

    def boom(src, dst):
        raise OSError("disk on fire")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk on fire"):
        atomic_write_text(p, "new")
    assert p.read_text(encoding="utf-8") == "old"
    assert sorted(os.listdir(tmp_path)) == ["report.json"]
    with pytest.raises(TypeError):
        atomic_write_text(p, b"bytes")  # type: ignore[arg-type]
    assert sorted(os.listdir(tmp_path)) == ["report.json"]


# ---------------------------------------------------------------------------------------------
# Whole-input reading, resume scanning, sidecars and fingerprints


def test_read_input_digest_covers_the_whole_file_whatever_the_limit(tmp_path):
    import hashlib

    data = b"".join(f'{{"id": "{i}", "prompt": "p"}}\n'.encode() for i in range(5))
    src = tmp_path / "in.jsonl"
    src.write_bytes(data)
    whole = hashlib.sha256(data).hexdigest()
    items, sha = mio.read_input(str(src), limit=2, digest=True)
    assert [it.id for it in items] == ["0", "1"] and sha == whole
    items, sha = mio.read_input(str(src), digest=True)
    assert len(items) == 5 and sha == whole
    assert mio.read_input(str(src))[1] is None
    src.write_bytes(b'{"id": "a", "prompt": "x"}\n\n{"id": "a", "prompt": "y"}\n')
    with pytest.raises(InputError, match="duplicate id 'a' on lines 1 and 3"):
        mio.read_input(str(src))


def test_read_input_stdin_is_read_to_the_end_for_the_digest(monkeypatch):
    import hashlib

    data = b'{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": "c"}\n'
    monkeypatch.setattr("sys.stdin", types.SimpleNamespace(buffer=io.BytesIO(data)))
    items, sha = mio.read_input("-", limit=1, digest=True)
    assert len(items) == 1 and sha == hashlib.sha256(data).hexdigest()


def _result(rid, error=None):
    return dump_json_line({"id": rid, "output": "x", "error": error}) + "\n"


def test_scan_output_keeps_complete_lines_and_cuts_a_torn_one(tmp_path):
    p = tmp_path / "out.jsonl"
    body = _result("a") + _result("b", {"type": "invalid_json"}) + dump_json_line(
        {"custom_id": "c", "error": None}) + "\n"
    p.write_bytes(body.encode() + b'{"id": "d", "out')
    scan = mio.scan_output(p)
    assert scan.done == {"a": False, "b": True, "c": False}
    assert scan.keep_bytes == len(body.encode()) and scan.torn_bytes == len(b'{"id": "d", "out')
    # A complete last line without its newline is torn too: it is regenerated.
    p.write_bytes(_result("a").encode() + _result("b").encode().rstrip(b"\n"))
    assert list(mio.scan_output(p).done) == ["a"]


@pytest.mark.parametrize("content,fragment", [
    (b"garbage\n", "line 1 is not a marscli result (not valid JSON)"),
    (b'{"id": "a"}\n[1]\n', "line 2 is not a marscli result (a JSON array, not an object)"),
    (b'{"id": 3}\n', "no string 'id' or 'custom_id'"),
    (b'{"id": "a"}\n{"id": "a"}\n', "id 'a' appears twice (line 2)"),
    (b'\xff\xfe\n', "not valid JSON"),
])
def test_scan_output_refuses_files_it_did_not_write(tmp_path, content, fragment):
    p = tmp_path / "out.jsonl"
    p.write_bytes(content)
    with pytest.raises(mio.UsageError) as exc:
        mio.scan_output(p)
    assert fragment in str(exc.value) and "\n" not in str(exc.value)


def test_sidecar_round_trip_and_atomic(tmp_path):
    side = tmp_path / "out.jsonl.marscli.json"
    assert mio.read_sidecar(side) is None
    fp = {"sampling": {"seed": 1}, "profile": None}
    mio.write_sidecar(side, fp)
    assert mio.read_sidecar(side) == fp
    assert sorted(os.listdir(tmp_path)) == [side.name]  # no temp file left


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=200) | _json_values().map(lambda v: json.dumps(v).encode()))
def test_untrusted_sidecar_and_output_never_raise_unhandled(tmp_path_factory, data):
    d = tmp_path_factory.mktemp("untrusted")
    p = d / "f"
    p.write_bytes(data)
    for read in (mio.read_sidecar, mio.scan_output):
        try:
            read(p)
        except mio.UsageError as e:
            assert str(e) and "\n" not in str(e)


def _cfg(**kw):
    from marscli.config import DraftConfig, GenerateConfig, ModelConfig, VerifyConfig

    base = {"input": "in.jsonl", "output": "out.jsonl", "target": ModelConfig("m"),
            "draft": DraftConfig(), "draft_model": None, "verify": VerifyConfig(),
            "sampling": SamplingParams()}
    return GenerateConfig(**{**base, **kw})


TARGET = {"name": "m", "source": "/m", "kind": "dir", "sha256": None, "revision": None,
          "dtype": "float32", "quantization": None, "device": "cuda:1"}


def test_run_fingerprint_components_and_what_it_leaves_out():
    extra = {"input": {"sha256": "ab"}, "profile": None}
    fp = mio.run_fingerprint(_cfg(), TARGET, None, extra)
    assert fp["target"]["device"] == "cuda"  # which GPU does not change results
    assert fp["verify"] == {"mode": "strict", "theta": None, "margin": "logit-ratio"}
    assert fp["input"] == {"sha256": "ab"} and fp["profile"] is None
    json.dumps(fp, allow_nan=False)
    # Things that do not change the result bytes are not part of it.
    same = mio.run_fingerprint(_cfg(limit=3, fail_fast=True, resume=True, output="other.jsonl"),
                               dict(TARGET, device="cuda:0"), None, extra)
    assert same == fp
    from marscli.config import DraftConfig

    none = mio.run_fingerprint(_cfg(draft=DraftConfig(kind="none", ngram_max=5)), TARGET, None, extra)
    assert none["drafter"] == {"kind": "none"}
    # The verification really used (e.g. set by a profile) replaces the command line's.
    from marscli.config import VerifyConfig

    mars = mio.run_fingerprint(_cfg(), TARGET, None, extra, verify=VerifyConfig("mars", 0.93))
    assert mars["verify"] == {"mode": "mars", "theta": 0.93, "margin": "logit-ratio"}


def test_fingerprint_diff_names_each_difference():
    old = {"sampling": {"temperature": 0.0, "seed": 1}, "profile": None, "input": {"sha256": "a"}}
    new = {"sampling": {"temperature": 0.7, "seed": 1}, "profile": {"name": "p"},
           "input": {"sha256": "a"}, "extra": 1}
    assert mio.fingerprint_diff(old, new) == [
        "sampling.temperature: 0.0 in the existing run, 0.7 now",
        'profile: null in the existing run, {"name": "p"} now',
        "extra: (absent) in the existing run, 1 now",
    ]
    assert mio.fingerprint_diff(old, new, ignore=["sampling", "profile", "extra"]) == []
    assert mio.fingerprint_diff({"a": 1}, {"a": 1.0}) == []


def test_run_output_fresh_then_resume(tmp_path):
    out = tmp_path / "out.jsonl"
    items = [Request(index=i, line=i + 1, id=str(i), prompt="p") for i in range(3)]
    fp = {"sampling": {"seed": 1}}
    run = mio.RunOutput(str(out), resume=False)
    assert not out.exists()  # validated without creating it
    w = run.open(fp, items)
    w.write(0, {"id": "0", "error": None})
    w.close()
    assert mio.read_sidecar(mio.sidecar_path(out)) == fp
    with open(out, "a") as f:
        f.write('{"id": "1", "err')  # torn by a crash
    run = mio.RunOutput(str(out), resume=True)
    assert run.resuming and run.done == {"0": False} and run.scan.torn_bytes > 0
    with pytest.raises(mio.UsageError, match="sampling.seed: 1 in the existing run, 2 now"):
        run.check({"sampling": {"seed": 2}})
    w = run.open(fp, items)
    w.write(1, {"id": "1", "error": None})
    w.write(2, {"id": "2", "error": None})
    w.close()
    assert [json.loads(x)["id"] for x in out.read_text().splitlines()] == ["0", "1", "2"]
    with pytest.raises(mio.UsageError, match="--resume needs -o FILE"):
        mio.RunOutput("-", resume=True)
