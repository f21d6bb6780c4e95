"""marscli inside lm-evaluation-harness (marscli.lmeval, `marscli lm-eval`).

generate_until must give what marscli's own API gives for the same context, stop strings and
length (at any batch size); loglikelihoods must be the target's, computed apart by
transformers; and a local task (a JSONL file and a YAML written here: no hub) must run through
lm-eval's own evaluator and command line with `--model marscli`.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the tasks below read local files only
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402

import marscli  # noqa: E402
from marscli.cli import app  # noqa: E402
from marscli.errors import UsageError  # noqa: E402
from marscli.lmeval import MarscliLM, parse_model_args  # noqa: E402

CONTEXTS = ["def add(a, b):\n    return", "The quick brown fox", "Numbers: 1, 2, 3,", "x"]


def _gen(context: str, i: int = 0, **gen_kwargs) -> Instance:
    return Instance("generate_until", {}, (context, gen_kwargs), idx=0, metadata=("t", i, 1))


def _ll(context: str, continuation: str) -> Instance:
    return Instance("loglikelihood", {}, (context, continuation), idx=0, metadata=("t", 0, 1))


@pytest.fixture(scope="module")
def lm(tiny_model_dir, tiny_draft_dir):
    return MarscliLM.create_from_arg_string(f"target={tiny_model_dir},draft={tiny_draft_dir},batch_size=3",
                                            {"batch_size": 1, "device": "cpu"})


@pytest.fixture(scope="module")
def api(tiny_model_dir, tiny_draft_dir):
    return marscli.load(str(tiny_model_dir), str(tiny_draft_dir), device="cpu")  # batch size 1


def test_model_args_are_generates_options(tiny_model_dir, lm):
    args = parse_model_args(f"pretrained={tiny_model_dir},draft=none,verify=mars,theta=0.9,batch_size=8,"
                            "adaptive=false,max_gen_toks=32")
    assert args["draft"] == "none"  # not None: no drafter, as on marscli's command line
    assert args["theta"] == 0.9 and args["batch_size"] == 8 and args["adaptive"] is False
    assert args["max_gen_toks"] == 32
    # model_args' batch size wins over lm-eval's --batch_size (whose default is 1)
    assert lm.llm.setup.batch_size == 3
    with pytest.raises(UsageError, match="unknown frobnicate"):
        MarscliLM.create_from_arg_string(f"target={tiny_model_dir},frobnicate=1")
    with pytest.raises(UsageError, match="batch_size auto"):
        MarscliLM.create_from_arg_string(f"target={tiny_model_dir}", {"batch_size": "auto"})
    with pytest.raises(UsageError, match="theta=high: expected a number"):
        parse_model_args("theta=high")


def test_generate_until_is_the_apis_output(lm, api):
    # Free runs first, so that a stop string can be chosen that really occurs.
    free = api.generate([{"prompt": c, "max_tokens": 24} for c in CONTEXTS])
    stops = [[r["output"][3:6]] if len(r["output"]) > 8 else ["\n\n"] for r in free]
    reqs = [_gen(c, i, until=s, max_gen_toks=24, do_sample=False) for i, (c, s) in enumerate(zip(CONTEXTS, stops))]
    reqs.append(_gen(CONTEXTS[0], 9, until=[], max_new_tokens=7))  # lm-eval's length alias
    got = lm.generate_until(reqs)
    want = [r["output"] for r in api.generate([{"prompt": c, "max_tokens": 24, "stop": s}
                                               for c, s in zip(CONTEXTS, stops)])]
    want.append(api.generate([{"prompt": CONTEXTS[0], "max_tokens": 7}])[0]["output"])
    assert got == want
    assert any(len(g) < len(f["output"]) for g, f in zip(got, free))  # a stop string cut a response
    for g, s in zip(got, stops):
        assert s[0] not in g
    # Acceptance statistics are kept per request, in order.
    assert len(lm.stats) == len(reqs) and lm.stats[0]["doc_id"] == 0 and lm.stats[-1]["doc_id"] == 9
    assert all(s["spec"]["drafted"] >= s["spec"]["accepted"] >= 0 for s in lm.stats)
    assert sum(s["spec"]["drafted"] for s in lm.stats) > 0


def test_sampled_repeats_get_their_own_seeds(lm, api):
    req = _gen(CONTEXTS[1], 0, until=[], max_gen_toks=16, do_sample=True, temperature=1.0, top_p=0.9)
    got = lm.generate_until([req, req, req])  # lm-eval lists a request `repeats` times
    want = [api.generate([{"prompt": CONTEXTS[1], "max_tokens": 16, "temperature": 1.0, "top_p": 0.9,
                           "seed": s}])[0]["output"] for s in range(3)]
    assert got == want
    assert len(set(got)) > 1
    assert lm.generate_until([req]) == want[:1]  # a function of the request, not of its neighbours


def test_unsupported_generation_keys_are_refused(lm):
    with pytest.raises(UsageError, match="repetition_penalty"):
        lm.generate_until([_gen("x", until=[], repetition_penalty=1.2)])


def _oracle_logprob(oracle, ids: list[int], n: int) -> tuple[float, bool]:
    with torch.inference_mode():
        logp = torch.log_softmax(oracle(torch.tensor([ids[:-1]])).logits[0].double(), dim=-1)
    rows = logp[-n:]
    want = torch.tensor(ids[-n:])
    return float(rows.gather(1, want[:, None]).sum()), bool((rows.argmax(-1) == want).all())


def test_loglikelihood_is_the_targets(lm, oracle):
    tok = lm.tokenizer
    pairs = [("The quick brown", " fox jumps"), ("Numbers: 1, 2, ", "3, 4"), ("", "hello there")]
    got = lm.loglikelihood([_ll(c, x) for c, x in pairs])
    for (context, cont), (lp, greedy) in zip(pairs, got):
        if context:
            # lm-eval's convention: a context's trailing spaces belong to the continuation
            stripped = context.rstrip()
            whole = tok.encode(stripped + context[len(stripped):] + cont)
            n = len(whole) - len(tok.encode(stripped))
        else:
            body = tok.encode(cont, add_special_tokens=False)
            whole, n = [tok.eos_token_id, *body], len(body)
        want_lp, want_greedy = _oracle_logprob(oracle, whole, n)
        assert lp == pytest.approx(want_lp, abs=1e-4) and lp < 0
        assert greedy == want_greedy
    # A continuation that greedy decoding produces is greedy.
    ids = tok.encode("The quick")
    with torch.inference_mode():
        nxt = int(oracle(torch.tensor([ids])).logits[0, -1].argmax())
    cont = tok.decode([nxt])
    if tok.encode("The quick" + cont)[len(ids):] == [nxt]:
        assert lm.loglikelihood([_ll("The quick", cont)])[0][1] is True


def test_rolling_loglikelihood_covers_every_token_once(lm, oracle):
    text = "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n" * 3
    ids = lm.tokenizer.encode(text)
    full = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0, ("t", 0, 1))])[0]
    want, _ = _oracle_logprob(oracle, [lm.tokenizer.eos_token_id, *ids], len(ids))
    assert full == pytest.approx(want, abs=1e-3)
    # With a window shorter than the text, every token is still scored exactly once (windows).
    short = lm.max_length
    try:
        lm.max_length = 16
        windowed = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0, ("t", 0, 1))])[0]
    finally:
        lm.max_length = short
    assert len(ids) > 16 and windowed < 0 and windowed != pytest.approx(full, abs=1e-3)


def _task_files(tmp_path: Path) -> Path:
    docs = [{"question": q, "answer": "x", "choices": [" yes", " no"], "gold": 0}
            for q in ("Is water wet?", "Is fire cold?", "Two plus two?")]
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    common = (f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
              "test_split: test\ndoc_to_text: \"Q: {{question}}\\nA:\"\n")
    (tasks / "gen.yaml").write_text(
        "task: marscli_gen\n" + common + "doc_to_target: \"{{answer}}\"\noutput_type: generate_until\n"
        "generation_kwargs:\n  until: [\"\\n\\n\"]\n  max_gen_toks: 12\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n")
    (tasks / "mc.yaml").write_text(
        "task: marscli_mc\n" + common + "output_type: multiple_choice\ndoc_to_choice: \"{{choices}}\"\n"
        "doc_to_target: gold\nmetric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
    return tasks


def test_a_local_task_runs_through_lm_evals_evaluator(tmp_path, tiny_model_dir, lm, api):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    tasks = _task_files(tmp_path)
    out = simple_evaluate(model=lm, tasks=["marscli_gen", "marscli_mc"], log_samples=True,
                          task_manager=TaskManager(include_path=str(tasks)))
    assert set(out["results"]) == {"marscli_gen", "marscli_mc"}
    assert 0.0 <= out["results"]["marscli_mc"]["acc,none"] <= 1.0
    samples = out["samples"]["marscli_gen"]
    want = {r["id"]: r["output"] for r in api.generate(
        [{"id": str(s["doc_id"]), "prompt": f"Q: {s['doc']['question']}\nA:", "max_tokens": 12, "stop": ["\n\n"]}
         for s in samples])}
    assert len(samples) == 3
    assert all(s["resps"][0][0] == want[str(s["doc_id"])] for s in samples)


def test_marscli_lm_eval_is_lm_evals_command_line(runner, tmp_path, tiny_model_dir, tiny_draft_dir):
    tasks = _task_files(tmp_path)
    stats = tmp_path / "stats.jsonl"
    res = runner.invoke(app, ["lm-eval", "--model", "marscli", "--model_args",
                              f"target={tiny_model_dir},draft={tiny_draft_dir},stats_file={stats},batch_size=2",
                              "--tasks", "marscli_gen", "--include_path", str(tasks),
                              "--output_path", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    reports = list((tmp_path / "out").rglob("results_*.json"))
    assert reports and "marscli_gen" in json.loads(reports[0].read_text())["results"]
    lines = [json.loads(line) for line in stats.read_text().splitlines()]
    assert [line["doc_id"] for line in sorted(lines, key=lambda x: x["doc_id"])] == [0, 1, 2]
    assert all("acceptance_length" in line["spec"] for line in lines)
    bad = runner.invoke(app, ["lm-eval", "--model", "marscli", "--model_args", f"target={tiny_model_dir},nope=1",
                              "--tasks", "marscli_gen", "--include_path", str(tasks)])
    assert bad.exit_code == 2 and "unknown nope" in bad.output


def test_the_shipped_example_task_runs_offline(runner, monkeypatch, tmp_path, tiny_model_dir):
    # examples/lm-eval/gsm8k_examples.yaml: lm-eval's GSM8K filters over examples/gsm8k.jsonl,
    # run from the repository root as its comment says (through the chat template).
    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    res = runner.invoke(app, ["lm-eval", "--model", "marscli", "--model_args", f"target={tiny_model_dir},draft=ngram",
                              "--tasks", "gsm8k_examples", "--include_path", "examples/lm-eval", "--limit", "2",
                              "--gen_kwargs", "max_gen_toks=8", "--apply_chat_template", "--log_samples",
                              "--output_path", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    (report,) = (tmp_path / "out").rglob("results_*.json")
    results = json.loads(report.read_text())["results"]["gsm8k_examples"]
    assert {"exact_match,strict-match", "exact_match,flexible-extract"} <= set(results)
    (samples,) = (tmp_path / "out").rglob("samples_gsm8k_examples_*.jsonl")
    lines = [json.loads(line) for line in samples.read_text().splitlines()]
    # one line per record and filter
    assert sorted((x["doc_id"], x["filter"]) for x in lines) == [
        (0, "flexible-extract"), (0, "strict-match"), (1, "flexible-extract"), (1, "strict-match")]
    assert all(x["target"].startswith("#### ") for x in lines)
