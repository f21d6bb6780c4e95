"""A walk through the batched KV cache (marscli.models.slots' SlotCache) that the cache tests
share: every row's logits against a plain forward of its
own sequence, through joins, leaves, rejected drafts and rollbacks."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama(max_positions: int = 256):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions)
    return LlamaForCausalLM(cfg).eval()


def cache_walk(kv, model, *, longer: bool = False, on_step=None):
    """Rows join (prompts of different lengths), decode chunks of which a part is rejected,
    leave in several orders and are replaced; returns every row's logits at every step,
    each checked against a plain forward of the row's own sequence. longer: then 12 more
    steps (to outgrow a first capacity), a drafter's rollback of one row, and another leave.
    on_step(kv): called after every step."""
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
        if on_step is not None:
            on_step(kv)

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
        step()
        if not longer:
            return logits
        for _ in range(11):  # long enough to outgrow the first capacity
            step()
        kv.truncate_row(1, len(seqs[1]) - 3)  # a drafter's rollback: the row re-feeds its tail
        seqs[1] = seqs[1][:-2]
        step()
        keep([3, 0])
        step()
    return logits
