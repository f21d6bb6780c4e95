"""marscli bench on a tiny random model: every method and field in the report, exactness of
strict/ar against transformers' generate() checked inside bench, loud correctness failures."""

from __future__ import annotations

import json

import pytest

from marscli.bench import methods as bench_mod
from marscli.bench.methods import (
    MethodSpec,
    parse_float_list,
    parse_int_list,
    parse_methods,
)
from marscli.cli import app
from marscli.config import DEFAULT_PREFIX_CACHE_MIB
from marscli.errors import EXIT_OK, EXIT_RUNTIME, EXIT_USAGE, UsageError
from marscli.jobs import bench as bench_job

PROMPTS = [
    {"question_id": 1, "category": "demo",
     "turns": ["hello world, hello marscli; the cat sat on the mat. hello world, hello"],
     "reference": ["the cat sat on the mat", "hello world"]},
    {"question_id": 2, "category": "demo", "turns": ["one two three four five six seven eight nine ten one two"]},
]
METHOD_FIELDS = {
    "kind", "theta", "runs", "completion_tokens", "seconds", "tokens_per_s", "median_tokens_per_s",
    "speedup_vs_hf_generate", "speedup_vs_ar", "target_forwards", "tokens_per_target_forward",
    "steps", "drafted", "accepted", "relaxed", "acceptance_length", "acceptance_rate",
    "per_position_acceptance_rate", "accepted_per_step_hist", "steps_by_draft_length", "relaxed_share",
    "ideal_speedup_vs_ar", "measured_over_ideal", "exact_match_rate", "exact_matches", "prefix_share",
    "nll_per_token", "rouge_l", "rouge_l_prompts", "peak_rss_mib", "cuda_peak_mib",
    "speedup_vs_strict", "seconds_per_record", "mean_completion_tokens",
    "task_speedup_vs_hf_generate", "task_speedup_vs_ar", "task_speedup_vs_strict",
    "length_ratio_vs_hf_generate", "length_ratio_vs_ar", "length_ratio_vs_strict",
}
SPEC_FIELDS = ("steps", "acceptance_length", "acceptance_rate", "per_position_acceptance_rate",
               "relaxed_share", "ideal_speedup_vs_ar", "measured_over_ideal")
MAX_TOKENS = "12"


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return path


def bench_args(prompts_file, target, *extra):
    return ["bench", str(prompts_file), "--target", str(target), "--max-tokens", MAX_TOKENS, *extra]


# ------------------------------------------------------------------------------ parsing


def test_parse_methods_expands_mars_per_theta():
    specs = parse_methods("hf-generate, ar,mars,strict,mars", (0.85, 0.9))
    assert [s.name for s in specs] == ["hf-generate", "ar", "mars@0.85", "mars@0.9", "strict"]
    assert specs[2] == MethodSpec("mars@0.85", "mars", 0.85)
    with pytest.raises(UsageError, match="unknown method 'medusa'"):
        parse_methods("ar,medusa", (0.9,))
    with pytest.raises(UsageError, match="empty"):
        parse_methods(" , ", (0.9,))
    assert parse_float_list("0.85,0.9,0.9", "--theta") == (0.85, 0.9)
    assert parse_int_list("0,1,2", "--seeds") == (0, 1, 2)
    for bad in ("x", "", "nan"):
        with pytest.raises(UsageError, match="--theta"):
            parse_float_list(bad, "--theta")
    with pytest.raises(UsageError, match="--seeds"):
        parse_int_list("-1", "--seeds")


def test_read_prompt_records_keeps_references_and_skips_bad_lines(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join([
        "{broken",
        json.dumps(PROMPTS[0]),
        json.dumps({"id": "mt", "turns": ["first", "second"], "reference": ["ref one", "ref two"]}),
        json.dumps({"id": "o", "prompt": "plain", "max_tokens": 3}),
        json.dumps({"id": "beyond the limit", "prompt": "x"}),
    ]) + "\n")
    records, skipped, overridden = bench_mod.read_prompt_records(str(path), limit=4)
    assert [(r.id, ref) for r, ref in records] == [
        ("1", "the cat sat on the mat\nhello world"), ("mt", "ref one"), ("o", None)]
    assert skipped == [{"id": "0", "line": 1, "reason": skipped[0]["reason"]}]
    assert skipped[0]["reason"].startswith("invalid_json")
    assert overridden == 1


# ------------------------------------------------------------------------------ full runs


def test_bench_reports_every_method_and_field(runner, prompts_file, tiny_model_dir, tmp_path):
    report_path, plot_path = tmp_path / "bench.json", tmp_path / "bench.png"
    r = runner.invoke(app, bench_args(prompts_file, tiny_model_dir, "--theta", "0.5,0.9",
                                      "--report", str(report_path), "--plot", str(plot_path)))
    assert r.exit_code == EXIT_OK, r.stderr
    assert r.stdout == ""
    rep = json.loads(report_path.read_text())
    names = ["hf-generate", "hf-assisted", "ar", "strict", "mars@0.5", "mars@0.9"]
    assert list(rep["methods"]) == names
    for name, a in rep["methods"].items():
        assert set(a) >= METHOD_FIELDS, (name, METHOD_FIELDS - set(a))
        assert a["runs"] == 2 and a["completion_tokens"] > 0 and a["tokens_per_s"] > 0
        assert a["nll_per_token"] > 0 and 0 <= a["prefix_share"] <= 1
        assert a["rouge_l_prompts"] == 1 and 0 <= a["rouge_l"] <= 1  # one prompt has a reference
        assert a["peak_rss_mib"] > 0
        spec = a["kind"] in ("strict", "mars")
        for f in SPEC_FIELDS:
            assert (a[f] is not None) == spec, (name, f)
    m = rep["methods"]
    assert m["hf-generate"]["speedup_vs_hf_generate"] == 1 and m["ar"]["speedup_vs_ar"] == 1
    # Time per task: seconds per record of the same runs; paired ratios, which with one seed
    # satisfy speed-up in tokens/s = task speed-up x length ratio whatever the timings.
    for name, a in m.items():
        own = [x for x in rep["runs"] if x["method"] == name]
        assert a["seconds_per_record"] == pytest.approx(sum(x["seconds"] for x in own) / 2, rel=1e-3)
        assert a["mean_completion_tokens"] == sum(x["completion_tokens"] for x in own) / 2
        for ref in ("hf_generate", "ar", "strict"):
            assert a[f"speedup_vs_{ref}"] == pytest.approx(
                a[f"task_speedup_vs_{ref}"] * a[f"length_ratio_vs_{ref}"], rel=1e-4), (name, ref)
    assert m["ar"]["task_speedup_vs_ar"] == 1 and m["strict"]["task_speedup_vs_strict"] == 1
    assert m["strict"]["length_ratio_vs_ar"] == 1 and m["ar"]["length_ratio_vs_hf_generate"] == 1  # exact outputs
    assert m["hf-generate"]["target_forwards"] == m["hf-generate"]["completion_tokens"]
    # Exactness inside bench: greedy strict and ar equal transformers' generate() token for token.
    for name in ("ar", "strict", "hf-assisted"):
        assert m[name]["exact_match_rate"] == 1 and m[name]["prefix_share"] == 1
        assert m[name]["nll_per_token"] == pytest.approx(m["hf-generate"]["nll_per_token"])
    assert rep["correctness"] == {"checked": True, "reference": "hf-generate", "methods": ["ar", "strict"],
                                  "failures": 0}
    assert rep["correctness_failures"] == []
    assert m["strict"]["relaxed"] == 0
    assert len(m["strict"]["per_position_acceptance_rate"]) == 8
    assert sum(m["strict"]["accepted_per_step_hist"]) == m["strict"]["steps"]
    assert sum(m["strict"]["steps_by_draft_length"]) == m["strict"]["steps"]
    limit = rep["physical_limit"]
    assert set(limit["target_forward_s"]) == {str(n) for n in range(1, 10)}
    assert limit["t_1_s"] > 0 and limit["t_k_plus_1_s"] > 0 and limit["draft_forward_s"] is None
    assert set(limit["methods"]) == {"strict", "mars@0.5", "mars@0.9"}
    assert rep["settings"]["hf_assisted"]["prompt_lookup_num_tokens"] == 8
    assert rep["environment"]["cpu_fastpath"] is True
    assert any("same target model object" in n for n in rep["notes"])
    assert len(rep["runs"]) == 2 * len(names)
    assert {(x["method"], x["id"]) for x in rep["runs"]} == {(n, i) for n in names for i in ("1", "2")}
    # The tables on stderr.
    for header in ("method", "tok/s", "s/record", "x hf-gen", "task x ar", "tau", "exact", "NLL/tok", "ROUGE-L",
                   "meas/ideal"):
        assert header in r.stderr
    assert "task x hf-gen" not in r.stderr  # one task speed-up column: vs ar when there is ar
    # one time-per-task line per method but ar, the reference
    for name in names:
        assert (f"\n{name}: " in r.stderr) == (name != "ar"), name
    assert " per task vs ar (answers 1.00x as long)" in r.stderr  # strict, ar's output exactly
    assert "acceptance rate by draft position" in r.stderr
    assert "exactness of ar, strict against hf-generate (greedy, token for token): OK" in r.stderr
    assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_draft_model_and_report_on_stdout(runner, prompts_file, tiny_model_dir, tiny_draft_dir):
    r = runner.invoke(app, bench_args(prompts_file, tiny_model_dir, "--draft", str(tiny_draft_dir), "-k", "3",
                                      "--methods", "hf-generate,hf-assisted,strict,mars", "--report", "-", "-q"))
    assert r.exit_code == EXIT_OK, r.stderr
    assert r.stderr == ""
    rep = json.loads(r.stdout)  # stdout is the report and nothing else
    assert rep["settings"]["hf_assisted"]["candidates"] == "assistant_model"
    assert rep["settings"]["hf_assisted"]["num_assistant_tokens"] == 3
    assert rep["settings"]["hf_assisted"]["assistant_confidence_threshold"] is not None
    assert rep["draft"]["name"] and rep["physical_limit"]["draft_forward_s"] > 0
    assert set(rep["physical_limit"]["target_forward_s"]) == {"1", "2", "3", "4"}
    m = rep["methods"]
    assert m["strict"]["exact_match_rate"] == 1 and m["hf-assisted"]["exact_match_rate"] == 1
    assert m["strict"]["speedup_vs_ar"] is None  # no ar in --methods
    assert rep["correctness"]["methods"] == ["strict"] and rep["correctness"]["failures"] == 0


def test_sampling_reports_mean_and_spread_over_seeds(runner, prompts_file, tiny_model_dir, tmp_path):
    out = tmp_path / "r.json"
    r = runner.invoke(app, bench_args(prompts_file, tiny_model_dir, "--temperature", "1.0", "--seeds", "0,1",
                                      "--methods", "hf-generate,ar,strict,mars", "--report", str(out)))
    assert r.exit_code == EXIT_OK, r.stderr
    rep = json.loads(out.read_text())
    assert rep["settings"]["seeds"] == [0, 1]
    assert rep["correctness"]["checked"] is False and rep["correctness_failures"] == []
    for a in rep["methods"].values():
        assert a["runs"] == 4
        assert [s["seed"] for s in a["seeds"]] == [0, 1]
        assert a["tokens_per_s"] == pytest.approx((a["seeds"][0]["tokens_per_s"] + a["seeds"][1]["tokens_per_s"]) / 2,
                                                  rel=1e-4)
        assert a["spread"]["tokens_per_s"] is not None and a["spread"]["nll_per_token"] is not None
        assert a["spread"]["seconds_per_record"] is not None and a["spread"]["task_speedup_vs_ar"] is not None
        assert a["seconds_per_record"] == pytest.approx(
            (a["seeds"][0]["seconds_per_record"] + a["seeds"][1]["seconds_per_record"]) / 2, rel=1e-4)
    assert "±" in r.stderr
    assert any("different random streams" in n for n in rep["notes"])


def test_a_strict_mismatch_is_a_loud_correctness_failure(runner, prompts_file, tiny_model_dir, tmp_path, monkeypatch):
    original = bench_job.Bench.__init__

    def init_with_broken_strict(self, *args, **kwargs):
        original(self, *args, **kwargs)
        good = self.runners["strict"]

        def broken(ids, sampling):
            tokens, stats = good(ids, sampling)
            return tokens[:3] + [(tokens[3] + 1) % 100] + tokens[4:], stats

        self.runners["strict"] = broken

    monkeypatch.setattr(bench_job.Bench, "__init__", init_with_broken_strict)
    out = tmp_path / "r.json"
    r = runner.invoke(app, bench_args(prompts_file, tiny_model_dir, "--methods", "hf-generate,ar,strict",
                                      "--report", str(out), "-q"))
    assert r.exit_code == EXIT_RUNTIME
    assert "CORRECTNESS FAILURE: strict output differs from hf-generate on id 1 (seed 0) at token 3" in r.stderr
    assert "CORRECTNESS FAILURE: strict" in r.stderr and "on id 2" in r.stderr
    rep = json.loads(out.read_text())  # the report is written all the same
    fails = rep["correctness_failures"]
    assert [(f["method"], f["id"], f["first_mismatch"]) for f in fails] == [("strict", "1", 3), ("strict", "2", 3)]
    assert fails[0]["token"] != fails[0]["reference_token"]
    assert rep["correctness"]["failures"] == 2
    assert rep["methods"]["strict"]["exact_match_rate"] == 0 and rep["methods"]["ar"]["exact_match_rate"] == 1


@pytest.mark.parametrize("args,fragment", [
    (["--methods", "ar,medusa"], "unknown method 'medusa'"),
    (["--draft", "none"], "--draft none leaves nothing to draft for hf-assisted, strict, mars@0.9"),
    (["--seeds", "0,1"], "greedy decoding (--temperature 0) is deterministic"),
    (["--theta", "high"], "--theta takes comma-separated numbers"),
    (["--margin", "odds"], "--margin must be"),
    (["--report", "/nonexistent-dir/r.json"], "folder /nonexistent-dir does not exist"),
    (["--plot", "-"], "--plot needs a file name"),
    (["--batch-size", "4,0"], "--batch-size takes integers >= 1"),
    (["--batch-size", "four"], "--batch-size takes comma-separated integers"),
    (["--batch-size", "4", "--methods", "hf-assisted"], "--batch-size measures hf-generate, ar, strict, mars"),
    (["--throughput"], "--throughput measures batched throughput: give --batch-size too"),
    (["--throughput", "--batch-size", "4", "--task", "sum"], "--task needs the per-record runs"),
    (["--throughput", "--batch-size", "4", "--plot", "p.png"], "--plot needs the per-record runs"),
])
def test_usage_errors_exit_2(runner, prompts_file, tiny_model_dir, args, fragment):
    r = runner.invoke(app, bench_args(prompts_file, tiny_model_dir, *args))
    assert r.exit_code == EXIT_USAGE, r.stderr
    assert fragment in r.stderr and r.stdout == ""


MANY_TEXTS = ["hello world, hello marscli; the cat sat on the mat. hello world, hello",
              "one two three four five six seven eight nine ten one two", "a margin",
              "speculative decoding drafts tokens and the target verifies them in one pass. speculative",
              "the quick brown fox"]


def write_prompts(path, texts):
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": t}) + "\n" for i, t in enumerate(texts)))
    return path


def test_batched_throughput_rows_and_batch_invariance(runner, tiny_model_dir, tmp_path):
    """--batch-size: every batched method at every size over all prompts; marscli's strict
    greedy outputs do not depend on the batch size, and ar/strict equal hf-generate's batch-1
    ones."""
    prompts = write_prompts(tmp_path / "many.jsonl", MANY_TEXTS)
    out = tmp_path / "r.json"
    r = runner.invoke(app, bench_args(prompts, tiny_model_dir, "--methods", "hf-generate,ar,strict,mars",
                                      "--theta", "0.5", "--batch-size", "1,3", "--report", str(out)))
    assert r.exit_code == EXIT_OK, r.stderr
    rep = json.loads(out.read_text())
    tp = rep["throughput"]
    assert [(x["method"], x["batch_size"]) for x in tp] == [
        (m, b) for m in ("hf-generate", "ar", "strict", "mars@0.5") for b in (1, 3)]
    assert rep["settings"]["batch_sizes"] == [1, 3]
    for x in tp:
        assert x["prompts"] == 5 and x["completion_tokens"] > 0 and x["tokens_per_s"] > 0
        if x["kind"] in ("ar", "strict"):  # MARS's relaxations follow the batch's draft lengths
            assert x["outputs_equal_first_batch_size"] == 5, x
        if x["kind"] != "hf-generate":
            assert x["prefill_seconds"] >= 0 and x["peak_kv_cache_mib"] > 0
            assert x["prefill_passes"] >= 1 and x["prefill_tokens"] > 0 and x["prefill_padding"] >= 0
        else:  # transformers' generate() has no engine counters
            assert x["prefill_passes"] is x["prefix_tokens_reused"] is x["prefill_seconds"] is None
        assert x["records_per_s"] == pytest.approx(5 / x["seconds"], rel=1e-3)
        assert x["speedup_vs_hf_generate"] > 0  # hf-generate ran at every size
        assert (x["acceptance_length"] is not None) == (x["kind"] in ("strict", "mars"))
    sha = {(x["method"], x["batch_size"]): x["outputs_sha256"] for x in tp}
    assert sha[("ar", 3)] == sha[("strict", 3)] == sha[("hf-generate", 1)]
    # The per-prompt protocol ran too, and its exactness check agrees.
    assert rep["correctness"]["failures"] == 0
    assert "batched throughput" in r.stderr
    assert any("warms up on the first prompt" in n for n in rep["notes"])


def test_throughput_mode_runs_only_the_batched_rows(runner, tiny_model_dir, tmp_path):
    """--throughput: the batched rows alone, records/s against hf-generate's at the same size;
    no per-record runs, scores or forward timings in the report."""
    prompts = write_prompts(tmp_path / "many.jsonl", MANY_TEXTS)
    out = tmp_path / "r.json"
    r = runner.invoke(app, bench_args(prompts, tiny_model_dir, "--throughput", "--methods", "hf-generate,ar",
                                      "--batch-size", "1,4", "--report", str(out)))
    assert r.exit_code == EXIT_OK, r.stderr
    rep = json.loads(out.read_text())
    assert set(rep) == {"marscli_bench", "created", "input", "settings", "environment", "target", "draft",
                        "prompts", "throughput", "notes"}  # no "runs", "methods", "physical_limit", "task"
    assert rep["settings"]["throughput_only"] is True and rep["settings"]["batch_sizes"] == [1, 4]
    assert rep["settings"]["prefix_cache_mib"] == DEFAULT_PREFIX_CACHE_MIB
    tp = rep["throughput"]
    assert [(x["method"], x["batch_size"]) for x in tp] == [(m, b) for m in ("hf-generate", "ar") for b in (1, 4)]
    for x in tp:
        assert x["records_per_s"] > 0 and x["tokens_per_s"] > 0
        assert x["outputs_equal_first_batch_size"] == x["prompts"] == 5, x
        if x["kind"] == "ar":
            assert x["speedup_vs_hf_generate"] > 0
            assert x["prefix_tokens_reused"] >= 0 and x["prefill_passes"] >= 1
        else:
            assert x["speedup_vs_hf_generate"] == 1
    sha = {(x["method"], x["batch_size"]): x["outputs_sha256"] for x in tp}
    assert sha[("ar", 1)] == sha[("ar", 4)] == sha[("hf-generate", 1)]
    assert any("warms up on the first prompt" in n and "cold for prefixes" in n for n in rep["notes"])
    for header in ("batched throughput only", "records/s", "x hf-gen", "prefix reused"):
        assert header in r.stderr, header
    assert "exactness of" not in r.stderr and "target forward over" not in r.stderr
    assert "note: throughput:" in r.stderr  # how the rows were measured, the run's only table


def test_throughput_rows_reuse_a_shared_prefix_and_start_cold(runner, tiny_model_dir, tmp_path):
    """Prompts sharing a long prefix: the engine computes it once per row (prefix cache);
    --prefix-cache 0 turns that off; the warm-up leaves nothing cached or counted."""
    shared = ("you are a careful assistant. answer the question below in one short sentence, "
              "and say nothing else. the cat sat on the mat; the quick brown fox jumps. question: ")
    prompts = write_prompts(tmp_path / "shared.jsonl",
                            [shared + q for q in ("one two", "three four", "five six", "seven eight")])
    runs = {}
    for name, extra in (("cached", ["--batch-size", "1,4"]), ("off", ["--batch-size", "4", "--prefix-cache", "0"]),
                        ("one", ["--batch-size", "1", "--limit", "1"])):
        out = tmp_path / f"{name}.json"
        r = runner.invoke(app, bench_args(prompts, tiny_model_dir, "--throughput", "--methods", "ar",
                                          "--report", str(out), "-q", *extra))
        assert r.exit_code == EXIT_OK, r.stderr
        runs[name] = json.loads(out.read_text())
    rows = {x["batch_size"]: x for x in runs["cached"]["throughput"]}
    assert rows[4]["prefix_tokens_reused"] > 0 and rows[1]["prefix_tokens_reused"] > 0
    assert rows[4]["speedup_vs_hf_generate"] is None  # no hf-generate in --methods
    off = runs["off"]["throughput"][0]
    assert runs["off"]["settings"]["prefix_cache_mib"] == 0
    assert off["prefix_tokens_reused"] == 0 and off["outputs_sha256"] == rows[4]["outputs_sha256"]
    assert off["prefill_tokens"] > rows[4]["prefill_tokens"]  # the shared prefix computed once per prompt
    # One record: the warm-up ran it, yet the timed run finds nothing cached and counts one pass.
    one = runs["one"]["throughput"][0]
    assert one["prefix_tokens_reused"] == 0 and one["prefill_passes"] == 1
    # the whole prompt: its last token's logits give the first output token
    assert one["prefill_tokens"] == runs["one"]["prompts"]["prompt_tokens"]["max"]


def test_help_has_examples(runner):
    r = runner.invoke(app, ["bench", "--help"])
    assert r.exit_code == 0 and "marscli bench" in r.stdout and "--report" in r.stdout
