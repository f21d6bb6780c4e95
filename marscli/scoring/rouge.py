"""A prompt-set record's reference text and ROUGE-L against it (the optional `rouge-score`
package, Google's implementation, with stemming): the `sum` task's score and bench's
ROUGE-L column."""

from __future__ import annotations

from functools import lru_cache
from typing import Any


def reference_text(record: dict[str, Any]) -> str | None:
    """The reference answer of a prompt-set record for its FIRST turn, as one text.

    `reference` is a string, or a list: with one entry per turn (MT-Bench: as many entries as
    turns, more than one turn) the first entry; otherwise the lines of one answer (GSM8K
    solution steps, HumanEval code lines, a summary), joined by newlines.
    """
    ref = record.get("reference")
    if isinstance(ref, str):
        return ref or None
    if not isinstance(ref, list) or not ref or not all(isinstance(r, str) for r in ref):
        return None
    turns = record.get("turns")
    if isinstance(turns, list) and len(turns) > 1 and len(ref) == len(turns):
        return ref[0] or None
    text = "\n".join(ref)
    return text if text.strip() else None


def rouge_available() -> bool:
    try:
        import rouge_score  # noqa: F401
    except ImportError:
        return False
    return True


@lru_cache(maxsize=1)
def _rouge_scorer():
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)


def rouge_l(prediction: str, reference: str) -> float:
    """ROUGE-L F1 of `prediction` against `reference` (raises ImportError without rouge-score)."""
    return float(_rouge_scorer().score(reference, prediction)["rougeL"].fmeasure)
