"""Strict spans: parts of the output where every position is verified strictly, whatever the
rule (``--strict-in code,answer``, ``--strict-regex PATTERN``; issue 14).

Users of relaxed rules want "relax in free text, never in code or in the answer". A position's
span is decided from the **text before it**: the record's output decoded so far, then the
step's earlier drafts (never the prompt, never the token itself), so the verification rule
stays a deterministic function of the prefix, whatever the batch or the step structure. A
strict position reaches ``rules.decide`` with ``PositionFacts.guarded`` set, the seam the loop
guard uses (marscli.verification.guard): the draft may still be accepted by the strict check, never
relaxed.

What makes a position strict (``strict_at`` is the definition; ``SpanTracker`` computes the
same thing incrementally):

- ``code``: the text before it is inside a fenced code block. A fence is a line whose first
  non-blank characters are a run of at least 3 backticks or tildes (CommonMark's fences,
  except that any indentation counts, so that fences in list items do too; a backtick fence's
  info string may not contain a backtick, so "```x```" on one line is inline code). The block
  is open from the moment the text before shows the opening run (the info string is already
  inside) until the end of the line that closes it: a line of the same character, at least as
  long as the opening run, and nothing but blanks after it. A block never closed runs to the
  end. Indented code blocks (no fence) and fences in block quotes are not recognised.
- ``answer``: an answer marker (``####``, ``\\boxed{``, ``Final answer:``; case-insensitive) has
  appeared outside code in the text before it; every later position is strict.
- ``--strict-regex PATTERN``: ``re.search(PATTERN, text before)`` finds a match (Python's
  ``re``; use inline flags such as ``(?i)`` or ``(?s)``). Since the text before only grows, a
  pattern without anchors or lookaheads is strict from its first match on, like a marker;
  a negative lookahead can close a span again, e.g. ``<tool_call>(?![\\s\\S]*</tool_call>)``
  (strict while a ``<tool_call>`` is open).

The text is decoded incrementally, token by token (vLLM's detokenizer offsets: a token's text
is held back while it ends in an incomplete character), so a token's text does not depend on
how the tokens were grouped into steps.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

CODE = "code"
ANSWER = "answer"
SPAN_KINDS = (CODE, ANSWER)
#: Final-answer markers (GSM8K's "####", LaTeX's "\boxed{", "Final answer:"), matched in
#: lower case.
ANSWER_MARKERS = ("####", "\\boxed{", "final answer:")
FENCE_CHARS = "`~"
MIN_FENCE = 3
#: The replacement character a decoder emits for an incomplete UTF-8 sequence.
INCOMPLETE = "\ufffd"

Fence = tuple[str, int]  # (fence character, length of the opening run)


def parse_strict_in(value: str | None) -> tuple[str, ...]:
    """'code,answer' -> ('code', 'answer'); 'none' -> () (no strict span, not even a
    profile's); raises ValueError naming an unknown kind."""
    if value is None or value.strip().lower() == "none":
        return ()
    kinds = tuple(dict.fromkeys(k.strip() for k in value.split(",") if k.strip()))
    bad = [k for k in kinds if k not in SPAN_KINDS]
    if bad:
        raise ValueError(f"--strict-in: unknown span {bad[0]!r}; expected a comma-separated "
                         f"list of {', '.join(SPAN_KINDS)}")
    return kinds


def compile_regex(pattern: str) -> re.Pattern:
    try:
        return re.compile(pattern)
    except re.error as e:
        raise ValueError(f"--strict-regex {pattern!r}: {e}") from None


# --------------------------------------------------------------------------- lines


def fence_opener(line: str) -> Fence | None:
    """The fence a line opens (its character and run length), or None."""
    s = line.lstrip(" \t")
    if not s or s[0] not in FENCE_CHARS:
        return None
    ch = s[0]
    run = len(s) - len(s.lstrip(ch))
    if run < MIN_FENCE or (ch == "`" and "`" in s[run:]):
        return None
    return ch, run


def fence_closes(line: str, fence: Fence) -> bool:
    """Does this (complete) line close the open fence?"""
    ch, n = fence
    s = line.lstrip(" \t")
    run = len(s) - len(s.lstrip(ch))
    return run >= n and not s[run:].strip(" \t\r")


def has_marker(line: str) -> bool:
    low = line.lower()
    return any(m in low for m in ANSWER_MARKERS)


@dataclass(frozen=True)
class TextState:
    """Where a text stands, from its complete lines: the fence open after them, whether an
    answer marker appeared outside code; and its last, unfinished line."""

    fence: Fence | None = None
    answer: bool = False
    line: str = ""

    def fed(self, text: str) -> TextState:
        """The state of this text followed by `text`."""
        if not text:
            return self
        if "\n" not in text:
            return TextState(self.fence, self.answer, self.line + text)
        fence, answer = self.fence, self.answer
        *lines, last = (self.line + text).split("\n")
        for line in lines:
            if fence is not None:
                if fence_closes(line, fence):
                    fence = None
            else:
                fence = fence_opener(line)
                if fence is None and not answer:
                    answer = has_marker(line)
        return TextState(fence, answer, last)

    def in_code(self) -> bool:
        return self.fence is not None or fence_opener(self.line) is not None

    def after_answer(self) -> bool:
        if self.answer:
            return True
        return self.fence is None and fence_opener(self.line) is None and has_marker(self.line)


@dataclass(frozen=True)
class SpanRule:
    """Which spans are strict: kinds among SPAN_KINDS and an optional compiled regex."""

    kinds: tuple[str, ...] = ()
    regex: re.Pattern | None = None

    @classmethod
    def from_config(cls, cfg) -> SpanRule | None:
        """A config.SpanConfig -> SpanRule (None when no span is asked for)."""
        if cfg is None or not cfg.active:
            return None
        return cls(tuple(cfg.strict_in), compile_regex(cfg.strict_regex) if cfg.strict_regex is not None else None)

    def strict(self, state: TextState, text: str) -> bool:
        """Is the position after `text` (whose scanning state is `state`) strict?"""
        return ((CODE in self.kinds and state.in_code())
                or (ANSWER in self.kinds and state.after_answer())
                or (self.regex is not None and self.regex.search(text) is not None))


def strict_at(text: str, rule: SpanRule) -> bool:
    """The definition: is the position whose text before is `text` strict?"""
    return rule.strict(TextState().fed(text), text)


# --------------------------------------------------------------------------- incremental


@dataclass(frozen=True)
class _Cursor:
    """The text of a token stream so far, decoded incrementally: `window` holds the tokens
    from the detokenizer's prefix offset on, the first `read` of them already turned into
    text (`prefix` is their text); `state` scans `text`."""

    window: tuple[int, ...] = ()
    read: int = 0
    prefix: str = ""
    text: str = ""
    state: TextState = TextState()


class SpanTracker:
    """One record's strict spans, kept incrementally as tokens are committed.

    ``flags(drafts)`` says, per draft of a chain, whether it lies in a strict span (from the
    committed text and the drafts before it); ``tree_flags`` the same for the nodes of a
    draft tree; ``commit(tokens)`` moves the committed text on (reusing what ``flags``
    decoded for the accepted drafts).
    """

    def __init__(self, tokenizer: Any, rule: SpanRule):
        self.tokenizer = tokenizer
        self.rule = rule
        self.cur = _Cursor()
        self._ahead: dict[tuple[int, ...], _Cursor] = {}  # token prefixes decoded by flags()

    def _decode(self, tokens) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=True)

    def _step(self, c: _Cursor, token: int) -> _Cursor:
        window = c.window + (int(token),)
        new = self._decode(window)
        if len(new) > len(c.prefix) and not new.endswith(INCOMPLETE):
            delta = new[len(c.prefix):]
            rest = window[c.read:]
            return _Cursor(rest, len(rest), self._decode(rest), c.text + delta, c.state.fed(delta))
        return _Cursor(window, c.read, c.prefix, c.text, c.state)

    def _strict(self, c: _Cursor) -> bool:
        return self.rule.strict(c.state, c.text)

    def flags(self, drafts: list[int]) -> list[bool]:
        """Per draft: strict, from the committed text and the drafts before it."""
        out = []
        c = self.cur
        self._ahead = {}
        for i, t in enumerate(drafts):
            out.append(self._strict(c))
            c = self._step(c, t)  # the last one too: commit reuses it when all are accepted
            self._ahead[tuple(drafts[: i + 1])] = c
        return out

    def tree_flags(self, tokens: list[int], parents: list[int]) -> list[bool]:
        """Per node of a draft tree (parents before children, -1 = the root): strict, from
        the committed text and the node's root path before it."""
        self._ahead = {}
        cursors: list[_Cursor] = []
        keys: list[tuple[int, ...]] = []
        out = []
        for t, p in zip(tokens, parents):
            c = self.cur if p < 0 else cursors[p]
            key = (keys[p] if p >= 0 else ()) + (int(t),)
            out.append(self._strict(c))
            nxt = self._step(c, t)
            cursors.append(nxt)
            keys.append(key)
            self._ahead[key] = nxt
        return out

    def commit(self, tokens: list[int]) -> None:
        """Append a step's emitted tokens to the committed text."""
        c = self.cur
        for j, t in enumerate(tokens):
            got = self._ahead.get(tuple(tokens[: j + 1]))
            c = got if got is not None else self._step(c, t)
        self.cur = c
        self._ahead = {}
