"""Admission: which records decode now, and what happens when the batch does not fit.

``Admission.run`` is an engine's run loop around its steps: records join in groups (every free
place is filled from the input at once and the joiners are prefilled together), a finished row
leaves at once and the next records take its place (unless other rows are certain to end at
the next step: then the free places wait that one step, so that all the joiners share one
prefill pass, ``Admission.hold``), a record that cannot start fails alone,
and on CUDA out-of-memory the batch is halved and the affected records restart from scratch
(their outputs are a function of their records and settings, so a restart changes nothing).
The engine (marscli.engine.scheduler) owns the rows, the caches and the step; this object
owns the queues around them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch

from marscli.config import SamplingParams
from marscli.engine.sequence import GenerationResult, Sequence


def oom_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean 'the batch did not fit' (torch.cuda.OutOfMemoryError exists on
    CPU builds too, so a CPU test can raise it)."""
    return (torch.cuda.OutOfMemoryError,)


@dataclass
class Joiner:
    """A record about to join the batch: its prompt, sampling and fresh Sequence."""

    item: Any
    ids: list[int]
    sampling: SamplingParams
    seq: Sequence


def fill_order(rows: int, gone: list[int]) -> list[int]:
    """The rows that stay when rows `gone` leave, in the order that moves the fewest: a place
    freed below the new end is taken by a staying row from past it; every other row keeps its
    place. So one leaving row moves at most one row's keys and values (with the rows after it
    shifting down, a leaving row near the front moved almost the whole batch)."""
    out = set(gone)
    n = rows - len(out)
    order = list(range(n))
    movers = iter(b for b in range(n, rows) if b not in out)
    for b in range(n):
        if b in out:
            order[b] = next(movers)
    return order


class Admission:
    """One run's queues: records not yet read, records to restart after an out-of-memory
    halving, and the one record read ahead (to know whether the job is drained).

    engine: the marscli.engine.scheduler.Engine whose rows these records become (its
    reset_rows, start_rows, drop_unfinished_rows, halve, evict_all, step, keep, result)."""

    def __init__(self, engine: Any, items: Iterable[Any],
                 prepare: Callable[[Any], tuple[list[int], SamplingParams]],
                 observer_for: Callable[[Any], Any] | None):
        self.engine = engine
        self.source = iter(items)
        self.prepare = prepare
        self.observer_for = observer_for
        self.retry: deque[tuple[Any, list[int], SamplingParams]] = deque()
        self.ahead: deque[Any] = deque()  # at most one record read early
        self.exhausted = False

    def _next_joiner(self) -> tuple[Joiner | None, list[tuple[Any, Any]], bool]:
        """The next record that can join (restarted ones first), the results of records that
        never join (failed to prepare, or no room for a token), and whether the input ended."""
        e = self.engine
        out: list[tuple[Any, Any]] = []
        while True:
            if self.retry:
                item, ids, sampling = self.retry.popleft()
            else:
                if self.ahead:
                    item = self.ahead.popleft()
                else:
                    try:
                        item = next(self.source)
                    except StopIteration:
                        self.exhausted = True
                        return None, out, True
                try:
                    ids, sampling = self.prepare(item)
                except Exception as err:  # noqa: BLE001 - a RecordFailure or a tokenizer fault: this record only
                    out.append((item, err))
                    continue
            try:
                seq = Sequence(e.settings, ids, sampling,
                               observer=self.observer_for(item) if self.observer_for else None)
            except Exception as err:  # noqa: BLE001 - this record only
                out.append((item, err))
                continue
            if seq.done:  # no room for a single new token: it never joins
                out.append((item, e.result(seq, [] if sampling.logprobs else None)))
                continue
            return Joiner(item, ids, sampling, seq), out, False

    def _refill(self) -> Iterator[tuple[Any, GenerationResult | Exception]]:
        """Fill every free place; the joiners are prefilled together."""
        e = self.engine
        while len(e.rows) < e.batch_size:
            joiners: list[Joiner] = []
            ended = False
            while len(e.rows) + len(joiners) < e.batch_size and not ended:
                joiner, failed, ended = self._next_joiner()
                yield from failed
                if joiner is not None:
                    joiners.append(joiner)
            if not joiners:
                return
            try:
                finished = e.start_rows(joiners)
            except oom_errors() as err:
                e.drop_unfinished_rows()
                if e.halve():
                    for j in reversed(joiners):
                        self.retry.appendleft((j.item, j.ids, j.sampling))
                    for r in reversed(e.evict_all()):
                        self.retry.appendleft((r.item, r.ids, r.sampling))
                    continue
                for j in joiners:
                    yield j.item, err
                continue
            except Exception as err:  # noqa: BLE001 - alone, one record's failure ends only it
                e.drop_unfinished_rows()
                if len(joiners) == 1:
                    yield joiners[0].item, err
                    continue
                for j in joiners:
                    try:
                        finished = e.start_rows([j])
                    except Exception as err:  # noqa: BLE001
                        e.drop_unfinished_rows()
                        yield j.item, err
                        continue
                    yield from self._leave(finished)
                continue
            yield from self._leave(finished)

    def hold(self, held: bool) -> bool:
        """Whether the free places wait one step before they are filled: some row is certain
        to end at the next step (one token left: a step emits at least one a row), so its
        place and the free ones are filled together, in one prefill pass instead of two.
        Never two steps in a row (held: the last step waited), never at batch size 1, never
        with no row running. A prefill pass costs the same weight reads and per-layer work
        however few prompts it carries, and short prompts (labelling) are mostly that: rows
        whose drafts were kept end a step before the others, and joining at once split every
        wave of joiners in two (20 prefill passes against plain decoding's 10 for 160 short
        records at batch 16). Which step a record joins at never changes its text."""
        e = self.engine
        if held or e.batch_size <= 1 or not e.rows or len(e.rows) >= e.batch_size:
            return False
        return any(r.seq.left <= 1 and not r.seq.done for r in e.rows)

    def _leave(self, finished: list[int]) -> Iterator[tuple[Any, GenerationResult]]:
        """Rows that finished (in a step, or at their first token) leave at once."""
        if finished:
            e = self.engine
            done_rows = [e.rows[b] for b in finished]
            e.keep(fill_order(len(e.rows), finished))
            for r in done_rows:
                yield r.item, e.result(r.seq, r.logprobs)

    def run(self) -> Iterator[tuple[Any, GenerationResult | Exception]]:
        e = self.engine
        e.reset_rows()
        held = False
        with torch.inference_mode():
            while True:
                held = self.hold(held)
                if not held:
                    yield from self._refill()
                if not e.rows:
                    return
                # A full batch looks one record ahead (never at batch size 1, where a caller
                # may feed the next record only after reading this one's result): when none
                # is left, the draft lengths aim at the end of the job (engine.lengths).
                if e.batch_size > 1 and not self.exhausted and not self.ahead and not self.retry:
                    try:
                        self.ahead.append(next(self.source))
                    except StopIteration:
                        self.exhausted = True
                e.drained = self.exhausted and not self.retry and not self.ahead
                try:
                    finished = e.step()
                except oom_errors() as err:
                    if e.halve():
                        for r in reversed(e.evict_all()):
                            self.retry.appendleft((r.item, r.ids, r.sampling))
                        continue
                    for r in e.evict_all():
                        yield r.item, err
                    continue
                except Exception as err:  # noqa: BLE001 - the batch's records fail, the run goes on
                    for r in e.evict_all():
                        yield r.item, err
                    continue
                yield from self._leave(finished)

