"""The prefix cache and batched prefill (marscli.models.prefill): the radix tree's matches,
splits and eviction on hand-made keys/values; and, on the tiny target, that rows prefilled
together or over a cached prefix decode what they decode alone (strict greedy: transformers'
generate(); relaxed and sampled rows: the engine without a prefix cache, one at a time)."""

from __future__ import annotations

import pytest
import torch

from marscli.config import DraftConfig, SamplingParams, VerifyConfig
from marscli.models.prefill import MIN_SHARED, Prefiller, PrefixCache, shared_prefixes
from tests.engines import RunnerUpDrafter, make_engine
from tests.oracles import hf_greedy

LAYERS, HEADS, DIM = 2, 1, 2


def kv_of(ids: list[int]) -> list:
    """Fake keys/values [1, H, L, D] whose entries encode (layer, token): a match's slices
    must carry exactly the inserted tokens' values."""
    out = []
    for li in range(LAYERS):
        k = torch.tensor([[float(t * 10 + li)] * DIM for t in ids]).view(1, HEADS, len(ids), DIM)
        out.append((k, -k))
    return out


def token_bytes(n: int) -> int:
    return n * LAYERS * 2 * HEADS * DIM * 4


def check(kv, ids: list[int]) -> None:
    want = kv_of(ids)
    for (k, v), (wk, wv) in zip(kv, want):
        assert torch.equal(k, wk) and torch.equal(v, wv)


def test_longest_prefix_match_and_prompts_that_are_prefixes_of_each_other():
    c = PrefixCache(1 << 20)
    c.insert([1, 2, 3, 4], kv_of([1, 2, 3, 4]))
    m, kv, feats = c.match([1, 2, 3, 4, 5, 6])
    assert m == 4 and feats is None
    check(kv, [1, 2, 3, 4])
    m, kv, _ = c.match([1, 2])  # a prompt that is a prefix of a cached one
    assert m == 2
    check(kv, [1, 2])
    assert c.match([9, 1, 2]) == (0, None, None)
    c.insert([1, 2], kv_of([1, 2]))  # nothing new: no node, no bytes
    assert c.nodes == 1 and c.nbytes == token_bytes(4)
    c.insert([1, 2, 7], kv_of([1, 2, 7]))  # parts from [1, 2, 3, 4] after two tokens: a split
    assert c.nodes == 3 and c.nbytes == token_bytes(5)
    m, kv, _ = c.match([1, 2, 7, 7])
    assert m == 3
    check(kv, [1, 2, 7])
    m, kv, _ = c.match([1, 2, 3, 9])
    assert m == 3
    check(kv, [1, 2, 3])
    assert c.lookup([1, 2, 3, 4]) == 4 and c.lookup([5]) == 0


def test_eviction_is_least_recently_used_and_bounded():
    c = PrefixCache(token_bytes(10))
    a, b, d = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
    c.insert(a, kv_of(a))
    c.insert(b, kv_of(b))
    assert c.match(a)[0] == 4  # a is used again: b is now the oldest
    c.insert(d, kv_of(d))  # 12 tokens > 10: one entry goes
    assert c.nbytes <= c.capacity
    assert c.lookup(a) == 4 and c.lookup(d) == 4 and c.lookup(b) == 0
    assert c.evicted_tokens == 4


def test_a_shared_prefix_outlives_its_leaves_and_then_goes():
    c = PrefixCache(token_bytes(12))
    shared = list(range(100, 108))
    c.insert(shared + [1], kv_of(shared + [1]))
    c.insert(shared + [2], kv_of(shared + [2]))  # split: the shared 8 tokens are one node
    assert c.nodes == 3 and c.nbytes == token_bytes(10)
    c.insert([50, 51, 52, 53], kv_of([50, 51, 52, 53]))  # 14 tokens: the two old leaves go first
    assert c.nbytes <= c.capacity
    assert c.lookup(shared + [9]) == 8, "the shared prefix stays while a leaf can go instead"
    c.insert([60, 61, 62, 63, 64, 65, 66, 67, 68, 69], kv_of(list(range(60, 70))))
    assert c.nbytes <= c.capacity and c.lookup(shared) < 8  # with its leaves gone, it goes too
    m, kv, _ = c.match(list(range(60, 70)))
    assert m == 10
    check(kv, list(range(60, 70)))


def test_zero_capacity_is_off():
    c = PrefixCache(0)
    c.insert([1, 2, 3], kv_of([1, 2, 3]))
    assert not c.enabled and c.nodes == 0 and c.match([1, 2, 3]) == (0, None, None)


def test_shared_prefixes_of_joiners():
    c = PrefixCache(1 << 20)
    head = list(range(1, MIN_SHARED + 5))
    prompts = [head + [200], [7, 8, 9], head + [201, 202], head[:3] + [99]]
    assert shared_prefixes(prompts, c) == [head]
    c.insert(head, kv_of(head))
    assert shared_prefixes(prompts, c) == []  # cached already: nothing to compute first
    assert shared_prefixes([[1, 2, 3, 4], [1, 2, 3, 5]], PrefixCache(1 << 20)) == []  # too short to pay


FEWSHOT = ("the quick brown fox jumps over the lazy dog. one two three four five six seven eight "
           "nine ten. hello world, hello marscli; the cat sat on the mat. ")
QUESTIONS = [FEWSHOT + q for q in ("a margin", "the cat", "hello", "one two three", "speculative",
                                   "the quick", "a margin aware rule")]
# prompts that are prefixes of each other, and a duplicate
QUESTIONS += [FEWSHOT, FEWSHOT + "the cat", "a margin", "a margin aware"]


def run_all(engine, target, prompts, samplings):
    got = {}
    for i, res in engine.run(range(len(prompts)), lambda i: (target.tokenizer(prompts[i]).input_ids, samplings[i])):
        assert not isinstance(res, Exception), res
        got[i] = res.token_ids
    return [got[i] for i in range(len(prompts))]


@pytest.mark.parametrize("batch_size", [1, 4, 16])
def test_strict_greedy_over_shared_prefixes_equals_generate(target, oracle, batch_size):
    engine = make_engine(target, "ngram", k=3, batch_size=batch_size)
    samplings = [SamplingParams(max_tokens=6 + 3 * (i % 3)) for i in range(len(QUESTIONS))]
    got = run_all(engine, target, QUESTIONS, samplings)
    for p, s, out in zip(QUESTIONS, samplings, got):
        ids = target.tokenizer(p).input_ids
        assert out == hf_greedy(oracle, ids, s.max_tokens)[: len(out)] and len(out) == s.max_tokens
    assert engine.prefix_tokens_reused > len(QUESTIONS) * 20  # the few-shot part came from the cache
    if batch_size > 1:
        assert engine.prefiller.passes < len(QUESTIONS)


def test_relaxed_and_sampled_text_ignores_who_joined_together_and_the_cache(target):
    """The reproducibility contract: a record's text is the same alone without a prefix
    cache, in a batch of 4 or 16 whose rows joined (and were prefilled) together, and again in
    the same engine once its whole prompt is cached."""
    mars = VerifyConfig("mars", 0.3, "prob-ratio")
    dcfg = DraftConfig(kind="model", model="x", num_draft_tokens=3, adaptive=False)
    prompts = [QUESTIONS[i] for i in (0, 1, 7, 8, 9, 10)]  # shared prefixes, prefixes of each other
    samplings = [SamplingParams(max_tokens=8, temperature=0.9 * (i % 2), seed=40 + i) for i in range(len(prompts))]

    def engine(bs, mib):
        from marscli.drafters.base import RowDrafters
        from marscli.engine.scheduler import Engine
        return Engine(target, RowDrafters(lambda: RunnerUpDrafter(target.model, 3)), mars.rule, dcfg, bs,
                      prefix_cache_mib=mib)

    alone = engine(1, 0)
    ref = [run_all(alone, target, [p], [s])[0] for p, s in zip(prompts, samplings)]
    assert alone.prefix_tokens_reused == 0
    e = engine(4, 64)
    first = run_all(e, target, prompts, samplings)
    reused = e.prefix_tokens_reused
    assert reused > 0
    again = run_all(e, target, prompts, samplings)  # every prompt cached now
    assert first == ref and again == ref
    assert e.prefix_tokens_reused - reused == sum(len(target.tokenizer(p).input_ids) - 1 for p in prompts)


def test_a_prefix_cache_smaller_than_a_prompt_still_decodes(target, oracle):
    engine = make_engine(target, "none", batch_size=4, prefix_cache_mib=0.001)  # ~1 KB: evicts at once
    samplings = [SamplingParams(max_tokens=5)] * 5
    got = run_all(engine, target, QUESTIONS[:5], samplings)
    for p, out in zip(QUESTIONS[:5], got):
        assert out == hf_greedy(oracle, target.tokenizer(p).input_ids, 5)
    assert engine.prefix.nbytes <= engine.prefix.capacity and engine.prefix.evicted_tokens > 0


def test_prefiller_groups_within_the_token_budget(target):
    cache = PrefixCache(0)
    p = Prefiller(target.model, target.device, cache, budget=400)
    prompts = [target.tokenizer(q).input_ids for q in ("a margin", "the cat", "hello", "one two three four five")]
    with torch.inference_mode():
        rows = p.prefill(prompts)
    assert [r.length for r in rows] == [len(x) for x in prompts]
    assert p.passes == 1 and p.tokens == sum(map(len, prompts))
    for x, r in zip(prompts, rows):  # each row's keys/values are its own prompt's, alone
        with torch.inference_mode():
            out = target.model(torch.tensor([x]), use_cache=True)
        for li, layer in enumerate(out.past_key_values.layers):
            torch.testing.assert_close(r.kv[li][0], layer.keys, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(r.kv[li][1], layer.values, atol=1e-5, rtol=1e-5)
    p.budget = 8
    with torch.inference_mode():
        p.prefill(prompts)
    assert p.passes > 2  # the long prompt runs apart


def test_packed_passes_equal_each_prompt_alone(target, monkeypatch):
    """Prompts of different lengths after different cached prefixes, packed into one row with
    no padding: each prompt's keys/values and its last token's logits are those of a plain
    forward of it alone, as the padded pass gives them, each prompt attending over its own
    prefix and rest only (packed_segments); short rests pack (no padding to pay), two long
    equal rests do not (nothing to save)."""
    import marscli.models.fastpath as fastpath

    cache = PrefixCache(1 << 26)
    packed = Prefiller(target.model, target.device, cache, packing=True)
    assert packed.token_cost and packed.pair_cost
    # the CPU's attention takes the pass prompt by prompt (packed_segments), one SDPA call each
    assert packed.segmented
    seen, real_attention, real_sdpa, calls = [], fastpath.cpu_sdpa_forward, fastpath.sdpa, []

    def recorded(module, query, key, value, mask, *a, **kw):
        calls.clear()
        out = real_attention(module, query, key, value, mask, *a, **kw)
        if kw.get("packed_segments"):
            seen.append(kw["packed_segments"])
            assert len(calls) == len(kw["packed_segments"])
        return out

    def counted(*a):
        calls.append(1)
        return real_sdpa(*a)

    monkeypatch.setattr(fastpath, "cpu_sdpa_forward", recorded)
    monkeypatch.setattr(fastpath, "sdpa", counted)
    prompts = [target.tokenizer(q).input_ids for q in
               ("the quick brown fox jumps over the lazy dog", "the quick brown cat", "x y",
                "hello world hello world hello", "the quick brown fox sleeps")]
    with torch.inference_mode():
        packed.prefill([prompts[0]])  # a cached prefix for three of them
        rows = packed.prefill(prompts, logits=True)
    assert packed.padded == 0 and packed.reused > 0
    assert seen and all(len(s) == len(prompts) for s in seen) and any(m for s in seen for _, _, _, m, _ in s)
    for x, r in zip(prompts, rows):
        with torch.inference_mode():
            out = target.model(torch.tensor([x]), use_cache=True)
        assert r.length == len(x)
        torch.testing.assert_close(r.logits, out.logits[0, -1], atol=1e-5, rtol=1e-5)
        for li, layer in enumerate(out.past_key_values.layers):
            torch.testing.assert_close(r.kv[li][0], layer.keys, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(r.kv[li][1], layer.values, atol=1e-5, rtol=1e-5)
    assert packed.packs([0] * 16, [4, 9] * 8)
    assert not packed.packs([0, 0], [600, 600])
    assert not Prefiller(target.model, target.device, cache).packs([0] * 16, [4, 9] * 8)  # packing off


def test_last_logits_without_the_head_hook(target, monkeypatch):
    """A model whose output head the pre-hook does not reach (its logits then cover every
    position) still gives each prompt the logits at its own last token."""
    from contextlib import nullcontext

    import marscli.models.prefill as prefill_mod

    prompts = [target.tokenizer(q).input_ids for q in ("the quick brown fox jumps", "x y", "hello world")]
    monkeypatch.setattr(prefill_mod, "last_positions", lambda *a: nullcontext())
    for packing in (False, True):
        p = Prefiller(target.model, target.device, PrefixCache(0), packing=packing)
        with torch.inference_mode():
            rows = p.prefill(prompts, logits=True)
        for x, r in zip(prompts, rows):
            with torch.inference_mode():
                want = target.model(torch.tensor([x])).logits[0, -1]
            torch.testing.assert_close(r.logits, want, atol=1e-5, rtol=1e-5)
