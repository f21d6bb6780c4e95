"""Task scores of outputs: the one entry point `score_items` for `marscli score` and
`bench --task`, and the readers of result lines and prompt sets it needs.

Tasks:

- ``humaneval``: pass@1 by execution (marscli.scoring.humaneval); the problem comes from the
  record's id (N or "HumanEval/N"); the prompt set's reference is not used.
- ``gsm8k``: accuracy of the final number (marscli.scoring.gsm8k) against the reference's
  ``#### N``.
- ``sum``: ROUGE-L F1 (rouge-score, with stemming; marscli.scoring.rouge.rouge_l) against the
  reference highlights.

A record with several outputs (n samples) scores the mean over them: for 0/1 scores that
is the unbiased pass@1 estimate from n samples.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from marscli.errors import InputError, UsageError
from marscli.io.records import open_input
from marscli.scoring import gsm8k, humaneval, rouge

HUMANEVAL = "humaneval"
GSM8K = "gsm8k"
SUM = "sum"
TASKS = (HUMANEVAL, GSM8K, SUM)
#: What each task's per-record score is called in tables.
SCORE_NAMES = {HUMANEVAL: "pass@1", GSM8K: "accuracy", SUM: "ROUGE-L"}
#: Tasks whose per-record score is 0 or 1 (one output per record).
BINARY_TASKS = (HUMANEVAL, GSM8K)


def check_task(task: str | None) -> None:
    if task is not None and task not in TASKS:
        raise UsageError(f"--task {task}: choose from {', '.join(TASKS)}")


@dataclass
class TaskItem:
    """One record to score: its id, its output(s) and the prompt set's reference text."""

    id: Any
    outputs: list[str] | None  # None: the record has no output (a failed record)
    reference: str | None = None


@dataclass
class TaskScore:
    score: float | None  # None: not scored (see error)
    detail: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        d = dict(self.detail)
        if self.error is not None:
            d["error"] = self.error
        return d


# --------------------------------------------------------------------------------------------
# Reading result lines and prompt sets


def record_id(rec: dict[str, Any]) -> Any:
    for key in ("id", "custom_id", "question_id"):
        if key in rec:
            return rec[key]
    return None


def _choice_text(choice: Any) -> str | None:
    if isinstance(choice, str):
        return choice
    if isinstance(choice, dict):
        if isinstance(choice.get("text"), str):
            return choice["text"]
        msg = choice.get("message")
        if isinstance(msg, dict) and isinstance(msg.get("content"), str):
            return msg["content"]
    return None


def output_texts(rec: dict[str, Any]) -> list[str] | None:
    """The output text(s) of a result line: `output` (a string, or a list of n), `choices`, or
    an OpenAI batch output line's `response.body.choices`; None when it has none."""
    out = rec.get("output")
    if isinstance(out, str):
        return [out]
    if isinstance(out, list):
        texts = [_choice_text(o) for o in out]
        return texts if texts and all(t is not None for t in texts) else None
    choices = rec.get("choices")
    if choices is None:
        body = (rec.get("response") or {}).get("body") if isinstance(rec.get("response"), dict) else None
        choices = body.get("choices") if isinstance(body, dict) else None
    if isinstance(choices, list) and choices:
        texts = [_choice_text(c) for c in choices]
        return texts if all(t is not None for t in texts) else None
    return None


def read_jsonl(path: str, what: str) -> list[dict[str, Any]]:
    """Every non-blank line of a JSONL file as an object; a bad line is a one-line error."""

    out = []
    with open_input(path) as f:
        for n, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw.decode("utf-8-sig"))
            except (UnicodeDecodeError, ValueError) as e:
                raise InputError(f"{path}:{n}: {what} line is not JSON ({e})") from None
            if not isinstance(obj, dict):
                raise InputError(f"{path}:{n}: {what} line is not a JSON object")
            out.append(obj)
    return out


def read_references(path: str) -> dict[str, str | None]:
    """A prompt set -> {str(id): reference text of the first turn} (question_id, id or custom_id)."""
    refs: dict[str, str | None] = {}
    for n, rec in enumerate(read_jsonl(path, "prompt set"), 1):
        rid = record_id(rec)
        if rid is None:
            raise InputError(f"{path}: record {n} has no question_id, id or custom_id")
        refs[str(rid)] = rouge.reference_text(rec)
    return refs


# --------------------------------------------------------------------------------------------
# Scoring


def _sum_score(output: str, reference: str) -> tuple[float, dict[str, Any]]:
    if not rouge.rouge_available():
        raise UsageError("--task sum needs rouge-score: pip install 'marscli[score]'")
    return rouge.rouge_l(output, reference), {}


def score_items(task: str, items: Sequence[TaskItem], *, problems_file: str | None = None,
                limits: humaneval.Limits = humaneval.Limits(), workers: int | None = None,
                progress: Callable[[int, int], None] | None = None) -> list[TaskScore]:
    """Score every item for `task`; an item that cannot be scored gets score None and an error."""
    check_task(task)
    out: list[TaskScore | None] = [None] * len(items)
    if task == HUMANEVAL:
        problems = humaneval.load_problems(problems_file)
        jobs: list[tuple[int, humaneval.Problem, str]] = []
        for i, it in enumerate(items):
            tid = humaneval.task_id(it.id)
            if tid is None or tid not in problems:
                out[i] = TaskScore(None, error=f"id {it.id!r} names no HumanEval problem")
            elif it.outputs is None:
                out[i] = TaskScore(None, error="the record has no output")
            else:
                jobs.extend((i, problems[tid], text) for text in it.outputs)
        outcomes = humaneval.check_many([(p, t) for _, p, t in jobs], limits, workers, progress)
        per_item: dict[int, list[humaneval.Outcome]] = {}
        for (i, _, _), o in zip(jobs, outcomes):
            per_item.setdefault(i, []).append(o)
        for i, os_ in per_item.items():
            detail = os_[0].to_json() if len(os_) == 1 else {"samples": [o.to_json() for o in os_]}
            out[i] = TaskScore(sum(o.passed for o in os_) / len(os_), detail)
        return _complete(out)

    for i, it in enumerate(items):
        if it.outputs is None:
            out[i] = TaskScore(None, error="the record has no output")
            continue
        if it.reference is None:
            out[i] = TaskScore(None, error=f"no reference for id {it.id!r} in the prompt set")
            continue
        try:
            if task == GSM8K:
                scored = [gsm8k.score(t, it.reference) for t in it.outputs]
            else:
                scored = [_sum_score(t, it.reference) for t in it.outputs]
        except ValueError as e:
            out[i] = TaskScore(None, error=f"id {it.id!r}: {e}")
            continue
        detail = scored[0][1] if len(scored) == 1 else {"samples": [d for _, d in scored]}
        out[i] = TaskScore(sum(s for s, _ in scored) / len(scored), detail)
        if progress is not None:
            progress(i + 1, len(items))
    return _complete(out)


def _complete(scores: list[TaskScore | None]) -> list[TaskScore]:
    assert all(s is not None for s in scores), "an item was left unscored"
    return [s for s in scores if s is not None]
