"""A separate, smaller draft model with its own KV cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from marscli.config import SamplingParams
from marscli.drafters.base import AcceptanceTracker, DrafterBase, DraftOffer, Proposal
from marscli.drafters.kinds import MODEL
from marscli.models.kvcache import cache_kw, new_cache, rollback, to_device
from marscli.models.prefill import DRAFT_PREFIX_CACHE_MIB, MIB, Prefiller, PrefixCache
from marscli.models.slots import EAGER, SlotCache, StepPlan, supports
from marscli.verification.chain import sampled_groups, sampling_probs
from marscli.verification.draws import coupled_draw, position_keys


def fit_vocab(logits: torch.Tensor, vocab_size: int | None) -> torch.Tensor:
    """Draft logits [V_draft] cut or -inf-padded to the target's width: padded embedding rows
    are never drafted, and tokens the draft model lacks get probability 0."""
    if vocab_size is None or logits.shape[-1] == vocab_size:
        return logits
    if logits.shape[-1] > vocab_size:
        return logits[: vocab_size]
    pad = logits.new_full((vocab_size - logits.shape[-1],), float("-inf"))
    return torch.cat([logits, pad])


def reusable_prefix(cached: list[int], seq: list[int]) -> int:
    """How many leading tokens of a draft cache still match the committed sequence; at least
    seq's last token is always fed again (its logits start the next draft)."""
    common = 0
    for a, b in zip(cached, seq):
        if a != b:
            break
        common += 1
    return min(common, len(seq) - 1)


def draft_tokens(logits: torch.Tensor, samplings: list[SamplingParams], positions: list[int]) -> list[int]:
    """One draft token per row from draft logits [R, V]: the argmax (greedy rows) or the
    position's draw from the row's filtered draft law q (sampled rows), coupled to the
    target's draw there (marscli.verification.draws: the same noise, from the record's seed
    and the output position). One host transfer for all rows."""
    out = logits.argmax(dim=-1)  # [R]
    for (t, k, p), rows in sampled_groups(samplings).items():
        q = sampling_probs(logits[rows], t, k, p)  # [R', V]
        keys = position_keys(torch.tensor([samplings[i].seed for i in rows]),
                             torch.tensor([positions[i] for i in rows]))
        out[rows] = coupled_draw(q, keys.to(q.device))
    return out.tolist()


@dataclass(frozen=True)
class SiblingTree:
    """A draft model's tree: the chain it drafts anyway (the engine chooses its length, up to
    ``k_max``, as for a chain) plus, at its least certain positions, its next choices as
    sibling leaves, ``tokens`` tokens in all counting the root.

    Siblings cost no draft forward (they come from the logits the chain was drafted from),
    only verification, so a step whose chain token the target rejects still keeps the position
    when the target's choice was the draft's second. On a 2-core CPU the extra verified tokens
    cost more than they keep (lab/benchmarks-history.md); where verifying a few more tokens is free
    (a GPU at batch 1) they are a gain. Candidates are ranked as EAGLE
    ranks tree nodes, by the draft model's probability of reaching them: the product of its
    top-1 probabilities before the position times the sibling's own probability.
    """

    k_max: int
    top_k: int = 2
    tokens: int = 16

    def __post_init__(self) -> None:
        if self.k_max < 1 or self.top_k < 1 or self.tokens < 2:
            raise ValueError(f"a draft-model tree needs K >= 1, top-k >= 1 and tokens >= 2, got {self}")

    @property
    def max_path(self) -> int:
        return self.k_max

    #: the engine chooses each step's chain length (Engine.draft_lengths), as for a chain
    chooses_length = True

    def build(self, chain: list[int],
              alternatives: list[tuple[float, int, int]]) -> tuple[list[int], list[int], list[float]]:
        """The tree of a drafted chain: (tokens, parents, scores), parents first.

        chain: the k chain tokens (node i under node i - 1); alternatives: (score, position,
        token) candidates for siblings of chain node `position`. The likeliest fill the
        nodes left after the chain (ties: the earlier position first), in position order."""
        k = len(chain)
        room = max(self.tokens - 1 - k, 0)
        picked = sorted(alternatives, key=lambda a: (-a[0], a[1]))[:room]
        picked.sort(key=lambda a: a[1])
        tokens = list(chain) + [tok for _, _, tok in picked]
        parents = list(range(-1, k - 1)) + [pos - 1 for _, pos, _ in picked]
        scores = [1.0] * k + [score for score, _, _ in picked]
        return tokens, parents, scores


def prompt_offset(prompt_len: int, context: int | None) -> int:
    """Where a draft model with a prompt window of `context` tokens starts reading a prompt of
    prompt_len tokens (0: all of it). The window never includes the prompt's last token, which
    every draft feeds anyway; so a prompt shorter than context + 1 is read whole."""
    if context is None:
        return 0
    return max(prompt_len - 1 - context, 0)


class DraftModelSettings:
    """What every draft-model drafter holds: the model, its device, K, the target's vocabulary
    width (draft probabilities are padded or cut to it) and its prompt window (``context``:
    the draft model reads a record from ``prompt_offset`` on; None: from its start)."""

    def __init__(self, model, k_max: int, *, vocab_size: int | None = None, context: int | None = None):
        self.model = model
        self.device = model.get_input_embeddings().weight.device
        self.k_max = k_max
        self.vocab_size = vocab_size
        self.context = context


class ModelDrafter(DraftModelSettings, DrafterBase):
    """Drafts k tokens autoregressively with a small model sharing the target's vocabulary.

    Its cache holds a prefix of the committed sequence plus the drafts it fed itself; after
    verification it keeps only the part the target accepted. Greedy decoding drafts argmax
    tokens (one-hot q); sampling drafts from the draft model's own filtered distribution and
    hands that distribution to the verifier.
    """

    name = MODEL

    def __init__(self, model, k_max: int, *, tree: SiblingTree | None = None, **kw):
        super().__init__(model, k_max, **kw)
        self.tree = tree
        self.offset = 0
        self.sampling = SamplingParams()
        self.prompt_len = 0
        self.cache = None
        self.cached: list[int] = []  # tokens whose keys/values are in self.cache
        self.tracker = AcceptanceTracker()

    def start(self, prompt_ids: list[int], sampling: SamplingParams | None = None) -> None:
        self.sampling = sampling or SamplingParams()
        self.prompt_len = len(prompt_ids)
        self.cache = new_cache(self.model)
        self.cached = []
        self.tracker = AcceptanceTracker()
        self.offset = prompt_offset(len(prompt_ids), self.context)  # what the draft model skips

    def _forward(self, ids: list[int]) -> torch.Tensor:
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        out = self.model(input_ids=x, **cache_kw(self.model, self.cache), use_cache=True, logits_to_keep=1)
        self.cached.extend(ids)
        return out.logits[0, -1]  # [V_draft]

    def offer(self, seq: list[int], k_max: int) -> DraftOffer:
        return self.tracker.offer(k_max)

    def _catch_up(self, seq: list[int]) -> torch.Tensor:
        """Bring the cache up to the committed sequence as the draft model reads it (its prompt
        window on; at least the last token is new): the logits [V] of the first draft."""
        seq = seq[self.offset:]
        common = reusable_prefix(self.cached, seq)
        rollback(self.cache, common)
        del self.cached[common:]
        return fit_vocab(self._forward(seq[common:]), self.vocab_size)

    def token_after(self, seq: list[int]) -> int:
        """The draft model's token for the position after seq (its argmax, or its coupled
        draw when sampling): one forward over what its cache lacks of seq."""
        logits = self._catch_up(seq)
        return draft_tokens(logits.unsqueeze(0), [self.sampling], [len(seq) - self.prompt_len])[0]

    def propose(self, seq: list[int], k: int, bonus: bool = False) -> Proposal:
        """k drafts, each the draft model's token given the drafts before it (its argmax, or
        its coupled draw when sampling), and with ``bonus`` its token after them too (one
        more draft position)."""
        m = max(k, 0) + bonus
        if m <= 0:
            return Proposal([])
        logits = self._catch_up(seq)
        tokens: list[int] = []
        at = len(seq) - self.prompt_len  # the output position of the first draft
        for i in range(m):
            tok = draft_tokens(logits.unsqueeze(0), [self.sampling], [at + i])[0]
            tokens.append(tok)
            if i + 1 < m:
                logits = fit_vocab(self._forward([tok]), self.vocab_size)
        return Proposal(tokens[:k], tokens[k] if bonus else None)

    def propose_tree(self, seq: list[int], k: int) -> tuple[list[int], list[int], list[float]]:
        """A SiblingTree after seq with a chain of k: the chain is the draft model's argmax at
        every position, greedy or sampling alike (the tree's nodes are deterministic drafts, so
        the tree walk's one-hot rejection keeps the target's law exact), and each position
        offers its next top-k - 1 tokens as siblings (SiblingTree.build)."""
        assert self.tree is not None, "this drafter drafts chains"
        if k <= 0:
            return [], [], []
        logits = self._catch_up(seq)
        chain: list[int] = []
        alternatives: list[tuple[float, int, int]] = []
        reach = 1.0  # the draft model's probability of its own chain so far
        extra = self.tree.top_k - 1
        for i in range(k):
            arg = logits.argmax().view(1)
            probs = torch.softmax(logits.float(), dim=-1)
            top = torch.topk(probs, extra + 1)
            # one transfer a position: the argmax, its probability and the top's ids and
            # probabilities (all exact in float64)
            got = torch.cat([arg.double(), probs[arg].double(), top.indices.double(), top.values.double()]).tolist()
            tok, p_tok = int(got[0]), got[1]
            ids, ps = [int(t) for t in got[2: extra + 3]], got[extra + 3:]
            if extra > 0:
                alts = [(p, t) for p, t in zip(ps, ids) if t != tok and p > 0][:extra]
                alternatives += [(reach * p, i, t) for p, t in alts]
            reach *= p_tok
            chain.append(tok)
            if i + 1 < k:
                logits = fit_vocab(self._forward([tok]), self.vocab_size)
        return self.tree.build(chain, alternatives)

    def accepted(self, proposed: int, accepted: int, seq: list[int]) -> None:
        self.tracker.update(proposed, accepted)


class _Row:
    """One row's drafting state in a BatchedModelDrafter."""

    def __init__(self, sampling: SamplingParams, prompt_len: int):
        self.sampling = sampling
        self.prompt_len = prompt_len  # output positions count from here
        self.tracker = AcceptanceTracker()
        self.cached: list[int] = []  # tokens whose keys/values are valid in the row's cache
        self.offset = 0  # where the draft model starts reading the record (prompt_offset)


class BatchedModelDrafter(DraftModelSettings):
    """ModelDrafter for a whole batch (a BatchedDrafter): one draft-model forward per draft
    position for all rows, over a slot cache of its own (marscli.models.slots).

    Each row drafts what a ModelDrafter would for it alone: the same greedy argmax or the
    same coupled draws for the same k; only the float summation order of the draft model's
    batched pass may differ.
    """

    feature_layers: tuple[int, ...] = ()
    tree = None
    plan = EAGER  # the engine's StepPlan (use_plan)

    def __init__(self, model, k_max: int, **kw):
        super().__init__(model, k_max, **kw)
        tok = getattr(model.config, "pad_token_id", None)
        self.pad_id = tok if isinstance(tok, int) else 0
        if not supports(model):  # build_drafters gives those a ModelDrafter per row
            raise ValueError("a batched draft model needs a model a slot cache can hold "
                             "(no sliding-window layer, an attention that takes a custom mask)")
        self.reset()

    def use_plan(self, plan: StepPlan) -> None:
        """Run the draft model's steps as the engine's plan says (from the next reset on)."""
        self.plan = plan

    def reset(self) -> None:
        # Its rows in slots (marscli.models.slots); its steps run as the engine's plan says
        # (use_plan). A slot cache of the same plan is kept, emptied: its captured shapes
        # live with the model.
        kv = getattr(self, "kv", None)
        plan = self.plan.on(self.device)
        if isinstance(kv, SlotCache) and getattr(self, "kv_plan", None) == plan:
            kv.clear_rows()
        else:
            self.kv = SlotCache.for_step(self.model, self.device, plan, pad_id=self.pad_id)
        self.kv_plan = plan
        self.rows: list[_Row] = []
        if not hasattr(self, "prefiller"):  # the prefix cache outlives the rows and jobs
            self.prefiller = Prefiller(self.model, self.device, PrefixCache(DRAFT_PREFIX_CACHE_MIB * MIB),
                                       self.pad_id)

    def add_row(self, prompt_ids: list[int], sampling: SamplingParams) -> None:
        """Prefill the new row's prompt but its last token, alone, and append the row."""
        self.add_rows([prompt_ids], [sampling])

    def add_rows(self, prompts: list[list[int]], samplings: list[SamplingParams]) -> None:
        """Prefill the new rows' prompts but their last tokens, together (in padded passes,
        each after what the draft model's prefix cache holds of it), and append the rows."""
        rows = []
        for ids, sampling in zip(prompts, samplings):
            row = _Row(sampling, len(ids))
            row.offset = prompt_offset(len(ids), self.context)
            row.cached = list(ids[row.offset:-1])
            rows.append(row)
        done = self.prefiller.prefill([r.cached for r in rows])
        self.kv.add_rows([(p.kv, p.length) for p in done])
        self.rows.extend(rows)

    def keep(self, rows: list[int]) -> None:
        self.rows = [self.rows[b] for b in rows]
        self.kv.keep_rows(rows)

    def propose_tree(self, row: int, seq: list[int], max_path: int):
        raise NotImplementedError("a draft model drafts chains")

    def observe(self, row: int, features: torch.Tensor) -> None:
        pass

    def accepted(self, row: int, proposed: int, accepted: int, seq: list[int]) -> None:
        self.rows[row].tracker.update(proposed, accepted)

    def rewind(self, row: int, seq: list[int]) -> None:
        """Nothing to do: the row's cache is compared with its sequence before every
        proposal (reusable_prefix) and cut where they part."""

    def _feed(self, feeds: list[list[int]]) -> torch.Tensor:
        """One forward: row b appends feeds[b] (possibly none) -> logits [B, S, V_draft]."""
        B = len(self.rows)
        S = max(len(f) for f in feeds)
        ids = torch.full((B, S), self.pad_id, dtype=torch.long)
        new_mask = torch.zeros(B, S, dtype=torch.long)
        for b, f in enumerate(feeds):
            if f:
                ids[b, : len(f)] = torch.tensor(f)
                new_mask[b, : len(f)] = 1
        npos = torch.tensor([len(h.cached) for h in self.rows], dtype=torch.long)
        pos = npos[:, None] + torch.arange(S)[None, :]
        ids, mask_on_device, pos = (to_device(t, self.device) for t in (ids, new_mask, pos))
        logits = self.kv.forward(ids, mask_on_device, pos).logits  # [B, S, V_draft]
        self.kv.commit(new_mask, [len(f) for f in feeds])  # known on the host: no transfer back
        for h, f in zip(self.rows, feeds):
            h.cached.extend(f)
        return logits

    def offers(self, seqs: list[list[int]], k_caps: list[int]) -> list[DraftOffer]:
        return [h.tracker.offer(cap) for h, cap in zip(self.rows, k_caps)]

    @torch.inference_mode()
    def propose(self, seqs: list[list[int]], ks: list[int], bonus: bool = False) -> list[Proposal]:
        rows = self.rows
        assert len(seqs) == len(ks) == len(rows)
        ks = [max(k, 0) for k in ks]
        ms = [k + bonus for k in ks]  # tokens each row drafts: its k, and the one after them
        catch: list[list[int]] = []
        for b, (h, seq, m) in enumerate(zip(rows, seqs, ms)):
            if m <= 0:
                catch.append([])
                continue
            # Bring the row's cache up to its committed sequence (at least the last token is new).
            seq = seq[h.offset:]
            common = reusable_prefix(h.cached, seq)
            if common < len(h.cached):
                self.kv.truncate_row(b, common)
                del h.cached[common:]
            catch.append(list(seq[common:]))
        if not any(ms):
            self.kv.trim()
            return [Proposal([]) for _ in rows]
        logits = self._feed(catch)
        # each drafting row's logits of its next draft [R, V]
        live = [b for b, m in enumerate(ms) if m > 0]
        last = torch.stack([fit_vocab(logits[b, len(catch[b]) - 1], self.vocab_size) for b in live])
        at = [len(seqs[b]) - rows[b].prompt_len for b in live]  # output position of each row's next draft
        tokens: list[list[int]] = [[] for _ in rows]
        for i in range(max(ms)):
            live_now = [j for j, b in enumerate(live) if i < ms[b]]
            # one argmax (or coupled draw) and one host transfer for every drafting row
            picked = draft_tokens(last[live_now], [rows[live[j]].sampling for j in live_now],
                                  [at[j] + i for j in live_now])
            feeds: list[list[int]] = [[] for _ in rows]
            for j, tok in zip(live_now, picked):
                b = live[j]
                tokens[b].append(tok)
                if i + 1 < ms[b]:
                    feeds[b] = [tok]
            if not any(feeds):
                break
            logits = self._feed(feeds)
            for j, b in enumerate(live):
                if feeds[b]:
                    last[j] = fit_vocab(logits[b, 0], self.vocab_size)
        self.kv.trim()
        return [Proposal(tokens[b][: ks[b]], tokens[b][ks[b]] if bonus and len(tokens[b]) > ks[b] else None)
                for b in range(len(rows))]
