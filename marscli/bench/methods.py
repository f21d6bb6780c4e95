"""marscli bench: speed and quality of every method, side by side, in one process.

Methods, all on the same target, drafter, prompts, max tokens, temperature and seed:

- ``hf-generate``: transformers' ``generate()``, no drafter (the baseline).
- ``hf-assisted``: transformers' assisted generation with the same drafter: the draft model
  as ``assistant_model`` (``num_assistant_tokens`` = K), or ``prompt_lookup_num_tokens`` = K
  for the n-gram drafter.
- ``ar``: marscli's engine with no drafter (plain decoding through the same loop).
- ``strict``: marscli speculative decoding with exact verification.
- ``mars@THETA``: marscli with margin-aware verification, one method per theta.
- ``ratio@R``, ``topk@N:D``, ``typical@E:A`` (or ``typical@E``: A = sqrt(E)), ``regret@B``:
  marscli with another relaxed rule of the rulebook (marscli.verification.rules.Rule) at these knobs,
  guarded like ``mars``; labelled by ``Rule.label()``. ``mars@THETA`` spells one MARS method.
- With ``--match-relax-rate S`` (marscli.jobs.bench_match) the knobs written are only the
  rule's template: every relaxed method's main knob (theta, rho, delta, epsilon, budget) is
  fitted on a calibration split so that all relax the same share S of verified positions,
  and the spellings may leave that knob out: ``mars``, ``ratio``, ``topk`` / ``topk@N``,
  ``typical`` / ``typical@E:A`` (an explicit A stays fixed), ``regret``.
- ``strict-tree`` and ``mars-tree@THETA`` (a draft model or an EAGLE-3 head): the same with
  the drafter drafting a tree (the --tree-* settings, else the drafter's defaults: an EAGLE-2
  dynamic tree from a head, the chain with sibling leaves from a draft model) instead of a
  chain, so chain and tree compare side by side. ``strict``/``mars`` then draft chains.

Protocol: every method runs once on the first prompt (warm-up, not measured); then, per seed
and per prompt, every method runs once, the order rotating from prompt to prompt, so machine
drift and cache effects hit all methods alike. Only generation is timed; scoring (target NLL,
ROUGE-L) happens between runs. Greedy ``ar`` and ``strict`` outputs must equal the
reference's (``hf-generate``'s) token for token: a difference is a correctness failure,
listed in the report and turned into exit code 1, never averaged away.

This module holds what a benchmark is (methods, settings, prompts, runs) and how runs
add up to per-method figures; marscli/jobs/bench.py runs it, marscli/bench/report.py prints and
writes the report. Report layout and column meanings: docs/benchmarks.md.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from marscli.bench import metrics
from marscli.config import (
    DEFAULT_PREFIX_CACHE_MIB,
    MODEL_TREE_DEFAULTS,
    SPANS_OFF,
    DraftConfig,
    GuardConfig,
    MarginKind,
    ModelConfig,
    RecordError,
    Request,
    SamplingParams,
    SpanConfig,
)
from marscli.drafters.eagle3 import DEFAULT_TREE
from marscli.drafters.kinds import EAGLE3, MODEL, drafter_kind
from marscli.errors import EXIT_RUNTIME, InputError, UsageError
from marscli.io.input_index import find_duplicate_ids
from marscli.io.records import open_input, read_requests
from marscli.scoring import rouge
from marscli.scoring.compare import check_ready
from marscli.verification.guard import repetition_stats
from marscli.verification.registry import (
    MARS,
    PAPER_THETA,
    RELAXING_RULES,
    RULEBOOK,
    SAMPLING_MODE,
    STRICT,
    Rule,
)

HF_GENERATE = "hf-generate"
HF_ASSISTED = "hf-assisted"
AR = "ar"
STRICT_TREE = "strict-tree"
MARS_TREE = "mars-tree"
#: MARS with the loop guard off (the paper's rule alone), beside `mars` (guarded by the run's
#: --repeat-guard / --max-relaxed-share, on by default): what the guard changes.
MARS_NOGUARD = "mars-noguard"
#: The rulebook's relaxed rules but MARS (which has methods of its own, one per --theta),
#: spelled NAME@KNOBS (registry.RuleSpec.spelling: ratio@R, topk@N:D, ...): one method each.
RULE_METHODS = tuple(r for r in RELAXING_RULES if r != MARS)
ALL_METHODS = (HF_GENERATE, HF_ASSISTED, AR, STRICT, MARS, MARS_NOGUARD, STRICT_TREE, MARS_TREE, *RULE_METHODS)
DEFAULT_METHODS = ",".join((HF_GENERATE, HF_ASSISTED, AR, STRICT, MARS))
#: The default for an EAGLE-3 drafter: transformers has no EAGLE-3 assisted generation, and
#: chain and tree drafting compare side by side.
DEFAULT_EAGLE3_METHODS = ",".join((HF_GENERATE, AR, STRICT, STRICT_TREE, MARS, MARS_TREE))
#: Methods whose greedy output must equal the reference method's token for token.
EXACT_METHODS = (AR, STRICT, STRICT_TREE)
#: Methods that need a drafter.
DRAFTED_METHODS = (HF_ASSISTED, STRICT, MARS, MARS_NOGUARD, STRICT_TREE, MARS_TREE, *RULE_METHODS)
#: Methods with per-step statistics (acceptance, relaxed share, the ideal speedup).
SPEC_METHODS = (STRICT, MARS, MARS_NOGUARD, STRICT_TREE, MARS_TREE, *RULE_METHODS)
#: Methods that verify with MARS (one per theta) and methods that draft trees.
MARS_METHODS = (MARS, MARS_NOGUARD, MARS_TREE)
TREE_METHODS = (STRICT_TREE, MARS_TREE)
#: Methods measured at several batch sizes by --batch-size (transformers refuses assisted
#: generation at batch size > 1, and draft trees run one record at a time).
BATCHED_METHODS = (HF_GENERATE, AR, STRICT, MARS, MARS_NOGUARD, *RULE_METHODS)
#: Methods whose main knob --match-relax-rate fits (one method each, whatever --theta says).
MATCHED_METHODS = (MARS, MARS_NOGUARD, *RULE_METHODS)
#: --calibration-records' default: calibration prompts taken after the measured ones.
DEFAULT_CALIBRATION_RECORDS = 20
#: Reference for quality comparisons, in order of preference.
REFERENCE_METHODS = (HF_GENERATE, AR)

DEFAULT_BENCH_MAX_TOKENS = 128
DEFAULT_THETAS = (PAPER_THETA,)
WARMUP_MAX_TOKENS = 16
#: Tokens of the warm-up run before each throughput row: enough to run the prefill and a
#: decoding step, few enough to cost nothing beside the timed run.
THROUGHPUT_WARMUP_MAX_TOKENS = 2
FORWARD_TIMING_REPEATS = 5
REPORT_FORMAT = 1
EXIT_CORRECTNESS = EXIT_RUNTIME
MIB = 1024 * 1024

#: Scalars averaged over seeds (their std is the "spread" of a sampling run).
SPREAD_FIELDS = (
    "tokens_per_s", "median_tokens_per_s", "speedup_vs_hf_generate", "speedup_vs_ar", "speedup_vs_strict",
    "seconds_per_record", "mean_completion_tokens",
    "task_speedup_vs_hf_generate", "task_speedup_vs_ar", "task_speedup_vs_strict",
    "length_ratio_vs_hf_generate", "length_ratio_vs_ar", "length_ratio_vs_strict",
    "acceptance_length", "acceptance_rate", "relaxed_share", "tokens_per_target_forward",
    "exact_match_rate", "prefix_share", "nll_per_token", "rouge_l",
    "ideal_speedup_vs_ar", "measured_over_ideal", "repeat_share", "loop_share",
)

#: The methods whose time per record others are measured against, by the suffix of the
#: `speedup_vs_*`, `task_speedup_vs_*` and `length_ratio_vs_*` fields: the first method of each kind.
TIME_REFERENCES = (("hf_generate", HF_GENERATE), ("ar", AR), ("strict", STRICT))

Log = Callable[[str], None]


# --------------------------------------------------------------------------------------------
# Configuration


@dataclass(frozen=True)
class MethodSpec:
    name: str  # label in tables and the report: "strict", "mars@0.9", "ratio@0.5"
    kind: str  # one of ALL_METHODS
    theta: float | None = None
    rule: Any = None  # the marscli.verification.rules.Rule of a RULE_METHODS method (its knobs), else None

    def verify_rule(self, margin: str):
        """The marscli.verification.rules.Rule this method verifies with, or None (hf-*, ar)."""

        if self.rule is not None:
            return self.rule
        if self.kind in MARS_METHODS:
            return Rule(MARS, self.theta, margin)
        if self.kind in (STRICT, STRICT_TREE):
            return Rule(STRICT, margin=margin)
        return None


@dataclass(frozen=True)
class BenchConfig:
    """Everything `marscli bench` needs, parsed from the command line."""

    input: str
    methods: tuple[MethodSpec, ...]
    target: ModelConfig
    draft: DraftConfig
    draft_model: ModelConfig | None = None
    margin: MarginKind = "logit-ratio"
    max_tokens: int = DEFAULT_BENCH_MAX_TOKENS
    temperature: float = 0.0
    seeds: tuple[int, ...] = (0,)
    limit: int | None = None
    report: str | None = None  # path, "-" for stdout, None: no report file
    plot: str | None = None
    batch_sizes: tuple[int, ...] = ()  # non-empty: also measure batched throughput at these sizes
    #: --throughput: only the batched throughput rows (no per-record runs, scores or forwards).
    throughput_only: bool = False
    #: MiB of every engine's prefix cache (0: off; marscli.models.prefill): same outputs at any size.
    prefix_cache: float = DEFAULT_PREFIX_CACHE_MIB
    #: --compile of every engine (config.COMPILE_MODES; captured steps on CUDA).
    compile: str = "auto"
    #: The loop guard of the `mars` and `mars-tree` methods (`mars-noguard` has none).
    guard: GuardConfig = GuardConfig()
    #: Strict spans of every method (marscli.verification.spans; they change only relaxed ones).
    spans: SpanConfig = SPANS_OFF
    task: str | None = None  # humaneval, gsm8k, sum: task scores and the paired comparison (marscli.scoring)
    #: --match-relax-rate S: fit every MATCHED_METHODS knob to relax a share S (jobs/bench_match).
    match_relax_rate: float | None = None
    calibrate_on: str | None = None  # the calibration prompts' file (None: the input's, after --limit)
    calibration_records: int = DEFAULT_CALIBRATION_RECORDS

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def throughput_warmup_tokens(self) -> int:
        """New tokens of the warm-up run before each throughput row."""
        return min(THROUGHPUT_WARMUP_MAX_TOKENS, self.max_tokens)

    def sampling(self, seed: int, max_tokens: int | None = None) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, max_tokens=max_tokens or self.max_tokens, seed=seed)


def parse_methods(text: str, thetas: Sequence[float], match: bool = False) -> tuple[MethodSpec, ...]:
    """'hf-generate,ar,mars,ratio@0.5' + thetas -> method specs; `mars` becomes one method per
    theta, `mars@THETA` one at that theta; a rule method NAME@KNOBS one at its knobs.

    ``match`` (--match-relax-rate): MATCHED_METHODS are templates whose main knob will be
    fitted: one method each (named as written until then), the main knob may be left out."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise UsageError("--methods is empty; choose from " + ", ".join(ALL_METHODS))
    out: list[MethodSpec] = []
    for name in names:
        kind, at, knobs = name.partition("@")
        if kind not in ALL_METHODS:
            raise UsageError(f"unknown method {name!r} in --methods; choose from {', '.join(ALL_METHODS)}")
        if kind in RULE_METHODS:
            specs = [rule_method(name, match)]
        elif match and kind in (MARS, MARS_NOGUARD):
            theta = _method_number(name, knobs, f"{kind}@THETA") if at else DEFAULT_THETAS[0]
            specs = [MethodSpec(name, kind, theta)]
        elif kind in MARS_METHODS and at:
            theta = _method_number(name, knobs, f"{kind}@THETA")
            specs = [MethodSpec(f"{kind}@{theta:g}", kind, theta)]
        elif at:
            raise UsageError(f"method {name!r} in --methods: {kind} takes no knobs; write {kind}")
        elif kind in MARS_METHODS:
            specs = [MethodSpec(f"{kind}@{t:g}", kind, t) for t in thetas]
        else:
            specs = [MethodSpec(kind, kind)]
        out.extend(s for s in specs if s not in out)
    return tuple(out)


def rule_method(name: str, match: bool = False) -> MethodSpec:
    """'ratio@0.5', 'topk@3:0.1', 'typical@0.1[:0.3]', 'regret@2' -> its method, labelled by
    Rule.label(). A bad spelling or a knob out of range is a usage error naming the method.
    ``match``: the main knob may be left out ('ratio', 'topk@3'; fitted later), and the
    method keeps the name written until it is."""

    kind, _, text = name.partition("@")
    spec = RULEBOOK[kind]
    spelling = spec.spelling
    parts = text.split(":") if text else []
    least = 0 if match else len([k for k in spec.knobs if not k.optional])
    if not least <= len(parts) <= len(spec.knobs):
        hint = " (or leave the knobs out with --match-relax-rate)" if len(parts) < least else ""
        raise UsageError(f"method {name!r} in --methods: write {spelling}{hint}")
    knobs: dict[str, Any] = {}
    for knob, part in zip(spec.knobs, parts):
        value = _method_number(name, part, spelling)
        if knob.kind is int:
            if value != int(value):
                raise UsageError(f"method {name!r} in --methods: {knob.symbol} is a whole number; write {spelling}")
            value = int(value)
        knobs[knob.name] = value
    try:
        rule = Rule(kind, **knobs)
    except ValueError as e:
        raise UsageError(f"method {name!r} in --methods: {str(e).removeprefix('--')}") from None
    return MethodSpec(name if match else rule.label(), kind, None, rule)


def _method_number(name: str, text: str, spelling: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if math.isnan(value):
        raise UsageError(f"method {name!r} in --methods: {text!r} is not a number; write {spelling}")
    return value


def parse_float_list(text: str, option: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise UsageError(f"{option} takes comma-separated numbers, got {text!r}") from None
    if not values or any(math.isnan(v) for v in values):
        raise UsageError(f"{option} takes comma-separated numbers, got {text!r}")
    return tuple(dict.fromkeys(values))


def parse_int_list(text: str, option: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise UsageError(f"{option} takes comma-separated integers, got {text!r}") from None
    if not values or any(v < 0 for v in values):
        raise UsageError(f"{option} takes comma-separated integers >= 0, got {text!r}")
    return tuple(dict.fromkeys(values))


def check_config(cfg: BenchConfig) -> None:
    if not cfg.greedy:
        greedy_only = [m.name for m in cfg.methods if m.rule is not None and SAMPLING_MODE not in m.rule.modes]
        if greedy_only:
            raise UsageError(f"{', '.join(greedy_only)}: the rule is defined for greedy decoding only; "
                             "drop it from --methods or use --temperature 0")
    trees = [m.name for m in cfg.methods if m.kind in TREE_METHODS]
    if trees and not drafter_kind(cfg.draft.kind).trees:
        raise UsageError(f"{', '.join(trees)} draft trees with a draft model or an EAGLE-3 head: "
                         "--draft MODEL or --draft eagle3:PATH")
    if cfg.draft.kind == EAGLE3 and any(m.kind == HF_ASSISTED for m in cfg.methods):
        raise UsageError("transformers has no assisted generation with an EAGLE-3 head: drop "
                         "hf-assisted from --methods")
    if not drafter_kind(cfg.draft.kind).drafts:
        drafted = [m.name for m in cfg.methods if m.kind in DRAFTED_METHODS]
        if drafted:
            raise UsageError(f"--draft none leaves nothing to draft for {', '.join(drafted)}; "
                             "choose a drafter or drop them from --methods")
    if cfg.greedy and len(cfg.seeds) > 1:
        raise UsageError("greedy decoding (--temperature 0) is deterministic: give one seed, "
                         "or several with --temperature > 0")
    # A bench can run for an hour: refuse now what would only fail when the results are in.
    for option, path in (("--report", cfg.report), ("--plot", cfg.plot)):
        if path and path != "-":
            folder = os.path.dirname(os.path.abspath(path))
            if not os.path.isdir(folder):
                raise UsageError(f"{option} {path}: folder {folder} does not exist")
            if not os.access(folder, os.W_OK):
                raise UsageError(f"{option} {path}: folder {folder} is not writable")
    if any(b < 1 for b in cfg.batch_sizes):
        raise UsageError(f"--batch-size takes integers >= 1, got {','.join(map(str, cfg.batch_sizes))}")
    if cfg.batch_sizes and not any(m.kind in BATCHED_METHODS for m in cfg.methods):
        raise UsageError("--batch-size measures " + ", ".join(BATCHED_METHODS) + "; none is in --methods")
    if cfg.throughput_only:
        # --throughput runs no record alone: nothing for --task to score or --plot to draw.
        if not cfg.batch_sizes:
            raise UsageError("--throughput measures batched throughput: give --batch-size too, e.g. --batch-size 16,64")
        for option, given in (("--task", cfg.task), ("--plot", cfg.plot)):
            if given:
                raise UsageError(f"{option} needs the per-record runs that --throughput skips: drop one of them")
    if cfg.prefix_cache < 0:
        raise UsageError(f"--prefix-cache takes MiB >= 0, got {cfg.prefix_cache:g}")

    check_ready(cfg.task, [m.kind for m in cfg.methods])
    if cfg.plot == "-":
        raise UsageError("--plot needs a file name (a PNG is not written to stdout)")
    if cfg.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError("--plot needs matplotlib: pip install 'marscli[bench]'") from None

# --------------------------------------------------------------------------------------------
# Prompts


@dataclass
class BenchPrompt:
    id: str
    line: int
    ids: list[int]  # prompt token ids, chat template applied
    reference: str | None  # the prompt set's reference answer for the first turn


def read_prompt_records(source: str, limit: int | None,
                        start: int = 0) -> tuple[list[tuple[Request, str | None]], list[dict], int]:
    """The first `limit` records of a JSONL input (after its first `start` ones: bench
    --match-relax-rate's calibration split) -> ([(request, reference text)], skipped,
    number of records whose per-record sampling overrides are ignored). Records count as
    --limit counts them: every input record, unparsable ones included."""

    data = _read_bytes(source)
    lines = data.split(b"\n")
    items: list[Request | RecordError] = []
    for n, item in enumerate(read_requests(io.BytesIO(data))):
        if limit is not None and len(items) >= limit:
            break
        if n >= start:
            items.append(item)
    dup = find_duplicate_ids(items)
    if dup is not None:
        raise InputError(f"{source}: duplicate id {dup[0]!r} on lines {dup[1]} and {dup[2]}")
    records: list[tuple[Request, str | None]] = []
    skipped: list[dict] = []
    overridden = 0
    for item in items:
        if isinstance(item, RecordError):
            skipped.append({"id": item.id, "line": item.line, "reason": f"{item.type}: {item.message}"})
            continue
        overridden += bool(item.overrides)
        records.append((item, _reference_of(lines[item.line - 1])))
    return records, skipped, overridden


def _read_bytes(source: str) -> bytes:

    if source == "-":
        return sys.stdin.buffer.read()
    with open_input(source) as f:
        return f.read()


def _reference_of(raw: bytes) -> str | None:
    try:
        obj = json.loads(raw.decode("utf-8-sig"))
    except ValueError:
        return None
    return rouge.reference_text(obj) if isinstance(obj, dict) else None

# --------------------------------------------------------------------------------------------
# Running


@dataclass
class Run:
    """One method on one prompt with one seed.

    ``seconds``: wall seconds of the method's one generate call (jobs/bench.py ``Bench._timed``),
    from token ids in to token ids out: the prompt's prefill, every decoding step and the
    record's end (CUDA synchronized on both sides). Prompt encoding (chat template,
    tokenization) happens before it and quality scoring after it; neither is timed."""

    method: str
    prompt: BenchPrompt
    seed: int
    tokens: list[int]
    seconds: float
    target_forwards: int
    stats: Any = None  # SpecStats for marscli methods with a drafter
    exact: bool | None = None
    prefix_share: float | None = None
    first_mismatch: int | None = None
    nll: list[float] = field(default_factory=list)
    rouge_l: float | None = None

    @property
    def repetition(self) -> dict[str, Any]:
        """repeat_share and ends_in_loop of the output (marscli.verification.guard), computed once."""
        if getattr(self, "_repetition", None) is None:
            self._repetition = repetition_stats(self.tokens)
        return self._repetition

    def to_json(self) -> dict[str, Any]:
        n = len(self.tokens)
        return {
            "method": self.method, "id": self.prompt.id, "seed": self.seed,
            "prompt_tokens": len(self.prompt.ids), "completion_tokens": n,
            "seconds": round(self.seconds, 5),
            "tokens_per_s": round_or_none(metrics.rate(n, self.seconds)),
            "target_forwards": self.target_forwards,
            "acceptance_length": round_or_none(self.stats.acceptance_length) if self.stats is not None else None,
            "relaxed": self.stats.relaxed if self.stats is not None else None,
            "exact_match": self.exact, "prefix_share": round_or_none(self.prefix_share),
            "first_mismatch": self.first_mismatch,
            "nll_per_token": round_or_none(metrics.mean(self.nll)), "rouge_l": round_or_none(self.rouge_l),
            **self.repetition,
        }


# --------------------------------------------------------------------------------------------
# Aggregation


def aggregate(runs: Sequence[Run], spec: MethodSpec, t_target: Sequence[float] | None,
              t_draft: float, margin: str = "logit-ratio") -> dict[str, Any]:
    """One method's figures over `runs` (one seed, or pooled)."""
    rule = spec.verify_rule(margin)
    tokens = sum(len(r.tokens) for r in runs)
    seconds = sum(r.seconds for r in runs)
    forwards = sum(r.target_forwards for r in runs)
    per_prompt = [v for r in runs if (v := metrics.rate(len(r.tokens), r.seconds)) is not None]
    out: dict[str, Any] = {
        "kind": spec.kind, "theta": spec.theta,
        # the verification rule and its knobs (marscli.verification.rules.Rule.knobs); None: no verification
        "rule": rule.name if rule is not None else None, "knobs": rule.knobs() if rule is not None else None,
        "runs": len(runs),
        "completion_tokens": tokens, "seconds": seconds,
        "tokens_per_s": metrics.rate(tokens, seconds),
        "median_tokens_per_s": metrics.median(per_prompt),
        "speedup_vs_hf_generate": None, "speedup_vs_ar": None, "speedup_vs_strict": None,
        # time per task: a run's seconds cover its prefill and decoding (Run.seconds)
        "seconds_per_record": seconds / len(runs) if runs else None,
        "mean_completion_tokens": tokens / len(runs) if runs else None,
        **{f"{p}_vs_{ref}": None for ref, _ in TIME_REFERENCES for p in ("task_speedup", "length_ratio")},
        "target_forwards": forwards, "tokens_per_target_forward": metrics.ratio(tokens, forwards),
    }
    stats = [r.stats for r in runs if r.stats is not None]
    if stats:
        k = len(stats[0].accepted_per_position)
        steps = sum(s.steps for s in stats)
        emitted = sum(s.emitted for s in stats)
        drafted = sum(s.drafted for s in stats)
        accepted = sum(s.accepted for s in stats)
        relaxed = sum(s.relaxed for s in stats)
        app = [sum(s.accepted_per_position[i] for s in stats) for i in range(k)]
        dpp = [sum(s.drafted_per_position[i] for s in stats) for i in range(k)]
        k_counts = metrics.steps_by_draft_length(dpp, steps)
        # A tree step's cost is that of its N+1 tokens, not of its depth: no ideal for trees.
        ideal = (metrics.ideal_speedup(k_counts, emitted, t_target, t_draft)
                 if t_target and spec.kind not in TREE_METHODS else None)
        out.update({
            "steps": steps, "drafted": drafted, "accepted": accepted, "relaxed": relaxed,
            "acceptance_length": metrics.ratio(emitted, steps),
            "acceptance_rate": metrics.ratio(accepted, drafted),
            "per_position_acceptance_rate": metrics.per_position_rates(app, dpp),
            "accepted_per_step_hist": [sum(s.accepted_hist[i] for s in stats) for i in range(k + 1)],
            "steps_by_draft_length": k_counts,
            "relaxed_share": metrics.ratio(relaxed, emitted),
            "ideal_speedup_vs_ar": ideal, "measured_over_ideal": None,
        })
    else:
        out.update({k: None for k in ("steps", "drafted", "accepted", "relaxed", "acceptance_length",
                                      "acceptance_rate", "per_position_acceptance_rate",
                                      "accepted_per_step_hist", "steps_by_draft_length", "relaxed_share",
                                      "ideal_speedup_vs_ar", "measured_over_ideal")})
    compared = [r for r in runs if r.exact is not None]
    nll_tokens = sum(len(r.nll) for r in runs)
    rouge = [r.rouge_l for r in runs if r.rouge_l is not None]
    out.update({
        "exact_match_rate": metrics.mean([float(r.exact) for r in compared]) if compared else None,
        "exact_matches": sum(bool(r.exact) for r in compared) if compared else None,
        "prefix_share": metrics.mean([r.prefix_share for r in compared]) if compared else None,
        "nll_per_token": sum(sum(r.nll) for r in runs) / nll_tokens if nll_tokens else None,
        "rouge_l": metrics.mean(rouge) if rouge else None,
        "rouge_l_prompts": len(rouge),
        # label-free warning signs of a rule that runs away (marscli.verification.guard)
        "repeat_share": metrics.mean([r.repetition["repeat_share"] for r in runs]) if runs else None,
        "loop_share": metrics.mean([float(r.repetition["ends_in_loop"]) for r in runs]) if runs else None,
    })
    return out


def paired_time_ratios(mine: Sequence[Run], ref: Sequence[Run]) -> tuple[float | None, float | None]:
    """(task speed-up, length ratio) of `mine` against `ref` over the (record, seed) pairs both
    ran: ref's seconds per record / mine's, and mine's completion tokens / ref's. In bench
    every method runs every record and seed, so the pairs are all of both methods' runs."""
    ref_by = {(r.prompt.id, r.seed): r for r in ref}
    pairs = [(r, ref_by[key]) for r in mine if (key := (r.prompt.id, r.seed)) in ref_by]
    task = metrics.ratio(sum(b.seconds for _, b in pairs), sum(a.seconds for a, _ in pairs))
    length = metrics.ratio(sum(len(a.tokens) for a, _ in pairs), sum(len(b.tokens) for _, b in pairs))
    return task, length


def _add_ratios(per_method: dict[str, dict[str, Any]], runs_of: dict[str, Sequence[Run]],
                refs: dict[str, str | None]) -> None:
    """Ratios against the reference methods (refs: TIME_REFERENCES' suffix -> method name or
    None): tokens/s (`speedup_vs_*`), time per record (`task_speedup_vs_*`) and answer length
    (`length_ratio_vs_*`)."""
    for name, a in per_method.items():
        for suffix, ref in refs.items():
            if ref is None:
                continue
            a[f"speedup_vs_{suffix}"] = metrics.ratio(a["tokens_per_s"], per_method[ref]["tokens_per_s"])
            a[f"task_speedup_vs_{suffix}"], a[f"length_ratio_vs_{suffix}"] = paired_time_ratios(
                runs_of[name], runs_of[ref])
        if a.get("ideal_speedup_vs_ar") is not None:
            a["measured_over_ideal"] = metrics.ratio(a["speedup_vs_ar"], a["ideal_speedup_vs_ar"])


def summarize(cfg: BenchConfig, runs: Sequence[Run], limit_info: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """Per-method figures: per seed, then across seeds (mean, and std as the spread)."""
    t_target = limit_info["_t_target"] if limit_info else None
    t_draft = limit_info["_t_draft"] if limit_info else 0.0
    refs = {suffix: next((m.name for m in cfg.methods if m.kind == kind), None) for suffix, kind in TIME_REFERENCES}
    per_seed: list[dict[str, dict[str, Any]]] = []
    for seed in cfg.seeds:
        seed_runs = {m.name: [r for r in runs if r.method == m.name and r.seed == seed] for m in cfg.methods}
        seed_methods = {m.name: aggregate(seed_runs[m.name], m, t_target, t_draft, cfg.margin) for m in cfg.methods}
        _add_ratios(seed_methods, seed_runs, refs)
        per_seed.append(seed_methods)
    out: dict[str, dict[str, Any]] = {}
    for m in cfg.methods:
        pooled = aggregate([r for r in runs if r.method == m.name], m, t_target, t_draft, cfg.margin)
        if len(cfg.seeds) == 1:
            pooled.update({f: per_seed[0][m.name][f] for f in SPREAD_FIELDS})
        else:
            spread = {}
            for f in SPREAD_FIELDS:
                vals = [s[m.name][f] for s in per_seed if s[m.name][f] is not None]
                pooled[f] = metrics.mean(vals)
                spread[f] = metrics.std(vals)
            pooled["spread"] = spread
            pooled["seeds"] = [{"seed": seed, **{f: s[m.name][f] for f in SPREAD_FIELDS}}
                               for seed, s in zip(cfg.seeds, per_seed)]
        out[m.name] = pooled
    return out



def round_or_none(v: float | None, digits: int = 4) -> float | None:
    return None if v is None else round(v, digits)


def chain_or_tree(draft: DraftConfig, tree: bool) -> DraftConfig:
    """The drafter of a chain method (no tree) or of a tree method (the --tree-* settings,
    else the drafter's defaults: EAGLE-3's, or a draft model's sibling tree)."""
    if not tree:
        return dataclasses.replace(draft, tree_depth=None, tree_top_k=None, tree_tokens=None)
    if draft.tree:
        return draft
    if draft.kind == MODEL:
        return dataclasses.replace(draft, tree_depth=None, tree_top_k=MODEL_TREE_DEFAULTS[0],
                                   tree_tokens=MODEL_TREE_DEFAULTS[1])
    return dataclasses.replace(draft, tree_depth=DEFAULT_TREE.depth, tree_top_k=DEFAULT_TREE.top_k,
                               tree_tokens=DEFAULT_TREE.tokens)
