"""EAGLE-3 drafting: checkpoint format and checks, chain and tree drafting, strict and MARS.

Heads are written in the published format (marscli.drafters.eagle3_files.save_head) and loaded back through
the same loader a user's checkpoint goes through. Two heads: a random one (accepts almost
nothing) and one fitted for a few hundred steps to the tiny target's own features on the
target's greedy continuations of PROMPTS (accepts often; asserted). Strict greedy output must
equal transformers' greedy generate() token for token, in float32, for chains and trees.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from marscli.config import DraftConfig, ModelConfig, SamplingParams, VerifyConfig
from marscli.drafters.eagle3 import Eagle3Drafter
from marscli.drafters.eagle3_files import load_head, random_head, save_head
from marscli.drafters.eagle3_head import AUX_LAYERS_KEY, FeatureTap, default_feature_layers
from marscli.drafters.factory import build_drafter, build_drafters
from marscli.engine import build_engine
from marscli.engine.scheduler import Engine
from marscli.errors import ModelLoadError
from marscli.models.loading import load_model
from marscli.models.slots import StepPlan
from marscli.training.ttt import pass_mask
from marscli.verification.rules import margin_statistic, top2
from tests.engines import make_engine
from tests.oracles import hf_greedy, replay_mars

TARGET_LAYERS = 8  # EAGLE-3's rule picks layers 2, 4, 5: three distinct feature layers
PROMPTS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, hello marscli; the cat sat on the mat.",
    "one two three four five six seven eight nine ten",
    "a margin aware rule",
    "speculative decoding drafts tokens",
]
#: Prompts the fitted head never saw.
HELD_OUT = ["quick brown", "seven eight nine", "the lazy dog", "world, hello", "tokens verify"]
MAX_NEW = 24
FIT_STEPS = 200
SHARPEN = 0.05  # temperature of the fitted head's targets
TREE = dict(tree_depth=3, tree_top_k=3, tree_tokens=12)


# --------------------------------------------------------------------------- fixtures


# These 64-wide models run faster on one thread than on two contended ones.
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory, tiny_factory, tiny_tokenizer) -> Path:
    return tiny_factory(tmp_path_factory.mktemp("e3-target"), seed=0, layers=TARGET_LAYERS,
                        tokenizer=tiny_tokenizer)


def greedy_ref(target, ids: list[int], max_new: int = MAX_NEW) -> list[int]:
    return hf_greedy(target.model, ids, max_new)


@pytest.fixture(scope="module")
def references(target):
    return {p: greedy_ref(target, target.tokenizer(p).input_ids) for p in PROMPTS}


@pytest.fixture(scope="module")
def random_dir(target, tmp_path_factory) -> Path:
    """A random head with a reduced draft vocabulary (every other token), so d2t matters."""
    V = target.model.get_output_embeddings().weight.shape[0]
    head = random_head(target.model, seed=1, draft_vocab=list(range(0, V, 2)))
    return save_head(head, tmp_path_factory.mktemp("e3-random"))


def fit_head(target, seqs: torch.Tensor, *, steps: int, seed: int = 0, draft_vocab=None, unroll: int = 3):
    """Fit a random head to the target's own features on sequences seqs [B, L] (the target's
    greedy text), EAGLE-3 style: the loss is the cross-entropy against the target's next-token
    distribution restricted to the draft vocabulary; the first pass reads the target's
    features, `unroll - 1` more passes read the head's own outputs, as drafting does
    (training-time test)."""
    head = random_head(target.model, seed=seed, draft_vocab=draft_vocab)
    m = target.model
    tap = FeatureTap(m, head.feature_layers)
    with torch.no_grad(), tap.capture():
        logits = m(seqs).logits  # [B, L, V]: the target's view after each position
    feats = tap.features
    B, L = seqs.shape
    S = L - 1
    in_draft = head.to_target(torch.arange(head.d2t.shape[0]))
    # The target distribution on the draft vocabulary, sharpened: the tiny random target is
    # nearly uniform (its top-2 logits are close), which would teach a flat head.
    p = torch.softmax(logits[..., in_draft] / SHARPEN, -1)  # [B, L, Dv]
    hid, toks, pos = feats[:, :S], seqs[:, 1:], torch.arange(S).expand(B, S)
    head.train().requires_grad_(True)
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3, weight_decay=0.0)

    def ce(out, target_p):
        return -(target_p * torch.log_softmax(head.draft_logits(out), -1)).sum(-1).mean()

    for _ in range(steps):
        out, keys, values = head(hid, toks, pos, target_features=True)
        loss = ce(out, p[:, 1:])
        prev = out
        for u in range(1, unroll):
            # Entry j of pass u reads pass u-1's output at j-1 and token j+1; it sees the
            # committed entries up to j-u and its own chain of draft entries (one per pass).
            n = S - u
            mask = pass_mask(S, u, torch.device("cpu"))
            out, k2, v2 = head(prev[:, :n], toks[:, u:], pos[:, u:], (keys, values), mask,
                               target_features=False)
            loss = loss + 0.8 ** u * ce(out, p[:, 1 + u:])
            keys, values = torch.cat([keys, k2], 2), torch.cat([values, v2], 2)
            prev = out
        opt.zero_grad()
        loss.backward()
        opt.step()
    return head.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def fitted_dir(target, references, tmp_path_factory) -> Path:
    """A head fitted to the target's features on its greedy continuations of PROMPTS, with a
    reduced draft vocabulary (the tokens of that text plus some others), as pytorch_model.bin."""
    tok = target.tokenizer
    rows = [tok(p).input_ids + references[p] for p in PROMPTS]
    L = min(len(r) for r in rows)
    seqs = torch.tensor([r[:L] for r in rows])
    V = target.model.get_output_embeddings().weight.shape[0]
    vocab = sorted(set(seqs.flatten().tolist()) | set(range(0, V, 5)))
    torch.manual_seed(0)
    head = fit_head(target, seqs, steps=FIT_STEPS, draft_vocab=vocab)
    return save_head(head, tmp_path_factory.mktemp("e3-fitted"), fmt="bin")


@pytest.fixture(scope="module")
def heads(target, random_dir, fitted_dir):
    return {"random": load_head(str(random_dir), target), "fitted": load_head(str(fitted_dir), target)}


def run_all(engine, target, sampling=SamplingParams(max_tokens=MAX_NEW), observer=None):
    out, steps, emitted, accepted, drafted = {}, 0, 0, 0, 0
    for p in PROMPTS:
        res = engine.generate_ids(target.tokenizer(p).input_ids, sampling, observer=observer)
        out[p] = res.token_ids
        steps += res.stats.steps
        emitted += res.stats.emitted
        accepted += res.stats.accepted
        drafted += res.stats.drafted
    return out, {"tau": emitted / steps, "accepted": accepted, "drafted": drafted}


# --------------------------------------------------------------------------- format and loading


PUBLISHED_KEYS = {
    "fc.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
    "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight",
    "midlayer.post_attention_layernorm.weight", "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight", "norm.weight",
    "lm_head.weight", "d2t", "t2d",
}


def test_default_feature_layers_follow_eagle3():
    assert default_feature_layers(32) == (2, 16, 29)  # LLaMA-3.1-8B
    assert default_feature_layers(80) == (2, 40, 77)  # LLaMA-3.3-70B
    assert default_feature_layers(8) == (2, 4, 5)
    assert default_feature_layers(2) == (1,)  # a shallow target gets fewer (each layer once)


def test_checkpoint_uses_the_published_names_and_loads_back(target, random_dir, tmp_path):
    from safetensors.torch import load_file

    sd = load_file(str(random_dir / "model.safetensors"))
    assert set(sd) == PUBLISHED_KEYS  # no embed_tokens: the target's are used
    H = target.model.config.hidden_size
    assert sd["fc.weight"].shape == (H, 3 * H)
    assert sd["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * H
    assert sd["d2t"].dtype == torch.long and sd["t2d"].dtype == torch.bool
    cfg = json.loads((random_dir / "config.json").read_text())
    assert cfg["draft_vocab_size"] == sd["lm_head.weight"].shape[0] == int(sd["t2d"].sum())

    head = load_head(str(random_dir), target).head
    again = save_head(head, tmp_path / "again", fmt="bin")
    back = torch.load(again / "pytorch_model.bin", weights_only=True)
    assert set(back) == PUBLISHED_KEYS
    for k in PUBLISHED_KEYS:
        assert torch.equal(back[k], sd[k]), k
    # draft token i is target token i + d2t[i]
    assert head.to_target(torch.tensor([0, 1, 5])).tolist() == [0, 2, 10]


def test_own_embedding_and_the_converters_layer_prefix(target, tmp_path):
    from safetensors.torch import load_file, save_file

    head = random_head(target.model, seed=3, own_embedding=True)
    d = save_head(head, tmp_path / "own")
    sd = load_file(str(d / "model.safetensors"))
    assert "embed_tokens.weight" in sd
    renamed = {k.replace("midlayer.", "layers.0."): v for k, v in sd.items()}
    save_file(renamed, str(d / "model.safetensors"))
    loaded = load_head(str(d), target).head
    assert loaded.own_embedding
    assert torch.equal(loaded.embed_tokens.weight, head.embed_tokens.weight)


def test_head_from_the_local_hub_cache(target, random_dir, monkeypatch, tmp_path):
    import shutil

    hub = tmp_path / "hf" / "hub"
    rev = "0123456789abcdef0123456789abcdef01234567"
    repo = hub / "models--someone--EAGLE3-tiny"
    shutil.copytree(random_dir, repo / "snapshots" / rev)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(rev)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    loaded = load_head("someone/EAGLE3-tiny", target)
    assert loaded.identity["kind"] == "hub" and loaded.identity["revision"] == rev
    with pytest.raises(ModelLoadError, match="not in the local Hugging Face cache"):
        load_head("someone/not-there", target)


def _mangle(src: Path, dst: Path, *, drop=(), replace=None, config=None):
    """Copy a safetensors head with keys dropped/replaced and config keys changed."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    sd = load_file(str(dst / "model.safetensors"))
    for k in drop:
        sd.pop(k)
    sd.update(replace or {})
    save_file(sd, str(dst / "model.safetensors"))
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(config or {})
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("case,needle", [
    ("missing weight", "missing key 'midlayer.mlp.up_proj.weight'"),
    ("wrong hidden size", "'fc.weight' takes 96 target features"),
    ("wrong vocab", "vocab_size is 999"),
    ("d2t out of order", "'d2t' is not increasing at draft token 2"),
    ("d2t out of range", "'d2t' maps draft token 159 to"),
    ("no d2t", "missing key 'd2t'"),
    ("t2d disagrees", "'t2d' does not mark"),
    ("unexpected key", "unexpected key 'midlayer.self_attn.q_proj.bias'"),
    ("bad config", "missing 'hidden_size'"),
    ("layer ids", "names layer 9 but the target has 8 layers"),
])
def test_malformed_or_mismatched_checkpoints_fail_clearly(target, random_dir, tmp_path, case, needle):
    d = tmp_path / "bad"
    sd_file = "model.safetensors"
    from safetensors.torch import load_file

    sd = load_file(str(random_dir / sd_file))
    if case == "missing weight":
        _mangle(random_dir, d, drop=["midlayer.mlp.up_proj.weight"])
    elif case == "wrong hidden size":  # a head for a 32-wide target (fc takes 3 x 32)
        _mangle(random_dir, d, replace={"fc.weight": torch.zeros(64, 96)})
    elif case == "wrong vocab":
        _mangle(random_dir, d, config={"vocab_size": 999})
    elif case == "d2t out of order":
        d2t = sd["d2t"].clone()
        d2t[2] = -2  # draft token 2 -> target 0, before draft token 1 -> target 2
        _mangle(random_dir, d, replace={"d2t": d2t})
    elif case == "d2t out of range":
        d2t = sd["d2t"].clone()
        d2t[-1] = 10_000
        _mangle(random_dir, d, replace={"d2t": d2t})
    elif case == "no d2t":
        _mangle(random_dir, d, drop=["d2t"])
    elif case == "t2d disagrees":
        t2d = sd["t2d"].clone()
        t2d[1] = True
        _mangle(random_dir, d, replace={"t2d": t2d})
    elif case == "unexpected key":
        _mangle(random_dir, d, replace={"midlayer.self_attn.q_proj.bias": torch.zeros(64)})
    elif case == "bad config":
        _mangle(random_dir, d)
        (d / "config.json").write_text(json.dumps({"vocab_size": 320}))
    elif case == "layer ids":
        _mangle(random_dir, d, config={AUX_LAYERS_KEY: [1, 4, 9]})
    with pytest.raises(ModelLoadError) as err:
        load_head(str(d), target)
    msg = str(err.value)
    assert needle in msg
    assert "\n" not in msg
    where = "config.json" if case in ("wrong vocab", "bad config", "layer ids") else sd_file
    assert str(d / where) in msg


def test_missing_files_fail_clearly(target, random_dir, tmp_path):
    with pytest.raises(ModelLoadError, match="model path not found"):
        load_head(str(tmp_path / "nowhere"), target)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text((random_dir / "config.json").read_text())
    with pytest.raises(ModelLoadError, match="no model.safetensors or pytorch_model.bin"):
        load_head(str(tmp_path / "empty"), target)


def test_head_for_a_shallower_target_is_refused(tiny_model_dir, random_dir):
    two_layer = load_model(ModelConfig(str(tiny_model_dir), dtype="float32", device="cpu"))
    with pytest.raises(ModelLoadError, match=r"takes 192 target features but this target gives 1 layers"):
        load_head(str(random_dir), two_layer)


# --------------------------------------------------------------------------- the head and its cache


def test_incremental_head_cache_equals_one_pass(target, heads):
    """Entries fed in pieces (prefill, then per-step features) give the outputs of one pass."""
    head = heads["random"].head
    ids = target.tokenizer(PROMPTS[0]).input_ids
    tap = FeatureTap(target.model, head.feature_layers)
    with torch.no_grad(), tap.capture():
        target.model(torch.tensor([ids]))
    feats = tap.features  # [1, L, F]
    S = len(ids) - 1
    toks = torch.tensor([ids[1:]])
    pos = torch.arange(S)[None]
    with torch.no_grad():
        full, _, _ = head(feats[:, :S], toks, pos, target_features=True)
        past, outs = None, []
        for a, b in ((0, 3), (3, 4), (4, S)):
            o, k, v = head(feats[:, a:b], toks[:, a:b], pos[:, a:b], past, target_features=True)
            past = (k, v) if past is None else (torch.cat([past[0], k], 2), torch.cat([past[1], v], 2))
            outs.append(o)
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-5, atol=1e-5)


def test_a_sampled_draft_is_the_heads_coupled_draw(target, heads):
    """A sampled chain's first draft is the position's draw from the head's own law q, with
    the noise of the target token ids (marscli.verification.draws): the draw the target makes
    there when its law is q. Every draft lies in the draft vocabulary; another seed draws
    otherwise."""
    from marscli.verification.chain import sampling_probs
    from marscli.verification.draws import coupled_draw, position_keys

    head = heads["random"].head
    drafter = build_drafter(DraftConfig(kind="eagle3", model="x", num_draft_tokens=3, adaptive=False),
                            target, heads["random"])
    ids = target.tokenizer(PROMPTS[1]).input_ids
    tap = FeatureTap(target.model, drafter.feature_layers)
    with torch.no_grad(), tap.capture():
        target.model(torch.tensor([ids[:-1]]))
    firsts = set()
    for seed in range(12):
        drafter.start(ids, SamplingParams(temperature=0.7, seed=seed))
        drafter.observe(tap.features[0])
        prop = drafter.propose(ids, 3)
        assert len(prop.tokens) == 3 and all(bool(head.t2d[t]) for t in prop.tokens)
        with torch.no_grad():
            q = sampling_probs(head.draft_logits(drafter.last_out).unsqueeze(0), 0.7)  # [1, Dv]
        tid = head.to_target(torch.arange(q.shape[-1]))
        want = tid[coupled_draw(q, position_keys(torch.tensor([seed]), torch.tensor([0])), tid)]
        assert prop.tokens[0] == int(want[0])
        firsts.add(prop.tokens[0])
    assert len(firsts) > 1


# --------------------------------------------------------------------------- chain drafting


@pytest.mark.parametrize("which", ["random", "fitted"])
def test_chain_strict_greedy_equals_generate(target, heads, references, which):
    out, st = run_all(make_engine(target, "eagle3", heads[which], k=4), target)
    assert out == references
    if which == "random":
        assert st["drafted"] > 0 and st["accepted"] < st["drafted"] / 4
    else:
        assert st["tau"] > 1.5, st  # the fitted head really drafts what the target says


def assert_runs_as_alone(target, single, engine, references):
    """Every prompt, greedy and sampled, decodes in `engine`'s batch what it decodes alone in
    `single` (tokens and statistics), and greedy output is the reference's; returns the last
    (sampled) run's results."""
    for s in (SamplingParams(max_tokens=MAX_NEW), SamplingParams(max_tokens=MAX_NEW, temperature=0.8, seed=5)):
        a = {p: single.generate_ids(target.tokenizer(p).input_ids, s) for p in PROMPTS}
        b = dict(engine.run(PROMPTS, lambda p, s=s: (target.tokenizer(p).input_ids, s)))
        assert {p: r.token_ids for p, r in a.items()} == {p: r.token_ids for p, r in b.items()}
        assert all(a[p].stats.to_dict() == b[p].stats.to_dict() for p in PROMPTS)
        if s.greedy:
            assert {p: r.token_ids for p, r in a.items()} == references
    return b


@pytest.mark.parametrize("head_batched", [True, False])
def test_chain_adaptive_and_batched_equal_single(target, heads, references, head_batched):
    """Batch decoding gives every record what it gets alone: with the head's passes batched
    over the rows (what the CLI uses) and with one head pass per row."""
    from marscli.drafters.base import RowDrafters
    from marscli.drafters.eagle3 import BatchedEagle3Drafter

    # Equal rows (statistics and sampled draws included) need the same draft lengths alone
    # and in the batch: a fixed K. Adaptive lengths are chosen per batch; greedy strict
    # output is the reference either way (checked at the end).
    cfg = DraftConfig(kind="eagle3", model="x", num_draft_tokens=5, adaptive=False)
    single = build_engine(target, heads["fitted"], VerifyConfig(), cfg)
    if head_batched:
        bd = build_drafters(cfg, target, heads["fitted"], batch_size=3)
        assert isinstance(bd, BatchedEagle3Drafter)
    else:
        bd = RowDrafters(lambda: build_drafter(cfg, target, heads["fitted"]),
                         feature_layers=heads["fitted"].head.feature_layers)
    batch = Engine(target, bd, VerifyConfig().rule, cfg, 3)
    assert_runs_as_alone(target, single, batch, references)
    adaptive = dataclasses.replace(cfg, adaptive=True)
    if head_batched:
        bd = build_drafters(adaptive, target, heads["fitted"], batch_size=3)
    batch = Engine(target, bd, VerifyConfig().rule, adaptive, 3)
    got = dict(batch.run(PROMPTS, lambda p: (target.tokenizer(p).input_ids, SamplingParams(max_tokens=MAX_NEW))))
    assert {p: r.token_ids for p, r in got.items()} == references


def test_captured_step_shapes_feed_the_head_its_features(target, heads, references):
    """The captured step's static shapes (marscli.models.slots, run eagerly as a CPU can) hook
    the head's target features out of the forward themselves (on a GPU they are outputs of the
    graph), and the head's own draft passes run at static shapes too (HeadSteps): at batch 1
    and 3 with rows joining and leaving, strict greedy records equal generate() and every
    record, greedy and sampled (whose tokens follow the drafts), equals the eager engine's
    alone."""
    from marscli.drafters.eagle3 import BatchedEagle3Drafter
    from marscli.models.slots import SlotCache

    cfg = DraftConfig(kind="eagle3", model="x", num_draft_tokens=4, adaptive=False)
    single = build_engine(target, heads["fitted"], VerifyConfig(), cfg)
    for bs in (1, 3):
        drafters = build_drafters(cfg, target, heads["fitted"], batch_size=bs, batched_model=True)
        engine = Engine(target, drafters, VerifyConfig().rule, cfg, bs, compile_mode="static")
        assert engine.step_kind == "static" and isinstance(drafters, BatchedEagle3Drafter)
        b = assert_runs_as_alone(target, single, engine, references)
        assert isinstance(engine.kv, SlotCache) and engine.kv.tap is engine.tap and engine.kv.steps.shapes
        # the head's draft passes and its steps' catch-up passes: static too
        assert drafters.steps is not None and {k[0] == "catch-up" for k in drafters.steps.shapes} == {True, False}
        assert sum(r.stats.accepted for r in b.values()) > 0  # the head drafted from real features


@pytest.mark.parametrize("verify", [VerifyConfig(), VerifyConfig("mars", 0.05, "prob-ratio")], ids=["strict", "mars"])
def test_captured_tree_steps_give_the_eager_trees_records(target, heads, references, verify):
    """An EAGLE-3 tree step at a captured step's shapes (a slot cache, the tree's ancestor mask
    in the step's mask, the head's features out of the step): strict greedy records equal
    generate(), and every record, greedy and sampled, equals the eager tree step's."""
    from marscli.models.slots import SlotCache

    wide = dict(tree_depth=6, tree_top_k=4, tree_tokens=30)
    eager, static = (make_engine(target, "eagle3", heads["fitted"], **wide, verify=verify, compile_mode=m)
                     for m in ("off", "static"))
    assert static.step_kind == "static"
    for s in (SamplingParams(max_tokens=MAX_NEW), SamplingParams(max_tokens=MAX_NEW, temperature=0.8, seed=5)):
        for p in PROMPTS + HELD_OUT:
            ids = target.tokenizer(p).input_ids
            a, b = eager.generate_ids(ids, s), static.generate_ids(ids, s)
            assert a.token_ids == b.token_ids, p
            assert a.stats.to_dict() == b.stats.to_dict(), p
            if s.greedy and verify.rule.name == "strict" and p in references:
                assert b.token_ids == references[p]
    assert isinstance(static.kv, SlotCache) and any(S >= 16 for _, S, _ in static.kv.steps.shapes)
    assert b.stats.tree_nodes > 0


def test_chain_mars_greedy_emits_only_top1_or_relaxable_top2(target, heads):
    theta = 0.3
    eng = make_engine(target, "eagle3", heads["fitted"], k=4, verify=VerifyConfig("mars", theta, "prob-ratio"))
    for p in PROMPTS:
        ids = target.tokenizer(p).input_ids
        res = eng.generate_ids(ids, SamplingParams(max_tokens=MAX_NEW))
        assert replay_mars(target, ids, res.token_ids, theta, "prob-ratio") == res.stats.relaxed


# --------------------------------------------------------------------------- tree drafting


def test_dynamic_tree_is_eagle2s(target, heads):
    """Top-k after the pending token, top-k expansion by cumulative log-probability, then the
    best tokens-1 nodes, parents first."""
    from marscli.drafters.eagle3 import ROOT, TreeShape

    shape = TreeShape(depth=3, top_k=3, tokens=12)
    drafter = build_drafter(DraftConfig(kind="eagle3", model="x", tree_depth=3, tree_top_k=3, tree_tokens=12),
                            target, heads["fitted"])
    ids = target.tokenizer(PROMPTS[2]).input_ids
    tap = FeatureTap(target.model, drafter.feature_layers)
    with torch.no_grad(), tap.capture():
        target.model(torch.tensor([ids[:-1]]))
    drafter.start(ids)
    drafter.observe(tap.features[0])
    tokens, parents, scores = drafter.propose_tree(ids, max_path=99)
    assert len(tokens) == shape.tokens - 1
    depth = []
    for i, p in enumerate(parents):
        assert p == ROOT or 0 <= p < i
        depth.append(1 if p == ROOT else depth[p] + 1)
        if p != ROOT:
            assert scores[i] <= scores[p]  # cumulative log-probabilities only fall
    assert max(depth) <= shape.max_path
    for p in set(parents):
        kids = [tokens[i] for i in range(len(tokens)) if parents[i] == p]
        assert len(kids) == len(set(kids)) <= shape.top_k
    # The root's children are the head's top-k after the pending token, best first.
    head = heads["fitted"].head
    lp = torch.log_softmax(head.draft_logits(drafter.last_out), -1)
    top = torch.topk(lp, 3)
    roots = [i for i, p in enumerate(parents) if p == ROOT]
    assert [tokens[i] for i in roots] == head.to_target(top.indices).tolist()[: len(roots)]
    # The budget cuts paths.
    short = drafter.propose_tree(ids, max_path=2)
    assert max(1 if p == ROOT else 2 for p in short[1]) <= 2


@pytest.mark.parametrize("which", ["random", "fitted"])
def test_tree_strict_greedy_equals_generate(target, heads, references, which):
    out, st = run_all(make_engine(target, "eagle3", heads[which], **TREE), target)
    assert out == references
    if which == "fitted":
        assert st["tau"] > 1.5, st


def reference_tree_mars(tree, logits, theta, margin):
    """The paper's rule, node by node: ok when the node's token is the top-1 at its parent's
    row, or the top-2 there and that row's statistic exceeds theta. Returns (the longest
    all-ok path length, the fewest relaxed nodes among such paths, ok flags, relaxed flags)."""
    z1, z2, t1, t2 = top2(logits)
    stat = margin_statistic(z1, z2, margin)
    toks, pars = tree.tokens.tolist(), tree.parents.tolist()
    ok, relaxed, best = [], [], (0, 0)
    length, nrelax = [], []
    for _i, (t, p) in enumerate(zip(toks, pars)):
        r = p + 1
        top1 = t == int(t1[r])
        rel = not top1 and t == int(t2[r]) and float(stat[r]) > theta
        parent_ok = p < 0 or ok[p]
        ok.append(parent_ok and (top1 or rel))
        relaxed.append(rel)
        length.append((0 if p < 0 else length[p]) + 1)
        nrelax.append((0 if p < 0 else nrelax[p]) + rel)
        if ok[-1] and (length[-1], -nrelax[-1]) > best:
            best = (length[-1], -nrelax[-1])
    return best[0], -best[1], ok, relaxed


@pytest.mark.parametrize("margin,theta", [("prob-ratio", 0.05), ("logit-ratio", 0.5)])
def test_tree_mars_greedy_follows_the_papers_rule(target, heads, margin, theta):
    steps = []

    def observe(obs):
        steps.append(obs)

    wide = dict(tree_depth=6, tree_top_k=4, tree_tokens=30)  # siblings often hold the top-2
    eng = make_engine(target, "eagle3", heads["fitted"], **wide, verify=VerifyConfig("mars", theta, margin))
    relaxed_total = 0
    for p in PROMPTS + HELD_OUT:  # on held-out text the head errs, and siblings get their chance
        ids = target.tokenizer(p).input_ids
        steps.clear()
        res = eng.generate_ids(ids, SamplingParams(max_tokens=MAX_NEW), observer=observe)
        for obs in steps:
            if obs.tree is None:
                continue
            n, nrelax, ok, relaxed = reference_tree_mars(obs.tree, obs.tree_logits, theta, margin)
            path = list(obs.result.path)
            assert len(path) == n and all(ok[i] for i in path)
            assert sum(relaxed[i] for i in path) == nrelax == sum(obs.result.relaxed)
            last = 0 if not path else path[-1] + 1
            assert obs.result.next_token == int(obs.tree_logits[last].argmax())
        # And against one full target pass over the output: the tree mask and positions were right.
        assert replay_mars(target, ids, res.token_ids, theta, margin) == res.stats.relaxed
        relaxed_total += res.stats.relaxed
    assert relaxed_total > 0, "the test must exercise relaxed acceptances"


@pytest.mark.parametrize("verify", [VerifyConfig(), VerifyConfig("mars", 0.6)])
def test_tree_sampling_runs_and_is_deterministic(target, heads, verify):
    eng = make_engine(target, "eagle3", heads["fitted"], **TREE, verify=verify)
    # (the tiny target's logits are nearly flat: at 0.02 its law is peaked enough for the
    # head's children to be drawn)
    s = SamplingParams(max_tokens=MAX_NEW, temperature=0.02, seed=3)
    ids = target.tokenizer(PROMPTS[0]).input_ids
    a, b = eng.generate_ids(ids, s), eng.generate_ids(ids, s)
    assert a.token_ids == b.token_ids and len(a.token_ids) == MAX_NEW
    assert a.stats.tree_nodes > 0 and a.stats.accepted > 0
    c = eng.generate_ids(ids, SamplingParams(max_tokens=MAX_NEW, temperature=0.02, seed=4))
    assert c.token_ids != a.token_ids


def test_tree_calibration_records_path_and_siblings(target, heads):
    from marscli.calibration.collect import TREE_COLS, MarginCollector

    col = MarginCollector()
    eng = make_engine(target, "eagle3", heads["fitted"], **TREE)
    res = [eng.generate_ids(target.tokenizer(p).input_ids, SamplingParams(max_tokens=MAX_NEW), observer=col)
           for p in PROMPTS[:3]]
    data = col.data(records=3)
    assert int(data.step_n.sum()) == sum(r.stats.accepted for r in res)
    assert data.steps == sum(r.stats.steps for r in res)
    nodes = data.tree_nodes
    on_path = nodes[:, TREE_COLS.index("on_path")] > 0.5
    assert int(on_path.sum()) == sum(r.stats.accepted for r in res)
    assert (~on_path).sum() > 0  # siblings and rejected children too
    assert (nodes[on_path, TREE_COLS.index("rank")] == 1).all()  # strict greedy: path nodes are top-1
    # The chain view holds the path and one rejected child per step that had children left.
    assert data.positions >= int(data.step_n.sum())


# --------------------------------------------------------------------------- command line


def _jsonl(path: Path, prompts) -> Path:
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": p}) + "\n" for i, p in enumerate(prompts)))
    return path


def test_cli_generate_chain_and_tree(runner, target_dir, fitted_dir, references, tmp_path):
    from marscli.cli import app

    src = _jsonl(tmp_path / "in.jsonl", PROMPTS)
    base = ["generate", str(src), "--target", str(target_dir), "--draft", f"eagle3:{fitted_dir}",
            "--max-tokens", str(MAX_NEW), "--token-ids", "--no-timing", "--dtype", "float32", "--device", "cpu"]
    for extra in ([], ["--batch-size", "2"], ["--tree-depth", "3", "--tree-top-k", "3", "--tree-tokens", "12"]):
        r = runner.invoke(app, base + ["--verify", "strict"] + extra)
        assert r.exit_code == 0, r.stderr
        res = [json.loads(line) for line in r.stdout.splitlines()]
        assert [x["token_ids"] for x in res] == [references[p] for p in PROMPTS]
        assert all(x["spec"]["drafter"] == "eagle3" for x in res)
        if extra and extra[0] == "--tree-depth":
            assert "eagle3 tree (depth 3, top-k 3, 12 tokens)" in r.stderr
            assert all(x["spec"]["tree_nodes"] > 0 for x in res)
    # MARS on a tree through the command line
    r = runner.invoke(app, base + ["--verify", "mars", "--theta", "0.5", "--tree-depth", "2"])
    assert r.exit_code == 0, r.stderr
    assert "mars (theta=0.5" in r.stderr


@pytest.mark.parametrize("args,fragment", [
    (["--tree-depth", "3", "--batch-size", "2"], "tree drafting runs one record at a time"),
    (["--draft", "ngram", "--tree-depth", "3"], "need a draft model (--draft MODEL) or an EAGLE-3 drafter"),
    (["--draft", "eagle3"], "ships no EAGLE-3 head for"),
])
def test_cli_usage_errors(runner, target_dir, fitted_dir, tmp_path, args, fragment):
    from marscli.cli import app

    src = _jsonl(tmp_path / "in.jsonl", PROMPTS[:1])
    argv = ["generate", str(src), "--target", str(target_dir)]
    if "--draft" not in args:
        argv += ["--draft", f"eagle3:{fitted_dir}"]
    r = runner.invoke(app, argv + args)
    assert r.exit_code == 2 and fragment in r.stderr, r.stderr
    assert r.stdout == ""


def test_cli_mismatched_head_fails_with_one_line(runner, tiny_model_dir, random_dir, tmp_path):
    from marscli.cli import app

    src = _jsonl(tmp_path / "in.jsonl", PROMPTS[:1])
    r = runner.invoke(app, ["generate", str(src), "--target", str(tiny_model_dir),
                                 "--draft", f"eagle3:{random_dir}"])
    assert r.exit_code == 2, r.stderr
    line = [x for x in r.stderr.splitlines() if x.startswith("marscli: error:")]
    assert len(line) == 1 and "fc.weight" in line[0] and str(random_dir) in line[0]


@pytest.mark.parametrize("tree", [[], ["--tree-depth", "3", "--tree-top-k", "3", "--tree-tokens", "12"]])
def test_cli_calibrate_with_eagle3(runner, target_dir, fitted_dir, tmp_path, tree):
    import yaml

    from marscli.cli import app

    src = _jsonl(tmp_path / "in.jsonl", PROMPTS + HELD_OUT)
    out = tmp_path / "prof.yaml"
    r = runner.invoke(app, ["calibrate", str(src), "--target", str(target_dir), "--draft",
                                 f"eagle3:{fitted_dir}", "--max-tokens", "16", "--relax-rate", "0.3",
                                 "-o", str(out), "-q"] + tree)
    assert r.exit_code == 0, r.stderr
    prof = yaml.safe_load(out.read_text())
    assert prof["drafter"]["kind"] == "eagle3"
    assert prof["drafter"]["model"]["fingerprint"]
    assert (prof["drafter"].get("tree") or {}).get("depth") == (3 if tree else None)
    # generate finds the profile for this target and head by itself
    g = runner.invoke(app, ["generate", str(src), "--target", str(target_dir), "--draft",
                                 f"eagle3:{fitted_dir}", "--max-tokens", "4", "--profile", str(out)])
    assert g.exit_code == 0, g.stderr
    # MARS at the profile's theta, unless the profile predicts relaxing gains too little
    if prof["speed"]["verify_strictly"]:
        assert "verifying strictly" in g.stderr and "mars (theta=" not in g.stderr
        g = runner.invoke(app, ["generate", str(src), "--target", str(target_dir), "--draft",
                                     f"eagle3:{fitted_dir}", "--max-tokens", "4", "--profile", str(out),
                                     "--verify", "mars"])
    assert "mars (theta=" in g.stderr


def test_cli_bench_compares_chain_and_tree(runner, target_dir, fitted_dir, tmp_path):
    from marscli.cli import app

    src = _jsonl(tmp_path / "in.jsonl", PROMPTS[:3])
    rep = tmp_path / "bench.json"
    r = runner.invoke(app, ["bench", str(src), "--target", str(target_dir), "--draft", f"eagle3:{fitted_dir}",
                                 "--max-tokens", "16", "--tree-depth", "3", "--tree-top-k", "3",
                                 "--tree-tokens", "12", "--theta", "0.5", "--report", str(rep), "-q"])
    assert r.exit_code == 0, r.stderr
    report = json.loads(rep.read_text())
    methods = report["methods"]
    assert set(methods) == {"hf-generate", "ar", "strict", "strict-tree", "mars@0.5", "mars-tree@0.5"}
    assert report["correctness"]["failures"] == 0
    assert set(report["correctness"]["methods"]) >= {"strict", "strict-tree"}
    assert methods["strict-tree"]["acceptance_length"] > 1.5 and methods["strict"]["acceptance_length"] > 1.5
    assert report["settings"]["drafter"]["tree"] == {"depth": 3, "top_k": 3, "tokens": 12}
    bad = runner.invoke(app, ["bench", str(src), "--target", str(target_dir), "--draft", f"eagle3:{fitted_dir}",
                                   "--methods", "hf-assisted,strict"])
    assert bad.exit_code == 2 and "no assisted generation" in bad.stderr


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_logprobs_and_shared_prefills_with_eagle3(target, heads, tree):
    """Issue 18 with a drafter that reads the target's features: logprobs of greedy MARS output
    are the target's own (trees included), and n choices that join from the prefix cache (its
    features copied too) equal single runs with seeds seed + i of an engine without one."""
    from tests.oracles import check_logprobs

    wide = dict(tree_depth=6, tree_top_k=4, tree_tokens=30) if tree else {}
    eng = make_engine(target, "eagle3", heads["fitted"], **wide, verify=VerifyConfig("mars", 0.05, "prob-ratio"))
    ids = target.tokenizer(PROMPTS[0]).input_ids
    res = eng.generate_ids(ids, SamplingParams(max_tokens=MAX_NEW, logprobs=True, top_logprobs=2))
    assert res.stats.accepted > 0
    check_logprobs(target.model, ids, res, 2)

    sp = [SamplingParams(max_tokens=MAX_NEW, temperature=0.8, seed=3 + i) for i in range(3)]
    before = eng.prefix_tokens_reused
    shared = dict(eng.run(range(3), lambda i: (ids, sp[i])))
    assert eng.prefix_tokens_reused - before == 3 * (len(ids) - 1)
    alone = make_engine(target, "eagle3", heads["fitted"], **wide, verify=VerifyConfig("mars", 0.05, "prob-ratio"),
                        prefix_cache_mib=0)
    for i in range(3):
        assert shared[i].token_ids == alone.generate_ids(ids, sp[i]).token_ids
    assert alone.prefix_tokens_reused == 0



# --------------------------------------------------------------------------- the head's slot cache


class WrittenBytes(TorchDispatchMode):
    """Bytes of floating-point data an operation writes, over every operation run inside the
    block (the model's, the cache's, attention's): a fresh result's size, or for an in-place
    operation the size of what it writes from (scatter's source, a copy's source); views write
    nothing. An independent measure of a pass's memory work, whatever the code calls."""

    def __init__(self):
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            written = (args[1:], kwargs) if func._schema.is_mutable else out
            self.total += sum(t.numel() * t.element_size() for t in tree_flatten(written)[0]
                              if isinstance(t, torch.Tensor) and t.is_floating_point())
        return out


def head_job(head, B: int, length: int, static: bool):
    """A batched head over B rows whose prompts are `length` tokens and more (row b: b more),
    their (random) prompt features committed: (drafter, seqs)."""
    from marscli.drafters.eagle3 import BatchedEagle3Drafter

    d = BatchedEagle3Drafter(head, 4, vocab_size=head.cfg.vocab_size)
    if static:
        d.use_plan(StepPlan("static"))
        d.reset()
    g = torch.Generator().manual_seed(length)
    seqs = [torch.randint(3, head.cfg.vocab_size, (length + b,), generator=g).tolist() for b in range(B)]
    d.add_rows([s[:-1] for s in seqs], [SamplingParams()] * B)
    for b, s in enumerate(seqs):
        d.observe(b, torch.randn(len(s) - 1, head.n_features, generator=g))
    return d, seqs


def head_step(d, seqs, g, k: int = 4):
    """One engine step's worth of head work: two tokens committed a row (their features),
    then a chain of k drafts for every row."""
    for b in range(len(seqs)):
        seqs[b] += torch.randint(3, d.head.cfg.vocab_size, (2,), generator=g).tolist()
        d.observe(b, torch.randn(2, d.head.n_features, generator=g))
    return d.propose(seqs, [k] * len(seqs))


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_the_heads_step_work_does_not_grow_with_length(target, heads, static):
    """The batched head keeps its cache in slot buffers (marscli.drafters.eagle3_slots): a
    step's head work (its catch-up pass and a chain of 4 drafts for 3 rows) writes the same
    floating-point bytes whether the rows hold 20 or 700 entries (before, every row's cache
    was left-padded and concatenated every step and its shared heads repeated: 0.56 MB a step
    at 20 entries, 10.7 MB at 700), and its shapes and buffers outlive the step."""
    head = heads["random"].head
    written = []
    for length in (20, 700):
        d, seqs = head_job(head, 3, length, static)
        g = torch.Generator().manual_seed(1)
        head_step(d, seqs, g)  # the prompts' pass, and shapes built
        head_step(d, seqs, g)  # the buffers hold the next step
        buffers = d.slots.k.data_ptr()
        with WrittenBytes() as w:
            head_step(d, seqs, g)
        written.append(w.total)
        assert d.slots.k.data_ptr() == buffers and d.slots.lengths == [len(s) - 1 for s in seqs]
        assert (d.steps is not None) == static
    assert written[0] == written[1] > 0, written


def single_head_step(d, seq, g):
    """One tree step's worth of a single sequence's head work: two tokens committed (their
    features), a draft tree, then a chain of 4 drafts."""
    head = d.head
    seq.extend(torch.randint(3, head.cfg.vocab_size, (2,), generator=g).tolist())
    d.observe(torch.randn(2, head.n_features, generator=g))
    tokens, _, _ = d.propose_tree(seq, max_path=99)
    assert len(tokens) == d.tree.tokens - 1
    assert len(d.propose(seq, 4).tokens) == 4


def test_a_single_rows_tree_and_chain_work_does_not_grow_with_length(target, heads):
    """A single sequence's head (tree drafting, batch size 1) keeps its cache in buffers that
    grow by doubling: a step (two tokens committed with their features, a depth-3 tree of 12
    tokens, a chain of 4) writes the same floating-point bytes at 20 entries as at 700, and
    the same key/value entries (before, the whole cache was concatenated for the committed
    entries, for each chain draft and for each tree level: O(length) a step)."""
    from marscli.drafters.eagle3 import TreeShape

    head = heads["random"].head
    written, entries = [], []
    for length in (20, 700):
        g = torch.Generator().manual_seed(length)
        d = Eagle3Drafter(head, 4, vocab_size=head.cfg.vocab_size, tree=TreeShape(3, 3, 12))
        seq = torch.randint(3, head.cfg.vocab_size, (length,), generator=g).tolist()
        d.start(seq[:-1])
        d.observe(torch.randn(length - 1, head.n_features, generator=g))
        single_head_step(d, seq, g)  # the prompt's entries
        single_head_step(d, seq, g)  # the buffers grown past the step's scratch entries
        buffers, before = d.keys.data_ptr(), d.written
        with WrittenBytes() as w:
            single_head_step(d, seq, g)
        written.append(w.total)
        entries.append(d.written - before)
        assert d.keys.data_ptr() == buffers and d.n == len(seq) - 1
    assert written[0] == written[1] > 0 and entries[0] == entries[1] == 2 + 9 + 3, (written, entries)


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_the_heads_slots_draft_what_each_row_drafts_alone(target, heads, static):
    """Rows in the head's slots (rows leaving and joining, the buffers growing past their
    first capacity, greedy and sampled rows) draft what an Eagle3Drafter drafts for each alone
    (its own cache)."""
    head = heads["fitted"].head
    d, seqs = head_job(head, 3, 50, static)
    samplings = [SamplingParams(), SamplingParams(temperature=0.8, seed=3), SamplingParams()]
    d.rows = [type(r)(len(s) - 1, sp) for r, s, sp in zip(d.rows, seqs, samplings)]
    # each row's features, kept to feed the single drafters
    g = torch.Generator().manual_seed(7)
    feats = [torch.randn(len(s) - 1, head.n_features, generator=g) for s in seqs]
    for r, f in zip(d.rows, feats):
        r.pending = [f]
    singles = []
    for s, sp, f in zip(seqs, samplings, feats):
        one = Eagle3Drafter(head, 4, vocab_size=head.cfg.vocab_size)
        one.start(s[:-1], sp)
        one.observe(f)
        singles.append(one)
    capacities = set()
    for step in range(40):
        if step == 10:  # row 0 leaves, a long row joins
            d.keep([1, 2])
            singles = singles[1:]
            seqs = seqs[1:]
            s = torch.randint(3, head.cfg.vocab_size, (90,), generator=g).tolist()
            f = torch.randn(89, head.n_features, generator=g)
            d.add_rows([s[:-1]], [SamplingParams(temperature=0.6, seed=9)])
            d.observe(2, f)
            one = Eagle3Drafter(head, 4, vocab_size=head.cfg.vocab_size)
            one.start(s[:-1], SamplingParams(temperature=0.6, seed=9))
            one.observe(f)
            singles.append(one)
            seqs.append(s)
        ks = [(step + b) % 5 for b in range(len(seqs))]
        got = d.propose(seqs, ks)
        for b, (one, seq, k) in enumerate(zip(singles, seqs, ks)):
            assert got[b].tokens == one.propose(seq, k).tokens, (step, b)
        capacities.add(d.slots.capacity)
        for b, one in enumerate(singles):  # a step: 1-3 tokens committed with their features
            n = 1 + (step + b) % 3
            new = torch.randint(3, head.cfg.vocab_size, (n,), generator=g).tolist()
            f = torch.randn(n, head.n_features, generator=g)
            seqs[b] = seqs[b] + new
            d.observe(b, f)
            one.observe(f)
    assert len(capacities) > 1, capacities  # the buffers grew with rows in them


def test_the_batched_head_reads_the_host_once_per_chain(target, heads, monkeypatch):
    """What would be a device-to-host transfer on a GPU, counted on a CPU (static steps, the
    draws' dense path): a batched EAGLE-3 job reads the target's verdicts once a step and the
    head's drafts once per chain for the whole batch (at most one per draft position), greedy
    and sampled rows alike."""
    from marscli.engine.host_reads import count_host_reads
    from marscli.verification import draws

    monkeypatch.setattr(draws, "DENSE_DEVICES", frozenset({"cpu"}))
    cfg = DraftConfig(kind="eagle3", model="x", num_draft_tokens=4, adaptive=False)
    drafters = build_drafters(cfg, target, heads["fitted"], batch_size=3, batched_model=True)
    engine = Engine(target, drafters, VerifyConfig("mars", 0.05, "prob-ratio").rule, cfg, 3, compile_mode="static")
    samplings = [SamplingParams(max_tokens=MAX_NEW, temperature=float(i % 2), seed=i) for i in range(len(PROMPTS))]
    items = range(len(PROMPTS))
    job = lambda i: (target.tokenizer(PROMPTS[i]).input_ids, samplings[i])  # noqa: E731
    dict(engine.run(items, job))  # shapes built, buffers grown
    steps, chains = [0], [0]
    step, propose, prefill = engine.step, drafters.propose, engine.start_rows

    def counted_step():
        steps[0] += 1
        return step()

    def counted_propose(seqs, ks, bonus=False):
        chains[0] += any(k > 0 for k in ks)
        return propose(seqs, ks, bonus)

    def uncounted_prefill(joiners):  # prompts are read on the host anyway; steps are counted
        with reads.paused():
            return prefill(joiners)

    engine.step, drafters.propose, engine.start_rows = counted_step, counted_propose, uncounted_prefill
    with count_host_reads() as reads:
        got = dict(engine.run(items, job))
    assert len(got) == len(PROMPTS) and steps[0] > 0 and chains[0] > 0
    assert reads.by_kind["cpu"] == steps[0], reads.by_kind  # the verdicts, once a step
    assert reads.total <= steps[0] + chains[0], (reads.by_kind, steps[0], chains[0])


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_a_tree_step_reads_the_host_twice(target, heads, temperature, monkeypatch):
    """An EAGLE-3 tree step at a captured step's shapes (static, the draws' dense path) reads
    the host twice: the head's whole tree in one transfer (no level asks the device) and the
    verdict in one (the relaxable rows with it). Before: 8 device reads a step (a sync per
    tree level, three for the tree, one for the relaxable count), and 13-17 counted."""
    from marscli.engine.host_reads import count_host_reads
    from marscli.verification import draws

    monkeypatch.setattr(draws, "DENSE_DEVICES", frozenset({"cpu"}))
    engine = make_engine(target, "eagle3", heads["fitted"], tree_depth=4, tree_top_k=3, tree_tokens=16,
                         verify=VerifyConfig("mars", 0.05, "prob-ratio"), compile_mode="static")
    s = SamplingParams(max_tokens=MAX_NEW, temperature=temperature, seed=3)
    ids = target.tokenizer(PROMPTS[0]).input_ids
    want = engine.generate_ids(ids, s)  # shapes built
    steps, trees = [0], [0]
    step, propose_tree, prefill = engine.step, engine.drafters.propose_tree, engine.start_rows

    def counted_step():
        steps[0] += 1
        return step()

    def counted_tree(*a, **k):
        trees[0] += 1
        return propose_tree(*a, **k)

    def uncounted_prefill(joiners):  # the prompt is read on the host anyway
        with reads.paused():
            return prefill(joiners)

    engine.step, engine.drafters.propose_tree, engine.start_rows = counted_step, counted_tree, uncounted_prefill
    with count_host_reads() as reads:
        got = engine.generate_ids(ids, s)
    assert got.token_ids == want.token_ids and got.stats.tree_nodes > 0 and trees[0] > 0
    # every tree step: two reads; a step without a tree (the record's last token): one
    assert reads.total <= steps[0] + trees[0], (reads.by_kind, steps[0], trees[0])
