"""GSM8K accuracy: the final number of an answer against the reference's `#### N`.

The rule (docs/bench.md, "Task scores"):

1. The answer is the number after the LAST `####` that a number follows (`#### 18`,
   `#### $1,080.00`, `####-3`); else the last number anywhere in the text (`... so she
   makes $18 a day.`, `\\boxed{18}`); an answer with no number has none and scores 0.
2. Numbers are normalised before comparing: thousands commas, `$` and `%` dropped, a
   trailing `.0` / `.00` dropped (`18.0` = `18`), trailing zeros of decimals dropped
   (`0.50` = `0.5`), `-0` = `0`. A comma only counts as a thousands separator between
   groups of three digits (`1,000`), so a list `1,2,3` is three numbers.
3. The reference's answer is taken by the same rule (its last line is `#### N`).
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Any

#: A number: optional sign, optional $, digits with thousands commas or plain, optional decimals.
_NUMBER = r"[-+]?(?:\$\s?)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[-+]?(?:\$\s?)?\.\d+"
NUMBER_RE = re.compile(_NUMBER)
HASHES_RE = re.compile(r"####\s*(" + _NUMBER + ")")


def normalize_number(text: str) -> str | None:
    """'$1,080.00' -> '1080', '-0.50' -> '-0.5', '18.' -> '18'; None if not a number."""
    t = text.strip().replace(",", "").replace("$", "").replace("%", "").replace(" ", "")
    t = t.rstrip(".")
    if not t:
        return None
    try:
        d = Decimal(t)
    except InvalidOperation:
        return None
    if not d.is_finite():
        return None
    if d == d.to_integral_value():
        d = d.quantize(Decimal(1))
        return str(abs(d)) if d == 0 else str(d)
    return format(d.normalize(), "f")


def extract_answer(text: str | None) -> str | None:
    """The normalised final answer of a GSM8K answer text (None: no number in it)."""
    if not text:
        return None
    marked = HASHES_RE.findall(text)
    if marked:
        return normalize_number(marked[-1])
    numbers = NUMBER_RE.findall(text)
    return normalize_number(numbers[-1]) if numbers else None


def score(output: str | None, reference: str) -> tuple[float, dict[str, Any]]:
    """1.0 when the output's answer equals the reference's, else 0.0; with the two answers."""
    want = extract_answer(reference)
    if want is None:
        raise ValueError("the reference has no number")
    got = extract_answer(output)
    return float(got is not None and got == want), {"answer": got, "reference_answer": want}
