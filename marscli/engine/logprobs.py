"""Log-probabilities of emitted tokens, from the verification forward that already scored them.

The target's one forward pass of a step scores [pending, d_1 .. d_k] of every row: position j
holds the target's distribution for the token after the j-th fed token, so the emitted tokens
(the accepted drafts d_1 .. d_n, then the correction or bonus) are scored at positions 0 .. n.
No extra forward runs.

Which distribution: ``log_softmax`` of the RAW target logits in float32 (vLLM's default
"raw logprobs"), whatever the temperature, top-k or top-p: a token's logprob is the target's
own, so a greedy run and a sampled run report the same value for the same context, and a token
that a relaxed (MARS) rule accepted shows what the target thought of it. The values are
gathered on the device and travel to the host in the step's one device-to-host transfer
(packed as int32 bit patterns beside the verdicts: ``pack`` / ``unpack``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token: its id, the target's log-probability, and the most likely
    alternatives [(token id, logprob), ...], most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def emitted_tokens(drafts: torch.Tensor,  # [B, K] long
                   num_accepted: torch.Tensor,  # [B] long
                   next_token: torch.Tensor,  # [B] long
                   ) -> torch.Tensor:
    """[B, K+1] the tokens a step emits at positions 0 .. n_b (the accepted drafts, then the
    next token); what lies beyond n_b is never read."""
    B, K = drafts.shape
    out = torch.cat([drafts, drafts.new_zeros(B, 1)], dim=1)
    out.scatter_(1, num_accepted.view(B, 1).long(), next_token.view(B, 1).long())
    return out


def gather(logits: torch.Tensor,  # [B, S, V] raw target logits
           tokens: torch.Tensor,  # [B, S] long
           top: int,
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logprob of each token [B, S] float32, top ids [B, S, top] long, top logprobs
    [B, S, top] float32), from log_softmax of the raw logits."""
    assert logits.dim() == 3 and tokens.shape == logits.shape[:2], (tuple(logits.shape), tuple(tokens.shape))
    lsm = torch.log_softmax(logits.float(), dim=-1)  # [B, S, V]
    chosen = lsm.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # [B, S]
    if top > 0:
        top_lp, top_ids = lsm.topk(min(top, lsm.shape[-1]), dim=-1)  # [B, S, top]
    else:
        top_lp = lsm.new_zeros(lsm.shape[:2] + (0,))
        top_ids = tokens.new_zeros(tokens.shape + (0,))
    return chosen, top_ids, top_lp


def _bits(x: torch.Tensor) -> torch.Tensor:
    """float32 values -> their int32 bit patterns, as long (exact, reversible)."""
    return x.float().contiguous().view(torch.int32).long()


def pack(chosen: torch.Tensor,  # [B, S] float32
         top_ids: torch.Tensor,  # [B, S, T] long
         top_lp: torch.Tensor,  # [B, S, T] float32
         ) -> torch.Tensor:
    """[B, S * (1 + 2T)] long: per position its logprob's bits, then T ids, then T logprobs'
    bits; appended to the verdicts so the step keeps ONE device-to-host transfer."""
    B, S, T = top_ids.shape
    cols = torch.cat([_bits(chosen).unsqueeze(-1), top_ids.long(), _bits(top_lp)], dim=-1)  # [B, S, 1+2T]
    return cols.reshape(B, S * (1 + 2 * T))


def _floats(ints: list[int]) -> list[float]:
    return torch.tensor(ints, dtype=torch.long).to(torch.int32).view(torch.float32).tolist()


def unpack(row: list[int], tokens: list[int], T: int, top: int) -> list[TokenLogprob]:
    """One row's packed values (from `pack`, T alternatives computed) -> a TokenLogprob per
    token of `tokens` (positions 0 .. len(tokens)-1), keeping `top` <= T alternatives."""
    width = 1 + 2 * T
    out = []
    for j, tok in enumerate(tokens):
        cell = row[j * width: (j + 1) * width]
        values = _floats([cell[0]] + cell[1 + T: 1 + 2 * T])
        alts = tuple(zip(cell[1: 1 + top], values[1: 1 + top]))
        out.append(TokenLogprob(int(tok), values[0], alts))
    return out
