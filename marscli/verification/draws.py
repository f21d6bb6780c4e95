"""The random draw of each output position: coupled, drafter-invariant sampling.

A sampled record's token at output position t is ONE draw from the target's sampling law
p_t, made with noise that is a function of the record's seed and t alone (never of the step,
the draft length, the batch or the drafter): Gumbel-max, ``argmax_v log p_t(v) + G(seed, t, v)``
with G(seed, t, v) i.i.d. standard Gumbel noise from a counter-based hash. That is the
coupling of "drafter-invariant speculative decoding" (Daliri, Musco, Suresh 2024):

- the emitted token has exactly the law p_t (the Gumbel-max trick);
- a drafter that samples draws its token from its own law q_t with the SAME noise, so it
  agrees with the target's draw with probability at least (1 - d) / (1 + d), d the total
  variation distance between p_t and q_t; a deterministic draft x agrees with probability
  p_t(x), as strict rejection sampling keeps it;
- strict speculative sampling keeps a draft exactly where it equals the draw, so its text
  is the same with any drafter, any draft length, at any batch size, and with none.

Cost. Hashing noise for every token of a 50k-150k vocabulary at every position would cost
more than the rest of the verification, so the draw splits the vocabulary by the law itself
(exactly, not approximately): the *candidates* C = {v : p(v) >= CANDIDATE_RATIO * max p}
get their own noise G(seed, t, v); the rest, the tail T, is represented by one Gumbel variable
of its own, log P(T) + G(seed, t, TAIL), and, when the tail wins, by an inverse-CDF draw
within it with the uniform U(seed, t, TAIL_PICK). The maximum of log p(v) + G_v over T is
distributed as log P(T) + Gumbel and its argmax as p restricted to T, independently of each
other and of the candidates' noise, so the draw's law is exactly p. Two laws with the same
candidates see the same noise; coupling quality is only lost where the tail wins, which
happens with probability at most about P(T).
"""

from __future__ import annotations

import math

import torch

#: A token is a candidate (its own hashed noise) when p(v) >= CANDIDATE_RATIO * max p.
CANDIDATE_RATIO = 1e-4
#: Noise indices of the tail's Gumbel variable and of its inverse-CDF uniform (never a token id).
TAIL = -1
TAIL_PICK = -2

_MASK64 = (1 << 64) - 1


def _signed(c: int) -> int:
    """A 64-bit constant as the int64 torch stores."""
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MIX1 = _signed(0xBF58476D1CE4E5B9)
_MIX2 = _signed(0x94D049BB133111EB)
_TOKEN_SALT = _signed(0xD6E8FEB86659FD93)
_53 = float(1 << 53)


def _lsr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 tensors (multiplication wraps modulo 2^64)."""
    x = (x ^ _lsr(x, 30)) * _MIX1
    x = (x ^ _lsr(x, 27)) * _MIX2
    return x ^ _lsr(x, 31)


def position_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[N] int64 keys of (seed, output position) pairs: the root of every draw's noise."""
    return _mix(_mix(seeds.long() * _GOLDEN + 1) ^ positions.long())


def uniforms(keys: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Uniforms in (0, 1), float64, of (key, index) pairs (keys and index broadcast): a
    token id's noise, or TAIL / TAIL_PICK's."""
    h = _mix(keys ^ (index.long() * _TOKEN_SALT))
    return (_lsr(h, 11).double() + 0.5) / _53


def gumbel(keys: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise of (key, index) pairs, float64."""
    return -torch.log(-torch.log(uniforms(keys, index)))


def reference_uniform(seed: int, position: int, index: int) -> float:
    """The same uniform in plain Python integers: an independent check of the tensor code
    (tests), and what any other implementation must reproduce."""

    def mix(x: int) -> int:
        x &= _MASK64
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
        return x ^ (x >> 31)

    key = mix(mix(seed * 0x9E3779B97F4A7C15 + 1) ^ (position & _MASK64))
    h = mix(key ^ ((index * 0xD6E8FEB86659FD93) & _MASK64))
    return ((h >> 11) + 0.5) / _53


def coupled_draw(
    probs: torch.Tensor,  # [N, V] each row a law (zeros allowed: filtered tokens)
    keys: torch.Tensor,  # [N] int64 position_keys of each row's (seed, position)
    token_ids: torch.Tensor | None = None,  # [V] long: the token id of each column (None: the column)
) -> torch.Tensor:
    """[N] long: each row's draw (a column index), exactly distributed as the row's law, with
    the noise of its key: the module's Gumbel-max over the candidates and the tail.

    token_ids names the columns by target token id when they are not (an EAGLE-3 head's
    draft vocabulary), so that a drafter's draw and the target's see the same noise per
    token."""
    assert probs.dim() == 2 and keys.shape == probs.shape[:1], (tuple(probs.shape), tuple(keys.shape))
    N, V = probs.shape
    dev = probs.device
    if N == 0:
        return torch.zeros(0, dtype=torch.long, device=dev)
    p = probs.float()
    top = p.amax(dim=-1, keepdim=True)  # [N, 1]
    cand = p >= top * CANDIDATE_RATIO  # [N, V] (the top token always)
    keys = keys.to(dev)
    if dev.type in DENSE_DEVICES:
        return _dense_draw(p, cand, keys, token_ids)
    rows, cols = cand.nonzero(as_tuple=True)
    ids = cols if token_ids is None else token_ids.to(dev)[cols]
    score = torch.log(p[rows, cols].double()) + gumbel(keys[rows], ids)  # [M]
    best = torch.full((N,), -math.inf, dtype=torch.float64, device=dev)
    best = best.scatter_reduce(0, rows, score, reduce="amax")
    # the candidate holding each row's best score (the first column on an exact tie)
    hit = score == best[rows]
    pick = torch.full((N,), V, dtype=torch.long, device=dev)
    pick = pick.scatter_reduce(0, rows[hit], cols[hit], reduce="amin")
    tail = p.masked_fill(cand, 0.0)  # [N, V]
    mass = tail.sum(dim=-1).double()  # [N]
    has_tail = mass > 0
    if bool(has_tail.any()):
        tail_score = torch.log(mass.clamp(min=1e-300)) + gumbel(keys, torch.full_like(keys, TAIL))
        wins = has_tail & (tail_score > best)
        if bool(wins.any()):
            w = wins.nonzero(as_tuple=True)[0]
            t_w = tail[w].double()  # [W, V]
            cdf = t_w.cumsum(dim=-1)
            u = uniforms(keys[w], torch.full_like(w, TAIL_PICK)) * cdf[:, -1]
            j = torch.searchsorted(cdf, u.unsqueeze(1), right=True).squeeze(1).clamp(max=V - 1)
            # u * total may round onto the last step's edge: take the last tail token then
            j = torch.where(t_w.gather(1, j.unsqueeze(1)).squeeze(1) > 0, j,
                            (t_w > 0).long().cumsum(-1).argmax(-1))
            pick[w] = j
    return pick


#: Devices where coupled_draw takes the dense path: every column scored and the tail picked
#: for every row, with no host read (on a GPU the sparse path's nonzero() and its two tests
#: of "any row?" are each a transfer and a sync). The same draws as the sparse path, which a
#: CPU keeps: it hashes the candidates only.
DENSE_DEVICES = frozenset({"cuda"})


def _dense_draw(p: torch.Tensor, cand: torch.Tensor, keys: torch.Tensor,
                token_ids: torch.Tensor | None) -> torch.Tensor:
    """coupled_draw's computation over every column: the same scores, the same argmax (the
    first column on an exact tie), the same tail pick, without a host read."""
    N, V = p.shape
    dev = p.device
    ids = torch.arange(V, device=dev) if token_ids is None else token_ids.to(dev)
    noise = gumbel(keys[:, None], ids[None, :])  # [N, V]
    score = torch.where(cand, torch.log(p.double()) + noise, torch.full_like(noise, -math.inf))
    pick = score.argmax(dim=-1)  # [N]
    best = score.gather(1, pick[:, None]).squeeze(1)
    tail = p.masked_fill(cand, 0.0).double()  # [N, V]
    mass = tail.sum(dim=-1)
    tail_score = torch.log(mass.clamp(min=1e-300)) + gumbel(keys, torch.full_like(keys, TAIL))
    wins = (mass > 0) & (tail_score > best)
    cdf = tail.cumsum(dim=-1)
    u = uniforms(keys, torch.full_like(keys, TAIL_PICK)) * cdf[:, -1]
    j = torch.searchsorted(cdf, u.unsqueeze(1), right=True).squeeze(1).clamp(max=V - 1)
    j = torch.where(tail.gather(1, j.unsqueeze(1)).squeeze(1) > 0, j, (tail > 0).long().cumsum(-1).argmax(-1))
    return torch.where(wins, j, pick)
