"""Result lines: one dict per record, the same for the JSONL output and the Python API.

A record's result carries its id (under the key it came with), the output, finish reason,
usage, the speculative decoding figures (`spec`), timing and `error` (None, or an object with
type, message and line). Fields may be added over time, never changed.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from marscli.config import RecordError, SamplingParams
from marscli.repetition import repetition_stats

#: Error types of records whose generation failed (the others come from marscli.io / engine).
ERR_GENERATION_FAILED = "generation_failed"
ERR_OUT_OF_MEMORY = "out_of_memory"
#: Longest error message kept from an exception's text.
MAX_ERROR_CHARS = 300


@dataclass(frozen=True)
class ResultOptions:
    """How records are fitted and what their result lines hold."""

    truncate_prompt: str = "none"  # "left": drop a long prompt's oldest tokens
    timing: bool = True  # wall-clock figures (off: byte-identical reruns)
    token_ids: bool = False  # the generated token ids


def error_result(item, type_: str, message: str) -> dict:
    return {item.id_key: item.id, "output": None,
            "error": {"type": type_, "message": message, "line": item.line}}


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    line = text[0] if text else type(exc).__name__
    return line if len(line) <= MAX_ERROR_CHARS else line[: MAX_ERROR_CHARS - 3] + "..."


def failure_result(item, exc: BaseException) -> dict:
    """The error result line for a record whose preparation or generation raised `exc`."""
    import torch

    from marscli.engine.sequence import RecordFailure

    if isinstance(exc, RecordFailure):
        return error_result(item, exc.type, exc.message)
    if isinstance(exc, (torch.cuda.OutOfMemoryError, MemoryError)):
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # give the next record the memory this one held
        return error_result(item, ERR_OUT_OF_MEMORY, one_line(exc))
    return error_result(item, ERR_GENERATION_FAILED, f"{type(exc).__name__}: {one_line(exc)}")


def result_line(item, res, dropped: int, options: ResultOptions, spec_meta: dict) -> dict:
    usage = {"prompt_tokens": res.prompt_tokens, "completion_tokens": res.completion_tokens}
    if options.truncate_prompt != "none":
        usage["truncated_prompt_tokens"] = dropped
    if res.max_tokens_capped_to is not None:  # only then, so other results keep their bytes
        usage["max_tokens_capped_to"] = res.max_tokens_capped_to
    out = {
        item.id_key: item.id,
        "output": res.text,
        "finish_reason": res.finish_reason,
        "usage": usage,
        "spec": {**spec_meta, **res.stats.to_dict(), **repetition_stats(res.token_ids)},
        "timing": {
            "seconds": round(res.seconds, 4),
            "tokens_per_s": round(res.completion_tokens / res.seconds, 2) if res.seconds > 0 else None,
        } if options.timing else None,
        "error": None,
    }
    if options.token_ids:
        out["token_ids"] = res.token_ids
    return out


def generate_results(engine, items: Iterable, sampling: SamplingParams, options: ResultOptions,
                     spec_meta: dict, batch_size: int = 1) -> Iterator[tuple[Any, dict, float]]:
    """Every record -> (item, result line, seconds spent generating), as records finish.

    Never raises for one record's sake: a record that cannot be parsed, fitted or generated
    becomes an error result and the run goes on. One at a time (batch size 1) records come
    in input order, so --fail-fast stops where the input says; batched, the invalid records
    come first and the others as they finish.
    """
    dropped: dict[int, int] = {}

    def prepare(item):
        sp = sampling.with_overrides(item.overrides)
        ids, dropped[item.index] = engine.fit_prompt(engine.tokenize(item), truncate=options.truncate_prompt,
                                                     max_tokens=sp.max_tokens)
        return ids, sp

    def finished(item, res) -> tuple[Any, dict, float]:
        if isinstance(res, BaseException):
            return item, failure_result(item, res), 0.0
        return item, result_line(item, res, dropped.pop(item.index, 0), options, spec_meta), res.seconds

    if batch_size > 1:
        valid = []
        for item in items:
            if isinstance(item, RecordError):
                yield item, error_result(item, item.type, item.message), 0.0
            else:
                valid.append(item)
        for item, res in engine.run(valid, prepare):
            yield finished(item, res)
        return
    for item in items:
        if isinstance(item, RecordError):
            yield item, error_result(item, item.type, item.message), 0.0
            continue
        for done, res in engine.run([item], prepare):
            yield finished(done, res)


class Totals:
    """A run's summary line: records, tokens, rate, acceptance length, relaxed share."""

    SUMMED = ("records", "tokens", "seconds", "steps", "accepted", "relaxed", "loops")

    def __init__(self) -> None:
        self.records = 0
        self.tokens = 0
        self.seconds = 0.0
        self.steps = 0
        self.accepted = 0
        self.relaxed = 0
        self.loops = 0  # outputs that end in a loop (marscli.repetition)
        self.wall: float | None = None  # batched runs: records overlap, so rate = tokens / wall time

    def add(self, r: dict, seconds: float) -> None:
        self.records += 1
        self.tokens += r["usage"]["completion_tokens"]
        self.seconds += seconds
        s = r["spec"]
        self.steps += s["steps"]
        self.accepted += s["accepted"]
        self.relaxed += s["relaxed"]
        self.loops += bool(s.get("ends_in_loop"))

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.SUMMED}

    @classmethod
    def summed(cls, parts: list[dict[str, Any]], wall: float) -> Totals:
        """The totals of a data-parallel run: its processes' totals, over its wall time."""
        t = cls()
        for k in cls.SUMMED:
            setattr(t, k, sum(p.get(k, 0) for p in parts))
        t.wall = wall
        return t

    def summary(self, total: int, failed: int) -> str:
        seconds = self.wall if self.wall is not None else self.seconds
        tps = self.tokens / seconds if seconds else 0.0
        tau = self.tokens / self.steps if self.steps else 0.0
        relaxed = self.relaxed / self.tokens if self.tokens else 0.0
        return (
            f"done: {self.records}/{total} records ok, {failed} failed, {self.tokens} tokens, "
            f"{tps:.1f} tok/s, mean acceptance length {tau:.2f}, relaxed share {relaxed:.3f}"
            + (f", {self.loops} ending in a loop" if self.loops else "")
        )
