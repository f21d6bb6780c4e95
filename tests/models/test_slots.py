"""The slot cache (marscli.models.slots): every row's logits equal a plain forward of its own
sequence through joins, leaves, rejected drafts and growth, and equal the hole cache's."""

from __future__ import annotations

import pytest
import torch

from marscli.models.kvcache import HoleCache
from marscli.models.slots import SlotCache
from tests.models.cache_walks import cache_walk, tiny_llama


@pytest.mark.parametrize("bucket,static", [(1, False), (16, False), (1, True), (16, True)],
                         ids=["exact", "span-bucket", "static", "static-span-bucket"])
def test_slot_cache_rows_see_only_their_own_tokens(bucket, static):
    """Every row's logits equal its own plain forward and the hole cache's, eager or at the
    static shapes a captured step runs (rows, new tokens and span padded up to buckets)."""
    model = tiny_llama(512)
    kv = SlotCache(model, "cpu", slots=2, bucket=bucket, static=static)  # too few slots at first: it grows
    got = cache_walk(kv, model, longer=True)
    holes = cache_walk(HoleCache(model, "cpu", masked=True, batch_capacity=4), model, longer=True)
    assert len(got) == len(holes)
    for a, b in zip(got, holes):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
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
