"""The generate job: read, load, generate, write results in input order; resume, data
parallel (marscli.io.distributed), signals, --fail-fast and a closed stdout.

The input is read once up front into an index (marscli.io.input_index.index_input: ids, lines and
where each line lies, not the records' text), so duplicate ids reject the run before the
models load; records are parsed again one at a time as the engine pulls them, so memory does
not grow with the prompts.

Ctrl-C, SIGTERM and a closed stdout end the run cleanly: every finished result is on disk
(or sent) before the exit, and with -o FILE the run can be finished with --resume. Under a
launcher (WORLD_SIZE > 1) each process generates its shard into its own part file and the
main process merges them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator

from marscli.config import GenerateConfig
from marscli.errors import (
    EXIT_FOR_SIGNAL,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_RECORDS_FAILED,
    MarscliError,
    Stop,
    UsageError,
)
from marscli.io.console import Log, Progress, silence_stdout
from marscli.io.distributed import (
    Group,
    ProgressPump,
    ids_digest,
    launch_from_env,
    shard,
    solo_step,
)
from marscli.io.input_index import index_input
from marscli.io.openai_format import render
from marscli.io.results import held_path
from marscli.io.resume import RunOutput, fingerprint_diff
from marscli.jobs.fingerprint import LOADED_COMPONENTS, run_fingerprint, run_key
from marscli.jobs.results import (
    ERR_GENERATION_FAILED,
    ERR_OUT_OF_MEMORY,
    Totals,
    ignored_keys_note,
    result_options,
)
from marscli.jobs.setup import (
    build_generator,
    check_rule_modes,
    drafter_desc,
    verify_desc,
)


class StopSignals:
    """SIGINT and SIGTERM raise Stop while the run is on; previous handlers come back after.

    Writing a result line is a critical section (`deferred()`): a signal arriving then waits
    until the line is written and flushed, so no line is ever left half-written. Once
    stopping, further signals are ignored so a second Ctrl-C cannot break the cleanup.
    Outside the main thread (signals cannot be caught there) nothing is installed.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self._saved: dict[int, object] = {}
        self._depth = 0
        self._pending: int | None = None
        self.stopping = False

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._saved[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._saved.clear()

    def _handle(self, signum: int, frame: object) -> None:
        if self.stopping:
            return
        if self._depth:
            self._pending = signum
            return
        self.stopping = True
        raise Stop(signum)

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if not self._depth and self._pending is not None and not self.stopping:
                self.stopping = True
                raise Stop(self._pending)


def start_group(log: Log, input_path: str):
    """The process group of a launched run (accelerate launch, torchrun), or None alone."""

    launch = launch_from_env()
    if launch is None:
        return None
    if input_path == "-":
        raise UsageError("under a launcher every process reads the input itself: give a file, "
                         "not '-' (stdin)")
    if not launch.is_main:
        log.mute()
    group = Group(launch).start()
    log.info(f"data parallel: {launch.world_size} processes on {launch.machines} machine(s), "
             f"rank r taking records r, r+{launch.world_size}, ... of those to do")
    return group


def run_generate(cfg: GenerateConfig, log: Log) -> int:
    """Read, load, generate, write results in input order. Returns the exit code."""
    group = start_group(log, cfg.input)
    try:
        with StopSignals() as signals:
            run = GenerateRun(cfg, log, signals, group)
            try:
                return run.execute()
            except (Stop, KeyboardInterrupt) as e:
                signals.stopping = True
                return run.interrupted(e.signum if isinstance(e, Stop) else signal.SIGINT)
            except MarscliError as e:
                raise run.with_resume_hint(e) from None
            finally:
                run.close()
                if run.output is not None:
                    run.output.close()  # after the merge: the output is this run's until now
    finally:
        if group is not None:
            group.close()


def fail_fast_note(stop: dict) -> str:
    return (f"stopped at the first failed record (--fail-fast): id {stop['id']!r}, "
            f"line {stop['line']}: {stop['type']}: {stop['message']}")


def prefill_summary(engine) -> str:
    """The run's prompt work: prefill passes, prompt tokens computed and taken from the
    prefix cache (marscli.models.prefill)."""
    p = engine.prefiller
    return (f"prefill: {p.passes} passes, {p.tokens} prompt tokens computed"
            f" (+{p.padded} padding), {p.reused} reused from the prefix cache, {engine.prefill_seconds:.1f} s")


def steps_summary(engine) -> str | None:
    """How the run's steps ran when not eagerly (--compile): the shapes captured as CUDA graphs
    or compiled, and the seconds that took (said once, at the end); None for eager steps."""
    if engine.step_kind == "eager":
        return None
    steps = engine.kv.steps
    what = {"graphs": "captured as CUDA graphs", "compiled": "compiled by torch.compile"}.get(
        engine.step_kind, "run at static shapes")
    line = f"steps ({engine.step_kind}): {steps.captures} shapes {what} in {steps.capture_seconds:.1f} s"
    if steps.capture_error:
        line += f"; then eager ({steps.capture_error})"
    return line


class GenerateRun:
    """One `marscli generate` run; holds what the cleanup paths need to report."""

    def __init__(self, cfg: GenerateConfig, log: Log, signals: StopSignals, group=None):
        self.cfg = cfg
        self.log = log
        self.signals = signals
        self.group = group  # marscli.io.distributed.Group under a launcher, else None
        self.output = None  # marscli.io.RunOutput
        self.writer = None  # marscli.io.ResultWriter, once the output is open
        self.input = None  # marscli.io.input_index.InputIndex, once the input is read
        self.progress: Progress | None = None
        self.total = 0
        self.done_before = 0

    def execute(self) -> int:
        cfg, log, group = self.cfg, self.log, self.group
        step = group.step if group is not None else solo_step
        setup = cfg.setup
        if setup.verify.mode is not None:  # a rule asked for: its decoding modes, before anything else
            check_rule_modes(setup.verify.mode, cfg.sampling)
        # Everything that can be checked without the models is checked before loading them.
        with step("reading the input") as s:
            self.output = output = RunOutput(cfg.output, resume=cfg.resume, input_path=cfg.input,
                                             lock=group is None or group.is_main)
            # Refs (RecordRef) to the good records and the bad ones (RecordError) whole: what
            # resume, sharding and merging read (ids, lines, indexes); the engine gets each
            # record parsed again from its line as it pulls it (self.input.requests).
            self.input = index_input(cfg.input, limit=cfg.limit,
                                     digest=output.path is not None or group is not None)
            items, input_sha = self.input.items, self.input.sha256
            # "profile" is known once the target is loaded (a profile matches the loaded weights).
            extra = {"input": {"sha256": input_sha}, "profile": None}
            if items:
                output.check(run_fingerprint(setup, cfg.options, None, None, extra), ignore=LOADED_COMPONENTS)
            done = output.done
            todo = [it for it in items if it.id not in done]
            s.value = (input_sha, len(items), ids_digest([it.id for it in todo]))
        if group is not None and len(set(s.values)) > 1:
            differ = [r for r, v in enumerate(s.values) if v != s.values[0]]
            raise group.fail_all(
                f"rank(s) {', '.join(map(str, differ))} read another input or other finished "
                f"results than rank 0: every process must see the same input file and the "
                f"output's folder (one machine, or a filesystem shared by the machines)")
        if not items:
            if group is None or group.is_main:
                output.write_empty()
            log.info(f"{cfg.input}: no records; nothing to do")
            return EXIT_OK
        self.total = len(items)
        self.done_before = len(items) - len(todo)
        if output.resuming:
            torn = f"; cut a torn last line ({output.torn_bytes} bytes)" if output.torn_bytes else ""
            parts = f" and {len(output.part_scans)} part file(s)" if output.part_scans else ""
            log.info(f"resuming {output.path}{parts}: {self.done_before} of {len(items)} records "
                     f"already done{torn}")

        with step("loading the models") as s:
            gen = build_generator(setup, log.info, group)
            check_rule_modes(gen.verify.rule, cfg.sampling)  # the rule may come from the profile
            extra["profile"] = gen.spec_meta["profile"]
            fingerprint = run_fingerprint(
                setup, cfg.options, gen.target.identity, gen.draft_loaded.identity if gen.draft_loaded else None,
                extra, verify=gen.verify,
            )
            s.value = fingerprint
        if group is not None:
            self._check_same_run(s.values)
        log.info(f"drafter {drafter_desc(setup.draft)}, verify {verify_desc(gen.verify)}")

        if group is None:
            self.writer = writer = output.open(fingerprint, items)
            mine = todo
        else:
            writer, mine = self._open_parts(fingerprint, todo)
        failed = sum(done.values())  # earlier results that are errors count too
        totals = Totals()
        self.progress = Progress(log, len(todo))
        t_start = time.perf_counter()
        options = result_options(cfg.options, gen.target, run_key(fingerprint))
        note = ignored_keys_note(todo)  # every record of the run, whatever the rank
        if note is not None:
            log.note(note)
        results = gen.results(self.input.requests(mine), cfg.sampling, options)
        pump = contextlib.nullcontext()
        if group is not None and group.is_main and not log.quiet:
            pump = ProgressPump(group, self.progress.set)
        with pump:
            for item, result, seconds in results:
                error = result.get("error")
                if error:
                    failed += 1
                    if error["type"] in (ERR_GENERATION_FAILED, ERR_OUT_OF_MEMORY):
                        log.note(f"record {item.id!r} (line {item.line}) failed: {error['message']}")
                else:
                    totals.add(result, seconds)
                with self.signals.deferred():
                    writer.write(item.index, render(item, result, options))
                tokens = result["usage"]["completion_tokens"] if result.get("usage") else 0
                if group is not None:
                    group.add_progress(1, tokens)
                else:
                    self.progress.advance(tokens)
                if writer.broken_pipe:
                    # The reader went away (`| head`): stop quietly, nothing left to say.
                    self.close()
                    silence_stdout()
                    return EXIT_OK
                if error and cfg.fail_fast:
                    stop = {"id": item.id, "line": item.line, "type": error["type"],
                            "message": error["message"]}
                    if group is None:
                        self.close()
                        log.always(fail_fast_note(stop))
                        return EXIT_RECORDS_FAILED
                    group.request_stop(stop)
                    break
                if group is not None and cfg.fail_fast and group.stop_requested():
                    break
            if group is not None:
                return self._finish_group(items, todo, totals, failed - sum(done.values()), t_start)
        self.close()
        output.finish(items)  # merge a resume over parts or gaps; drop the emptied held file
        if setup.batch_size > 1:
            totals.wall = time.perf_counter() - t_start
        earlier = f"; {self.done_before} more were done before resuming" if self.done_before else ""
        log.info(totals.summary(len(todo), failed - sum(done.values())) + earlier)
        log.info(prefill_summary(gen.engine))
        if (line := steps_summary(gen.engine)) is not None:
            log.info(line)
        return EXIT_RECORDS_FAILED if failed else EXIT_OK

    # ------------------------------------------------------------------ data parallel

    def _check_same_run(self, fingerprints: list[dict]) -> None:
        for r, fp in enumerate(fingerprints):
            diffs = fingerprint_diff(fingerprints[0], fp)
            if diffs:
                raise self.group.fail_all(
                    f"rank {r} would make other results than rank 0 ({'; '.join(diffs)}; "
                    "read 'in the existing run' as 'on rank 0'): every process must load the "
                    "same models, profile and settings")

    def _open_parts(self, fingerprint: dict, todo: list):
        """Main process: prepare the output; every process: open its part file (after checking
        it sees what the main process wrote); returns (writer, this rank's records)."""

        group, output = self.group, self.output
        with group.step("opening the output") as s:
            if group.is_main:
                s.value = output.prepare_parts(fingerprint)
        parts_base, probe = s.values[0]
        with group.step("opening the part files") as s:
            output.parts_base = parts_base
            if not os.path.exists(probe):
                import socket

                hint = (" (results on stdout put the parts in a temporary folder of rank 0's "
                        "machine: across machines, write them to a file on a shared filesystem "
                        "with -o FILE)" if output.path is None else "")
                raise UsageError(
                    f"rank {group.rank} on {socket.gethostname()} cannot see {probe}, written by "
                    f"rank 0: every process must see the output's folder (one machine, or a "
                    f"filesystem shared by the machines){hint}")
            self.writer = output.open_part(group.rank, group.world_size)
        if group.is_main:
            with contextlib.suppress(OSError):
                os.unlink(probe)
        return self.writer, shard(todo, group.rank, group.world_size)

    def _finish_group(self, items: list, todo: list, totals: Totals, failed_now: int,
                      t_start: float) -> int:
        """Every rank: close the part and say it is done. The main process waits for the
        others (the bar moving on), merges the parts into the output, and sums up."""
        group, log, output = self.group, self.log, self.output
        self.writer.close()
        group.mark_done({"totals": totals.to_dict(), "failed": failed_now})
        if not group.is_main:
            return EXIT_OK
        parts = group.wait_all_done()
        wall = time.perf_counter() - t_start
        self.close()
        sys.stdout.flush()
        report = output.merge(items, stream=sys.stdout.buffer if output.path is None else None)
        if report.broken_pipe:
            silence_stdout()
            return EXIT_OK
        stop = group.stop_requested()
        if stop is not None:
            log.always(fail_fast_note(stop) + (
                f"; the finished results are in {output.path}: rerun with --resume to go on"
                if output.path is not None else ""))
            return EXIT_RECORDS_FAILED
        if report.missing:  # pragma: no cover - every rank finished its shard
            raise MarscliError(f"{len(report.missing)} records have no result (e.g. id "
                               f"{report.missing[0]!r})")
        summed = Totals.summed([p["totals"] for p in parts], wall)
        earlier = f"; {self.done_before} more were done before resuming" if self.done_before else ""
        log.info(summed.summary(len(todo), sum(p["failed"] for p in parts)) + earlier
                 + f" ({group.world_size} processes)")
        return EXIT_RECORDS_FAILED if report.failed else EXIT_OK

    def close(self) -> None:
        """Stop the progress bar, flush and close the output, close the input; safe to call
        twice."""
        if self.progress is not None:
            self.progress.close()
            self.progress = None
        if self.input is not None:
            self.input.close()
        if self.writer is not None:
            try:
                self.writer.close()
            except OSError:  # disk full on the last flush: what was flushed before stays
                pass

    def interrupted(self, signum: int) -> int:
        self.close()
        why = "interrupted (Ctrl-C)" if signum == signal.SIGINT else "terminated (SIGTERM)"
        out = self.output
        if self.group is not None:
            if out is not None:
                out.cleanup()
            if self.writer is None:
                self.log.always(f"{why} before generating; no results written")
            elif out is not None and out.path is not None:
                self.log.always(
                    f"{why}: the finished results are in {out.path} and its part files "
                    f"({os.path.basename(out.path)}.rank*-of-{self.group.world_size}.part); to "
                    f"finish, rerun the same command with --resume (and the same -o {out.path}), "
                    "with any number of processes")
            else:
                self.log.always(f"{why}: results on stdout come when every process is done, so "
                                "none were sent; write them to a file (-o FILE) so an interrupted "
                                "run can be finished with --resume")
        elif self.writer is None:
            self.log.always(f"{why} before generating; no results written")
        elif out is not None and out.path is not None:
            held = len(self.writer.pending)
            have = self.done_before + self.writer.written + held
            where = (f"{out.path} and {held_path(out.path)} ({held} finished ahead of an "
                     "earlier record)" if held else out.path)
            self.log.always(
                f"{why}: {have} of {self.total} results are in {where}; to finish, rerun "
                f"the same command with --resume (and the same -o {out.path})"
            )
        else:
            self.log.always(
                f"{why} after {self.writer.written} of {self.total} results; write them to a "
                "file (-o FILE) so an interrupted run can be finished with --resume"
            )
        return EXIT_FOR_SIGNAL.get(signum, EXIT_INTERRUPTED)

    def with_resume_hint(self, err: MarscliError) -> MarscliError:
        """A failure after results were written: say they are kept and how to go on."""
        out = self.output
        if getattr(err, "reported_elsewhere", False):
            return err
        if self.writer is None or out is None or out.path is None:
            if out is not None:
                out.cleanup()
            return err
        where = f"{out.path} and its part files" if self.group is not None else out.path
        hinted = MarscliError(
            f"{err}; the finished results are in {where}: rerun with --resume to go on"
        )
        hinted.exit_code = err.exit_code
        return hinted
