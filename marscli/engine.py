"""The speculative decoding loop.

One step: the drafter proposes k tokens; the target scores [pending, d_1 .. d_k] in one
forward pass over its KV cache (k+1 logit rows); the verifier keeps a prefix of the drafts
and emits one more token; the target cache is cut back to what was kept. The target cache
always holds every committed token but the last ("pending") one, so no context is ever
re-encoded.

Data flow stays one way: Request -> prompt ids -> steps -> GenerationResult. Batching and
tree drafting plug in at the same seams: verify.* already works on [B, K] rows with
per-row draft lengths, and drafters work per sequence.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from marscli.config import DraftConfig, Request, SamplingParams, VerifyConfig
from marscli.drafters.base import Proposal
from marscli.kvcache import new_cache, rollback
from marscli.verify import verify

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
#: What to do with a prompt that does not fit the context window: fail the record, or keep
#: its end (TRUNCATE_LEFT).
TRUNCATE_NONE = "none"
TRUNCATE_LEFT = "left"


class RecordFailure(Exception):
    """A record that cannot be generated (too long, no chat template...): becomes an error
    result for that record while the run goes on."""

    def __init__(self, type_: str, message: str):
        super().__init__(message)
        self.type = type_
        self.message = message


@dataclass
class SpecStats:
    """Per-record speculative decoding statistics."""

    k_max: int
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    relaxed: int = 0
    relaxable: int = 0  # relaxable positions among those decided (accepted + first rejection)
    decided: int = 0  # draft positions whose fate was decided (accepted or the first rejection)
    emitted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_hist: list[int] = field(default_factory=list)  # steps by number of accepted drafts
    # Tree steps: drafted/accepted count path positions (depths); tree_nodes counts the nodes
    # the target scored.
    tree_nodes: int = 0

    def __post_init__(self) -> None:
        k = max(self.k_max, 0)
        self.accepted_per_position = self.accepted_per_position or [0] * k
        self.drafted_per_position = self.drafted_per_position or [0] * k
        self.accepted_hist = self.accepted_hist or [0] * (k + 1)

    def record_step(self, k: int, n: int, relaxed: int, relaxable: int, emitted: int) -> None:
        self.steps += 1
        self.drafted += k
        self.accepted += n
        self.relaxed += relaxed
        self.relaxable += relaxable
        self.decided += min(n + 1, k)
        self.emitted += emitted
        for i in range(k):
            self.drafted_per_position[i] += 1
        for i in range(n):
            self.accepted_per_position[i] += 1
        self.accepted_hist[n] += 1

    @property
    def acceptance_length(self) -> float:
        return self.emitted / self.steps if self.steps else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "relaxed": self.relaxed,
            "relaxable_positions": self.relaxable,
            "decided_positions": self.decided,
            "acceptance_length": round(self.acceptance_length, 4),
            "accepted_per_position": self.accepted_per_position,
            "drafted_per_position": self.drafted_per_position,
            "accepted_per_step_hist": self.accepted_hist,
            **({"tree_nodes": self.tree_nodes} if self.tree_nodes else {}),
        }


@dataclass
class GenerationResult:
    token_ids: list[int]  # completion tokens as generated (an EOS token included)
    text: str
    finish_reason: str
    prompt_tokens: int
    stats: SpecStats
    seconds: float
    #: The record's max_tokens cut to what the context window leaves after the prompt, when
    #: that is less than it asked for (None: not capped).
    max_tokens_capped_to: int | None = None

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


class _StopChecker:
    """Finds stop strings in the decoded completion as tokens arrive."""

    def __init__(self, tokenizer, stops: tuple[str, ...]):
        self.tokenizer = tokenizer
        self.stops = tuple(s for s in stops if s)
        self.longest = max((len(s) for s in self.stops), default=0)

    def first_stop(self, tokens: list[int], checked_chars: int) -> tuple[int | None, str]:
        """(char offset of the earliest stop string or None, decoded text)."""
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        start = max(0, checked_chars - self.longest)
        hits = [i for i in (text.find(s, start) for s in self.stops) if i >= 0]
        return (min(hits) if hits else None), text


@dataclass
class StepObservation:
    """What the target saw and decided in one step, for observers such as calibration.

    The drafts beyond the first rejection were scored too (one forward pass covers all k), so
    an observer can replay the step under another verification rule.
    """

    drafts: torch.Tensor  # [1, k] long
    logits: torch.Tensor  # [1, k+1, V] raw target logits
    result: Any  # VerifyResult
    sampling: SamplingParams
    u_accept: torch.Tensor | None  # [1, k] the acceptance uniforms (sampling only)
    draft_probs: torch.Tensor | None  # [1, k, V] q (sampling with a model drafter only)
    emitted: int  # tokens this step added to the completion (after stopping rules)
    # Tree steps (EAGLE-3 trees): drafts/logits above are the accepted path and its rows
    # ([1, n] and [1, n+1, V]); result is the tree verifier's; these hold the whole tree.
    tree: Any = None  # marscli.tree.DraftTree
    tree_logits: torch.Tensor | None = None  # [N+1, V] rows: root, then node i at i + 1
    tree_u_accept: torch.Tensor | None = None  # [N] acceptance uniforms (sampling only)


class SpecEngine:
    """Speculative generation for one target with one drafter and one verification rule.

    target: an object with .model, .tokenizer, .device, .eos_token_ids, .context_length
    (marscli.models.LoadedModel). drafter: see marscli.drafters.base.Drafter.
    """

    def __init__(self, target, drafter, verify_cfg: VerifyConfig, draft_cfg: DraftConfig):
        self.target = target
        self.model = target.model
        self.tokenizer = target.tokenizer
        self.device = target.device
        self.eos = set(int(t) for t in target.eos_token_ids)
        self.drafter = drafter
        self.verify_cfg = verify_cfg
        self.k_max = 0 if draft_cfg.kind == "none" else draft_cfg.num_draft_tokens
        self.theta = verify_cfg.effective_theta
        # A drafter that drafts from the target's hidden states (EAGLE-3) names the layers it
        # reads; every target forward pass then captures them (no second pass).
        layers = getattr(drafter, "feature_layers", None)
        self.tap = None
        if layers:
            from marscli.eagle3 import FeatureTap

            self.tap = FeatureTap(self.model, layers)
        self.last_features: torch.Tensor | None = None  # [B, S, F] from the newest forward pass
        # Tree drafting (EAGLE-3 --tree-*): paths hold at most max_path drafts.
        self.tree = getattr(drafter, "tree", None)
        if self.tree is not None:
            from marscli.errors import UsageError
            from marscli.tree import check_tree_support

            try:
                check_tree_support(self.model)
            except ValueError as e:  # sliding windows, flash attention...: chain drafting still works
                raise UsageError(f"--tree-*: {e}") from None
            self.k_max = self.tree.max_path
        if self.device.type == "cpu":
            from marscli.fastpath import install_cpu_fastpath

            install_cpu_fastpath(self.model)

    # ------------------------------------------------------------------ prompts

    def encode(self, req: Request) -> list[int]:
        """Prompt token ids for a request; a prompt that does not fit is a RecordFailure."""
        return self.fit_prompt(self.tokenize(req))[0]

    def tokenize(self, req: Request) -> list[int]:
        """Prompt token ids (chat template applied to messages), not yet fitted to the window."""
        tok = self.tokenizer
        if req.messages is not None:
            if not getattr(tok, "chat_template", None):
                raise RecordFailure(
                    "no_chat_template",
                    "the target has no chat template, so 'messages' cannot be rendered; "
                    "send 'prompt' with the raw text instead",
                )
            text = tok.apply_chat_template(req.messages, add_generation_prompt=True, tokenize=False)
            ids = tok(text, add_special_tokens=False).input_ids
        else:
            ids = tok(req.prompt).input_ids
        if not ids:
            raise RecordFailure("empty_prompt", "the prompt encodes to zero tokens")
        return ids

    def fit_prompt(self, ids: list[int], *, truncate: str = TRUNCATE_NONE,
                   max_tokens: int = 1) -> tuple[list[int], int]:
        """Fit prompt ids to the target's context window -> (ids, tokens dropped at the start).

        TRUNCATE_NONE: a prompt that leaves no room for one new token is a RecordFailure.
        TRUNCATE_LEFT: drop the oldest tokens until prompt + max_tokens fits (at least one
        prompt token stays); a prompt that already leaves room is never changed.
        """
        ctx = self.target.context_length
        if ctx is None:
            return ids, 0
        if truncate == TRUNCATE_LEFT:
            keep = max(1, ctx - max(max_tokens, 1))
            if len(ids) > keep:
                return ids[-keep:], len(ids) - keep
            return ids, 0
        if truncate != TRUNCATE_NONE:
            raise ValueError(f"unknown truncation {truncate!r}")
        if len(ids) >= ctx:
            raise RecordFailure(
                "prompt_too_long",
                f"prompt has {len(ids)} tokens; the target's context window is {ctx} "
                "(--truncate-prompt left keeps the end of the prompt instead)",
            )
        return ids, 0

    # ------------------------------------------------------------------ generation

    def run(self, items, prepare, observer_for=None):
        """Generate every item one at a time; yield (item, GenerationResult or the exception
        that ended that record). Same contract as BatchEngine.run: prepare(item) -> (prompt
        ids, sampling); observer_for(item) -> an observer of that record's steps or None."""
        for item in items:
            try:
                ids, sampling = prepare(item)
                observer = observer_for(item) if observer_for is not None else None
                res = self.generate_ids(ids, sampling, observer=observer)
            except Exception as e:  # noqa: BLE001 - one record's failure ends only it
                yield item, e
                continue
            yield item, res

    def generate(self, req: Request, sampling: SamplingParams,
                 observer: Callable[[StepObservation], None] | None = None) -> GenerationResult:
        return self.generate_ids(self.encode(req), sampling, observer=observer)

    @torch.inference_mode()
    def generate_ids(self, prompt_ids: list[int], sampling: SamplingParams,
                     on_step: Callable[[int], None] | None = None,
                     observer: Callable[[StepObservation], None] | None = None) -> GenerationResult:
        s = Sequence(self, self.drafter, prompt_ids, sampling, on_step=on_step, observer=observer)
        cache = new_cache(self.model)
        if len(prompt_ids) > 1:  # prefill all but the pending last token; its logits are not needed
            self._forward(list(prompt_ids[:-1]), cache, logits_to_keep=1)
            s.observe_prefill(self.last_features)
        while not s.done:
            if self.tree is not None:
                self._tree_step(s, cache)
                continue
            drafts, proposal = s.propose()
            base = cache.get_seq_length()
            logits = self._forward([s.seq[-1]] + drafts, cache)  # [1, k+1, V]
            n = s.commit(drafts, proposal, logits, features=self.last_features)
            rollback(cache, base + 1 + n)
        return s.result()

    def _tree_step(self, s: Sequence, cache) -> None:
        """One step with a draft tree: one target pass over root + all nodes (tree mask and
        tree position ids), verification along the tree, then only the accepted path stays
        in the cache."""
        from marscli.tree import compact_cache, tree_forward

        tree = s.propose_tree()
        base = cache.get_seq_length()
        if len(tree) == 0:  # nothing to draft (budget, or no features yet): a plain step
            logits = self._forward([s.seq[-1]], cache)  # [1, 1, V]
            s.commit([], Proposal([]), logits, features=self.last_features)
            rollback(cache, base + 1)
            return
        with self.capture():
            logits, _ = tree_forward(self.model, cache, tree, s.seq[-1], base)  # [N+1, V]
        path = s.commit_tree(tree, logits, features=self.last_features)
        compact_cache(cache, base, path)

    # ------------------------------------------------------------------ internals

    def _forward(self, ids: list[int], cache, logits_to_keep: int = 0) -> torch.Tensor:
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        with self.capture():
            out = self.model(input_ids=x, past_key_values=cache, use_cache=True,
                             logits_to_keep=logits_to_keep)
        return out.logits  # [1, len(ids) or logits_to_keep, V]

    @contextlib.contextmanager
    def capture(self):
        """Run a target forward pass inside this to leave its features in last_features
        ([B, S, F]; None when the drafter reads none)."""
        if self.tap is None:
            self.last_features = None
            yield
            return
        with self.tap.capture():
            yield
        self.last_features = self.tap.features


def verify_step(d: torch.Tensor, logits: torch.Tensor, proposal: Proposal, sampling: SamplingParams,
                gen: torch.Generator, theta: float, margin: str):
    """Verify drafts d [1, k] against logits [1, k+1, V] -> (result, u_accept, q)."""
    k = d.shape[1]
    if sampling.greedy:
        return verify(d, logits, theta=theta, margin=margin), None, None
    # A fixed number of uniforms per step keeps the random stream a function of the
    # sequence of draft lengths only (and so independent of any batch the row is in).
    u_accept = torch.rand(1, k, generator=gen).to(logits.device)
    u_sample = torch.rand(1, generator=gen).to(logits.device)
    q = None if proposal.probs is None else proposal.probs[:k].unsqueeze(0).to(logits.device)
    if q is not None and q.shape[-1] != logits.shape[-1]:
        raise RuntimeError(f"draft probs width {q.shape[-1]} != target logits {logits.shape[-1]}")
    res = verify(
        d, logits, theta=theta, margin=margin,
        temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
        u_accept=u_accept, u_sample=u_sample, draft_probs=q,
    )
    return res, u_accept, q


class Sequence:
    """One record's decoding state, independent of how its target forward passes are run.

    SpecEngine runs one Sequence over its own cache; marscli.batch runs many over one batched
    cache. Both call propose() -> forward [pending, drafts] -> commit(logits), so a record's
    drafts, random draws, verification and stopping are the same code whichever path runs it.
    engine: a SpecEngine (for tokenizer, eos, k_max, theta, verify_cfg, target).
    """

    def __init__(self, engine: SpecEngine, drafter, prompt_ids: list[int], sampling: SamplingParams,
                 on_step: Callable[[int], None] | None = None,
                 observer: Callable[[StepObservation], None] | None = None):
        self.t0 = time.perf_counter()
        self.engine = engine
        self.drafter = drafter
        self.sampling = sampling
        self.on_step = on_step
        self.observer = observer
        self.prompt_len = len(prompt_ids)
        max_new = sampling.max_tokens
        if engine.target.context_length is not None:
            max_new = min(max_new, engine.target.context_length - len(prompt_ids))
        self.max_new = max_new
        self.stats = SpecStats(engine.k_max)
        self.gen = torch.Generator(device="cpu").manual_seed(sampling.seed)
        draft_gen = torch.Generator(device="cpu").manual_seed(sampling.seed + 0x5EED)
        drafter.start(list(prompt_ids), sampling, draft_gen)
        self.stopper = _StopChecker(engine.tokenizer, sampling.stop) if sampling.stop else None
        self.seq = list(prompt_ids)
        self.out: list[int] = []
        self.finish = FINISH_LENGTH
        self.checked_chars = 0
        self.text: str | None = None
        self.done = len(self.out) >= self.max_new

    def k_cap(self) -> int:
        """The most drafts the next step can use (the remaining budget less the bonus)."""
        return min(self.engine.k_max, self.max_new - len(self.out) - 1)

    def propose(self) -> tuple[list[int], Proposal]:
        """The drafts for the next step (at most what the remaining budget can use)."""
        k_cap = self.k_cap()
        proposal = self.drafter.propose(self.seq, k_cap) if k_cap > 0 else Proposal([])
        return proposal.tokens[:k_cap], proposal

    def observe_prefill(self, features: torch.Tensor | None) -> None:
        """Hand the prefill's target features [1, S, F] to a drafter that reads them."""
        if features is not None:
            self.drafter.observe(features[0])

    def commit(self, drafts: list[int], proposal: Proposal, logits: torch.Tensor,
               features: torch.Tensor | None = None) -> int:
        """Verify this step's drafts against the target's logits [1, k+1, V] for
        [pending, drafts]; extend the sequence; return the number of accepted drafts (the
        caller keeps the pending token and that many drafts in its cache). features
        [1, k+1, F]: the same pass's target features, for a drafter that reads them."""
        k = len(drafts)
        assert logits.shape[:2] == (1, k + 1), (tuple(logits.shape), k)
        eng = self.engine
        d = torch.tensor([drafts], dtype=torch.long, device=logits.device).view(1, k)
        res, u_accept, q = verify_step(d, logits, proposal, self.sampling, self.gen,
                                       eng.theta, eng.verify_cfg.margin)
        n = int(res.num_accepted[0])
        relaxed = int(res.relaxed[0, :n].sum()) if k else 0
        decided = min(n + 1, k)
        relaxable = int(res.relaxable[0, :decided].sum()) if k else 0
        emitted = self._finish_step(
            drafts[:n] + [int(res.next_token[0])], k, n, relaxed, relaxable,
            lambda e: StepObservation(d, logits, res, self.sampling, u_accept, q, e))
        if features is not None:  # the positions the target keeps: pending + accepted drafts
            self.drafter.observe(features[0, : len(emitted)])
        self.drafter.accepted(k, n, self.seq)
        return n

    # ------------------------------------------------------------------ trees

    def propose_tree(self):
        """The draft tree for the next step (paths cut to what the remaining budget can use)."""
        from marscli.tree import DraftTree

        k_cap = self.k_cap()
        tokens, parents, _ = self.drafter.propose_tree(self.seq, k_cap) if k_cap > 0 else ([], [], [])
        return DraftTree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long))

    def commit_tree(self, tree, logits: torch.Tensor, features: torch.Tensor | None = None) -> list[int]:
        """Verify a draft tree against the target's logits [N+1, V] for [pending, nodes];
        extend the sequence; return the accepted path (node indices; the caller keeps the
        pending token and the path in its cache). features [1, N+1, F]: the same pass's."""
        from marscli.tree import verify_tree

        N = len(tree)
        assert logits.shape[0] == N + 1, (tuple(logits.shape), N)
        eng = self.engine
        s = self.sampling
        u_accept = u_sample = None
        if not s.greedy:  # a fixed number of draws per step (N + 1), as in the chain case
            u_accept = torch.rand(N, generator=self.gen).to(logits.device)
            u_sample = torch.rand(1, generator=self.gen).to(logits.device)
        res = verify_tree(tree, logits, theta=eng.theta, margin=eng.verify_cfg.margin,
                          temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                          u_accept=u_accept, u_sample=u_sample)
        path = [int(i) for i in res.path]
        n = len(path)
        depth = int(tree.depth().max()) if N else 0
        tokens = tree.tokens.tolist()
        rows = [0] + [i + 1 for i in path]  # logits rows that decided something
        relaxed = sum(bool(r) for r in res.relaxed)  # per accepted node
        decided = rows[: min(n + 1, depth)]  # rows whose children were judged
        relaxable = int(res.relaxable[torch.tensor(decided, dtype=torch.long)].sum()) if decided else 0
        self.stats.tree_nodes += N
        emitted = self._finish_step(
            [tokens[i] for i in path] + [int(res.next_token)], depth, n, relaxed, relaxable,
            lambda e: StepObservation(
                tree.tokens[path].view(1, n) if n else torch.zeros(1, 0, dtype=torch.long),
                logits[rows].unsqueeze(0), res, s, None, None, e, tree=tree, tree_logits=logits,
                tree_u_accept=u_accept))
        if features is not None:
            self.drafter.observe(features[0, rows][: len(emitted)])
        self.drafter.accepted(depth, n, self.seq)
        return path

    def _finish_step(self, emitted: list[int], k: int, n: int, relaxed: int, relaxable: int,
                     observation: Callable[[int], StepObservation]) -> list[int]:
        """Stopping rules, statistics, observer and sequence update for one verified step;
        returns the tokens the step really added."""
        eng = self.engine
        remaining = self.max_new - len(self.out)
        # Stopping: EOS ends the sequence after it; max tokens cuts the step short.
        stop_at = None
        for i, t in enumerate(emitted):
            if t in eng.eos:
                stop_at = i + 1
                break
        if stop_at is not None:
            emitted = emitted[:stop_at]
            self.finish = FINISH_STOP
        emitted = emitted[:remaining]
        self.stats.record_step(k, n, relaxed, relaxable, len(emitted))
        if self.observer is not None:
            self.observer(observation(len(emitted)))
        self.seq.extend(emitted)
        out = self.out
        out.extend(emitted)
        if self.on_step is not None:
            self.on_step(len(emitted))
        if self.stopper is not None:
            # Check token by token so the completion ends at the token that completes it.
            at, decoded = None, ""
            for j in range(len(out) - len(emitted) + 1, len(out) + 1):
                at, decoded = self.stopper.first_stop(out[:j], self.checked_chars)
                if at is not None:
                    del out[j:]
                    break
            if at is not None:
                self.text = decoded[:at]
                self.finish = FINISH_STOP
            else:
                self.checked_chars = len(decoded)  # the loop's last decode was the whole completion
        self.done = self.finish == FINISH_STOP or len(out) >= self.max_new
        return emitted

    def result(self) -> GenerationResult:
        text = self.text
        if text is None:
            text = self.engine.tokenizer.decode(self.out, skip_special_tokens=True)
        capped = self.max_new if self.max_new < self.sampling.max_tokens else None
        return GenerationResult(self.out, text, self.finish, self.prompt_len, self.stats,
                                time.perf_counter() - self.t0, capped)


def build_drafter(draft_cfg: DraftConfig, target, draft_model=None):
    """Make the drafter a DraftConfig asks for (draft_model: a LoadedModel for kind 'model')."""
    from marscli.drafters.base import CostModel
    from marscli.drafters.model import ModelDrafter
    from marscli.drafters.ngram import NgramDrafter, NoDrafter

    device_type = target.device.type
    if draft_cfg.kind == "eagle3":
        from marscli.drafters.eagle3 import Eagle3Drafter, TreeShape

        if draft_model is None:
            raise ValueError("an EAGLE-3 drafter needs a loaded head (marscli.eagle3.load_head)")
        head = getattr(draft_model, "head", draft_model)
        tree = (TreeShape(draft_cfg.tree_depth, draft_cfg.tree_top_k, draft_cfg.tree_tokens)
                if draft_cfg.tree else None)
        t_params = sum(p.numel() for p in target.model.parameters())
        h_params = sum(p.numel() for p in head.parameters())
        cost = CostModel.for_device(device_type, draft_step=h_params / max(t_params, 1))
        vocab = target.model.get_output_embeddings().weight.shape[0]
        return Eagle3Drafter(head, draft_cfg.num_draft_tokens, vocab_size=vocab, cost=cost,
                             adaptive=draft_cfg.adaptive, tree=tree)
    if draft_cfg.kind == "none":
        return NoDrafter()
    if draft_cfg.kind == "ngram":
        return NgramDrafter(draft_cfg.num_draft_tokens, ngram_max=draft_cfg.ngram_max,
                            ngram_min=draft_cfg.ngram_min, cost=CostModel.for_device(device_type),
                            adaptive=draft_cfg.adaptive)
    if draft_model is None:
        raise ValueError("a model drafter needs a loaded draft model")
    if draft_model.device.type == "cpu":
        from marscli.fastpath import install_cpu_fastpath

        install_cpu_fastpath(draft_model.model)
    t_params = sum(p.numel() for p in target.model.parameters())
    d_params = sum(p.numel() for p in draft_model.model.parameters())
    # Decode is memory-bound: a draft step costs roughly its share of the weights.
    ratio = d_params / max(t_params, 1)
    cost = CostModel.for_device(device_type, draft_step=ratio if math.isfinite(ratio) else 1.0)
    vocab = target.model.get_output_embeddings().weight.shape[0]
    return ModelDrafter(draft_model.model, draft_cfg.num_draft_tokens, cost=cost,
                        adaptive=draft_cfg.adaptive, vocab_size=vocab)


def build_engine(target, draft_model, verify_cfg: VerifyConfig, draft_cfg: DraftConfig,
                 batch_size: int = 1):
    """THE place an engine is made: the drafter(s) for draft_cfg, the verification rule and
    the batch size. draft_model: the loaded draft model or EAGLE-3 head (None for ngram/none).
    Raises UsageError for combinations the engine cannot run (trees or sliding windows at
    batch size > 1). Every engine has run(items, prepare, observer_for), tokenize, fit_prompt,
    encode and generate_ids."""
    from marscli.errors import UsageError

    if batch_size > 1:
        from marscli.batch import BatchEngine, batched_drafter_for

        try:
            return BatchEngine(target, lambda: build_drafter(draft_cfg, target, draft_model),
                               verify_cfg, draft_cfg, batch_size,
                               batched_drafter=batched_drafter_for(draft_cfg, target, draft_model))
        except ValueError as e:
            raise UsageError(str(e)) from None
    return SpecEngine(target, build_drafter(draft_cfg, target, draft_model), verify_cfg, draft_cfg)
