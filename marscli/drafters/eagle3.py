"""EAGLE-3 drafter: a one-layer head drafting from the target's own hidden states.

The engine hands the drafter the target's features of every position it commits
(``observe``): from the prefill, then from each verification pass (the pending token and the
accepted drafts). The head's KV cache holds one committed entry per committed position but
the last: entry j pairs the target features at j with token j+1, and its output predicts
token j+2 (see marscli.drafters.eagle3_head). Drafting appends entries built from the head's own outputs;
they are dropped again before the next step, and the accepted tokens re-enter the cache with
the target's real features (what the published code does with its "stable" cache).

Two ways to draft:

- chain (``propose``): top-1 (greedy) or the position's draw from the head's distribution q
  (sampling; coupled to the target's draw there: marscli.verification.draws, the noise keyed
  by target token ids), K tokens, K chosen adaptively as for the other drafters. A chain
  token past the first comes from the head's own features, not the target's, so it is not
  the head's proposal for its position given the text (which would read the target's
  features there): relaxed rules keep the drafted-positions rule of the paper for EAGLE-3
  (the engine drafts a fixed K; ``propose`` has no proposal after the chain);
- tree (``propose_tree``): EAGLE-2's dynamic tree. The head takes the top-k tokens after the
  pending one; then, ``depth`` times, it expands the top-k nodes of the newest level (by
  cumulative draft log-probability), each into its top-k children, in one head pass per level;
  finally the best ``tokens - 1`` nodes of everything generated are kept (ancestors rank ahead
  of their descendants, so the kept set is a tree). Paths hold up to depth + 1 drafts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from marscli.config import TREE_DEFAULTS, SamplingParams
from marscli.drafters.base import AcceptanceTracker, DrafterBase, DraftOffer, Proposal
from marscli.drafters.eagle3_head import Eagle3Head
from marscli.drafters.kinds import EAGLE3
from marscli.models.kvcache import left_pad
from marscli.models.slots import (
    ROW_BUCKETS,
    TOKEN_BUCKETS,
    CapturedShapes,
    bucket_of,
    span_bucket,
    step_on,
)
from marscli.verification.chain import sampled_groups, sampling_probs
from marscli.verification.draws import coupled_draw, position_keys

#: Parent of a depth-1 node (its parent is the pending token, the tree's root).
ROOT = -1


@dataclass(frozen=True)
class TreeShape:
    """EAGLE's tree settings: expansions after the first top-k (``depth``: paths hold up to
    depth + 1 drafts), branching (``top_k``) and tree size counting the root (``tokens``:
    tokens - 1 draft nodes). The MARS reference runs depth 6-7, top-k 10, 50-60 tokens."""

    depth: int
    top_k: int
    tokens: int

    def __post_init__(self) -> None:
        if self.depth < 0 or self.top_k < 1 or self.tokens < 2:
            raise ValueError(f"tree needs depth >= 0, top-k >= 1 and tokens >= 2, got {self}")

    @property
    def max_path(self) -> int:
        return self.depth + 1


#: EAGLE-3's own defaults (eagle/model/ea_model.py): depth 7, top-k 10, 60 tokens.
DEFAULT_TREE = TreeShape(*TREE_DEFAULTS)


def head_draws(head: Eagle3Head, logits: torch.Tensor, samplings: list[SamplingParams],
               positions: list[int]) -> torch.Tensor:
    """[R] target token ids: each row's draft from the head's logits [R, draft_vocab]: the
    top-1 (greedy rows) or the position's coupled draw from q (sampled rows; the noise keyed
    by target token ids, as the target's own draw is)."""
    picked = logits.argmax(dim=-1)  # [R] draft-vocabulary ids
    groups = sampled_groups(samplings)
    if groups:
        ids = head.to_target(torch.arange(logits.shape[-1], device=logits.device))  # [Dv]
        for (t, k, p), rows in groups.items():
            q = sampling_probs(logits[rows], t, k, p)  # [R', Dv]
            keys = position_keys(torch.tensor([samplings[i].seed for i in rows]),
                                 torch.tensor([positions[i] for i in rows])).to(q.device)
            picked[rows] = coupled_draw(q, keys, ids)
    return head.to_target(picked)


class Eagle3Drafter(DrafterBase):
    """Drafts with an EAGLE-3 head for one sequence at a time (one per batch row)."""

    name = EAGLE3

    def __init__(self, head: Eagle3Head, k_max: int, *, vocab_size: int, tree: TreeShape | None = None):
        self.head = head
        self.k_max = k_max
        self.vocab_size = vocab_size  # the target's logits width
        self.tree = tree
        self.device = head.device
        self.start([])

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """Target layers whose input hidden states the engine must hand over (observe)."""
        return self.head.feature_layers

    def start(self, prompt_ids: list[int], sampling: SamplingParams | None = None) -> None:
        self.sampling = sampling or SamplingParams()
        self.prompt_len = len(prompt_ids)
        self.tracker = AcceptanceTracker()
        self.past: tuple[torch.Tensor, torch.Tensor] | None = None  # committed entries' keys, values
        self.n = 0  # committed head entries (= committed positions with features, but the last)
        self.pending: list[torch.Tensor] = []  # target features not yet in the head's cache
        self.last_out: torch.Tensor | None = None  # [H] output of the newest committed entry

    # ------------------------------------------------------------------ target features

    def observe(self, features: torch.Tensor) -> None:
        """Target features [S, n_features] of the next S committed positions, in order."""
        assert features.dim() == 2 and features.shape[1] == self.head.n_features, tuple(features.shape)
        if features.shape[0]:
            self.pending.append(features)

    def ready(self, seq: list[int]) -> bool:
        """Whether the head's cache holds every committed position of seq but the last."""
        return self.last_out is not None and self.n == len(seq) - 1

    def _catch_up(self, seq: list[int]) -> bool:
        """Put the pending features into the cache as committed entries; True when the head
        is ready to draft the token after seq[-1]."""
        if self.pending:
            feats = torch.cat(self.pending, 0) if len(self.pending) > 1 else self.pending[0]
            self.pending = []
            P = feats.shape[0]
            assert self.n + P <= len(seq) - 1, (self.n, P, len(seq))
            dev = self.device
            tokens = torch.tensor([seq[self.n + 1: self.n + 1 + P]], dtype=torch.long, device=dev)
            pos = torch.arange(self.n, self.n + P, device=dev).unsqueeze(0)
            out, k, v = self.head(feats.unsqueeze(0).to(dev), tokens, pos, self.past, target_features=True)
            self.past = (k, v) if self.past is None else (torch.cat([self.past[0], k], 2),
                                                          torch.cat([self.past[1], v], 2))
            self.n += P
            self.last_out = out[0, -1]
        return self.ready(seq)

    # ------------------------------------------------------------------ chain

    def offer(self, seq: list[int], k_max: int) -> DraftOffer:
        return self.tracker.offer(k_max)

    @torch.inference_mode()
    def propose(self, seq: list[int], k: int, bonus: bool = False) -> Proposal:
        """k chain drafts; no proposal after them (the module's docstring: ``bonus`` is
        ignored)."""
        if k <= 0 or not self._catch_up(seq):
            return Proposal([])
        head, dev = self.head, self.device
        past = self.past
        out = self.last_out.view(1, 1, -1)
        tokens: list[int] = []
        at = len(seq) - self.prompt_len
        for i in range(k):
            logits = head.draft_logits(out[0, -1])  # [draft_vocab]
            tok = head_draws(head, logits.unsqueeze(0), [self.sampling], [at + i])  # [1]
            tokens.append(int(tok))
            if i + 1 < k:  # the last draft needs no head pass
                pos = torch.tensor([[self.n + i]], device=dev)
                out, kk, vv = head(out, tok.view(1, 1), pos, past, target_features=False)
                past = (torch.cat([past[0], kk], 2), torch.cat([past[1], vv], 2))
        return Proposal(tokens)

    def accepted(self, proposed: int, accepted: int, seq: list[int]) -> None:
        self.tracker.update(proposed, accepted)

    # ------------------------------------------------------------------ tree

    @torch.inference_mode()
    def propose_tree(self, seq: list[int], max_path: int) -> tuple[list[int], list[int], list[float]]:
        """EAGLE-2 dynamic tree after seq -> (tokens [N], parents [N] (ROOT or an earlier
        index), scores [N] cumulative draft log-probabilities); nodes in generation order, so
        parents come first. Paths are cut at max_path drafts (the remaining budget)."""
        shape = self.tree
        assert shape is not None, "propose_tree needs a TreeShape"
        levels = min(shape.max_path, max_path)
        if levels <= 0 or not self._catch_up(seq):
            return [], [], []
        head, dev = self.head, self.device
        K = shape.top_k
        lp = torch.log_softmax(head.draft_logits(self.last_out), -1)  # [Dv]
        top = torch.topk(lp, min(K, lp.shape[-1]))
        # Every generated node: target token, parent node index (ROOT), cumulative score.
        tok_chunks = [head.to_target(top.indices)]
        par_chunks = [torch.full_like(top.indices, ROOT)]
        score_chunks = [top.values]
        n_nodes = top.indices.numel()
        frontier = torch.arange(n_nodes, device=dev)  # node ids to expand next
        f_scores = top.values
        f_tokens = tok_chunks[0]
        f_hidden = self.last_out.view(1, 1, -1).expand(1, n_nodes, -1)  # their parents' outputs
        f_parent_entry = torch.full((n_nodes,), -1, dtype=torch.long, device=dev)
        T = self.n
        keys, values = self.past
        anc = torch.zeros(0, 0, dtype=torch.bool, device=dev)  # [E, E] ancestor-or-self of tree entries
        for level in range(1, levels):
            F = frontier.numel()
            E = anc.shape[0]
            # A frontier node sees every committed entry, its ancestors' entries and itself.
            rows = torch.zeros(F, E, dtype=torch.bool, device=dev)
            has_parent = f_parent_entry >= 0
            if E and bool(has_parent.any()):
                rows[has_parent] = anc[f_parent_entry[has_parent]]
            mask = torch.cat([torch.ones(F, T, dtype=torch.bool, device=dev), rows,
                              torch.eye(F, dtype=torch.bool, device=dev)], 1)[None, None]
            pos = torch.full((1, F), T + level - 1, device=dev)
            out, k, v = head(f_hidden, f_tokens.view(1, F), pos, (keys, values), mask, target_features=False)
            keys, values = torch.cat([keys, k], 2), torch.cat([values, v], 2)
            new_anc = torch.zeros(E + F, E + F, dtype=torch.bool, device=dev)
            new_anc[:E, :E] = anc
            new_anc[E:, :E] = rows
            new_anc[E:, E:] = torch.eye(F, dtype=torch.bool, device=dev)
            anc = new_anc
            # Each frontier node's top-k children, scored by cumulative log-probability.
            lp = torch.log_softmax(head.draft_logits(out[0]), -1)  # [F, Dv]
            top = torch.topk(lp, min(K, lp.shape[-1]), dim=-1)
            cum = (f_scores.unsqueeze(1) + top.values).reshape(-1)  # [F * K]
            child_parent = frontier.repeat_interleave(top.indices.shape[1])
            child_tok = head.to_target(top.indices.reshape(-1))
            tok_chunks.append(child_tok)
            par_chunks.append(child_parent)
            score_chunks.append(cum)
            child_ids = torch.arange(n_nodes, n_nodes + cum.numel(), device=dev)
            n_nodes += cum.numel()
            if level + 1 >= levels:
                break
            best = torch.topk(cum, min(K, cum.numel())).indices
            frontier = child_ids[best]
            f_scores = cum[best]
            f_tokens = child_tok[best]
            parent_row = best // top.indices.shape[1]  # which frontier node each came from
            f_hidden = out[:, parent_row]
            f_parent_entry = E + parent_row
        tokens = torch.cat(tok_chunks).tolist()
        parents = torch.cat(par_chunks).tolist()
        scores = torch.cat(score_chunks).float().tolist()
        # Rerank: the best tokens - 1 nodes; ties go to the earlier node, so a parent (never
        # scored below its child, and generated earlier) always ranks ahead of its children.
        keep = sorted(range(len(tokens)), key=lambda i: (-scores[i], i))[: shape.tokens - 1]
        keep.sort()
        new_index = {old: new for new, old in enumerate(keep)}
        out_parents = [ROOT if parents[i] == ROOT else new_index[parents[i]] for i in keep]
        return [tokens[i] for i in keep], out_parents, [scores[i] for i in keep]


# ---------------------------------------------------------------------------- batched chains


class BatchedEagle3Drafter:
    """Chain drafting for a whole batch: the rows' catch-up entries in one head pass and then
    one head pass per draft position for all rows (instead of one pass per row and position).

    Each row is an Eagle3Drafter (its own committed cache, features and acceptance tracker);
    this class only runs their head passes together (a BatchedDrafter).
    The rows' committed caches are left-padded to a common length for each step; padding is
    masked out, so a row drafts what it would alone, up to float summation order. Rows follow
    the engine's batch (added and dropped together).
    """

    tree = None
    step_kind = "eager"  # the engine's (Engine.step_kind): "static" or "graphs" run HeadSteps

    def __init__(self, head: Eagle3Head, k_max: int, *, vocab_size: int):
        self.head = head
        self.k_max = k_max
        self.vocab_size = vocab_size
        self.reset()

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.head.feature_layers

    def reset(self) -> None:
        self.rows: list[Eagle3Drafter] = []
        # The draft positions' head passes at static shapes when the engine's steps are
        # (captured as CUDA graphs on CUDA); a compiled CPU engine's head stays eager.
        kind = step_on(self.step_kind, self.head.device)
        if getattr(self, "steps_kind", None) != kind:  # the head's shapes live with the head
            self.steps = HeadSteps(self.head, graphs=kind == "graphs") if kind in ("static", "graphs") else None
            self.steps_kind = kind

    def add_row(self, prompt_ids: list[int], sampling: SamplingParams) -> None:
        # The head's prompt entries come from the target's prefill features (observe).
        row = Eagle3Drafter(self.head, self.k_max, vocab_size=self.vocab_size)
        row.start(prompt_ids, sampling)
        self.rows.append(row)

    def add_rows(self, prompts: list[list[int]], samplings: list[SamplingParams]) -> None:
        for p, s in zip(prompts, samplings):
            self.add_row(p, s)

    def keep(self, rows: list[int]) -> None:
        self.rows = [self.rows[b] for b in rows]

    def propose_tree(self, row: int, seq: list[int], max_path: int):
        raise NotImplementedError("batched EAGLE-3 drafting drafts chains")

    def observe(self, row: int, features: torch.Tensor) -> None:
        self.rows[row].observe(features)

    def accepted(self, row: int, proposed: int, accepted: int, seq: list[int]) -> None:
        self.rows[row].accepted(proposed, accepted, seq)

    def rewind(self, row: int, seq: list[int]) -> None:
        raise NotImplementedError("EAGLE-3 rows keep the drafted-positions rule: they never rewind")

    def offers(self, seqs: list[list[int]], k_caps: list[int]) -> list[DraftOffer]:
        return [r.tracker.offer(cap) for r, cap in zip(self.rows, k_caps)]

    @torch.inference_mode()
    def propose(self, seqs: list[list[int]], ks: list[int], bonus: bool = False) -> list[Proposal]:
        rows, head = self.rows, self.head
        assert len(seqs) == len(ks) == len(rows)
        dev = head.device
        proposals = [Proposal([]) for _ in rows]
        ks = [max(k, 0) for k in ks]
        active = [b for b, k in enumerate(ks) if k > 0]
        if not active:
            return proposals
        # 1. Catch-up: every active row's pending target features, in one padded pass.
        self._catch_up([rows[b] for b in active], [seqs[b] for b in active])
        active = [b for b in active if rows[b].ready(seqs[b])]
        if not active:
            return proposals
        B = len(active)
        act = [rows[b] for b in active]
        T = max(r.n for r in act)
        keys = torch.cat([left_pad(r.past[0], T) for r in act], 0)  # [B, kv, T, hd]
        values = torch.cat([left_pad(r.past[1], T) for r in act], 0)
        valid = torch.zeros(B, T, dtype=torch.bool, device=dev)
        for i, r in enumerate(act):
            valid[i, T - r.n:] = True
        out = torch.stack([r.last_out for r in act]).unsqueeze(1)  # [B, 1, H]
        tokens: list[list[int]] = [[] for _ in act]
        kmax = max(ks[b] for b in active)
        samplings = [r.sampling for r in act]
        at = [len(seqs[b]) - r.prompt_len for b, r in zip(active, act)]
        static = self.steps.begin(keys, values, valid, kmax) if self.steps is not None and kmax > 1 else None
        logits = head.draft_logits(out[:, 0])  # [B, Dv]
        for i in range(kmax):
            # one argmax (or coupled draw) over the batch and one transfer a draft position
            toks = head_draws(head, logits, samplings, [a + i for a in at])  # [B]
            picked = toks.tolist()
            for j in range(len(act)):
                if i < ks[active[j]]:
                    tokens[j].append(picked[j])
            if i + 1 >= kmax:
                break
            pos = torch.tensor([[r.n + i] for r in act], device=dev)
            if static is not None:
                out, logits = self.steps.step(static, out, toks, pos, i)
                continue
            mask = torch.cat([valid, torch.ones(B, 1, dtype=torch.bool, device=dev)], 1)[:, None, None, :]
            out, k, v = head(out, toks.view(B, 1), pos, (keys, values), mask, target_features=False)
            keys, values = torch.cat([keys, k], 2), torch.cat([values, v], 2)
            valid = torch.cat([valid, torch.ones(B, 1, dtype=torch.bool, device=dev)], 1)
            logits = head.draft_logits(out[:, 0])
        for j, b in enumerate(active):
            proposals[b] = Proposal(tokens[j][: ks[b]])
        return proposals

    def _catch_up(self, rows: list[Eagle3Drafter], seqs: list[list[int]]) -> None:
        todo = [(r, s) for r, s in zip(rows, seqs) if r.pending]
        if not todo:
            return
        head, dev = self.head, self.head.device
        feats = [torch.cat(r.pending, 0) for r, _ in todo]
        P = max(f.shape[0] for f in feats)
        T = max(r.n for r, _ in todo)
        B = len(todo)
        F = feats[0].shape[1]
        # The inputs are built on the host and sent at once, the features gathered in one
        # copy: a handful of transfers and kernels a pass, not several per row.
        lens = [f.shape[0] for f in feats]
        tok_h = torch.zeros(B, P, dtype=torch.long)
        where = []
        for i, ((r, seq), p) in enumerate(zip(todo, lens)):
            assert r.n + p <= len(seq) - 1, (r.n, p, len(seq))
            tok_h[i, :p] = torch.tensor(seq[r.n + 1: r.n + 1 + p], dtype=torch.long)
            where.extend(range(i * P, i * P + p))
        n_h = torch.tensor([r.n for r, _ in todo], dtype=torch.long)
        x = torch.zeros(B * P, F, dtype=feats[0].dtype, device=dev)
        x.index_copy_(0, torch.tensor(where, dtype=torch.long).to(dev), torch.cat(feats, 0).to(dev, x.dtype))
        x = x.view(B, P, F)
        tok = tok_h.to(dev)
        pos = (n_h[:, None] + torch.arange(P)[None, :]).to(dev)
        n_d = n_h.to(dev)
        col = torch.arange(T + P, device=dev)
        # a row's committed entries (left-padded: its last n of the T), then the new ones causally
        committed = (col[None, :] >= T - n_d[:, None]) & (col[None, :] < T)  # [B, T+P]
        new = (col[None, :] >= T) & (col[None, :] - T <= torch.arange(P, device=dev)[:, None])  # [P, T+P]
        mask = (committed[:, None, :] | new[None, :, :])[:, None]  # [B, 1, P, T+P]
        if T:
            keys = torch.cat([left_pad(r.past[0], T) if r.past is not None else
                              head_kv_zeros(head, T, dev) for r, _ in todo], 0)
            values = torch.cat([left_pad(r.past[1], T) if r.past is not None else
                                head_kv_zeros(head, T, dev) for r, _ in todo], 0)
            past = (keys, values)
        else:
            past = None
        if self.steps is not None and T and P <= CATCH_UP_TOKENS:  # a step's catch-up, not a prompt's
            out, k, v = self.steps.catch_up(x, tok, pos, mask, past)
        else:
            out, k, v = head(x, tok, pos, past, mask, target_features=True)
        for i, ((r, _), f) in enumerate(zip(todo, feats)):
            p = f.shape[0]
            kk, vv = k[i: i + 1, :, :p], v[i: i + 1, :, :p]
            r.past = (kk, vv) if r.past is None else (torch.cat([r.past[0], kk], 2), torch.cat([r.past[1], vv], 2))
            r.n += p
            r.last_out = out[i, p - 1]
            r.pending = []


#: A static head step attends over HEAD_SPAN_BUCKET x a power of two positions.
HEAD_SPAN_BUCKET = 64
#: A catch-up pass of at most this many entries a row runs at a static shape (a step's: its
#: accepted drafts and the correction); a longer one (a prompt's features) runs eagerly.
CATCH_UP_TOKENS = 32


class HeadSteps(CapturedShapes):
    """The EAGLE-3 head's draft-position passes at static shapes (BatchedEagle3Drafter, when
    the engine's steps are static or captured: Engine.step_kind).

    A propose call's rows (left-padded committed entries, T positions) are copied into the
    buffers of a shape (rows padded up to a ROW_BUCKETS size, the span T + k up to
    HEAD_SPAN_BUCKET x a power of two); draft position i writes every row's new entry at T + i
    (the same column for all rows: they are left-padded) and attends through a mask over the
    whole span, so the shape's pass, with the draft logits, is one fixed computation on
    buffers that outlive it. On CUDA (graphs) it is captured once per shape as a CUDA graph
    and replayed; a capture that fails is said once on stderr and the passes run eagerly at
    the same shapes. Padding rows see their position 0 only. A step's catch-up pass (each
    row's newly committed entries, up to CATCH_UP_TOKENS) runs the same way at (rows, entries
    up to a TOKEN_BUCKETS size, span) shapes; a prompt's (longer) runs eagerly.
    """

    captured_what = "capturing the EAGLE-3 head's step as a CUDA graph"

    def __init__(self, head: Eagle3Head, *, graphs: bool):
        super().__init__()  # shapes: (rows, span) draft steps; ("catch-up", rows, entries, span)
        self.head = head
        self.graphs = graphs

    def begin(self, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor, kmax: int) -> dict:
        """Load a propose call's committed entries (keys, values [B, kv, T, hd], left-padded;
        valid [B, T]) into its shape's buffers; returns the shape's state."""
        B, nkv, T, hd = keys.shape
        Bb, L = bucket_of(B, ROW_BUCKETS), span_bucket(T + kmax, HEAD_SPAN_BUCKET)
        st = self.shapes.pop((Bb, L), None)
        if st is None:
            dev, H = keys.device, self.head.cfg.hidden_size
            st = {"k": keys.new_zeros(Bb, nkv, L, hd), "v": values.new_zeros(Bb, nkv, L, hd),
                  "out": torch.zeros(Bb, 1, H, dtype=self.head.dtype, device=dev),
                  "tok": torch.zeros(Bb, 1, dtype=torch.long, device=dev),
                  "pos": torch.zeros(Bb, 1, dtype=torch.long, device=dev),
                  "at": torch.zeros(1, dtype=torch.long, device=dev),
                  "mask": torch.zeros(Bb, 1, 1, L, dtype=torch.bool, device=dev)}
            self.built += 1
        self._keep((Bb, L), st)
        st["k"][:B, :, :T] = keys
        st["v"][:B, :, :T] = values
        mask = st["mask"]
        mask.zero_()
        mask[:B, 0, 0, :T] = valid
        mask[B:, 0, 0, 0] = True
        st["B"], st["T"] = B, T
        return st

    def _run(self, st: dict) -> tuple[torch.Tensor, torch.Tensor]:
        head = self.head
        out, _, _ = head(st["out"], st["tok"], st["pos"], None, st["mask"], target_features=False,
                         into=(st["k"], st["v"], st["at"]))
        return out, head.draft_logits(out[:, 0])

    def step(self, st: dict, out: torch.Tensor, toks: torch.Tensor, pos: torch.Tensor, i: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft position i's pass for the rows (out [B, 1, H], toks [B], pos [B, 1]): the next
        out [B, 1, H] and draft logits [B, Dv]."""
        B, at = st["B"], st["T"] + i
        st["out"][:B] = out
        st["tok"][:B, 0] = toks
        st["pos"][:B] = pos
        st["at"].fill_(at)
        st["mask"][:, 0, 0, at] = True  # each row's new entry sees itself
        res = self._replay(st, self._run, "res")
        return res[0][:B], res[1][:B]

    def catch_up(self, x: torch.Tensor, tok: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor,
                 past: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A step's catch-up pass (BatchedEagle3Drafter._catch_up's inputs: x [B, P, F], tok
        and pos [B, P], mask [B, 1, P, T+P], the left-padded committed entries [B, kv, T, hd])
        at a static shape (rows, P up to a TOKEN_BUCKETS size, the span): out [B, P, H] and the
        new entries' keys and values [B, kv, P, hd] (copies: the buffers are reused)."""
        keys, values = past
        B, P, F = x.shape
        T = keys.shape[2]
        Bb, Pb = bucket_of(B, ROW_BUCKETS), bucket_of(P, TOKEN_BUCKETS)
        L = span_bucket(T + Pb, HEAD_SPAN_BUCKET)
        key = ("catch-up", Bb, Pb, L)
        st = self.shapes.pop(key, None)
        if st is None:
            dev = x.device
            st = {"x": x.new_zeros(Bb, Pb, F), "tok": torch.zeros(Bb, Pb, dtype=torch.long, device=dev),
                  "pos": torch.zeros(Bb, Pb, dtype=torch.long, device=dev),
                  "at": torch.zeros(Pb, dtype=torch.long, device=dev),
                  "mask": torch.zeros(Bb, 1, Pb, L, dtype=torch.bool, device=dev),
                  "k": keys.new_zeros(Bb, keys.shape[1], L, keys.shape[3]),
                  "v": values.new_zeros(Bb, values.shape[1], L, values.shape[3])}
            self.built += 1
        self._keep(key, st)
        st["x"].zero_()
        st["x"][:B, :P] = x
        st["tok"].zero_()
        st["tok"][:B, :P] = tok
        st["pos"].zero_()
        st["pos"][:B, :P] = pos
        st["at"].copy_(T + torch.arange(Pb, device=x.device))
        m = st["mask"]
        m.zero_()
        m[:B, :, :P, : T + P] = mask
        diag = torch.arange(Pb, device=x.device)
        m[:, 0, diag, T + diag] = True  # padding queries see themselves (never an empty row)
        st["k"][:B, :, :T] = keys
        st["v"][:B, :, :T] = values
        out = self._replay(st, self._run_catch_up, "res")
        # copies: a row keeps its newest output (last_out) and entries past the next replay
        return out[:B, :P].clone(), st["k"][:B, :, T:T + P].clone(), st["v"][:B, :, T:T + P].clone()

    def _run_catch_up(self, st: dict) -> torch.Tensor:
        out, _, _ = self.head(st["x"], st["tok"], st["pos"], None, st["mask"], target_features=True,
                              into=(st["k"], st["v"], st["at"]))
        return out


def head_kv_zeros(head: Eagle3Head, T: int, dev) -> torch.Tensor:
    a = head.midlayer.self_attn
    return torch.zeros(1, a.nkv, T, a.hd, dtype=head.dtype, device=dev)
