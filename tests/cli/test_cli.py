"""marscli generate through Typer's CliRunner: JSONL on stdout only, narration on stderr."""

from __future__ import annotations

import json

import pytest

from marscli.cli import app
from marscli.errors import EXIT_OK, EXIT_RECORDS_FAILED, EXIT_USAGE


def write_jsonl(path, lines):
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def parse_stdout(out: str) -> list[dict]:
    lines = [line for line in out.splitlines() if line.strip()]
    return [json.loads(line) for line in lines]  # every stdout line must be JSON


def test_generate_writes_jsonl_in_order(runner, tiny_model_dir, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [
        {"id": "a", "prompt": "the quick brown fox"},
        {"id": "b", "messages": [{"role": "user", "content": "hello world"}], "max_tokens": 3},
        {"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": {"prompt": "one two", "max_tokens": 4}},
    ])
    r = runner.invoke(app, ["generate", str(src), "--target", str(tiny_model_dir), "--max-tokens", "6", "--token-ids"])
    assert r.exit_code == EXIT_OK, r.stderr
    res = parse_stdout(r.stdout)
    assert [x.get("id", x.get("custom_id")) for x in res] == ["a", "b", "c"]
    assert "custom_id" in res[2] and "id" not in res[2]
    assert res[1]["usage"]["completion_tokens"] <= 3 and res[2]["usage"]["completion_tokens"] <= 4
    for x in res:
        assert x["error"] is None
        assert x["finish_reason"] in ("stop", "length")
        assert set(x["spec"]) >= {"steps", "drafted", "accepted", "relaxed", "relaxable_positions",
                                   "acceptance_length", "accepted_per_position"}
        assert x["timing"]["seconds"] >= 0
        assert len(x["token_ids"]) == x["usage"]["completion_tokens"]
    assert "done: 3/3 records ok" in r.stderr
    assert "done:" not in r.stdout


def test_generate_compile_on_says_what_it_compiled(runner, tiny_model_dir, tmp_path):
    """--compile on on a CPU: the steps are compiled (torch.compile), the records are those of
    --compile off, the result spec records it, and stderr says once how many shapes compiled
    in how long; a wrong value is a usage error."""
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "the quick brown fox"},
                                              {"id": "b", "prompt": "one two"}])
    base = ["generate", str(src), "--target", str(tiny_model_dir), "--max-tokens", "5", "--token-ids",
            "--draft", "none"]
    off = runner.invoke(app, base + ["--compile", "off"])
    on = runner.invoke(app, base + ["--compile", "on"])
    assert off.exit_code == on.exit_code == EXIT_OK, on.stderr
    a, b = parse_stdout(off.stdout), parse_stdout(on.stdout)
    assert [x["token_ids"] for x in a] == [x["token_ids"] for x in b]
    assert all(x["spec"].get("compile") == "compiled" for x in b) and all("compile" not in x["spec"] for x in a)
    assert on.stderr.count("steps (compiled): ") == 1 and "shapes compiled by torch.compile in" in on.stderr
    assert "steps (" not in off.stderr
    bad = runner.invoke(app, base + ["--compile", "sometimes"])
    assert bad.exit_code == EXIT_USAGE and "--compile takes auto, on, off; got 'sometimes'" in bad.stderr


def test_bad_records_become_error_results(runner, tiny_model_dir, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [
        {"id": "ok", "prompt": "hello"},
        "{not json",
        {"id": "x", "text": "no prompt here"},
        {"id": "y", "prompt": 42},
        {"id": "z", "prompt": "fine", "temperature": "hot"},
        {"id": "last", "prompt": "still runs"},
    ])
    r = runner.invoke(app, ["generate", str(src), "--target", str(tiny_model_dir), "--max-tokens", "3"])
    assert r.exit_code == EXIT_RECORDS_FAILED
    res = parse_stdout(r.stdout)
    assert len(res) == 6
    assert res[0]["error"] is None and res[5]["error"] is None
    errs = [x["error"] for x in res[1:5]]
    assert [e["line"] for e in errs] == [2, 3, 4, 5]
    assert errs[0]["type"] == "invalid_json"
    assert "neither 'prompt' nor 'messages'" in errs[1]["message"]
    assert "prompt" in errs[2]["message"]
    assert "temperature" in errs[3]["message"]
    assert "4 failed" in r.stderr


def test_messages_without_chat_template_is_a_record_error(runner, tiny_factory, tiny_tokenizer_factory, tmp_path):
    tok = tiny_tokenizer_factory()
    tok.chat_template = None
    d = tiny_factory(tmp_path / "base", tokenizer=tok)
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": "m", "messages": [{"role": "user", "content": "hi"}]},
                                             {"id": "p", "prompt": "hi"}])
    r = runner.invoke(app, ["generate", str(src), "--target", str(d), "--max-tokens", "2"])
    assert r.exit_code == EXIT_RECORDS_FAILED
    res = parse_stdout(r.stdout)
    assert res[0]["error"]["type"] == "no_chat_template" and res[1]["error"] is None


@pytest.mark.parametrize("args,fragment", [
    (["--verify", "lenient"], "--verify must be one of strict, mars, ratio, topk, typical, regret"),
    (["--margin", "odds"], "--margin must be"),
    (["--ngram-min", "4", "--ngram-max", "2"], "--ngram-min (4) must not exceed --ngram-max (2)"),
    (["--dtype", "int3"], "--dtype must be"),
])
def test_usage_errors_exit_2(runner, tiny_model_dir, tmp_path, args, fragment):
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "hi"}])
    r = runner.invoke(app, ["generate", str(src), "--target", str(tiny_model_dir), *args])
    assert r.exit_code == EXIT_USAGE
    assert fragment in r.stderr and r.stdout == ""


def test_missing_model_and_duplicate_ids_exit_2(runner, tiny_model_dir, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "hi"}, {"id": "a", "prompt": "again"}])
    r = runner.invoke(app, ["generate", str(src), "--target", str(tiny_model_dir)])
    assert r.exit_code == EXIT_USAGE
    assert "duplicate id 'a' on lines 1 and 2" in r.stderr
    src2 = write_jsonl(tmp_path / "in2.jsonl", [{"prompt": "hi"}])
    r = runner.invoke(app, ["generate", str(src2), "--target", str(tmp_path / "nope")])
    assert r.exit_code == EXIT_USAGE and "not found" in r.stderr
    r = runner.invoke(app, ["generate", str(src2), "--target", "someorg/not-cached-model"])
    assert r.exit_code == EXIT_USAGE and "someorg/not-cached-model" in r.stderr


def test_load_in_4bit_without_cuda(runner, tiny_model_dir, tmp_path):
    import torch

    if torch.cuda.is_available():  # pragma: no cover
        pytest.skip("this machine has CUDA")
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "hi"}])
    r = runner.invoke(app, ["generate", str(src), "--target", str(tiny_model_dir), "--load-in-4bit"])
    assert r.exit_code == EXIT_USAGE and "CUDA" in r.stderr


def test_empty_input_and_stdin(runner, tiny_model_dir, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    r = runner.invoke(app, ["generate", str(empty), "--target", str(tiny_model_dir)])
    assert r.exit_code == EXIT_OK and r.stdout == "" and "no records" in r.stderr
    r = runner.invoke(app, ["generate", "-", "--target", str(tiny_model_dir), "--max-tokens", "2", "-q"],
                      input='{"id": "s", "prompt": "from stdin"}\n')
    assert r.exit_code == EXIT_OK, r.stderr
    assert parse_stdout(r.stdout)[0]["id"] == "s" and r.stderr == ""


def test_output_file_and_no_timing_is_byte_identical(runner, tiny_model_dir, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": str(i), "prompt": f"hello {i} world"} for i in range(3)])
    outs = []
    for n in range(2):
        out = tmp_path / f"out{n}.jsonl"
        r = runner.invoke(app, ["generate", str(src), "--target", str(tiny_model_dir), "-o", str(out),
                                "--no-timing", "--temperature", "0.9", "--seed", "3", "--max-tokens", "8"])
        assert r.exit_code == EXIT_OK and r.stdout == ""
        outs.append(out.read_bytes())
    assert outs[0] == outs[1] and outs[0].count(b"\n") == 3
    assert json.loads(outs[0].splitlines()[0])["timing"] is None


def test_mars_default_theta_is_announced(runner, tiny_model_dir, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "hi"}])
    r = runner.invoke(app, ["generate", str(src), "--target", str(tiny_model_dir), "--verify", "mars",
                            "--max-tokens", "2"])
    assert r.exit_code == EXIT_OK
    assert "theta = 0.9" in r.stderr
    assert parse_stdout(r.stdout)[0]["spec"]["theta"] == 0.9


def test_help_lists_exit_codes(runner):
    r = runner.invoke(app, ["generate", "--help"])
    assert r.exit_code == 0 and "Exit codes" in r.stdout


def test_openai_content_parts_give_the_joined_string_prompt(runner, tiny_model_dir, tmp_path):
    """An OpenAI batch line whose content is text parts generates what the same text as one
    string (parts joined by newlines) generates, prompt tokens included."""
    parts = [{"type": "text", "text": "the quick brown fox"}, {"type": "text", "text": "jumps over"}]
    src = write_jsonl(tmp_path / "in.jsonl", [
        {"custom_id": "parts", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": parts}]}},
        {"custom_id": "string", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "the quick brown fox\njumps over"}]}},
        {"custom_id": "glued", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "the quick brown foxjumps over"}]}},
    ])
    r = runner.invoke(app, ["generate", str(src), "--target", str(tiny_model_dir), "--max-tokens", "8",
                            "--token-ids", "--no-timing"])
    assert r.exit_code == EXIT_OK, r.stderr
    by_id = {x["custom_id"]: x for x in parse_stdout(r.stdout)}
    strip = lambda x: {k: v for k, v in x.items() if k != "custom_id"}  # noqa: E731
    assert strip(by_id["parts"]) == strip(by_id["string"])
    assert by_id["parts"]["usage"]["prompt_tokens"] != by_id["glued"]["usage"]["prompt_tokens"]
