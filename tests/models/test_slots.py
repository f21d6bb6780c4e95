"""The slot cache (marscli.models.slots): every row's logits equal a plain forward of its own
sequence through joins, leaves, rejected drafts and growth, and equal the hole cache's."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from marscli.models.kvcache import HoleCache
from marscli.models.slots import SlotCache


def _model():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return LlamaForCausalLM(cfg).eval()


def _walk(kv, model):
    """Rows join (prompts of different lengths), decode chunks of which a part is rejected,
    leave in several orders and are replaced; returns every row's logits at every step,
    each checked against a plain forward of the row's own sequence."""
    gen = torch.Generator().manual_seed(3)
    seqs: list[list[int]] = []
    logits = []

    def join(n):
        ids = torch.randint(0, 50, (n,), generator=gen).tolist()
        kv.add_prefilled(ids[:-1])
        seqs.append(ids)

    def step():
        B = len(seqs)
        chunks = [torch.randint(0, 50, (1 + (b + len(logits)) % 3,), generator=gen).tolist() for b in range(B)]
        K = max(len(c) for c in chunks)
        ids = torch.zeros(B, K, dtype=torch.long)
        new_mask = torch.zeros(B, K, dtype=torch.long)
        for b, c in enumerate(chunks):
            ids[b, : len(c)] = torch.tensor([seqs[b][-1]] + c[1:])
            new_mask[b, : len(c)] = 1
        npos = torch.tensor([len(s) - 1 for s in seqs])
        pos = npos[:, None] + torch.arange(K)[None, :]
        out = kv.forward(ids, new_mask, pos).logits
        for b, c in enumerate(chunks):  # each row keeps 1 + some of its new positions
            fed = [seqs[b][-1]] + c[1:]
            logits.append(out[b, : len(c)].clone())
            ref = model(input_ids=torch.tensor([seqs[b][:-1] + fed])).logits[0, len(seqs[b]) - 1:]
            torch.testing.assert_close(out[b, : len(c)], ref, rtol=1e-4, atol=1e-4)
            keep = 1 + (b + len(logits)) % len(c)
            new_mask[b, keep:] = 0
            seqs[b] = seqs[b][:-1] + fed[:keep] + [int(out[b, keep - 1].argmax())]
        kv.commit(new_mask)
        kv.trim()

    def keep(rows):
        kv.keep_rows(rows)
        seqs[:] = [seqs[b] for b in rows]

    with torch.inference_mode():
        for n in (7, 3, 9):
            join(n)
        for _ in range(3):
            step()
        keep([0, 2])  # the middle row leaves (order kept)
        join(4)
        step()
        keep([2, 1])  # the first row leaves, the last takes its place
        join(6)
        join(2)
        step()
        for _ in range(12):  # long enough to outgrow the first capacity
            step()
        kv.truncate_row(1, len(seqs[1]) - 3)  # a drafter's rollback: the row re-feeds its tail
        seqs[1] = seqs[1][:-2]
        step()
        keep([3, 0])
        step()
    return logits


@pytest.mark.parametrize("bucket,static", [(1, False), (16, False), (1, True), (16, True)],
                         ids=["exact", "span-bucket", "static", "static-span-bucket"])
def test_slot_cache_rows_see_only_their_own_tokens(bucket, static):
    """Every row's logits equal its own plain forward and the hole cache's, eager or at the
    static shapes a captured step runs (rows, new tokens and span padded up to buckets)."""
    model = _model()
    kv = SlotCache(model, "cpu", slots=2, bucket=bucket, static=static)  # too few slots at first: it grows
    got = _walk(kv, model)
    holes = _walk(HoleCache(model, "cpu", masked=True, batch_capacity=4), model)
    assert len(got) == len(holes)
    for a, b in zip(got, holes):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert kv.slots >= 4 and kv.capacity % bucket == 0
    if static:  # 3 rows ran as 4, 2 rows as 2, 1-3 new tokens as 2 or 4: a shape each
        assert {(b, s) for b, s, _ in kv.steps.shapes} >= {(4, 4), (2, 4)}


def test_rollback_is_a_length_change_and_a_leaving_row_moves_nothing_else():
    model = _model()
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
    model = _model()
    kv = SlotCache(model, "cpu", slots=4, graphs=True)
    got = _walk(kv, model)  # checks every row against a plain forward as it goes
    assert got and kv.graphs is False and kv.steps.captures == 0 and kv.steps.capture_error
    err = capsys.readouterr().err
    assert err.count("capturing a step as a CUDA graph failed") == 1
