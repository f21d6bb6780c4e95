"""Hybrid drafting (marscli.drafters.hybrid, `--draft ngram+MODEL`): prompt lookup where its
match is long, the draft model elsewhere, chosen at every position from the row's text.

The choice is checked per position against an independent loop over the text; the engine
with a hybrid drafter against plain decoding and transformers' generate() (strict greedy),
with both sources really used; and a relaxed or sampled hybrid row decodes the same text
whatever its draft lengths and its batch.
"""

from __future__ import annotations

import json

import pytest
import torch

from marscli.config import DraftConfig, GuardConfig, SamplingParams, VerifyConfig
from marscli.drafters.base import RowDrafters
from marscli.drafters.factory import build_drafter
from marscli.drafters.hybrid import HybridDrafter
from marscli.engine import build_engine
from marscli.engine.costs import StepCosts
from marscli.engine.scheduler import Engine
from marscli.verification.registry import MARS, Rule
from tests.oracles import hf_greedy

PROMPTS = [
    "hello world, hello marscli; the cat sat on the mat. hello world, hello",
    "one two three four five six seven eight nine ten one two three",
    "the quick brown fox jumps over the lazy dog",
    "speculative decoding drafts tokens and the target verifies them in one pass. speculative",
]
CFG = DraftConfig(kind="model", model="x", num_draft_tokens=4, hybrid=True)


def curve(draft_share: float) -> StepCosts:
    """A CPU-like curve: verifying 9 tokens costs 1.2 one-token forwards; a draft token
    costs draft_share of one."""
    return StepCosts((1,), (1, 9), ((1.0, 1.2),), (draft_share,), {"test": draft_share}, "measured")


def longest_match(text: list[int], nmax: int = 3) -> tuple[int, int | None]:
    """(n, the token after the latest earlier occurrence) of the longest suffix n-gram of
    text: a brute-force scan, the oracle of the drafter's index."""
    for n in range(nmax, 0, -1):
        if len(text) <= n:
            continue
        for stop in range(len(text) - 1, n - 1, -1):
            if text[stop - n: stop] == text[-n:]:
                return n, text[stop]
    return 0, None


# --- the choice -------------------------------------------------------------------------


def test_each_position_takes_a_long_match_else_the_draft_model(target, draft):
    """Each proposal of a chain is the n-gram's token where the text so far (with the drafts
    before it) ends in a 3-gram seen before, else the draft model's argmax after that text."""
    d = build_drafter(CFG, target, draft)
    assert isinstance(d, HybridDrafter)
    for text in PROMPTS:
        ids = target.tokenizer(text).input_ids
        d.start(ids, SamplingParams())
        p = d.propose(ids, 4, bonus=True)
        chain = p.tokens + [p.next]
        cur = list(ids)
        for tok in chain:
            n, copied = longest_match(cur)
            if n >= 3:
                assert tok == copied
            else:
                with torch.no_grad():
                    want = int(draft.model(torch.tensor([cur])).logits[0, -1].argmax())
                assert tok == want
            cur.append(tok)
    assert d.steps["ngram"] > 0 and d.steps["model"] > 0, d.steps


# --- in the engine ------------------------------------------------------------------------


@pytest.mark.parametrize("draft_share", [0.02, 0.9])
def test_strict_hybrid_drafting_is_plain_decoding_and_uses_both_sources(target, draft, oracle, draft_share):
    made: list[HybridDrafter] = []

    def factory():
        made.append(build_drafter(CFG, target, draft))
        return made[-1]
    engine = Engine(target, RowDrafters(factory), Rule("strict"), CFG, 1, costs=curve(draft_share))
    plain = build_engine(target, None, VerifyConfig(), DraftConfig(kind="none"))
    for text in PROMPTS:
        ids = target.tokenizer(text).input_ids
        res = engine.generate_ids(ids, SamplingParams(max_tokens=40))
        assert res.token_ids == plain.generate_ids(ids, SamplingParams(max_tokens=40)).token_ids, text
        assert res.token_ids == hf_greedy(oracle, ids, 40), text
    assert all(isinstance(d, HybridDrafter) for d in made)
    steps = {src: sum(d.steps[src] for d in made) for src in ("ngram", "model")}
    assert steps["ngram"] > 0 and steps["model"] > 0, steps


def test_a_batch_of_hybrid_rows_equals_each_row_alone(target, draft):
    engine = build_engine(target, draft, VerifyConfig(), CFG, batch_size=3)
    alone = build_engine(target, None, VerifyConfig(), DraftConfig(kind="none"))
    prompts = [target.tokenizer(t).input_ids for t in PROMPTS]
    got = dict(engine.run(range(len(prompts)), lambda i: (prompts[i], SamplingParams(max_tokens=32))))
    for i, ids in enumerate(prompts):
        assert got[i].token_ids == alone.generate_ids(ids, SamplingParams(max_tokens=32)).token_ids, i


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_relaxed_hybrid_rows_decode_one_text_whatever_the_schedule(target, draft, temperature):
    """MARS with hybrid drafting, greedy and sampled: the same tokens at a fixed K of 1 and
    of 4, adaptive, alone and in a batch of 3 in reverse order. (Greedy rows relax on the
    tiny models; sampled rows' drafts mostly agree with the coupled draws instead, which
    tests/test_contract.py's drafter relaxes against.)"""
    verify = VerifyConfig.from_rule(Rule(MARS, 0.3, "prob-ratio"),
                                    GuardConfig(repeat_ngram=0, max_relaxed_share=1.0, strict_first=0,
                                                loop_rewind=0))
    prompts = [target.tokenizer(t).input_ids for t in PROMPTS * 2]
    settings = [SamplingParams(temperature=temperature, max_tokens=30, seed=20 + i) for i in range(len(prompts))]
    want = None
    for k, adaptive, batch in ((4, True, 1), (1, False, 1), (4, False, 3)):
        cfg = DraftConfig(kind="model", model="x", num_draft_tokens=k, hybrid=True, adaptive=adaptive)
        engine = build_engine(target, draft, verify, cfg, batch_size=batch)
        order = list(range(len(prompts)))[::-1] if batch > 1 else list(range(len(prompts)))
        got = {i: r for i, r in engine.run(order, lambda i: (prompts[i], settings[i]))}
        text = [got[i].token_ids for i in range(len(prompts))]
        if want is None:
            want = text
            assert sum(r.stats.relaxed if not temperature else r.stats.accepted for r in got.values()) > 0
        assert text == want, (k, adaptive, batch)


# --- the command line ---------------------------------------------------------------------


def test_draft_ngram_plus_model_reaches_spec_and_fingerprint(runner, tiny_model_dir, tiny_draft_dir, tmp_path):
    from marscli.cli import app

    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"id": "a", "prompt": "hello world, hello marscli; hello world"}) + "\n")
    out = tmp_path / "out.jsonl"
    base = ["generate", str(src), "--target", str(tiny_model_dir), "--max-tokens", "12", "--verify", "strict"]
    r = runner.invoke(app, [*base, "--draft", f"ngram+{tiny_draft_dir}", "-o", str(out)])
    assert r.exit_code == 0, r.stderr
    rec = json.loads(out.read_text())
    assert rec["spec"]["drafter"] == "model" and rec["spec"]["hybrid"] is True
    plain = tmp_path / "plain.jsonl"
    assert runner.invoke(app, [*base, "--draft", "none", "-o", str(plain)]).exit_code == 0
    assert json.loads(plain.read_text())["output"] == rec["output"]
    # resuming with the draft model alone is a different run
    r = runner.invoke(app, [*base, "--draft", str(tiny_draft_dir), "-o", str(out), "--resume"])
    assert r.exit_code != 0 and "drafter" in r.stderr
    for bad in ("ngram+", "ngram+ngram", "ngram+none", "ngram+eagle3:x"):
        r = runner.invoke(app, [*base, "--draft", bad])
        assert r.exit_code != 0 and "--draft ngram+MODEL needs a draft model" in r.stderr, bad
