"""Independent oracles the tests compare the engine with (fixtures are in conftest.py)."""

from __future__ import annotations

import torch


def hf_greedy(model, ids: list[int], max_new: int) -> list[int]:
    """transformers' own greedy generate(): the reference for strict greedy output. Give it a
    model the engine never patched (conftest's ``oracle``) unless the patched kernels are
    what is being checked against (int8 weights: the quantized model is the reference)."""
    dev = model.device  # the CPU, or the GPU for tests/models/test_cuda.py
    out = model.generate(torch.tensor([ids], device=dev),
                         attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=dev),
                         do_sample=False, max_new_tokens=max_new,
                         pad_token_id=model.generation_config.pad_token_id)
    return out[0, len(ids):].tolist()


def oracle_logprobs(model, prompt_ids: list[int], out_ids: list[int]):
    """log_softmax of transformers' own forward over prompt + output, at the positions that
    predict the output's tokens: [len(out_ids), V]."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + out_ids])).logits[0].float()
    return torch.log_softmax(logits[len(prompt_ids) - 1: len(prompt_ids) - 1 + len(out_ids)], -1)


def check_logprobs(model, prompt_ids, res, top):
    """A result's logprobs and its `top` alternatives are the oracle's (oracle_logprobs)."""
    lsm = oracle_logprobs(model, prompt_ids, res.token_ids)
    assert [e.token for e in res.logprobs] == res.token_ids
    got = torch.tensor([e.logprob for e in res.logprobs])
    want = lsm.gather(-1, torch.tensor(res.token_ids).unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    for j, e in enumerate(res.logprobs):
        assert len(e.top) == top
        # the alternatives' values are the oracle's top values, and each is its token's own
        torch.testing.assert_close(torch.tensor([v for _, v in e.top]), lsm[j].topk(top).values, rtol=0, atol=1e-4)
        torch.testing.assert_close(torch.tensor([v for _, v in e.top]), lsm[j, [t for t, _ in e.top]],
                                   rtol=0, atol=1e-4)
