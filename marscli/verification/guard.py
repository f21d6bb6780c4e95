"""Repetition: the statistic that makes loops visible, and the index the loop guard asks.

Relaxed verification plus prompt lookup amplifies repetition: the n-gram drafter proposes
continuations copied from earlier text, and where the target hesitates between its top two
tokens and the runner-up is the copy, a relaxed rule accepts the copy; each accepted copy
makes the next one likelier (issue 17; docs/calibration.md, "Loops"). Repetitive text is also
*likely* text, so a proxy such as the target's NLL of the output falls as the output loops.

Two things live here, both plain Python over token ids (no torch, no model):

- ``NgramIndex``: the n-grams of one record's recent *output* (its generated tokens, not the
  prompt), kept incrementally as tokens are committed. ``repeats(drafts)`` says, for each
  draft token x, whether ``(last n-1 tokens before x) + x`` already occurs among the last W
  tokens before x (the output so far and the drafts ahead of x in the same step). The loop
  guard never *relaxes* such a token: a strict acceptance is still allowed (that is the
  target's own choice), a relaxed one is not.
- the per-record statistics reported in every result's ``spec`` and by ``bench``: the share of
  generated tokens that complete an n-gram already seen in the last W tokens
  (``repeat_share``) and whether the output ends in a loop (``ends_in_loop``).

The prompt is left out on purpose: copying from the prompt (a signature, a quoted passage) is
what prompt lookup is for; copying the output's own recent text is how a loop starts.
"""

from __future__ import annotations

from collections.abc import Sequence

#: The guard's defaults, the settings values' too (marscli.config.GuardConfig; measured in
#: docs/calibration.md, "Loops"). Plain Python and nothing of marscli imported: this module
#: sits in the base layer with the registry, so config builds on it. n-gram size and window
#: (tokens) of the loop guard, and of the repetition statistic whatever the guard's settings
#: (so strict and relaxed runs are measured alike).
DEFAULT_GUARD_NGRAM = 4
DEFAULT_GUARD_WINDOW = 256
#: Default relaxation budget per record, as a share of its max tokens (1.0: no budget).
DEFAULT_MAX_RELAXED_SHARE = 0.25
#: Generated tokens at the start of every output that relaxed rules verify strictly (issue 31:
#: a relaxed verifier's weaker jailbreak and prompt-injection robustness is repaired by
#: verifying the first 1-2 tokens exactly).
DEFAULT_STRICT_FIRST = 2

#: Loop rewinds (GuardConfig.loop_rewind): a relaxed token at most this many tokens before
#: the periodic tail of a loop the output falls into is taken back (docs/calibration.md, "Loops").
DEFAULT_LOOP_REWIND = 64
#: Rewinds after which a record relaxes no more. A rewind goes back to the earliest relaxed
#: token in the window (not yet made strict), so one rewind takes back every relaxation that
#: could have started the loop, and the record is decided strictly from there on: a record
#: whose relaxations derailed once is one to decode as the target would. On 120 held-out
#: records at 256 tokens (2026-11-30) this ends as many records in a loop as walking back one
#: relaxation at a time with a cap of 2 (11; plain decoding 17) with 27 rewinds and 11.2% of
#: the kept tokens discarded instead of 45 and 15.1% (docs/calibration.md, "Loops"). Relaxations
#: made before the rewound position can still be taken back by a later loop.
MAX_REWINDS = 1

#: A loop at the end of an output: a block of at most LOOP_MAX_PERIOD tokens repeated at least
#: LOOP_MIN_REPEATS times, covering at least LOOP_MIN_SPAN tokens, up to the last token (the
#: last copy may be cut short, as at max tokens). For text (scoring a results file without
#: token ids) the units are characters: any period, at least LOOP_MIN_SPAN_CHARS characters.
LOOP_MAX_PERIOD = 64
LOOP_MIN_REPEATS = 3
LOOP_MIN_SPAN = 16
LOOP_MIN_SPAN_CHARS = 64


class NgramIndex:
    """The n-grams of a token stream (one record's output), for "has this n-gram been seen in
    the last W tokens?" in O(1) per question.

    ``last[g]`` is the start of the most recent occurrence of n-gram g; an occurrence counts
    when it lies wholly within the window, i.e. starts at or after len - W.
    """

    def __init__(self, n: int = DEFAULT_GUARD_NGRAM, window: int = DEFAULT_GUARD_WINDOW):
        if n < 2:
            raise ValueError(f"the guard's n-gram size must be at least 2, got {n}")
        if window < n:
            raise ValueError(f"the guard's window ({window}) must be at least its n-gram size ({n})")
        self.n = n
        self.window = window
        self.tokens: list[int] = []
        self.last: dict[tuple[int, ...], int] = {}

    def extend(self, tokens: Sequence[int]) -> None:
        """Commit tokens to the stream (a step's emitted tokens)."""
        n, toks = self.n, self.tokens
        for t in tokens:
            toks.append(int(t))
            start = len(toks) - n
            if start >= 0:
                self.last[tuple(toks[start:])] = start

    def repeats(self, drafts: Sequence[int]) -> list[bool]:
        """For each draft i: does the n-gram ending at drafts[i] (after the stream and
        drafts[:i]) occur among the last W tokens before drafts[i]? The index is unchanged."""
        n, W = self.n, self.window
        y = self.tokens[-(W + n):] + [int(t) for t in drafts]  # enough history for every draft
        base = len(self.tokens) - (len(y) - len(drafts))  # stream position of y[0]
        local: dict[tuple[int, ...], int] = {}  # n-grams that end inside the drafts
        out = []
        for i in range(len(drafts)):
            end = len(y) - len(drafts) + i  # index of drafts[i] in y
            start = end - n + 1
            if start < 0 or base + start < 0:
                out.append(False)
            else:
                g = tuple(y[start: end + 1])
                before = local.get(g, self.last.get(g))
                # an earlier occurrence, wholly within the W tokens before drafts[i]
                lo = base + end - W
                out.append(before is not None and before >= lo and before < base + start)
                local[g] = base + start
        return out


def repeat_flags(tokens: Sequence[int], n: int = DEFAULT_GUARD_NGRAM,
                 window: int = DEFAULT_GUARD_WINDOW) -> list[bool]:
    """Per token: does it complete an n-gram seen among the W tokens before it? (The same
    question the guard asks of a draft, asked of every generated token.)"""
    index = NgramIndex(n, window)
    flags = []
    for t in tokens:
        flags += index.repeats([t])
        index.extend([t])
    return flags


def repeat_share(tokens: Sequence[int], n: int = DEFAULT_GUARD_NGRAM,
                 window: int = DEFAULT_GUARD_WINDOW) -> float:
    """Share of the tokens that complete an n-gram seen in the last W tokens (0 when empty)."""
    flags = repeat_flags(tokens, n, window)
    return sum(flags) / len(flags) if flags else 0.0


def loop_period(tokens: Sequence[int] | str, max_period: int | None = LOOP_MAX_PERIOD,
                min_repeats: int = LOOP_MIN_REPEATS, min_span: int = LOOP_MIN_SPAN) -> int | None:
    """The smallest period p <= max_period (None: any) such that the output's tail of
    max(min_repeats * p, min_span) units repeats with period p (unit i equals unit i - p all
    along it); None when the output does not end in such a loop. Units: token ids, or the
    characters of a str."""
    toks = list(tokens)
    top = len(toks) // min_repeats if max_period is None else max_period
    for p in range(1, top + 1):
        span = max(min_repeats * p, min_span)
        if span > len(toks):
            break
        tail = toks[-span:]
        if all(tail[i] == tail[i - p] for i in range(p, span)):
            return p
    return None


class LoopWatch:
    """``loop_period`` of a growing token stream, kept up to date in O(max_period) a token:
    run[p] is how many of the last tokens each equal the token p before them, so the stream
    ends in a loop of period p exactly when run[p] >= max(min_repeats p, min_span) - p (and
    the stream is that long). ``truncate`` rebuilds it for a shorter stream (a rewind)."""

    def __init__(self, max_period: int = LOOP_MAX_PERIOD, min_repeats: int = LOOP_MIN_REPEATS,
                 min_span: int = LOOP_MIN_SPAN):
        self.max_period, self.min_repeats, self.min_span = max_period, min_repeats, min_span
        self.tokens: list[int] = []
        self.run = [0] * (max_period + 1)  # run[0] unused

    def push(self, token: int) -> int | None:
        """Append a token; the smallest period p of the loop the stream now ends in, or None."""
        toks = self.tokens
        toks.append(int(token))
        n, run, found = len(toks), self.run, None
        for p in range(1, self.max_period + 1):
            if n > p and toks[-1] == toks[-1 - p]:
                run[p] += 1
                span = max(self.min_repeats * p, self.min_span)
                if found is None and run[p] >= span - p and span <= n:
                    found = p
            else:
                run[p] = 0
        return found

    def onset(self, p: int) -> int:
        """Where the periodic tail of period p begins (an index into the stream)."""
        return len(self.tokens) - self.run[p] - p

    def truncate(self, n: int) -> None:
        tokens = self.tokens[:n]
        self.tokens = []
        self.run = [0] * (self.max_period + 1)
        for t in tokens:
            self.push(t)


def ends_in_loop(tokens: Sequence[int] | str, **kw) -> bool:
    """Whether the output ends in a loop (see ``loop_period``); a str is judged by its
    characters (any period, at least LOOP_MIN_SPAN_CHARS of them)."""
    if isinstance(tokens, str):
        kw = {"max_period": None, "min_span": LOOP_MIN_SPAN_CHARS, **kw}
    return loop_period(tokens, **kw) is not None


def repetition_stats(tokens: Sequence[int]) -> dict[str, float | bool]:
    """The per-record repetition figures of a result's ``spec``."""
    return {"repeat_share": round(repeat_share(tokens), 4), "ends_in_loop": ends_in_loop(tokens)}
