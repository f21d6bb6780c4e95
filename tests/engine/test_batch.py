"""Batched decoding against the single-record engine: same records, same tokens.

Every test runs the same records through the engine at batch size 1, one at a time, and at
several batch sizes, and asserts token-for-token equality (float32 tiny random models).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import marscli.engine.scheduler as scheduler_mod
from marscli.config import DraftConfig, SamplingParams, VerifyConfig
from marscli.drafters.base import RowDrafters
from marscli.drafters.factory import build_drafter, build_drafters
from marscli.engine.scheduler import Engine
from marscli.engine.sequence import FINISH_STOP, RecordFailure

# Very different lengths: one token, a few, and a long repetitive one that ngram drafts well.
PROMPTS = [
    "the quick brown fox jumps over the lazy dog",
    "x",
    "hello world, hello marscli; the cat sat on the mat. hello world, hello",
    "one two three four five six seven eight nine ten one two three",
    "a margin aware rule",
    "speculative decoding drafts tokens and the target verifies them in one pass. " * 4,
]
STRICT = VerifyConfig()
MARS = VerifyConfig("mars", 0.3, "prob-ratio")


def ngram_cfg(k: int = 4, adaptive: bool = False) -> DraftConfig:
    # Fixed K: these tests check that batching gives every row what it gets alone, which
    # holds for a fixed K; adaptive draft lengths depend on the batch by design (the step
    # costs the longest row's length), see test_adaptive_batch_is_exact below.
    return DraftConfig(kind="ngram", num_draft_tokens=k, adaptive=adaptive)


def sampling_for(i: int, temperature: float = 0.0, **kw) -> SamplingParams:
    # Different budgets per record, so rows finish at different times.
    return SamplingParams(temperature=temperature, max_tokens=24 + 9 * (i % 4), seed=100 + i, **kw)


def engine_of(target, factory, vcfg, dcfg, batch_size, eos=None) -> Engine:
    """An engine whose rows each run their own drafter from factory."""
    engine = Engine(target, RowDrafters(factory), vcfg.rule, dcfg, batch_size)
    if eos is not None:
        engine.settings = dataclasses.replace(engine.settings, eos=frozenset(eos))
    return engine


def singles(target, factory, vcfg, dcfg, prompts, samplings, eos=None):
    engine = engine_of(target, factory, vcfg, dcfg, 1, eos)
    return [engine.generate_ids(target.tokenizer(p).input_ids, s) for p, s in zip(prompts, samplings)]


def batched(target, factory, vcfg, dcfg, prompts, samplings, batch_size, eos=None, order=None):
    engine = engine_of(target, factory, vcfg, dcfg, batch_size, eos)
    order = list(range(len(prompts))) if order is None else order
    got = {}
    arrival = []
    for i, res in engine.run(order, lambda i: (target.tokenizer(prompts[i]).input_ids, samplings[i])):
        assert not isinstance(res, Exception), res
        got[i] = res
        arrival.append(i)
    assert sorted(got) == sorted(order)
    return [got[i] for i in range(len(prompts)) if i in got], arrival, engine


def assert_same(ref, got):
    for i, (a, b) in enumerate(zip(ref, got)):
        assert b.token_ids == a.token_ids, (i, a.token_ids, b.token_ids)
        assert b.text == a.text and b.finish_reason == a.finish_reason, i
        assert b.stats.to_dict() == a.stats.to_dict(), i
        assert b.prompt_tokens == a.prompt_tokens


@pytest.mark.parametrize("vcfg", [STRICT, MARS], ids=["strict", "mars"])
def test_greedy_batched_equals_one_at_a_time(target, vcfg):
    dcfg = ngram_cfg()
    factory = lambda: build_drafter(dcfg, target)  # noqa: E731
    samplings = [sampling_for(i) for i in range(len(PROMPTS))]
    ref = singles(target, factory, vcfg, dcfg, PROMPTS, samplings)
    assert sum(r.stats.accepted for r in ref) > 0, "the ngram drafter must get drafts accepted"
    for bs in (2, 4, 8):
        got, arrival, _ = batched(target, factory, vcfg, dcfg, PROMPTS, samplings, bs)
        assert_same(ref, got)
        if bs == 8:  # all at once: rows finish (and are yielded) at different times
            assert arrival != list(range(len(PROMPTS)))


def test_mars_relaxations_are_batch_invariant(target):
    """A drafter that always offers the target's runner-up, so MARS really relaxes."""
    from tests.engines import RunnerUpDrafter

    dcfg = DraftConfig(kind="model", model="x", num_draft_tokens=3, adaptive=False)
    factory = lambda: RunnerUpDrafter(target.model, 3)  # noqa: E731
    prompts = PROMPTS[:4]
    samplings = [SamplingParams(max_tokens=12 + 5 * i) for i in range(len(prompts))]
    ref = singles(target, factory, MARS, dcfg, prompts, samplings)
    assert sum(r.stats.relaxed for r in ref) > 0
    got, _, _ = batched(target, factory, MARS, dcfg, prompts, samplings, 4)
    assert_same(ref, got)


def test_rows_stopping_early_on_eos_and_stop_strings(target):
    dcfg = ngram_cfg()
    factory = lambda: build_drafter(dcfg, target)  # noqa: E731
    base = [sampling_for(i) for i in range(len(PROMPTS))]
    full = singles(target, factory, STRICT, dcfg, PROMPTS, base)
    # A pretend end-of-sequence token taken from record 2's output, and a stop string from
    # record 0's text: some rows end early, others run to their budget.
    eos = set(target.eos_token_ids) | {full[2].token_ids[6]}
    stop = full[0].text[5:8]
    samplings = [SamplingParams(max_tokens=s.max_tokens, seed=s.seed, stop=(stop,) if i % 2 == 0 else ())
                 for i, s in enumerate(base)]
    ref = singles(target, factory, STRICT, dcfg, PROMPTS, samplings, eos=eos)
    assert ref[0].finish_reason == FINISH_STOP and ref[2].finish_reason == FINISH_STOP
    assert any(r.finish_reason != FINISH_STOP for r in ref)
    got, _, _ = batched(target, factory, STRICT, dcfg, PROMPTS, samplings, 4, eos=eos)
    assert_same(ref, got)


@pytest.mark.parametrize("vcfg", [STRICT, MARS], ids=["strict", "mars"])
def test_sampling_with_per_record_seeds_is_batch_invariant(target, vcfg):
    dcfg = ngram_cfg()
    factory = lambda: build_drafter(dcfg, target)  # noqa: E731
    samplings = [sampling_for(i, temperature=0.9, top_p=0.95) for i in range(len(PROMPTS))]
    ref = singles(target, factory, vcfg, dcfg, PROMPTS, samplings)
    for bs in (3, 6):
        got, _, _ = batched(target, factory, vcfg, dcfg, PROMPTS, samplings, bs)
        assert_same(ref, got)


def test_refill_order_never_changes_results(target):
    dcfg = ngram_cfg()
    factory = lambda: build_drafter(dcfg, target)  # noqa: E731
    samplings = [sampling_for(i) for i in range(len(PROMPTS))]
    ref = singles(target, factory, STRICT, dcfg, PROMPTS, samplings)
    for order in ([5, 4, 3, 2, 1, 0], [1, 5, 0, 3, 2, 4]):
        got, _, _ = batched(target, factory, STRICT, dcfg, PROMPTS, samplings, 2, order=order)
        assert_same(ref, got)


@pytest.mark.parametrize("vcfg,temperature", [(STRICT, 0.0), (MARS, 0.0), (MARS, 1.0)],
                         ids=["strict", "mars", "mars-sampled"])
def test_slot_and_contiguous_caches_give_the_same_records(target, vcfg, temperature, monkeypatch):
    """A record's text does not depend on the cache kind: rows joining and leaving a batch of
    3 and rows alone, all in slots (marscli.models.slots), decode what each decodes alone in
    the contiguous cache that a model slots cannot hold gets (marscli.models.kvcache)."""
    import marscli.engine.scheduler as sched

    dcfg = ngram_cfg(k=4, adaptive=False)
    factory = lambda: build_drafter(dcfg, target)  # noqa: E731
    samplings = [sampling_for(i, temperature=temperature) for i in range(len(PROMPTS))]
    slots, _, engine = batched(target, factory, vcfg, dcfg, PROMPTS, samplings, 3)
    assert type(engine.kv).__name__ == "SlotCache"
    alone_in_slots = singles(target, factory, vcfg, dcfg, PROMPTS, samplings)
    with monkeypatch.context() as m:
        m.setattr(sched, "supports_slots", lambda model: False)
        engine = engine_of(target, factory, vcfg, dcfg, 1)
        assert type(engine.kv).__name__ == "ContiguousCache"
        contiguous = [engine.generate_ids(target.tokenizer(p).input_ids, s) for p, s in zip(PROMPTS, samplings)]
        with pytest.raises(ValueError, match="batched decoding needs an attention"):
            engine_of(target, factory, vcfg, dcfg, 2)
    assert_same(contiguous, alone_in_slots)
    assert_same(contiguous, slots)


@pytest.mark.parametrize("kind", ["none", "ngram", "model"])
@pytest.mark.parametrize("vcfg", [STRICT, MARS], ids=["strict", "mars"])
def test_captured_step_shapes_give_the_same_records(target, draft, kind, vcfg):
    """The captured step's static shapes (rows, new tokens and span padded up to buckets, the
    padding rows in free slots; marscli.models.slots.StaticSteps), run eagerly as a CPU can:
    at batch 1 and 4 with rows joining and leaving, every record decodes what it decodes on
    the eager engine alone, greedy and sampled (the draft model's steps static too)."""
    from marscli.models.slots import SlotCache

    dcfg = (DraftConfig(kind="none") if kind == "none" else ngram_cfg(k=4) if kind == "ngram"
            else DraftConfig(kind="model", model="x", num_draft_tokens=3, adaptive=False))
    factory = lambda: build_drafter(dcfg, target, draft)  # noqa: E731
    prompts = PROMPTS[:5]
    samplings = [sampling_for(i, temperature=float(i % 2)) for i in range(len(prompts))]
    ref = singles(target, factory, vcfg, dcfg, prompts, samplings)
    for bs in (1, 4):
        # A captured engine's draft model drafts through the batched drafter at batch 1 too.
        drafters = build_drafters(dcfg, target, draft, batch_size=bs, batched_model=True)
        engine = Engine(target, drafters, vcfg.rule, dcfg, bs, compile_mode="static")
        assert engine.step_kind == "static"
        got = dict(engine.run(range(len(prompts)), lambda i: (target.tokenizer(prompts[i]).input_ids, samplings[i])))
        assert_same(ref, [got[i] for i in range(len(prompts))])
        assert isinstance(engine.kv, SlotCache) and engine.kv.steps.shapes
        if kind == "model":
            assert drafters.kv.steps is not None and drafters.kv.steps.shapes


def static_mars_job(target, draft, kind: str):
    """MARS at static steps (a CPU's captured-step path), batch 3, the n-gram drafter (K 4)
    or a batched draft model (K 3): (engine, drafters, the job's items, its item function)
    over 5 records, greedy and sampled rows alternating."""
    dcfg = (ngram_cfg(k=4) if kind == "ngram"
            else DraftConfig(kind="model", model="x", num_draft_tokens=3, adaptive=False))
    prompts = PROMPTS[:5]
    samplings = [sampling_for(i, temperature=float(i % 2)) for i in range(len(prompts))]
    drafters = build_drafters(dcfg, target, draft, batch_size=3, batched_model=True)
    engine = Engine(target, drafters, MARS.rule, dcfg, 3, compile_mode="static")
    return engine, drafters, range(len(prompts)), lambda i: (target.tokenizer(prompts[i]).input_ids, samplings[i])


@pytest.mark.parametrize("kind", ["ngram", "model"])
def test_a_second_run_on_one_engine_builds_no_shape(target, draft, kind):
    """Captured shapes live with the loaded model, not the job: the same job run again on one
    engine (static steps, as a CPU runs them) builds no shape of the target's steps or of the
    draft model's, and decodes the same records (the first run's buffer growths keep static
    shapes: only graphs and compiled steps read the old buffers)."""
    engine, drafters, items, job = static_mars_job(target, draft, kind)
    built, runs = [], []
    for _ in range(2):
        before = (engine.kv.steps.built, drafters.kv.steps.built if kind == "model" else 0)
        got = dict(engine.run(items, job))
        runs.append([got[i].token_ids for i in items])
        built.append((engine.kv.steps.built - before[0],
                      (drafters.kv.steps.built if kind == "model" else 0) - before[1]))
    assert built[0][0] > 0 and (kind != "model" or built[0][1] > 0)
    assert built[1] == (0, 0), built
    assert runs[0] == runs[1]


@pytest.mark.parametrize("kind", ["ngram", "model"])
def test_one_host_read_per_chain_step_and_per_draft_position(target, draft, kind, monkeypatch):
    """What would be a device-to-host transfer on a GPU, counted on a CPU (static steps, the
    captured step's path, and the draws' dense path, a GPU's): a chain step reads the verdicts
    once; a batched draft model reads its drafts once per draft position for the whole batch,
    greedy and sampled rows alike; the commits read nothing."""
    from marscli.engine.host_reads import count_host_reads
    from marscli.verification import draws

    monkeypatch.setattr(draws, "DENSE_DEVICES", frozenset({"cpu"}))

    engine, drafters, items, job = static_mars_job(target, draft, kind)
    dict(engine.run(items, job))  # shapes built, caches grown
    steps, feeds = [0], [0]
    step = engine.step

    def counted_step():
        steps[0] += 1
        return step()

    engine.step = counted_step
    if kind == "model":
        feed = drafters._feed

        def counted_feed(f):
            feeds[0] += 1
            return feed(f)

        drafters._feed = counted_feed
    prefill = engine.start_rows

    def uncounted_prefill(joiners):  # prompts are read on the host anyway; steps are counted
        with reads.paused():
            return prefill(joiners)

    engine.start_rows = uncounted_prefill
    with count_host_reads() as reads:
        got = dict(engine.run(items, job))
    assert steps[0] > 0 and len(got) == len(items)
    assert reads.total <= steps[0] + feeds[0], (reads.by_kind, steps[0], feeds[0])
    assert reads.by_kind["cpu"] == steps[0]  # the verdicts, once a step
    if kind == "model":
        assert feeds[0] > 0 and reads.by_kind["tolist"] <= feeds[0]


def test_compile_on_compiles_the_step_on_a_cpu(target, capsys):
    """--compile on on a CPU compiles the static step shapes with torch.compile: strict greedy and
    MARS records at batch 2, rows joining and leaving, equal the eager engine's records alone;
    auto and off stay eager on a CPU."""
    dcfg = ngram_cfg(k=3)
    prompts = PROMPTS[:3]
    samplings = [SamplingParams(max_tokens=12 + 4 * i) for i in range(len(prompts))]
    for vcfg in (STRICT, MARS):
        factory = lambda: build_drafter(dcfg, target)  # noqa: E731
        ref = singles(target, factory, vcfg, dcfg, prompts, samplings)
        engine = Engine(target, build_drafters(dcfg, target, None, batch_size=2), vcfg.rule, dcfg, 2,
                        compile_mode="on")
        assert engine.step_kind == "compiled"
        got = dict(engine.run(range(len(prompts)), lambda i: (target.tokenizer(prompts[i]).input_ids, samplings[i])))
        assert [got[i].token_ids for i in range(len(prompts))] == [r.token_ids for r in ref]
        steps = engine.kv.steps
        assert steps.captures > 0 and steps.capture_error is None and steps.capture_seconds > 0
    assert "failed" not in capsys.readouterr().err
    for mode in ("auto", "off"):
        engine = Engine(target, build_drafters(dcfg, target, None, batch_size=2), STRICT.rule, dcfg, 2,
                        compile_mode=mode)
        assert engine.step_kind == "eager"


def test_model_drafter_rows(target, draft):
    dcfg = DraftConfig(kind="model", model="x", num_draft_tokens=3, adaptive=False)
    factory = lambda: build_drafter(dcfg, target, draft)  # noqa: E731
    prompts = PROMPTS[:4]
    for temperature in (0.0, 1.0):
        samplings = [sampling_for(i, temperature=temperature) for i in range(len(prompts))]
        ref = singles(target, factory, STRICT, dcfg, prompts, samplings)
        got, _, _ = batched(target, factory, STRICT, dcfg, prompts, samplings, 4)
        assert_same(ref, got)


@pytest.mark.parametrize("vcfg", [STRICT, MARS], ids=["strict", "mars"])
def test_batched_draft_model(target, draft, vcfg):
    """One draft-model forward per draft position for all rows: same drafts, same outputs."""
    from marscli.drafters.model import BatchedModelDrafter

    # Fixed k: the adaptive policy finds this random drafter not worth running at all.
    dcfg = DraftConfig(kind="model", model="x", num_draft_tokens=3, adaptive=False)
    factory = lambda: build_drafter(dcfg, target, draft)  # noqa: E731
    prompts = PROMPTS
    for temperature in (0.0, 1.0):
        samplings = [sampling_for(i, temperature=temperature) for i in range(len(prompts))]
        ref = singles(target, factory, vcfg, dcfg, prompts, samplings)
        assert sum(r.stats.drafted for r in ref) > 0
        for bs in (2, 4):
            bd = build_drafters(dcfg, target, draft, batch_size=bs)
            assert isinstance(bd, BatchedModelDrafter)
            engine = Engine(target, bd, vcfg.rule, dcfg, bs)
            got = dict(engine.run(range(len(prompts)),
                                  lambda i, samplings=samplings: (target.tokenizer(prompts[i]).input_ids,
                                                                  samplings[i])))
            assert_same(ref, [got[i] for i in range(len(prompts))])


def test_batched_draft_model_with_self_drafting(target):
    """The target as its own draft model: everything accepted, in batch too."""
    dcfg = DraftConfig(kind="model", model="x", num_draft_tokens=4, adaptive=False)
    factory = lambda: build_drafter(dcfg, target, target)  # noqa: E731
    samplings = [sampling_for(i) for i in range(len(PROMPTS))]
    ref = singles(target, factory, STRICT, dcfg, PROMPTS, samplings)
    engine = Engine(target, build_drafters(dcfg, target, target, batch_size=3), STRICT.rule, dcfg, 3)
    got = dict(engine.run(range(len(PROMPTS)), lambda i: (target.tokenizer(PROMPTS[i]).input_ids, samplings[i])))
    assert_same(ref, [got[i] for i in range(len(PROMPTS))])
    assert all(r.stats.accepted == r.stats.drafted for r in got.values())


def test_out_of_memory_halves_the_batch_and_restarts(target, monkeypatch):
    dcfg = ngram_cfg()
    factory = lambda: build_drafter(dcfg, target)  # noqa: E731
    samplings = [sampling_for(i) for i in range(len(PROMPTS))]
    ref = singles(target, factory, STRICT, dcfg, PROMPTS, samplings)
    real = Engine.step
    state = {"steps": 0, "raised": 0}

    def flaky(self):
        state["steps"] += 1
        if state["steps"] in (3, 9):  # mid-run, twice: 4 -> 2 -> 1
            state["raised"] += 1
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(self)

    monkeypatch.setattr(Engine, "step", flaky)
    got, _, engine = batched(target, factory, STRICT, dcfg, PROMPTS, samplings, 4)
    assert state["raised"] == 2 and engine.oom_retries == 2 and engine.batch_size == 1
    assert_same(ref, got)


def test_out_of_memory_at_batch_one_fails_the_record(target, monkeypatch):
    dcfg = ngram_cfg()
    engine = engine_of(target, lambda: build_drafter(dcfg, target), STRICT, dcfg, 1)
    real = Engine.step
    state = {"n": 0}

    def flaky(self):
        state["n"] += 1
        if state["n"] == 2:
            raise torch.cuda.OutOfMemoryError("simulated")
        return real(self)

    monkeypatch.setattr(Engine, "step", flaky)
    out = dict(engine.run([0, 1], lambda i: (target.tokenizer(PROMPTS[i]).input_ids, sampling_for(i))))
    assert isinstance(out[0], torch.cuda.OutOfMemoryError)
    assert out[1].token_ids


def test_prepare_failures_are_yielded_per_record(target):
    dcfg = ngram_cfg()
    engine = engine_of(target, lambda: build_drafter(dcfg, target), STRICT, dcfg, 2)

    def prepare(i):
        if i == 1:
            raise RecordFailure("empty_prompt", "nothing")
        if i == 3:
            raise ValueError("a tokenizer fault")
        return target.tokenizer(PROMPTS[i]).input_ids, sampling_for(i)

    out = dict(engine.run([0, 1, 2, 3, 4], prepare))
    assert isinstance(out[1], RecordFailure) and isinstance(out[3], ValueError)
    assert out[0].token_ids and out[2].token_ids and out[4].token_ids


def test_batched_logits_match_single_row(target):
    """The mask/position bookkeeping itself: one batched step's logits per row equal a
    plain single-row forward of that row's sequence (to float32 rounding)."""
    dcfg = ngram_cfg()
    engine = engine_of(target, lambda: build_drafter(dcfg, target), STRICT, dcfg, 3)
    seen = []
    real_verify = scheduler_mod.verify_rows

    def spy(drafts, logits, draft_len, *a, **kw):  # the step's one verification call
        for b, row in enumerate(engine.rows):
            k = int(draft_len[b])
            seen.append((list(row.seq.seq), drafts[b, :k].tolist(), logits[b: b + 1, : k + 1].clone()))
        return real_verify(drafts, logits, draft_len, *a, **kw)

    scheduler_mod.verify_rows = spy
    try:
        list(engine.run(range(3), lambda i: (target.tokenizer(PROMPTS[i + 2]).input_ids, sampling_for(i))))
    finally:
        scheduler_mod.verify_rows = real_verify
    assert len(seen) > 10
    for seq, drafts, logits in seen[::3]:
        with torch.no_grad():
            full = target.model(torch.tensor([seq + drafts])).logits[:, len(seq) - 1:]
        torch.testing.assert_close(logits, full, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------ CLI

CLI_RUN = ["--no-timing", "--token-ids", "--max-tokens", "12", "-q"]


def _cli_records(tmp_path):
    import json

    lines = [json.dumps({"id": f"r{i}", "prompt": p, "max_tokens": 6 + 3 * i, "seed": i,
                         **({"temperature": 0.8} if i % 3 == 1 else {})})
             for i, p in enumerate(PROMPTS + PROMPTS[:3])]
    lines[4] = "{broken"  # an error result keeps its place
    lines.insert(6, json.dumps({"id": "long", "prompt": " ".join(f"w{i}" for i in range(400))}))
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(lines) + "\n")
    return src


def _gen(*args):
    from typer.testing import CliRunner

    from marscli.cli import app

    return CliRunner().invoke(app, ["generate", *map(str, args)])


def test_cli_batch_size_gives_the_same_bytes(tiny_model_dir, tmp_path):
    """With a fixed K and no job corpus every byte is the batch size's neither; with the
    defaults (draft lengths chosen per batch, strict's n-gram drafter drafting from the
    records finished before: which ones depends on the batch) greedy records keep their
    tokens, statistics may differ."""
    import json

    from marscli.errors import EXIT_RECORDS_FAILED

    src = _cli_records(tmp_path)
    outs = {}
    for bs in (1, 4):
        for extra in (["--fixed-k", "--no-job-corpus"], []):
            out = tmp_path / f"out{bs}{len(extra)}.jsonl"
            r = _gen(src, "--target", tiny_model_dir, "-o", out, "--batch-size", bs, *CLI_RUN, *extra)
            assert r.exit_code == EXIT_RECORDS_FAILED, r.stderr  # the broken line and the long prompt
            outs[bs, bool(extra)] = out.read_bytes()
    assert outs[1, True] == outs[4, True]
    assert b'"prompt_too_long"' in outs[4, True] and b'"invalid_json"' in outs[4, True]
    a, b = ([json.loads(line) for line in outs[bs, False].splitlines()] for bs in (1, 4))
    assert [r.get("id") for r in a] == [r.get("id") for r in b]
    greedy = [i for i, line in enumerate(src.read_text().splitlines()) if '"temperature"' not in line]
    for i in greedy:
        assert a[i].get("token_ids") == b[i].get("token_ids") and a[i].get("error") == b[i].get("error"), i


def test_cli_batched_run_resumes_and_fails_fast(tiny_model_dir, tmp_path, monkeypatch):
    import os
    import signal

    from marscli.errors import EXIT_RECORDS_FAILED, EXIT_TERMINATED

    # A fixed K and no job corpus: with adaptive draft lengths a record's statistics follow its
    # batch, and with the job corpus the records that finished before it.
    src = _cli_records(tmp_path)
    ref = tmp_path / "ref.jsonl"
    _gen(src, "--target", tiny_model_dir, "-o", ref, *CLI_RUN, "--fixed-k", "--no-job-corpus")
    real = Engine.step
    calls = {"n": 0}

    def step(self):
        calls["n"] += 1
        if calls["n"] == 12:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(self)

    monkeypatch.setattr(Engine, "step", step)
    out = tmp_path / "out.jsonl"
    r = _gen(src, "--target", tiny_model_dir, "-o", out, "--batch-size", 3, *CLI_RUN, "--fixed-k", "--no-job-corpus")
    assert r.exit_code == EXIT_TERMINATED, r.stderr
    partial = out.read_bytes()
    assert ref.read_bytes().startswith(partial) and len(partial) < len(ref.read_bytes())
    monkeypatch.setattr(Engine, "step", real)
    # Resume with another batch size: the results do not depend on it.
    r = _gen(src, "--target", tiny_model_dir, "-o", out, "--resume", "--batch-size", 2, *CLI_RUN, "--fixed-k",
             "--no-job-corpus")
    assert r.exit_code == EXIT_RECORDS_FAILED, r.stderr
    assert out.read_bytes() == ref.read_bytes()

    r = _gen(src, "--target", tiny_model_dir, "--batch-size", 4, "--fail-fast", *CLI_RUN, "--fixed-k",
             "--no-job-corpus")
    assert r.exit_code == EXIT_RECORDS_FAILED
    assert "stopped at the first failed record (--fail-fast)" in r.stderr


def test_cli_batched_draft_model_gives_the_same_bytes(tiny_model_dir, tiny_draft_dir, tmp_path):
    src = _cli_records(tmp_path)
    outs = {}
    for bs in (1, 3):
        out = tmp_path / f"out{bs}.jsonl"
        r = _gen(src, "--target", tiny_model_dir, "--draft", tiny_draft_dir, "--fixed-k", "-k", "3",
                 "-o", out, "--batch-size", bs, *CLI_RUN)
        assert r.exit_code == 3, r.stderr
        outs[bs] = out.read_bytes()
    assert outs[1] == outs[3]
    assert b'"drafter": "model"' in outs[3]


def test_cli_batched_summary_rate_uses_wall_time(tiny_model_dir, tmp_path):
    """Batched records overlap in time, so the summary's rate is taken over the run's wall
    time (this only checks that the batched summary line is there with a rate)."""
    import re

    src = _cli_records(tmp_path)
    r = _gen(src, "--target", tiny_model_dir, "--batch-size", 4, "--no-timing", "--max-tokens", "12")
    m = re.search(r"(\d+) tokens, ([\d.]+) tok/s", r.stderr)
    assert m and float(m.group(2)) > 0, r.stderr


def test_out_of_memory_in_a_prefill_halves_the_batch(target, monkeypatch):
    dcfg = ngram_cfg()
    factory = lambda: build_drafter(dcfg, target)  # noqa: E731
    samplings = [sampling_for(i) for i in range(len(PROMPTS))]
    ref = singles(target, factory, STRICT, dcfg, PROMPTS, samplings)
    real = Engine.start_rows
    calls = {"n": 0}

    def flaky(self, *a, **kw):
        calls["n"] += 1
        if calls["n"] == 2:  # the second refill's prefill, with rows already running
            raise torch.cuda.OutOfMemoryError("simulated")
        return real(self, *a, **kw)

    monkeypatch.setattr(Engine, "start_rows", flaky)
    got, _, engine = batched(target, factory, STRICT, dcfg, PROMPTS, samplings, 4)
    assert engine.oom_retries == 1 and engine.batch_size == 2
    assert_same(ref, got)


def test_drained_queue_is_known_before_the_first_step(target):
    """A full batch reads one record ahead: with every record in the batch, the first step
    already knows the queue is drained (and the draft lengths aim at the job's end); strict
    greedy results stay those of batch size 1."""
    prompts = PROMPTS[:3]
    samplings = [sampling_for(i) for i in range(3)]
    dcfg = ngram_cfg(4, adaptive=True)
    factory = lambda: build_drafter(dcfg, target)  # noqa: E731
    engine = engine_of(target, factory, STRICT, dcfg, 3)
    seen = []
    step = engine.step

    def spy():
        seen.append(engine.drained)
        return step()

    engine.step = spy
    got = {i: r for i, r in engine.run(range(3), lambda i: (target.tokenizer(prompts[i]).input_ids, samplings[i]))}
    assert seen and all(seen)
    ref = singles(target, factory, STRICT, dcfg, prompts, samplings)
    assert [got[i].token_ids for i in range(3)] == [r.token_ids for r in ref]
    # With more records than rows the queue drains only once the last one has joined.
    engine = engine_of(target, factory, STRICT, dcfg, 2)
    seen.clear()
    engine.step = spy
    list(engine.run(range(3), lambda i: (target.tokenizer(prompts[i]).input_ids, samplings[i])))
    assert not seen[0] and seen[-1]


def test_batch_size_one_never_reads_ahead(target):
    """At batch size 1 the next record is read only after the current one's result is out
    (a caller may write the next request after reading a result)."""
    prompts = PROMPTS[:2]
    dcfg = ngram_cfg(4, adaptive=True)
    engine = engine_of(target, lambda: build_drafter(dcfg, target), STRICT, dcfg, 1)
    done = []

    def items():
        yield 0
        assert done == [0], "record 1 was read before record 0's result was out"
        yield 1

    for i, res in engine.run(items(), lambda i: (target.tokenizer(prompts[i]).input_ids, sampling_for(i))):
        assert not isinstance(res, Exception), res
        done.append(i)
    assert done == [0, 1]


def test_relaxed_and_sampled_rows_follow_the_measured_costs_and_keep_their_text(target):
    """Adaptive draft lengths and a steep measured cost at batch size 4: relaxed and sampled
    rows draft by the batch's costs like any row (down to plain steps that draft nothing),
    and what each decodes stays what it decodes alone with cheap drafting (the
    reproducibility contract: the text is defined position by position)."""
    from marscli.engine.costs import StepCosts

    dcfg = ngram_cfg(8, adaptive=True)
    factory = lambda: build_drafter(dcfg, target)  # noqa: E731
    samplings = [sampling_for(i, temperature=0.8 * (i % 2)) for i in range(len(PROMPTS))]
    ref = singles(target, factory, MARS, dcfg, PROMPTS, samplings)
    engine = engine_of(target, factory, MARS, dcfg, 4)
    bs, ns = (1, 2, 4), (1, 2, 3, 5, 9)
    engine.costs = StepCosts(bs, ns, tuple(tuple(1.0 + 0.6 * (b * n - 1) for n in ns) for b in bs),
                             (0.0, 0.0, 0.0), {"test": "steep"}, "test")
    chosen = []
    real = engine.lengths

    def spy(offers, caps):
        ks = real(offers, caps)
        chosen.append((max(o.available for o in offers), max(ks)))
        return ks

    engine.lengths = spy
    got = {}
    for i, res in engine.run(range(len(PROMPTS)), lambda i: (target.tokenizer(PROMPTS[i]).input_ids, samplings[i])):
        assert not isinstance(res, Exception), res
        got[i] = res
    assert any(avail > 0 and k == 0 for avail, k in chosen), "some step must have drafted nothing it could"
    assert sum(r.stats.relaxed for r in ref) > 0
    for i, r in enumerate(ref):
        assert got[i].token_ids == r.token_ids and got[i].text == r.text, i


def test_a_greedy_mars_step_reads_the_vocabulary_twice(target):
    """The target's top-1 is taken once per chain step and shared: greedy verification, MARS's
    top two and the stop guard read it, so a greedy MARS step with stop tokens makes two
    argmax passes over its [B, K+1, V] logits (top-1, then top-2 with it removed), not four;
    the rows write what they write one at a time."""
    from torch.overrides import TorchFunctionMode

    vocab = target.model.get_output_embeddings().weight.shape[0]
    passes, steps = [0], [0]

    class Count(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.Tensor.argmax and args[0].dim() == 3 and args[0].shape[-1] == vocab:
                passes[0] += 1
            return func(*args, **(kwargs or {}))

    dcfg = ngram_cfg(k=3)
    factory = lambda: build_drafter(dcfg, target)  # noqa: E731
    prompts = PROMPTS[2:6]
    samplings = [sampling_for(i) for i in range(len(prompts))]
    ref = singles(target, factory, MARS, dcfg, prompts, samplings, eos=[7, 11])
    engine = engine_of(target, factory, MARS, dcfg, 2, eos=[7, 11])
    step = engine._chain_step

    def counted(*a, **kw):
        steps[0] += 1
        with Count():
            return step(*a, **kw)

    engine._chain_step = counted
    out = dict(engine.run(range(len(prompts)), lambda i: (target.tokenizer(prompts[i]).input_ids, samplings[i])))
    assert steps[0] > 0 and passes[0] == 2 * steps[0], (passes[0], steps[0])
    assert [out[i].token_ids for i in range(len(prompts))] == [r.token_ids for r in ref]


@pytest.mark.parametrize("batch_size", [1, 4])
@pytest.mark.parametrize("vcfg", [STRICT, MARS], ids=["strict", "mars"])
def test_the_first_token_comes_from_the_prefill(target, oracle, vcfg, batch_size):
    """A joining row's first token is judged on the prefill pass's logits at its last prompt
    token (as transformers' generate() takes it): a one-token job runs no decoding step, and
    its tokens and logprobs are those of an engine that computes the first token in a step
    (and, strict, the oracle's greedy token), for prompts the prefix cache holds whole (the
    job run twice on one engine) and a prompt joining twice in one group."""
    from tests.oracles import check_logprobs

    dcfg = ngram_cfg()
    factory = lambda: build_drafter(dcfg, target)  # noqa: E731
    prompts = PROMPTS + [PROMPTS[2]]
    ids = [target.tokenizer(p).input_ids for p in prompts]
    samplings = [SamplingParams(max_tokens=1, logprobs=True, top_logprobs=2) for _ in prompts]
    stepped = engine_of(target, factory, vcfg, dcfg, 1)
    stepped._first_ok = False  # the first token from a step, as before the prefill gave it
    assert not stepped.first_from_prefill
    ref = [stepped.generate_ids(p, s) for p, s in zip(ids, samplings)]
    engine = engine_of(target, factory, vcfg, dcfg, batch_size)
    assert engine.first_from_prefill
    steps = [0]
    step = engine.step

    def counted():
        steps[0] += 1
        return step()

    engine.step = counted
    for _ in range(2):  # the second run finds every prompt in the prefix cache
        out = dict(engine.run(range(len(prompts)), lambda i: (ids[i], samplings[i])))
        assert steps[0] == 0
        for i, p in enumerate(ids):
            assert out[i].token_ids == ref[i].token_ids and len(out[i].token_ids) == 1, i
            assert out[i].stats.relaxed == ref[i].stats.relaxed
            check_logprobs(oracle, p, out[i], 2)
            if not vcfg.rule.relaxes:
                with torch.no_grad():
                    assert out[i].token_ids == [int(oracle(torch.tensor([p])).logits[0, -1].argmax())]
    assert engine.prefix_tokens_reused > 0


def test_free_places_wait_a_step_for_rows_certain_to_end(target, monkeypatch):
    """A row ending a step before its neighbour, which has one token left, leaves its place
    empty one step: both places are then filled by one prefill pass (not two), and no text
    changes. Never two steps in a row: a place waits at most one step."""
    from marscli.engine.admission import Admission

    prompts = PROMPTS[:4]
    # First token from the prefill: record 0 ends after 2 steps, record 1 after 3, and so on.
    samplings = [SamplingParams(max_tokens=n) for n in (3, 4, 3, 4)]
    dcfg = DraftConfig(kind="none")

    def run(hold):
        monkeypatch.setattr(Admission, "hold", hold)
        engine = engine_of(target, lambda: build_drafter(dcfg, target), STRICT, dcfg, 2)
        groups = []
        start = engine.start_rows

        def counted(joiners):
            groups.append(len(joiners))
            return start(joiners)

        engine.start_rows = counted
        got = dict(engine.run(range(4), lambda i: (target.tokenizer(prompts[i]).input_ids, samplings[i])))
        return [got[i].token_ids for i in range(4)], groups

    real_hold, verdicts = Admission.hold, []

    def recorded(self, held):
        verdicts.append(real_hold(self, held))
        return verdicts[-1]

    waiting, groups = run(recorded)
    assert groups == [2, 2]
    assert True in verdicts and (True, True) not in set(zip(verdicts, verdicts[1:]))
    at_once, groups = run(lambda self, held: False)
    assert groups == [2, 1, 1]
    assert waiting == at_once
    # Rows that keep having one token left never keep a place empty two steps running.
    assert not Admission.hold(type("A", (), {"engine": None})(), True)
