"""OpenAI batch, fully (issue 18): n samples per request, logprobs, the OpenAI batch output
format, and request keys that marscli does not act on.

Oracles: n choices against n single-sample runs with seeds seed..seed+n-1; logprobs against
log_softmax of transformers' own forward pass over prompt + output; output lines against a
JSON schema written from the OpenAI Batch API documentation (a small validator below, so no
test dependency is added).
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from marscli.cli import app
from marscli.config import DraftConfig, ModelConfig, SamplingParams, VerifyConfig
from marscli.errors import EXIT_OK, EXIT_RECORDS_FAILED, EXIT_TERMINATED
from marscli.io.records import read_requests
from tests.oracles import check_logprobs

SCHEMA = json.loads((Path(__file__).parents[1] / "openai_batch_output.schema.json").read_text())
PROMPTS = ["the quick brown fox", "hello world, hello", "one two three four five six"]


# ------------------------------------------------------------------------------ helpers


def parse(*records) -> list:
    data = "\n".join(json.dumps(r) for r in records).encode()
    return list(read_requests(io.BytesIO(data)))


def validate(value, schema, path="$"):
    """A small JSON Schema validator (type, required, properties, items, enum, const,
    minimum, maximum, local $ref): raises AssertionError naming the path."""
    if "$ref" in schema:
        name = schema["$ref"].split("/")[-1]
        return validate(value, SCHEMA["$defs"][name], path)
    types = schema.get("type")
    if types is not None:
        types = [types] if isinstance(types, str) else types
        kinds = {"object": dict, "array": list, "string": str, "null": type(None)}
        ok = False
        for t in types:
            if t == "integer":
                ok |= isinstance(value, int) and not isinstance(value, bool)
            elif t == "number":
                ok |= isinstance(value, (int, float)) and not isinstance(value, bool)
            elif t == "boolean":
                ok |= isinstance(value, bool)
            else:
                ok |= isinstance(value, kinds[t])
        assert ok, f"{path}: {value!r} is not of type {types}"
    if value is None:
        return
    if "const" in schema:
        assert value == schema["const"], f"{path}: {value!r} != {schema['const']!r}"
    if "enum" in schema:
        assert value in schema["enum"], f"{path}: {value!r} not in {schema['enum']}"
    if "minimum" in schema:
        assert value >= schema["minimum"], f"{path}: {value} < {schema['minimum']}"
    if "maximum" in schema:
        assert value <= schema["maximum"], f"{path}: {value} > {schema['maximum']}"
    if isinstance(value, dict):
        for key in schema.get("required", ()):
            assert key in value, f"{path}: missing {key!r}"
        for key, sub in schema.get("properties", {}).items():
            if key in value:
                validate(value[key], sub, f"{path}.{key}")
    if isinstance(value, list) and "items" in schema:
        for i, v in enumerate(value):
            validate(v, schema["items"], f"{path}[{i}]")


def validate_line(line: dict) -> None:
    """A whole OpenAI batch output line: the envelope, then its body by kind."""
    validate(line, SCHEMA)
    resp = line["response"]
    if line["error"] is None:
        assert resp["status_code"] == 200
        kind = {"chat.completion": "chat_completion", "text_completion": "text_completion"}[resp["body"]["object"]]
        validate(resp["body"], SCHEMA["$defs"][kind], "$.response.body")
        usage = resp["body"]["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    else:
        assert resp["status_code"] in (400, 500)
        validate(resp["body"], SCHEMA["$defs"]["error_body"], "$.response.body")


def test_the_validator_rejects_what_it_should():
    good = {"id": "b", "custom_id": "c", "error": None, "response": {
        "status_code": 200, "request_id": "r", "body": {
            "id": "x", "object": "chat.completion", "created": 0, "model": "m",
            "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3},
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                         "finish_reason": "stop", "logprobs": None}]}}}
    validate_line(good)
    for broken in (
        lambda d: d.pop("custom_id"),
        lambda d: d["response"]["body"]["choices"][0].update(finish_reason="done"),
        lambda d: d["response"]["body"]["choices"][0]["message"].pop("content"),
        lambda d: d["response"]["body"].update(created=1.5),
        lambda d: d["response"]["body"]["choices"][0].update(logprobs={"content": [{"token": "a"}]}),
    ):
        bad = json.loads(json.dumps(good))
        broken(bad)
        with pytest.raises(AssertionError):
            validate_line(bad)


def lines(text: str) -> list[dict]:
    return [json.loads(x) for x in text.splitlines() if x.strip()]


def write(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


# ------------------------------------------------------------------------------ records


def test_n_and_logprobs_are_parsed_with_openai_semantics():
    chat, comp, plain = parse(
        {"custom_id": "a", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "x"}], "n": 3, "logprobs": True, "top_logprobs": 4}},
        {"custom_id": "b", "url": "/v1/completions", "body": {"prompt": "x", "logprobs": 2}},
        {"prompt": "x", "logprobs": True},
    )
    assert chat.overrides == {"n": 3, "logprobs": True, "top_logprobs": 4} and chat.ignored == []
    assert comp.overrides == {"logprobs": True, "top_logprobs": 2} and comp.ignored == []
    assert plain.overrides == {"logprobs": True}
    sp = SamplingParams(seed=7).with_overrides(chat.overrides)
    assert (sp.n, sp.logprobs, sp.top_logprobs, sp.seed) == (3, True, 4, 7)


@pytest.mark.parametrize("record,fragment", [
    ({"prompt": "x", "n": 0}, "'n' must be an integer in [1, 128], got 0"),
    ({"prompt": "x", "n": True}, "'n' must be an integer in [1, 128], got true"),
    ({"prompt": "x", "top_logprobs": 21, "logprobs": True}, "'top_logprobs' must be an integer in [0, 20]"),
    ({"prompt": "x", "top_logprobs": 2, "logprobs": False}, "'top_logprobs' needs 'logprobs': true"),
    ({"custom_id": "c", "url": "/v1/completions", "body": {"prompt": "x", "logprobs": True}},
     "'body.logprobs' must be an integer in [0, 20], got true"),
])
def test_bad_n_and_logprobs_are_error_records(record, fragment):
    (err,) = parse(record)
    assert err.type == "invalid_record" and fragment in err.message, err


def test_keys_marscli_does_not_act_on_are_reported_and_identifying_ones_are_quiet():
    batch, plain, neutral = parse(
        {"custom_id": "a", "body": {"messages": [{"role": "user", "content": "x", "name": "bob"}],
                                    "model": "gpt-4o", "user": "u1", "metadata": {"k": 1},
                                    "tools": [{"type": "function"}], "response_format": {"type": "json_object"},
                                    "some_vendor_key": 1, "seed": 3}},
        {"prompt": "x", "presence_penalty": 0.5, "logit_bias": {"1": 5}, "my_metadata": "kept quietly"},
        {"custom_id": "b", "body": {"prompt": "x", "presence_penalty": 0, "frequency_penalty": 0.0,
                                    "logit_bias": {}, "stream": False, "n": None, "tools": None}},
    )
    assert batch.ignored == ["body.messages[0].name", "body.tools", "body.response_format",
                             "body.some_vendor_key"]
    assert plain.ignored == ["presence_penalty", "logit_bias"]
    assert neutral.ignored == []
    # a completions body asks with its int logprobs: a chat-only key is reported there
    (comp,) = parse({"custom_id": "c", "url": "/v1/completions", "body": {"prompt": "x", "top_logprobs": 2}})
    assert comp.ignored == ["body.top_logprobs"] and "logprobs" not in comp.overrides


# ------------------------------------------------------------------------------ logprobs


@pytest.mark.parametrize("batch_size", [1, 3])
@pytest.mark.parametrize("kind,verify", [("ngram", VerifyConfig()), ("model", VerifyConfig()),
                                         ("runner-up", VerifyConfig("mars", 0.3, "prob-ratio"))],
                         ids=["ngram-strict", "model-strict", "runner-up-mars"])
def test_logprobs_equal_log_softmax_of_transformers_forward(target, tiny_draft_dir, batch_size, kind, verify):
    """Greedy output's logprobs (and top alternatives) are the target's own, from the
    verification logits: equal to a plain forward over prompt + output. Under MARS with a
    drafter that offers the target's runner-up, relaxed tokens are emitted and still get the
    target's logprob."""
    from marscli.drafters.base import RowDrafters
    from marscli.engine import build_engine
    from marscli.engine.scheduler import Engine
    from marscli.models.loading import load_model

    if kind == "runner-up":
        from tests.engines import RunnerUpDrafter

        dcfg = DraftConfig(kind="model", model="x", num_draft_tokens=3, adaptive=False)
        engine = Engine(target, RowDrafters(lambda: RunnerUpDrafter(target.model, 3)), verify.rule, dcfg,
                        batch_size)
    else:
        draft = load_model(ModelConfig(str(tiny_draft_dir), dtype="float32", device="cpu")) if kind == "model" else None
        engine = build_engine(target, draft, verify, DraftConfig(kind=kind, num_draft_tokens=4, adaptive=False),
                              batch_size)
    top = 3
    sp = SamplingParams(max_tokens=24, logprobs=True, top_logprobs=top)
    ids = [target.tokenizer(p).input_ids for p in PROMPTS]
    out = dict(engine.run(range(len(PROMPTS)), lambda i: (ids[i], sp)))
    relaxed = 0
    for i, res in out.items():
        assert not isinstance(res, Exception), res
        assert len(res.token_ids) > 0
        check_logprobs(target.model, ids[i], res, top)
        relaxed += res.stats.relaxed
    if verify.mode == "mars":
        assert relaxed > 0  # the relaxed path was exercised


def test_logprobs_do_not_change_the_output_and_cost_no_extra_transfer(target, monkeypatch):
    from marscli.engine import build_engine
    from marscli.verification.chain import VerifyResult

    engine = build_engine(target, None, VerifyConfig(), DraftConfig(kind="ngram", num_draft_tokens=4), 2)
    calls = {"host": 0, "steps": 0, "joins": 0}
    real_host, real_step, real_join = VerifyResult.host_rows, engine.step, engine.start_rows

    def host(self, *a, **kw):
        calls["host"] += 1
        return real_host(self, *a, **kw)

    def step(*a, **kw):
        calls["steps"] += 1
        return real_step(*a, **kw)

    monkeypatch.setattr(VerifyResult, "host_rows", host)
    def join(*a, **kw):
        calls["joins"] += 1
        return real_join(*a, **kw)

    monkeypatch.setattr(engine, "step", step)
    monkeypatch.setattr(engine, "start_rows", join)
    ids = [target.tokenizer(p).input_ids for p in PROMPTS]
    plain = SamplingParams(max_tokens=16, temperature=0.9, seed=3)
    with_lp = SamplingParams(max_tokens=16, temperature=0.9, seed=3, logprobs=True)
    a = dict(engine.run(range(3), lambda i: (ids[i], plain)))
    b = dict(engine.run(range(3), lambda i: (ids[i], with_lp if i != 1 else plain)))
    assert all(a[i].token_ids == b[i].token_ids for i in range(3))
    assert a[0].logprobs is None and b[1].logprobs is None and len(b[0].logprobs) == len(b[0].token_ids)
    # one transfer a step, and one a joining group (its first tokens, from the prefill)
    assert engine.first_from_prefill
    assert calls["host"] == calls["steps"] + calls["joins"]


# ------------------------------------------------------------------------------ n


@pytest.mark.parametrize("batch_size", [1, 4])
def test_n_choices_equal_single_runs_with_seeds_seed_to_seed_plus_n(runner, tiny_model_dir, tmp_path,
                                                                    batch_size, monkeypatch):
    from marscli.engine.scheduler import Engine

    engines = []
    real_init = Engine.__init__

    def init(self, *a, **kw):
        real_init(self, *a, **kw)
        engines.append(self)

    monkeypatch.setattr(Engine, "__init__", init)
    src = write(tmp_path / "in.jsonl", [{"id": "s", "prompt": PROMPTS[0], "n": 3, "seed": 11},
                                        {"id": "g", "prompt": PROMPTS[1], "n": 2, "temperature": 0}])
    common = ["--target", str(tiny_model_dir), "--max-tokens", "8", "--temperature", "0.9", "--no-timing",
              "--token-ids", "--batch-size", str(batch_size), "-q",
              "--fixed-k"]  # adaptive lengths follow the batch (issue 16): sampled outputs would too
    r = runner.invoke(app, ["generate", str(src), *common])
    assert r.exit_code == EXIT_OK, r.stderr
    sampled, greedy = lines(r.stdout)
    # one prefill per request: the other choices take its prompt from the prefix cache
    (engine,) = engines
    # (every choice computes its prompt's last token: its logits give the first output token)
    cached = [len(engine.target.tokenizer(p).input_ids) - 1 for p in PROMPTS[:2]]
    assert engine.prefiller.tokens <= sum(cached) + 3 + 2
    assert engine.prefix_tokens_reused >= 2 * cached[0] + cached[1]
    # temperature > 0: choice i is the single-sample run with seed 11 + i
    singles = write(tmp_path / "single.jsonl", [{"id": f"s{i}", "prompt": PROMPTS[0], "seed": 11 + i}
                                                for i in range(3)])
    r1 = runner.invoke(app, ["generate", str(singles), *common])
    single = lines(r1.stdout)
    assert [c["output"] for c in sampled["choices"]] == [s["output"] for s in single]
    assert [c["token_ids"] for c in sampled["choices"]] == [s["token_ids"] for s in single]
    assert [c["spec"]["steps"] for c in sampled["choices"]] == [s["spec"]["steps"] for s in single]
    assert len({c["output"] for c in sampled["choices"]}) > 1  # the seeds differ, so do the samples
    # the n = 1 fields: choice 0's output, summed usage and counters
    assert sampled["output"] == single[0]["output"] and sampled["finish_reason"] == single[0]["finish_reason"]
    assert sampled["usage"]["completion_tokens"] == sum(s["usage"]["completion_tokens"] for s in single)
    assert sampled["spec"]["steps"] == sum(s["spec"]["steps"] for s in single)
    assert [c["index"] for c in sampled["choices"]] == [0, 1, 2] and "token_ids" not in sampled
    # greedy: n identical choices
    assert greedy["choices"][0]["token_ids"] == greedy["choices"][1]["token_ids"]


def test_n_1_output_is_byte_identical_to_no_option(runner, tiny_model_dir, tmp_path):
    src = write(tmp_path / "in.jsonl", [{"id": "a", "prompt": PROMPTS[0]}, {"id": "b", "prompt": PROMPTS[2]}])
    common = [str(src), "--target", str(tiny_model_dir), "--max-tokens", "6", "--temperature", "0.7",
              "--no-timing", "-q"]
    a = runner.invoke(app, ["generate", *common])
    b = runner.invoke(app, ["generate", *common, "--n", "1"])
    assert a.exit_code == b.exit_code == EXIT_OK and a.stdout == b.stdout
    assert set(lines(a.stdout)[0]) == {"id", "output", "finish_reason", "usage", "spec", "timing", "error"}


def test_n_from_the_command_line_and_a_record_override(runner, tiny_model_dir, tmp_path):
    src = write(tmp_path / "in.jsonl", [{"id": "a", "prompt": PROMPTS[0]}, {"id": "b", "prompt": PROMPTS[2], "n": 1}])
    r = runner.invoke(app, ["generate", str(src), "--target", str(tiny_model_dir), "--max-tokens", "4",
                            "--no-timing", "-q", "--n", "2"])
    a, b = lines(r.stdout)
    assert len(a["choices"]) == 2 and "choices" not in b


N_RECORDS = 6
RUN = ["--no-timing", "--max-tokens", "6", "--temperature", "0.8", "--seed", "5", "-q", "--n", "3",
       "--top-logprobs", "2"]


@pytest.fixture(scope="module")
def n_records(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("n-records")
    return write(d / "in.jsonl", [{"id": f"r{i}", "prompt": f"the quick brown fox {i} jumps"}
                                  for i in range(N_RECORDS)])


@pytest.fixture(scope="module", params=["default", "openai"])
def n_reference(request, n_records, tiny_model_dir, tmp_path_factory):
    fmt = request.param
    out = tmp_path_factory.mktemp("n-ref") / "out.jsonl"
    r = CliRunner().invoke(app, ["generate", str(n_records), "--target", str(tiny_model_dir), "-o", str(out),
                                 "--output-format", fmt, *RUN])
    assert r.exit_code == EXIT_OK, r.stderr
    return fmt, out.read_bytes()


def test_resume_after_sigterm_in_the_middle_of_a_requests_samples(runner, n_records, tiny_model_dir, tmp_path,
                                                                  n_reference, monkeypatch):
    """SIGTERM arrives as choice 1 of the third request starts: two requests are written, the
    third's finished choice is lost with it, and --resume makes the very file of an
    undisturbed run (in both formats)."""
    from marscli.engine.scheduler import Engine

    fmt, reference = n_reference
    real = Engine.start_rows

    def start_row(self, joiners, *a, **kw):
        if any(j.item.item.id == "r2" and j.item.index == 1 for j in joiners):
            os.kill(os.getpid(), signal.SIGTERM)
        return real(self, joiners, *a, **kw)

    monkeypatch.setattr(Engine, "start_rows", start_row)
    out = tmp_path / "out.jsonl"
    args = [str(n_records), "--target", str(tiny_model_dir), "-o", str(out), "--output-format", fmt, *RUN]
    r = runner.invoke(app, ["generate", *args])
    assert r.exit_code == EXIT_TERMINATED, r.stderr
    assert out.read_bytes() == b"".join(reference.splitlines(keepends=True)[:2])
    monkeypatch.setattr(Engine, "start_rows", real)
    r = runner.invoke(app, ["generate", *args, "--resume"])
    assert r.exit_code == EXIT_OK, r.stderr
    assert out.read_bytes() == reference


def test_sigkill_mid_samples_then_resume_is_byte_identical(runner, n_records, tiny_model_dir, tmp_path,
                                                           n_reference):
    from tests.helpers import _start, _wait_for_lines

    fmt, reference = n_reference
    out = tmp_path / "out.jsonl"
    args = [str(n_records), "--target", str(tiny_model_dir), "-o", str(out), "--output-format", fmt, *RUN]
    proc = _start(args, stdout=subprocess.DEVNULL)
    _wait_for_lines(proc, out, 1)
    proc.send_signal(signal.SIGKILL)  # the next request's samples are under way
    proc.communicate(timeout=120)
    assert proc.returncode in (-signal.SIGKILL, EXIT_OK)
    r = runner.invoke(app, ["generate", *args, "--resume"])
    assert r.exit_code == EXIT_OK, r.stderr
    assert out.read_bytes() == reference


# ------------------------------------------------------------------------------ OpenAI format


def test_openai_format_lines_validate_against_the_schema(runner, tiny_model_dir, tmp_path):
    src = write(tmp_path / "in.jsonl", [
        {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "whatever", "messages": [{"role": "user", "content": "hello"}],
                  "max_completion_tokens": 5, "logprobs": True, "top_logprobs": 2, "n": 2, "temperature": 0.9}},
        {"custom_id": "comp", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "one two three", "max_tokens": 5, "logprobs": 1}},
        {"id": "plain", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        {"custom_id": "bad", "body": {"prompt": 3}},
        {"custom_id": "warned", "body": {"prompt": "x", "max_tokens": 3, "tools": [{"type": "function"}]}},
    ])
    args = ["generate", str(src), "--target", str(tiny_model_dir), "--output-format", "openai", "-q",
            "--token-ids"]
    r = runner.invoke(app, args)
    assert r.exit_code == EXIT_RECORDS_FAILED, r.stderr
    rows = lines(r.stdout)
    for row in rows:
        validate_line(row)
    chat, comp, plain, bad, warned = rows
    assert [x["custom_id"] for x in rows] == ["chat", "comp", "plain", "bad", "warned"]
    body = chat["response"]["body"]
    assert body["object"] == "chat.completion" and len(body["choices"]) == 2
    assert body["created"] > 0  # --timing (the default): the wall clock
    assert all(len(c["logprobs"]["content"]) == len(chat["marscli"]["choices"][i]["token_ids"])
               for i, c in enumerate(body["choices"]))
    assert [len(t["top_logprobs"]) for t in body["choices"][0]["logprobs"]["content"]] == [2] * len(
        body["choices"][0]["logprobs"]["content"])
    assert body["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in chat["marscli"]["choices"])
    assert "spec" in chat["marscli"] and all("spec" in c for c in chat["marscli"]["choices"])
    cb = comp["response"]["body"]
    assert cb["object"] == "text_completion" and cb["choices"][0]["text"] is not None
    lp = cb["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == len(comp["marscli"]["token_ids"])
    assert lp["text_offset"][0] == 0 and all(len(d) <= 1 for d in lp["top_logprobs"])
    assert plain["response"]["body"]["choices"][0]["logprobs"] is None
    assert bad["error"]["code"] == "invalid_record" and bad["response"]["status_code"] == 400
    assert warned["marscli"]["warnings"] == ["body.tools: marscli does not act on this key; it was ignored"]
    assert chat["id"] != comp["id"] and chat["id"].startswith("batch_req_")


def test_openai_format_is_deterministic_without_timing(runner, tiny_model_dir, tmp_path):
    src = write(tmp_path / "in.jsonl", [{"custom_id": "a", "body": {"prompt": "one two", "max_tokens": 3}}])
    args = ["generate", str(src), "--target", str(tiny_model_dir), "--output-format", "openai", "-q", "--no-timing"]
    a, b = runner.invoke(app, args), runner.invoke(app, args)
    assert a.stdout == b.stdout and lines(a.stdout)[0]["response"]["body"]["created"] == 0
    c = runner.invoke(app, [*args, "--seed", "1"])  # another run: other ids
    assert lines(c.stdout)[0]["id"] != lines(a.stdout)[0]["id"]


def test_unknown_keys_warn_once_on_stderr_and_strict_keys_makes_errors(runner, tiny_model_dir, tmp_path):
    src = write(tmp_path / "in.jsonl", [
        {"custom_id": "a", "body": {"prompt": "x", "max_tokens": 2, "response_format": {"type": "json_object"}}},
        {"custom_id": "b", "body": {"prompt": "y", "max_tokens": 2, "model": "gpt-4o-mini"}},
        {"custom_id": "c", "body": {"prompt": "z", "max_tokens": 2, "response_format": {"type": "text"},
                                    "logit_bias": {"5": 10}}},
    ])
    args = ["generate", str(src), "--target", str(tiny_model_dir), "--no-timing"]
    r = runner.invoke(app, args)
    assert r.exit_code == EXIT_OK, r.stderr
    a, b, c = lines(r.stdout)
    assert a["warnings"] == ["body.response_format: marscli does not act on this key; it was ignored"]
    assert "warnings" not in b  # model only identifies
    assert len(c["warnings"]) == 2
    note = [x for x in r.stderr.splitlines() if "do not act on" in x or "does not act on" in x]
    assert len(note) == 1 and "body.response_format (2)" in note[0] and "body.logit_bias (1)" in note[0]
    assert "2 record(s)" in note[0]
    r = runner.invoke(app, [*args, "--strict-keys"])
    assert r.exit_code == EXIT_RECORDS_FAILED
    a, b, c = lines(r.stdout)
    assert a["error"]["type"] == "unsupported_key" and "body.response_format" in a["error"]["message"]
    assert b["error"] is None and c["output"] is None


# ------------------------------------------------------------------------------ Python API


def test_python_api_takes_the_same_options(tiny_model_dir):
    import marscli

    llm = marscli.load(str(tiny_model_dir), "none", verify="strict", device="cpu", dtype="float32")
    recs = [{"id": "q", "messages": [{"role": "user", "content": "hello"}]}]
    (res,) = llm.generate(recs, max_tokens=5, n=2, top_logprobs=1, temperature=0.8, seed=4, timing=False)
    assert len(res["choices"]) == 2 and len(res["choices"][1]["logprobs"]["content"][0]["top_logprobs"]) == 1
    (one,) = llm.generate(recs, max_tokens=5, temperature=0.8, seed=5, timing=False)
    assert res["choices"][1]["output"] == one["output"]
    (oa,) = llm.generate(recs, max_tokens=5, n=2, logprobs=True, output_format="openai", timing=False)
    validate_line(oa)
    assert oa["custom_id"] == "q" and len(oa["response"]["body"]["choices"]) == 2
    (strict,) = llm.generate([{"prompt": "x", "tools": [1]}], max_tokens=2, strict_keys=True)
    assert strict["error"]["type"] == "unsupported_key"


# ------------------------------------------------------------------------------ embedded


@pytest.mark.embedded
def test_embedded_logprobs_equal_transformers_forward(embedded_model):
    """On the real SmolLM2-135M-Instruct, greedy strict output with the ngram drafter: the
    logprobs are log_softmax of the model's own forward over prompt + output."""
    from marscli.engine import build_engine

    engine = build_engine(embedded_model, None, VerifyConfig(), DraftConfig(kind="ngram", num_draft_tokens=6))
    ids = embedded_model.tokenizer("The capital of France is Paris. The capital of Italy is").input_ids
    res = engine.generate_ids(ids, SamplingParams(max_tokens=24, logprobs=True, top_logprobs=2))
    assert res.stats.accepted > 0  # drafts were accepted: logprobs of several tokens per step
    check_logprobs(embedded_model.model, ids, res, 2)
