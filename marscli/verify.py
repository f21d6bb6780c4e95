"""Verification of draft tokens: strict and margin-aware (MARS), greedy and sampling.

Pure tensor functions: no model, no I/O, no hidden random state. Randomness comes in as
uniform draws chosen by the caller, so a result is a function of its arguments alone (and a
batch row's result never depends on the other rows).

Words used throughout marscli (fixed here, kept everywhere):

- **target**: the model whose output we want. **drafter**: what proposes tokens.
- **step**: the drafter proposes up to K tokens; the target scores them in one forward pass
  and returns K+1 rows of logits (row i scores the token that follows draft i-1; row 0 scores
  the first draft, row K the token after all K drafts).
- **accepted**: draft tokens kept in a step (always a prefix of the drafts).
- **relaxed**: accepted only because MARS relaxed the check: the draft equals the target's
  top-2 token at a low-margin position (in sampling mode also: the draft is the top-1 token
  but strict rejection sampling would have rejected it).
- **correction**: the token the target emits at the first rejected position.
- **bonus**: the extra target token emitted after all drafts of a row were accepted.
- **margin statistic**: from the target's raw float32 logits z1 >= z2 (top-1, top-2) at a
  position: ``logit-ratio`` r = z2 / z1 (the paper's; relaxable only if z1 > 0) or
  ``prob-ratio`` p2 / p1 = exp(z2 - z1) (invariant to a constant logit shift).
- **theta**: the threshold; a position is **relaxable** when its statistic exceeds theta.
  theta = +inf makes MARS identical to strict verification.
- **acceptance length** (tau): tokens emitted per step, bonus/correction included.

Every function takes drafts ``[B, K]`` and target logits ``[B, K+1, V]`` and an optional
``draft_len`` ``[B]``: row b proposed only its first ``draft_len[b]`` drafts (the rest is
padding and never accepted). The token emitted after the accepted prefix is a correction when
the row rejected one of its own drafts and a bonus when it accepted all of them; a bonus is
drawn from the plain target distribution.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

LOGIT_RATIO = "logit-ratio"
PROB_RATIO = "prob-ratio"
MARGINS = (LOGIT_RATIO, PROB_RATIO)

#: Statistic value of positions that can never be relaxed (z1 <= 0 under logit-ratio).
NOT_RELAXABLE = -math.inf


@dataclass
class VerifyResult:
    """Outcome of verifying one step for every row of a batch."""

    num_accepted: torch.Tensor  # [B] long, 0..draft_len[b]
    next_token: torch.Tensor  # [B] long: correction or bonus
    relaxed: torch.Tensor  # [B, K] bool: accepted only thanks to MARS
    relaxable: torch.Tensor  # [B, K] bool: statistic > theta at that draft position
    statistic: torch.Tensor  # [B, K] float32: the margin statistic at each draft position

    def emitted(self, drafts: torch.Tensor, b: int) -> list[int]:
        """Tokens row b emits this step: its accepted drafts, then the next token."""
        n = int(self.num_accepted[b])
        return drafts[b, :n].tolist() + [int(self.next_token[b])]


# ----------------------------------------------------------------------------- margins


def top2(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-1 and top-2 logits and token ids along the last dim.

    Ties resolve to the lowest token id, as torch.argmax (and so transformers' greedy
    search) does: top-1 is argmax; top-2 is argmax with the top-1 entry removed.
    Returns (z1, z2, t1, t2), each shaped like ``logits[..., 0]``.
    """
    x = logits.float()
    t1 = x.argmax(dim=-1)
    z1 = x.gather(-1, t1.unsqueeze(-1)).squeeze(-1)
    masked = x.scatter(-1, t1.unsqueeze(-1), -math.inf)
    t2 = masked.argmax(dim=-1)
    z2 = masked.gather(-1, t2.unsqueeze(-1)).squeeze(-1)
    return z1, z2, t1, t2


def margin_statistic(z1: torch.Tensor, z2: torch.Tensor, margin: str) -> torch.Tensor:
    """The margin statistic from top-1/top-2 raw logits (higher = closer call).

    logit-ratio: z2 / z1 where z1 > 0, else NOT_RELAXABLE (the ratio has no meaning there).
    prob-ratio: exp(z2 - z1) in [0, 1]; 0 when z2 = -inf.
    """
    z1 = z1.float()
    z2 = z2.float()
    if margin == LOGIT_RATIO:
        ratio = z2 / torch.where(z1 > 0, z1, torch.ones_like(z1))
        stat = torch.where(z1 > 0, ratio, torch.full_like(z1, NOT_RELAXABLE))
    elif margin == PROB_RATIO:
        stat = torch.exp(z2 - z1)
        stat = torch.where(torch.isfinite(z1), stat, torch.zeros_like(stat))
    else:
        raise ValueError(f"unknown margin statistic {margin!r}; expected one of {MARGINS}")
    return torch.nan_to_num(stat, nan=NOT_RELAXABLE, neginf=NOT_RELAXABLE)


def _draft_mask(drafts: torch.Tensor, draft_len: torch.Tensor | None) -> torch.Tensor:
    """[B, K] bool: which draft slots hold real proposals."""
    B, K = drafts.shape
    if draft_len is None:
        return torch.ones(B, K, dtype=torch.bool, device=drafts.device)
    pos = torch.arange(K, device=drafts.device).unsqueeze(0)
    return pos < draft_len.to(drafts.device).unsqueeze(1)


def _check_shapes(drafts: torch.Tensor, logits: torch.Tensor) -> None:
    assert drafts.dim() == 2, f"drafts must be [B, K], got {tuple(drafts.shape)}"
    assert logits.dim() == 3, f"logits must be [B, K+1, V], got {tuple(logits.shape)}"
    B, K = drafts.shape
    assert logits.shape[:2] == (B, K + 1), (
        f"logits {tuple(logits.shape)} do not match drafts {tuple(drafts.shape)}: need [B, K+1, V]"
    )


def _prefix_len(ok: torch.Tensor) -> torch.Tensor:
    """[B, K] bool -> [B] long: length of the leading run of True."""
    if ok.shape[1] == 0:
        return torch.zeros(ok.shape[0], dtype=torch.long, device=ok.device)
    return ok.long().cumprod(dim=1).sum(dim=1)


def _stats(logits_k: torch.Tensor, theta: float, margin: str):
    """Top-2 and relaxability for the K draft rows. logits_k: [B, K, V]."""
    z1, z2, t1, t2 = top2(logits_k)
    stat = margin_statistic(z1, z2, margin)
    relaxable = stat > theta  # +inf theta: never
    return t1, t2, stat, relaxable


# ----------------------------------------------------------------------------- greedy


def strict_greedy(
    drafts: torch.Tensor,  # [B, K] long
    logits: torch.Tensor,  # [B, K+1, V]
    draft_len: torch.Tensor | None = None,  # [B] long
) -> VerifyResult:
    """Accept drafts while they equal the target's argmax; then emit the argmax."""
    _check_shapes(drafts, logits)
    B, K = drafts.shape
    argmax = logits.float().argmax(dim=-1)  # [B, K+1]
    ok = (drafts == argmax[:, :K]) & _draft_mask(drafts, draft_len)
    n = _prefix_len(ok)
    nxt = argmax.gather(1, n.unsqueeze(1)).squeeze(1)
    none = torch.zeros(B, K, dtype=torch.bool, device=drafts.device)
    return VerifyResult(n, nxt, none, none.clone(), torch.full((B, K), NOT_RELAXABLE))


def mars_greedy(
    drafts: torch.Tensor,  # [B, K] long
    logits: torch.Tensor,  # [B, K+1, V]
    theta: float,
    margin: str = LOGIT_RATIO,
    draft_len: torch.Tensor | None = None,  # [B] long
) -> VerifyResult:
    """MARS greedy verification (paper, Algorithm 1).

    At each draft position: accept if the draft is the target's top-1; else accept (relaxed)
    if it is the top-2 and the position is relaxable; else emit the top-1 and stop.
    """
    _check_shapes(drafts, logits)
    B, K = drafts.shape
    t1, t2, stat, relaxable = _stats(logits[:, :K], theta, margin)
    valid = _draft_mask(drafts, draft_len)
    exact = drafts == t1
    relax_ok = (drafts == t2) & relaxable & ~exact
    n = _prefix_len((exact | relax_ok) & valid)
    accepted = torch.arange(K, device=drafts.device).unsqueeze(0) < n.unsqueeze(1)
    argmax = logits.float().argmax(dim=-1)  # [B, K+1]
    nxt = argmax.gather(1, n.unsqueeze(1)).squeeze(1)
    return VerifyResult(n, nxt, relax_ok & accepted, relaxable & valid, stat)


# ----------------------------------------------------------------------------- sampling


def sampling_probs(
    logits: torch.Tensor,  # [..., V]
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
) -> torch.Tensor:
    """The target's sampling distribution, float32 [..., V].

    Same order and tie rules as transformers' warpers: temperature, then top-k (keeps every
    token whose logit reaches the k-th largest), then top-p (drops the low tail whose mass is
    at most 1 - top_p, keeping at least one token). Filtered tokens get probability 0.
    """
    assert temperature > 0, "sampling_probs needs temperature > 0; greedy uses argmax"
    x = logits.float() / temperature
    V = x.shape[-1]
    if 0 < top_k < V:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, -math.inf)
    if top_p < 1.0:
        sorted_x, idx = torch.sort(x, dim=-1, descending=False)
        cum = sorted_x.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cum <= (1.0 - top_p)
        remove_sorted[..., -1] = False  # always keep the most likely token
        remove = remove_sorted.scatter(-1, idx, remove_sorted)
        x = x.masked_fill(remove, -math.inf)
    return torch.softmax(x, dim=-1)


def sample_from(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: probs [B, V], u [B] in [0, 1) -> token ids [B] long.

    Deterministic given u; never returns a token of probability 0.
    """
    cdf = probs.double().cumsum(dim=-1)  # [B, V]
    total = cdf[:, -1:]
    x = u.double().unsqueeze(1) * total
    idx = torch.searchsorted(cdf, x, right=True).squeeze(1)
    idx = idx.clamp(max=probs.shape[-1] - 1)
    # u * total can round up to total: fall back to the most likely token in that corner.
    bad = probs.gather(1, idx.unsqueeze(1)).squeeze(1) <= 0
    if bool(bad.any()):
        idx = torch.where(bad, probs.argmax(dim=-1), idx)
    return idx


def _residual(p: torch.Tensor, q: torch.Tensor | None, draft: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) per row; q None means one-hot at `draft`. p: [B, V]."""
    if q is None:
        r = p.scatter(1, draft.unsqueeze(1), 0.0)
    else:
        r = (p - q).clamp(min=0.0)
    mass = r.sum(dim=-1, keepdim=True)
    # Rejection implies p(x) < q(x), so the residual has mass; guard rounding anyway.
    return torch.where(mass > 0, r / mass.clamp(min=1e-30), p)


def strict_sampling_accepts(
    drafts: torch.Tensor,  # [B, K] long
    p: torch.Tensor,  # [B, K, V] target sampling probabilities at the K draft positions
    u_accept: torch.Tensor,  # [B, K] uniforms in [0, 1)
    draft_probs: torch.Tensor | None = None,  # [B, K, V]; None: one-hot q
) -> torch.Tensor:
    """[B, K] bool: would strict rejection sampling accept each draft on its own
    (u < min(1, p(x) / q(x)) and p(x) > 0)? Positions are judged independently: the accepted
    prefix is the caller's business."""
    B, K = drafts.shape
    p_x = p.gather(2, drafts.unsqueeze(2)).squeeze(2)  # [B, K]
    if draft_probs is None:
        q_x = torch.ones_like(p_x)
    else:
        assert draft_probs.shape == (B, K, p.shape[-1]), f"draft_probs {tuple(draft_probs.shape)}"
        q_x = draft_probs.gather(2, drafts.unsqueeze(2)).squeeze(2).float()
    # Compare in float64: a float64 uniform just below 1 must not round up to 1 and reject a
    # certain draft.
    ok = u_accept.double() < (p_x.double() / q_x.double().clamp(min=1e-30)).clamp(max=1.0)
    return ok & (p_x > 0)


def speculative_sampling(
    drafts: torch.Tensor,  # [B, K] long
    logits: torch.Tensor,  # [B, K+1, V] raw target logits
    u_accept: torch.Tensor,  # [B, K] uniforms in [0, 1)
    u_sample: torch.Tensor,  # [B] uniform in [0, 1) for the correction/bonus
    *,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    draft_probs: torch.Tensor | None = None,  # [B, K, V]; None: deterministic drafter (one-hot q)
    theta: float = math.inf,
    margin: str = LOGIT_RATIO,
    draft_len: torch.Tensor | None = None,  # [B] long
) -> VerifyResult:
    """Speculative sampling; strict for theta = +inf, MARS sampling otherwise.

    Strict (Leviathan et al.): accept draft x with probability min(1, p(x) / q(x)); at the
    first rejection emit a correction from norm(max(0, p - q)); after K acceptances a bonus
    from p. This reproduces the target's sampling distribution p exactly.

    MARS (the authors' released code): at a relaxable position (statistic from the raw
    logits > theta) accept x outright if it is the target's top-1 or top-2 token and p(x) > 0;
    otherwise reject and draw the correction from p itself. Other positions stay strict.
    """
    _check_shapes(drafts, logits)
    B, K = drafts.shape
    p = sampling_probs(logits, temperature, top_k, top_p)  # [B, K+1, V]
    valid = _draft_mask(drafts, draft_len)
    t1, t2, stat, relaxable = _stats(logits[:, :K], theta, margin)
    relaxable = relaxable & valid

    p_x = p[:, :K].gather(2, drafts.unsqueeze(2)).squeeze(2)  # [B, K]
    strict_ok = strict_sampling_accepts(drafts, p[:, :K], u_accept, draft_probs)
    in_top2 = ((drafts == t1) | (drafts == t2)) & (p_x > 0)
    ok = torch.where(relaxable, in_top2, strict_ok) & valid
    n = _prefix_len(ok)
    accepted = torch.arange(K, device=drafts.device).unsqueeze(0) < n.unsqueeze(1)
    relaxed = accepted & relaxable & ~strict_ok

    # The next token: from row n of p, or of the residual when a strict check rejected there.
    rows = torch.arange(B, device=drafts.device)
    p_n = p[rows, n]  # [B, V]
    rejected_own = n < (draft_len if draft_len is not None else torch.full_like(n, K))
    use_residual = torch.zeros(B, dtype=torch.bool, device=drafts.device)
    if K > 0:
        n_c = n.clamp(max=K - 1)
        use_residual = rejected_own & ~relaxable[rows, n_c]
    dist = p_n
    if bool(use_residual.any()):
        d_n = drafts[rows, n.clamp(max=max(K - 1, 0))]
        q_n = None if draft_probs is None else draft_probs[rows, n.clamp(max=K - 1)].float()
        dist = torch.where(use_residual.unsqueeze(1), _residual(p_n, q_n, d_n), p_n)
    nxt = sample_from(dist, u_sample)
    return VerifyResult(n, nxt, relaxed, relaxable, stat)


def verify(
    drafts: torch.Tensor,  # [B, K]
    logits: torch.Tensor,  # [B, K+1, V]
    *,
    theta: float,
    margin: str = LOGIT_RATIO,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    u_accept: torch.Tensor | None = None,  # [B, K]
    u_sample: torch.Tensor | None = None,  # [B]
    draft_probs: torch.Tensor | None = None,  # [B, K, V]
    draft_len: torch.Tensor | None = None,  # [B]
) -> VerifyResult:
    """Dispatch to the right rule: greedy when temperature == 0, else sampling."""
    if temperature == 0.0:
        if math.isinf(theta) and theta > 0:
            return strict_greedy(drafts, logits, draft_len)
        return mars_greedy(drafts, logits, theta, margin, draft_len)
    assert u_accept is not None and u_sample is not None, "sampling needs uniforms"
    return speculative_sampling(
        drafts,
        logits,
        u_accept,
        u_sample,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        draft_probs=draft_probs,
        theta=theta,
        margin=margin,
        draft_len=draft_len,
    )
