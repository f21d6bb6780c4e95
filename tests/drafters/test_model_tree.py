"""Draft-model trees (issue 32): a draft model's chain with its next choices as sibling
leaves (marscli.drafters.model.SiblingTree), verified by the tree walk.

Strict greedy output equals plain decoding and transformers' generate() with siblings really
accepted; the sampling walk over a real sibling tree reproduces the target's law; a chain's
proposal is the tree's chain; the command line's --tree-* options reach a draft model.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

import marscli.engine.scheduler as scheduler
from marscli.config import DraftConfig, ModelConfig, SamplingParams, VerifyConfig
from marscli.drafters.factory import build_drafter, build_drafters
from marscli.drafters.hybrid import HybridDrafter
from marscli.drafters.model import ModelDrafter, SiblingTree
from marscli.engine import build_engine
from marscli.models.loading import load_model
from marscli.verification.registry import Rule
from marscli.verification.tree import DraftTree, verify_tree
from tests.oracles import hf_greedy
from tests.verify_helpers import slot_tree_forward

PROMPTS = [
    "hello world, hello marscli; the cat sat on the mat. hello world, hello",
    "one two three four five six seven eight nine ten one two three",
    "the quick brown fox jumps over the lazy dog",
    "speculative decoding drafts tokens and the target verifies them in one pass. speculative",
]


def tree_cfg(top_k: int = 2, tokens: int = 12, k: int = 4, **kw) -> DraftConfig:
    return DraftConfig(kind="model", model="x", num_draft_tokens=k, tree_top_k=top_k, tree_tokens=tokens, **kw)


# --- the shape ----------------------------------------------------------------------------


def test_sibling_tree_keeps_the_chain_and_the_likeliest_siblings_in_position_order():
    shape = SiblingTree(k_max=4, top_k=3, tokens=7)  # 6 nodes: the chain of 3 and 3 siblings
    chain = [10, 11, 12]
    alternatives = [(0.30, 0, 20), (0.05, 0, 21), (0.20, 1, 22), (0.25, 2, 23), (0.20, 2, 24)]
    tokens, parents, scores = shape.build(chain, alternatives)
    # the three likeliest: 0.30 @0, 0.25 @2, and of the two 0.20s the earlier position (@1)
    assert tokens == [10, 11, 12, 20, 22, 23]
    assert parents == [-1, 0, 1, -1, 0, 1]  # a sibling of chain node i hangs under node i - 1
    assert scores == [1.0, 1.0, 1.0, 0.30, 0.20, 0.25]
    tree = DraftTree(torch.tensor(tokens), torch.tensor(parents))  # parents first: a valid tree
    assert tree.depth().tolist() == [1, 2, 3, 1, 2, 3]
    # no room: the chain alone; a chain longer than the room is never cut
    assert shape.build([1, 2, 3, 4, 5, 6, 7], alternatives) == ([1, 2, 3, 4, 5, 6, 7], list(range(-1, 6)), [1.0] * 7)
    assert SiblingTree(4, 2, 16).max_path == 4
    with pytest.raises(ValueError):
        SiblingTree(0, 2, 16)


@pytest.fixture(scope="module")
def near(tiny_model_dir):
    """A draft model that mostly agrees with the target: its weights plus noise, so that the
    target's choice is often the draft's first and sometimes its second."""
    m = load_model(ModelConfig(str(tiny_model_dir), dtype="float32", device="cpu"))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for w in m.model.parameters():
            w.add_(torch.randn(w.shape, generator=g) * 0.5 * float(w.std()))
    return m


def test_the_trees_chain_is_the_chain_proposal_and_siblings_are_the_next_choices(target, draft):
    from marscli.engine.host_reads import count_host_reads

    vocab = target.model.get_output_embeddings().weight.shape[0]
    shape = SiblingTree(k_max=5, top_k=3, tokens=30)
    tree_drafter = ModelDrafter(draft.model, 5, vocab_size=vocab, tree=shape)
    chain_drafter = ModelDrafter(draft.model, 5, vocab_size=vocab)
    ids = target.tokenizer(PROMPTS[0]).input_ids
    for d in (tree_drafter, chain_drafter):
        d.start(ids, SamplingParams())
    tokens, parents, scores = tree_drafter.propose_tree(ids, 5)
    chain = chain_drafter.propose(ids, 5).tokens
    assert tokens[:5] == chain and parents[:5] == [-1, 0, 1, 2, 3]
    assert len(tokens) == 5 + 2 * 5  # room for every candidate: two siblings per position
    # each sibling is the draft model's 2nd or 3rd choice after the chain's prefix
    for tok, parent, score in zip(tokens[5:], parents[5:], scores[5:]):
        prefix = ids + chain[: parent + 1]
        with torch.no_grad():
            logits = draft.model(torch.tensor([prefix])).logits[0, -1]
        probs = torch.softmax(logits.float(), -1)
        top = torch.topk(probs, 3).indices.tolist()
        assert top[0] == chain[parent + 1] and tok in top[1:]
        reach = math.prod(float(torch.softmax(draft.model(torch.tensor([ids + chain[:j]])).logits[0, -1].float(), -1)
                                [chain[j]]) for j in range(parent + 1))
        assert score == pytest.approx(reach * float(probs[tok]), rel=1e-4)
    # the next proposal after a sibling was committed rolls the draft cache back correctly
    committed = ids + [tokens[5]]
    with count_host_reads() as reads:  # one transfer a draft position (3 a position before)
        again = tree_drafter.propose_tree(committed, 3)[0][:3]
    assert reads.total <= 3, reads.by_kind
    fresh = ModelDrafter(draft.model, 3, vocab_size=vocab)
    fresh.start(committed, SamplingParams())
    assert again == fresh.propose(committed, 3).tokens


class Spy:
    """Counts tree steps whose accepted path went through a sibling (not the chain)."""

    def __init__(self, monkeypatch):
        self.steps = self.sibling_paths = 0
        real = scheduler.verify_tree

        def spy(tree, logits, **kw):
            res = real(tree, logits, **kw)
            self.steps += 1
            parents = tree.parents.tolist()
            self.sibling_paths += any(parents[i] != i - 1 for i in res.path)
            return res
        monkeypatch.setattr(scheduler, "verify_tree", spy)


@pytest.mark.parametrize("hybrid", [False, True])
def test_strict_greedy_with_a_draft_model_tree_is_plain_decoding(target, near, oracle, monkeypatch, hybrid):
    spy = Spy(monkeypatch)
    cfg = tree_cfg(hybrid=hybrid)
    engine = build_engine(target, near, VerifyConfig(), cfg)
    assert isinstance(engine.tree, SiblingTree)
    plain = build_engine(target, None, VerifyConfig(), DraftConfig(kind="none"))
    nodes = 0
    for text in PROMPTS:
        ids = target.tokenizer(text).input_ids
        res = engine.generate_ids(ids, SamplingParams(max_tokens=40))
        assert res.token_ids == plain.generate_ids(ids, SamplingParams(max_tokens=40)).token_ids, text
        assert res.token_ids == hf_greedy(oracle, ids, 40), text
        nodes += res.stats.tree_nodes
    assert spy.steps > 0 and nodes > 0
    assert spy.sibling_paths > 0, "no step accepted a sibling: the tree never paid"
    assert isinstance(build_drafter(cfg, target, near), HybridDrafter if hybrid else ModelDrafter)


def test_an_int8_target_verifies_sibling_trees_exactly(tiny_model_dir, tiny_draft_dir):
    """An int8 target (float64 attention) takes the tree mask too: strict greedy with an int8
    draft model's trees equals the int8 target's plain decoding and its own generate()."""
    target8 = load_model(ModelConfig(str(tiny_model_dir), dtype="float32", device="cpu", quant="int8"))
    draft8 = load_model(ModelConfig(str(tiny_draft_dir), dtype="float32", device="cpu", quant="int8"))
    engine = build_engine(target8, draft8, VerifyConfig(), tree_cfg())
    plain = build_engine(target8, None, VerifyConfig(), DraftConfig(kind="none"))
    nodes = 0
    for text in PROMPTS[:3]:
        ids = target8.tokenizer(text).input_ids
        res = engine.generate_ids(ids, SamplingParams(max_tokens=32))
        assert res.token_ids == plain.generate_ids(ids, SamplingParams(max_tokens=32)).token_ids, text
        assert res.token_ids == hf_greedy(target8.model, ids, 32), text
        nodes += res.stats.tree_nodes
    assert nodes > 0


@pytest.mark.parametrize("verify", [VerifyConfig(), VerifyConfig.from_rule(Rule("mars", 0.3, "prob-ratio"))],
                         ids=["strict", "mars"])
def test_captured_tree_steps_give_the_eager_trees_records(target, near, monkeypatch, verify):
    """A tree step at a captured step's shapes (the slot cache; run eagerly as a CPU can): the
    tree at a padded token count, the accepted path kept by keep_path. Every record, greedy and
    sampled, equals the eager tree step's (contiguous cache, compact_cache), tokens and
    statistics, and some accepted paths went through a sibling (a path moved in the slot)."""
    from marscli.models.slots import SlotCache

    spy = Spy(monkeypatch)
    engines = [build_engine(target, near, verify, tree_cfg(), compile_mode=m) for m in ("off", "static")]
    assert [e.step_kind for e in engines] == ["eager", "static"]
    for s in (SamplingParams(max_tokens=32), SamplingParams(max_tokens=32, temperature=0.8, seed=2)):
        for text in PROMPTS:
            ids = target.tokenizer(text).input_ids
            a, b = (e.generate_ids(ids, s) for e in engines)
            assert a.token_ids == b.token_ids, text
            assert a.stats.to_dict() == b.stats.to_dict(), text
    kv = engines[1].kv
    assert isinstance(kv, SlotCache) and any(S > 1 for _, S, _ in kv.steps.shapes)
    assert spy.sibling_paths > 0


def test_mars_greedy_with_a_draft_model_tree_is_reproducible_and_relaxes(target, near):
    """MARS over sibling trees: a record's text is the same alone and again (the chain is a
    fixed K: relaxed trees keep the drafted-positions rule), and the rule does relax."""
    verify = VerifyConfig.from_rule(Rule("mars", 0.3, "prob-ratio"))
    outs, relaxed = [], 0
    for _ in range(2):
        engine = build_engine(target, near, verify, tree_cfg())
        assert engine.fixed_lengths
        res = [engine.generate_ids(target.tokenizer(t).input_ids, SamplingParams(max_tokens=32)) for t in PROMPTS]
        outs.append([r.token_ids for r in res])
        relaxed += sum(r.stats.relaxed for r in res)
    assert outs[0] == outs[1] and relaxed > 0


def test_relaxed_and_sampled_tree_rows_ignore_measured_costs(target, near):
    """The reproducibility contract on trees: with cheap and with dear measured costs a MARS
    greedy record drafts the same (fixed) chains and gives the same text; a strict sampled
    one gives the same text (its draws), whatever it drafts."""
    from marscli.engine.costs import StepCosts
    from marscli.engine.scheduler import Engine

    def costs(slope):
        ns = (1, 2, 3, 5, 9)
        return StepCosts((1,), ns, (tuple(1.0 + slope * (n - 1) for n in ns),), (0.05,), {"t": slope}, "measured")
    cases = ((Rule("mars", 0.3, "prob-ratio"), SamplingParams(max_tokens=30)),
             (Rule("strict"), SamplingParams(temperature=0.9, max_tokens=30, seed=4)))
    for rule, s in cases:
        outs = []
        for slope in (0.001, 2.0):
            cfg = tree_cfg()
            engine = Engine(target, build_drafters(cfg, target, near), rule, cfg, 1, costs=costs(slope))
            res = [engine.generate_ids(target.tokenizer(t).input_ids, s) for t in PROMPTS]
            outs.append([(r.token_ids, r.stats.drafted, r.stats.tree_nodes) if rule.relaxes else r.token_ids
                         for r in res])
        assert outs[0] == outs[1], rule.name
    # and a strict greedy row does follow them: dear drafting drafts less, same text
    drafted = []
    for slope in (0.001, 2.0):
        cfg = tree_cfg()
        engine = Engine(target, build_drafters(cfg, target, near), Rule("strict"), cfg, 1, costs=costs(slope))
        res = [engine.generate_ids(target.tokenizer(t).input_ids, SamplingParams(max_tokens=30)) for t in PROMPTS]
        drafted.append(([r.token_ids for r in res], sum(r.stats.drafted for r in res)))
    assert drafted[0][0] == drafted[1][0] and drafted[1][1] < drafted[0][1]


def test_the_sampling_walk_over_a_sibling_tree_reproduces_the_targets_law(target):
    """The target drafts for itself, so its sibling tree's root children are the target's own
    top-2: the walk keeps the child that is the position's draw. The first token of many
    independent steps (seeds) follows the target's law, and is the draw itself."""
    vocab = target.model.get_output_embeddings().weight.shape[0]
    drafter = ModelDrafter(target.model, 3, vocab_size=vocab, tree=SiblingTree(3, 2, 7))
    ids = target.tokenizer(PROMPTS[2]).input_ids
    drafter.start(ids, SamplingParams(temperature=1.0))
    tokens, parents, _ = drafter.propose_tree(ids, 3)
    assert len(tokens) == 6 and parents[3] == -1  # a sibling at the root
    tree = DraftTree(torch.tensor(tokens), torch.tensor(parents))
    with torch.no_grad():
        logits, _, _ = slot_tree_forward(target.model, ids[:-1], tree, ids[-1])
    # a temperature at which the target's first choice has about half the mass (the tiny
    # random model's own logits are nearly flat)
    lo, hi = 1e-4, 10.0
    for _ in range(60):
        T = math.sqrt(lo * hi)
        lo, hi = (T, hi) if float(torch.softmax(logits[0] / T, -1).max()) > 0.5 else (lo, T)
    p = torch.softmax(logits[0] / T, -1).double()
    assert float(p[tokens[0]]) < 0.9 and float(p[tokens[3]]) > 0.02  # both root children matter
    n = 4000
    first = [verify_tree(tree, logits, temperature=T, seed=i, position=0).emitted(tree)[0] for i in range(n)]
    from marscli.verification.chain import sampled_draws

    draws = sampled_draws(p.float().view(1, 1, -1).expand(n, 1, -1), torch.arange(n), torch.zeros(n, dtype=torch.long))
    assert first == draws[:, 0].tolist()
    freq = torch.bincount(torch.tensor(first), minlength=p.numel()).double() / n
    support = int((p > 1e-3).sum())
    tv = 0.5 * float((freq - p).abs().sum())
    assert tv < 1.5 * math.sqrt(support / n) + 0.01, (tv, support)
    # each root child is emitted at its own probability (binomial, 5 sigma)
    for tok in (tokens[0], tokens[3]):
        sd = math.sqrt(float(p[tok]) * (1 - float(p[tok])) / n)
        assert abs(float(freq[tok]) - float(p[tok])) < 5 * sd + 1e-9, tok


def test_strict_sampling_with_a_draft_model_tree_is_reproducible(target, draft):
    engine = build_engine(target, draft, VerifyConfig(), tree_cfg())
    ids = target.tokenizer(PROMPTS[1]).input_ids
    s = SamplingParams(temperature=0.8, max_tokens=24, seed=5)
    a = engine.generate_ids(ids, s).token_ids
    b = build_engine(target, draft, VerifyConfig(), tree_cfg()).generate_ids(ids, s).token_ids
    assert a == b and len(a) > 0


def test_trees_run_one_record_at_a_time(target, draft):
    drafters = build_drafters(tree_cfg(), target, draft, batch_size=1)
    assert isinstance(drafters.tree, SiblingTree)
    one = build_drafter(tree_cfg(), target, draft)
    assert isinstance(one, ModelDrafter) and one.tree == SiblingTree(4, 2, 12)
    from marscli.errors import UsageError
    with pytest.raises(UsageError, match="one record at a time"):
        build_engine(target, draft, VerifyConfig(), tree_cfg(), batch_size=2)


# --- the command line ---------------------------------------------------------------------


def test_tree_options_reach_a_draft_model(runner, tiny_model_dir, tiny_draft_dir, tmp_path):
    from marscli.cli import app

    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"id": "a", "prompt": "hello world, hello marscli; hello world"}) + "\n")
    base = ["generate", str(src), "--target", str(tiny_model_dir), "--max-tokens", "16", "--verify", "strict",
            "--draft", str(tiny_draft_dir)]
    out = tmp_path / "out.jsonl"
    r = runner.invoke(app, [*base, "--tree-top-k", "3", "--tree-tokens", "10", "-o", str(out)])
    assert r.exit_code == 0, r.stderr
    assert "model tree (chain K<=8, top-k 3, 10 tokens)" in r.stderr
    rec = json.loads(out.read_text())
    assert rec["spec"]["tree_nodes"] > 0
    plain = tmp_path / "plain.jsonl"
    assert runner.invoke(app, [*base[:-2], "--draft", "none", "-o", str(plain)]).exit_code == 0
    assert json.loads(plain.read_text())["output"] == rec["output"]
    # resuming with chains is a different run (the fingerprint holds the tree)
    r = runner.invoke(app, [*base, "-o", str(out), "--resume"])
    assert r.exit_code != 0 and "drafter" in r.stderr, r.stderr
    for args, fragment in ((["--tree-depth", "3"], "--tree-depth is EAGLE-3's"),
                           (["--tree-top-k", "1"], "needs at least 2"),
                           (["--tree-tokens", "9", "--batch-size", "2"], "one record at a time")):
        r = runner.invoke(app, [*base, *args])
        assert r.exit_code == 2 and fragment in r.stderr, (args, r.stderr)
