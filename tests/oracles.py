"""Independent oracles the tests compare the engine with (fixtures are in conftest.py)."""

from __future__ import annotations

import torch

from marscli.verification.rules import margin_statistic, top2


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


def replay_mars(target, ids: list[int], out: list[int], theta: float, margin: str) -> int:
    """MARS greedy's law on an output, by one full target forward over prompt + output: every
    emitted token is the target's top-1, or its top-2 where the margin statistic exceeds theta.
    Returns how many tokens were top-2 (relaxed)."""
    with torch.no_grad():
        logits = target.model(torch.tensor([ids + out])).logits[0, len(ids) - 1: len(ids) + len(out) - 1]
    z1, z2, t1, t2 = top2(logits)
    stat = margin_statistic(z1, z2, margin)
    relaxed = 0
    for i, tok in enumerate(out):
        if tok == int(t1[i]):
            continue
        # Tiny float differences between a (k+1)-token and a full forward only matter at
        # exact near-ties; the tiny model has none at these prompts.
        assert tok == int(t2[i]) and float(stat[i]) > theta, (i, tok, int(t1[i]), int(t2[i]), float(stat[i]))
        relaxed += 1
    return relaxed


def position_loop(model, ids: list[int], max_new: int, proposal, judge, eos: frozenset[int] = frozenset(),
                  after=None) -> tuple[list[int], int]:
    """The position-wise rule as a plain loop without a cache: at every output position the
    drafter's proposal for it (proposal(text) -> a token or None, text = prompt + output so
    far) is judged on the target's logits from a full forward pass over the text:
    judge(z, prop, out, relaxed) -> (the token emitted, whether the rule relaxed to it). The
    output ends at max_new tokens or after its first token of eos; after(token) sees each
    token. Returns (the output, how many tokens were relaxed). No step, no draft length: the
    text the engine must compute whatever its schedule."""
    out: list[int] = []
    relaxed = 0
    while len(out) < max_new:
        text = ids + out
        with torch.no_grad():
            z = model(torch.tensor([text])).logits[0, -1].float()
            prop = proposal(text)
        tok, was_relaxed = judge(z, prop, out, relaxed)
        out.append(tok)
        relaxed += bool(was_relaxed)
        if after is not None:
            after(tok)
        if tok in eos:
            break
    return out, relaxed
