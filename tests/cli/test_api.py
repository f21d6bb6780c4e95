"""The Python API (marscli.load(...).generate/calibrate) returns exactly what the CLI writes,
because the CLI runs the same code path."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import marscli
from marscli.cli import app
from marscli.errors import EXIT_OK, EXIT_RECORDS_FAILED, InputError, UsageError
from marscli.io.results import dump_json_line

RECORDS = [
    {"id": "a", "prompt": "hello world, hello marscli; the cat sat on the mat. hello world, hello"},
    {"id": "b", "messages": [{"role": "user", "content": "hello world"}], "max_tokens": 5},
    {"id": "bad", "text": "neither prompt nor messages"},
    {"id": "typed", "prompt": 42},
    {"custom_id": "c", "method": "POST", "url": "/v1/completions",
     "body": {"prompt": "one two three one two three one", "max_tokens": 9}},
    {"id": "hot", "prompt": "the quick brown fox jumps", "temperature": 0.8, "seed": 3},
]


def cli_bytes(runner, tmp_path, records, *args) -> bytes:
    """What `marscli generate --no-timing -o FILE` writes for `records`."""
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    r = runner.invoke(app, ["generate", str(src), "--no-timing", "-q", "-o", str(out), *map(str, args)])
    assert r.exit_code in (EXIT_OK, EXIT_RECORDS_FAILED), r.stderr
    return out.read_bytes()


def as_bytes(results: list[dict]) -> bytes:
    return "".join(dump_json_line(r) + "\n" for r in results).encode("utf-8")


def cli_results(runner, tmp_path, records, *args) -> list[dict]:
    return [json.loads(line) for line in cli_bytes(runner, tmp_path, records, *args).split(b"\n") if line]


@pytest.mark.parametrize("options", [
    {"verify": "strict"},
    {"verify": "mars", "theta": 0.5, "batch_size": 3},
    {"verify": "strict", "batch_size": 4, "num_draft_tokens": 3},
])
def test_generate_returns_the_lines_the_cli_writes(runner, tiny_model_dir, tmp_path, options):
    args = ["--target", tiny_model_dir, "--max-tokens", 16, "--token-ids"]
    for key, value in options.items():
        args += [f"--{key.replace('_', '-')}", value]
    written = cli_bytes(runner, tmp_path, RECORDS, *args)
    llm = marscli.load(str(tiny_model_dir), **options)
    got = llm.generate(RECORDS, max_tokens=16, timing=False, token_ids=True)
    assert as_bytes(got) == written
    # Bad records are error results in place, with the CLI's types and line numbers.
    assert got[2]["error"]["type"] == "invalid_record" and got[2]["error"]["line"] == 3
    assert got[3]["output"] is None and got[3]["error"]["line"] == 4
    assert got[4]["custom_id"] == "c" and "id" not in got[4]
    assert got[0]["spec"]["verify"] == options["verify"]


def test_strings_are_prompt_records_and_stream_keeps_input_order(runner, tiny_model_dir, tmp_path):
    prompts = ["the cat sat on the mat", "one two three"]
    # A fixed K and no job corpus: the CLI at batch size 1 and the API at 2 then write the same
    # statistics too (adaptive draft lengths follow the batch; the corpus, what finished before).
    written = cli_bytes(runner, tmp_path, [{"prompt": p} for p in prompts], "--target", tiny_model_dir,
                        "--max-tokens", 8, "--no-profile", "--fixed-k", "--no-job-corpus")
    llm = marscli.load(str(tiny_model_dir), auto_profile=False, batch_size=2, adaptive=False, job_corpus=False)
    streamed = list(llm.stream(prompts, max_tokens=8, timing=False))
    assert [r["id"] for r in streamed] == ["0", "1"]
    assert as_bytes(streamed) == written
    one = llm.generate("the cat sat on the mat", max_tokens=8, timing=False)
    assert one == streamed[:1]


def test_a_capped_max_tokens_is_said_in_the_result(runner, tiny_model_dir, tmp_path):
    """A record asking for more than the context window leaves gets usage.max_tokens_capped_to
    (the tiny model's window is 512 tokens); one that fits keeps its usage bytes unchanged."""
    records = [{"id": "long", "prompt": "hello world " * 40, "max_tokens": 1000},
               {"id": "short", "prompt": "hello", "max_tokens": 4}]
    long, short = cli_results(runner, tmp_path, records, "--target", tiny_model_dir, "--verify", "strict")
    usage = long["usage"]
    assert usage["max_tokens_capped_to"] == 512 - usage["prompt_tokens"]
    assert usage["completion_tokens"] <= usage["max_tokens_capped_to"]
    assert set(short["usage"]) == {"prompt_tokens", "completion_tokens"}
    api = marscli.load(str(tiny_model_dir), verify="strict").generate(records, timing=False)
    assert api == [long, short]


def test_duplicate_ids_and_bad_arguments_are_refused(tiny_model_dir):
    llm = marscli.load(str(tiny_model_dir), verify="strict")
    with pytest.raises(InputError, match="duplicate id 'x'"):
        llm.generate([{"id": "x", "prompt": "a"}, {"id": "x", "prompt": "b"}])
    with pytest.raises(UsageError, match="truncate-prompt"):
        llm.generate(["a"], truncate_prompt="right")
    with pytest.raises(UsageError, match="prompt string or a dict"):
        llm.generate([3])
    with pytest.raises(UsageError, match="--verify must be"):
        marscli.load(str(tiny_model_dir), verify="loose")
    with pytest.raises(UsageError, match="unknown option.*thetaa"):
        marscli.load(str(tiny_model_dir), thetaa=0.9)


def test_load_takes_generates_options_as_its_keywords():
    import dataclasses
    import inspect

    from marscli.config import GenerationOptions

    params = inspect.signature(marscli.load).parameters
    assert list(params)[:2] == ["target", "draft"]  # positional, as before
    assert set(params) - {"quiet"} == {f.name for f in dataclasses.fields(GenerationOptions)}
    assert params["verify"].default is None and params["auto_profile"].default is True


def test_calibrate_returns_the_profile_the_cli_writes(runner, tiny_model_dir, tmp_path):
    records = [{"id": str(i), "prompt": p} for i, p in enumerate(
        ["hello world, hello marscli; the cat sat on the mat. hello world, hello",
         "one two three four one two three four one two", "a margin a margin a margin"])]
    src = tmp_path / "cal.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "cli.yaml"
    r = runner.invoke(app, ["calibrate", str(src), "--target", str(tiny_model_dir), "--max-tokens", "24",
                            "--relax-rate", "0.2", "-o", str(out), "-q"])
    assert r.exit_code == EXIT_OK, r.stderr
    from marscli.calibration.profiles import load_profile

    cli_prof = load_profile(out)
    prof = marscli.load(str(tiny_model_dir)).calibrate(records, relax_rate=0.2, max_tokens=24)
    assert prof.theta == cli_prof.theta and prof.margin == cli_prof.margin
    for key in ("histogram", "summary", "target", "drafter", "policy"):
        a, b = prof.data[key], cli_prof.data[key]
        if key == "summary":  # wall-clock figures differ between two runs
            a = {k: v for k, v in a.items() if "second" not in k and "per_s" not in k}
            b = {k: v for k, v in b.items() if "second" not in k and "per_s" not in k}
        assert a == b, key


def test_import_marscli_stays_light():
    code = "import sys, marscli; marscli.LLM; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
