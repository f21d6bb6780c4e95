"""The slot cache (marscli.models.slots): every row's logits equal a plain forward of its own
sequence through joins, leaves, rejected drafts and growth."""

from __future__ import annotations

import pytest
import torch

from marscli.models.slots import SlotCache
from tests.models.cache_walks import cache_walk, tiny_llama


@pytest.mark.parametrize("bucket,static", [(1, False), (16, False), (1, True), (16, True)],
                         ids=["exact", "span-bucket", "static", "static-span-bucket"])
def test_slot_cache_rows_see_only_their_own_tokens(bucket, static):
    """Every row's logits equal its own plain forward (cache_walk checks each), eager or at
    the static shapes a captured step runs (rows, new tokens and span padded up to buckets)."""
    model = tiny_llama(512)
    kv = SlotCache(model, "cpu", slots=2, bucket=bucket, static=static)  # too few slots at first: it grows
    got = cache_walk(kv, model, longer=True)
    assert got
    assert kv.slots >= 4 and kv.capacity % bucket == 0
    if static:  # 3 rows ran as 4, 2 rows as 2, 1-3 new tokens as 2 or 4: a shape each
        assert {(b, s) for b, s, _ in kv.steps.shapes} >= {(4, 4), (2, 4)}


def test_rollback_is_a_length_change_and_a_leaving_row_moves_nothing_else():
    model = tiny_llama(512)
    kv = SlotCache(model, "cpu", slots=4)
    with torch.inference_mode():
        for n in (5, 8, 3):
            kv.add_prefilled(list(range(1, n)))
        buf = kv.layers()[0].kbuf
        before = buf.clone()
        kv.truncate_row(1, 2)
        assert kv.lengths == [4, 2, 2]
        kv.keep_rows([0, 2])  # row 2 moves to slot 1; slot 0 stays where it was
        assert kv.layers()[0].kbuf is buf  # no new buffer
        torch.testing.assert_close(buf[0], before[0])
        torch.testing.assert_close(buf[1, :, :2], before[2, :, :2])
        assert kv.lengths == [4, 2]


def test_a_step_that_cannot_be_captured_runs_eagerly(capsys):
    """A capture that fails (here: no CUDA at all) is said once on stderr and the steps run
    eagerly at the same shapes: every row's logits still equal its own plain forward."""
    model = tiny_llama(512)
    kv = SlotCache(model, "cpu", slots=4, graphs=True)
    got = cache_walk(kv, model, longer=True)  # checks every row against a plain forward as it goes
    assert got and kv.graphs is False and kv.steps.captures == 0 and kv.steps.capture_error
    err = capsys.readouterr().err
    assert err.count("capturing a step as a CUDA graph failed") == 1


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_a_tree_step_on_a_slot_cache_beside_another_row(static):
    """A draft tree over a slot cache (its ancestor mask as SlotCache.forward's block) gives
    each node the logits a plain forward of its root path gives, beside another row (in
    eager and static steps); keeping the accepted path
    (keep_path) leaves the row as if root and path had been fed as a chain: the next step's
    logits equal a plain forward of the row's sequence."""
    from marscli.engine.tree_forward import tree_block
    from marscli.verification.tree import DraftTree
    from tests.verify_helpers import path_to

    model = tiny_llama(512)
    gen = torch.Generator().manual_seed(5)
    seq = torch.randint(0, 50, (9,), generator=gen).tolist()
    # root's children 0, 1; 0's children 2, 3; 3's child 4; 1's child 5
    tree = DraftTree(torch.randint(0, 50, (6,), generator=gen), torch.tensor([-1, -1, 0, 0, 3, 1]))
    kv = SlotCache(model, "cpu", slots=1, static=static)
    with torch.inference_mode():
        kv.add_prefilled([7, 3, 9, 1])  # a neighbour in slot 0: the tree's row is slot 1
        kv.add_prefilled(seq[:-1])
        base = len(seq) - 1
        ids, pos, block = tree_block(tree, seq[-1], base, "cpu")
        other = torch.tensor([[5] + [0] * 6])
        kv_ids = torch.cat([other, ids])
        kv_pos = torch.cat([torch.tensor([[4] + [0] * 6]), pos])
        chain = torch.ones(1, 7, 7, dtype=torch.bool).tril()
        out = kv.forward(kv_ids, None, kv_pos, block=torch.cat([chain, block])).logits
        for i in range(-1, len(tree)):  # the root's row, then node i's
            along = seq + [int(tree.tokens[j]) for j in (path_to(tree, i) if i >= 0 else [])]
            torch.testing.assert_close(out[1, i + 1].float(), model(input_ids=torch.tensor([along])).logits[0, -1],
                                       rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(out[0, 0], model(input_ids=torch.tensor([[7, 3, 9, 1, 5]])).logits[0, -1],
                                   rtol=1e-4, atol=1e-4)
        path = [0, 3, 4]
        kv.truncate_row(0, 4)  # the neighbour keeps nothing new
        kv.keep_path(1, path)
        assert kv.lengths == [4, base + 1 + len(path)]
        grown = seq + [int(tree.tokens[i]) for i in path]
        nxt = kv.forward(torch.tensor([[5], [11]]), None, torch.tensor([[4], [len(grown)]])).logits
        plain = model(input_ids=torch.tensor([grown + [11]])).logits[0, -1]
        torch.testing.assert_close(nxt[1, 0], plain, rtol=1e-4, atol=1e-4)


def test_eager_attention_gets_an_additive_mask():
    """A model on transformers' eager attention (which adds the mask to the scores) walks the
    slot cache as an sdpa one does; flash attention (no custom 4D mask) is not held."""
    from marscli.models.slots import supports

    model = tiny_llama(512)
    model.set_attn_implementation("eager")
    assert supports(model)
    cache_walk(SlotCache(model, "cpu", slots=2), model)  # checks every row against a plain forward
    cache_walk(SlotCache(model, "cpu", slots=2, static=True), model)
    model.config._attn_implementation = "flash_attention_2"
    assert not supports(model)


def test_models_whose_forward_cannot_be_captured_get_static_steps(capsys):
    """bitsandbytes 8-bit layers, offloaded weights and dynamic RoPE break a CUDA graph
    capture: such a model's steps run at the static shapes eagerly on CUDA, said once, and
    no capture is attempted; a plain model gets graphs."""
    from marscli.engine.scheduler import step_plan
    from marscli.models.slots import graphs_blocker

    cuda = torch.device("cuda")
    model = tiny_llama(64)
    assert graphs_blocker(model) is None and step_plan("auto", cuda, model).kind == "graphs"
    model.config.rope_scaling = {"rope_type": "dynamic", "factor": 2.0}
    assert graphs_blocker(model) == "dynamic RoPE scaling"
    assert step_plan("auto", cuda, model).kind == "static" and step_plan("on", cuda, model).kind == "static"
    model.config.rope_scaling = None
    model.hf_device_map = {"model.layers.0": 0, "model.layers.1": "cpu"}
    assert "offloaded" in graphs_blocker(model)
    del model.hf_device_map

    class Linear8bitLt(torch.nn.Linear):
        pass
    model.lm_head = Linear8bitLt(4, 4)
    assert graphs_blocker(model) == "bitsandbytes 8-bit layers"
    assert step_plan("auto", torch.device("cpu"), model).kind == "eager"  # a CPU never captures
    err = capsys.readouterr().err
    assert err.count("no CUDA graphs for this model (dynamic RoPE scaling)") == 1


def test_rows_attend_over_their_own_lengths_group_by_group(monkeypatch):
    """Eager CPU steps attend in groups of rows, each over the columns its rows can see
    (row_runs: the least reads plus a call's cost), not every row over the longest: the
    grouping is the cheapest one, one call where splitting saves little, and every row's
    logits still equal its own plain forward through joins, leaves, drafts and growth."""
    from marscli.models import slots as slots_mod
    from marscli.models.fastpath import GQA_SDPA, install_gqa_attention

    row_runs = slots_mod.row_runs
    assert row_runs([500]) is None and row_runs([300] * 16) is None  # nothing to save
    assert row_runs([100] * 8 + [1500] * 8) == [(0, 8, 100), (8, 16, 1500)]
    assert row_runs([1500, 100, 1500, 100]) == [(0, 1, 1500), (1, 2, 100), (2, 3, 1500), (3, 4, 100)]
    assert row_runs([1500, 1400, 100, 90]) == [(0, 2, 1500), (2, 4, 100)]
    assert row_runs([1000, 990, 1010, 900]) is None  # within RUN_MIN_SAVING of one call
    model = tiny_llama(512)
    install_gqa_attention(model)
    assert model.config._attn_implementation == GQA_SDPA
    used = []

    def every_row_alone(needs):  # the tiny rows are short: split wherever the lengths differ
        runs = row_runs(needs, call_cost=0)
        used.append(runs)
        return runs

    from marscli.models import fastpath

    received = []
    real_attention = fastpath.cpu_sdpa_forward

    real_sdpa, sdpa_calls = fastpath.sdpa, []

    def counted_sdpa(query, *a):
        sdpa_calls.append(query.shape[0])
        return real_sdpa(query, *a)

    def recorded(module, query, key, value, mask, *a, **kw):
        sdpa_calls.clear()
        out = real_attention(module, query, key, value, mask, *a, **kw)
        if kw.get("row_runs"):  # one SDPA call per group, over the group's rows
            received.append(kw["row_runs"])
            assert sdpa_calls == [b - a for a, b, _ in kw["row_runs"]]
        return out

    monkeypatch.setattr(slots_mod, "row_runs", every_row_alone)
    monkeypatch.setattr(fastpath, "cpu_sdpa_forward", recorded)
    monkeypatch.setattr(fastpath, "sdpa", counted_sdpa)
    kv = SlotCache(model, "cpu", slots=2)
    assert cache_walk(kv, model, longer=True)  # checks every row against a plain forward as it goes
    split = [r for r in used if r is not None]
    assert len(split) >= 10 and all(len(r) > 1 for r in split), used
    # every layer's attention got the step's groups
    layers = model.config.num_hidden_layers
    assert received == [r for r in split for _ in range(layers)]
