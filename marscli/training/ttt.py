"""EAGLE-3's training objective: forward KL against the target, unrolled as drafting unrolls.

Words (marscli.drafters.eagle3_head): head *entry* j pairs the target's features at
committed position j with token j+1; its output predicts token j+2, whose target
distribution is the target's softmax after position j+1.

Training-time test (Li et al., EAGLE-3, arXiv 2503.01840, section 3.2): drafting feeds the
head its own output hidden states after the first draft, so training does too. Pass 0 runs
every entry on the target's features, in one causal pass. Pass u (1 <= u < steps) runs entry
j (j >= u) on pass u-1's output at entry j-1 and token j+1, at position j, and lets it see
what drafting would let it see: the committed entries up to j-u (the target's features),
its own chain of earlier passes' entries j-u+1 .. j-1 (one per pass), and itself. That is
exactly the head state the drafter (marscli.drafters.eagle3) builds when it drafts u+1
tokens after committing position j-u+1, so pass u's prediction at entry j is the drafter's
(u+1)-th draft after entry j-u when the first u drafts were right (tokens j-u+2 .. j+1).

The loss of pass u is the mean over the loss-masked entries of KL(p || q_u), p the target's
distribution restricted to the draft vocabulary (renormalised), q_u the head's, weighted
0.8^u (EAGLE-3's and SpecForge's weights); an entry whose target top-1 token is outside the
draft vocabulary is left out, as SpecForge does (no draft could match it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from marscli.drafters.eagle3_head import Eagle3Head

#: Weight of pass u: STEP_DECAY ** u.
STEP_DECAY = 0.8


@dataclass
class Batch:
    """A padded batch of recorded sequences (right padding: causal attention never reaches
    the pad of a shorter row, so positions stay 0..L-1 per row).

    features: [B, L, n_features] target features per position;
    tokens:   [B, L] token ids (pad: any id);
    p:        [B, L, D] the target's distribution over the draft vocabulary after each
              position (the renormalised softmax of its logits on those tokens);
    target_top_in: [B, L] bool, whether the target's top-1 token after the position is in
              the draft vocabulary;
    loss_mask: [B, L] bool, positions whose next token the loss should predict (the answer;
              False on pads).
    """

    features: torch.Tensor
    tokens: torch.Tensor
    p: torch.Tensor
    target_top_in: torch.Tensor
    loss_mask: torch.Tensor

    def __post_init__(self) -> None:
        B, L = self.tokens.shape
        assert self.features.shape[:2] == (B, L), (tuple(self.features.shape), (B, L))
        assert self.p.shape[:2] == (B, L), tuple(self.p.shape)
        assert self.target_top_in.shape == self.loss_mask.shape == (B, L)


def pass_mask(S: int, u: int, device: torch.device) -> torch.Tensor:
    """Attention mask of pass u >= 1 -> [1, 1, S-u, S + sum_{w=1}^{u-1} (S-w) + (S-u)] bool.

    Row i is entry j = i + u. Columns: the S committed entries (visible up to j-u), then each
    earlier pass w's S-w entries (pass w's index i' is entry i' + w; visible: the one on this
    chain, entry j-u+w, i.e. index i), then this pass's own entries (itself)."""
    n = S - u
    j = torch.arange(u, S, device=device)
    cols = [torch.arange(S, device=device)[None, :] <= (j - u)[:, None]]
    for w in range(1, u):
        cols.append(torch.arange(S - w, device=device)[None, :] == torch.arange(n, device=device)[:, None])
    cols.append(torch.eye(n, dtype=torch.bool, device=device))
    return torch.cat(cols, 1)[None, None]


def unrolled_outputs(head: Eagle3Head, features: torch.Tensor, tokens: torch.Tensor,
                     steps: int) -> list[torch.Tensor]:
    """The head's output hidden states of every training-time-test pass.

    features [B, L, n_features], tokens [B, L] -> a list of min(steps, L-1) tensors; pass u's
    is [B, S-u, H] (S = L-1) and its row i is entry j = i + u, which predicts token j+2."""
    B, L = tokens.shape
    S = L - 1
    assert S >= 1 and 1 <= steps, (L, steps)
    dev = features.device
    pos = torch.arange(S, device=dev).expand(B, S)
    out, keys, values = head(features[:, :S], tokens[:, 1:], pos, target_features=True)
    outs = [out]
    for u in range(1, min(steps, S)):
        n = S - u
        out, k, v = head(out[:, :n], tokens[:, 1 + u:], pos[:, u:], (keys, values),
                         pass_mask(S, u, dev), target_features=False)
        outs.append(out)
        keys, values = torch.cat([keys, k], 2), torch.cat([values, v], 2)
    return outs


def unrolled_logits(head: Eagle3Head, features: torch.Tensor, tokens: torch.Tensor,
                    steps: int) -> list[torch.Tensor]:
    """unrolled_outputs through the head's LM head: pass u's [B, S-u, D] draft logits."""
    return [head.draft_logits(o) for o in unrolled_outputs(head, features, tokens, steps)]


def entry_weights(batch: Batch, u: int) -> torch.Tensor:
    """[B, S-u] bool: where pass u's entry counts in the loss. Entry j predicts the token
    after position j+1: it counts when that position is in the loss mask and the target's
    top-1 there is draftable."""
    m = batch.loss_mask & batch.target_top_in  # [B, L]
    S = batch.tokens.shape[1] - 1
    return m[:, 1 + u: S + 1]


def ttt_loss(head: Eagle3Head, batch: Batch, steps: int) -> tuple[torch.Tensor, list[dict]]:
    """The weighted training-time-test loss of a batch and, per pass, its KL and top-1
    agreement with the target (over the counted entries). The LM head runs on the counted
    entries only (the prompt's need no logits: on a CPU the LM head is most of the cost)."""
    outs = unrolled_outputs(head, batch.features, batch.tokens, steps)
    total = batch.features.new_zeros((), dtype=torch.float32)
    stats = []
    for u, out in enumerate(outs):
        w = entry_weights(batch, u)  # [B, S-u]
        count = int(w.sum())
        if not count:
            stats.append({"pass": u, "kl": 0.0, "top1": 0.0, "entries": 0})
            continue
        p = batch.p[:, 1 + u: 1 + u + out.shape[1]][w].float()  # [M, D]
        logq = torch.log_softmax(head.draft_logits(out[w]), -1)  # [M, D]
        kl = (p * (torch.log(p.clamp_min(1e-30)) - logq)).sum(-1)  # [M]
        loss_u = kl.mean()
        total = total + STEP_DECAY ** u * loss_u
        agree = (logq.argmax(-1) == p.argmax(-1)).float().mean()
        stats.append({"pass": u, "kl": float(loss_u.detach()), "top1": float(agree), "entries": count})
    return total, stats


# --------------------------------------------------------------------------------------------
# Simulated acceptance


def chain_matches(head: Eagle3Head, features: torch.Tensor, tokens: torch.Tensor, k: int) -> torch.Tensor:
    """For every committed entry c, how many of the greedy chain's first k drafts after it
    equal the sequence's tokens, counting from the first: [B, S] int (S = L-1).

    The drafts after entry c are the argmaxes of pass u at entry c+u (u < k), mapped to target
    ids; draft u predicts token c+u+2 and counts while every earlier draft matched (which is
    also when pass u's input tokens are the ones drafting feeds it). Drafts past the end of
    the sequence never match."""
    B, L = tokens.shape
    S = L - 1
    with torch.no_grad():
        per_pass = unrolled_logits(head, features, tokens, k)
    run = torch.ones(B, S, dtype=torch.bool, device=tokens.device)
    count = torch.zeros(B, S, dtype=torch.long, device=tokens.device)
    for u, logits in enumerate(per_pass):
        draft = head.to_target(logits.argmax(-1))  # [B, S-u], row i: entry c = i
        # entry c's draft u is pass u's entry c+u (row c), predicting token c+u+2
        n_valid = max(0, L - (u + 2))  # entries c with c+u+2 < L
        hit = torch.zeros(B, S, dtype=torch.bool, device=tokens.device)
        if n_valid:
            hit[:, :n_valid] = draft[:, :n_valid] == tokens[:, u + 2: u + 2 + n_valid]
        run = run & hit
        count = count + run.long()
    return count


@dataclass
class WalkStats:
    """What strict greedy speculative decoding with a fixed chain of k would record."""

    steps: int
    emitted: int
    accepted_per_position: list[int]
    drafted_per_position: list[int]

    @property
    def acceptance_length(self) -> float:
        return self.emitted / self.steps if self.steps else 0.0

    def add(self, other: WalkStats) -> WalkStats:
        return WalkStats(self.steps + other.steps, self.emitted + other.emitted,
                         [a + b for a, b in zip(self.accepted_per_position, other.accepted_per_position, strict=True)],
                         [a + b for a, b in zip(self.drafted_per_position, other.drafted_per_position, strict=True)])


def empty_walk(k: int) -> WalkStats:
    return WalkStats(0, 0, [0] * k, [0] * k)


def walk(matches: list[int], prompt_len: int, length: int, k: int) -> WalkStats:
    """Strict greedy decoding of one sequence (its tokens prompt_len..length-1 are the
    target's greedy answer, ending by the token budget) with a chain of k drafts, replayed
    from chain_matches' row: the engine's first step drafts after the prompt (entry
    prompt_len - 2), each step drafts min(k, budget left - 1), accepts the matching prefix
    and emits it plus the target's own token."""
    assert prompt_len >= 2, "the head's first entry needs two committed tokens"
    out = empty_walk(k)
    n = prompt_len  # committed tokens
    steps = emitted = 0
    while n < length:
        cap = min(k, length - n - 1)
        a = min(matches[n - 2], cap)
        for i in range(cap):
            out.drafted_per_position[i] += 1
            if i < a:
                out.accepted_per_position[i] += 1
        steps += 1
        emitted += a + 1
        n += a + 1
    out.steps, out.emitted = steps, emitted
    return out


__all__ = ["Batch", "STEP_DECAY", "WalkStats", "chain_matches", "empty_walk", "entry_weights",
           "pass_mask", "ttt_loss", "unrolled_logits", "unrolled_outputs", "walk"]
