"""The rulebook's relaxed rules from generate, the Python API and bench (issue 14): options
and their usage errors, the modes each rule defines, the rule and its knobs in every result's
spec, in the resume fingerprint and in bench's report."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

import marscli
from marscli.bench.methods import MethodSpec, parse_methods
from marscli.cli import app
from marscli.config import GUARD_OFF, GuardConfig, VerifyConfig, VerifyRequest
from marscli.errors import EXIT_OK, EXIT_RECORDS_FAILED, EXIT_USAGE, UsageError
from marscli.jobs.setup import verify_desc
from marscli.verification.registry import ALL_KNOBS, OTHER_KNOBS, RULEBOOK, Rule

#: A prompt whose n-grams repeat, so the ngram drafter has drafts to verify.
PROMPT = "hello world, hello marscli; the cat sat on the mat. hello world, hello the cat sat on the"
MAX_TOKENS = "10"


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def generate(runner, src, target, *args):
    return runner.invoke(app, ["generate", str(src), "--target", str(target), "--max-tokens", MAX_TOKENS,
                               "--no-timing", *map(str, args)])


def lines(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.strip()]  # every stdout line is JSON


# ------------------------------------------------------------------------------ configs


def test_config_knows_every_rule_and_builds_it():
    # The Rule and the request carry exactly the registry's knobs, each defaulting to its
    # strict end (VerifyConfig holds a Rule).
    fields = lambda cls: [f.name for f in dataclasses.fields(cls)]  # noqa: E731
    assert [k for k in fields(Rule) if k in ALL_KNOBS] == list(ALL_KNOBS)
    assert fields(VerifyConfig) == ["rule", "guard"]  # the knobs are the Rule's, read through
    assert [k for k in fields(VerifyRequest) if k in ALL_KNOBS] == list(ALL_KNOBS)
    assert set(fields(Rule)) - set(ALL_KNOBS) == {"name", "margin"}
    for knob in OTHER_KNOBS:
        assert getattr(VerifyConfig(), knob) == getattr(Rule(), knob) == ALL_KNOBS[knob].default \
            or knob == "alpha"
    assert VerifyConfig().top_n == RULEBOOK["topk"].knob("top_n").default == 2
    # Existing positional call sites keep their meaning: mode, theta, margin, guard.
    v = VerifyConfig("mars", 0.8, "prob-ratio", GUARD_OFF)
    assert v.rule == Rule("mars", 0.8, "prob-ratio")
    # Every other knob defaults to its rule's strict end (typical's alpha defaults to
    # sqrt(epsilon), so typical is strict at alpha = inf only).
    for name in ("ratio", "topk", "regret"):
        assert not VerifyConfig(name).rule.relaxes, name
    assert not VerifyConfig("typical", alpha=math.inf).rule.relaxes
    assert VerifyConfig("typical").rule.alpha == 1.0
    rule = Rule("typical", epsilon=0.09)
    v = VerifyConfig.from_rule(rule, GuardConfig())
    assert v.rule == rule and v.rule.alpha == pytest.approx(0.3) and v.guard == GuardConfig()
    assert VerifyConfig("topk", top_n=3, delta=0.1).rule.knobs() == {"top_n": 3, "delta": 0.1}


def test_verify_desc_names_the_rule_its_knobs_and_the_guard():
    assert verify_desc(VerifyConfig()) == "strict"
    assert verify_desc(VerifyConfig("ratio", rho=0.5, guard=GuardConfig())) == \
        "ratio (rho=0.5; repeat guard 4-grams in 256 tokens, at most 0.25 relaxed, first 2 strict, strict stops)"
    assert verify_desc(VerifyConfig("regret", budget=2.0)) == "regret (budget=2; no guard)"
    assert verify_desc(VerifyConfig("mars", 0.9)).startswith("mars (theta=0.9, logit-ratio;")


# ------------------------------------------------------------------------------ generate


@pytest.mark.parametrize("args,knobs", [
    (["--verify", "ratio", "--rho", "0.5"], {"rho": 0.5}),
    (["--rule", "topk", "--top-n", "3", "--delta", "0.1"], {"top_n": 3, "delta": 0.1}),
    (["--verify", "topk", "--delta", "0.2"], {"top_n": 2, "delta": 0.2}),
    (["--verify", "typical", "--epsilon", "0.09"], {"epsilon": 0.09, "alpha": 0.3}),
    (["--verify", "typical", "--epsilon", "0.1", "--alpha", "0.5"], {"epsilon": 0.1, "alpha": 0.5}),
    (["--verify", "regret", "--budget", "2"], {"budget": 2.0}),
    (["--verify", "mars", "--theta", "0.5"], {"theta": 0.5, "margin": "logit-ratio"}),
])
def test_generate_with_each_rule_records_it_in_every_spec(runner, tiny_model_dir, tmp_path, args, knobs):
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": PROMPT}, {"id": "b", "prompt": "one two one two"}])
    r = generate(runner, src, tiny_model_dir, *args)
    assert r.exit_code == EXIT_OK, r.stderr
    res = lines(r.stdout)
    assert [x["id"] for x in res] == ["a", "b"]
    name = args[1]
    for x in res:
        assert x["error"] is None
        spec = x["spec"]
        assert spec["verify"] == name
        assert spec["knobs"].keys() == knobs.keys()
        for k, v in knobs.items():
            assert spec["knobs"][k] == pytest.approx(v) if isinstance(v, float) else spec["knobs"][k] == v
        assert spec["guard"] == GuardConfig().to_dict()  # the loop guard applies to every relaxed rule
        assert spec["theta"] == (0.5 if name == "mars" else None)
    assert f"verify {name} (" in r.stderr and "repeat guard 4-grams" in r.stderr
    assert "error" not in r.stderr


def test_rules_at_their_strict_end_equal_strict_and_a_lenient_one_relaxes(runner, tiny_model_dir, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": PROMPT}])

    def run(*args):
        r = generate(runner, src, tiny_model_dir, "--token-ids", "--fixed-k", "--no-guard", *args)
        assert r.exit_code == EXIT_OK, r.stderr
        return lines(r.stdout)[0]

    strict = run("--verify", "strict")
    assert strict["spec"]["knobs"] == {} and "guard" not in strict["spec"]
    for args in (["--verify", "ratio", "--rho", "1"], ["--verify", "topk", "--top-n", "5", "--delta", "0"],
                 ["--verify", "regret", "--budget", "0"], ["--verify", "typical", "--epsilon", "1", "--alpha", "inf"]):
        x = run(*args)
        assert x["token_ids"] == strict["token_ids"], args
        assert x["spec"]["relaxed"] == 0, args
    # On a tiny random target nearly every draft has p(x) >= 0.01 * p1: ratio relaxes.
    lenient = run("--verify", "ratio", "--rho", "0.01")
    assert lenient["spec"]["relaxed"] > 0
    assert lenient["spec"]["drafted"] > 0


@pytest.mark.parametrize("args,fragment", [
    (["--verify", "ratio"], "--verify ratio needs --rho (0 < R <= 1)"),
    (["--verify", "topk", "--top-n", "3"], "--verify topk needs --delta (D >= 0)"),
    (["--verify", "typical"], "--verify typical needs --epsilon (0 < E <= 1)"),
    (["--rule", "regret"], "--verify regret needs --budget (B >= 0)"),
    (["--rho", "0.5"], "--rho needs --verify ratio"),
    (["--alpha", "0.5"], "--alpha needs --verify typical"),
    (["--verify", "topk", "--delta", "0.1", "--rho", "0.5"], "--rho belongs to --verify ratio, not --verify topk"),
    (["--verify", "mars", "--budget", "1"], "--budget belongs to --verify regret, not --verify mars"),
    (["--verify", "ratio", "--rho", "0.5", "--theta", "0.9"], "--theta belongs to --verify mars, not --verify ratio"),
    (["--verify", "ratio", "--rho", "2"], "--rho must be in (0, 1], got 2"),
    (["--verify", "ratio", "--rho", "0"], "--rho must be in (0, 1], got 0"),
    (["--verify", "topk", "--top-n", "0", "--delta", "0.1"], "--top-n must be at least 1, got 0"),
    (["--verify", "topk", "--delta", "-0.1"], "--delta must be at least 0, got -0.1"),
    (["--verify", "typical", "--epsilon", "1.5"], "--epsilon must be in (0, 1], got 1.5"),
    (["--verify", "typical", "--epsilon", "0.1", "--alpha", "0"], "--alpha must be positive, got 0"),
    (["--verify", "regret", "--budget", "-1"], "--budget must be at least 0, got -1"),
    (["--verify", "regret", "--budget", "2", "--temperature", "0.7"],
     "--temperature 0.7: the regret rule is defined for greedy decoding only"),
    (["--verify", "lenient"], "--verify must be one of strict, mars, ratio, topk, typical, regret"),
])
def test_rule_usage_errors_are_one_line_naming_the_option(runner, tiny_model_dir, tmp_path, args, fragment):
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "hi"}])
    r = generate(runner, src, tiny_model_dir, *args)
    assert r.exit_code == EXIT_USAGE, r.stderr
    assert r.stdout == ""
    errors = [line for line in r.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and fragment in errors[0], r.stderr


def test_a_record_asking_to_sample_under_regret_is_that_records_error(runner, tiny_model_dir, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [
        {"id": "a", "prompt": PROMPT},
        {"id": "hot", "prompt": PROMPT, "temperature": 0.8},
        {"id": "cold", "prompt": PROMPT, "temperature": 0},
    ])
    for batch in ("1", "2"):
        r = generate(runner, src, tiny_model_dir, "--verify", "regret", "--budget", "2", "--batch-size", batch)
        assert r.exit_code == EXIT_RECORDS_FAILED, r.stderr
        res = {x["id"]: x for x in lines(r.stdout)}
        assert list(res) == ["a", "hot", "cold"]
        assert res["a"]["error"] is None and res["cold"]["error"] is None
        err = res["hot"]["error"]
        assert err["type"] == "invalid_record" and err["line"] == 2
        assert "temperature 0.8" in err["message"] and "regret" in err["message"] and "greedy" in err["message"]
    # Other rules define sampling: the same record decodes.
    r = generate(runner, src, tiny_model_dir, "--verify", "ratio", "--rho", "0.5")
    assert r.exit_code == EXIT_OK, r.stderr


def test_resume_refuses_another_rule_or_knob(runner, tiny_model_dir, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": PROMPT}])
    out = tmp_path / "out.jsonl"
    base = ["-o", out, "--verify", "ratio", "--rho", "0.5"]
    r = generate(runner, src, tiny_model_dir, *base)
    assert r.exit_code == EXIT_OK, r.stderr
    first = out.read_bytes()
    sidecar = json.loads((tmp_path / "out.jsonl.marscli.json").read_text())
    assert sidecar["fingerprint"]["verify"]["mode"] == "ratio"
    assert sidecar["fingerprint"]["verify"]["knobs"] == {"rho": 0.5}
    for args, diff in ((["--verify", "ratio", "--rho", "0.6"], "verify.knobs.rho: 0.5 in the existing run, 0.6 now"),
                       (["--verify", "topk", "--delta", "0.1"], 'verify.mode: "ratio" in the existing run, "topk" now'),
                       (["--verify", "mars", "--theta", "0.5"], "verify.mode")):
        r = generate(runner, src, tiny_model_dir, "-o", out, *args, "--resume")
        assert r.exit_code == EXIT_USAGE, (args, r.stderr)
        assert "cannot resume" in r.stderr and diff in r.stderr, r.stderr
        assert out.read_bytes() == first
    r = generate(runner, src, tiny_model_dir, *base, "--resume")
    assert r.exit_code == EXIT_OK, r.stderr
    assert out.read_bytes() == first


# ------------------------------------------------------------------------------ Python API


def test_api_load_takes_the_rule_and_its_knobs(tiny_model_dir):
    llm = marscli.load(str(tiny_model_dir), verify="ratio", rho=0.5)
    assert llm.verify.rule == Rule("ratio", rho=0.5) and llm.verify.guard == GuardConfig()
    res = llm.generate([PROMPT, {"id": "hot", "prompt": PROMPT, "temperature": 0.7}], max_tokens=6)
    assert all(x["error"] is None for x in res)
    assert res[0]["spec"]["verify"] == "ratio" and res[0]["spec"]["knobs"] == {"rho": 0.5}
    regret = marscli.load(str(tiny_model_dir), verify="regret", budget=1.5)
    res = regret.generate([PROMPT, {"id": "hot", "prompt": PROMPT, "temperature": 0.7}], max_tokens=6)
    assert res[0]["error"] is None and res[0]["spec"]["knobs"] == {"budget": 1.5}
    assert res[1]["error"]["type"] == "invalid_record"
    with pytest.raises(UsageError, match="temperature 0.5: the regret rule is defined for greedy decoding only"):
        regret.generate([PROMPT], temperature=0.5)
    with pytest.raises(UsageError, match=r"--verify ratio needs --rho"):
        marscli.load(str(tiny_model_dir), verify="ratio")
    with pytest.raises(UsageError, match=r"--top-n belongs to --verify topk, not --verify ratio"):
        marscli.load(str(tiny_model_dir), verify="ratio", rho=0.5, top_n=3)


# ------------------------------------------------------------------------------ fingerprint


def test_fingerprint_holds_the_rule_and_its_knobs():
    from marscli.config import (
        DraftConfig,
        ModelConfig,
        ModelSetup,
        SamplingOptions,
        VerifyRequest,
    )
    from marscli.io.resume import fingerprint_diff
    from marscli.jobs.fingerprint import run_fingerprint

    setup = ModelSetup(target=ModelConfig("m"), draft=DraftConfig(), draft_model=None, verify=VerifyRequest())

    def fp(v):
        return run_fingerprint(setup, SamplingOptions(), None, None, {}, verify=v)["verify"]

    a = fp(VerifyConfig("typical", epsilon=0.09, guard=GuardConfig()))
    assert a["mode"] == "typical" and a["knobs"] == {"epsilon": 0.09, "alpha": pytest.approx(0.3)}
    assert a["guard"] == GuardConfig().to_dict()
    assert fingerprint_diff(a, fp(VerifyConfig("typical", epsilon=0.09, alpha=0.4, guard=GuardConfig())))
    assert fingerprint_diff(fp(VerifyConfig("topk", delta=0.1)), fp(VerifyConfig("topk", top_n=3, delta=0.1)))
    # strict and mars keep the fingerprint they had before the other rules (old sidecars match).
    assert "knobs" not in fp(VerifyConfig()) and "knobs" not in fp(VerifyConfig("mars", 0.9))
    # Before loading, the options as asked.
    asked = run_fingerprint(dataclasses.replace(setup, verify=VerifyRequest("ratio", rho=0.5)), SamplingOptions(),
                            None, None, {})["verify"]
    assert asked["mode"] == "ratio" and asked["knobs"]["rho"] == 0.5


# ------------------------------------------------------------------------------ bench


def test_bench_parses_every_method_spelling():
    specs = parse_methods("strict,mars@0.8,mars,ratio@0.5,topk@3:0.1,typical@0.09,typical@0.1:0.5,regret@2,"
                          "ratio@0.5", (0.9,))
    assert [s.name for s in specs] == ["strict", "mars@0.8", "mars@0.9", "ratio@0.5", "topk@3:0.1",
                                       "typical@0.09:0.3", "typical@0.1:0.5", "regret@2"]
    assert specs[1] == MethodSpec("mars@0.8", "mars", 0.8)
    assert specs[3] == MethodSpec("ratio@0.5", "ratio", None, Rule("ratio", rho=0.5))
    assert specs[4].rule == Rule("topk", top_n=3, delta=0.1) and isinstance(specs[4].rule.top_n, int)
    assert specs[7].rule == Rule("regret", budget=2.0)
    assert specs[1].verify_rule("prob-ratio") == Rule("mars", 0.8, "prob-ratio")
    assert specs[0].verify_rule("logit-ratio").name == "strict"
    assert MethodSpec("ar", "ar").verify_rule("logit-ratio") is None
    for bad, fragment in (("ratio@2", "method 'ratio@2' in --methods: rho must be in (0, 1], got 2"),
                          ("topk@3", "method 'topk@3' in --methods: write topk@N:D"),
                          ("topk@3.5:0.1", "N is a whole number"),
                          ("typical@0.1:0.2:0.3", "write typical@E:A or typical@E"),
                          ("regret@-1", "budget must be at least 0"),
                          ("ratio", "method 'ratio' in --methods: write ratio@R"),
                          ("ratio@x", "'x' is not a number"),
                          ("mars@nan", "'nan' is not a number"),
                          ("strict@1", "strict takes no knobs"),
                          ("foo@1", "unknown method 'foo@1'")):
        with pytest.raises(UsageError) as e:
            parse_methods(f"strict,{bad}", (0.9,))
        assert fragment in str(e.value) and "\n" not in str(e.value), (bad, str(e.value))


def test_bench_runs_every_rule_and_reports_its_knobs(runner, tiny_model_dir, tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": "1", "prompt": PROMPT},
                                                 {"id": "2", "prompt": "one two one two"}])
    out = tmp_path / "bench.json"
    methods = "strict,ratio@0.5,topk@3:0.1,typical@0.1,regret@2,mars@0.5"
    r = runner.invoke(app, ["bench", str(prompts), "--target", str(tiny_model_dir), "--max-tokens", "8",
                            "--methods", methods, "--report", str(out)])
    assert r.exit_code == EXIT_OK, r.stderr
    rep = json.loads(out.read_text())
    names = ["strict", "ratio@0.5", "topk@3:0.1", "typical@0.1:0.316228", "regret@2", "mars@0.5"]
    assert list(rep["methods"]) == names == rep["settings"]["methods"]
    m = rep["methods"]
    assert (m["strict"]["rule"], m["strict"]["knobs"]) == ("strict", {})
    assert (m["ratio@0.5"]["rule"], m["ratio@0.5"]["knobs"]) == ("ratio", {"rho": 0.5})
    assert (m["topk@3:0.1"]["rule"], m["topk@3:0.1"]["knobs"]) == ("topk", {"top_n": 3, "delta": 0.1})
    assert m["typical@0.1:0.316228"]["knobs"] == {"epsilon": 0.1, "alpha": pytest.approx(math.sqrt(0.1))}
    assert (m["regret@2"]["rule"], m["regret@2"]["knobs"]) == ("regret", {"budget": 2.0})
    assert m["mars@0.5"]["knobs"] == {"theta": 0.5, "margin": "logit-ratio"}
    for name, a in m.items():
        assert a["runs"] == 2 and a["completion_tokens"] > 0
        assert a["steps"] is not None and a["acceptance_length"] is not None, name  # speculative statistics
    assert set(rep["physical_limit"]["methods"]) == set(names)
    for name in names:
        assert name in r.stderr  # the tables show every method under its label
    # regret is greedy only: refused before anything is loaded.
    r = runner.invoke(app, ["bench", str(prompts), "--target", str(tiny_model_dir), "--methods", "strict,regret@2",
                            "--temperature", "0.5"])
    assert r.exit_code == EXIT_USAGE
    assert "regret@2: the rule is defined for greedy decoding only" in r.stderr
    r = runner.invoke(app, ["bench", str(prompts), "--target", str(tiny_model_dir), "--methods", "strict,ratio@2"])
    assert r.exit_code == EXIT_USAGE and "method 'ratio@2' in --methods" in r.stderr
