"""bench --match-relax-rate on a tiny random model: the knobs bench fits are those
match_relax_rate gives on a separate strict collection over the calibration split, the split
never overlaps the measured prompts, and the usage errors and report fields."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from marscli.bench.methods import BenchConfig, parse_methods, read_prompt_records
from marscli.cli import app
from marscli.config import GUARD_OFF, ModelConfig, VerifyConfig
from marscli.errors import EXIT_OK, EXIT_USAGE, UsageError
from marscli.jobs.bench_match import read_calibration
from marscli.verification.registry import Rule

TEXTS = [
    "hello world, hello marscli; the cat sat on the mat. hello world, hello",
    "one two three four five six seven eight nine ten one two three four",
    "speculative decoding drafts tokens and the target verifies them. speculative decoding drafts",
    "the quick brown fox jumps over the lazy dog. the quick brown fox jumps",
    "a b c d e f g a b c d e f g a b c d",
    "red green blue red green blue red green blue red",
]
MAX_TOKENS = 12
SHARE = 0.2
METHODS = "ar,strict,mars,mars-noguard,ratio,topk@3,typical,typical@0.5:0.2,regret"


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": t}) + "\n" for i, t in enumerate(TEXTS)))
    return path


def args(prompts, target, *extra):
    return ["bench", str(prompts), "--target", str(target), "--max-tokens", str(MAX_TOKENS), "-q", *extra]


def independent_collection(path, start, target_dir):
    """A strict collection over records [start, ...) of ``path`` by the calibrate job's own
    collect_margins, with bench's default loop guard."""
    from marscli.calibration.collect import MarginCollector
    from marscli.config import DraftConfig, GuardConfig, SamplingParams
    from marscli.engine import build_engine
    from marscli.jobs.calibrate import collect_margins
    from marscli.jobs.setup import load_models

    records, _, _ = read_prompt_records(str(path), None, start=start)
    target, _ = load_models(ModelConfig(str(target_dir)), None, kind="ngram")
    guard = GuardConfig()  # bench's default loop guard
    # as calibrate collects: strict, proposing after the drafts as a relaxed rule's engine
    # does (calibrating), without the job corpus the relaxed rules never get
    engine = build_engine(target, None, VerifyConfig(guard=guard), DraftConfig(kind="ngram"), 1,
                         job_corpus=False, calibrating=True)
    per = {}

    def observer_for(item):
        per[item.index] = MarginCollector()
        return per[item.index]

    collect_margins(engine, [r for r, _ in records], SamplingParams(max_tokens=MAX_TOKENS), observer_for,
                    lambda *a: pytest.fail(f"record skipped: {a}"), lambda _: None)
    merged = MarginCollector()
    for i in sorted(per):
        merged.extend(per[i])
    return merged.data(records=len(records), guard=guard)


def independent_fit(path, start, target_dir):
    """independent_collection and match_relax_rate on it (guarded, and unguarded for
    mars-noguard)."""
    from marscli.calibration.policies import RELAXED, match_relax_rate

    data = independent_collection(path, start, target_dir)
    templates = [Rule("mars", 0.9), Rule("ratio"), Rule("topk", top_n=3), Rule("typical"),
                 Rule("typical", epsilon=0.5, alpha=0.2), Rule("regret")]
    fitted = match_relax_rate(data, templates, SHARE, by=RELAXED)
    noguard = match_relax_rate(replace(data, guard=GUARD_OFF), [Rule("mars", 0.9)], SHARE, by=RELAXED)[0]
    return data, fitted, noguard


def test_match_fits_every_relaxed_method_on_the_records_after_the_measured_ones(runner, prompts, tiny_model_dir,
                                                                                tmp_path):
    out = tmp_path / "r.json"
    r = runner.invoke(app, args(prompts, tiny_model_dir, "--limit", "2", "--methods", METHODS,
                                "--match-relax-rate", str(SHARE), "--report", str(out)))
    assert r.exit_code == EXIT_OK, r.stderr
    rep = json.loads(out.read_text())
    data, fitted, noguard = independent_fit(prompts, 2, tiny_model_dir)
    assert data.positions > 0 and any(f.relaxes for f in fitted)
    # calibrating: the strict collection judged the proposal after the drafts too
    assert data.step_bonus.any() and data.positions == int((data.step_k + data.step_bonus).sum())
    mars, ratio, topk, typical, typical_fixed, regret = fitted
    labels = [mars.label(), f"mars-noguard@{noguard.theta:g}", ratio.label(), topk.label(),
              typical.label(), typical_fixed.label(), regret.label()]
    assert rep["settings"]["methods"] == ["ar", "strict", *labels]
    m = rep["match_relax_rate"]
    assert m["share"] == SHARE
    # The split: the 4 records after the 2 measured ones, no overlap, nothing skipped.
    assert m["calibration"] == {"file": str(prompts), "records": 4, "positions": data.positions,
                                "tokens": data.tokens, "dropped_overlap": 0, "skipped": 0}
    assert {x["id"] for x in rep["runs"]} == {"p0", "p1"}
    assert list(m["methods"]) == labels
    for label, rule in zip(labels, (mars, noguard, ratio, topk, typical, typical_fixed, regret)):
        got = m["methods"][label]
        assert got["rule"] == rule.name
        for k, v in rule.knobs().items():
            assert got["knobs"][k] == (pytest.approx(v, rel=1e-5) if isinstance(v, float) else v), (label, k)
        on = replace(data, guard=GUARD_OFF) if label.startswith("mars-noguard") else data
        rep_on = on.replay(rule)
        assert got["relax_rate_calibration"] == pytest.approx(rep_on.relax_rate, rel=1e-5)
        relaxed = rep_on.relaxed / on.positions  # what is matched: relaxed drafts the replay accepts
        assert got["relaxed_per_position_calibration"] == pytest.approx(relaxed, rel=1e-5)
        assert got["within_share"] == (relaxed <= SHARE)
        assert relaxed <= rep_on.relax_rate + 1e-12  # a relaxation reached is one judged on its own
        if rule.name != "typical":  # typical at epsilon 1 may still relax more than the share
            assert relaxed <= SHARE and rule.relaxes, label
        assert 0 <= got["relaxed_per_position_measured"] <= 1
        a = rep["methods"][label]
        assert got["relaxed_per_position_measured"] == pytest.approx(a["relaxed"] / a["drafted"], rel=1e-5)
        assert a["knobs"]["margin" if rule.name == "mars" else rule.knob[0]] is not None
    assert m["methods"][labels[0]]["template"] == "mars" and m["methods"][labels[3]]["template"] == "topk@3"
    assert m["methods"][labels[3]]["knobs"]["top_n"] == 3  # the template's N is kept
    assert m["methods"][labels[5]]["knobs"]["alpha"] == pytest.approx(0.2)  # an explicit A stays fixed
    assert m["methods"][labels[4]]["knobs"]["alpha"] == pytest.approx(typical.epsilon ** 0.5, rel=1e-5)  # tied
    assert "relaxed / drafted" in m["definition"]
    # Greedy strict still equals ar: matching changed nothing but the relaxed methods.
    assert rep["correctness"]["failures"] == 0


def test_fit_script_matches_every_rule_to_the_reference_methods_share(prompts, tiny_model_dir, tmp_path):
    """scripts/fit_matched_knobs.py: the share is what the reference (kept as it is) relaxes
    on an independent collection of the split, each rule's knob is match_relax_rate's at that
    share, and the methods line it prints is one bench parses back to those rules."""
    import importlib.util
    from pathlib import Path

    from marscli.calibration.policies import (
        RELAXED,
        match_relax_rate,
        relaxed_per_position,
    )

    script = Path(__file__).resolve().parents[2] / "scripts" / "fit_matched_knobs.py"
    spec = importlib.util.spec_from_file_location("fit_matched_knobs", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "knobs.json"
    assert mod.main(["--calibrate-on", str(prompts), "--reference", "mars@0.9",
                     "--rules", "ratio,topk@3,typical,regret",
                     "--target", str(tiny_model_dir), "--max-tokens", str(MAX_TOKENS), "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    data = independent_collection(prompts, 0, tiny_model_dir)
    reference = Rule("mars", 0.9)
    share = relaxed_per_position(data, data.replay(reference))
    assert data.positions > 0 and share > 0
    assert doc["share"] == pytest.approx(share, rel=1e-9)
    assert doc["calibration"]["records"] == len(TEXTS) and doc["calibration"]["positions"] == data.positions
    templates = [Rule("ratio"), Rule("topk", top_n=3), Rule("typical"), Rule("regret")]
    fitted = match_relax_rate(data, templates, share, by=RELAXED)
    assert list(doc["rules"]) == [r.label() for r in fitted]
    for rule, got in zip(fitted, doc["rules"].values()):
        for k, v in rule.knobs().items():
            assert got["knobs"][k] == (pytest.approx(v, rel=1e-9) if isinstance(v, float) else v), (rule.name, k)
        assert got["relaxed_per_position_calibration"] == pytest.approx(relaxed_per_position(data, data.replay(rule)))
        if rule.name != "typical":  # typical at epsilon 1 may still relax more than the share
            assert got["within_share"] and got["relaxed_per_position_calibration"] <= share + 1e-12
    specs = parse_methods(doc["methods"], ())
    assert [m.name for m in specs] == ["mars@0.9", *doc["rules"]]
    for m, rule in zip(specs[1:], fitted):  # the labels round the knobs to 6 digits
        assert m.rule.name == rule.name
        for k, v in rule.knobs().items():
            if isinstance(v, float):
                assert getattr(m.rule, k) == pytest.approx(v, rel=1e-5), (rule.name, k)


def test_calibrate_on_drops_prompts_equal_to_measured_ones(runner, prompts, tiny_model_dir, tmp_path):
    calib = tmp_path / "calib.jsonl"
    calib.write_text(json.dumps({"id": "x", "prompt": TEXTS[0]}) + "\n"  # a measured prompt, another id
                     + json.dumps({"id": "p0", "prompt": TEXTS[4]}) + "\n")  # a measured id, another prompt
    out = tmp_path / "r.json"
    r = runner.invoke(app, args(prompts, tiny_model_dir, "--limit", "2", "--methods", "strict,ratio",
                                "--match-relax-rate", "0.1", "--calibrate-on", str(calib), "--report", str(out)))
    assert r.exit_code == EXIT_OK, r.stderr
    cal = json.loads(out.read_text())["match_relax_rate"]["calibration"]
    assert cal["file"] == str(calib) and cal["records"] == 1 and cal["dropped_overlap"] == 1
    # Every calibration prompt overlapping: a usage error, nothing timed.
    calib.write_text(json.dumps({"id": "x", "prompt": TEXTS[1]}) + "\n")
    r = runner.invoke(app, args(prompts, tiny_model_dir, "--limit", "2", "--methods", "strict,ratio",
                                "--match-relax-rate", "0.1", "--calibrate-on", str(calib)))
    assert r.exit_code == EXIT_USAGE and "pass --calibrate-on FILE" in r.stderr


def cfg_for(path, limit=None, calibrate_on=None, n=20):
    return BenchConfig(input=str(path), methods=(), target=ModelConfig("t"), draft=None, limit=limit,
                       match_relax_rate=0.1, calibrate_on=calibrate_on, calibration_records=n)


def test_the_calibration_split_is_disjoint_from_the_measured_records(prompts, tmp_path):
    measured, _, _ = read_prompt_records(str(prompts), 2)
    ids = [r.id for r, _ in measured]
    assert ids == ["p0", "p1"]
    split = [r.id for r, _ in read_calibration(cfg_for(prompts, limit=2))]
    assert split == ["p2", "p3", "p4", "p5"]
    assert [r.id for r, _ in read_calibration(cfg_for(prompts, limit=2, n=2))] == ["p2", "p3"]
    # The input again as --calibrate-on (another spelling of its path): still after --limit.
    alias = str(tmp_path / "." / "prompts.jsonl")
    assert [r.id for r, _ in read_calibration(cfg_for(prompts, limit=3, calibrate_on=alias))] == ["p3", "p4", "p5"]
    with pytest.raises(UsageError, match="every record of .* is measured; pass --calibrate-on"):
        read_calibration(cfg_for(prompts, calibrate_on=str(prompts)))
    with pytest.raises(UsageError, match="no usable calibration records after the first 6 .* pass --calibrate-on"):
        read_calibration(cfg_for(prompts, limit=6))
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"id": "o1", "prompt": "x"}) + "\n")
    assert [r.id for r, _ in read_calibration(cfg_for(prompts, calibrate_on=str(other)))] == ["o1"]


def test_spellings_without_knobs_only_with_match():
    specs = parse_methods("ar,mars,mars-noguard@0.8,ratio,topk@3,typical,typical@0.5:0.2,regret", (0.85, 0.9),
                          match=True)
    assert [s.name for s in specs] == ["ar", "mars", "mars-noguard@0.8", "ratio", "topk@3", "typical",
                                       "typical@0.5:0.2", "regret"]
    assert specs[1].theta == 0.9 and specs[2].theta == 0.8  # one mars method, whatever --theta says
    assert specs[4].rule == Rule("topk", top_n=3)
    assert specs[6].rule.alpha == 0.2 and specs[5].rule == Rule("typical")
    for bad in ("ratio", "topk@3", "regret", "typical"):
        with pytest.raises(UsageError, match="leave the knobs out with --match-relax-rate"):
            parse_methods(bad, (0.9,))
    assert [s.name for s in parse_methods("mars", (0.85, 0.9))] == ["mars@0.85", "mars@0.9"]


@pytest.mark.parametrize("extra,fragment", [
    (["--match-relax-rate", "0"], "--match-relax-rate must be in (0, 1), got 0"),
    (["--match-relax-rate", "1"], "--match-relax-rate must be in (0, 1), got 1"),
    (["--match-relax-rate", "1.5"], "--match-relax-rate must be in (0, 1)"),
    (["--match-relax-rate", "0.1"], "is measured; pass --calibrate-on FILE"),
    (["--match-relax-rate", "0.1", "--limit", "6"], "no usable calibration records after the first 6"),
    (["--match-relax-rate", "0.1", "--theta", "0.9"], "--theta sets MARS's threshold"),
    (["--match-relax-rate", "0.1", "--calibration-records", "0"], "--calibration-records must be at least 1"),
    (["--calibrate-on", "x.jsonl"], "--calibrate-on gives the prompts"),
    (["--calibration-records", "3"], "--calibration-records gives the prompts"),
    (["--match-relax-rate", "0.1", "--methods", "ar,strict"], "none is in --methods"),
    (["--match-relax-rate", "0.1", "--methods", "strict,mars-tree"], "drop mars-tree@0.9"),
    (["--methods", "strict,ratio"], "leave the knobs out with --match-relax-rate"),
])
def test_usage_errors(runner, prompts, tiny_model_dir, extra, fragment):
    methods = [] if "--methods" in extra else ["--methods", "strict,mars,ratio@0.5"]
    r = runner.invoke(app, args(prompts, tiny_model_dir, *methods, *extra))
    assert r.exit_code == EXIT_USAGE, r.stderr
    assert fragment in r.stderr and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1
