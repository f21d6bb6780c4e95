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
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Annotated, Any, Optional

import typer
from rich.console import Console

from marscli import __version__
from marscli.config import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_NUM_DRAFT_TOKENS,
    CalibrateConfig,
    PAPER_THETA,
    TREE_DEFAULTS,
    DraftConfig,
    GenerateConfig,
    ModelConfig,
    SamplingParams,
    VerifyRequest,
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
    # Under a launcher an error every rank shares is printed once, by the main process.
    if not getattr(err, "reported_elsewhere", False):
        _stderr().print(f"{_who()}: error: {err}", markup=False, soft_wrap=True)
    return typer.Exit(err.exit_code)


def _who() -> str:
    """'marscli', or 'marscli (rank N)' in a process other than the main one of a launch."""
    rank = os.environ.get("RANK", "0")
    if os.environ.get("WORLD_SIZE", "1") not in ("", "1") and rank not in ("", "0"):
        return f"marscli (rank {rank})"
    return "marscli"


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
    """'none' | 'ngram' | 'eagle3:PATH' | a model path or hub id -> (kind, model)."""
    if draft in ("none", "ngram"):
        return draft, None
    if draft.startswith("eagle3:"):
        head = draft[len("eagle3:"):]
        if not head:
            raise _fail(UsageError("--draft eagle3: needs the head's folder or hub id, e.g. "
                                   "--draft eagle3:./EAGLE3-LLaMA3.1-Instruct-8B"))
        return "eagle3", head
    return "model", draft


# Options shared by generate and calibrate (and later bench): one definition each.
TargetOpt = Annotated[
    Optional[str],
    typer.Option(help="Target model: local dir, .gguf file or hub id from the local cache. Default: embedded SmolLM2-135M-Instruct (or the --profile's target).", rich_help_panel=PANEL_MODEL),
]
DraftOpt = Annotated[
    Optional[str], typer.Option(help="Drafter: 'ngram' (prompt lookup, default), 'none' (plain decoding), a draft model path / hub id, or 'eagle3:PATH' (an EAGLE-3 head folder / hub id; see docs/drafters.md).", rich_help_panel=PANEL_DRAFT)
]
TreeDepthOpt = Annotated[
    Optional[int], typer.Option("--tree-depth", min=0, max=32, help="EAGLE-3 tree drafting: expansions after the first top-k (EAGLE's depth; paths hold up to depth+1 drafts). Any --tree-* option turns tree drafting on (default depth 7).", rich_help_panel=PANEL_DRAFT)
]
TreeTopKOpt = Annotated[
    Optional[int], typer.Option("--tree-top-k", min=1, max=64, help="EAGLE-3 tree drafting: children per expanded node and nodes expanded per level (default 10).", rich_help_panel=PANEL_DRAFT)
]
TreeTokensOpt = Annotated[
    Optional[int], typer.Option("--tree-tokens", min=2, max=1024, help="EAGLE-3 tree drafting: tokens per tree counting the root, i.e. tokens-1 draft nodes (EAGLE's total_token; default 60).", rich_help_panel=PANEL_DRAFT)
]
NumDraftOpt = Annotated[
    Optional[int], typer.Option("--num-draft-tokens", "-k", min=1, max=64, help=f"Most draft tokens per step (K); default {DEFAULT_NUM_DRAFT_TOKENS}.", rich_help_panel=PANEL_DRAFT)
]
AdaptiveOpt = Annotated[
    Optional[bool], typer.Option("--adaptive/--fixed-k", help="Adapt the draft length to how often drafts pass (deterministic cost model; default) or always draft K.", rich_help_panel=PANEL_DRAFT, show_default=False)
]
NgramMaxOpt = Annotated[Optional[int], typer.Option(min=1, max=16, help="Longest suffix n-gram to match (default 3).", rich_help_panel=PANEL_DRAFT)]
NgramMinOpt = Annotated[Optional[int], typer.Option(min=1, max=16, help="Shortest suffix n-gram to match (default 1).", rich_help_panel=PANEL_DRAFT)]
MarginOpt = Annotated[
    Optional[str], typer.Option(help="Margin statistic: 'logit-ratio' (z2/z1, the paper's; default) or 'prob-ratio' (p2/p1).", rich_help_panel=PANEL_VERIFY)
]
TemperatureOpt = Annotated[float, typer.Option(min=0.0, help="0 = greedy.", rich_help_panel=PANEL_SAMPLING)]
TopPOpt = Annotated[float, typer.Option(min=0.0, max=1.0, help="Nucleus sampling mass.", rich_help_panel=PANEL_SAMPLING)]
TopKOpt = Annotated[int, typer.Option(min=0, help="Top-k filter (0 = off).", rich_help_panel=PANEL_SAMPLING)]
SeedOpt = Annotated[int, typer.Option(min=0, help="Random seed (per record unless the record sets one).", rich_help_panel=PANEL_SAMPLING)]
MaxTokensOpt = Annotated[int, typer.Option(min=1, help="Most new tokens per record.", rich_help_panel=PANEL_SAMPLING)]
StopOpt = Annotated[Optional[list[str]], typer.Option(help="Stop string (repeatable).", rich_help_panel=PANEL_SAMPLING)]
DtypeOpt = Annotated[str, typer.Option(help="auto, float32, bfloat16 or float16.", rich_help_panel=PANEL_MODEL)]
DeviceOpt = Annotated[str, typer.Option(help="auto, cpu, cuda or cuda:N.", rich_help_panel=PANEL_MODEL)]
DeviceMapOpt = Annotated[Optional[str], typer.Option(help="'auto' to spread the target and the draft model over the GPUs (then the CPU) with accelerate, for models larger than one GPU; also balanced, balanced_low_0, sequential. Under a launcher each process takes its share of the machine's GPUs.", rich_help_panel=PANEL_MODEL)]
MaxMemoryOpt = Annotated[Optional[str], typer.Option(help="With a device map, the most the target may take per device, e.g. '0=20GiB,1=20GiB,cpu=64GiB' (implies --device-map auto).", rich_help_panel=PANEL_MODEL)]
Load8Opt = Annotated[bool, typer.Option(help="8-bit weights (bitsandbytes; CUDA, or --device cpu for its slow CPU backend). Applies to the draft model too.", rich_help_panel=PANEL_MODEL)]
Load4Opt = Annotated[bool, typer.Option(help="4-bit NF4 weights (bitsandbytes; CUDA, or --device cpu for its slow CPU backend). Applies to the draft model too.", rich_help_panel=PANEL_MODEL)]
BnbComputeOpt = Annotated[str, typer.Option("--bnb-compute-dtype", help="dtype of the 4-bit matmuls: auto (= --dtype), float32, bfloat16 or float16.", rich_help_panel=PANEL_MODEL)]
LimitOpt = Annotated[Optional[int], typer.Option(min=1, help="Only the first N records.", rich_help_panel=PANEL_OUTPUT)]
BatchSizeOpt = Annotated[int, typer.Option(
    "--batch-size", min=1, help="Records decoded together, each with its own drafts and acceptance; "
    "a finished record's place goes to the next one. Same outputs as 1 (the default).",
    rich_help_panel=PANEL_MODEL)]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress or notes on stderr.", rich_help_panel=PANEL_OUTPUT)]


def _check_choices(margin: str | None, dtype: str, ngram_min: int | None, ngram_max: int | None) -> None:
    if margin is not None and margin not in ("logit-ratio", "prob-ratio"):
        raise _fail(UsageError(f"--margin must be 'logit-ratio' or 'prob-ratio', got {margin!r}"))
    if (ngram_min or 1) > (ngram_max or 3):
        raise _fail(UsageError(f"--ngram-min ({ngram_min or 1}) must not exceed --ngram-max ({ngram_max or 3})"))
    if dtype not in ("auto", "float32", "bfloat16", "float16"):
        raise _fail(UsageError(f"--dtype must be auto, float32, bfloat16 or float16, got {dtype!r}"))


def _draft_config(draft: str | None, k: int | None, adaptive: bool | None, ngram_max: int | None,
                  ngram_min: int | None, profile_drafter: dict | None = None,
                  tree: tuple[int | None, int | None, int | None] = (None, None, None)) -> DraftConfig:
    """Command line > profile > defaults for the drafter. tree: --tree-depth, --tree-top-k,
    --tree-tokens as given (any of them turns EAGLE-3 tree drafting on)."""
    pd = profile_drafter or {}
    if draft is None and pd:
        if pd["kind"] == "model":
            draft = (pd["model"] or {}).get("source")
        elif pd["kind"] == "eagle3":
            draft = "eagle3:" + str((pd["model"] or {}).get("source"))
        else:
            draft = pd["kind"]
    kind, model = parse_draft(draft or "ngram")
    from_profile = bool(pd) and pd["kind"] == kind
    prof_tree = (pd.get("tree") or {}) if from_profile else {}
    if any(v is not None for v in tree) or prof_tree:
        if kind != "eagle3":
            raise _fail(UsageError("--tree-depth, --tree-top-k and --tree-tokens need an EAGLE-3 "
                                   "drafter (--draft eagle3:PATH)"))
        depth, top_k, tokens = (v if v is not None else prof_tree.get(key, default)
                                for v, key, default in zip(tree, ("depth", "top_k", "tokens"), TREE_DEFAULTS))
    else:
        depth = top_k = tokens = None

    def pick(cli, key, default):
        if cli is not None:
            return cli
        if from_profile and pd.get(key) is not None:
            return pd[key]
        return default

    return DraftConfig(
        kind, model,
        pick(k, "num_draft_tokens", DEFAULT_NUM_DRAFT_TOKENS),
        pick(ngram_max, "ngram_max", 3),
        pick(ngram_min, "ngram_min", 1),
        pick(adaptive, "adaptive", True),
        depth, top_k, tokens,
    )


def _model_configs(target: str | None, draft: DraftConfig, dtype: str, device: str,
                   device_map: str | None, load_in_8bit: bool, load_in_4bit: bool,
                   max_memory: str | None = None, bnb_compute_dtype: str = "auto"):
    """Target and draft model configs. --max-memory bounds the target only: the draft model,
    loaded after it, is placed by accelerate in the memory left (a device map of its own)."""
    from marscli.models import DEVICE_MAPS, parse_max_memory

    if device_map is not None and device_map not in DEVICE_MAPS:
        raise _fail(UsageError(f"--device-map must be one of {', '.join(DEVICE_MAPS)}, got {device_map!r}"))
    if bnb_compute_dtype not in ("auto", "float32", "bfloat16", "float16"):
        raise _fail(UsageError(f"--bnb-compute-dtype must be auto, float32, bfloat16 or float16, got {bnb_compute_dtype!r}"))
    pairs = None
    if max_memory is not None:
        try:
            pairs = parse_max_memory(max_memory)
        except ValueError as e:
            raise _fail(UsageError(f"--max-memory {e}")) from None
        device_map = device_map or "auto"
    tcfg = ModelConfig(target, dtype, device, device_map, load_in_8bit, load_in_4bit, pairs, bnb_compute_dtype)
    dcfg = (ModelConfig(draft.model, dtype, device, device_map, load_in_8bit, load_in_4bit, None, bnb_compute_dtype)
            if draft.model else None)
    return tcfg, dcfg


@app.command(
    epilog=(
        "Examples:\n\n"
        "  marscli generate prompts.jsonl > results.jsonl\n\n"
        "  marscli generate prompts.jsonl --profile smollm2-135m-instruct.ngram.float32\n\n"
        "  marscli generate prompts.jsonl --target ./Llama-3.1-8B-Instruct "
        "--draft ./Llama-3.2-1B-Instruct --verify mars --theta 0.9 -o results.jsonl\n\n"
        "  cat prompts.jsonl | marscli generate - --draft ngram | jq -r .output\n\n"
        "  marscli generate prompts.jsonl -o results.jsonl --resume   # finish an interrupted run\n\n"
        "  marscli generate prompts.jsonl --batch-size 8 -o results.jsonl   # 8 records at once\n\n"
        "  accelerate launch --multi_gpu --num_processes 8 -m marscli generate prompts.jsonl "
        "-o results.jsonl   # 8 GPUs, one merged file (docs/scaling.md)\n\n"
        "  marscli generate prompts.jsonl --target ./Llama-3.3-70B-Instruct --device-map auto "
        "--load-in-4bit   # larger than one GPU\n\n"
        + EXIT_CODES_HELP
    ),
)
def generate(
    input: Annotated[str, typer.Argument(help="JSONL file of records, or '-' for stdin.")],
    output: Annotated[
        Optional[str], typer.Option("-o", "--output", help="Write results here instead of stdout.", rich_help_panel=PANEL_OUTPUT)
    ] = None,
    target: TargetOpt = None,
    draft: DraftOpt = None,
    num_draft_tokens: NumDraftOpt = None,
    adaptive: AdaptiveOpt = None,
    ngram_max: NgramMaxOpt = None,
    ngram_min: NgramMinOpt = None,
    tree_depth: TreeDepthOpt = None,
    tree_top_k: TreeTopKOpt = None,
    tree_tokens: TreeTokensOpt = None,
    verify: Annotated[
        Optional[str], typer.Option(help="'strict' (exact) or 'mars' (relax at low-margin positions). Default: mars when a calibrated profile matches the target and drafter, else strict.", rich_help_panel=PANEL_VERIFY)
    ] = None,
    theta: Annotated[
        Optional[float], typer.Option(help=f"MARS threshold. Default: the profile's, else {PAPER_THETA} (the paper's).", rich_help_panel=PANEL_VERIFY)
    ] = None,
    margin: MarginOpt = None,
    profile: Annotated[
        Optional[str], typer.Option(help="Calibration profile (name or YAML path) to take theta, margin, target and drafter from. Default: the newest profile matching the loaded target and drafter.", rich_help_panel=PANEL_VERIFY)
    ] = None,
    no_profile: Annotated[
        bool, typer.Option("--no-profile", help="Do not pick a profile automatically.", rich_help_panel=PANEL_VERIFY)
    ] = False,
    temperature: TemperatureOpt = 0.0,
    top_p: TopPOpt = 1.0,
    top_k: TopKOpt = 0,
    seed: SeedOpt = 0,
    max_tokens: MaxTokensOpt = DEFAULT_MAX_TOKENS,
    stop: StopOpt = None,
    dtype: DtypeOpt = "auto",
    device: DeviceOpt = "auto",
    device_map: DeviceMapOpt = None,
    load_in_8bit: Load8Opt = False,
    load_in_4bit: Load4Opt = False,
    max_memory: MaxMemoryOpt = None,
    bnb_compute_dtype: BnbComputeOpt = "auto",
    limit: LimitOpt = None,
    timing: Annotated[
        bool, typer.Option("--timing/--no-timing", help="Include wall-clock timing in results (off: byte-identical reruns).", rich_help_panel=PANEL_OUTPUT)
    ] = True,
    token_ids: Annotated[
        bool, typer.Option("--token-ids", help="Include the generated token ids in results.", rich_help_panel=PANEL_OUTPUT)
    ] = False,
    quiet: QuietOpt = False,
    resume: Annotated[
        bool, typer.Option("--resume", help="Finish an interrupted run: keep the results already in -o FILE, append the missing ones. Refused if the settings differ.", rich_help_panel=PANEL_OUTPUT)
    ] = False,
    fail_fast: Annotated[
        bool, typer.Option("--fail-fast", help="Stop at the first record that fails (exit 3) instead of going on.", rich_help_panel=PANEL_OUTPUT)
    ] = False,
    truncate_prompt: Annotated[
        str, typer.Option("--truncate-prompt", help="A prompt too long for the context window: 'none' (error result) or 'left' (drop its oldest tokens to leave room for --max-tokens).", rich_help_panel=PANEL_SAMPLING)
    ] = "none",
    batch_size: BatchSizeOpt = 1,
) -> None:
    """Generate completions for a JSONL file of prompts with speculative decoding.

    Each input line is {"prompt": ...}, {"messages": [...]} (chat template applied), an OpenAI
    batch line (custom_id, body), or a prompt-set record (question_id, turns: first turn).
    Per-line max_tokens, temperature, top_p, top_k, seed and stop override the options.
    One JSON result per input line is written in input order.
    """
    if verify is not None and verify not in ("strict", "mars"):
        raise _fail(UsageError(f"--verify must be 'strict' or 'mars', got {verify!r}"))
    _check_choices(margin, dtype, ngram_min, ngram_max)
    if profile is not None and no_profile:
        raise _fail(UsageError("--profile and --no-profile exclude each other"))
    if truncate_prompt not in ("none", "left"):
        raise _fail(UsageError(f"--truncate-prompt must be 'none' or 'left', got {truncate_prompt!r}"))
    log = _Log(quiet)
    prof = None
    if profile is not None:
        from marscli.profiles import resolve_profile

        try:
            prof = resolve_profile(profile)
        except MarscliError as e:
            raise _fail(e)
        target = target if target is not None else prof.target_source
    draft_cfg = _draft_config(draft, num_draft_tokens, adaptive, ngram_max, ngram_min,
                              prof.data["drafter"] if prof is not None else None,
                              tree=(tree_depth, tree_top_k, tree_tokens))
    if draft_cfg.tree and batch_size > 1:
        raise _fail(UsageError("EAGLE-3 tree drafting runs one record at a time: drop --batch-size "
                               "or the --tree-* options (chain drafting batches)"))
    target_cfg, draft_model_cfg = _model_configs(target, draft_cfg, dtype, device, device_map, load_in_8bit, load_in_4bit,
                                                 max_memory, bnb_compute_dtype)
    cfg = GenerateConfig(
        input=input,
        output=output,
        target=target_cfg,
        draft=draft_cfg,
        draft_model=draft_model_cfg,
        verify=VerifyRequest(verify, theta, margin),
        sampling=SamplingParams(temperature, top_p, top_k, max_tokens, seed, tuple(stop or ())),
        limit=limit,
        timing=timing,
        token_ids=token_ids,
        profile=str(prof.path) if prof is not None else None,
        auto_profile=not no_profile,
        resume=resume,
        fail_fast=fail_fast,
        truncate_prompt=truncate_prompt,
        batch_size=batch_size,
    )
    try:
        code = run_generate(cfg, log)
    except MarscliError as e:
        raise _fail(e)
    raise typer.Exit(code)


PANEL_POLICY = "Choosing theta (one policy)"


@app.command(
    epilog=(
        "Examples:\n\n"
        "  marscli calibrate prompts.jsonl                       # embedded model, ngram drafter, "
        "--max-nll-increase 0.02\n\n"
        "  marscli calibrate prompts.jsonl --relax-rate 0.10 --plot calib.png\n\n"
        "  marscli calibrate prompts.jsonl --batch-size 8      # 8 records at once, same profile\n\n"
        "  torchrun --nproc_per_node 8 -m marscli calibrate prompts.jsonl   # 8 GPUs, one profile\n\n"
        "  marscli calibrate prompts.jsonl --target ./Qwen3-8B --draft ./Qwen3-0.6B "
        "--max-nll-increase 0.02 -o profiles/qwen3-8b.yaml\n\n"
        "Exit codes: 0 profile written; 1 runtime failure; 2 usage, configuration or model error; "
        "3 profile written but some records failed; 130 interrupted."
    ),
)
def calibrate(
    input: Annotated[str, typer.Argument(help="JSONL calibration prompts (same formats as generate), or '-'.")],
    output: Annotated[
        Optional[str], typer.Option("-o", "--output", help="Profile file to write ('-': stdout). Default: NAME.yaml in the user profile dir, where generate finds it.", rich_help_panel=PANEL_OUTPUT)
    ] = None,
    name: Annotated[Optional[str], typer.Option(help="Profile name. Default: target.drafter.dtype.", rich_help_panel=PANEL_OUTPUT)] = None,
    max_nll_increase: Annotated[
        Optional[float], typer.Option(min=0.0, help="Policy (default, 0.02): the most relaxing theta whose estimated cost stays within EPS nats of target log-probability per token.", rich_help_panel=PANEL_POLICY)
    ] = None,
    relax_rate: Annotated[
        Optional[float], typer.Option(min=0.0, max=1.0, help="Policy: theta at which this share of verified draft positions is relaxable.", rich_help_panel=PANEL_POLICY)
    ] = None,
    theta: Annotated[Optional[float], typer.Option(help="Policy: a fixed theta (e.g. the paper's 0.9), recorded as such.", rich_help_panel=PANEL_POLICY)] = None,
    margin: MarginOpt = None,
    target: TargetOpt = None,
    draft: DraftOpt = None,
    num_draft_tokens: NumDraftOpt = None,
    adaptive: AdaptiveOpt = None,
    ngram_max: NgramMaxOpt = None,
    ngram_min: NgramMinOpt = None,
    tree_depth: TreeDepthOpt = None,
    tree_top_k: TreeTopKOpt = None,
    tree_tokens: TreeTokensOpt = None,
    temperature: TemperatureOpt = 0.0,
    top_p: TopPOpt = 1.0,
    top_k: TopKOpt = 0,
    seed: SeedOpt = 0,
    max_tokens: MaxTokensOpt = DEFAULT_MAX_TOKENS,
    stop: StopOpt = None,
    dtype: DtypeOpt = "auto",
    device: DeviceOpt = "auto",
    device_map: DeviceMapOpt = None,
    load_in_8bit: Load8Opt = False,
    load_in_4bit: Load4Opt = False,
    max_memory: MaxMemoryOpt = None,
    bnb_compute_dtype: BnbComputeOpt = "auto",
    limit: LimitOpt = None,
    batch_size: BatchSizeOpt = 1,
    plot: Annotated[Optional[str], typer.Option(help="Also draw the histogram and the curve to this PNG (needs matplotlib).", rich_help_panel=PANEL_OUTPUT)] = None,
    quiet: QuietOpt = False,
) -> None:
    """Measure the target's margins over prompts and write a profile with a calibrated theta.

    Runs the target with the drafter under strict verification, records the margin statistics
    at every verified draft position, replays each step under MARS for a grid of theta, and
    picks theta by one policy. generate then finds the profile for this target and drafter.
    """
    from marscli.calibrate import DEFAULT_MAX_NLL_INCREASE
    from marscli.profiles import POLICY_FIXED, POLICY_MAX_NLL, POLICY_RELAX_RATE

    _check_choices(margin, dtype, ngram_min, ngram_max)
    chosen = [(n, v) for n, v in ((POLICY_MAX_NLL, max_nll_increase), (POLICY_RELAX_RATE, relax_rate),
                                  (POLICY_FIXED, theta)) if v is not None]
    if len(chosen) > 1:
        raise _fail(UsageError("give one policy: --max-nll-increase, --relax-rate or --theta "
                               f"(got {', '.join('--' + n if n != POLICY_FIXED else '--theta' for n, _ in chosen)})"))
    policy, value = chosen[0] if chosen else (POLICY_MAX_NLL, DEFAULT_MAX_NLL_INCREASE)
    if theta is not None and not math.isfinite(theta):
        raise _fail(UsageError("--theta must be a finite number"))
    draft_cfg = _draft_config(draft, num_draft_tokens, adaptive, ngram_max, ngram_min,
                              tree=(tree_depth, tree_top_k, tree_tokens))
    if draft_cfg.tree and batch_size > 1:
        raise _fail(UsageError("EAGLE-3 tree drafting runs one record at a time: drop --batch-size "
                               "or the --tree-* options (chain drafting batches)"))
    if draft_cfg.kind == "none":
        raise _fail(UsageError("calibrate needs a drafter: --draft ngram or a draft model"))
    target_cfg, draft_model_cfg = _model_configs(target, draft_cfg, dtype, device, device_map, load_in_8bit, load_in_4bit,
                                                 max_memory, bnb_compute_dtype)
    cfg = CalibrateConfig(
        input=input, output=output, name=name, target=target_cfg, draft=draft_cfg,
        draft_model=draft_model_cfg, margin=margin or "logit-ratio", policy=policy,
        policy_value=float(value),
        sampling=SamplingParams(temperature, top_p, top_k, max_tokens, seed, tuple(stop or ())),
        limit=limit, plot=plot, batch_size=batch_size,
    )
    try:
        code = run_calibrate(cfg, _Log(quiet))
    except MarscliError as e:
        raise _fail(e)
    raise typer.Exit(code)


profile_app = typer.Typer(help="List, show and validate calibration profiles.", no_args_is_help=True)
app.add_typer(profile_app, name="profile")


@profile_app.command("list")
def profile_list() -> None:
    """Profiles in the user profile dir and the packaged ones, in search order."""
    from rich.table import Table

    from marscli.profiles import ProfileError, iter_profile_files, load_profile, profile_dirs

    table = Table(title="search order: " + ", ".join(str(d) for d in profile_dirs()), title_justify="left")
    for col in ("name", "target", "dtype", "drafter", "margin", "theta", "policy", "file"):
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
                      drafter, p.margin, f"{p.theta:.6g}", f"{d['policy']['name']} {d['policy']['value']:g}", str(f))
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
    from marscli.profiles import resolve_profile

    try:
        p = resolve_profile(name)
        _show_profile(p, Console(highlight=False))
        if plot:
            from marscli.calibrate import plot_profile

            plot_profile(p.data, plot)
    except MarscliError as e:
        raise _fail(e) from None


@profile_app.command("validate")
def profile_validate(files: Annotated[list[str], typer.Argument(help="Profile YAML files.")]) -> None:
    """Check profile files against the schema; exit 2 naming the file and key of the first problem."""
    from marscli.profiles import load_profile

    code = 0
    for f in files:
        try:
            p = load_profile(f)
        except MarscliError as e:
            _stderr().print(f"marscli: error: {e}", markup=False, soft_wrap=True)
            code = e.exit_code
            continue
        print(f"{f}: ok (profile {p.name}, theta {p.theta:.6g}, sha256 {p.short_hash})")
    raise typer.Exit(code)


def _show_profile(p, con: Console) -> None:
    from marscli.calibrate import curve_table, histogram_text

    d = p.data
    s = d["summary"]
    cd = d["calibration_data"]
    con.print(f"profile {p.describe()}  sha256 {p.short_hash}", markup=False)
    con.print(f"target {d['target']['name']} ({d['target']['dtype']}, {d['target']['device_type']}); "
              f"drafter {d['drafter']['kind']} K<={d['drafter']['num_draft_tokens']}", markup=False)
    con.print(f"theta {p.theta:.6g} ({p.margin}) by {d['policy']['name']} {d['policy']['value']:g}; "
              f"calibrated on {cd['file']}: {cd['records']} records, {cd['tokens']} tokens, "
              f"{cd['positions']} verified draft positions", markup=False)
    con.print(f"estimated: tau strict {s['tau_strict']:.3f} -> mars {s['tau_mars']:.3f}, relaxable "
              f"{s['relaxable_share']:.3f}, relaxed {s['relaxed_share']:.3f}/token, NLL +{s['nll_increase']:.4f} nats/token",
              markup=False)
    con.print(histogram_text(d["histogram"], p.theta), markup=False, highlight=False)
    con.print(curve_table(d, "trade-off curve (replayed on the calibration run)"))


# --------------------------------------------------------------------------- bench


@app.command(
    epilog=(
        "Examples:\n\n"
        "  marscli bench ../shared/data/prompts/sum.jsonl --limit 20 --max-tokens 128 "
        "--methods hf-generate,hf-assisted,ar,strict,mars --theta 0.85,0.9,0.95 --report bench.json\n\n"
        "  marscli bench prompts.jsonl --profile smollm2-135m-instruct.ngram.float32 --plot bench.png\n\n"
        "  marscli bench prompts.jsonl --target ./Llama-3.1-8B-Instruct --draft ./Llama-3.2-1B-Instruct "
        "--temperature 1.0 --seeds 0,1,2\n\n"
        "  marscli bench prompts.jsonl --report - | jq .methods\n\n"
        "Exit codes: 0 done; 1 a correctness check failed (greedy ar or strict output differs from "
        "hf-generate's; the report is still written) or a runtime failure; 2 usage, model or profile "
        "error; 130 interrupted."
    ),
)
def bench(
    input: Annotated[str, typer.Argument(help="JSONL file of prompts (any format generate reads), or '-' for stdin.")],
    methods: Annotated[
        Optional[str], typer.Option(help="Comma-separated: hf-generate, hf-assisted, ar, strict, mars (one per theta); with an EAGLE-3 drafter also strict-tree, mars-tree (tree drafting). Default: hf-generate,hf-assisted,ar,strict,mars; with --draft eagle3:... hf-generate,ar,strict,strict-tree,mars,mars-tree.", rich_help_panel=PANEL_VERIFY)
    ] = None,
    theta: Annotated[
        Optional[str], typer.Option(help=f"MARS thresholds, comma-separated. Default: the --profile's theta, else {PAPER_THETA} (the paper's).", rich_help_panel=PANEL_VERIFY)
    ] = None,
    profile: Annotated[
        Optional[str], typer.Option(help="Calibration profile (name or path): adds its theta (and supplies margin, target and drafter unless given).", rich_help_panel=PANEL_VERIFY)
    ] = None,
    margin: MarginOpt = None,
    target: TargetOpt = None,
    draft: DraftOpt = None,
    num_draft_tokens: NumDraftOpt = None,
    adaptive: AdaptiveOpt = None,
    tree_depth: TreeDepthOpt = None,
    tree_top_k: TreeTopKOpt = None,
    tree_tokens: TreeTokensOpt = None,
    temperature: Annotated[float, typer.Option(min=0.0, help="0 = greedy; the same for every method.", rich_help_panel=PANEL_SAMPLING)] = 0.0,
    seeds: Annotated[
        str, typer.Option(help="Comma-separated seeds; with --temperature > 0 every method runs once per seed.", rich_help_panel=PANEL_SAMPLING)
    ] = "0",
    max_tokens: Annotated[int, typer.Option(min=1, help="Most new tokens per prompt, for every method.", rich_help_panel=PANEL_SAMPLING)] = 128,
    dtype: DtypeOpt = "auto",
    device: DeviceOpt = "auto",
    limit: LimitOpt = None,
    batch_size: Annotated[
        Optional[str], typer.Option("--batch-size", help="Also measure batched throughput at these batch sizes, comma-separated (e.g. 1,4,8,16): hf-generate, ar, strict and mars each decode all prompts at each size.", rich_help_panel=PANEL_SAMPLING)
    ] = None,
    report: Annotated[
        Optional[str], typer.Option(help="Write the full JSON report here ('-': stdout).", rich_help_panel=PANEL_OUTPUT)
    ] = None,
    plot: Annotated[
        Optional[str], typer.Option(help="Write a PNG of speedup against quality per method and theta (needs matplotlib).", rich_help_panel=PANEL_OUTPUT)
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
        DEFAULT_EAGLE3_METHODS,
        DEFAULT_METHODS,
        BenchConfig,
        parse_float_list,
        parse_int_list,
        parse_methods,
        run_bench,
    )

    log = _Log(quiet)
    try:
        from marscli.distributed import launch_from_env

        if launch_from_env() is not None:
            raise UsageError("bench times methods against each other in one process: run it "
                             "without a launcher (accelerate launch, torchrun)")
        _check_choices(margin, dtype, None, None)
        prof = None
        if profile is not None:
            from marscli.profiles import resolve_profile

            prof = resolve_profile(profile)
            target = target if target is not None else prof.target_source
            margin = margin or prof.margin
        thetas = parse_float_list(theta, "--theta") if theta is not None else ()
        if prof is not None and prof.theta not in thetas:
            thetas = (*thetas, prof.theta)
        draft_cfg = _draft_config(draft, num_draft_tokens, adaptive, None, None,
                                  prof.data["drafter"] if prof is not None else None,
                                  tree=(tree_depth, tree_top_k, tree_tokens))
        if methods is None:
            methods = DEFAULT_EAGLE3_METHODS if draft_cfg.kind == "eagle3" else DEFAULT_METHODS
        cfg = BenchConfig(
            input=input,
            methods=parse_methods(methods, thetas or (PAPER_THETA,)),
            target=ModelConfig(target, dtype, device),
            draft=draft_cfg,
            draft_model=ModelConfig(draft_cfg.model, dtype, device) if draft_cfg.model else None,
            margin=margin or "logit-ratio",
            max_tokens=max_tokens,
            temperature=temperature,
            seeds=parse_int_list(seeds, "--seeds"),
            limit=limit,
            report=report,
            plot=plot,
            batch_sizes=parse_int_list(batch_size, "--batch-size") if batch_size is not None else (),
        )
        if prof is not None:
            log.info(f"using profile {prof.describe()}: theta {prof.theta:.6g} ({prof.margin})")
        console = Console(stderr=True, highlight=False, width=None if _stderr().is_terminal else 200)
        code = run_bench(cfg, log.info, console=console, quiet=quiet)
    except MarscliError as e:
        raise _fail(e) from None
    raise typer.Exit(code)


# --------------------------------------------------------------------------- generate


class _Log:
    """Narration on stderr; silent with --quiet."""

    def __init__(self, quiet: bool):
        self.quiet = quiet
        self.muted = False
        self.notes = not quiet
        self.console = _stderr()

    def mute(self) -> None:
        """Processes other than the main one of a launch say nothing but errors and notes about
        their own records: the main process speaks for the run."""
        self.notes = not self.quiet
        self.quiet = self.muted = True

    def note(self, msg: str) -> None:
        """A note about one record, which only the process that ran it knows."""
        if self.notes:
            self.console.print(f"{_who()}: {msg}", markup=False, soft_wrap=True)

    def info(self, msg: str) -> None:
        if not self.quiet:
            self.always(msg)

    def always(self, msg: str) -> None:
        """What the user must see even with --quiet (how to finish an interrupted run)."""
        if not self.muted:
            self.console.print(f"marscli: {msg}", markup=False, soft_wrap=True)


class _Progress:
    """A rich bar on a terminal, a plain line every few seconds otherwise, nothing if quiet."""

    PLAIN_EVERY_S = 10.0

    def __init__(self, log: _Log, total: int, label: str = "generating"):
        self.log = log
        self.total = total
        self.done = 0
        self.tokens = 0
        self.t0 = time.perf_counter()
        self.last = self.t0
        self.bar = None
        self._lock = threading.Lock()
        if not log.quiet and log.console.is_terminal:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(
                TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                TextColumn("{task.fields[rate]}"), console=log.console, redirect_stdout=False,
                redirect_stderr=False, transient=True,
            )
            self.task = self.bar.add_task("gen", total=total, rate="")
            self.bar.start()

    def advance(self, tokens: int) -> None:
        self.set(self.done + 1, self.tokens + tokens)

    def set(self, done: int, tokens: int) -> None:
        """Absolute progress (a data-parallel run's counters, summed over its processes)."""
        with self._lock:
            self._show(done, tokens)

    def _show(self, done: int, tokens: int) -> None:
        advance = done - self.done
        if advance <= 0:
            return
        self.done = done
        self.tokens = tokens
        now = time.perf_counter()
        rate = self.tokens / max(now - self.t0, 1e-9)
        if self.bar is not None:
            self.bar.update(self.task, advance=advance, rate=f"{rate:.1f} tok/s")
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


def _start_group(log: _Log, input_path: str):
    """The process group of a launched run (accelerate launch, torchrun), or None alone."""
    from marscli.distributed import Group, launch_from_env

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


def _place(model: ModelConfig | None, group) -> ModelConfig | None:
    """This rank's device: cuda:LOCAL_RANK for --device auto/cuda, its share of the GPUs for
    --device-map."""
    if model is None or group is None:
        return model
    import dataclasses

    from marscli.distributed import place_device, rank_max_memory
    from marscli.models import max_memory_dict

    if model.device_map is not None:
        share = rank_max_memory(group.launch, max_memory_dict(model.max_memory))
        pairs = None if share is None else tuple((str(k), v) for k, v in share.items())
        return dataclasses.replace(model, max_memory=pairs)
    return dataclasses.replace(model, device=place_device(model.device, group.launch))


def run_generate(cfg: GenerateConfig, log: _Log) -> int:
    """Read, load, generate, write results in input order. Returns the exit code.

    Ctrl-C, SIGTERM and a closed stdout end the run cleanly: every finished result is on
    disk (or sent) before the exit, and with -o FILE the run can be finished with --resume.
    Under a launcher (WORLD_SIZE > 1) each process generates its shard into its own part file
    and the main process merges them (marscli.distributed).
    """
    group = _start_group(log, cfg.input)
    try:
        with _StopSignals() as signals:
            run = _GenerateRun(cfg, log, signals, group)
            try:
                return run.execute()
            except (_Stop, KeyboardInterrupt) as e:
                signals.stopping = True
                return run.interrupted(e.signum if isinstance(e, _Stop) else signal.SIGINT)
            except MarscliError as e:
                raise run.with_resume_hint(e) from None
            finally:
                run.close()
                if run.output is not None:
                    run.output.close()  # after the merge: the output is this run's until now
    finally:
        if group is not None:
            group.close()


class _GenerateRun:
    """One `marscli generate` run; holds what the cleanup paths need to report."""

    def __init__(self, cfg: GenerateConfig, log: _Log, signals: _StopSignals, group=None):
        self.cfg = cfg
        self.log = log
        self.signals = signals
        self.group = group  # marscli.distributed.Group under a launcher, else None
        self.output = None  # marscli.io.RunOutput
        self.writer = None  # marscli.io.ResultWriter, once the output is open
        self.progress: _Progress | None = None
        self.total = 0
        self.done_before = 0

    def execute(self) -> int:
        from marscli.distributed import ids_digest, solo_step
        from marscli.io.records import read_input
        from marscli.io.resume import RunOutput
        from marscli.jobs.fingerprint import LOADED_COMPONENTS, run_fingerprint

        cfg, log, group = self.cfg, self.log, self.group
        step = group.step if group is not None else solo_step
        # Everything that can be checked without the models is checked before loading them.
        with step("reading the input") as s:
            self.output = output = RunOutput(cfg.output, resume=cfg.resume, input_path=cfg.input,
                                             lock=group is None or group.is_main)
            items, input_sha = read_input(cfg.input, limit=cfg.limit,
                                          digest=output.path is not None or group is not None)
            # "profile" is known once the target is loaded (a profile matches the loaded weights).
            extra = {"input": {"sha256": input_sha}, "profile": None}
            if items:
                output.check(run_fingerprint(cfg, None, None, extra), ignore=LOADED_COMPONENTS)
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

        from marscli.engine import build_engine
        from marscli.profiles import resolve_verification

        with step("loading the models") as s:
            target, draft_loaded = _load_models(cfg.target, cfg.draft_model, log, group, cfg.draft.kind)
            prof = _choose_profile(cfg, target, draft_loaded, log)
            verify_cfg = resolve_verification(cfg.verify, prof, log.info)
            extra["profile"] = prof.reference() if prof is not None else None
            fingerprint = run_fingerprint(
                cfg, target.identity, draft_loaded.identity if draft_loaded else None, extra,
                verify=verify_cfg,
            )
            engine = build_engine(target, draft_loaded, verify_cfg, cfg.draft, cfg.batch_size)
            if cfg.batch_size > 1:
                log.info(f"batch size {cfg.batch_size}")
            s.value = fingerprint
        if group is not None:
            self._check_same_run(s.values)
        vdesc = verify_cfg.mode if verify_cfg.mode == "strict" else f"mars (theta={verify_cfg.theta:g}, {verify_cfg.margin})"
        log.info(f"drafter {_drafter_desc(cfg.draft)}, verify {vdesc}")
        spec_meta = {
            "drafter": cfg.draft.kind,
            "verify": verify_cfg.mode,
            "theta": None if verify_cfg.mode == "strict" else verify_cfg.theta,
            "margin": verify_cfg.margin,
            "profile": extra["profile"],
        }

        if group is None:
            self.writer = writer = output.open(fingerprint, items)
            mine = todo
        else:
            writer, mine = self._open_parts(fingerprint, todo)
        failed = sum(done.values())  # earlier results that are errors count too
        totals = _Totals()
        self.progress = _Progress(log, len(todo))
        t_start = time.perf_counter()
        if cfg.batch_size > 1:
            results = _run_batched(engine, mine, cfg, spec_meta)
        else:
            results = ((item, *_run_one(engine, item, cfg, spec_meta)) for item in mine)
        pump = contextlib.nullcontext()
        if group is not None and group.is_main and not log.quiet:
            from marscli.distributed import ProgressPump

            pump = ProgressPump(group, self.progress.set)
        with pump:
            for item, result, seconds in results:
                error = result.get("error")
                if error:
                    failed += 1
                    if error["type"] in (ERR_GENERATION_FAILED, ERR_OUT_OF_MEMORY):
                        self._say(f"record {item.id!r} (line {item.line}) failed: {error['message']}")
                else:
                    totals.add(result, seconds)
                with self.signals.deferred():
                    writer.write(item.index, result)
                tokens = result["usage"]["completion_tokens"] if result.get("usage") else 0
                if group is not None:
                    group.add_progress(1, tokens)
                else:
                    self.progress.advance(tokens)
                if writer.broken_pipe:
                    # The reader went away (`| head`): stop quietly, nothing left to say.
                    self.close()
                    _silence_stdout()
                    return EXIT_OK
                if error and cfg.fail_fast:
                    stop = {"id": item.id, "line": item.line, "type": error["type"],
                            "message": error["message"]}
                    if group is None:
                        self.close()
                        log.always(_fail_fast_note(stop))
                        return EXIT_RECORDS_FAILED
                    group.request_stop(stop)
                    break
                if group is not None and cfg.fail_fast and group.stop_requested():
                    break
            if group is not None:
                return self._finish_group(items, todo, totals, failed - sum(done.values()), t_start)
        self.close()
        if output.needs_merge(items):
            output.merge(items)  # a resume over part files, or over an output with gaps
        if cfg.batch_size > 1:
            totals.wall = time.perf_counter() - t_start
        earlier = f"; {self.done_before} more were done before resuming" if self.done_before else ""
        log.info(totals.summary(len(todo), failed - sum(done.values())) + earlier)
        return EXIT_RECORDS_FAILED if failed else EXIT_OK

    # ------------------------------------------------------------------ data parallel

    def _say(self, msg: str) -> None:
        """A note about one record: every rank says it about its own records (with its rank)."""
        self.log.note(msg)

    def _check_same_run(self, fingerprints: list[dict]) -> None:
        from marscli.io.resume import fingerprint_diff

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
        from marscli.distributed import shard

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

    def _finish_group(self, items: list, todo: list, totals: _Totals, failed_now: int,
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
            _silence_stdout()
            return EXIT_OK
        stop = group.stop_requested()
        if stop is not None:
            log.always(_fail_fast_note(stop) + (
                f"; the finished results are in {output.path}: rerun with --resume to go on"
                if output.path is not None else ""))
            return EXIT_RECORDS_FAILED
        if report.missing:  # pragma: no cover - every rank finished its shard
            raise MarscliError(f"{len(report.missing)} records have no result (e.g. id "
                               f"{report.missing[0]!r})")
        summed = _Totals.summed([p["totals"] for p in parts], wall)
        earlier = f"; {self.done_before} more were done before resuming" if self.done_before else ""
        log.info(summed.summary(len(todo), sum(p["failed"] for p in parts)) + earlier
                 + f" ({group.world_size} processes)")
        return EXIT_RECORDS_FAILED if report.failed else EXIT_OK

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


def _fail_fast_note(stop: dict) -> str:
    return (f"stopped at the first failed record (--fail-fast): id {stop['id']!r}, "
            f"line {stop['line']}: {stop['type']}: {stop['message']}")


def run_calibrate(cfg: CalibrateConfig, log: _Log) -> int:
    """Collect margins under strict verification, choose theta, write and show the profile.

    Under a launcher each process collects the margins of its shard of the records; the main
    process gathers them, merges them in input order (so the profile is the one a single
    process computes) and alone writes the profile.
    """
    group = _start_group(log, cfg.input)
    try:
        return _calibrate(cfg, log, group)
    finally:
        if group is not None:
            group.close()


def _calibrate(cfg: CalibrateConfig, log: _Log, group) -> int:
    from marscli.calibrate import MarginCollector, analyse, build_profile, plot_profile
    from marscli.config import RecordError, VerifyConfig
    from marscli.distributed import shard, solo_step
    from marscli.engine import build_engine
    from marscli.engine.sequence import RecordFailure
    from marscli.errors import InputError
    from marscli.io.records import read_input
    from marscli.profiles import default_profile_name, identity_for_profile, save_profile, user_profile_dir

    step = group.step if group is not None else solo_step
    with step("reading the input") as s:
        items, input_sha = read_input(cfg.input, limit=cfg.limit, digest=True)
        if not items:
            raise InputError(f"{cfg.input}: no records to calibrate on")
        s.value = (input_sha, len(items))
    if group is not None and len(set(s.values)) > 1:
        raise group.fail_all("the processes read different inputs: every process must see the "
                             "same input file")

    with step("loading the models") as s:
        target, draft_loaded = _load_models(cfg.target, cfg.draft_model, log, group, cfg.draft.kind)
        engine = build_engine(target, draft_loaded, VerifyConfig(), cfg.draft, cfg.batch_size)
        batch = engine if cfg.batch_size > 1 else None
        s.value = (identity_for_profile(target.identity),
                   identity_for_profile(draft_loaded.identity) if draft_loaded else None)
    if group is not None and any(v != s.values[0] for v in s.values):
        differ = [r for r, v in enumerate(s.values) if v != s.values[0]]
        raise group.fail_all(f"rank(s) {', '.join(map(str, differ))} loaded other models (or "
                             "dtype, quantization, device type) than rank 0")

    mine = items if group is None else shard(items, group.rank, group.world_size)
    collector = MarginCollector()
    # One collector per record, merged in input order: the profile does not depend on the
    # batch size or on how many processes shared the records.
    per_record: dict[int, MarginCollector] = {}
    progress = _Progress(log, len(items), label="calibrating")
    failed = 0
    t0 = time.perf_counter()

    def tick(tokens: int) -> None:
        if group is not None:
            group.add_progress(1, tokens)
        else:
            progress.advance(tokens)

    def skipped(item, message: str) -> None:
        nonlocal failed
        failed += 1
        log.note(f"{cfg.input}:{item.line}: skipped: {message}")
        tick(0)

    pump = contextlib.nullcontext()
    if group is not None and group.is_main and not log.quiet:
        from marscli.distributed import ProgressPump

        pump = ProgressPump(group, progress.set)
    try:
        with pump:
            if batch is not None:
                def observer_for(item):
                    per_record[item.index] = MarginCollector()  # a restart starts afresh
                    return per_record[item.index]

                valid = []
                for item in mine:
                    if isinstance(item, RecordError):
                        skipped(item, item.message)
                    else:
                        valid.append(item)
                prepare = lambda it: (engine.encode(it), cfg.sampling.with_overrides(it.overrides))  # noqa: E731
                for item, res in batch.run(valid, prepare, observer_for=observer_for):
                    if isinstance(res, RecordFailure):
                        per_record.pop(item.index, None)
                        skipped(item, res.message)
                    elif isinstance(res, BaseException):
                        raise res
                    else:
                        tick(res.completion_tokens)
            else:
                for item in mine:
                    if isinstance(item, RecordError):
                        skipped(item, item.message)
                        continue
                    per_record[item.index] = observer = MarginCollector()
                    try:
                        res = engine.generate(item, cfg.sampling.with_overrides(item.overrides), observer=observer)
                    except RecordFailure as e:
                        per_record.pop(item.index, None)
                        skipped(item, e.message)
                        continue
                    tick(res.completion_tokens)
            if group is not None:
                group.mark_done({"failed": failed})
                group.wait_all_done()
    except KeyboardInterrupt:
        progress.close()
        log.info("interrupted: no profile written")
        return EXIT_INTERRUPTED
    if group is not None:
        gathered = group.gather((per_record, failed), "gathering the margins")
        if gathered is None:
            return EXIT_OK  # the main process writes the profile
        per_record = {i: c for part, _ in gathered for i, c in part.items()}
        failed = sum(f for _, f in gathered)
    for index in sorted(per_record):
        collector.extend(per_record[index])
    progress.close()
    seconds = time.perf_counter() - t0
    data = collector.data(records=len(items) - failed, failed=failed)
    if data.positions == 0:
        raise MarscliError(f"{cfg.input}: the drafter proposed no tokens on these prompts, so there "
                           "are no margins to calibrate on (try --fixed-k, more or longer prompts, or another drafter)")
    cal = analyse(data, cfg.margin, cfg.policy, cfg.policy_value, seconds)
    ident = target.identity
    name = cfg.name or default_profile_name(
        str(ident.get("name")), cfg.draft.kind, draft_loaded.identity.get("name") if draft_loaded else None,
        str(ident.get("dtype")), ident.get("quantization"))
    doc = build_profile(
        name=name, cal=cal, data=data, target_identity=ident, draft_cfg=cfg.draft,
        draft_identity=draft_loaded.identity if draft_loaded else None, sampling=cfg.sampling,
        input_name="-" if cfg.input == "-" else os.path.basename(cfg.input),
        input_sha256=input_sha, seconds=seconds,
    )
    from marscli.profiles import dump_profile, parse_profile

    if cfg.output == "-":
        text = dump_profile(doc)
        prof = parse_profile(text, "<stdout>")
        sys.stdout.write(text)
        sys.stdout.flush()
    else:
        out = cfg.output or str(user_profile_dir() / f"{name}.yaml")
        existed = os.path.exists(out)
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        prof = save_profile(doc, out)
        log.info(f"{'replaced' if existed else 'wrote'} profile {out}")
    if not log.quiet:
        _show_profile(prof, log.console)
    if cfg.plot:
        plot_profile(doc, cfg.plot)
        log.info(f"wrote plot {cfg.plot}")
    if failed:
        log.info(f"{failed} of {len(items)} records failed and were left out")
    return EXIT_RECORDS_FAILED if failed else EXIT_OK


def _drafter_desc(d: DraftConfig) -> str:
    if d.kind == "none":
        return "none"
    if d.tree:
        return f"{d.kind} tree (depth {d.tree_depth}, top-k {d.tree_top_k}, {d.tree_tokens} tokens)"
    return f"{d.kind} (K<={d.num_draft_tokens})"


def _load_models(target_cfg: ModelConfig, draft_cfg: ModelConfig | None, log: _Log, group=None,
                 kind: str = "model"):
    """Load the target and (if any) the draft model or EAGLE-3 head (kind "eagle3"); check
    that they fit each other. Under a launcher each model goes to this rank's device(s), the
    draft model's share reckoned with the memory the target left."""
    from marscli.models import check_vocab_compatible, load_model

    t0 = time.perf_counter()
    target = load_model(_place(target_cfg, group), role="target", log=log.info)
    draft = None
    if draft_cfg is not None and kind == "eagle3":
        from marscli.eagle3 import load_head

        draft = load_head(str(draft_cfg.source), target, log=log.info)
    elif draft_cfg is not None:
        draft = load_model(_place(draft_cfg, group), role="draft", log=log.info)
        check_vocab_compatible(target, draft)
    log.info(f"loaded {target.identity.get('name')} on {target.device} in {time.perf_counter() - t0:.1f} s")
    return target, draft


def _choose_profile(cfg: GenerateConfig, target, draft_loaded, log: _Log):
    """The profile generate runs with: the one asked for, else the newest matching one."""
    from marscli.profiles import (
        drafter_description,
        find_matching_profile,
        load_profile,
        match_problems,
    )

    drafter = drafter_description(cfg.draft.kind, draft_loaded.identity if draft_loaded else None)
    if cfg.profile is not None:
        prof = load_profile(cfg.profile)
        problems = match_problems(prof, target.identity, drafter)
        if problems is None:
            log.info(f"warning: profile {prof.describe()} was calibrated for other weights or another "
                     "drafter; using it because you asked")
        elif problems:
            log.info(f"warning: profile {prof.describe()} was calibrated with {'; '.join(problems)}")
        log.info(f"using profile {prof.describe()} (sha256 {prof.short_hash})")
        return prof
    if not cfg.auto_profile or cfg.draft.kind == "none":
        return None
    prof = find_matching_profile(target.identity, drafter, note=log.info)
    if prof is not None:
        log.info(f"using profile {prof.describe()} (sha256 {prof.short_hash}), matched to the target")
    elif cfg.verify.mode is None:
        log.info("no calibrated profile for this target and drafter: verifying strictly "
                 "(run `marscli calibrate` to make one)")
    return prof


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
        self.wall: float | None = None  # batched runs: records overlap, so rate = tokens / wall time

    def add(self, r: dict, seconds: float) -> None:
        self.records += 1
        self.tokens += r["usage"]["completion_tokens"]
        self.seconds += seconds
        s = r["spec"]
        self.steps += s["steps"]
        self.accepted += s["accepted"]
        self.relaxed += s["relaxed"]

    _SUMMED = ("records", "tokens", "seconds", "steps", "accepted", "relaxed")

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self._SUMMED}

    @classmethod
    def summed(cls, parts: list[dict[str, Any]], wall: float) -> _Totals:
        """The totals of a data-parallel run: its processes' totals, over its wall time."""
        t = cls()
        for k in cls._SUMMED:
            setattr(t, k, sum(p[k] for p in parts))
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


def _prepare(engine, item, cfg: GenerateConfig) -> tuple[list[int], SamplingParams, int]:
    """A valid record -> (prompt ids, sampling, prompt tokens dropped); RecordFailure if not."""
    sampling = cfg.sampling.with_overrides(item.overrides)
    ids, dropped = engine.fit_prompt(engine.tokenize(item), truncate=cfg.truncate_prompt,
                                     max_tokens=sampling.max_tokens)
    return ids, sampling, dropped


def _failure_result(item, exc: BaseException) -> dict:
    """The error result line for a record whose preparation or generation raised `exc`."""
    import torch

    from marscli.engine.sequence import RecordFailure

    if isinstance(exc, RecordFailure):
        return _error_result(item, exc.type, exc.message)
    if isinstance(exc, (torch.cuda.OutOfMemoryError, MemoryError)):
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # give the next record the memory this one held
        return _error_result(item, ERR_OUT_OF_MEMORY, _one_line(exc))
    return _error_result(item, ERR_GENERATION_FAILED, f"{type(exc).__name__}: {_one_line(exc)}")


def _result_line(item, res, dropped: int, cfg: GenerateConfig, spec_meta: dict) -> dict:
    usage = {"prompt_tokens": res.prompt_tokens, "completion_tokens": res.completion_tokens}
    if cfg.truncate_prompt != "none":
        usage["truncated_prompt_tokens"] = dropped
    out = {
        item.id_key: item.id,
        "output": res.text,
        "finish_reason": res.finish_reason,
        "usage": usage,
        "spec": {**spec_meta, **res.stats.to_dict()},
        "timing": {
            "seconds": round(res.seconds, 4),
            "tokens_per_s": round(res.completion_tokens / res.seconds, 2) if res.seconds > 0 else None,
        } if cfg.timing else None,
        "error": None,
    }
    if cfg.token_ids:
        out["token_ids"] = res.token_ids
    return out


def _run_one(engine, item, cfg: GenerateConfig, spec_meta: dict) -> tuple[dict, float]:
    """One record -> (result line, seconds spent generating). Never raises for one record's
    sake: a failure becomes an error result and the run goes on."""
    from marscli.config import RecordError

    if isinstance(item, RecordError):
        return _error_result(item, item.type, item.message), 0.0
    try:
        ids, sampling, dropped = _prepare(engine, item, cfg)
        res = engine.generate_ids(ids, sampling)
    except Exception as e:  # noqa: BLE001 - one record's failure must not end a night's run
        return _failure_result(item, e), 0.0
    return _result_line(item, res, dropped, cfg, spec_meta), res.seconds


def _run_batched(engine, items, cfg: GenerateConfig, spec_meta: dict) -> Iterator[tuple[Any, dict, float]]:
    """Like _run_one over many records with a BatchEngine: yields (item, result line,
    seconds) as records finish (not in input order)."""
    from marscli.config import RecordError

    dropped: dict[int, int] = {}

    def prepare(item):
        ids, sampling, dropped[item.index] = _prepare(engine, item, cfg)
        return ids, sampling

    valid = []
    for item in items:
        if isinstance(item, RecordError):
            yield item, _error_result(item, item.type, item.message), 0.0
        else:
            valid.append(item)
    for item, res in engine.run(valid, prepare):
        if isinstance(res, BaseException):
            yield item, _failure_result(item, res), 0.0
        else:
            yield item, _result_line(item, res, dropped.pop(item.index, 0), cfg, spec_meta), res.seconds


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:  # before or after run_generate's own handling
        sys.exit(EXIT_INTERRUPTED)
    except _Stop as e:  # a second signal in the instant cleanup starts
        sys.exit(_EXIT_FOR_SIGNAL.get(e.signum, EXIT_INTERRUPTED))


if __name__ == "__main__":
    main()
