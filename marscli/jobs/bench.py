"""The bench job: bench's options -> BenchConfig, load the models once, run the protocol
(marscli.bench.runner.Bench: every method's engine, warm-up, methods rotating per prompt,
quality scored in between, batched throughput), and hand the report to marscli.bench.report.
What the methods are, the protocol's rationale and how runs add up: marscli.bench.methods.
"""

from __future__ import annotations

import dataclasses
import os
import platform
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from typing import Any

from marscli._version import __version__
from marscli.bench import metrics
from marscli.bench.methods import (
    BATCHED_METHODS,
    DEFAULT_EAGLE3_METHODS,
    DEFAULT_METHODS,
    EXACT_METHODS,
    EXIT_CORRECTNESS,
    MARS_METHODS,
    REPORT_FORMAT,
    SPEC_METHODS,
    TREE_METHODS,
    WARMUP_MAX_TOKENS,
    BenchConfig,
    BenchPrompt,
    Run,
    chain_or_tree,
    check_config,
    parse_float_list,
    parse_int_list,
    parse_methods,
    read_prompt_records,
    summarize,
)
from marscli.bench.report import REPORT_WIDTH, json_safe, render_tables, write_outputs
from marscli.bench.runner import Bench, batch_counters  # noqa: F401 (batch_counters: scripts/bench_batch.py)
from marscli.config import (
    DEFAULT_PREFIX_CACHE_MIB,
    GenerationOptions,
)
from marscli.drafters.kinds import EAGLE3
from marscli.errors import EXIT_OK, InputError, UsageError
from marscli.io.console import UNIT_RUNS, Progress
from marscli.io.console import Log as Narration
from marscli.io.distributed import launch_from_env
from marscli.jobs.bench_match import (
    check_match,
    fit_methods,
    match_section,
    read_calibration,
)
from marscli.jobs.setup import (
    compile_mode,
    generation_setup,
    load_models,
    named_profile,
    resolve_spans,
    resolve_verification,
)
from marscli.scoring import rouge
from marscli.scoring.compare import task_report
from marscli.verification.registry import MARS, PAPER_THETA, STRICT

# --------------------------------------------------------------------------------------------
# The whole run


def run_bench(cfg: BenchConfig, log: Narration) -> int:
    """Load models, run every method (--throughput: the batched rows only), print tables,
    write the report and plot; return the exit code (1 after writing everything when a
    correctness check failed)."""
    check_config(cfg)
    records, skipped, overridden = read_prompt_records(cfg.input, cfg.limit)
    if not records:
        raise InputError(f"{cfg.input}: no usable records to benchmark")
    calibration = read_calibration(cfg) if cfg.match_relax_rate is not None else None
    target, draft = load_models(cfg.target, cfg.draft_model, log.info, kind=cfg.draft.kind)
    match = None
    if calibration is not None:  # before anything is timed
        cfg, match = fit_methods(cfg, calibration, records, target, draft, log.info)
    bench = Bench(cfg, target, draft, log=log.info)
    report = bench_report(bench, records, skipped, overridden, log=log)
    if match is not None:  # a --throughput report has no per-method figures to set beside the fit
        report["match_relax_rate"] = match_section(match, report.get("methods", {}), log.info)
    failures = report.get("correctness_failures", [])  # none under --throughput: nothing is compared
    from rich.console import Console

    # Tables are wide: off a terminal, a fixed width keeps each row on one line.
    console = Console(stderr=True, highlight=False, width=None if log.console.is_terminal else REPORT_WIDTH)
    if not log.quiet:
        render_tables(report, console)
    for f in failures:
        console.print(f"[bold red]CORRECTNESS FAILURE: {f['method']} output differs from {f['reference']} "
                      f"on id {f['id']} (seed {f['seed']}) at token {f['first_mismatch']}[/]", soft_wrap=True)
    write_outputs(cfg, report, log.info)
    return EXIT_CORRECTNESS if failures else EXIT_OK


def bench_report(bench: Bench, records, skipped: list[dict], overridden: int = 0, *,
                 log: Narration | None = None) -> dict[str, Any]:
    narration = log if log is not None else Narration(quiet=True)
    cfg, log = bench.cfg, bench.log
    prompts, unusable = bench.encode(records)
    skipped = skipped + unusable
    for s in skipped:
        log(f"skipping record {s['id']} (line {s['line']}): {s['reason']}")
    if not prompts:
        raise InputError(f"{cfg.input}: no usable records to benchmark")
    notes = list(bench.notes)
    if overridden:
        notes.append(f"{overridden} records carry their own sampling settings; bench ignores them so "
                     "that every method decodes alike")
    if cfg.throughput_only:
        return _throughput_report(bench, prompts, skipped, notes, narration)
    if not rouge.rouge_available():
        notes.append("rouge-score is not installed (pip install 'marscli[bench]'): no ROUGE-L")
    elif not any(p.reference for p in prompts):
        notes.append("no record has a reference answer: no ROUGE-L")
    names = ", ".join(m.name for m in cfg.methods)
    log(f"{len(prompts)} prompts x {len(cfg.seeds)} seed(s) x {len(cfg.methods)} methods: {names}")

    memory = bench.warm_up(prompts[0])
    context = sorted(prompts, key=lambda p: len(p.ids))[len(prompts) // 2].ids
    limit_info = bench.measure_forwards(context)
    with Progress(narration, label="bench", unit=UNIT_RUNS) as progress:
        runs = bench.run(prompts, progress.update)
    throughput = _throughput_rows(bench, prompts, narration) if cfg.batch_sizes else []
    per_method = summarize(cfg, runs, limit_info)
    task = _task_section(bench, runs) if cfg.task else None
    cuda_peak = getattr(bench, "cuda_peak_mib", {})
    for name, a in per_method.items():
        a.update(memory.get(name, {}))
        if name in cuda_peak:  # pragma: no cover - needs a GPU
            a["cuda_peak_mib"] = round(cuda_peak[name], 1)
    failures = bench.correctness_failures(runs)
    ref = bench.reference_method()
    exact_checked = [m.name for m in cfg.methods if m.kind in EXACT_METHODS and m.name != ref]
    physical = {k: v for k, v in limit_info.items() if not k.startswith("_")}
    physical["methods"] = {
        m.name: {f: per_method[m.name][f] for f in ("acceptance_length", "ideal_speedup_vs_ar",
                                                   "speedup_vs_ar", "measured_over_ideal")}
        for m in cfg.methods if m.kind in SPEC_METHODS
    }
    notes += [
        target_note(bench),
        ("tokens_per_s counts completion tokens (an EOS included) over generation time only: from the "
         "start of the prompt's prefill to the record's last token; prompt encoding and quality scoring "
         "are not timed"),
        ("seconds_per_record: mean generation time of a method's runs (records x seeds); task_speedup_vs_X: "
         "X's seconds per record / the method's, on the same records and seeds; length_ratio_vs_X: the "
         "method's completion tokens / X's there (so task_speedup = speedup in tokens/s / length_ratio)"),
        ("peak_rss_mib is the process's peak resident memory right after the method's warm-up run "
         "(methods warm up in the listed order): it only grows, and includes the models, earlier "
         "methods and Python itself, so only increases between methods say anything about a method"),
        ("ideal_speedup_vs_ar: plain decoding costs one target forward a token; a perfect engine "
         "costs t(k+1) (+ k draft forwards) per step, for the draft lengths and acceptance measured; "
         "measured_over_ideal = speedup_vs_ar / ideal_speedup_vs_ar"),
    ]
    if cfg.batch_sizes:
        notes.append(throughput_note(cfg))
    if not cfg.greedy:
        notes.append("sampling: exact match and prefix share compare samples of different methods "
                     "with the same seed (different random streams), so they measure agreement, not "
                     "correctness; figures are means over seeds, 'spread' holds their std")
    report: dict[str, Any] = {
        **_header(cfg),
        "settings": _settings(bench),
        "environment": _environment(bench),
        "target": bench.target.identity,
        "draft": bench.draft.identity if bench.draft is not None else None,
        "prompts": _prompts_section(prompts, skipped),
        "reference_method": ref,
        "methods": per_method,
        "physical_limit": physical,
        "correctness": {"checked": bool(cfg.greedy and ref and exact_checked), "reference": ref,
                        "methods": exact_checked if cfg.greedy else [], "failures": len(failures)},
        "correctness_failures": failures,
        "throughput": throughput,
        "task": task,
        "runs": [r.to_json() for r in runs],
        "notes": notes,
    }
    return json_safe(report)


def _throughput_report(bench: Bench, prompts: Sequence[BenchPrompt], skipped: list[dict], notes: list[str],
                       narration: Narration) -> dict[str, Any]:
    """bench --throughput: the batched throughput rows alone (no per-record runs, task scores
    or forward measurements), with the settings, environment, models and prompts behind them."""
    cfg = bench.cfg
    measured = [m.name for m in cfg.methods if m.kind in BATCHED_METHODS]
    unbatched = [m.name for m in cfg.methods if m.kind not in BATCHED_METHODS]
    if unbatched:  # e.g. the default methods' hf-assisted
        notes.append(f"--throughput measures batched methods only: {', '.join(unbatched)} not run")
    bench.log(f"{len(prompts)} prompts, throughput only: {', '.join(measured)}")
    throughput = _throughput_rows(bench, prompts, narration)
    notes.append(target_note(bench))
    notes.append(throughput_note(cfg))
    return json_safe({
        **_header(cfg),
        "settings": _settings(bench),
        "environment": _environment(bench),
        "target": bench.target.identity,
        "draft": bench.draft.identity if bench.draft is not None else None,
        "prompts": _prompts_section(prompts, skipped),
        "throughput": throughput,
        "notes": notes,
    })


def _throughput_rows(bench: Bench, prompts: Sequence[BenchPrompt], narration: Narration) -> list[dict[str, Any]]:
    sizes = ", ".join(map(str, bench.cfg.batch_sizes))
    bench.log(f"throughput: batch sizes {sizes} over all {len(prompts)} prompts")
    with Progress(narration, label="bench", unit=UNIT_RUNS) as progress:
        return bench.throughput(prompts, progress.update)


def throughput_note(cfg: BenchConfig) -> str:
    """The report's note on the throughput rows: how they were measured."""
    return ("throughput: each method decodes all prompts at each --batch-size, sizes in the given "
            f"order; before each row the method warms up on the first prompt ({cfg.throughput_warmup_tokens} "
            "new tokens, same engine or generate()), then the engine's prefix cache is emptied and its "
            "prefill counters zeroed, so "
            "the timed run starts warm for kernels but cold for prefixes; marscli methods refill a "
            "finished row's place at once (continuous batching), hf-generate runs consecutive left-padded "
            "batches (static batching); tokens_per_s and records_per_s include prompt prefill; "
            "speedup_vs_hf_generate is records/s over hf-generate's at the same batch size; "
            "prefix_tokens_reused counts prompt tokens taken from the prefix cache "
            f"(--prefix-cache {cfg.prefix_cache:g} MiB); outputs_equal_first_batch_size counts prompts "
            "whose output equals the method's at the first batch size; peak_rss_mib only grows through "
            "the run" + ("" if cfg.greedy else "; sampling: the first seed only"))


def _header(cfg: BenchConfig) -> dict[str, Any]:
    return {"marscli_bench": REPORT_FORMAT, "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "input": cfg.input}


def _prompts_section(prompts: Sequence[BenchPrompt], skipped: list[dict]) -> dict[str, Any]:
    lengths = sorted(len(p.ids) for p in prompts)
    return {
        "used": len(prompts), "skipped": skipped,
        "prompt_tokens": {"min": lengths[0], "median": metrics.median(lengths), "max": lengths[-1]},
        "with_reference": sum(p.reference is not None for p in prompts),
    }


def _settings(bench: Bench) -> dict[str, Any]:
    cfg = bench.cfg
    return {
        "methods": [m.name for m in cfg.methods],
        "max_tokens": cfg.max_tokens, "temperature": cfg.temperature, "seeds": list(cfg.seeds),
        "limit": cfg.limit, "margin": cfg.margin,
        "thetas": sorted({m.theta for m in cfg.methods if m.kind in MARS_METHODS}),
        "guard": cfg.guard.to_dict(),
        **({"spans": cfg.spans.to_dict()} if cfg.spans.active else {}),
        "drafter": {"kind": cfg.draft.kind, "model": cfg.draft.model,
                    "num_draft_tokens": cfg.draft.num_draft_tokens, "adaptive": cfg.draft.adaptive,
                    "ngram_max": cfg.draft.ngram_max, "ngram_min": cfg.draft.ngram_min,
                    **({"hybrid": True} if cfg.draft.hybrid else {}),
                    **({"context": cfg.draft.context} if cfg.draft.context else {}), **_tree_settings(cfg)},
        "hf_assisted": bench.hf_assisted,
        # the per-record protocol's warm-up (none under --throughput)
        "warmup_max_tokens": None if cfg.throughput_only else min(WARMUP_MAX_TOKENS, cfg.max_tokens),
        "batch_sizes": list(cfg.batch_sizes),
        "throughput_warmup_max_tokens": cfg.throughput_warmup_tokens,
        "throughput_only": cfg.throughput_only,
        "prefix_cache_mib": cfg.prefix_cache,
        "compile": cfg.compile,  # --compile; each row's step_kind says what ran
    }


def _task_section(bench: Bench, runs: Sequence[Run]) -> dict[str, Any]:
    """bench --task: every run's task score and each method against strict (marscli.scoring)."""

    bench.log(f"scoring {len(runs)} outputs for {bench.cfg.task}")
    tok = bench.target.tokenizer
    return task_report(bench.cfg.task, runs, [(m.name, m.kind) for m in bench.cfg.methods],
                       lambda ids: tok.decode(ids, skip_special_tokens=True), bench.target.eos_token_ids,
                       bench.cfg.max_tokens)


def _tree_settings(cfg: BenchConfig) -> dict[str, Any]:
    if not any(m.kind in TREE_METHODS for m in cfg.methods):
        return {}
    t = chain_or_tree(cfg.draft, True)
    return {"tree": {"depth": t.tree_depth, "top_k": t.tree_top_k, "tokens": t.tree_tokens}}


def target_is_cpu(bench: Bench) -> bool:
    return bench.target.device.type == "cpu"


def target_note(bench: Bench) -> str:
    """The note on what hf-generate shares with marscli's methods."""
    if not target_is_cpu(bench):
        return "the target runs on CUDA: no CPU fast path"
    return ("transformers' generate() ran on the same target model object as marscli, with marscli's CPU "
            "fast path (marscli/models/fastpath.py) installed on its linear layers")


def _environment(bench: Bench) -> dict[str, Any]:
    import torch
    import transformers

    env = {
        "marscli": __version__, "python": platform.python_version(), "torch": torch.__version__,
        "transformers": transformers.__version__, "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(), "device": str(bench.target.device),
        "cuda_device": torch.cuda.get_device_name(bench.target.device) if bench.target.device.type == "cuda" else None,
        "cpu_fastpath": target_is_cpu(bench),
    }
    return env


def bench_config(input: str, o: GenerationOptions = GenerationOptions(), *, methods: str | None = None,
                 theta: str | None = None, profile: str | None = None, temperature: float = 0.0,
                 seeds: str = "0", max_tokens: int = 128, limit: int | None = None,
                 batch_size: str | None = None, report: str | None = None, plot: str | None = None,
                 task: str | None = None, match_relax_rate: float | None = None, calibrate_on: str | None = None,
                 calibration_records: int | None = None, throughput: bool = False,
                 prefix_cache: float = DEFAULT_PREFIX_CACHE_MIB, compile: str = "auto",
                 note: Callable[[str], None] = lambda _: None) -> BenchConfig:
    """`marscli bench`'s options -> BenchConfig, by generate's rule: command line > profile >
    defaults (target, drafter, margin; the profile's theta joins --theta's, except under
    --match-relax-rate, which fits it). ``o``: generate's model, drafting, guard and spans
    options (the others are bench's own: --theta takes a list, --batch-size too; --throughput
    and --prefix-cache are bench's as well, the latter for every engine bench builds)."""

    if launch_from_env() is not None:
        raise UsageError("bench times methods against each other in one process: run it "
                         "without a launcher (accelerate launch, torchrun)")
    setup = generation_setup(dataclasses.replace(o, profile=profile))
    prof = named_profile(setup.profile)
    resolved = resolve_verification(dataclasses.replace(setup.verify, mode=STRICT), prof)
    margin = resolved.margin
    thetas = parse_float_list(theta, "--theta") if theta is not None else ()
    prule = prof.rule if prof is not None else None
    if prule is not None and prule.name == MARS and prule.theta not in thetas:
        thetas = (*thetas, prule.theta)
    dcfg = setup.draft
    if methods is None:
        methods = DEFAULT_EAGLE3_METHODS if dcfg.kind == EAGLE3 else DEFAULT_METHODS
        if prule is not None and prule.name not in (MARS, STRICT):
            methods = f"{methods},{prule.label()}"  # the profile's rule at its knobs
    cfg = BenchConfig(
        input=input,
        methods=parse_methods(methods, thetas or (PAPER_THETA,), match=match_relax_rate is not None),
        target=setup.target,  # the same model configs as generate's (quantization included)
        draft=dcfg,
        draft_model=setup.draft_model,
        margin=margin,
        max_tokens=max_tokens,
        temperature=temperature,
        seeds=parse_int_list(seeds, "--seeds"),
        limit=limit,
        report=report,
        plot=plot,
        batch_sizes=parse_int_list(batch_size, "--batch-size") if batch_size is not None else (),
        throughput_only=throughput,
        prefix_cache=prefix_cache,
        compile=compile_mode(compile),
        guard=resolved.guard,
        task=task,
        spans=resolve_spans(setup, prof, note),
        match_relax_rate=match_relax_rate, calibrate_on=calibrate_on,
        **({"calibration_records": calibration_records} if calibration_records is not None else {}),
    )
    check_match(cfg, theta is not None, calibration_records is not None)
    if prof is not None:
        note(f"using profile {prof.describe()}: {prule.label()}")
    return cfg
