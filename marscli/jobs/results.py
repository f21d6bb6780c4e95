"""Result lines: one dict per record, the same for the JSONL output and the Python API.

A record's result carries its id (under the key it came with), the output, finish reason,
usage, the speculative decoding figures (`spec`), timing and `error` (None, or an object with
type, message and line). Fields may be added over time, never changed. Only when asked:
`token_ids`, `logprobs` ({"content": [{token, logprob, bytes, top_logprobs}]}, OpenAI chat's
shape), `provenance` (where each token came from: marscli.engine.provenance), `choices`
(n > 1) and `warnings` (request keys marscli did not act on).

n completions per request: choice i decodes with seed + i (choice 0 is exactly the n = 1
result), as its own row of the engine's batch; the choices share the prompt's prefill (they
join together, and the engine's prefix cache computes a shared prompt once:
marscli.models.prefill). The line keeps the n = 1 fields, meaning:
`output` and `finish_reason` of choice 0, `usage.completion_tokens` summed over the choices
(as OpenAI counts), `spec` with the counters summed and `timing.seconds` summed; `choices`
holds every choice in order: index, output, finish_reason, completion_tokens, its own spec
(and token_ids, logprobs when asked). A request whose choice fails is an error result.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from marscli.config import RecordError, SamplingOptions, SamplingParams
from marscli.engine.sequence import RecordFailure
from marscli.io.openai_format import logprobs_content
from marscli.io.records import ERR_RECORD
from marscli.verification.guard import repetition_stats
from marscli.verification.registry import mode_problem

#: Error types of records whose generation failed (the others come from marscli.io / engine).
ERR_GENERATION_FAILED = "generation_failed"
ERR_OUT_OF_MEMORY = "out_of_memory"
#: A record with keys marscli does not act on, under --strict-keys.
ERR_UNSUPPORTED_KEY = "unsupported_key"
#: Longest error message kept from an exception's text.
MAX_ERROR_CHARS = 300


@dataclass(frozen=True)
class ResultOptions:
    """How records are fitted and what their result lines hold."""

    truncate_prompt: str = "none"  # "left": drop a long prompt's oldest tokens
    timing: bool = True  # wall-clock figures (off: byte-identical reruns)
    token_ids: bool = False  # the generated token ids
    output_format: str = "default"  # "openai": OpenAI batch output lines (marscli.io.openai_format)
    strict_keys: bool = False  # a record with keys marscli does not act on is an error result
    model: str = ""  # the target's name, for the OpenAI format's `model`
    run_key: str = ""  # what the OpenAI format derives its ids from (the run's fingerprint)


def result_options(options: SamplingOptions, target, run_key: str) -> ResultOptions:
    """What a run's result lines hold, from its sampling and output options; the OpenAI
    format's ids come from ``run_key`` (marscli.jobs.fingerprint.run_key)."""
    return ResultOptions(options.truncate_prompt, options.timing, options.token_ids, options.output_format,
                         options.strict_keys, model_name(target), run_key)


def model_name(target) -> str:
    """The target's name as result lines give it (`model` of the OpenAI format)."""
    identity = getattr(target, "identity", None) or {}
    return str(identity.get("name") or identity.get("source") or "marscli")


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

    if isinstance(exc, RecordFailure):
        return error_result(item, exc.type, exc.message)
    if isinstance(exc, (torch.cuda.OutOfMemoryError, MemoryError)):
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # give the next record the memory this one held
        return error_result(item, ERR_OUT_OF_MEMORY, one_line(exc))
    return error_result(item, ERR_GENERATION_FAILED, f"{type(exc).__name__}: {one_line(exc)}")


def check_record_mode(rule, sampling: SamplingParams) -> None:
    """A record whose own settings (temperature) ask for a decoding mode the run's rule does
    not define (regret: greedy only) is an invalid record: its error result, the run goes on.
    The run's own settings were refused before it started (jobs.setup.check_rule_modes)."""
    problem = mode_problem(rule if isinstance(rule, str) else rule.name, sampling.temperature)
    if problem is not None:
        raise RecordFailure(ERR_RECORD, f"temperature {sampling.temperature:g}: {problem}")


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
    if res.provenance is not None:  # marscli.engine.provenance: one kind per completion token
        out["provenance"] = res.provenance
    return out


def request_result(item, results: list, dropped: int, options: ResultOptions, spec_meta: dict,
                   decode) -> dict:
    """The result line of a request from its choices' GenerationResults (choice order);
    decode(token id) -> its text, for logprobs."""

    first = results[0]
    out = result_line(item, first, dropped, options, spec_meta)
    if len(results) == 1:
        if first.logprobs is not None:
            out["logprobs"] = logprobs_content(first.logprobs, decode)
    else:
        out["usage"]["completion_tokens"] = sum(r.completion_tokens for r in results)
        reps = [repetition_stats(r.token_ids) for r in results]
        out["spec"] = {**spec_meta, **summed_stats([r.stats for r in results]),
                       "repeat_share": round(sum(x["repeat_share"] for x in reps) / len(reps), 4),
                       "ends_in_loop": any(x["ends_in_loop"] for x in reps)}
        if options.timing:
            seconds = sum(r.seconds for r in results)
            out["timing"] = {"seconds": round(seconds, 4),
                             "tokens_per_s": round(out["usage"]["completion_tokens"] / seconds, 2)
                             if seconds > 0 else None}
        if options.token_ids:
            del out["token_ids"]  # per choice
        choices = []
        for i, r in enumerate(results):
            c = {"index": i, "output": r.text, "finish_reason": r.finish_reason,
                 "completion_tokens": r.completion_tokens,
                 "spec": {**r.stats.to_dict(), **repetition_stats(r.token_ids)}}
            if options.token_ids:
                c["token_ids"] = r.token_ids
            if r.logprobs is not None:
                c["logprobs"] = logprobs_content(r.logprobs, decode)
            if r.provenance is not None:
                c["provenance"] = r.provenance
            choices.append(c)
        out["choices"] = choices
    if item.ignored:
        out["warnings"] = ignored_warnings(item.ignored)
    return out


def ignored_warnings(keys: list[str]) -> list[str]:
    return [f"{k}: marscli does not act on this key; it was ignored" for k in keys]


#: Integer `spec` fields that are not counters (a position in the completion): not summed.
NOT_SUMMED = ("budget_spent_at",)


def summed_stats(stats: list) -> dict[str, Any]:
    """SpecStats of the choices of a request -> one `spec` dict: integer counters and
    per-position lists summed, the acceptance length over all their steps."""
    dicts = [s.to_dict() for s in stats]
    keys = list(dict.fromkeys(k for d in dicts for k in d))
    out: dict[str, Any] = {}
    for k in keys:
        vals = [d.get(k, 0) for d in dicts]
        if k in NOT_SUMMED:
            out[k] = None  # see the choices' own
        elif all(isinstance(v, int) and not isinstance(v, bool) for v in vals):
            out[k] = sum(vals)
        elif all(isinstance(v, list) for v in vals) and len({len(v) for v in vals}) == 1:
            out[k] = [sum(col) for col in zip(*vals)]
        else:  # not a counter (a ratio...): see the choices' own
            out[k] = None
    steps = sum(s.steps for s in stats)
    out["acceptance_length"] = round(sum(s.emitted for s in stats) / steps, 4) if steps else 0.0
    return out


@dataclass(frozen=True)
class Choice:
    """Choice `index` of `n` of a request: one row of the engine's batch."""

    item: Any
    index: int
    n: int


def generate_results(engine, items: Iterable, sampling: SamplingParams, options: ResultOptions,
                     spec_meta: dict, batch_size: int = 1) -> Iterator[tuple[Any, dict, float]]:
    """Every record -> (item, result line, seconds spent generating), as records finish.

    Never raises for one record's sake: a record that cannot be parsed, fitted or generated
    becomes an error result and the run goes on. One at a time (batch size 1) records come
    in input order, so --fail-fast stops where the input says; batched, they come as they
    finish, an invalid record as soon as the engine has read past it. `items` is read as the
    engine pulls records (never ahead of it), so a stream of records is never held whole.
    A request's n choices run as n rows of the batch (choice i with seed + i) sharing one
    prefill; its line comes when all are done.
    """
    dropped: dict[int, int] = {}
    prepared: dict[int, Any] = {}  # per request: (ids, sampling, dropped) or the exception
    decode = token_decoder(engine.target.tokenizer)

    def prepare(choice: Choice):
        item = choice.item
        got = prepared.get(item.index)
        if got is None:
            try:
                sp = sampling.with_overrides(item.overrides)
                check_record_mode(engine.rule, sp)
                ids, cut = engine.prompts.fit_prompt(engine.prompts.tokenize(item), truncate=options.truncate_prompt,
                                             max_tokens=sp.max_tokens)
                got = (ids, sp, cut)
            except Exception as e:  # noqa: BLE001 - every choice of the record fails alike
                got = e
            prepared[item.index] = got
        if choice.index == choice.n - 1:
            del prepared[item.index]
        if isinstance(got, BaseException):
            raise got
        ids, sp, dropped[item.index] = got
        return ids, (sp if choice.index == 0 else dataclasses.replace(sp, seed=sp.seed + choice.index))

    def expand(requests: Iterable) -> Iterator[Choice]:
        for item in requests:
            n = item.overrides.get("n", sampling.n)
            for i in range(n):
                yield Choice(item, i, n)

    def finished(item, results: list) -> tuple[Any, dict, float]:
        failed = next((r for r in results if isinstance(r, BaseException)), None)
        if failed is not None:
            dropped.pop(item.index, None)
            return item, failure_result(item, failed), 0.0
        line = request_result(item, results, dropped.pop(item.index, 0), options, spec_meta, decode)
        return item, line, sum(r.seconds for r in results)

    def run(requests: Iterable) -> Iterator[tuple[Any, dict, float]]:
        slots: dict[int, list] = {}
        for choice, res in engine.run(expand(requests), prepare):
            got = slots.setdefault(choice.item.index, [None] * choice.n)
            got[choice.index] = res
            if all(r is not None for r in got):
                del slots[choice.item.index]
                yield finished(choice.item, got)

    def invalid(item) -> dict | None:
        if isinstance(item, RecordError):
            return error_result(item, item.type, item.message)
        if options.strict_keys and item.ignored:
            return error_result(item, ERR_UNSUPPORTED_KEY,
                                f"keys marscli does not act on (--strict-keys): {', '.join(item.ignored)}")
        return None

    if batch_size > 1:
        # The engine pulls the valid records; the invalid ones it reads past wait here (only
        # those met since its last result) and come out before its next result.
        early: deque[tuple[Any, dict, float]] = deque()

        def valid() -> Iterator[Any]:
            for item in items:
                bad = invalid(item)
                if bad is not None:
                    early.append((item, bad, 0.0))
                else:
                    yield item

        for out in run(valid()):
            while early:
                yield early.popleft()
            yield out
        while early:
            yield early.popleft()
        return
    for item in items:
        bad = invalid(item)
        if bad is not None:
            yield item, bad, 0.0
            continue
        yield from run([item])


def token_decoder(tokenizer):
    """token id -> its text (special tokens included), remembered: logprobs decode the same
    alternatives again and again."""
    cache: dict[int, str] = {}

    def decode(token: int) -> str:
        text = cache.get(token)
        if text is None:
            text = cache[token] = tokenizer.decode([token], skip_special_tokens=False)
        return text

    return decode


def ignored_keys_note(items: Iterable) -> str | None:
    """One stderr line summing up the request keys marscli did not act on, or None."""
    counts: dict[str, int] = {}
    records = 0
    for item in items:
        keys = getattr(item, "ignored", None)
        if keys:
            records += 1
            for k in keys:
                counts[k] = counts.get(k, 0) + 1
    if not records:
        return None
    shown = ", ".join(f"{k} ({c})" for k, c in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:8])
    more = f" and {len(counts) - 8} more" if len(counts) > 8 else ""
    return (f"{records} record(s) carry request keys marscli does not act on: {shown}{more}; "
            "each such result carries 'warnings' (--strict-keys makes them error results)")


class Totals:
    """A run's summary line: records, tokens, rate, acceptance length, relaxed share."""

    SUMMED = ("records", "tokens", "seconds", "steps", "accepted", "relaxed", "loops", "rewinds")

    def __init__(self) -> None:
        self.records = 0
        self.tokens = 0
        self.seconds = 0.0
        self.steps = 0
        self.accepted = 0
        self.relaxed = 0
        self.loops = 0  # outputs that end in a loop (marscli.verification.guard)
        self.rewinds = 0  # relaxations taken back because a loop followed them (--loop-rewind)
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
        self.rewinds += s.get("rewinds", 0)

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
            + (f", {self.rewinds} relaxation(s) taken back" if self.rewinds else "")
        )
