"""The scheduler's contract per step: one target forward, one verification call and one
device-to-host transfer for the whole batch, whatever the batch size (and for a joining
group's first tokens, judged on the prefill's logits: one verification, one transfer)."""

from __future__ import annotations

import pytest

import marscli.engine.scheduler as scheduler_mod
from marscli.config import DraftConfig, SamplingParams, VerifyConfig
from marscli.engine import build_engine
from marscli.verification.chain import VerifyResult

PROMPTS = ["the quick brown fox jumps over the lazy dog the quick brown fox",
           "one two three four five six seven eight nine ten one two three",
           "hello world, hello marscli; the cat sat on the mat. hello world, hello",
           "x"]


@pytest.mark.parametrize("batch_size", [1, 3])
@pytest.mark.parametrize("verify_cfg", [VerifyConfig(), VerifyConfig("mars", 0.3, "prob-ratio")],
                         ids=["strict", "mars"])
def test_one_forward_one_verification_one_transfer_per_step(target, monkeypatch, batch_size, verify_cfg):
    engine = build_engine(target, None, verify_cfg, DraftConfig(kind="ngram", num_draft_tokens=4),
                          batch_size)
    counts = {"steps": 0, "joins": 0, "verify": 0, "host": 0, "forward": 0}
    real_step, real_verify, real_host = engine.step, scheduler_mod.verify_rows, VerifyResult.host_rows
    real_join = engine.start_rows
    real_forward = engine.kv.__class__.forward

    def count(name, fn):
        def wrapped(*a, **kw):
            counts[name] += 1
            return fn(*a, **kw)
        return wrapped

    monkeypatch.setattr(engine, "step", count("steps", real_step))
    monkeypatch.setattr(engine, "start_rows", count("joins", real_join))
    monkeypatch.setattr(scheduler_mod, "verify_rows", count("verify", real_verify))
    monkeypatch.setattr(VerifyResult, "host_rows", count("host", real_host))
    monkeypatch.setattr(engine.kv.__class__, "forward", count("forward", real_forward))
    samplings = [SamplingParams(max_tokens=20, temperature=0.8 * (i % 2), seed=i) for i in range(len(PROMPTS))]
    out = dict(engine.run(range(len(PROMPTS)), lambda i: (target.tokenizer(PROMPTS[i]).input_ids, samplings[i])))
    assert all(not isinstance(r, Exception) for r in out.values())
    assert counts["steps"] > 0
    # steps are counted once per batch, so with 3 rows there are fewer steps than row-steps
    # (a record's statistics count its first token, from the prefill pass, as a step)
    assert engine.first_from_prefill
    row_steps = sum(r.stats.steps for r in out.values()) - len(out)
    assert counts["forward"] == counts["steps"]
    assert counts["verify"] == counts["host"] == counts["steps"] + counts["joins"]
    # prompts prefill apart from the steps: one pass per record alone (a one-token prompt too:
    # its logits give the first token), fewer when records join together (the first three here)
    prompted = len(PROMPTS)
    if batch_size > 1:
        assert counts["steps"] < row_steps
        assert 1 <= engine.prefiller.passes < prompted
    else:
        assert counts["steps"] == row_steps
        assert engine.prefiller.passes == prompted
