"""One record's decoding state: its tokens, stopping rules, random stream and statistics.

A Sequence knows nothing of models, caches, drafters or batches: the scheduler
(marscli.engine.scheduler) runs the target and the drafter, verifies, and hands each row's
verdict to ``Sequence.commit``, the one commit path of chain and tree steps alike. What a
Sequence needs from its engine is a small settings value (``RowSettings``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from marscli.config import GUARD_OFF, GuardConfig, SamplingParams
from marscli.engine.provenance import Provenance
from marscli.verification.guard import MAX_REWINDS, LoopWatch, NgramIndex
from marscli.verification.spans import SpanTracker

FINISH_STOP = "stop"
FINISH_LENGTH = "length"


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
    relaxable: int = 0  # relaxable positions among those decided
    #: positions whose proposal the rule judged for an emitted token (accepted drafts, the
    #: first rejected one, and the proposal after a step's drafts when it had one)
    decided: int = 0
    emitted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_hist: list[int] = field(default_factory=list)  # steps by number of accepted drafts
    # Tree steps: drafted/accepted count path positions (depths); tree_nodes counts the nodes
    # the target scored.
    tree_nodes: int = 0
    # The loop guard (only reported when a guard is active): steps whose first rejection was
    # a relaxation the guard or the budget refused, and the completion length at which the
    # relaxation budget ran out (the record is strict from there on).
    guarded: bool = False
    guard_refused: int = 0
    budget_spent_at: int | None = None
    # Strict spans (marscli.verification.spans; only reported when spans are on and the rule relaxes):
    # steps whose first rejection was a relaxation refused because the position lay in a
    # strict span. A refusal is counted once: here when the position is in a span, else in
    # guard_refused (the loop guard or the budget).
    spans: bool = False
    span_refused: int = 0
    # Loop rewinds (only reported when they are on): relaxations taken back because the output
    # fell into a loop after them, and the tokens those rewinds discarded.
    rewinding: bool = False
    rewinds: int = 0
    rewound_tokens: int = 0

    def __post_init__(self) -> None:
        k = max(self.k_max, 0)
        self.accepted_per_position = self.accepted_per_position or [0] * k
        self.drafted_per_position = self.drafted_per_position or [0] * k
        self.accepted_hist = self.accepted_hist or [0] * (k + 1)

    def record_step(self, k: int, n: int, relaxed: int, relaxable: int, emitted: int,
                    decided: int | None = None) -> None:
        """One step: k drafts, n accepted, ``decided`` judged proposals (default: the drafts
        up to the first rejection)."""
        self.steps += 1
        self.drafted += k
        self.accepted += n
        self.relaxed += relaxed
        self.relaxable += relaxable
        self.decided += min(n + 1, k) if decided is None else decided
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
            **({"guard_refused": self.guard_refused, "budget_spent_at": self.budget_spent_at}
               if self.guarded else {}),
            **({"span_refused": self.span_refused} if self.spans else {}),
            **({"rewinds": self.rewinds, "rewound_tokens": self.rewound_tokens} if self.rewinding else {}),
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
    #: Per completion token, the target's logprob and top alternatives
    #: (marscli.engine.logprobs.TokenLogprob), when the record asks for them; else None.
    logprobs: list | None = None
    #: Where each completion token came from (marscli.engine.provenance: Provenance.to_dict()),
    #: when the record asks; else None.
    provenance: dict | None = None

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


def first_tokens(tokenizer, stops: tuple[str, ...]) -> set[int]:
    """The first token of each stop string as the tokenizer encodes it alone."""
    out = set()
    for text in stops:
        ids = tokenizer.encode(text, add_special_tokens=False) if text else []
        if ids:
            out.add(int(ids[0]))
    return out


class StopChecker:
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
    result: Any  # VerifyResult ([1, k+1] shapes; its strict_ok says where the proposal is the target's token)
    sampling: SamplingParams
    emitted: int  # tokens this step added to the completion (after stopping rules)
    #: The proposal for the position after the drafts (judged there too), or None: none
    next_proposal: int | None = None
    # Tree steps (EAGLE-3 trees): drafts/logits above are the accepted path and its rows
    # ([1, n] and [1, n+1, V]); result is the tree verifier's; these hold the whole tree.
    tree: Any = None  # marscli.verification.tree.DraftTree
    tree_logits: torch.Tensor | None = None  # [N+1, V] rows: root, then node i at i + 1
    #: The loop guard's verdict per position ([1, k+1] bool; [N] per node for trees):
    #: calibration replays relaxed rules with it. None: no guard.
    guard: torch.Tensor | None = None
    #: Which of those positions lie in a strict span (marscli.verification.spans; same shape; None: no
    #: spans). They are included in `guard` already; kept apart so a replay can tell them.
    strict_span: torch.Tensor | None = None


@dataclass(frozen=True)
class RowSettings:
    """What every record of an engine shares: the small settings value a Sequence holds."""

    tokenizer: Any  # decodes the completion (stop strings, the final text)
    eos: frozenset[int]
    k_max: int  # the most drafts (chain) or path positions (tree) a step verifies
    context_length: int | None
    #: The loop guard and relaxation budget of a relaxed rule (GUARD_OFF: none). A Sequence
    #: keeps the n-gram index of its output when the guard is on and the rule relaxes or the
    #: record has an observer (calibration, strict, records the verdicts for its replay).
    guard: GuardConfig = GUARD_OFF
    relaxing: bool = False  # the rule relaxes: the budget applies
    #: Strict spans (a marscli.verification.spans.SpanRule; None: none). A Sequence tracks them when the
    #: rule relaxes or the record has an observer, as it keeps the n-gram index.
    spans: Any = None
    #: Loop rewinds (GuardConfig.loop_rewind; 0: off): when the output falls into a loop within
    #: this many tokens after a relaxed token, the record rewinds to the earliest such token and
    #: decides its position strictly (``Sequence.commit``). On only where every position is judged from
    #: the text (the engine's position-wise rows).
    loop_rewind: int = 0


#: Builds a step's StepObservation from the number of tokens the step really added; called
#: only when the record has an observer, so a run without one builds none.
ObservationFactory = Callable[[int], StepObservation]


class Sequence:
    """One record being decoded."""

    def __init__(self, settings: RowSettings, prompt_ids: list[int], sampling: SamplingParams,
                 observer: Callable[[StepObservation], None] | None = None):
        self.t0 = time.perf_counter()
        self.settings = settings
        self.sampling = sampling
        self.observer = observer
        self.prompt_len = len(prompt_ids)
        max_new = sampling.max_tokens
        if settings.context_length is not None:
            max_new = min(max_new, settings.context_length - len(prompt_ids))
        self.max_new = max_new
        self.stats = SpecStats(settings.k_max)
        #: the regret rule's summed regret of the proposals emitted since the last position
        #: where the target's token replaced the proposal (marscli.verification.chain)
        self.regret = 0.0
        self.stopper = StopChecker(settings.tokenizer, sampling.stop) if sampling.stop else None
        self.seq = list(prompt_ids)
        self.out: list[int] = []
        self.finish = FINISH_LENGTH
        self.checked_chars = 0
        self.text: str | None = None
        self.done = len(self.out) >= self.max_new
        g = settings.guard
        # The n-gram index only where its verdicts are read: a relaxed rule, or an observer
        # (calibration records them); a plain strict run does not pay for it.
        wanted = g.repeat_ngram and (settings.relaxing or observer is not None)
        self.ngrams = NgramIndex(g.repeat_ngram, g.repeat_window) if wanted else None
        self.relax_budget = g.budget(self.max_new) if settings.relaxing else None
        self.stats.guarded = settings.relaxing and (g.repeat_ngram > 0 or g.budgeted)
        if self.relax_budget == 0:
            self.stats.budget_spent_at = 0
        # Strict spans, only where they can change a verdict or an observer records them.
        track = settings.spans is not None and (settings.relaxing or observer is not None)
        self.spans = SpanTracker(settings.tokenizer, settings.spans) if track else None
        self.stats.spans = settings.spans is not None and settings.relaxing
        self.provenance = Provenance() if sampling.provenance else None
        # Loop rewinds: the loop test kept token by token, the output positions of relaxed
        # tokens, the positions a rewind made strict, and where the last commit rewound to.
        self.loops = LoopWatch() if settings.loop_rewind and settings.relaxing else None
        self.stats.rewinding = self.loops is not None
        self.relaxed_at: list[int] = []
        self.strict_at: set[int] = set()
        self.rewound_at: int | None = None
        # The relaxed rules' strict first tokens and stop tokens (GuardConfig.strict_first,
        # strict_stops), read where the n-gram index is: a relaxed rule or an observer.
        judged = settings.relaxing or observer is not None
        self.strict_first = g.strict_first if judged else 0
        self.stop_tokens: tuple[int, ...] = ()
        if judged and g.strict_stops:
            self.stop_tokens = tuple(sorted(settings.eos | set(first_tokens(settings.tokenizer, sampling.stop))))

    def repeats(self, drafts: list[int]) -> list[bool]:
        """Per draft: the loop guard refuses to relax it (it completes an n-gram seen in the
        last W tokens of the output); all False without a guard."""
        return self.ngrams.repeats(drafts) if self.ngrams is not None else [False] * len(drafts)

    def strict_spans(self, drafts: list[int]) -> list[bool]:
        """Per draft: it lies in a strict span (marscli.verification.spans), judged from the committed
        output and the drafts before it; all False without spans."""
        return self.spans.flags(drafts) if self.spans is not None else [False] * len(drafts)

    def strict_first_flags(self, depths: list[int]) -> list[bool]:
        """Per draft at depth d (1: the step's first draft): it lies among the output's first
        ``strict_first`` tokens, which relaxed rules verify strictly."""
        left = self.strict_first - len(self.out)
        return [d <= left for d in depths]

    def rewound_flags(self, n: int) -> list[bool]:
        """Per proposal for the next n output positions: a rewind made its position strict."""
        at = len(self.out)
        return [at + j in self.strict_at for j in range(n)]

    def strict_spans_tree(self, tokens: list[int], parents: list[int]) -> list[bool]:
        """The same per node of a draft tree (parents before children, -1: the root)."""
        if self.spans is None:
            return [False] * len(tokens)
        return self.spans.tree_flags(tokens, parents)

    def rewinds_spent(self) -> bool:
        """The record's relaxations derailed MAX_REWINDS times (once): it relaxes no more."""
        return self.loops is not None and self.stats.rewinds >= MAX_REWINDS

    def relax_left(self) -> int | None:
        """Relaxations this record may still make (None: no budget; 0 too once its rewinds
        reached MAX_REWINDS: strict from there on)."""
        if self.rewinds_spent():
            return 0
        if self.relax_budget is None:
            return None
        return max(self.relax_budget - self.stats.relaxed, 0)

    @property
    def left(self) -> int:
        """New tokens the record may still generate (max tokens less its output)."""
        return self.max_new - len(self.out)

    def k_cap(self) -> int:
        """The most drafts the next step can use (the remaining budget less the bonus)."""
        return min(self.settings.k_max, self.left - 1)

    def commit(self, emitted: list[int], k: int, n: int, relaxed: list[int] | list[bool], relaxable: int,
               observation: ObservationFactory | None = None, refused: int = 0,
               span_refused: int = 0, origin: tuple[str, list] | None = None,
               decided: int | None = None) -> list[int]:
        """Apply one verified step: `emitted` = the accepted drafts (chain) or path tokens
        (tree), then the correction or bonus; `relaxed`: per emitted token, whether the rule
        relaxed to it (counted for the tokens the step really adds). Stopping rules, statistics, the observer and the
        sequence update; returns the tokens the step really added. `refused`: the step's
        first rejection was a relaxation the loop guard or the budget refused; `span_refused`:
        one refused because it lay in a strict span (counted there only). `origin`: the
        provenance of `emitted` (kinds, statistics; marscli.engine.provenance), when the
        record asks for it."""
        remaining = self.left
        # Stopping: EOS ends the sequence after it; max tokens cuts the step short.
        stop_at = None
        for i, t in enumerate(emitted):
            if t in self.settings.eos:
                stop_at = i + 1
                break
        if stop_at is not None:
            emitted = emitted[:stop_at]
            self.finish = FINISH_STOP
        emitted = emitted[:remaining]
        self.rewound_at = None
        rewind_to = None
        if self.loops is not None:
            emitted, rewind_to = self._watch(emitted, relaxed)
        self.stats.record_step(k, n, sum(1 for f in relaxed[: len(emitted)] if f), relaxable, len(emitted),
                               decided)
        self.stats.guard_refused += refused
        self.stats.span_refused += span_refused
        if self.provenance is not None and origin is not None:
            self.provenance.extend(origin[0][: len(emitted)], origin[1])
        if self.observer is not None and observation is not None:
            self.observer(observation(len(emitted)))
        self.seq.extend(emitted)
        out = self.out
        out.extend(emitted)
        if self.ngrams is not None:
            self.ngrams.extend(emitted)
        if self.spans is not None:
            self.spans.commit(emitted)
        if (self.relax_budget is not None and self.stats.budget_spent_at is None
                and self.stats.relaxed >= self.relax_budget):
            self.stats.budget_spent_at = len(out)
        if self.stopper is not None:
            # Check token by token so the completion ends at the token that completes it.
            at, decoded = None, ""
            for j in range(len(out) - len(emitted) + 1, len(out) + 1):
                at, decoded = self.stopper.first_stop(out[:j], self.checked_chars)
                if at is not None:
                    del out[j:]
                    if self.provenance is not None:
                        self.provenance.truncate(j)
                    break
            if at is not None:
                self.text = decoded[:at]
                self.finish = FINISH_STOP
            else:
                self.checked_chars = len(decoded)  # the loop's last decode was the whole completion
        if rewind_to is not None:
            self.rewind(rewind_to)
        self.done = self.finish == FINISH_STOP or len(out) >= self.max_new
        return emitted

    def _watch(self, emitted: list[int], relaxed) -> tuple[list[int], int | None]:
        """Push a step's tokens through the loop test one at a time, as if they came one
        position at a time: at the first token after which the output ends in a loop whose
        periodic tail begins at most ``loop_rewind`` tokens after a relaxed token (one a
        rewind has not already decided strictly), the step's tokens end there and the
        record will rewind to the earliest such relaxed token: one rewind takes back every
        relaxation in the window, and the record relaxes no more after MAX_REWINDS of them.
        Returns (the tokens to commit, the position to rewind to or None)."""
        W = self.settings.loop_rewind
        base = len(self.out)
        for i, t in enumerate(emitted):
            if relaxed[i] if i < len(relaxed) else False:
                self.relaxed_at.append(base + i)
            p = self.loops.push(t)
            if p is None or t in self.settings.eos:
                continue
            onset = self.loops.onset(p)  # the stream is the output: an output position
            back = [r for r in self.relaxed_at if r >= onset - W and r not in self.strict_at]
            if back:
                # Any relaxation in the window may have started the loop; walking back one at
                # a time (the latest first) paid up to the window again per relaxation, and a
                # record that relaxed several times in it mostly rewound them all in turn.
                return emitted[: i + 1], min(back)
        return emitted, None

    def rewind(self, r: int) -> None:
        """Take the output back to its first r tokens: the relaxed token at position r and
        everything after it are gone, and position r is decided strictly from now on. Every
        part of the record's state that follows its text follows it back; the engine moves
        the caches and the drafter (``rewound_at``)."""
        removed = len(self.out) - r
        self.stats.relaxed -= sum(1 for x in self.relaxed_at if x >= r)
        self.stats.rewinds += 1
        self.stats.rewound_tokens += removed
        self.relaxed_at = [x for x in self.relaxed_at if x < r]
        self.strict_at.add(r)
        del self.out[r:]
        del self.seq[self.prompt_len + r:]
        self.loops.truncate(r)
        if self.ngrams is not None:
            self.ngrams = NgramIndex(self.ngrams.n, self.ngrams.window)
            self.ngrams.extend(self.out)
        if self.spans is not None:
            self.spans = SpanTracker(self.settings.tokenizer, self.settings.spans)
            self.spans.commit(self.out)
        if self.provenance is not None:
            self.provenance.truncate(r)
        if self.relax_budget is not None and self.stats.relaxed < self.relax_budget:
            self.stats.budget_spent_at = None
        self.regret = 0.0  # the regret rule's run restarts at the rewound position
        self.checked_chars = 0
        self.finish = FINISH_LENGTH
        self.text = None
        self.rewound_at = r

    def result(self) -> GenerationResult:
        text = self.text
        if text is None:
            text = self.settings.tokenizer.decode(self.out, skip_special_tokens=True)
        capped = self.max_new if self.max_new < self.sampling.max_tokens else None
        return GenerationResult(self.out, text, self.finish, self.prompt_len, self.stats,
                                time.perf_counter() - self.t0, capped,
                                provenance=None if self.provenance is None else self.provenance.to_dict())
