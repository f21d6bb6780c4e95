"""Command-line interface (Typer only).

Each command parses its options into frozen config dataclasses and calls the library. torch
and transformers are imported inside command bodies so `marscli --help` stays fast.
stdout carries JSONL data only; logs, progress and the summary go to stderr.

Exit codes: 0 all records succeeded; 1 runtime failure; 2 usage, configuration or model
error; 3 the run finished but some records failed (or --fail-fast stopped it); 130
interrupted (Ctrl-C); 143 terminated (SIGTERM). A closed stdout (`| head`) exits 0 quietly.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Annotated, Optional

import typer
from rich.console import Console

from marscli import __version__
from marscli.config import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_NUM_DRAFT_TOKENS,
    PAPER_THETA,
    STRICT_THETA,
    DraftConfig,
    GenerateConfig,
    ModelConfig,
    SamplingParams,
    VerifyConfig,
)
from marscli.errors import (
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_RECORDS_FAILED,
    EXIT_TERMINATED,
    MarscliError,
    UsageError,
)

EXIT_CODES_HELP = (
    "Exit codes: 0 all records succeeded; 1 runtime failure; 2 usage, configuration or model "
    "error; 3 finished but some records failed (or --fail-fast stopped at the first); "
    "130 interrupted (Ctrl-C); 143 terminated (SIGTERM). After 130 or 143, rerun the same "
    "command with --resume to finish."
)

app = typer.Typer(
    name="marscli",
    help="Offline LLM generation with speculative decoding and margin-aware verification (MARS).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

PANEL_MODEL = "Models"
PANEL_DRAFT = "Drafting"
PANEL_VERIFY = "Verification"
PANEL_SAMPLING = "Sampling"
PANEL_OUTPUT = "Input and output"


def _stderr() -> Console:
    return Console(stderr=True, highlight=False)


def _fail(err: MarscliError) -> typer.Exit:
    _stderr().print(f"marscli: error: {err}", markup=False, soft_wrap=True)
    return typer.Exit(err.exit_code)


def _version_cb(value: bool) -> None:
    if value:
        print(f"marscli {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version_cb, is_eager=True, help="Print the version.")
    ] = False,
) -> None:
    """marscli: speculative decoding with strict or margin-aware (MARS) verification."""


def parse_draft(draft: str) -> tuple[str, str | None]:
    """'none' | 'ngram' | a model path or hub id -> (kind, model)."""
    if draft in ("none", "ngram"):
        return draft, None
    return "model", draft


@app.command(
    epilog=(
        "Examples:\n\n"
        "  marscli generate prompts.jsonl > results.jsonl\n\n"
        "  marscli generate prompts.jsonl --target ./Llama-3.1-8B-Instruct "
        "--draft ./Llama-3.2-1B-Instruct --verify mars --theta 0.9 -o results.jsonl\n\n"
        "  cat prompts.jsonl | marscli generate - --draft ngram | jq -r .output\n\n"
        "  marscli generate prompts.jsonl -o results.jsonl --resume   # finish an interrupted run\n\n"
        + EXIT_CODES_HELP
    ),
)
def generate(
    input: Annotated[str, typer.Argument(help="JSONL file of records, or '-' for stdin.")],
    output: Annotated[
        Optional[str], typer.Option("-o", "--output", help="Write results here instead of stdout.", rich_help_panel=PANEL_OUTPUT)
    ] = None,
    target: Annotated[
        Optional[str],
        typer.Option(help="Target model: local dir, .gguf file or hub id from the local cache. Default: embedded SmolLM2-135M-Instruct.", rich_help_panel=PANEL_MODEL),
    ] = None,
    draft: Annotated[
        str, typer.Option(help="Drafter: 'ngram' (prompt lookup), 'none' (plain decoding) or a draft model path / hub id.", rich_help_panel=PANEL_DRAFT)
    ] = "ngram",
    num_draft_tokens: Annotated[
        int, typer.Option("--num-draft-tokens", "-k", min=1, max=64, help="Most draft tokens per step (K).", rich_help_panel=PANEL_DRAFT)
    ] = DEFAULT_NUM_DRAFT_TOKENS,
    adaptive: Annotated[
        bool, typer.Option("--adaptive/--fixed-k", help="Adapt the draft length to how often drafts pass (deterministic cost model) or always draft K.", rich_help_panel=PANEL_DRAFT)
    ] = True,
    ngram_max: Annotated[int, typer.Option(min=1, max=16, help="Longest suffix n-gram to match.", rich_help_panel=PANEL_DRAFT)] = 3,
    ngram_min: Annotated[int, typer.Option(min=1, max=16, help="Shortest suffix n-gram to match.", rich_help_panel=PANEL_DRAFT)] = 1,
    verify: Annotated[
        str, typer.Option(help="'strict' (exact) or 'mars' (relax at low-margin positions).", rich_help_panel=PANEL_VERIFY)
    ] = "strict",
    theta: Annotated[
        Optional[float], typer.Option(help=f"MARS threshold; default {PAPER_THETA} (the paper's).", rich_help_panel=PANEL_VERIFY)
    ] = None,
    margin: Annotated[
        str, typer.Option(help="Margin statistic: 'logit-ratio' (z2/z1) or 'prob-ratio' (p2/p1).", rich_help_panel=PANEL_VERIFY)
    ] = "logit-ratio",
    temperature: Annotated[float, typer.Option(min=0.0, help="0 = greedy.", rich_help_panel=PANEL_SAMPLING)] = 0.0,
    top_p: Annotated[float, typer.Option(min=0.0, max=1.0, help="Nucleus sampling mass.", rich_help_panel=PANEL_SAMPLING)] = 1.0,
    top_k: Annotated[int, typer.Option(min=0, help="Top-k filter (0 = off).", rich_help_panel=PANEL_SAMPLING)] = 0,
    seed: Annotated[int, typer.Option(min=0, help="Random seed (per record unless the record sets one).", rich_help_panel=PANEL_SAMPLING)] = 0,
    max_tokens: Annotated[int, typer.Option(min=1, help="Most new tokens per record.", rich_help_panel=PANEL_SAMPLING)] = DEFAULT_MAX_TOKENS,
    stop: Annotated[
        Optional[list[str]], typer.Option(help="Stop string (repeatable).", rich_help_panel=PANEL_SAMPLING)
    ] = None,
    dtype: Annotated[str, typer.Option(help="auto, float32, bfloat16 or float16.", rich_help_panel=PANEL_MODEL)] = "auto",
    device: Annotated[str, typer.Option(help="auto, cpu, cuda or cuda:N.", rich_help_panel=PANEL_MODEL)] = "auto",
    device_map: Annotated[
        Optional[str], typer.Option(help="'auto' to spread a model over devices with accelerate.", rich_help_panel=PANEL_MODEL)
    ] = None,
    load_in_8bit: Annotated[bool, typer.Option(help="8-bit weights (bitsandbytes, CUDA).", rich_help_panel=PANEL_MODEL)] = False,
    load_in_4bit: Annotated[bool, typer.Option(help="4-bit weights (bitsandbytes, CUDA).", rich_help_panel=PANEL_MODEL)] = False,
    limit: Annotated[
        Optional[int], typer.Option(min=1, help="Only the first N records.", rich_help_panel=PANEL_OUTPUT)
    ] = None,
    timing: Annotated[
        bool, typer.Option("--timing/--no-timing", help="Include wall-clock timing in results (off: byte-identical reruns).", rich_help_panel=PANEL_OUTPUT)
    ] = True,
    token_ids: Annotated[
        bool, typer.Option("--token-ids", help="Include the generated token ids in results.", rich_help_panel=PANEL_OUTPUT)
    ] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress or summary on stderr.", rich_help_panel=PANEL_OUTPUT)] = False,
    resume: Annotated[
        bool, typer.Option("--resume", help="Finish an interrupted run: keep the results already in -o FILE, append the missing ones. Refused if the settings differ.", rich_help_panel=PANEL_OUTPUT)
    ] = False,
    fail_fast: Annotated[
        bool, typer.Option("--fail-fast", help="Stop at the first record that fails (exit 3) instead of going on.", rich_help_panel=PANEL_OUTPUT)
    ] = False,
    truncate_prompt: Annotated[
        str, typer.Option("--truncate-prompt", help="A prompt too long for the context window: 'none' (error result) or 'left' (drop its oldest tokens to leave room for --max-tokens).", rich_help_panel=PANEL_SAMPLING)
    ] = "none",
) -> None:
    """Generate completions for a JSONL file of prompts with speculative decoding.

    Each input line is {"prompt": ...}, {"messages": [...]} (chat template applied), an OpenAI
    batch line (custom_id, body), or a prompt-set record (question_id, turns: first turn).
    Per-line max_tokens, temperature, top_p, top_k, seed and stop override the options.
    One JSON result per input line is written in input order.
    """
    if verify not in ("strict", "mars"):
        raise _fail(UsageError(f"--verify must be 'strict' or 'mars', got {verify!r}"))
    if margin not in ("logit-ratio", "prob-ratio"):
        raise _fail(UsageError(f"--margin must be 'logit-ratio' or 'prob-ratio', got {margin!r}"))
    if ngram_min > ngram_max:
        raise _fail(UsageError(f"--ngram-min ({ngram_min}) must not exceed --ngram-max ({ngram_max})"))
    if dtype not in ("auto", "float32", "bfloat16", "float16"):
        raise _fail(UsageError(f"--dtype must be auto, float32, bfloat16 or float16, got {dtype!r}"))
    if truncate_prompt not in ("none", "left"):
        raise _fail(UsageError(f"--truncate-prompt must be 'none' or 'left', got {truncate_prompt!r}"))
    log = _Log(quiet)
    if verify == "mars" and theta is None:
        theta = PAPER_THETA
        log.info(f"--verify mars without --theta: using the paper's theta = {PAPER_THETA}")
    if verify == "strict" and theta is not None:
        log.info("--theta has no effect with --verify strict")
    kind, draft_model = parse_draft(draft)
    cfg = GenerateConfig(
        input=input,
        output=output,
        target=ModelConfig(target, dtype, device, device_map, load_in_8bit, load_in_4bit),
        draft=DraftConfig(kind, draft_model, num_draft_tokens, ngram_max, ngram_min, adaptive),
        draft_model=ModelConfig(draft_model, dtype, device, device_map, load_in_8bit, load_in_4bit) if draft_model else None,
        verify=VerifyConfig(verify, theta if theta is not None else STRICT_THETA, margin),
        sampling=SamplingParams(temperature, top_p, top_k, max_tokens, seed, tuple(stop or ())),
        limit=limit,
        timing=timing,
        token_ids=token_ids,
        resume=resume,
        fail_fast=fail_fast,
        truncate_prompt=truncate_prompt,
    )
    try:
        code = run_generate(cfg, log)
    except MarscliError as e:
        raise _fail(e)
    raise typer.Exit(code)


# --------------------------------------------------------------------------- generate


class _Log:
    """Narration on stderr; silent with --quiet."""

    def __init__(self, quiet: bool):
        self.quiet = quiet
        self.console = _stderr()

    def info(self, msg: str) -> None:
        if not self.quiet:
            self.always(msg)

    def always(self, msg: str) -> None:
        """What the user must see even with --quiet (how to finish an interrupted run)."""
        self.console.print(f"marscli: {msg}", markup=False, soft_wrap=True)


class _Progress:
    """A rich bar on a terminal, a plain line every few seconds otherwise, nothing if quiet."""

    PLAIN_EVERY_S = 10.0

    def __init__(self, log: _Log, total: int):
        self.log = log
        self.total = total
        self.done = 0
        self.tokens = 0
        self.t0 = time.perf_counter()
        self.last = self.t0
        self.bar = None
        if not log.quiet and log.console.is_terminal:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(
                TextColumn("generating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                TextColumn("{task.fields[rate]}"), console=log.console, redirect_stdout=False,
                redirect_stderr=False, transient=True,
            )
            self.task = self.bar.add_task("gen", total=total, rate="")
            self.bar.start()

    def advance(self, tokens: int) -> None:
        self.done += 1
        self.tokens += tokens
        now = time.perf_counter()
        rate = self.tokens / max(now - self.t0, 1e-9)
        if self.bar is not None:
            self.bar.update(self.task, advance=1, rate=f"{rate:.1f} tok/s")
        elif not self.log.quiet and now - self.last >= self.PLAIN_EVERY_S:
            self.last = now
            self.log.info(f"{self.done}/{self.total} records, {self.tokens} tokens, {rate:.1f} tok/s")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


class _Stop(BaseException):
    """Raised by the SIGINT/SIGTERM handler so one cleanup path saves every finished result.

    A BaseException, like KeyboardInterrupt, so `except Exception` in loaders and in the
    per-record error handling lets it through.
    """

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


_EXIT_FOR_SIGNAL = {signal.SIGINT: EXIT_INTERRUPTED, signal.SIGTERM: EXIT_TERMINATED}


class _StopSignals:
    """SIGINT and SIGTERM raise _Stop while the run is on; previous handlers come back after.

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
        raise _Stop(signum)

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if not self._depth and self._pending is not None and not self.stopping:
                self.stopping = True
                raise _Stop(self._pending)


def run_generate(cfg: GenerateConfig, log: _Log) -> int:
    """Read, load, generate, write results in input order. Returns the exit code.

    Ctrl-C, SIGTERM and a closed stdout end the run cleanly: every finished result is on
    disk (or sent) before the exit, and with -o FILE the run can be finished with --resume.
    """
    with _StopSignals() as signals:
        run = _GenerateRun(cfg, log, signals)
        try:
            return run.execute()
        except (_Stop, KeyboardInterrupt) as e:
            signals.stopping = True
            return run.interrupted(e.signum if isinstance(e, _Stop) else signal.SIGINT)
        except MarscliError as e:
            raise run.with_resume_hint(e) from None
        finally:
            run.close()


class _GenerateRun:
    """One `marscli generate` run; holds what the cleanup paths need to report."""

    def __init__(self, cfg: GenerateConfig, log: _Log, signals: _StopSignals):
        self.cfg = cfg
        self.log = log
        self.signals = signals
        self.output = None  # marscli.io.RunOutput
        self.writer = None  # marscli.io.ResultWriter, once the output is open
        self.progress: _Progress | None = None
        self.total = 0
        self.done_before = 0

    def execute(self) -> int:
        from marscli.io import LOADED_COMPONENTS, RunOutput, read_input, run_fingerprint

        cfg, log = self.cfg, self.log
        # Everything that can be checked without the models is checked before loading them.
        self.output = output = RunOutput(cfg.output, resume=cfg.resume, input_path=cfg.input)
        items, input_sha = read_input(cfg.input, limit=cfg.limit, digest=output.path is not None)
        if not items:
            output.write_empty()
            log.info(f"{cfg.input}: no records; nothing to do")
            return EXIT_OK
        # "profile" stays None until generate takes profiles; then it carries name and sha256.
        extra = {"input": {"sha256": input_sha}, "profile": None}
        output.check(run_fingerprint(cfg, None, None, extra), ignore=LOADED_COMPONENTS)
        done = output.done
        todo = [it for it in items if it.id not in done]
        self.total = len(items)
        self.done_before = len(items) - len(todo)
        if output.resuming:
            torn = f"; cut a torn last line ({output.scan.torn_bytes} bytes)" if output.scan.torn_bytes else ""
            log.info(f"resuming {output.path}: {self.done_before} of {len(items)} records already done{torn}")

        from marscli.engine import SpecEngine, build_drafter
        from marscli.models import check_vocab_compatible, load_model

        t_load = time.perf_counter()
        target = load_model(cfg.target, role="target", log=log.info)
        draft_loaded = None
        if cfg.draft_model is not None:
            draft_loaded = load_model(cfg.draft_model, role="draft", log=log.info)
            check_vocab_compatible(target, draft_loaded)
        log.info(f"loaded {target.identity.get('name')} on {target.device} in {time.perf_counter() - t_load:.1f} s")
        fingerprint = run_fingerprint(
            cfg, target.identity, draft_loaded.identity if draft_loaded else None, extra
        )
        drafter = build_drafter(cfg.draft, target, draft_loaded)
        engine = SpecEngine(target, drafter, cfg.verify, cfg.draft)
        vdesc = cfg.verify.mode if cfg.verify.mode == "strict" else f"mars (theta={cfg.verify.theta:g}, {cfg.verify.margin})"
        log.info(f"drafter {cfg.draft.kind}{'' if cfg.draft.kind == 'none' else f' (K<={cfg.draft.num_draft_tokens})'}, verify {vdesc}")

        self.writer = writer = output.open(fingerprint, items)
        failed = sum(done.values())  # earlier results that are errors count too
        totals = _Totals()
        self.progress = _Progress(log, len(todo))
        for item in todo:
            result, seconds = _run_one(engine, item, cfg)
            error = result.get("error")
            if error:
                failed += 1
                if error["type"] in (ERR_GENERATION_FAILED, ERR_OUT_OF_MEMORY):
                    log.info(f"record {item.id!r} (line {item.line}) failed: {error['message']}")
            else:
                totals.add(result, seconds)
            with self.signals.deferred():
                writer.write(item.index, result)
            self.progress.advance(result["usage"]["completion_tokens"] if result.get("usage") else 0)
            if writer.broken_pipe:
                # The reader went away (`| head`): stop quietly, nothing left to say.
                self.close()
                _silence_stdout()
                return EXIT_OK
            if error and cfg.fail_fast:
                self.close()
                log.always(
                    f"stopped at the first failed record (--fail-fast): id {item.id!r}, "
                    f"line {item.line}: {error['type']}: {error['message']}"
                )
                return EXIT_RECORDS_FAILED
        self.close()
        earlier = f"; {self.done_before} more were done before resuming" if self.done_before else ""
        log.info(totals.summary(len(todo), failed - sum(done.values())) + earlier)
        return EXIT_RECORDS_FAILED if failed else EXIT_OK

    def close(self) -> None:
        """Stop the progress bar and flush and close the output; safe to call twice."""
        if self.progress is not None:
            self.progress.close()
            self.progress = None
        if self.writer is not None:
            try:
                self.writer.close()
            except OSError:  # disk full on the last flush: what was flushed before stays
                pass

    def interrupted(self, signum: int) -> int:
        self.close()
        why = "interrupted (Ctrl-C)" if signum == signal.SIGINT else "terminated (SIGTERM)"
        out = self.output
        if self.writer is None:
            self.log.always(f"{why} before generating; no results written")
        elif out is not None and out.path is not None:
            have = self.done_before + self.writer.written
            self.log.always(
                f"{why}: {have} of {self.total} results are in {out.path}; to finish, rerun "
                f"the same command with --resume (and the same -o {out.path})"
            )
        else:
            self.log.always(
                f"{why} after {self.writer.written} of {self.total} results; write them to a "
                "file (-o FILE) so an interrupted run can be finished with --resume"
            )
        return _EXIT_FOR_SIGNAL.get(signum, EXIT_INTERRUPTED)

    def with_resume_hint(self, err: MarscliError) -> MarscliError:
        """A failure after results were written: say they are kept and how to go on."""
        out = self.output
        if self.writer is None or out is None or out.path is None:
            return err
        hinted = MarscliError(
            f"{err}; the finished results are in {out.path}: rerun with --resume to go on"
        )
        hinted.exit_code = err.exit_code
        return hinted


def _silence_stdout() -> None:
    # The reader went away (e.g. `| head`): make the interpreter's final flush a no-op.
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


class _Totals:
    def __init__(self) -> None:
        self.records = 0
        self.tokens = 0
        self.seconds = 0.0
        self.steps = 0
        self.accepted = 0
        self.relaxed = 0

    def add(self, r: dict, seconds: float) -> None:
        self.records += 1
        self.tokens += r["usage"]["completion_tokens"]
        self.seconds += seconds
        s = r["spec"]
        self.steps += s["steps"]
        self.accepted += s["accepted"]
        self.relaxed += s["relaxed"]

    def summary(self, total: int, failed: int) -> str:
        tps = self.tokens / self.seconds if self.seconds else 0.0
        tau = self.tokens / self.steps if self.steps else 0.0
        relaxed = self.relaxed / self.tokens if self.tokens else 0.0
        return (
            f"done: {self.records}/{total} records ok, {failed} failed, {self.tokens} tokens, "
            f"{tps:.1f} tok/s, mean acceptance length {tau:.2f}, relaxed share {relaxed:.3f}"
        )


#: Error types of records whose generation failed (the others come from marscli.io / engine).
ERR_GENERATION_FAILED = "generation_failed"
ERR_OUT_OF_MEMORY = "out_of_memory"
_MAX_ERROR_CHARS = 300


def _error_result(item, type_: str, message: str) -> dict:
    return {item.id_key: item.id, "output": None,
            "error": {"type": type_, "message": message, "line": item.line}}


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    line = text[0] if text else type(exc).__name__
    return line if len(line) <= _MAX_ERROR_CHARS else line[: _MAX_ERROR_CHARS - 3] + "..."


def _run_one(engine, item, cfg: GenerateConfig) -> tuple[dict, float]:
    """One record -> (result line, seconds spent generating). Never raises for one record's
    sake: a failure becomes an error result and the run goes on."""
    import torch

    from marscli.config import RecordError
    from marscli.engine import RecordFailure

    if isinstance(item, RecordError):
        return _error_result(item, item.type, item.message), 0.0
    try:
        sampling = cfg.sampling.with_overrides(item.overrides)
        ids, dropped = engine.fit_prompt(engine.tokenize(item), truncate=cfg.truncate_prompt,
                                         max_tokens=sampling.max_tokens)
        res = engine.generate_ids(ids, sampling)
    except RecordFailure as e:
        return _error_result(item, e.type, e.message), 0.0
    except (torch.cuda.OutOfMemoryError, MemoryError) as e:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # give the next record the memory this one held
        return _error_result(item, ERR_OUT_OF_MEMORY, _one_line(e)), 0.0
    except Exception as e:  # noqa: BLE001 - one record's failure must not end a night's run
        return _error_result(item, ERR_GENERATION_FAILED, f"{type(e).__name__}: {_one_line(e)}"), 0.0
    usage = {"prompt_tokens": res.prompt_tokens, "completion_tokens": res.completion_tokens}
    if cfg.truncate_prompt != "none":
        usage["truncated_prompt_tokens"] = dropped
    out = {
        item.id_key: item.id,
        "output": res.text,
        "finish_reason": res.finish_reason,
        "usage": usage,
        "spec": {
            "drafter": cfg.draft.kind,
            "verify": cfg.verify.mode,
            "theta": None if cfg.verify.mode == "strict" else cfg.verify.theta,
            "margin": cfg.verify.margin,
            **res.stats.to_dict(),
        },
        "timing": {
            "seconds": round(res.seconds, 4),
            "tokens_per_s": round(res.completion_tokens / res.seconds, 2) if res.seconds > 0 else None,
        } if cfg.timing else None,
        "error": None,
    }
    if cfg.token_ids:
        out["token_ids"] = res.token_ids
    return out, res.seconds


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:  # before or after run_generate's own handling
        sys.exit(EXIT_INTERRUPTED)
    except _Stop as e:  # a second signal in the instant cleanup starts
        sys.exit(_EXIT_FOR_SIGNAL.get(e.signum, EXIT_INTERRUPTED))


if __name__ == "__main__":
    main()
