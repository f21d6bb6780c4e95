"""Tests of draft trees: the tree, the tree step over a slot cache and keeping its path on tiny
random models (marscli.engine.tree_forward, SlotCache.keep_path), and tree verification.

Verification is checked three ways: hand-made logits over a 10-token vocabulary for each branch
(greedy, and sampled over many records' seeds: the walk takes the child that is each row's
draw, else MARS's top-1/top-2 child at a relaxable row); hypothesis against
marscli.verification.chain on chain trees (a chain must give exactly the chain rule's result,
greedy and sampled with the same seed and position), against a plain-Python enumeration of
root-to-leaf paths for greedy MARS on random trees and against the sampled walk written from
verify_tree's docstring; a toy target shows that strict tree sampling emits the same text
whatever the tree; and seeded distribution tests show that strict tree sampling reproduces
the target law, that MARS's follows its own, and that deliberately broken draws fail the
same check.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import marscli.verification.tree as mvt
from marscli.engine.tree_forward import check_tree_support, tree_block
from marscli.verification.chain import sampling_probs, verify
from marscli.verification.draws import coupled_draw, position_keys, uniforms
from marscli.verification.registry import LOGIT_RATIO, PROB_RATIO
from marscli.verification.rules import NOT_RELAXABLE
from marscli.verification.tree import ROOT, DraftTree, verify_tree
from tests.verify_helpers import path_to, rule_from_theta, slot_tree_forward

V = 10
NINF = -math.inf
INF = math.inf

HYP = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


# Tiny tensors only: with a second intra-op thread on a shared CPU, each small op can wait
# milliseconds for it to be scheduled.
pytestmark = pytest.mark.usefixtures("one_thread")


def L(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.long)


def row(spec: dict[int, float], fill: float = -10.0) -> list[float]:
    """One row of V logits: `fill` everywhere except the token ids given in spec."""
    out = [fill] * V
    for tok, z in spec.items():
        out[tok] = z
    return out


def argmax_row(tok: int) -> list[float]:
    return row({tok: 5.0})


def close_call(t1: int, t2: int, ratio: float = 0.9) -> list[float]:
    """A row whose top-1 is t1 (logit 4) and top-2 t2 (logit 4 * ratio): logit ratio `ratio`."""
    return row({t1: 4.0, t2: 4.0 * ratio}, fill=-2.0)


def lg(*rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def tree_of(tokens: list[int], parents: list[int]) -> DraftTree:
    return DraftTree(L(tokens), L(parents))


# ---------------------------------------- the tree

#        root
#      /  |  \
#     0   1   2          (tokens 11 12 13)
#    / \   \
#   3   4   5            (21 22 23)
#  / \       \
# 6   7       8          (31 32 33)
#     |
#     9                  (41)
SAMPLE = tree_of([11, 12, 13, 21, 22, 23, 31, 32, 33, 41], [-1, -1, -1, 0, 0, 1, 3, 3, 5, 7])


def test_tree_structure():
    t = SAMPLE
    assert len(t) == 10
    assert t.depth().tolist() == [1, 1, 1, 2, 2, 2, 3, 3, 3, 4]
    assert t.children(ROOT) == [0, 1, 2]
    assert t.children(0) == [3, 4] and t.children(3) == [6, 7] and t.children(9) == []
    assert t.leaves() == [2, 4, 6, 8, 9]
    assert path_to(t, 9) == [0, 3, 7, 9] and path_to(t, 8) == [1, 5, 8] and path_to(t, 2) == [2]
    assert t.child_lists()[0] == [0, 1, 2] and t.child_lists()[4] == [6, 7]
    anc = t.ancestor_mask()
    assert anc.shape == (11, 11)
    # row of node 9 (index 10) sees the root and nodes 0, 3, 7, 9
    assert anc[10].nonzero().flatten().tolist() == [0, 1, 4, 8, 10]
    assert anc[0].nonzero().flatten().tolist() == [0]


def test_chain_and_empty_tree():
    c = DraftTree.chain([5, 6, 7])
    assert c.parents.tolist() == [ROOT, 0, 1] and c.tokens.tolist() == [5, 6, 7]
    assert c.depth().tolist() == [1, 2, 3] and c.leaves() == [2] and path_to(c, 2) == [0, 1, 2]
    e = DraftTree.chain([])
    assert len(e) == 0 and e.leaves() == [] and e.depth().shape == (0,)
    assert e.children(ROOT) == [] and e.ancestor_mask().tolist() == [[True]]


def test_tree_rejects_bad_parents_and_shapes():
    with pytest.raises(ValueError, match="node 1 has parent 1"):
        tree_of([1, 2], [-1, 1])
    with pytest.raises(ValueError, match="node 0 has parent -2"):
        tree_of([1], [-2])
    with pytest.raises(ValueError, match="node 1 has parent 3"):
        tree_of([1, 2], [-1, 3])
    with pytest.raises(AssertionError, match="parents"):
        DraftTree(L([1, 2]), L([-1]))
    with pytest.raises(AssertionError, match=r"tokens must be \[N\]"):
        DraftTree(L([[1, 2]]), L([[-1, 0]]))


def test_tree_block_by_hand():
    t = tree_of([7, 8, 9], [-1, -1, 0])  # root -> {0: 7 -> {2: 9}, 1: 8}
    ids, pos, block = tree_block(t, root_token=4, past_len=2, device="cpu")
    assert ids.tolist() == [[4, 7, 8, 9]]
    assert pos.tolist() == [[2, 3, 3, 4]]
    assert block.dtype == torch.bool and block[0].int().tolist() == [
        [1, 0, 0, 0],  # root: itself (and the whole past, which the slot cache adds)
        [1, 1, 0, 0],  # node 0: + root
        [1, 0, 1, 0],  # node 1: not its sibling
        [1, 1, 0, 1],  # node 2: root, node 0, itself
    ]


# ---------------------------------------- tiny models

MODEL_VOCAB = 64
MODEL_KW = {
    "vocab_size": MODEL_VOCAB, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}
_MODELS: dict = {}


def tiny(family: str = "llama", impl: str = "sdpa"):
    """A tiny random float32 model, built once per (family, attention implementation)."""
    key = (family, impl)
    if key not in _MODELS:
        import transformers as tf

        config_cls, model_cls, extra = {
            "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, {}),
            "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, {}),
            "gemma": (tf.GemmaConfig, tf.GemmaForCausalLM, {"head_dim": 16}),
            "mistral-sliding": (tf.MistralConfig, tf.MistralForCausalLM, {"sliding_window": 4}),
            "qwen2-sliding": (tf.Qwen2Config, tf.Qwen2ForCausalLM,
                              {"use_sliding_window": True, "sliding_window": 4,
                               "max_window_layers": 1}),
        }[family]
        torch.manual_seed(0)
        config = config_cls(**MODEL_KW, **extra, attn_implementation=impl)
        _MODELS[key] = model_cls(config).to(torch.float32).eval()
    return _MODELS[key]


def plain_logits(model, ids: list[int]) -> torch.Tensor:
    """[T, V] float32 logits of a plain forward over ids, no cache."""
    with torch.no_grad():
        return model(input_ids=L([ids])).logits[0].float()


def prefilled(model, past: list[int]):
    """transformers' own cache holding `past` (the oracle's)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    if past:
        with torch.no_grad():
            model(input_ids=L([past]), past_key_values=cache, use_cache=True)
    return cache


PAST = [3, 14, 15, 9, 26, 5, 35]
ROOT_TOKEN = 8
MODEL_TREE = tree_of([11, 12, 13, 21, 22, 23, 31, 32, 33, 41], SAMPLE.parents.tolist())


@pytest.mark.parametrize(
    ("family", "impl"),
    [("llama", "sdpa"), ("llama", "eager"), ("qwen2", "sdpa"), ("gemma", "eager")],
)
def test_a_tree_step_equals_each_root_path_as_a_sequence(family, impl):
    model = tiny(family, impl)
    t = MODEL_TREE
    with torch.no_grad():
        logits, out, kv = slot_tree_forward(model, PAST, t, ROOT_TOKEN, output_hidden_states=True)
    assert logits.shape == (len(t) + 1, MODEL_VOCAB) and logits.dtype == torch.float32
    base = PAST + [ROOT_TOKEN]
    assert torch.allclose(logits[0], plain_logits(model, base)[-1], atol=1e-4)
    for i in range(len(t)):
        seq = base + [int(t.tokens[j]) for j in path_to(t, i)]
        assert torch.allclose(logits[i + 1], plain_logits(model, seq)[-1], atol=1e-4), i
    # hidden states: embeddings + one per layer, [1, N+1, H]; the last matches a plain forward
    hidden = out.hidden_states
    assert len(hidden) == model.config.num_hidden_layers + 1
    assert hidden[-1].shape == (1, len(t) + 1, model.config.hidden_size)
    seq = base + [int(t.tokens[j]) for j in path_to(t, 9)]
    with torch.no_grad():
        ref = model(input_ids=L([seq]), output_hidden_states=True).hidden_states[-1][0, -1]
    assert torch.allclose(hidden[-1][0, 10], ref, atol=1e-4)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_a_chain_tree_equals_a_normal_forward(impl):
    model = tiny("llama", impl)
    chain = [17, 4, 40, 2]
    with torch.no_grad():
        tree_logits, _, kv = slot_tree_forward(model, PAST, DraftTree.chain(chain), ROOT_TOKEN)
        cache = prefilled(model, PAST)
        normal = model(input_ids=L([[ROOT_TOKEN] + chain]), past_key_values=cache, use_cache=True).logits[0]
    assert torch.allclose(tree_logits, normal, atol=1e-4)
    n = len(PAST) + 1 + len(chain)
    for la, lb in zip(kv.layers(), cache.layers):
        assert torch.allclose(la.kbuf[:1, :, :n], lb.keys, atol=1e-5)
        assert torch.allclose(la.vbuf[:1, :, :n], lb.values, atol=1e-5)


def test_empty_tree_and_empty_past():
    model = tiny()
    with torch.no_grad():
        logits, _, _ = slot_tree_forward(model, [], DraftTree.chain([]), ROOT_TOKEN)
    assert logits.shape == (1, MODEL_VOCAB)
    assert torch.allclose(logits[0], plain_logits(model, [ROOT_TOKEN])[-1], atol=1e-4)


@pytest.mark.parametrize("path", [[1, 5, 8], [0, 3, 7, 9], [0, 4], [2], []])
def test_keeping_a_path_then_decoding_equals_a_fresh_forward(path):
    model = tiny()
    t = MODEL_TREE
    with torch.inference_mode():  # as the engine fills its cache: keep_path writes in place
        _, _, kv = slot_tree_forward(model, PAST, t, ROOT_TOKEN)
        kv.keep_path(0, path)
        kept = len(PAST) + 1 + len(path)
        assert kv.lengths == [kept]
        accepted = PAST + [ROOT_TOKEN] + [int(t.tokens[i]) for i in path]
        nxt = 50
        step = kv.forward(L([[nxt]]), None, L([[kept]])).logits[0, -1]
        kv.commit(None, [1])
    assert torch.allclose(step, plain_logits(model, accepted + [nxt])[-1], atol=1e-4)
    # and the next step's tree sees the kept past as a plain prefix
    t2 = tree_of([6, 7, 60], [-1, -1, 0])
    with torch.inference_mode():
        ids, pos, block = tree_block(t2, 44, kept + 1, "cpu")
        logits = kv.forward(ids, None, pos, block=block).logits[0].float()
    for i in range(len(t2)):
        seq = accepted + [nxt, 44] + [int(t2.tokens[j]) for j in path_to(t2, i)]
        assert torch.allclose(logits[i + 1], plain_logits(model, seq)[-1], atol=1e-4)


@pytest.mark.parametrize("family", ["mistral-sliding", "qwen2-sliding"])
def test_sliding_window_models_are_refused(family):
    model = tiny(family)
    with pytest.raises(ValueError, match="not supported for models with sliding-window"):
        check_tree_support(model)


def test_unsupported_attention_implementation_is_refused():
    model = tiny()
    saved = model.config._attn_implementation
    try:
        model.config._attn_implementation = "flash_attention_2"
        with pytest.raises(ValueError, match="attn_implementation"):
            check_tree_support(model)
    finally:
        model.config._attn_implementation = saved
    check_tree_support(model)


# ---------------------------------------- greedy: hand-made cases


def test_strict_greedy_follows_the_argmax_through_siblings():
    # root -> {0: 3, 1: 5}; 0 -> {2: 7}; 1 -> {3: 2}; 3 is a leaf
    t = tree_of([3, 5, 7, 2], [-1, -1, 0, 1])
    logits = lg(argmax_row(5), argmax_row(7), argmax_row(2), argmax_row(9), argmax_row(6))
    r = verify_tree(t, logits, rule=rule_from_theta(INF))
    assert r.path == [1, 3] and r.relaxed == [False, False]
    assert r.next_token == 6  # bonus: argmax at the leaf's row
    assert r.emitted(t) == [5, 2, 6] and r.num_accepted == 2
    assert not r.relaxable.any()
    # correction: the root row's argmax is no child
    logits[0] = torch.tensor(argmax_row(8))
    r = verify_tree(t, logits, rule=rule_from_theta(INF))
    assert r.path == [] and r.next_token == 8
    # correction below an accepted node
    logits[0] = torch.tensor(argmax_row(3))
    r = verify_tree(t, logits, rule=rule_from_theta(INF))
    assert r.path == [0, 2] and r.emitted(t) == [3, 7, 9]  # node 2 is a leaf: bonus
    logits[1] = torch.tensor(argmax_row(4))
    r = verify_tree(t, logits, rule=rule_from_theta(INF))
    assert r.path == [0] and r.emitted(t) == [3, 4]  # correction at node 0's row


def test_strict_greedy_duplicate_siblings_take_the_longer_path():
    # both root children hold token 5; only the second one's child matches
    t = tree_of([5, 5, 1, 2], [-1, -1, 0, 1])
    logits = lg(argmax_row(5), argmax_row(7), argmax_row(2), argmax_row(9), argmax_row(4))
    r = verify_tree(t, logits, rule=rule_from_theta(INF))
    assert r.path == [1, 3] and r.next_token == 4


def test_mars_greedy_takes_the_longest_ok_path():
    # root row: close call 2 (top-1) vs 3 (top-2). Node 0 = 2 (exact) dead-ends; node 1 = 3
    # (relaxed) goes two exact nodes further.
    t = tree_of([2, 3, 9, 4, 6], [-1, -1, 0, 1, 3])
    logits = lg(close_call(2, 3), argmax_row(1), argmax_row(4), argmax_row(0), argmax_row(6),
                argmax_row(8))
    r = verify_tree(t, logits, rule=rule_from_theta(0.5))
    assert r.path == [1, 3, 4] and r.relaxed == [True, False, False] and r.next_token == 8
    assert r.relaxable.tolist() == [True] + [False] * 5
    assert r.statistic[0].item() == pytest.approx(0.9)
    # strict: only node 0 is ok; its row's argmax is the correction
    r = verify_tree(t, logits, rule=rule_from_theta(INF))
    assert r.path == [0] and r.next_token == 1 and r.relaxed == [False]
    # the statistic is reported under strict verification too (all rows, any theta)
    assert r.statistic[0].item() == pytest.approx(0.9) and not r.relaxable.any()


def test_mars_greedy_ties_prefer_fewer_relaxed_then_first_path():
    # node 0 = top-2 (relaxed), node 1 = top-1: same length, node 1 has no relaxed node
    t = tree_of([3, 2], [-1, -1])
    logits = lg(close_call(2, 3), argmax_row(7), argmax_row(8))
    r = verify_tree(t, logits, rule=rule_from_theta(0.5))
    assert r.path == [1] and r.relaxed == [False] and r.next_token == 8
    # two paths of length 2 with one relaxed node each: the first in depth-first order wins,
    # even though its last node has the larger index
    #   root -> {0: 2 (exact), 1: 3 (relaxed)}; 0 -> {3: 6 (relaxed)}; 1 -> {2: 5 (exact)}
    t = tree_of([2, 3, 5, 6], [-1, -1, 1, 0])
    logits = lg(close_call(2, 3), close_call(5, 6), argmax_row(5), argmax_row(1), argmax_row(0))
    r = verify_tree(t, logits, rule=rule_from_theta(0.5))
    assert r.path == [0, 3] and r.relaxed == [False, True] and r.next_token == 0
    # remove node 3's relaxation: node 0's path is now exact and still first
    r = verify_tree(t, logits, rule=rule_from_theta(0.95))
    assert r.path == [0] and r.next_token == 5


def test_mars_greedy_z1_non_positive_and_neg_inf_rows():
    # z1 <= 0: never relaxable under logit-ratio, relaxable under prob-ratio
    t = tree_of([3], [-1])
    logits = lg(row({2: -1.0, 3: -1.05}, fill=-20.0), argmax_row(8))
    r = verify_tree(t, logits, rule=rule_from_theta(NINF, LOGIT_RATIO))
    assert r.path == [] and r.next_token == 2 and r.statistic[0].item() == NOT_RELAXABLE
    r = verify_tree(t, logits, rule=rule_from_theta(0.5, PROB_RATIO))
    assert r.path == [0] and r.relaxed == [True] and r.next_token == 8
    # a single finite logit: the -inf draft is never accepted
    t = tree_of([0, 5], [-1, -1])
    logits = lg(row({2: 2.0}, fill=NINF), argmax_row(8), argmax_row(8))
    r = verify_tree(t, logits, rule=rule_from_theta(NINF))
    assert r.path == [] and r.next_token == 2


# ---------------------------------------- sampling: hand-made cases

P_ROOT = [0.06, 0.30, 0.25, 0.20, 0.10, 0.05, 0.02, 0.01, 0.005, 0.005]
P_FLAT = [0.1] * V
SEEDS = range(200)


def plogits(*ps) -> torch.Tensor:
    return torch.log(torch.tensor(ps, dtype=torch.float64)).float()


def draw_at(logits_row: torch.Tensor, seed: int, position: int, temperature: float = 1.0, top_k: int = 0,
            top_p: float = 1.0) -> int:
    """The draw of output position `position` from a row's sampling law (the record's seed)."""
    p = sampling_probs(logits_row.unsqueeze(0), temperature, top_k, top_p)
    return int(coupled_draw(p, position_keys(torch.tensor([seed]), torch.tensor([position])))[0])


def sample_tree(t, logits, seed, position=0, **kw):
    return verify_tree(t, logits, temperature=kw.pop("temperature", 1.0),
                       rule=rule_from_theta(kw.pop("theta", INF), kw.pop("margin", LOGIT_RATIO)),
                       seed=seed, position=position, **kw)


def test_strict_sampling_accepts_the_child_that_is_the_draw():
    """Strict: at a row the child that is its position's draw is accepted, whichever sibling
    it is; when no child is, the walk ends and emits the draw. A leaf's next token is its
    row's draw, for the next position. So a row accepts with probability the p-mass of its
    children (0.75 here), more than any single child."""
    t = tree_of([1, 2, 3], [-1, -1, -1])
    logits = plogits(P_ROOT, P_FLAT, P_FLAT, P_FLAT)
    hits = 0
    for s in SEEDS:
        d0 = draw_at(logits[0], s, 5)
        r = sample_tree(t, logits, s, 5)
        if d0 in (1, 2, 3):
            hits += 1
            node = d0 - 1
            assert r.path == [node] and r.relaxed == [False]
            assert r.next_token == draw_at(logits[node + 1], s, 6)
        else:
            assert r.path == [] and r.next_token == d0
    assert not r.relaxable.any()
    n = len(SEEDS)
    assert abs(hits / n - 0.75) < 5 * math.sqrt(0.75 * 0.25 / n) and hits < n


def test_strict_sampling_walks_down_the_draws():
    """Row r judges output position `position + depth(r)`: the walk follows the draws down
    the tree and emits them; a child of probability 0 is never accepted."""
    # root -> {0: 1 -> {2: 4, 3: 0}, 1: 2}
    t = tree_of([1, 2, 4, 0], [-1, -1, 0, 0])
    p_row1 = [0.5, 0.0, 0.0, 0.0, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0]
    logits = plogits(P_ROOT, p_row1, P_FLAT, P_FLAT, P_FLAT)
    paths = set()
    for s in SEEDS:
        r = sample_tree(t, logits, s, 40)
        d0 = draw_at(logits[0], s, 40)
        if d0 == 1:  # node 0; row 1's law is {0, 4}: one of its children is always the draw
            d1 = draw_at(logits[1], s, 41)
            node = 2 if d1 == 4 else 3
            assert r.path == [0, node] and r.emitted(t) == [1, d1, draw_at(logits[node + 1], s, 42)]
        elif d0 == 2:
            assert r.path == [1] and r.emitted(t) == [2, draw_at(logits[2], s, 41)]
        else:
            assert r.path == [] and r.emitted(t) == [d0]
        paths.add(tuple(r.path))
    assert paths == {(0, 2), (0, 3), (1,), ()}
    # token 5 has p = 0 under node 0: never accepted, whatever the seed
    t = tree_of([1, 5], [-1, 0])
    for s in SEEDS:
        r = sample_tree(t, plogits(P_ROOT, p_row1, P_FLAT), s, 40)
        assert 1 not in r.path and r.next_token in ((0, 4) if r.path else tuple(range(V)))


def test_mars_sampling_branches():
    close = close_call(1, 3, ratio=0.95)  # logit ratio 0.95 between tokens 1 and 3
    flat = row({6: 1.0}, fill=0.0)  # logit ratio 0: never relaxable

    def logits_for(t):
        return lg(close, *[flat] * len(t))

    d0 = {s: draw_at(lg(close)[0], s, 0) for s in SEEDS}
    d1 = {s: draw_at(lg(flat)[0], s, 1) for s in SEEDS}
    assert {1, 3, 4} <= set(d0.values()) and len(set(d0.values())) > 3  # every branch below is taken
    for s in SEEDS:
        # children [4, 3, 1]: the child that is the draw (strict), else the top-1 (relaxed)
        t = tree_of([4, 3, 1], [-1, -1, -1])
        r = sample_tree(t, logits_for(t), s, theta=0.9)
        want = ([[4, 3, 1].index(d0[s])], [False]) if d0[s] in (4, 3, 1) else ([2], [True])
        assert (r.path, r.relaxed) == want, s
        assert r.next_token == d1[s]
        assert r.relaxable.tolist() == [True, False, False, False]
        # ... judged strictly when the budget is spent or a child is guarded
        for kw in (dict(relax_left=0), dict(guard=torch.tensor([False, False, True]))):
            r = sample_tree(t, logits_for(t), s, theta=0.9, **kw)
            assert r.path == ([[4, 3, 1].index(d0[s])] if d0[s] in (4, 3, 1) else []) and not any(r.relaxed)
        # no top-1 child: the top-2 child
        t = tree_of([4, 3], [-1, -1])
        r = sample_tree(t, logits_for(t), s, theta=0.9)
        assert (r.path, r.relaxed) == (([0], [False]) if d0[s] == 4 else ([1], [d0[s] != 3])), s
        # neither: the draw's child, else the walk ends with the draw (as strict does)
        t = tree_of([4, 0], [-1, -1])
        for theta in (0.9, INF):
            r = sample_tree(t, logits_for(t), s, theta=theta)
            assert r.emitted(t) == ([d0[s], d1[s]] if d0[s] in (4, 0) else [d0[s]]) and not any(r.relaxed)
        # not relaxable (theta above the statistic): the top-2 child only as the draw
        t = tree_of([3], [-1])
        r = sample_tree(t, logits_for(t), s, theta=0.96)
        assert r.path == ([0] if d0[s] == 3 else []) and not r.relaxable.any()
        # top-2 filtered out by top-k: never accepted, even at a relaxable row
        r = sample_tree(t, logits_for(t), s, theta=0.9, top_k=1)
        assert r.path == [] and r.next_token == 1 and bool(r.relaxable[0])
        # below a relaxed node, a non-relaxable row stays strict
        t = tree_of([3, 6], [-1, 0])
        r = sample_tree(t, logits_for(t), s, theta=0.9)
        assert r.path[0] == 0 and r.relaxed[0] == (d0[s] != 3)
        assert r.path == ([0, 1] if d1[s] == 6 else [0]) and r.relaxed[1:] == [False] * (len(r.path) - 1)


def test_sampling_needs_the_records_seed_and_position():
    t = tree_of([1, 2], [-1, -1])
    logits = plogits(P_ROOT, P_FLAT, P_FLAT)
    with pytest.raises(AssertionError, match="seed and position"):
        verify_tree(t, logits, rule=rule_from_theta(INF), temperature=1.0)
    with pytest.raises(AssertionError, match="seed and position"):
        verify_tree(t, logits, rule=rule_from_theta(0.5), temperature=1.0, seed=3)
    with pytest.raises(AssertionError, match="seed and position"):
        verify_tree(t, logits, rule=rule_from_theta(INF), temperature=1.0, position=3)
    with pytest.raises(AssertionError, match=r"logits must be \[N\+1, V\]"):
        verify_tree(t, logits[:2], rule=rule_from_theta(INF))
    r = verify_tree(t, logits, rule=rule_from_theta(INF), temperature=1.0, seed=0, position=0)
    assert r.emitted(t)[0] == draw_at(logits[0], 0, 0)


# ---------------------------------------- chain trees equal marscli.verification.chain

grid_logit = st.sampled_from([-3.0, -2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0])
any_logit = st.one_of(grid_logit, grid_logit, grid_logit, st.floats(-6, 6, width=32),
                      st.just(NINF))
finite_row = st.lists(any_logit, min_size=V, max_size=V).filter(
    lambda r: any(math.isfinite(z) for z in r))


def pick_tokens(draw, rows: torch.Tensor, n: int) -> list[int]:
    """n draft tokens, biased to the top-1/top-2 of the given rows so acceptance is common."""
    from marscli.verification.rules import top2

    _, _, t1, t2 = top2(rows) if n else (None, None, L([]), L([]))
    out = []
    for i in range(n):
        c = draw(st.integers(0, V + 2))
        out.append(int(t1[i]) if c >= V + 1 else int(t2[i]) if c == V else c)
    return out


@st.composite
def chain_case(draw):
    K = draw(st.integers(0, 4))
    logits = torch.tensor(draw(st.lists(finite_row, min_size=K + 1, max_size=K + 1)),
                          dtype=torch.float32)
    drafts = pick_tokens(draw, logits[:K], K)
    params = {
        "theta": draw(st.sampled_from([INF, -0.5, 0.0, 0.3, 0.6, 0.9, 1.0])),
        "margin": draw(st.sampled_from([LOGIT_RATIO, PROB_RATIO])),
        "temperature": draw(st.sampled_from([0.0, 0.0, 0.5, 1.0, 2.0])),
        "top_k": draw(st.sampled_from([0, 1, 2, 3, V])),
        "top_p": draw(st.sampled_from([1.0, 0.9, 0.5, 0.2])),
    }
    seed = draw(st.integers(0, 2**62))
    position = draw(st.integers(0, 10**6))
    if params["temperature"] > 0 and K and draw(st.booleans()):
        # drafts that are the positions' draws now and then, so that strict acceptance is common
        p = sampling_probs(logits, params["temperature"], params["top_k"], params["top_p"])
        draws = coupled_draw(p[:K], position_keys(torch.full((K,), seed), position + torch.arange(K)))
        keep = draw(st.lists(st.booleans(), min_size=K, max_size=K))
        drafts = [int(draws[i]) if k else x for i, (x, k) in enumerate(zip(drafts, keep))]
    guard = draw(st.lists(st.booleans(), min_size=K, max_size=K)) if draw(st.booleans()) else None
    relax_left = draw(st.sampled_from([None, None, 0, 1, 2]))
    return drafts, logits, seed, position, params, guard, relax_left


@HYP
@given(chain_case())
def test_property_chain_tree_equals_chain_verify(case):
    """A tree that is one chain is verified as that chain: same accepted nodes, next token,
    relaxed flags, statistic and relaxable rows (sampled: the same seed and position, the
    chain's position j and the tree's row j sharing their draw), with the loop guard on some
    nodes (the chain's positions) and a relaxation budget."""
    drafts, logits, seed, position, params, guard, relax_left = case
    sampling = params["temperature"] > 0
    kw = dict(params) if sampling else {k: params[k] for k in ("theta", "margin")}
    kw["rule"] = rule_from_theta(kw.pop("theta"), kw.pop("margin"))
    K = len(drafts)
    chain = verify(L([drafts]).view(1, K), logits.unsqueeze(0), **kw,
                   guard=None if guard is None else torch.tensor([guard], dtype=torch.bool).view(1, K),
                   relax_left=None if relax_left is None else L([relax_left]),
                   **({"seeds": L([seed]), "positions": L([position])} if sampling else {}))
    r = verify_tree(DraftTree.chain(drafts), logits, **kw,
                    guard=None if guard is None else torch.tensor(guard, dtype=torch.bool).view(K),
                    relax_left=relax_left, **({"seed": seed, "position": position} if sampling else {}))
    n = int(chain.num_accepted[0])
    assert r.path == list(range(n))
    assert r.next_token == int(chain.next_token[0])
    assert r.relaxed == chain.relaxed[0, :n].tolist()
    assert not chain.relaxed[0, n:].any()
    if not math.isinf(params["theta"]):  # strict reports no statistic; the tree always does
        assert torch.equal(r.statistic, chain.statistic[0])
    if relax_left is None:  # the chain's relaxable flags count the budget, the tree's rows do not
        assert torch.equal(r.relaxable, chain.relaxable[0])  # [K+1] both: the drafts, then the row after
    assert sum(r.relaxed) <= (K if relax_left is None else relax_left)
    assert not bool(r.relaxable[K])  # the last row scores no draft (and the chain had no bonus)
    assert r.statistic.shape == (K + 1,) and r.relaxable.shape == (K + 1,)


# ---------------------------------------- random trees: greedy MARS against a reference


def ref_top2(z: list[float]) -> tuple[int, int, float, float]:
    t1 = max(range(V), key=lambda i: (z[i], -i))
    t2 = max((i for i in range(V) if i != t1), key=lambda i: (z[i], -i))
    return t1, t2, z[t1], z[t2]


def ref_relaxable(z: list[float], theta: float, margin: str) -> bool:
    _, _, z1, z2 = ref_top2(z)
    a, b = torch.tensor(z1), torch.tensor(z2)
    if margin == LOGIT_RATIO:
        stat = float(b / a) if z1 > 0 else NOT_RELAXABLE
    else:
        stat = float(torch.exp(b - a)) if math.isfinite(z1) else 0.0
    stat = NOT_RELAXABLE if math.isnan(stat) else stat
    return stat > theta


def ref_tree_greedy(tokens, parents, logits, theta, margin):
    """The paper's rule on every root-to-leaf path; the longest accepted prefix wins (ties:
    fewer relaxed nodes, then the candidate path that comes first in lexicographic order of
    node indices, i.e. depth-first with children in index order)."""
    n = len(tokens)

    def path_to_(i):
        out = []
        while i != -1:
            out.append(i)
            i = parents[i]
        return out[::-1]

    leaves = [i for i in range(n) if i not in parents]
    candidates = sorted(path_to_(leaf) for leaf in leaves)
    best, best_key = ([], []), (0, 0)
    for cand in candidates:
        acc, flags = [], []
        for node in cand:
            z = logits[parents[node] + 1]
            t1, t2, _, _ = ref_top2(z)
            if tokens[node] == t1:
                flags.append(False)
            elif tokens[node] == t2 and ref_relaxable(z, theta, margin):
                flags.append(True)
            else:
                break
            acc.append(node)
        key = (len(acc), -sum(flags))
        if key > best_key:
            best, best_key = (acc, flags), key
    path, flags = best
    last_row = path[-1] + 1 if path else 0
    return path, flags, ref_top2(logits[last_row])[0]


@st.composite
def tree_case(draw, finite: bool = False):
    n = draw(st.integers(0, 10))
    parents = [draw(st.integers(-1, i - 1)) for i in range(n)]
    rows = finite_row if finite else st.lists(any_logit, min_size=V, max_size=V)
    logits = torch.tensor(draw(st.lists(rows, min_size=n + 1, max_size=n + 1)),
                          dtype=torch.float32)
    tokens = pick_tokens(draw, logits[[p + 1 for p in parents]], n) if n else []
    return tree_of(tokens, parents), logits


@HYP
@given(tree_case(), st.sampled_from([INF, -0.5, 0.0, 0.3, 0.5, 0.7, 0.9, 1.0]),
       st.sampled_from([LOGIT_RATIO, PROB_RATIO]))
def test_property_mars_greedy_tree_matches_reference(case, theta, margin):
    t, logits = case
    r = verify_tree(t, logits, rule=rule_from_theta(theta, margin))
    path, flags, nxt = ref_tree_greedy(t.tokens.tolist(), t.parents.tolist(), logits.tolist(),
                                       theta, margin)
    assert (r.path, r.relaxed, r.next_token) == (path, flags, nxt)
    # the path is a root path
    if r.path:
        assert path_to(t, r.path[-1]) == r.path
    # every emitted token after an exact node is the target's greedy choice; under strict
    # verification the whole step is the target's own greedy continuation
    rows = [0] + [i + 1 for i in r.path]
    emitted = r.emitted(t)
    for k, (rw, tok) in enumerate(zip(rows, emitted)):
        if k == len(r.path) or not r.relaxed[k]:
            assert tok == int(logits[rw].argmax())
    if math.isinf(theta):
        assert not any(r.relaxed) and not r.relaxable.any()
    # a lower threshold never accepts less
    if not math.isinf(theta):
        strict = verify_tree(t, logits, rule=rule_from_theta(INF, margin))
        assert len(r.path) >= len(strict.path)


def ref_tree_sampling(tokens, parents, logits, *, seed, position, theta, margin, temperature, top_k):
    """The sampled walk written from verify_tree's docstring (strict/MARS): from the root, at
    each row the target's token is the draw of output position `position + depth(row)`; the
    first child that is the draw is accepted (strict); else, at a relaxable row, the first
    child that is the top-1 (else the top-2) with p > 0 (relaxed); else the walk ends and
    emits the draw (a leaf: its row's draw)."""
    kids = [[] for _ in range(len(tokens) + 1)]
    for i, par in enumerate(parents):
        kids[par + 1].append(i)
    p = sampling_probs(logits, temperature, top_k)
    path, relaxed, row, depth = [], [], 0, 0
    while True:
        d = draw_at(logits[row], seed, position + depth, temperature, top_k)
        child = next((c for c in kids[row] if tokens[c] == d), None)
        was_relaxed = False
        if child is None and kids[row] and ref_relaxable(logits[row].tolist(), theta, margin):
            t1, t2, _, _ = ref_top2(logits[row].tolist())
            for want in (t1, t2):
                child = next((c for c in kids[row] if tokens[c] == want and float(p[row, want]) > 0), None)
                if child is not None:
                    was_relaxed = True
                    break
        if child is None:
            return path, relaxed, d
        path.append(child)
        relaxed.append(was_relaxed)
        row, depth = child + 1, depth + 1


@HYP
@given(tree_case(finite=True), st.sampled_from([INF, 0.0, 0.5, 0.9]),
       st.sampled_from([LOGIT_RATIO, PROB_RATIO]), st.sampled_from([0.5, 1.0]),
       st.sampled_from([0, 2]), st.integers(0, 2**62), st.integers(0, 10**6))
def test_property_sampling_tree_matches_the_reference_walk(case, theta, margin, temperature, top_k, seed, position):
    t, logits = case
    r = verify_tree(t, logits, rule=rule_from_theta(theta, margin), temperature=temperature,
                    top_k=top_k, seed=seed, position=position)
    path, relaxed, nxt = ref_tree_sampling(t.tokens.tolist(), t.parents.tolist(), logits, seed=seed,
                                           position=position, theta=theta, margin=margin,
                                           temperature=temperature, top_k=top_k)
    assert (r.path, r.relaxed, r.next_token) == (path, relaxed, nxt)
    p = sampling_probs(logits, temperature, top_k)
    if r.path:
        assert path_to(t, r.path[-1]) == r.path
    rows = [0] + [i + 1 for i in r.path]
    for rw, tok in zip(rows, r.emitted(t)):
        assert float(p[rw, tok]) > 0  # nothing the target could not sample
    for node, was_relaxed in zip(r.path, r.relaxed):
        assert not was_relaxed or bool(r.relaxable[int(t.parents[node]) + 1])
    if math.isinf(theta):  # strict: the emitted tokens are the draws along the walk, in order
        assert not any(r.relaxed)
        assert r.emitted(t) == [draw_at(logits[rw], seed, position + k, temperature, top_k)
                                for k, rw in enumerate(rows)]


def world(prefix: tuple[int, ...]) -> torch.Tensor:
    """A toy target: logits [V], a fixed random function of the text so far."""
    g = torch.Generator().manual_seed(hash(prefix) % (2**31))
    return torch.randn(V, generator=g) * 2.0


def test_strict_tree_sampling_emits_the_same_text_whatever_the_tree():
    """Drafter invariance for trees: the rows' logits are the toy target's at each node's
    text, and strict sampling emits a prefix of the text strict sampling produces position
    by position (each position's draw), with any tree; as long a prefix as the tree holds."""
    rng = random.Random(0)
    lengths = set()
    for case in range(25):
        seed, position, prompt = case, 13 * case, (case, 1)
        text: list[int] = []
        for k in range(12):
            text.append(draw_at(world(prompt + tuple(text)), seed, position + k))
        for _ in range(4):
            n = rng.randrange(0, 11)
            parents = [rng.randrange(-1, i) for i in range(n)]
            depth = [0] * n
            for i, par in enumerate(parents):
                depth[i] = 1 if par == -1 else depth[par] + 1
            tokens = [text[depth[i] - 1] if rng.random() < 0.6 else rng.randrange(V) for i in range(n)]
            t = tree_of(tokens, parents)
            rows = [world(prompt)] + [world(prompt + tuple(tokens[j] for j in path_to(t, i))) for i in range(n)]
            r = verify_tree(t, torch.stack(rows), rule=rule_from_theta(INF), temperature=1.0, seed=seed,
                            position=position)
            emitted = r.emitted(t)
            assert emitted == text[: len(emitted)], (case, tokens, parents)
            # the walk goes as deep as the tree follows the text (the first such child at each row)
            kids, row, deep = t.child_lists(), 0, 0
            while (c := next((c for c in kids[row] if tokens[c] == text[deep]), None)) is not None:
                row, deep = c + 1, deep + 1
            assert len(r.path) == deep
            lengths.add(deep)
    assert len(lengths) >= 3  # trees of several depths along the text were walked


# ---------------------------------------- distribution

P_TARGET = torch.tensor([0.04, 0.35, 0.03, 0.25, 0.05, 0.04, 0.15, 0.03, 0.04, 0.02])
TARGET_LOGITS = torch.log(P_TARGET)
# three root children (the drafter's top-3 guesses), the first one with a child of its own
DIST_TREE = tree_of([1, 3, 6, 2], [-1, -1, -1, 0])
DIST_LOGITS = TARGET_LOGITS.unsqueeze(0).expand(len(DIST_TREE) + 1, -1).contiguous()


def tv(tokens: list[int], p: torch.Tensor) -> float:
    freq = torch.bincount(L(tokens), minlength=p.numel()).double() / len(tokens)
    return 0.5 * float((freq - p.double()).abs().sum())


def tv_bound(n: int, v: int = V) -> float:
    """An exact sampler's TV stays under this (E[TV] <= 0.5 sqrt(V/N), McDiarmid on top)."""
    return 1.5 * math.sqrt(v / n)


def fits(tokens: list[int], law: torch.Tensor) -> bool:
    """A chi-square test of `law` at about the 0.9999 level (cells expecting fewer than 5
    tokens pooled); a token outside the law's support fails outright."""
    cnt = torch.bincount(L(tokens), minlength=law.numel()).double()
    law = law.double()
    if bool((cnt[law <= 0] > 0).any()):
        return False
    exp = law * len(tokens)
    big = exp >= 5
    obs = torch.cat([cnt[big], cnt[~big].sum().view(1)])
    want = torch.cat([exp[big], exp[~big].sum().view(1)])
    keep = want > 0
    chi = float(((obs[keep] - want[keep]) ** 2 / want[keep]).sum())
    dof = int(keep.sum()) - 1
    return chi < dof + 4.0 * math.sqrt(2.0 * dof) + 10.0


def walk_tokens(n: int, seed: int, theta: float = INF, **kw) -> tuple[list[int], list[int]]:
    """The first token each of n records (seeds seed * 100_003 + i) emits from DIST_TREE, and
    the second token of those whose walk accepted node 0 (token 1)."""
    first, second = [], []
    for i in range(n):
        r = verify_tree(DIST_TREE, DIST_LOGITS, rule=rule_from_theta(theta), temperature=1.0,
                        seed=seed * 100_003 + i, position=17, **kw)
        out = r.emitted(DIST_TREE)
        first.append(out[0])
        if r.path[:1] == [0]:
            second.append(out[1])
    return first, second


def test_strict_tree_sampling_reproduces_target():
    n = 6_000
    first, second = walk_tokens(n, seed=7)
    assert fits(first, P_TARGET)
    # prefixes of one run: TV under the exact-sampler bound at each size, and shrinking
    tvs = [tv(first[:m], P_TARGET) for m in (n // 16, n // 4, n)]
    for m, t in zip((n // 16, n // 4, n), tvs):
        assert t < tv_bound(m), (m, t)
    assert tvs[-1] < tvs[0] / 2, tvs  # ~ 1/sqrt(N): expected ratio 4
    # below node 0 the next position has the row's law too (its own draw, not the root's)
    assert len(second) > 1500 and fits(second, P_TARGET)
    # with filtering: the filtered law, and nothing outside it
    p3 = sampling_probs(TARGET_LOGITS, 1.0, top_k=3)
    first, _ = walk_tokens(3_000, seed=8, top_k=3)
    assert fits(first, p3)


def test_negative_control_a_draw_that_ignores_the_filters_fails(monkeypatch):
    real = mvt.sampling_probs
    p3 = sampling_probs(TARGET_LOGITS, 1.0, top_k=3)
    unfiltered = lambda logits, temperature, top_k=0, top_p=1.0: real(logits, temperature)  # noqa: E731
    monkeypatch.setattr(mvt, "sampling_probs", unfiltered)
    first, _ = walk_tokens(3_000, seed=8, top_k=3)
    assert not fits(first, p3)


def test_negative_control_noise_that_is_not_gumbel_fails(monkeypatch):
    """argmax(log p + U) with uniform U favours the likely tokens: not a draw from p."""
    def broken(probs, keys, token_ids=None):
        idx = torch.arange(probs.shape[1]).view(1, -1)
        return (torch.log(probs.double()) + uniforms(keys.view(-1, 1), idx)).argmax(-1)

    monkeypatch.setattr(mvt, "coupled_draw", broken)
    first, _ = walk_tokens(3_000, seed=7)
    assert not fits(first, P_TARGET)


def test_negative_control_rows_drawn_at_the_roots_position_fail(monkeypatch):
    """Each row must draw at its own output position: with the root's noise at every depth
    and one law everywhere, node 0 accepted (the draw was 1) would be followed by 1 again."""
    real = mvt.position_keys
    monkeypatch.setattr(mvt, "position_keys", lambda seeds, positions: real(seeds, torch.full_like(positions, 17)))
    _, second = walk_tokens(3_000, seed=7)
    assert len(second) > 500 and not fits(second, P_TARGET)


def test_mars_tree_sampling_follows_its_analytic_law():
    """MARS at a relaxable root with children [4, 3] (3 the top-2, no top-1 child): the first
    token is 4 where the draw is 4, else 3 (the draw or the relaxed top-2): law p(4) on 4,
    1 - p(4) on 3; the check tells it from p, and strict on the same tree gives p."""
    close = torch.tensor(row({1: 4.0, 3: 3.8, 4: 3.0}, fill=0.0))  # logit ratio 0.95; p(4) ~ 0.16
    t = tree_of([4, 3], [-1, -1])
    logits = torch.stack([close, close, close])
    p = sampling_probs(close.unsqueeze(0), 1.0)[0]
    first = [verify_tree(t, logits, rule=rule_from_theta(0.9), temperature=1.0, seed=s, position=0).emitted(t)[0]
             for s in range(3_000)]
    law = torch.zeros(V)
    law[4], law[3] = p[4], 1 - p[4]
    assert fits(first, law) and not fits(first, p)
    strict = [verify_tree(t, logits, rule=rule_from_theta(INF), temperature=1.0, seed=s, position=0).emitted(t)[0]
              for s in range(3_000)]
    assert fits(strict, p)


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_verify_tree_reads_the_host_once(temperature, monkeypatch):
    """A tree's verdict comes to the host in one transfer (what the walk reads: ok, relaxed,
    the rows' own tokens, the relaxable rows); the tree's structure is read from its host
    lists (DraftTree.parent_list), no tensor. Sampled: the draws' dense path, a GPU's."""
    from marscli.engine.host_reads import count_host_reads
    from marscli.verification import draws

    monkeypatch.setattr(draws, "DENSE_DEVICES", frozenset({"cpu"}))
    torch.manual_seed(0)
    tree = tree_of([3, 5, 7, 3, 9, 2], [ROOT, ROOT, 0, 0, 1, 3])
    logits = torch.randn(len(tree) + 1, 12)
    rule = rule_from_theta(0.1)
    with count_host_reads() as reads:
        res = verify_tree(tree, logits, rule=rule, temperature=temperature, seed=5, position=3)
    assert reads.total == 1, reads.by_kind
    assert res.next_token == int(logits[(res.path[-1] + 1) if res.path else 0].argmax()) or temperature
