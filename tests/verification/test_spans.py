"""Strict spans (marscli.verification.spans) and per-token provenance (marscli.engine.provenance).

Span detection is tested on strings against the definition (``strict_at``); the incremental
tracker against the definition on every prefix; the engine with a drafter that always offers
the target's runner-up and MARS at a permissive theta, reading its text through a tokenizer
whose pieces hold fences and answer markers, so relaxations are offered everywhere and the
spans must refuse them there.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re

import pytest
import torch

from marscli.config import (
    DraftConfig,
    SamplingParams,
    SpanConfig,
    VerifyConfig,
)
from marscli.drafters.base import RowDrafters
from marscli.engine.provenance import (
    BONUS,
    CORRECTION,
    DRAFT,
    RELAXED,
    TARGET,
    Provenance,
    step_kinds,
)
from marscli.engine.scheduler import Engine
from marscli.verification.spans import (
    ANSWER,
    CODE,
    SpanRule,
    SpanTracker,
    compile_regex,
    fence_opener,
    parse_strict_in,
    strict_at,
)
from tests.engines import PROMPTS, RunnerUpDrafter, encode
from tests.verify_helpers import slot_tree_forward, strict_now

CODE_ONLY = SpanRule((CODE,))
ANSWER_ONLY = SpanRule((ANSWER,))

# --------------------------------------------------------------------------- on strings


@pytest.mark.parametrize("text,inside", [
    ("", False),
    ("Here:\n", False),
    ("Here:\n``", False),  # not a fence yet
    ("Here:\n```", True),  # the opening run is seen: its info string is inside
    ("Here:\n```python\nx = 1", True),
    ("```py\nx\n```", True),  # the closing line is not finished: still inside
    ("```py\nx\n```\n", False),
    ("```py\nx\n```\nmore text", False),
    ("```\ncode\n``` not a closer\nstill", True),  # a closer has nothing after its run
    ("~~~\ncode\n~~~\n", False),
    ("~~~\ncode\n```\n", True),  # another fence character does not close
    ("````\n```\n", True),  # a shorter run does not close
    ("````\nx\n`````\n", False),  # a longer one does
    ("  ```\nindented", True),
    ("1. item\n    ```js\n    let x", True),  # fences inside list items count
    ("use ```x``` inline\n", False),
    ("```x```\nafter", False),  # backticks in a backtick fence's info string: inline code
    ("~~~ a`b\ncode", True),  # but not in a tilde fence's
    ("text ``` mid-line\nmore", False),
    ("```\na\n```\n\n~~~\nb", True),  # a second block
])
def test_code_spans(text, inside):
    assert strict_at(text, CODE_ONLY) is inside
    assert strict_at(text, ANSWER_ONLY) is False


@pytest.mark.parametrize("text,after", [
    ("the sum is 42", False),
    ("so ###", False),
    ("so ####", True),
    ("so #### 42\nand then more", True),
    ("hence \\boxed{", True),
    ("hence \\boxed", False),
    ("FINAL ANSWER: 3", True),
    ("Final answer", False),
    ("```\n#### a comment\n```\nok", False),  # a marker in code is not an answer
    ("```\n#### a comment", False),
    ("#### heading\n```\ncode\n```\n", True),  # an answer stays strict through later code
])
def test_answer_spans(text, after):
    assert strict_at(text, ANSWER_ONLY) is after


def test_kinds_combine_and_regex_is_a_search_of_the_text_before():
    both = SpanRule((CODE, ANSWER))
    assert strict_at("```\nx", both) and strict_at("#### 1", both) and not strict_at("plain", both)
    sticky = SpanRule((), compile_regex("(?i)answer is"))
    assert not strict_at("the answer i", sticky)
    assert strict_at("The ANSWER is", sticky) and strict_at("The answer is 4.\nMore.", sticky)
    # A negative lookahead closes a span again: strict while a <t> is open.
    tag = SpanRule((), compile_regex(r"<t>(?![\s\S]*</t>)"))
    assert [strict_at(t, tag) for t in ("a", "a<t>", "a<t>x</t", "a<t>x</t>", "a<t>x</t><t>")] == \
        [False, True, True, False, True]


def test_option_parsing():
    assert parse_strict_in("code, answer,code") == (CODE, ANSWER)
    assert parse_strict_in(None) == ()
    with pytest.raises(ValueError, match="unknown span 'prose'"):
        parse_strict_in("code,prose")
    with pytest.raises(ValueError, match="--strict-regex"):
        compile_regex("(unclosed")
    assert fence_opener("  ~~~~ rust") == ("~", 4) and fence_opener("``") is None and fence_opener("") is None
    assert SpanRule.from_config(SpanConfig()) is None and SpanRule.from_config(None) is None
    assert SpanRule.from_config(SpanConfig(("code",), "x")).regex.pattern == "x"


class PieceTokenizer:
    """Token i decodes to pieces[i]; a token may also be half of a two-byte character."""

    def __init__(self, pieces: list[str]):
        self.pieces = pieces

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(self.pieces[i] for i in ids)


PIECES = ["\n", "```", "~~~", "`", "#", "### ", "\\boxed{", "x ", "y\n", "  ", "python\n", "Final ", "answer: ",
          "<t>", "</t>"]


def test_tracker_equals_the_definition_on_every_prefix_whatever_the_steps():
    rule = SpanRule((CODE, ANSWER), compile_regex(r"<t>(?![\s\S]*</t>)"))
    tok = PieceTokenizer(PIECES)
    rng = random.Random(0)
    for trial in range(40):
        stream = [rng.randrange(len(PIECES)) for _ in range(60)]
        tracker = SpanTracker(tok, rule)
        done = 0
        while done < len(stream):
            k = rng.randrange(0, 6)
            drafts = stream[done: done + k] + [rng.randrange(len(PIECES))]  # the last one rejected
            flags = tracker.flags(drafts)
            for i in range(len(drafts)):
                assert flags[i] == strict_at(tok.decode(stream[:done] + drafts[:i]), rule), (trial, done, i)
            n = min(k, len(stream) - done)
            tracker.commit(stream[done: done + n + 1])  # accepted drafts, then the "correction"
            done += n + 1
        assert tracker.cur.text == tok.decode(stream[:done])


def test_tree_flags_follow_each_nodes_root_path():
    rule = SpanRule((CODE, ANSWER))
    tok = PieceTokenizer(PIECES)
    rng = random.Random(1)
    tracker = SpanTracker(tok, rule)
    tracker.commit([7, 0, 1])  # "x \n```": inside code
    tokens, parents = [], []
    for i in range(30):
        tokens.append(rng.randrange(len(PIECES)))
        parents.append(rng.randrange(-1, i))
    flags = tracker.tree_flags(tokens, parents)
    for i in range(len(tokens)):
        path, j = [], parents[i]
        while j >= 0:
            path.append(tokens[j])
            j = parents[j]
        assert flags[i] == strict_at(tok.decode([7, 0, 1] + path[::-1]), rule)
    assert flags[0] is True


def test_tracker_holds_back_incomplete_characters(tiny_tokenizer):
    """A byte-level tokenizer splits 'é' over tokens: the text is what decode says once the
    character is whole, never a replacement character in the middle."""
    text = "caf\u00e9 ```\u00e9t\u00e9\n``` na\u00efve #### 4"
    ids = tiny_tokenizer(text).input_ids
    rule = SpanRule((CODE, ANSWER))
    tracker = SpanTracker(tiny_tokenizer, rule)
    flags = tracker.flags(ids)
    for i, f in enumerate(flags):
        before = tiny_tokenizer.decode(ids[:i], skip_special_tokens=True)
        if not before.endswith("\ufffd"):
            assert f == strict_at(before, rule), (i, before)
    tracker.commit(ids)
    assert tracker.cur.text == tiny_tokenizer.decode(ids, skip_special_tokens=True)
    assert strict_now(tracker)


# --------------------------------------------------------------------------- provenance


def test_step_kinds_and_truncation():
    assert step_kinds([0, 1, 0], 3, 3) == "drdb"
    assert step_kinds([1, 0, 0], 1, 3) == "rc"
    assert step_kinds([], 0, 0) == "t"
    assert step_kinds([0, 0], 2, 5, bonus=True) == "ddb"  # a tree path that ended at a leaf
    p = Provenance()
    p.extend("drdb", [None, 0.93, None, None])
    p.extend("rc", [0.5, None])
    assert p.to_dict() == {"kinds": "drdbrc", "relaxed": [[1, 0.93], [4, 0.5]], "relaxed_share": 0.3333}
    p.truncate(3)
    assert p.to_dict() == {"kinds": "drd", "relaxed": [[1, 0.93]], "relaxed_share": 0.3333}


# --------------------------------------------------------------------------- the engine


def span_engine(target, spans: SpanConfig | None, pieces: list[str], batch_size: int = 1, k: int = 3,
                theta: float = 0.0) -> Engine:
    """MARS at a permissive theta with a drafter whose first draft is always the target's
    runner-up; its text read through PieceTokenizer(pieces)."""
    cfg = DraftConfig(kind="model", model="x", num_draft_tokens=k, adaptive=False)
    engine = Engine(target, RowDrafters(lambda: RunnerUpDrafter(target.model, k)),
                    VerifyConfig("mars", theta, "prob-ratio").rule, cfg, batch_size, spans=spans)
    engine.settings = dataclasses.replace(engine.settings, tokenizer=PieceTokenizer(pieces))
    return engine


def fence_pieces(V: int, every: int = 5) -> list[str]:
    return ["\n```\n" if i % every == 2 else f"w{i} " for i in range(V)]


def run_all(engine, prompts: list[list[int]], sampling: SamplingParams) -> list:
    out = [None] * len(prompts)
    for i, res in engine.run(range(len(prompts)), lambda i: (prompts[i], sampling)):
        assert not isinstance(res, BaseException), res
        out[i] = res
    return out


def check_consistent(res) -> None:
    kinds = res.provenance["kinds"]
    assert len(kinds) == len(res.token_ids)
    assert set(kinds) <= {DRAFT, RELAXED, CORRECTION, BONUS, TARGET}
    if res.finish_reason == "length":  # no EOS cut a step short: the counters match exactly
        s = res.stats
        assert kinds.count(RELAXED) == s.relaxed
        # a step emits its accepted drafts (d, r) and one token more: a correction, a bonus,
        # a target token, or the proposal after the drafts when the rule relaxed to it (r)
        assert s.accepted + s.steps == len(kinds)
        ends = kinds.count(CORRECTION) + kinds.count(BONUS) + kinds.count(TARGET)
        assert ends <= s.steps <= ends + kinds.count(RELAXED)
        assert kinds.count(DRAFT) <= s.accepted
    relaxed = [i for i, c in enumerate(kinds) if c == RELAXED]
    assert [i for i, _ in res.provenance["relaxed"]] == relaxed
    assert res.provenance["relaxed_share"] == round(len(relaxed) / len(kinds), 4)


def test_no_relaxed_token_inside_code_and_the_spans_are_what_refused(target):
    V = target.model.config.vocab_size
    pieces = fence_pieces(V)
    tok = PieceTokenizer(pieces)
    prompts = [encode(target, p) for p in PROMPTS]
    sampling = SamplingParams(max_tokens=48, provenance=True)
    on = run_all(span_engine(target, SpanConfig((CODE,)), pieces), prompts, sampling)
    off = run_all(span_engine(target, None, pieces), prompts, sampling)
    inside_on = relaxed_inside_off = relaxed_on = positions_in_code = 0
    for a, b in zip(on, off):
        check_consistent(a)
        check_consistent(b)
        for res, which in ((a, "on"), (b, "off")):
            for i, kind in enumerate(res.provenance["kinds"]):
                inside = strict_at(tok.decode(res.token_ids[:i]), CODE_ONLY)
                if which == "on":
                    positions_in_code += inside
                    relaxed_on += kind == RELAXED
                    inside_on += inside and kind == RELAXED
                else:
                    relaxed_inside_off += inside and kind == RELAXED
        for _, stat in a.provenance["relaxed"]:  # MARS relaxes where p2/p1 > theta = 0
            assert stat is not None and 0.0 < stat <= 1.0
        assert "span_refused" in a.stats.to_dict() and "span_refused" not in b.stats.to_dict()
    assert inside_on == 0
    # The test has teeth: without spans relaxed tokens do land in code, with them the rule
    # still relaxes outside code, and the records spend time inside code.
    assert relaxed_inside_off > 0 and relaxed_on > 0 and positions_in_code > 0
    assert sum(r.stats.span_refused for r in on) > 0


def test_answer_marker_and_regex_spans_in_the_engine(target):
    V = target.model.config.vocab_size
    pieces = [" #### " if i % 11 == 4 else f"w{i} " for i in range(V)]
    tok = PieceTokenizer(pieces)
    prompts = [encode(target, p) for p in PROMPTS]
    sampling = SamplingParams(max_tokens=40, provenance=True)
    for spans, rule in ((SpanConfig((ANSWER,)), ANSWER_ONLY),
                        (SpanConfig((), r"w\d*7 "), SpanRule((), re.compile(r"w\d*7 ")))):
        results = run_all(span_engine(target, spans, pieces), prompts, sampling)
        strict_positions = 0
        for res in results:
            check_consistent(res)
            for i, kind in enumerate(res.provenance["kinds"]):
                strict = strict_at(tok.decode(res.token_ids[:i]), rule)
                strict_positions += strict
                assert not (strict and kind == RELAXED), (spans, i)
        assert strict_positions > 0 and sum(r.stats.relaxed for r in results) > 0


def test_batch_of_three_equals_one_at_a_time(target):
    V = target.model.config.vocab_size
    pieces = fence_pieces(V)
    prompts = [encode(target, p) for p in PROMPTS[:3]]
    sampling = SamplingParams(max_tokens=32, provenance=True)
    one = run_all(span_engine(target, SpanConfig((CODE,)), pieces), prompts, sampling)
    three = run_all(span_engine(target, SpanConfig((CODE,)), pieces, batch_size=3), prompts, sampling)
    for a, b in zip(one, three):
        assert a.token_ids == b.token_ids
        assert a.provenance["kinds"] == b.provenance["kinds"]
        assert [i for i, _ in a.provenance["relaxed"]] == [i for i, _ in b.provenance["relaxed"]]
        assert [s for _, s in a.provenance["relaxed"]] == pytest.approx([s for _, s in b.provenance["relaxed"]],
                                                                         rel=1e-4)
        assert a.stats.span_refused == b.stats.span_refused


def test_provenance_is_off_by_default_and_follows_stop_strings(target):
    V = target.model.config.vocab_size
    pieces = fence_pieces(V)
    prompt = encode(target, PROMPTS[1])
    engine = span_engine(target, SpanConfig((CODE,)), pieces)
    plain = engine.generate_ids(prompt, SamplingParams(max_tokens=30))
    assert plain.provenance is None
    full = engine.generate_ids(prompt, SamplingParams(max_tokens=30, provenance=True))
    assert full.token_ids == plain.token_ids
    # A word piece "wN " occurs in the text only as that token: its first occurrence is
    # where the stop string cuts.
    m = next(i for i in range(len(full.token_ids) // 2, len(full.token_ids))
             if pieces[full.token_ids[i]].startswith("w"))
    stop = pieces[full.token_ids[m]]
    cut = engine.generate_ids(prompt, SamplingParams(max_tokens=30, provenance=True, stop=(stop,)))
    assert cut.finish_reason == "stop" and len(cut.token_ids) <= m + 1 < len(full.token_ids) + 1
    assert len(cut.token_ids) < len(full.token_ids) or m == len(full.token_ids) - 1
    assert cut.provenance["kinds"] == full.provenance["kinds"][: len(cut.token_ids)]
    assert all(i < len(cut.token_ids) for i, _ in cut.provenance["relaxed"])


def test_plain_steps_are_target_tokens(target):
    engine = Engine(target, RowDrafters(lambda: RunnerUpDrafter(target.model, 1)),
                    VerifyConfig("mars", 0.0, "prob-ratio").rule, DraftConfig(kind="none", num_draft_tokens=1))
    res = engine.generate_ids(encode(target, PROMPTS[0]), SamplingParams(max_tokens=12, provenance=True))
    assert res.provenance["kinds"] == TARGET * len(res.token_ids)
    assert res.provenance["relaxed"] == [] and res.provenance["relaxed_share"] == 0.0


def test_spans_cost_nothing_for_strict_rules(target):
    engine = Engine(target, RowDrafters(lambda: RunnerUpDrafter(target.model, 2)), VerifyConfig().rule,
                    DraftConfig(kind="model", model="x", num_draft_tokens=2, adaptive=False),
                    spans=SpanConfig((CODE,)))
    seen = []
    orig = engine._chain_step

    def spy(*args):
        seen.extend(r.seq.spans for r in engine.rows)
        return orig(*args)

    engine._chain_step = spy
    engine.generate_ids(encode(target, PROMPTS[0]), SamplingParams(max_tokens=6))
    assert seen and all(s is None for s in seen)  # no tracker without a relaxed rule or observer


def test_tree_steps_report_provenance_and_respect_spans(target):
    """A tree step through verify_tree: the accepted path's nodes are drafts, then the
    correction or bonus; no relaxed node lies in a span."""
    from marscli.verification.registry import Rule
    from marscli.verification.tree import DraftTree, verify_tree

    V = target.model.config.vocab_size
    pieces = fence_pieces(V)
    tok = PieceTokenizer(pieces)
    tracker = SpanTracker(tok, CODE_ONLY)
    fence = next(i for i in range(V) if pieces[i].startswith("\n```"))
    tracker.commit([fence])  # the committed text opened a code block
    tokens, parents = [5, 6, fence, 8], [-1, 0, 0, 2]
    flags = tracker.tree_flags(tokens, parents)
    assert flags == [True, True, True, False]  # node 3 follows the closing fence
    with torch.no_grad():
        ids = encode(target, PROMPTS[0])
        tree = DraftTree(torch.tensor(tokens), torch.tensor(parents))
        logits, _, _ = slot_tree_forward(target.model, ids[:-1], tree, ids[-1])
    res = verify_tree(tree, logits, rule=Rule("mars", 0.0, "prob-ratio"), guard=torch.tensor(flags))
    for j, i in enumerate(res.path):
        assert not (res.relaxed[j] and flags[i])


def test_cli_generate_provenance_and_strict_in(runner, tiny_model_dir, tmp_path):
    from marscli.cli import app

    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": str(i), "prompt": p}) + "\n" for i, p in enumerate(PROMPTS[:2])))
    base = ["generate", str(src), "--target", str(tiny_model_dir), "--max-tokens", "16", "--token-ids",
            "--verify", "mars", "--theta", "0", "--margin", "prob-ratio", "-k", "3", "--fixed-k", "--no-profile"]
    r = runner.invoke(app, base + ["--provenance", "--strict-in", "code"])
    assert r.exit_code == 0, r.stderr
    lines = [json.loads(x) for x in r.stdout.splitlines() if x.strip()]
    assert len(lines) == 2
    for x in lines:
        p = x["provenance"]
        assert len(p["kinds"]) == x["usage"]["completion_tokens"] == len(x["token_ids"])
        assert p["kinds"].count("r") == len(p["relaxed"]) <= x["spec"]["relaxed"]
        assert x["spec"]["spans"] == {"strict_in": ["code"], "strict_regex": None}
        assert "span_refused" in x["spec"]
    r = runner.invoke(app, base)
    assert r.exit_code == 0, r.stderr
    for x in (json.loads(x) for x in r.stdout.splitlines() if x.strip()):
        assert "provenance" not in x and "spans" not in x["spec"] and "span_refused" not in x["spec"]
    r = runner.invoke(app, base + ["--strict-in", "prose"])
    assert r.exit_code == 2 and "unknown span 'prose'" in r.stderr
    r = runner.invoke(app, base + ["--strict-regex", "(oops"])
    assert r.exit_code == 2 and "--strict-regex" in r.stderr
