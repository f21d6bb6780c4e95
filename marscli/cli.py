"""Command-line interface (Typer only).

Each command parses its options into frozen config dataclasses and calls the library. torch
and transformers are imported inside command bodies so `marscli --help` stays fast.
stdout carries JSONL data only; logs, progress and the summary go to stderr.

Exit codes: 0 all records succeeded; 1 runtime failure; 2 usage, configuration or model
error; 3 the run finished but some records failed; 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import os
import sys
import time
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
    MarscliError,
    UsageError,
)

EXIT_CODES_HELP = (
    "Exit codes: 0 all records succeeded; 1 runtime failure; 2 usage, configuration or model "
    "error; 3 finished but some records failed; 130 interrupted."
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
    )
    try:
        code = run_generate(cfg, log)
    except MarscliError as e:
        raise _fail(e)
    raise typer.Exit(code)


# --------------------------------------------------------------------------- bench


@app.command(
    epilog=(
        "Examples:\n\n"
        "  marscli bench ../shared/data/prompts/sum.jsonl --limit 20 --max-tokens 128 "
        "--methods hf-generate,hf-assisted,ar,strict,mars --theta 0.85,0.9,0.95 --report bench.json\n\n"
        "  marscli bench prompts.jsonl --target ./Llama-3.1-8B-Instruct --draft ./Llama-3.2-1B-Instruct "
        "--temperature 1.0 --seeds 0,1,2 --plot bench.png\n\n"
        "  marscli bench prompts.jsonl --report - | jq .methods\n\n"
        "Exit codes: 0 done; 1 a correctness check failed (greedy ar or strict output differs from "
        "hf-generate's; the report is still written) or a runtime failure; 2 usage or model error; "
        "130 interrupted."
    ),
)
def bench(
    input: Annotated[str, typer.Argument(help="JSONL file of prompts (any format generate reads), or '-' for stdin.")],
    methods: Annotated[
        str, typer.Option(help="Comma-separated: hf-generate, hf-assisted, ar, strict, mars (one per --theta).", rich_help_panel=PANEL_VERIFY)
    ] = "hf-generate,hf-assisted,ar,strict,mars",
    theta: Annotated[
        str, typer.Option(help=f"MARS thresholds, comma-separated; default {PAPER_THETA} (the paper's).", rich_help_panel=PANEL_VERIFY)
    ] = str(PAPER_THETA),
    margin: Annotated[
        str, typer.Option(help="Margin statistic: 'logit-ratio' (z2/z1) or 'prob-ratio' (p2/p1).", rich_help_panel=PANEL_VERIFY)
    ] = "logit-ratio",
    target: Annotated[
        str | None,
        typer.Option(help="Target model: local dir, .gguf file or hub id from the local cache. Default: embedded SmolLM2-135M-Instruct.", rich_help_panel=PANEL_MODEL),
    ] = None,
    draft: Annotated[
        str, typer.Option(help="Drafter for hf-assisted, strict and mars: 'ngram' (prompt lookup), 'none', or a draft model path / hub id.", rich_help_panel=PANEL_DRAFT)
    ] = "ngram",
    num_draft_tokens: Annotated[
        int, typer.Option("--num-draft-tokens", "-k", min=1, max=64, help="Most draft tokens per step (K), for marscli and hf-assisted alike.", rich_help_panel=PANEL_DRAFT)
    ] = DEFAULT_NUM_DRAFT_TOKENS,
    adaptive: Annotated[
        bool, typer.Option("--adaptive/--fixed-k", help="marscli adapts the draft length (deterministic cost model) or always drafts K.", rich_help_panel=PANEL_DRAFT)
    ] = True,
    temperature: Annotated[float, typer.Option(min=0.0, help="0 = greedy; the same for every method.", rich_help_panel=PANEL_SAMPLING)] = 0.0,
    seeds: Annotated[
        str, typer.Option(help="Comma-separated seeds; with --temperature > 0 every method runs once per seed.", rich_help_panel=PANEL_SAMPLING)
    ] = "0",
    max_tokens: Annotated[int, typer.Option(min=1, help="Most new tokens per prompt, for every method.", rich_help_panel=PANEL_SAMPLING)] = 128,
    dtype: Annotated[str, typer.Option(help="auto, float32, bfloat16 or float16.", rich_help_panel=PANEL_MODEL)] = "auto",
    device: Annotated[str, typer.Option(help="auto, cpu, cuda or cuda:N.", rich_help_panel=PANEL_MODEL)] = "auto",
    limit: Annotated[int | None, typer.Option(min=1, help="Only the first N records.", rich_help_panel=PANEL_OUTPUT)] = None,
    report: Annotated[
        str | None, typer.Option(help="Write the full JSON report here ('-': stdout).", rich_help_panel=PANEL_OUTPUT)
    ] = None,
    plot: Annotated[
        str | None, typer.Option(help="Write a PNG of speedup against quality per method and theta (needs matplotlib).", rich_help_panel=PANEL_OUTPUT)
    ] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress or tables on stderr (correctness failures still show).", rich_help_panel=PANEL_OUTPUT)] = False,
) -> None:
    """Measure speed and quality of every method side by side on the same prompts, in one run.

    Methods: hf-generate (transformers generate(), the baseline), hf-assisted (transformers
    assisted generation with the same drafter), ar (marscli, no drafter), strict and mars
    (marscli speculative decoding). One warm-up, then methods interleaved per prompt. Tables go
    to stderr; --report writes the JSON report; stdout stays empty unless --report -.
    See docs/benchmarks.md for every column.
    """
    from marscli.bench import (
        BenchConfig,
        parse_float_list,
        parse_int_list,
        parse_methods,
        run_bench,
    )

    log = _Log(quiet)
    try:
        if margin not in ("logit-ratio", "prob-ratio"):
            raise UsageError(f"--margin must be 'logit-ratio' or 'prob-ratio', got {margin!r}")
        if dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise UsageError(f"--dtype must be auto, float32, bfloat16 or float16, got {dtype!r}")
        kind, draft_model = parse_draft(draft)
        cfg = BenchConfig(
            input=input,
            methods=parse_methods(methods, parse_float_list(theta, "--theta")),
            target=ModelConfig(target, dtype, device),
            draft=DraftConfig(kind, draft_model, num_draft_tokens, adaptive=adaptive),
            draft_model=ModelConfig(draft_model, dtype, device) if draft_model else None,
            margin=margin,
            max_tokens=max_tokens,
            temperature=temperature,
            seeds=parse_int_list(seeds, "--seeds"),
            limit=limit,
            report=report,
            plot=plot,
        )
        console = Console(stderr=True, highlight=False, width=None if _stderr().is_terminal else 200)
        code = run_bench(cfg, log.info, console=console, quiet=quiet)
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


def run_generate(cfg: GenerateConfig, log: _Log) -> int:
    """Load models, generate every record, write results in input order. Returns the exit code."""
    from marscli.io import ResultWriter, find_duplicate_ids, read_requests
    from marscli.errors import InputError

    items = []
    for item in read_requests(cfg.input):
        if cfg.limit is not None and len(items) >= cfg.limit:
            break
        items.append(item)
    dup = find_duplicate_ids(items)
    if dup is not None:
        raise InputError(f"{cfg.input}: duplicate id {dup[0]!r} on lines {dup[1]} and {dup[2]}")
    if not items:
        log.info(f"{cfg.input}: no records; nothing to do")
        return EXIT_OK

    from marscli.engine import SpecEngine, build_drafter
    from marscli.models import check_vocab_compatible, load_model

    t_load = time.perf_counter()
    target = load_model(cfg.target, role="target", log=log.info)
    draft_loaded = None
    if cfg.draft_model is not None:
        draft_loaded = load_model(cfg.draft_model, role="draft", log=log.info)
        check_vocab_compatible(target, draft_loaded)
    log.info(f"loaded {target.identity.get('name')} on {target.device} in {time.perf_counter() - t_load:.1f} s")
    drafter = build_drafter(cfg.draft, target, draft_loaded)
    engine = SpecEngine(target, drafter, cfg.verify, cfg.draft)
    vdesc = cfg.verify.mode if cfg.verify.mode == "strict" else f"mars (theta={cfg.verify.theta:g}, {cfg.verify.margin})"
    log.info(f"drafter {cfg.draft.kind}{'' if cfg.draft.kind == 'none' else f' (K<={cfg.draft.num_draft_tokens})'}, verify {vdesc}")

    failed = 0
    totals = _Totals()
    progress = _Progress(log, len(items))
    writer = ResultWriter(cfg.output)
    try:
        for item in items:
            result, seconds = _run_one(engine, item, cfg)
            if result.get("error"):
                failed += 1
            else:
                totals.add(result, seconds)
            writer.write(item.index, result)
            progress.advance(result.get("usage", {}).get("completion_tokens", 0) if result.get("usage") else 0)
            if writer.broken_pipe:
                break
    except KeyboardInterrupt:
        progress.close()
        writer.close()
        log.info(f"interrupted: {writer.written} results written")
        return EXIT_INTERRUPTED
    progress.close()
    writer.close()
    if writer.broken_pipe:
        _silence_stdout()
        return EXIT_OK
    log.info(totals.summary(len(items), failed))
    return EXIT_RECORDS_FAILED if failed else EXIT_OK


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


def _run_one(engine, item, cfg: GenerateConfig) -> tuple[dict, float]:
    """One record -> (result line, seconds spent generating)."""
    import torch

    from marscli.config import RecordError
    from marscli.engine import RecordFailure

    id_key = item.id_key
    if isinstance(item, RecordError):
        return {id_key: item.id, "output": None, "error": item.as_error()}, 0.0
    try:
        sampling = cfg.sampling.with_overrides(item.overrides)
        res = engine.generate(item, sampling)
    except RecordFailure as e:
        return {id_key: item.id, "output": None, "error": {"type": e.type, "message": e.message, "line": item.line}}, 0.0
    except torch.cuda.OutOfMemoryError as e:  # pragma: no cover - needs a GPU
        torch.cuda.empty_cache()
        return {id_key: item.id, "output": None, "error": {"type": "out_of_memory", "message": str(e).splitlines()[0], "line": item.line}}, 0.0
    out = {
        id_key: item.id,
        "output": res.text,
        "finish_reason": res.finish_reason,
        "usage": {"prompt_tokens": res.prompt_tokens, "completion_tokens": res.completion_tokens},
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
    except KeyboardInterrupt:
        sys.exit(EXIT_INTERRUPTED)


if __name__ == "__main__":
    main()
