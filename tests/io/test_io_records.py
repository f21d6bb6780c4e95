"""Tests of marscli.io.records: record validation and reading."""

from __future__ import annotations

import io
import json
import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import marscli.io.records as records
from marscli.config import RecordError, Request, SamplingParams
from marscli.errors import InputError
from marscli.io.input_index import find_duplicate_ids, read_input
from marscli.io.records import read_requests
from marscli.io.results import dump_json_line
from tests.helpers import json_values
from tests.verify_helpers import as_error


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
    (j({"messages": [{"role": "user", "content": 42}]}), "invalid_record",
     "messages[0].content must be a string, got 42"),
    # content parts: text only, each problem named with the part's position
    (j({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]}),
     "invalid_record",
     "messages[0].content[1]: part type 'image_url' is not supported (text only)"),
    (j({"custom_id": "r1", "body": {"messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}]}}),
     "invalid_record",
     "body.messages[0].content[0]: part type 'input_audio' is not supported (text only)"),
    (j({"messages": [{"role": "user", "content": []}]}), "invalid_record",
     "messages[0].content must be a string or a non-empty array of content parts"),
    (j({"messages": [{"role": "user", "content": ["hi"]}]}), "invalid_record",
     "messages[0].content[0] must be a content part object, got string"),
    (j({"messages": [{"role": "user", "content": [{"text": "hi"}]}]}), "invalid_record",
     "messages[0].content[0].type is missing"),
    (j({"messages": [{"role": "user", "content": [{"type": 1, "text": "hi"}]}]}),
     "invalid_record", "messages[0].content[0].type must be a string, got 1"),
    (j({"messages": [{"role": "user", "content": [{"type": "text"}]}]}), "invalid_record",
     "messages[0].content[0].text is missing"),
    (j({"messages": [{"role": "user", "content": [{"type": "text", "text": ["a"]}]}]}),
     "invalid_record", "messages[0].content[0].text must be a string, got an array"),
    ('{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
     "invalid_record", "'messages[0].content[0].text' contains an unpaired surrogate"),
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
    assert as_error(item) == {"type": etype, "message": item.message, "line": 1}


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


def test_content_parts_text_is_joined_by_newlines():
    # Real OpenAI batch files send content as parts; vLLM and llama.cpp join text parts so.
    item = read_one(j({"custom_id": "r", "body": {"messages": [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "First part."},
                                     {"type": "text", "text": "", "cache_control": {}},
                                     {"type": "text", "text": "Second part."}]},
    ]}}))
    assert isinstance(item, Request)
    assert item.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "First part.\n\nSecond part."},
    ]


def test_openai_chat_batch_line():
    item = read_one(j({
        "custom_id": "request-1", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": "gpt-4o", "messages": [{"role": "user", "content": "Hi"}],
                 "max_completion_tokens": 33, "temperature": 0, "n": 1},
    }))
    assert isinstance(item, Request)
    assert (item.id, item.id_key) == ("request-1", "custom_id")
    assert item.messages == [{"role": "user", "content": "Hi"}]
    # n: 1 is acted on (it overrides --n), so it stays among the overrides
    assert item.overrides == {"max_tokens": 33, "temperature": 0.0, "n": 1}
    assert item.ignored == []  # model only identifies


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
    monkeypatch.setattr(records, "MAX_LINE_BYTES", 32)
    monkeypatch.setattr(records, "DISCARD_CHUNK", 7)
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

    monkeypatch.setattr(records, "MAX_LINE_BYTES", 100)
    items = list(read_requests(Spy(b"x" * 10_000 + b"\n" + j({"prompt": "a"}).encode())))
    assert [type(it).__name__ for it in items] == ["RecordError", "Request"]
    assert all(0 < size <= records.DISCARD_CHUNK for size in calls)


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
            json.dumps(as_error(it))
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
@given(st.lists(json_values(), max_size=6), st.booleans())
def test_arbitrary_json_never_raises(values, ascii_only):
    lines = [json.dumps(v, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")
             for v in values]
    data = b"\n".join(lines)
    items = list(read_requests(io.BytesIO(data)))
    assert len(items) == len(values)
    _check_items(items, list(range(1, len(values) + 1)))


# ---------------------------------------------------------------------------------------------
# Whole-input reading


def test_read_input_digest_covers_the_whole_file_whatever_the_limit(tmp_path):
    import hashlib

    data = b"".join(f'{{"id": "{i}", "prompt": "p"}}\n'.encode() for i in range(5))
    src = tmp_path / "in.jsonl"
    src.write_bytes(data)
    whole = hashlib.sha256(data).hexdigest()
    items, sha = read_input(str(src), limit=2, digest=True)
    assert [it.id for it in items] == ["0", "1"] and sha == whole
    items, sha = read_input(str(src), digest=True)
    assert len(items) == 5 and sha == whole
    assert read_input(str(src))[1] is None
    src.write_bytes(b'{"id": "a", "prompt": "x"}\n\n{"id": "a", "prompt": "y"}\n')
    with pytest.raises(InputError, match="duplicate id 'a' on lines 1 and 3"):
        read_input(str(src))


def test_read_input_stdin_is_read_to_the_end_for_the_digest(monkeypatch):
    import hashlib

    data = b'{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": "c"}\n'
    monkeypatch.setattr("sys.stdin", types.SimpleNamespace(buffer=io.BytesIO(data)))
    items, sha = read_input("-", limit=1, digest=True)
    assert len(items) == 1 and sha == hashlib.sha256(data).hexdigest()
