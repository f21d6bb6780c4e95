"""Reliable batch runs (issue 6): bad input, faults, durable output, resume, signals.

In-process runs use Typer's CliRunner; the kill, Ctrl-C and broken-pipe tests start
`python -m marscli` in a subprocess on the tiny model, importing this checkout's code.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from marscli.cli import app
from marscli.errors import (
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_RECORDS_FAILED,
    EXIT_RUNTIME,
    EXIT_TERMINATED,
    EXIT_USAGE,
    MarscliError,
)
from marscli.io.records import MAX_LINE_BYTES
from marscli.io.resume import sidecar_path
from tests.helpers import _start, _subprocess_env, _wait_for_lines

#: Fast settings: the tiny model, no drafter, a few tokens.
FAST = ["--draft", "none", "--max-tokens", "2", "--no-timing"]
#: Settings of the resume tests: sampling, so each record's own seed matters.
RUN = ["--no-timing", "--max-tokens", "6", "--temperature", "0.8", "--seed", "5", "-q"]
N_RECORDS = 16


def write_lines(path: Path, lines: list) -> Path:
    with open(path, "wb") as f:
        for line in lines:
            if isinstance(line, bytes):
                f.write(line + b"\n")
            elif isinstance(line, str):
                f.write(line.encode() + b"\n")
            else:
                f.write(json.dumps(line).encode() + b"\n")
    return path


def results(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def ids_of(rows: list[dict]) -> list[str]:
    return [r.get("id", r.get("custom_id")) for r in rows]


def gen(runner, *args):
    return runner.invoke(app, ["generate", *map(str, args)])


# ------------------------------------------------------------------------------ bad input
# (the bad line, error type, exact message fragment); the bad line sits between two good ones.

LONG_PROMPT = " ".join(f"w{i}" for i in range(400))  # ~1200 tokens > the tiny 512 window

BAD_INPUT = [
    pytest.param('{"prompt": "hi"', "invalid_json", "invalid JSON: Expecting", id="invalid-json"),
    pytest.param('["prompt", "hi"]', "invalid_record", "expected a JSON object, got array", id="not-object"),
    pytest.param('"just a string"', "invalid_record", "expected a JSON object, got string", id="string-line"),
    pytest.param({"id": "x", "text": "hi"}, "invalid_record",
                 "record has neither 'prompt' nor 'messages'", id="missing-prompt"),
    pytest.param({"prompt": "   "}, "invalid_record", "'prompt' must not be empty or whitespace-only",
                 id="empty-prompt"),
    pytest.param({"messages": []}, "invalid_record", "'messages' must be a non-empty array",
                 id="empty-messages"),
    pytest.param({"prompt": 42}, "invalid_record", "'prompt' must be a non-empty string, got 42",
                 id="prompt-wrong-type"),
    pytest.param({"prompt": "hi", "max_tokens": "5"}, "invalid_record",
                 "'max_tokens' must be an integer >= 1, got '5'", id="override-wrong-type"),
    pytest.param({"messages": [{"role": "user", "content": 42}]}, "invalid_record",
                 "messages[0].content must be a string, got 42", id="content-wrong-type"),
    pytest.param({"messages": [{"role": "user", "content": [
                     {"type": "text", "text": "what is in this picture?"},
                     {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]},
                 "invalid_record",
                 "messages[0].content[1]: part type 'image_url' is not supported (text only)",
                 id="content-part-not-text"),
    pytest.param({"messages": [{"role": "robot", "content": "hi"}]}, "invalid_record",
                 "messages[0].role: unknown role 'robot'", id="unknown-role"),
    pytest.param(b'{"prompt": "caf\xe9"}', "invalid_encoding", "line is not valid UTF-8",
                 id="not-utf8"),
    pytest.param(b'{"prompt": "' + b"a" * (MAX_LINE_BYTES + 10) + b'"}', "line_too_long",
                 f"line is longer than the limit of {MAX_LINE_BYTES} bytes", id="line-too-long"),
    pytest.param({"prompt": LONG_PROMPT}, "prompt_too_long", "the target's context window is 512",
                 id="prompt-too-long"),
]


@pytest.mark.parametrize("bad,etype,fragment", BAD_INPUT)
def test_bad_record_is_an_error_result_and_the_run_goes_on(runner, tiny_model_dir, tmp_path,
                                                           bad, etype, fragment):
    src = write_lines(tmp_path / "in.jsonl", [{"id": "a", "prompt": "hello"}, bad,
                                              {"id": "c", "prompt": "world"}])
    r = gen(runner, src, "--target", tiny_model_dir, *FAST)
    assert r.exit_code == EXIT_RECORDS_FAILED, r.stderr
    rows = results(r.stdout)
    assert len(rows) == 3
    assert rows[0]["error"] is None and rows[2]["error"] is None
    err = rows[1]["error"]
    assert err["type"] == etype and fragment in err["message"] and err["line"] == 2
    assert rows[1]["output"] is None
    assert "done: 2/3 records ok, 1 failed" in r.stderr


def test_messages_to_a_base_model_without_chat_template(runner, tiny_factory,
                                                        tiny_tokenizer_factory, tmp_path):
    tok = tiny_tokenizer_factory()
    tok.chat_template = None
    base = tiny_factory(tmp_path / "base", tokenizer=tok)
    src = write_lines(tmp_path / "in.jsonl", [{"prompt": "hi"},
                                              {"messages": [{"role": "user", "content": "hi"}]}])
    r = gen(runner, src, "--target", base, *FAST)
    assert r.exit_code == EXIT_RECORDS_FAILED
    err = results(r.stdout)[1]["error"]
    assert err == {"type": "no_chat_template", "line": 2, "message": err["message"]}
    assert "has no chat template" in err["message"]


def test_duplicate_ids_reject_the_run_up_front(runner, tmp_path):
    src = write_lines(tmp_path / "in.jsonl", [{"id": "a", "prompt": "x"}, {"id": "b", "prompt": "y"},
                                              {"id": "a", "prompt": "z"}])
    out = tmp_path / "out.jsonl"
    # The target does not exist: the input is rejected before any model is looked at.
    r = gen(runner, src, "--target", tmp_path / "no-model", "-o", out)
    assert r.exit_code == EXIT_USAGE
    assert "duplicate id 'a' on lines 1 and 3" in r.stderr
    assert r.stdout == "" and not out.exists()


def test_empty_input_writes_nothing_and_exits_0(runner, tmp_path):
    src = tmp_path / "empty.jsonl"
    src.write_text("\n  \n")
    r = gen(runner, src, "--target", tmp_path / "no-model")
    assert r.exit_code == EXIT_OK and r.stdout == ""
    assert "no records; nothing to do" in r.stderr
    # With -o, a stale output from an earlier run does not survive as if it were this run's.
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": "old"}\n')
    Path(sidecar_path(out)).write_text("{}")
    r = gen(runner, src, "--target", tmp_path / "no-model", "-o", out)
    assert r.exit_code == EXIT_OK and out.read_text() == ""
    assert not Path(sidecar_path(out)).exists()


def test_truncate_prompt_left_keeps_the_end(runner, tiny_model_dir, tmp_path):
    src = write_lines(tmp_path / "in.jsonl", [{"id": "long", "prompt": LONG_PROMPT},
                                              {"id": "short", "prompt": "hi"}])
    r = gen(runner, src, "--target", tiny_model_dir, "--truncate-prompt", "left", *FAST)
    assert r.exit_code == EXIT_OK, r.stderr
    long, short = results(r.stdout)
    assert long["error"] is None
    assert long["usage"]["prompt_tokens"] == 512 - 2  # room left for --max-tokens 2
    assert long["usage"]["truncated_prompt_tokens"] > 0
    assert short["usage"]["truncated_prompt_tokens"] == 0
    r = gen(runner, src, "--target", tiny_model_dir, "--truncate-prompt", "right", *FAST)
    assert r.exit_code == EXIT_USAGE and "--truncate-prompt must be 'none' or 'left'" in r.stderr


def test_fail_fast_stops_at_the_first_bad_record(runner, tiny_model_dir, tmp_path):
    src = write_lines(tmp_path / "in.jsonl", [{"id": "a", "prompt": "hi"}, "{oops",
                                              {"id": "c", "prompt": "never"}])
    r = gen(runner, src, "--target", tiny_model_dir, "--fail-fast", *FAST)
    assert r.exit_code == EXIT_RECORDS_FAILED
    assert ids_of(results(r.stdout)) == ["a", "1"]
    assert "stopped at the first failed record (--fail-fast): id '1', line 2: invalid_json" in r.stderr


# ------------------------------------------------------------------------------ faults


@pytest.fixture
def failing_generation(monkeypatch):
    """Make the 2nd record's generation raise `exc` (set by the test)."""
    from marscli.engine.scheduler import Engine

    real = Engine.start_rows
    state = {"calls": 0, "exc": None}

    def start_row(self, *a, **kw):  # a record's generation starts with its row
        state["calls"] += 1
        if state["calls"] == 2:
            raise state["exc"]
        return real(self, *a, **kw)

    monkeypatch.setattr(Engine, "start_rows", start_row)
    return state


@pytest.mark.parametrize("make_exc,etype,message", [
    (lambda: RuntimeError("boom\nsecond line"), "generation_failed", "RuntimeError: boom"),
    (lambda: __import__("torch").cuda.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 2.00 GiB"), "out_of_memory",
     "CUDA out of memory. Tried to allocate 2.00 GiB"),
], ids=["raises", "cuda-oom"])
def test_a_record_whose_generation_fails(runner, tiny_model_dir, tmp_path, failing_generation,
                                         make_exc, etype, message):
    failing_generation["exc"] = make_exc()
    src = write_lines(tmp_path / "in.jsonl", [{"id": i, "prompt": f"p {i}"} for i in "abc"])
    r = gen(runner, src, "--target", tiny_model_dir, *FAST)
    assert r.exit_code == EXIT_RECORDS_FAILED
    a, b, c = results(r.stdout)
    assert a["error"] is None and c["error"] is None
    assert b["error"] == {"type": etype, "message": message, "line": 2}
    assert f"record 'b' (line 2) failed: {message}" in r.stderr


def _copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _fault_target(kind: str, tiny_model_dir: Path, tmp_path: Path, make_model,
                  make_tokenizer) -> tuple[list[str], str]:
    """(extra args, message fragment) for one kind of broken model."""
    if kind == "missing-weights":
        d = _copy_model(tiny_model_dir, tmp_path / "m")
        (d / "model.safetensors").unlink()
        return ["--target", str(d)], "no file named model.safetensors"
    if kind == "missing-tokenizer":
        d = _copy_model(tiny_model_dir, tmp_path / "m")
        (d / "tokenizer.json").unlink()
        return ["--target", str(d)], f"no tokenizer file in {d}"
    if kind == "missing-config":
        d = _copy_model(tiny_model_dir, tmp_path / "m")
        (d / "config.json").unlink()
        return ["--target", str(d)], "has no config.json"
    if kind == "truncated-safetensors":
        d = _copy_model(tiny_model_dir, tmp_path / "m")
        weights = d / "model.safetensors"
        os.truncate(weights, weights.stat().st_size // 2)
        return ["--target", str(d)], f"corrupt weights file {weights}"
    if kind == "garbage-gguf":
        bad = tmp_path / "model.gguf"
        bad.write_bytes(b"GGUF\x03\x00\x00\x00 this is not a model")
        return ["--target", str(bad)], f"cannot read GGUF file {bad}"
    if kind == "vocab-mismatch":
        other = make_tokenizer(corpus=("entirely different words here",), vocab_size=290)
        d = make_model(tmp_path / "draft", tokenizer=other, layers=1)
        return ["--target", str(tiny_model_dir), "--draft", str(d)], "does not share the vocabulary"
    if kind == "bitsandbytes-without-cuda":
        # (--load-in-8bit on a CPU is marscli's own int8 now: tests/models/test_quant.py)
        return ["--target", str(tiny_model_dir), "--load-in-4bit"], "--load-in-4bit needs a CUDA GPU"
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["missing-weights", "missing-tokenizer", "missing-config",
                                  "truncated-safetensors", "garbage-gguf", "vocab-mismatch",
                                  "bitsandbytes-without-cuda"])
def test_model_faults_end_in_one_clear_line(runner, tiny_model_dir, tiny_factory,
                                            tiny_tokenizer_factory, tmp_path, kind):
    import torch

    if kind == "bitsandbytes-without-cuda" and torch.cuda.is_available():  # pragma: no cover
        pytest.skip("this machine has CUDA")
    args, fragment = _fault_target(kind, tiny_model_dir, tmp_path, tiny_factory,
                                   tiny_tokenizer_factory)
    src = write_lines(tmp_path / "in.jsonl", [{"prompt": "hi"}])
    out = tmp_path / "out.jsonl"
    r = gen(runner, src, *FAST, *args, "-o", out, "-q")  # args last: its --draft wins
    assert r.exit_code == EXIT_USAGE
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("marscli: error: "), r.stderr
    assert fragment in lines[0]
    assert r.stdout == "" and not out.exists()  # nothing half-made left behind


@pytest.mark.parametrize("where,fragment", [
    ("missing-folder/out.jsonl", "does not exist"),
    (".", "is a directory"),
    ("in.jsonl", "is the input file"),
])
def test_bad_output_path_fails_before_loading(runner, tmp_path, where, fragment):
    src = write_lines(tmp_path / "in.jsonl", [{"prompt": "hi"}])
    # A missing model proves the output is checked first.
    r = gen(runner, src, "--target", tmp_path / "no-model", "-o", tmp_path / where)
    assert r.exit_code == EXIT_USAGE and fragment in r.stderr
    assert src.read_text() == '{"prompt": "hi"}\n'


def test_write_failure_mid_run_keeps_results_and_says_resume(runner, tiny_model_dir, tmp_path,
                                                            monkeypatch):
    from marscli.io.results import ResultWriter

    real = ResultWriter._emit
    calls = {"n": 0}

    def emit(self, result):
        calls["n"] += 1
        if calls["n"] == 3:
            raise MarscliError("cannot write results: No space left on device")
        real(self, result)

    monkeypatch.setattr(ResultWriter, "_emit", emit)
    src = write_lines(tmp_path / "in.jsonl", [{"id": str(i), "prompt": "hi"} for i in range(4)])
    out = tmp_path / "out.jsonl"
    r = gen(runner, src, "--target", tiny_model_dir, "-o", out, *FAST)
    assert r.exit_code == EXIT_RUNTIME
    assert "No space left on device; the finished results are in" in r.stderr
    assert "rerun with --resume" in r.stderr
    assert ids_of(results(out.read_text())) == ["0", "1"]


# ------------------------------------------------------------------------------ resume


@pytest.fixture(scope="module")
def records_file(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("records")
    lines = [{"id": f"r{i:02d}", "prompt": f"the quick brown fox {i} jumps over"}
             for i in range(N_RECORDS)]
    lines[7] = "{broken"  # an error result must survive a resume as well
    return write_lines(d / "in.jsonl", lines)


@pytest.fixture(scope="module")
def reference_run(records_file, tiny_model_dir, tmp_path_factory) -> Path:
    """The output of an uninterrupted run of records_file with RUN settings (sidecar beside)."""
    out = tmp_path_factory.mktemp("reference") / "out.jsonl"
    r = CliRunner().invoke(app, ["generate", str(records_file), "--target", str(tiny_model_dir),
                                 "-o", str(out), *RUN])
    assert r.exit_code == EXIT_RECORDS_FAILED, r.stderr
    assert out.read_bytes().count(b"\n") == N_RECORDS
    return out


@pytest.fixture
def reference(reference_run) -> bytes:
    return reference_run.read_bytes()


def assert_complete(data: bytes, reference: bytes) -> None:
    rows = [json.loads(line) for line in data.splitlines()]
    ids = ids_of(rows)
    assert len(ids) == len(set(ids)) == N_RECORDS  # no duplicate, none missing
    assert data == reference


@pytest.mark.parametrize("keep,torn", [(N_RECORDS - 6, b'{"id": "r10", "outp'),
                                       (N_RECORDS - 1, b"\x00\x00\x00")],
                         ids=["torn-line", "zero-filled-tail"])
def test_resume_after_a_crash_is_byte_identical(runner, records_file, tiny_model_dir, tmp_path,
                                                reference_run, reference, keep, torn):
    out = tmp_path / "out.jsonl"
    head = b"".join(reference.splitlines(keepends=True)[:keep])
    out.write_bytes(head + torn)
    shutil.copy(sidecar_path(reference_run), sidecar_path(out))
    r = gen(runner, records_file, "--target", tiny_model_dir, "-o", out, "--resume", *RUN)
    assert r.exit_code == EXIT_RECORDS_FAILED, r.stderr  # the broken record 7 still counts
    assert_complete(out.read_bytes(), reference)


def test_resume_can_raise_the_limit(runner, records_file, tiny_model_dir, tmp_path, reference):
    out = tmp_path / "out.jsonl"
    r = gen(runner, records_file, "--target", tiny_model_dir, "-o", out, *RUN, "--limit", "5")
    assert r.exit_code == EXIT_OK
    side = json.loads(Path(sidecar_path(out)).read_text())
    assert side["format"] == 1 and side["fingerprint"]["profile"] is None
    assert set(side["fingerprint"]) == {"target", "drafter", "draft_model", "verify", "sampling",
                                        "input", "profile", "output", "truncate_prompt"}
    r = gen(runner, records_file, "--target", tiny_model_dir, "-o", out, *RUN, "--resume")
    assert r.exit_code == EXIT_RECORDS_FAILED
    assert_complete(out.read_bytes(), reference)


def test_resume_with_other_settings_is_refused(runner, records_file, tiny_model_dir,
                                               tiny_draft_dir, tmp_path):
    out = tmp_path / "out.jsonl"
    r = gen(runner, records_file, "--target", tiny_model_dir, "-o", out, *RUN, "--limit", "2")
    assert r.exit_code == EXIT_OK
    before = out.read_bytes()
    changed = [a if a != "0.8" else "0.7" for a in RUN]
    r = gen(runner, records_file, "--target", tiny_model_dir, "-o", out, *changed, "--resume",
            "--draft", tiny_draft_dir)
    assert r.exit_code == EXIT_USAGE
    assert f"cannot resume {out}: it was made with other settings" in r.stderr
    assert "sampling.temperature: 0.8 in the existing run, 0.7 now" in r.stderr
    assert 'drafter.kind: "ngram" in the existing run, "model" now' in r.stderr
    # The draft model's identity is compared too (only known after loading).
    r = gen(runner, records_file, "--target", tiny_draft_dir, "-o", out, *RUN, "--resume")
    assert r.exit_code == EXIT_USAGE and "target.name" in r.stderr
    # Verification is compared once models are loaded (a profile matched to them can set it).
    r = gen(runner, records_file, "--target", tiny_model_dir, "-o", out, *RUN, "--resume",
            "--verify", "mars")
    assert r.exit_code == EXIT_USAGE
    assert 'verify.mode: "strict" in the existing run, "mars" now; verify.theta: null' in r.stderr
    other_input = write_lines(tmp_path / "other.jsonl", [{"prompt": "x"}])
    r = gen(runner, other_input, "--target", tiny_model_dir, "-o", out, *RUN, "--resume")
    assert r.exit_code == EXIT_USAGE and "input.sha256" in r.stderr
    assert out.read_bytes() == before


def test_resume_refusals(runner, records_file, tiny_model_dir, tmp_path):
    out = tmp_path / "out.jsonl"
    r = gen(runner, records_file, "--target", tiny_model_dir, "--resume")
    assert r.exit_code == EXIT_USAGE and "--resume needs -o FILE" in r.stderr
    out.write_text('{"id": "r00", "output": "x"}\n')
    r = gen(runner, records_file, "--target", tiny_model_dir, "-o", out, "--resume")
    assert r.exit_code == EXIT_USAGE and "sidecar" in r.stderr and "is missing" in r.stderr
    Path(sidecar_path(out)).write_text("[1, 2")
    r = gen(runner, records_file, "--target", tiny_model_dir, "-o", out, "--resume")
    assert r.exit_code == EXIT_USAGE and "is unreadable" in r.stderr
    out.write_text('{"id": "r00"}\nnot a result\n')
    r = gen(runner, records_file, "--target", tiny_model_dir, "-o", out, "--resume")
    assert r.exit_code == EXIT_USAGE and "line 2 is not a marscli result" in r.stderr


def test_resume_without_an_output_yet_starts_fresh(runner, records_file, tiny_model_dir, tmp_path):
    out = tmp_path / "out.jsonl"
    r = gen(runner, records_file, "--target", tiny_model_dir, "-o", out, *RUN, "--resume",
            "--limit", "2")
    assert r.exit_code == EXIT_OK and out.read_bytes().count(b"\n") == 2
    assert Path(sidecar_path(out)).exists()


# ------------------------------------------------------------------------------ signals


def test_sigterm_saves_results_and_exits_143(runner, records_file, tiny_model_dir, tmp_path,
                                             reference, monkeypatch):
    from marscli.engine.scheduler import Engine

    real = Engine.start_rows
    calls = {"n": 0}

    def start_row(self, *a, **kw):
        calls["n"] += 1
        if calls["n"] == 4:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(self, *a, **kw)

    monkeypatch.setattr(Engine, "start_rows", start_row)
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    out = tmp_path / "out.jsonl"
    r = gen(runner, records_file, "--target", tiny_model_dir, "-o", out, *RUN)
    assert r.exit_code == EXIT_TERMINATED
    assert {s: signal.getsignal(s) for s in before} == before  # handlers restored
    assert f"terminated (SIGTERM): 3 of {N_RECORDS} results are in" in r.stderr  # printed despite -q
    assert "rerun the same command with --resume" in r.stderr
    assert out.read_bytes() == b"".join(reference.splitlines(keepends=True)[:3])
    monkeypatch.setattr(Engine, "start_rows", real)
    r = gen(runner, records_file, "--target", tiny_model_dir, "-o", out, *RUN, "--resume")
    assert r.exit_code == EXIT_RECORDS_FAILED
    assert_complete(out.read_bytes(), reference)


def test_results_finished_out_of_order_survive_a_stop(runner, records_file, tiny_model_dir,
                                                      tmp_path, reference, monkeypatch):
    """Batched decoding finishes records out of order. A run stopped while later records wait
    for an earlier one keeps them in the held file, and --resume merges them in."""
    from marscli.io.results import held_path
    from marscli.jobs.setup import Generator

    real = Generator.results

    def reordered(self, items, sampling, options):
        block = []
        for n, r in enumerate(real(self, items, sampling, options)):
            block.append(r)
            if len(block) == 4 or n == N_RECORDS - 1:
                for m, late_first in enumerate(reversed(block)):
                    if n == 7 and m == 2:  # r07 and r06 are finished, r04 and r05 are not
                        os.kill(os.getpid(), signal.SIGTERM)
                    yield late_first
                block = []

    monkeypatch.setattr(Generator, "results", reordered)
    out = tmp_path / "out.jsonl"
    r = gen(runner, records_file, "--target", tiny_model_dir, "-o", out, *RUN)
    assert r.exit_code == EXIT_TERMINATED, r.stderr
    held = Path(held_path(out))
    assert f"6 of {N_RECORDS} results are in {out} and {held} (2 finished ahead" in r.stderr
    assert out.read_bytes() == b"".join(reference.splitlines(keepends=True)[:4])
    ids = ids_of(results(reference.decode()))
    # Journalled as they came: the first block's late ones (emitted since) and r07, r06.
    assert ids_of(results(held.read_text())) == [ids[3], ids[2], ids[1], ids[7], ids[6]]
    monkeypatch.setattr(Generator, "results", real)
    r = gen(runner, records_file, "--target", tiny_model_dir, "-o", out, *RUN, "--resume")
    assert r.exit_code == EXIT_RECORDS_FAILED, r.stderr
    assert_complete(out.read_bytes(), reference)
    assert not held.exists()  # merged in, then removed


def test_a_complete_run_leaves_no_held_file(runner, records_file, tiny_model_dir, tmp_path,
                                            reference, monkeypatch):
    from marscli.io.results import held_path
    from marscli.jobs.setup import Generator

    real = Generator.results

    def reversed_results(self, items, sampling, options):
        yield from reversed(list(real(self, items, sampling, options)))

    monkeypatch.setattr(Generator, "results", reversed_results)
    out = tmp_path / "out.jsonl"
    r = gen(runner, records_file, "--target", tiny_model_dir, "-o", out, *RUN)
    assert r.exit_code == EXIT_RECORDS_FAILED, r.stderr
    assert_complete(out.read_bytes(), reference)
    assert not Path(held_path(out)).exists()


def test_ctrl_c_while_writing_a_line_waits_for_the_line(runner, tiny_model_dir, tmp_path,
                                                        monkeypatch):
    from marscli.io.results import ResultWriter

    real = ResultWriter._emit

    def emit(self, result):
        if result["id"] == "1":
            os.kill(os.getpid(), signal.SIGINT)  # arrives in the middle of writing line 2
            time.sleep(0.05)
        real(self, result)

    monkeypatch.setattr(ResultWriter, "_emit", emit)
    src = write_lines(tmp_path / "in.jsonl", [{"id": str(i), "prompt": "hi"} for i in range(4)])
    out = tmp_path / "out.jsonl"
    r = gen(runner, src, "--target", tiny_model_dir, "-o", out, *FAST)
    assert r.exit_code == EXIT_INTERRUPTED
    assert ids_of(results(out.read_text())) == ["0", "1"] and out.read_text().endswith("\n")
    assert "interrupted (Ctrl-C): 2 of 4 results are in" in r.stderr


@pytest.mark.parametrize("sig,code", [(signal.SIGKILL, -signal.SIGKILL),
                                      (signal.SIGINT, EXIT_INTERRUPTED)], ids=["SIGKILL", "SIGINT"])
def test_killed_subprocess_then_resume_is_byte_identical(runner, records_file, tiny_model_dir,
                                                         tmp_path, reference, sig, code):
    out = tmp_path / "out.jsonl"
    args = [str(records_file), "--target", str(tiny_model_dir), "-o", str(out), *RUN]
    proc = _start(args, stdout=subprocess.DEVNULL)
    _wait_for_lines(proc, out, 1)
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=120)
    written = out.read_bytes().count(b"\n")
    # The run may (rarely) finish before the signal lands; the resume must be right anyway.
    assert proc.returncode in (code, EXIT_RECORDS_FAILED), stderr.decode()
    assert b"Traceback" not in stderr
    if proc.returncode == EXIT_RECORDS_FAILED:  # pragma: no cover
        assert written == N_RECORDS
    elif sig == signal.SIGINT and written < N_RECORDS:
        assert b"interrupted (Ctrl-C)" in stderr and b"--resume" in stderr
    r = gen(runner, *args, "--resume")
    assert r.exit_code == EXIT_RECORDS_FAILED, r.stderr
    assert_complete(out.read_bytes(), reference)


def _wait_for_lock(proc: subprocess.Popen, out: Path, timeout: float = 120.0) -> None:
    """Poll until `proc` has locked `out` (its pid is in the lock file)."""
    lock = Path(f"{out}.marscli.lock")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if json.loads(lock.read_text())["pid"] == proc.pid:
                return
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.002)
    proc.kill()
    pytest.fail(f"the first run did not lock {out} (exit code {proc.poll()})")


def test_two_runs_on_one_output_the_second_is_refused_and_the_first_ends_intact(
        records_file, tiny_model_dir, tmp_path, reference):
    """Two real `marscli generate -o SAME` runs: the second exits 2 naming the first, which
    finishes the very file an undisturbed run writes. The first is frozen (SIGSTOP) while it
    holds the lock, so the two surely overlap however fast the machine."""
    import socket

    out = tmp_path / "out.jsonl"
    args = [str(records_file), "--target", str(tiny_model_dir), "-o", str(out), *RUN]
    first = _start(args, stdout=subprocess.DEVNULL)
    try:
        _wait_for_lock(first, out)
        first.send_signal(signal.SIGSTOP)
        for extra in ([], ["--resume"]):
            second = subprocess.run([sys.executable, "-m", "marscli", "generate", *args, *extra],
                                    env=_subprocess_env(), capture_output=True, timeout=120)
            stderr = second.stderr.decode()
            assert second.returncode == EXIT_USAGE, stderr
            assert stderr.count("\n") == 1 and "Traceback" not in stderr
            assert stderr.startswith(f"marscli: error: output {out} is in use by another marscli "
                                     f"run (pid {first.pid} on host {socket.gethostname()}, "
                                     "started "), stderr
            assert second.stdout == b""
    finally:
        first.send_signal(signal.SIGCONT)
    _, stderr = first.communicate(timeout=120)
    assert first.returncode == EXIT_RECORDS_FAILED, stderr.decode()
    assert_complete(out.read_bytes(), reference)
    assert not Path(f"{out}.marscli.lock").exists()


def test_closed_stdout_exits_0_quietly(records_file, tiny_model_dir):
    """`marscli generate ... | head -1`: the reader leaves after one line."""
    proc = _start([str(records_file), "--target", str(tiny_model_dir), *RUN],
                  stdout=subprocess.PIPE)
    first = proc.stdout.readline()
    proc.stdout.close()  # what head does after its line; later writes hit a broken pipe
    _, stderr = proc.communicate(timeout=120)
    assert json.loads(first)["id"] == "r00"
    assert proc.returncode == EXIT_OK
    assert stderr == b""


def test_help_documents_exit_codes_and_resume(runner):
    r = runner.invoke(app, ["generate", "--help"], env={"COLUMNS": "200"})
    assert r.exit_code == 0
    text = " ".join(r.stdout.split())
    for fragment in ("3 finished but some records failed (or --fail-fast stopped at the first)",
                     "130 interrupted (Ctrl-C)", "143 terminated (SIGTERM)", "--resume",
                     "--fail-fast", "--truncate-prompt"):
        assert fragment in text, fragment


# ------------------------------------------------------------------------------ streamed input


def test_streamed_input_gives_the_output_of_records_read_whole(runner, tiny_model_dir, tmp_path,
                                                                 monkeypatch):
    """generate reads an index and parses each record again as the engine pulls it: the
    output is byte for byte the one of a run handed every record parsed up front (as before
    the index), from a file or from stdin, one at a time or batched."""
    import marscli.jobs.generate as generate
    from marscli.io.input_index import read_input

    lines = [b"\xef\xbb\xbf" + json.dumps({"id": "a", "prompt": "hi"}).encode(), b"",
             json.dumps({"prompt": "crlf", "max_tokens": 1}).encode() + b"\r", b"{oops", b"\xff",
             json.dumps({"custom_id": "c", "body": {"messages": [{"role": "user", "content": "m"}],
                                                    "tools": [{"x": 1}]}}).encode(),
             json.dumps({"prompt": "two", "n": 2, "seed": 1, "temperature": 0.7}).encode(),
             json.dumps({"id": "e", "prompt": ""}).encode()]
    src = write_lines(tmp_path / "in.jsonl", lines)

    class WholeIndex:
        """The records read whole, as generate read them before the index."""

        def __init__(self, path, *, limit=None, digest=False):
            self.items, self.sha256 = read_input(path, limit=limit, digest=digest)

        def requests(self, items):
            return iter(items)

        def close(self):
            pass

    outs = {}
    for whole in (True, False):
        with monkeypatch.context() as m:
            if whole:
                m.setattr(generate, "index_input", WholeIndex)
            for bs in (1, 3):
                out = tmp_path / f"out-{whole}-{bs}.jsonl"
                r = gen(runner, src, "--target", tiny_model_dir, "--batch-size", bs, "-o", out, *FAST)
                assert r.exit_code == EXIT_RECORDS_FAILED, r.stderr
                assert "body.tools (1)" in r.stderr
                outs[whole, bs] = out.read_bytes()
    r = runner.invoke(app, ["generate", "-", "--target", tiny_model_dir, *FAST], input=src.read_bytes())
    assert r.exit_code == EXIT_RECORDS_FAILED, r.stderr
    assert r.stdout_bytes == outs[True, 1] == outs[False, 1] == outs[False, 3] == outs[True, 3]
    assert ids_of(results(r.stdout)) == ["a", "1", "2", "3", "c", "5", "e"]
