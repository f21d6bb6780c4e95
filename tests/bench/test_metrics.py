"""marscli.bench.metrics and marscli.scoring.rouge on hand-made inputs, and the target NLL against a
hand computation."""

from __future__ import annotations

import math

import pytest

from marscli.bench import metrics as m
from marscli.scoring import rouge


@pytest.mark.parametrize("out,ref,exact,share,first", [
    ([1, 2, 3], [1, 2, 3], True, 1.0, None),
    ([1, 2, 3, 4], [1, 2, 9, 4], False, 0.5, 2),
    ([1, 2], [1, 2, 3, 4], False, 0.5, 2),  # a truncated output shares half the longer one
    ([1, 2, 3, 4], [1, 2], False, 0.5, 2),  # symmetric in length
    ([7], [1, 2], False, 0.0, 0),
    ([], [], True, 1.0, None),
    ([], [5], False, 0.0, 0),
])
def test_exact_match_prefix_share_first_mismatch(out, ref, exact, share, first):
    assert m.exact_match(out, ref) is exact
    assert m.prefix_share(out, ref) == pytest.approx(share)
    assert m.first_mismatch(out, ref) == first
    assert m.common_prefix_len(out, ref) == m.common_prefix_len(ref, out)


def test_number_helpers():
    assert m.mean([1, 2, 6]) == 3 and m.mean([]) is None
    assert m.median([5, 1, 3]) == 3 and m.median([]) is None
    assert m.std([2.0, 4.0]) == pytest.approx(math.sqrt(2)) and m.std([1.0]) is None
    assert m.ratio(6, 3) == 2 and m.ratio(1, 0) is None and m.ratio(None, 2) is None
    assert m.rate(10, 2.0) == 5 and m.rate(10, 0.0) is None


def test_steps_by_draft_length():
    # 5 steps: k = 0, 1, 3, 3, 2 -> drafted past position 0: 4 steps, past 1: 3, past 2: 2.
    assert m.steps_by_draft_length([4, 3, 2], 5) == [1, 1, 1, 2]
    assert m.steps_by_draft_length([], 7) == [7]  # plain decoding: K = 0
    assert m.per_position_rates([3, 1, 0], [4, 2, 0]) == [0.75, 0.5, None]


def test_ideal_speedup_by_hand():
    t = [10.0, 11.0, 12.0]  # ms for 1, 2, 3 tokens
    # Every step drafts 2 and emits 3 tokens: tau * t(1) / t(K+1) = 3 * 10 / 12.
    assert m.ideal_speedup([0, 0, 4], 12, t) == pytest.approx(2.5)
    # Mixed: 2 steps of k=0 (1 token each), 2 steps of k=2 (3 tokens each) -> 8 tokens.
    assert m.ideal_speedup([2, 0, 2], 8, t) == pytest.approx(8 * 10 / (2 * 10 + 2 * 12))
    # A draft model costing 1 ms a token: each k=2 step costs 12 + 2.
    assert m.ideal_speedup([0, 0, 4], 12, t, t_draft=1.0) == pytest.approx(120 / 56)
    assert m.ideal_speedup([0, 0, 0], 0, t) is None
    with pytest.raises(ValueError):
        m.ideal_speedup([0, 0, 0, 1], 4, t)


def test_reference_text():
    assert rouge.reference_text({"turns": ["q"], "reference": ["one summary"]}) == "one summary"
    assert rouge.reference_text({"turns": ["q"], "reference": ["step 1", "#### 4"]}) == "step 1\n#### 4"
    assert rouge.reference_text({"turns": ["t1", "t2"], "reference": ["a1", "a2"]}) == "a1"
    assert rouge.reference_text({"turns": ["q"], "reference": "plain"}) == "plain"
    assert rouge.reference_text({"turns": ["q"]}) is None
    assert rouge.reference_text({"turns": ["q"], "reference": [1, 2]}) is None
    assert rouge.reference_text({"turns": ["q"], "reference": []}) is None


def test_rouge_l_by_hand():
    # LCS of words: the, cat, on, mat (4 of 6 each way): P = R = F1 = 2/3.
    assert rouge.rouge_available()
    assert rouge.rouge_l("the cat was on a mat", "the cat sat on the mat") == pytest.approx(2 / 3)
    assert rouge.rouge_l("identical words here", "identical words here") == pytest.approx(1.0)
    assert rouge.rouge_l("nothing shared", "entirely different") == 0.0


def test_completion_nll_matches_a_hand_computation(tiny_model_dir):
    import torch

    from marscli.config import ModelConfig
    from marscli.models.loading import load_model

    target = load_model(ModelConfig(str(tiny_model_dir), dtype="float32", device="cpu"))
    prompt = target.tokenizer("the quick brown fox").input_ids
    completion = target.tokenizer(" jumps over the lazy dog").input_ids + [target.tokenizer.eos_token_id]
    got = m.completion_nll(target.model, prompt, completion)
    assert len(got) == len(completion)
    # By hand: a fresh full forward per token, -log softmax in float64 from the last row.
    for i, tok in enumerate(completion):
        with torch.no_grad():
            z = target.model(torch.tensor([prompt + completion[:i]])).logits[0, -1].double()
        lse = math.log(sum(math.exp(v) for v in z.tolist()))
        assert got[i] == pytest.approx(lse - float(z[tok]), abs=1e-4), i
    assert m.completion_nll(target.model, prompt, []) == []
    with pytest.raises(ValueError):
        m.completion_nll(target.model, [], completion)
