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
from marscli.drafters.eagle3_slots import HeadSlots
from marscli.drafters.kinds import EAGLE3
from marscli.models.slots import EAGER, StepPlan
from marscli.verification.chain import sampled_groups, sampling_probs
from marscli.verification.draws import coupled_draw, position_keys

#: Parent of a depth-1 node (its parent is the pending token, the tree's root).
ROOT = -1
#: Entries a single sequence's head cache holds at first (it doubles as it grows).
HEAD_CACHE_START = 256


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
        # The head's cache: keys, values [1, kv, capacity, hd]; entries [0, n) are committed,
        # a step's chain drafts and tree levels are written past them and dropped again (the
        # next commit overwrites them). Grown by doubling, so a step writes only its own new
        # entries, whatever the length (read through views, never concatenated).
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        #: key/value entries written into the cache (new entries and grown buffers' copies):
        #: what a step's cache work is, for tests.
        self.written = 0
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

    def _room(self, length: int) -> None:
        """A cache of at least `length` entries (doubled when it grows; committed entries
        copied over)."""
        cap = 0 if self.keys is None else self.keys.shape[2]
        if length <= cap:
            return
        a = self.head.midlayer.self_attn
        new_cap = max(length, 2 * cap, HEAD_CACHE_START)
        keys = torch.zeros(1, a.nkv, new_cap, a.hd, dtype=self.head.dtype, device=self.device)
        values = torch.zeros_like(keys)
        if self.n:
            keys[:, :, : self.n] = self.keys[:, :, : self.n]
            values[:, :, : self.n] = self.values[:, :, : self.n]
            self.written += self.n
        self.keys, self.values = keys, values

    def _into(self, cols: torch.Tensor, end: int):
        """The head pass's ``into`` for new entries at the cache's columns cols [1, S], the
        last of them end - 1 (known on the host): the cache up to there."""
        self._room(end)
        self.written += cols.shape[1]
        return self.keys[:, :, :end], self.values[:, :, :end], cols

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
            out, _, _ = self.head(feats.unsqueeze(0).to(dev), tokens, pos, into=self._into(pos, self.n + P),
                                  target_features=True)
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
        out = self.last_out.view(1, 1, -1)
        tokens: list[int] = []
        at = len(seq) - self.prompt_len
        for i in range(k):
            logits = head.draft_logits(out[0, -1])  # [draft_vocab]
            tok = head_draws(head, logits.unsqueeze(0), [self.sampling], [at + i])  # [1]
            tokens.append(int(tok))
            if i + 1 < k:  # the last draft needs no head pass
                pos = torch.tensor([[self.n + i]], device=dev)
                out, _, _ = head(out, tok.view(1, 1), pos, into=self._into(pos, self.n + i + 1), target_features=False)
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
        anc = torch.zeros(0, 0, dtype=torch.bool, device=dev)  # [E, E] ancestor-or-self of tree entries
        for level in range(1, levels):
            F = frontier.numel()
            E = anc.shape[0]
            # A frontier node sees every committed entry, its ancestors' entries and itself.
            # (level 1's frontier hangs under the root, every later one under a tree entry:
            # known on the host, so no level asks the device)
            rows = anc[f_parent_entry] if E else torch.zeros(F, 0, dtype=torch.bool, device=dev)
            mask = torch.cat([torch.ones(F, T, dtype=torch.bool, device=dev), rows,
                              torch.eye(F, dtype=torch.bool, device=dev)], 1)[None, None]
            pos = torch.full((1, F), T + level - 1, device=dev)
            cols = torch.arange(T + E, T + E + F, device=dev).unsqueeze(0)  # the level's entries
            keys, values, _ = self._into(cols, T + E + F)
            out, _, _ = head(f_hidden, f_tokens.view(1, F), pos, None, mask, target_features=False,
                             into=(keys, values, cols))
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
        # one transfer for the whole tree: token ids and parents are exact in float64, and so
        # are the float32 scores
        flat = torch.cat([torch.cat(tok_chunks).double(), torch.cat(par_chunks).double(),
                          torch.cat(score_chunks).double()]).tolist()
        N = len(flat) // 3
        tokens = [int(x) for x in flat[:N]]
        parents = [int(x) for x in flat[N: 2 * N]]
        scores = flat[2 * N:]
        # Rerank: the best tokens - 1 nodes; ties go to the earlier node, so a parent (never
        # scored below its child, and generated earlier) always ranks ahead of its children.
        keep = sorted(range(len(tokens)), key=lambda i: (-scores[i], i))[: shape.tokens - 1]
        keep.sort()
        new_index = {old: new for new, old in enumerate(keep)}
        out_parents = [ROOT if parents[i] == ROOT else new_index[parents[i]] for i in keep]
        return [tokens[i] for i in keep], out_parents, [scores[i] for i in keep]


# ---------------------------------------------------------------------------- batched chains


class _HeadRow:
    """A batch row of BatchedEagle3Drafter: what is its own (the cache is HeadSlots')."""

    __slots__ = ("sampling", "prompt_len", "tracker", "pending")

    def __init__(self, prompt_len: int, sampling: SamplingParams):
        self.sampling = sampling
        self.prompt_len = prompt_len
        self.tracker = AcceptanceTracker()
        self.pending: list[torch.Tensor] = []  # target features not yet in the head's cache


class BatchedEagle3Drafter:
    """Chain drafting for a whole batch: the rows' newly committed entries in one head pass
    and then one head pass per draft position for all rows, over the head's cache in slot
    buffers (marscli.drafters.eagle3_slots.HeadSlots: nothing copied per step).

    A row drafts what one Eagle3Drafter drafts for it alone, up to float summation order (its
    committed entries sit at its own columns, the rest masked out). Rows follow the engine's
    batch (added and dropped together). The drafts of a propose call reach the host in one
    transfer, after its last draft position.
    """

    tree = None
    plan = EAGER  # the engine's StepPlan (use_plan): static or graphs run static shapes

    def __init__(self, head: Eagle3Head, k_max: int, *, vocab_size: int):
        self.head = head
        self.k_max = k_max
        self.vocab_size = vocab_size
        self.slots: HeadSlots | None = None
        self.reset()

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.head.feature_layers

    @property
    def steps(self) -> HeadSlots | None:
        """The head's static shapes (None when its passes run eagerly): gpu_check reports them."""
        return self.slots if self.slots.static else None

    def reset(self) -> None:
        """No row. The slot buffers and their shapes live with the head: a run at the step
        kind of the last one builds nothing again."""
        self.rows: list[_HeadRow] = []
        plan = self.plan.on(self.head.device)
        if plan.compiled:  # a compiled CPU engine's head stays eager
            plan = EAGER
        if self.slots is None or self.slots_plan != plan:
            self.slots = HeadSlots(self.head, static=plan.static, graphs=plan.graphs)
            self.slots_plan = plan
        else:
            self.slots.clear_rows()

    def use_plan(self, plan: StepPlan) -> None:
        """Run the head's passes as the engine's plan says (from the next reset on)."""
        self.plan = plan

    def add_row(self, prompt_ids: list[int], sampling: SamplingParams) -> None:
        # The head's prompt entries come from the target's prefill features (observe).
        self.rows.append(_HeadRow(len(prompt_ids), sampling))
        self.slots.add_rows(1)

    def add_rows(self, prompts: list[list[int]], samplings: list[SamplingParams]) -> None:
        for p, s in zip(prompts, samplings):
            self.add_row(p, s)

    def keep(self, rows: list[int]) -> None:
        self.rows = [self.rows[b] for b in rows]
        self.slots.keep_rows(rows)

    def propose_tree(self, row: int, seq: list[int], max_path: int):
        raise NotImplementedError("batched EAGLE-3 drafting drafts chains")

    def observe(self, row: int, features: torch.Tensor) -> None:
        assert features.dim() == 2 and features.shape[1] == self.head.n_features, tuple(features.shape)
        if features.shape[0]:
            self.rows[row].pending.append(features)

    def accepted(self, row: int, proposed: int, accepted: int, seq: list[int]) -> None:
        self.rows[row].tracker.update(proposed, accepted)

    def rewind(self, row: int, seq: list[int]) -> None:
        raise NotImplementedError("EAGLE-3 rows keep the drafted-positions rule: they never rewind")

    def offers(self, seqs: list[list[int]], k_caps: list[int]) -> list[DraftOffer]:
        return [r.tracker.offer(cap) for r, cap in zip(self.rows, k_caps)]

    def _commit(self, seqs: list[list[int]]) -> None:
        """Every row's pending target features into the head's cache (one pass for the
        joining rows' prompts, one for the steps' entries)."""
        slots = self.slots
        feats: list[torch.Tensor | None] = [None] * len(self.rows)
        tokens: list[list[int]] = [[] for _ in self.rows]
        for b, (r, seq) in enumerate(zip(self.rows, seqs)):
            if not r.pending:
                continue
            f = torch.cat(r.pending, 0) if len(r.pending) > 1 else r.pending[0]
            r.pending = []
            n, p = slots.lengths[b], f.shape[0]
            assert n + p <= len(seq) - 1, (n, p, len(seq))
            feats[b], tokens[b] = f, seq[n + 1: n + 1 + p]
        if any(f is not None for f in feats):
            slots.commit(feats, tokens)

    @torch.inference_mode()
    def propose(self, seqs: list[list[int]], ks: list[int], bonus: bool = False) -> list[Proposal]:
        rows, head, slots = self.rows, self.head, self.slots
        assert len(seqs) == len(ks) == len(rows)
        proposals = [Proposal([]) for _ in rows]
        ks = [max(k, 0) for k in ks]
        if not any(ks):
            return proposals
        self._commit(seqs)
        # a row drafts once its cache holds every committed position but the last
        active = [b for b, k in enumerate(ks) if k > 0 and 0 < slots.lengths[b] == len(seqs[b]) - 1]
        if not active:
            return proposals
        kmax = max(ks[b] for b in active)
        out, logits, step = slots.drafting(kmax)
        samplings = [r.sampling for r in rows]
        at = [len(seq) - r.prompt_len for seq, r in zip(seqs, rows)]
        drafted = []
        for i in range(kmax):
            toks = head_draws(head, logits, samplings, [a + i for a in at])  # [B]: every row's
            drafted.append(toks)
            if i + 1 < kmax:
                out, logits = step(out, toks, i)
        picked = torch.stack(drafted, 1).tolist()  # [B, kmax]: one transfer for the chain
        for b in active:
            proposals[b] = Proposal(picked[b][: ks[b]])
        return proposals
