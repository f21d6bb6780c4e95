"""marscli bench: speed and quality of every method, side by side, in one process.

Methods, all on the same target, drafter, prompts, max tokens, temperature and seed:

- ``hf-generate``: transformers' ``generate()``, no drafter (the baseline).
- ``hf-assisted``: transformers' assisted generation with the same drafter: the draft model
  as ``assistant_model`` (``num_assistant_tokens`` = K), or ``prompt_lookup_num_tokens`` = K
  for the n-gram drafter.
- ``ar``: marscli's engine with no drafter (plain decoding through the same loop).
- ``strict``: marscli speculative decoding with exact verification.
- ``mars@THETA``: marscli with margin-aware verification, one method per theta.
- ``strict-tree`` and ``mars-tree@THETA`` (EAGLE-3 drafters only): the same with the head
  drafting an EAGLE-2 dynamic tree (the --tree-* settings, else EAGLE-3's defaults) instead of
  a chain, so chain and tree compare side by side. ``strict``/``mars`` then draft chains.

Protocol: every method runs once on the first prompt (warm-up, not measured); then, per seed
and per prompt, every method runs once, the order rotating from prompt to prompt, so machine
drift and cache effects hit all methods alike. Only generation is timed; scoring (target NLL,
ROUGE-L) happens between runs. Greedy ``ar`` and ``strict`` outputs must equal the
reference's (``hf-generate``'s) token for token: a difference is a correctness failure,
listed in the report and turned into exit code 1, never averaged away.

Report layout and column meanings: docs/benchmarks.md.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import platform
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from marscli import __version__, metrics
from marscli.config import (
    PAPER_THETA,
    DraftConfig,
    MarginKind,
    ModelConfig,
    RecordError,
    Request,
    SamplingParams,
    VerifyConfig,
)
from marscli.errors import EXIT_OK, EXIT_RUNTIME, InputError, MarscliError, UsageError

HF_GENERATE = "hf-generate"
HF_ASSISTED = "hf-assisted"
AR = "ar"
STRICT = "strict"
MARS = "mars"
STRICT_TREE = "strict-tree"
MARS_TREE = "mars-tree"
ALL_METHODS = (HF_GENERATE, HF_ASSISTED, AR, STRICT, MARS, STRICT_TREE, MARS_TREE)
DEFAULT_METHODS = ",".join((HF_GENERATE, HF_ASSISTED, AR, STRICT, MARS))
#: The default for an EAGLE-3 drafter: transformers has no EAGLE-3 assisted generation, and
#: chain and tree drafting compare side by side.
DEFAULT_EAGLE3_METHODS = ",".join((HF_GENERATE, AR, STRICT, STRICT_TREE, MARS, MARS_TREE))
#: Methods whose greedy output must equal the reference method's token for token.
EXACT_METHODS = (AR, STRICT, STRICT_TREE)
#: Methods that need a drafter.
DRAFTED_METHODS = (HF_ASSISTED, STRICT, MARS, STRICT_TREE, MARS_TREE)
#: Methods with per-step statistics (acceptance, relaxed share, the ideal speedup).
SPEC_METHODS = (STRICT, MARS, STRICT_TREE, MARS_TREE)
#: Methods that verify with MARS (one per theta) and methods that draft trees.
MARS_METHODS = (MARS, MARS_TREE)
TREE_METHODS = (STRICT_TREE, MARS_TREE)
#: Methods measured at several batch sizes by --batch-size (transformers refuses assisted
#: generation at batch size > 1, and draft trees run one record at a time).
BATCHED_METHODS = (HF_GENERATE, AR, STRICT, MARS)
#: Reference for quality comparisons, in order of preference.
REFERENCE_METHODS = (HF_GENERATE, AR)

DEFAULT_BENCH_MAX_TOKENS = 128
DEFAULT_THETAS = (PAPER_THETA,)
WARMUP_MAX_TOKENS = 16
FORWARD_TIMING_REPEATS = 5
REPORT_FORMAT = 1
EXIT_CORRECTNESS = EXIT_RUNTIME
_MIB = 1024 * 1024

#: Scalars averaged over seeds (their std is the "spread" of a sampling run).
SPREAD_FIELDS = (
    "tokens_per_s", "median_tokens_per_s", "speedup_vs_hf_generate", "speedup_vs_ar",
    "acceptance_length", "acceptance_rate", "relaxed_share", "tokens_per_target_forward",
    "exact_match_rate", "prefix_share", "nll_per_token", "rouge_l",
    "ideal_speedup_vs_ar", "measured_over_ideal",
)

Log = Callable[[str], None]


# --------------------------------------------------------------------------------------------
# Configuration


@dataclass(frozen=True)
class MethodSpec:
    name: str  # label in tables and the report: "strict", "mars@0.9"
    kind: str  # one of ALL_METHODS
    theta: float | None = None


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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def sampling(self, seed: int, max_tokens: int | None = None) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, max_tokens=max_tokens or self.max_tokens, seed=seed)


def parse_methods(text: str, thetas: Sequence[float]) -> tuple[MethodSpec, ...]:
    """'hf-generate,ar,mars' + thetas -> method specs; `mars` becomes one method per theta."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise UsageError("--methods is empty; choose from " + ", ".join(ALL_METHODS))
    out: list[MethodSpec] = []
    for name in names:
        if name not in ALL_METHODS:
            raise UsageError(f"unknown method {name!r} in --methods; choose from {', '.join(ALL_METHODS)}")
        specs = ([MethodSpec(f"{name}@{t:g}", name, t) for t in thetas] if name in MARS_METHODS
                 else [MethodSpec(name, name)])
        out.extend(s for s in specs if s not in out)
    return tuple(out)


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
    trees = [m.name for m in cfg.methods if m.kind in TREE_METHODS]
    if trees and cfg.draft.kind != "eagle3":
        raise UsageError(f"{', '.join(trees)} draft trees with an EAGLE-3 head: --draft eagle3:PATH")
    if cfg.draft.kind == "eagle3" and any(m.kind == HF_ASSISTED for m in cfg.methods):
        raise UsageError("transformers has no assisted generation with an EAGLE-3 head: drop "
                         "hf-assisted from --methods")
    if cfg.draft.kind == "none":
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


def read_prompt_records(source: str, limit: int | None) -> tuple[list[tuple[Request, str | None]], list[dict], int]:
    """The first `limit` records of a JSONL input -> ([(request, reference text)], skipped,
    number of records whose per-record sampling overrides are ignored)."""
    from marscli.io.records import find_duplicate_ids, read_requests

    data = _read_bytes(source)
    lines = data.split(b"\n")
    items: list[Request | RecordError] = []
    for item in read_requests(io.BytesIO(data)):
        if limit is not None and len(items) >= limit:
            break
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
    from marscli.io.records import open_input

    if source == "-":
        return sys.stdin.buffer.read()
    with open_input(source) as f:
        return f.read()


def _reference_of(raw: bytes) -> str | None:
    try:
        obj = json.loads(raw.decode("utf-8-sig"))
    except ValueError:
        return None
    return metrics.reference_text(obj) if isinstance(obj, dict) else None


# --------------------------------------------------------------------------------------------
# Running


@dataclass
class Run:
    """One method on one prompt with one seed."""

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

    def to_json(self) -> dict[str, Any]:
        n = len(self.tokens)
        return {
            "method": self.method, "id": self.prompt.id, "seed": self.seed,
            "prompt_tokens": len(self.prompt.ids), "completion_tokens": n,
            "seconds": round(self.seconds, 5),
            "tokens_per_s": _round(metrics.rate(n, self.seconds)),
            "target_forwards": self.target_forwards,
            "acceptance_length": _round(self.stats.acceptance_length) if self.stats is not None else None,
            "relaxed": self.stats.relaxed if self.stats is not None else None,
            "exact_match": self.exact, "prefix_share": _round(self.prefix_share),
            "first_mismatch": self.first_mismatch,
            "nll_per_token": _round(metrics.mean(self.nll)), "rouge_l": _round(self.rouge_l),
        }


class _ForwardCounter:
    """Counts calls of the target's forward (generate(), assisted or not, calls it per step)."""

    def __init__(self, model):
        self.count = 0
        self._handle = model.register_forward_pre_hook(self._hook)

    def _hook(self, *_: Any) -> None:
        self.count += 1

    def remove(self) -> None:
        self._handle.remove()


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers 5 warns about generation flags on every call; bench sets them on purpose."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(level)


Runner = Callable[[list[int], SamplingParams], tuple[list[int], Any]]


class Bench:
    """Runs the methods of a BenchConfig on loaded models and builds the report.

    `runners[name](prompt_ids, sampling) -> (completion token ids, SpecStats or None)` is the
    one seam between methods and the protocol; tests replace a runner to check that a wrong
    output is caught.
    """

    def __init__(self, cfg: BenchConfig, target, draft=None, *, log: Log = lambda _: None):
        from marscli.engine import build_engine

        self.cfg = cfg
        self.target = target
        self.draft = draft
        self.log = log
        self.notes: list[str] = []
        self.hf_assisted: dict[str, Any] | None = None
        none_cfg = DraftConfig(kind="none")
        # Building any engine installs marscli's CPU fast path on the target model object,
        # which transformers' generate() then shares (see the report's notes).
        self._encoder = build_engine(target, None, VerifyConfig(), none_cfg)
        self.runners: dict[str, Runner] = {}
        self.engines: dict[str, Any] = {}
        for m in cfg.methods:
            if m.kind == HF_GENERATE:
                self.runners[m.name] = self._hf_runner({})
            elif m.kind == HF_ASSISTED:
                self.runners[m.name] = self._hf_runner(self._assisted_kwargs())
            else:
                dcfg = none_cfg if m.kind == AR else chain_or_tree(cfg.draft, m.kind in TREE_METHODS)
                vcfg = (VerifyConfig("mars", m.theta, cfg.margin) if m.kind in MARS_METHODS
                        else VerifyConfig(margin=cfg.margin))
                engine = build_engine(target, draft, vcfg, dcfg)
                self.engines[m.name] = engine
                self.runners[m.name] = self._engine_runner(engine)
        self._check_generation_config()

    # ---------------------------------------------------------------- methods

    def _max_new(self, ids: list[int], sampling: SamplingParams) -> int:
        ctx = self.target.context_length
        return sampling.max_tokens if ctx is None else min(sampling.max_tokens, ctx - len(ids))

    def _hf_runner(self, extra: dict[str, Any]) -> Runner:
        import torch

        target = self.target

        def run(ids: list[int], sampling: SamplingParams) -> tuple[list[int], None]:
            x = torch.tensor([ids], dtype=torch.long, device=target.device)  # [1, P]
            kw = self._hf_generate_kwargs(sampling, self._max_new(ids, sampling))
            if not sampling.greedy:
                torch.manual_seed(sampling.seed)
            with _quiet_transformers():
                out = target.model.generate(x, attention_mask=torch.ones_like(x), **kw, **extra)  # [1, P + new]
            return out[0, len(ids):].tolist(), None

        return run

    def _hf_generate_kwargs(self, sampling: SamplingParams, max_new: int) -> dict[str, Any]:
        """Explicit values for every generate() knob that changes greedy or sampled output, so
        the model's generation_config cannot make hf-generate decode differently from marscli."""
        eos = list(self.target.eos_token_ids)
        pad = self.target.tokenizer.pad_token_id
        return {
            "max_new_tokens": max_new, "min_new_tokens": 0, "do_sample": not sampling.greedy, "num_beams": 1,
            "eos_token_id": eos, "pad_token_id": pad if pad is not None else eos[0],
            "repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
            "temperature": 1.0 if sampling.greedy else sampling.temperature, "top_k": 0, "top_p": 1.0,
        }

    def _assisted_kwargs(self) -> dict[str, Any]:
        d = self.cfg.draft
        if d.kind == "ngram":
            self.hf_assisted = {"candidates": "prompt_lookup", "prompt_lookup_num_tokens": d.num_draft_tokens,
                                "max_matching_ngram_size": d.ngram_max}
            return {"prompt_lookup_num_tokens": d.num_draft_tokens, "max_matching_ngram_size": d.ngram_max}
        assistant = self.draft.model
        gc = assistant.generation_config
        # The assistant drafts as many tokens as marscli's K; its other settings stay
        # transformers' defaults (what a user of assisted generation gets).
        gc.num_assistant_tokens = d.num_draft_tokens
        try:  # the values generate() will fill in for unset fields
            defaults = gc._get_default_generation_params()
        except AttributeError:  # pragma: no cover - other transformers versions
            defaults = {}

        def effective(key: str) -> Any:
            value = getattr(gc, key, None)
            return defaults.get(key) if value is None else value

        self.hf_assisted = {"candidates": "assistant_model", "num_assistant_tokens": d.num_draft_tokens,
                            "num_assistant_tokens_schedule": effective("num_assistant_tokens_schedule"),
                            "assistant_confidence_threshold": effective("assistant_confidence_threshold")}
        return {"assistant_model": assistant}

    def _engine_runner(self, engine) -> Runner:
        def run(ids: list[int], sampling: SamplingParams):
            res = engine.generate_ids(ids, sampling)
            return res.token_ids, (res.stats if engine.settings.k_max > 0 else None)

        return run

    def _check_generation_config(self) -> None:
        gc = getattr(self.target.model, "generation_config", None)
        odd = [k for k in ("suppress_tokens", "begin_suppress_tokens", "bad_words_ids", "forced_bos_token_id",
                           "forced_eos_token_id", "sequence_bias") if getattr(gc, k, None) is not None]
        if odd:
            self.notes.append(f"the target's generation_config sets {', '.join(odd)}: transformers' "
                              "generate() applies them and marscli does not, so hf outputs may differ")

    # ---------------------------------------------------------------- protocol

    def encode(self, records: Sequence[tuple[Request, str | None]]) -> tuple[list[BenchPrompt], list[dict]]:
        from marscli.engine.sequence import RecordFailure

        prompts, skipped = [], []
        for req, ref in records:
            try:
                ids = self._encoder.encode(req)
            except RecordFailure as e:
                skipped.append({"id": req.id, "line": req.line, "reason": f"{e.type}: {e.message}"})
                continue
            prompts.append(BenchPrompt(req.id, req.line, ids, ref))
        return prompts, skipped

    def _timed(self, name: str, ids: list[int], sampling: SamplingParams) -> tuple[list[int], Any, float, int]:
        import torch

        cuda = self.target.device.type == "cuda"
        counter = _ForwardCounter(self.target.model)
        try:
            if cuda:  # pragma: no cover - needs a GPU
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            tokens, stats = self.runners[name](ids, sampling)
            if cuda:  # pragma: no cover
                torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
        finally:
            counter.remove()
        return tokens, stats, seconds, counter.count

    def warm_up(self, prompt: BenchPrompt) -> dict[str, dict[str, float | None]]:
        """Run every method once (not measured); return each one's memory figures."""
        import torch

        memory: dict[str, dict[str, float | None]] = {}
        sampling = self.cfg.sampling(self.cfg.seeds[0], min(WARMUP_MAX_TOKENS, self.cfg.max_tokens))
        for m in self.cfg.methods:
            if self.target.device.type == "cuda":  # pragma: no cover - needs a GPU
                torch.cuda.reset_peak_memory_stats()
            self._timed(m.name, prompt.ids, sampling)
            memory[m.name] = {
                "peak_rss_mib": _round(_peak_rss_mib(), 1),
                "cuda_peak_mib": _round(torch.cuda.max_memory_allocated() / _MIB, 1)
                if self.target.device.type == "cuda" else None,
            }
        return memory

    def measure_forwards(self, ids: list[int]) -> dict[str, Any]:
        """Median target forward time for n = 1..K+1 new tokens over a cached context of
        `ids`, and the draft model's for one token."""
        k = self.cfg.draft.num_draft_tokens if self.cfg.draft.kind != "none" else 0
        if any(m.kind in TREE_METHODS for m in self.cfg.methods):  # a tree pass scores N+1 tokens
            k = max(k, chain_or_tree(self.cfg.draft, True).tree_tokens - 1)
        t_target = _forward_times(self.target.model, self.target.device, ids, k + 1)
        t_draft = None
        if self.draft is not None and self.cfg.draft.kind != "eagle3":  # a head has no forward of its own here
            t_draft = _forward_times(self.draft.model, self.draft.device, ids, 1)[0]
        return {
            "context_tokens": len(ids),
            "repeats": FORWARD_TIMING_REPEATS,
            "target_forward_s": {str(n + 1): _round(t, 6) for n, t in enumerate(t_target)},
            "t_1_s": _round(t_target[0], 6),
            "t_k_plus_1_s": _round(t_target[-1], 6),
            "draft_forward_s": _round(t_draft, 6),
            "_t_target": t_target,
            "_t_draft": t_draft or 0.0,
        }

    def run(self, prompts: Sequence[BenchPrompt], progress: Callable[[int, int], None] | None = None) -> list[Run]:
        """Every seed x prompt x method, methods rotating per prompt; quality scored in between."""
        names = [m.name for m in self.cfg.methods]
        runs: list[Run] = []
        total = len(self.cfg.seeds) * len(prompts) * len(names)
        done = 0
        cuda_peak: dict[str, float] = {}
        for seed in self.cfg.seeds:
            sampling = self.cfg.sampling(seed)
            for i, prompt in enumerate(prompts):
                order = names[i % len(names):] + names[: i % len(names)]
                out: dict[str, Run] = {}
                for name in order:
                    if self.target.device.type == "cuda":  # pragma: no cover - needs a GPU
                        import torch

                        torch.cuda.reset_peak_memory_stats()
                    tokens, stats, seconds, fwd = self._timed(name, prompt.ids, sampling)
                    if self.target.device.type == "cuda":  # pragma: no cover
                        import torch

                        cuda_peak[name] = max(cuda_peak.get(name, 0.0), torch.cuda.max_memory_allocated() / _MIB)
                    out[name] = Run(name, prompt, seed, tokens, seconds, fwd, stats)
                    done += 1
                    if progress is not None:
                        progress(done, total)
                self._score(prompt, [out[n] for n in names])
                runs.extend(out[n] for n in names)
        self.cuda_peak_mib = cuda_peak
        return runs

    def throughput(self, prompts: Sequence[BenchPrompt],
                   progress: Callable[[int, int], None] | None = None) -> list[dict[str, Any]]:
        """Batched throughput: every batched method at every --batch-size over all prompts.

        marscli's methods run through the engine's scheduler (continuous refill); hf-generate runs
        transformers' generate() on consecutive left-padded batches (static batching, what
        its users get). Each row: tokens/s over the whole set, and whether the outputs equal
        the method's outputs at the first batch size.
        """
        import hashlib

        import torch

        from marscli.engine import build_engine

        cfg = self.cfg
        sampling = cfg.sampling(cfg.seeds[0])
        cuda = self.target.device.type == "cuda"
        methods = [m for m in cfg.methods if m.kind in BATCHED_METHODS]
        total = len(methods) * len(cfg.batch_sizes)
        rows: list[dict[str, Any]] = []
        first_outputs: dict[str, list[list[int]]] = {}  # per method, at the first batch size
        first_tps: dict[str, float | None] = {}
        for m in methods:
            for bs in cfg.batch_sizes:
                if cuda:  # pragma: no cover - needs a GPU
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                extra: dict[str, Any] = {}
                t0 = time.perf_counter()
                if m.kind == HF_GENERATE:
                    outputs = self._hf_batched(prompts, sampling, bs)
                    stats = None
                else:
                    dcfg = DraftConfig(kind="none") if m.kind == AR else cfg.draft
                    vcfg = (VerifyConfig("mars", m.theta, cfg.margin) if m.kind == MARS
                            else VerifyConfig(margin=cfg.margin))
                    engine = build_engine(self.target, self.draft, vcfg, dcfg, bs)
                    results: dict[int, Any] = {}
                    for i, res in engine.run(range(len(prompts)), lambda i: (prompts[i].ids, sampling)):
                        if isinstance(res, BaseException):
                            raise res
                        results[i] = res
                    outputs = [results[i].token_ids for i in range(len(prompts))]
                    stats = [results[i].stats for i in range(len(prompts))]
                    extra = {"prefill_seconds": engine.prefill_seconds,
                             "peak_kv_cache_mib": engine.peak_cache_bytes / _MIB,
                             "oom_halvings": engine.oom_retries}
                if cuda:  # pragma: no cover
                    torch.cuda.synchronize()
                seconds = time.perf_counter() - t0
                tokens = sum(len(o) for o in outputs)
                ref = first_outputs.setdefault(m.name, outputs)
                row = {
                    "method": m.name, "kind": m.kind, "batch_size": bs, "prompts": len(prompts),
                    "completion_tokens": tokens, "seconds": seconds,
                    "tokens_per_s": metrics.rate(tokens, seconds),
                    "speedup_vs_first_batch_size": None,  # below, once tokens/s is known
                    "acceptance_length": (metrics.ratio(sum(s.emitted for s in stats), sum(s.steps for s in stats))
                                          if stats and self.cfg.draft.kind != "none" and m.kind != AR else None),
                    "outputs_equal_first_batch_size": sum(a == b for a, b in zip(outputs, ref)),
                    "outputs_sha256": hashlib.sha256(json.dumps(outputs).encode()).hexdigest()[:16],
                    "peak_rss_mib": _round(_peak_rss_mib(), 1),
                    "cuda_peak_mib": _round(torch.cuda.max_memory_allocated() / _MIB, 1) if cuda else None,
                    **extra,
                }
                base_tps = first_tps.setdefault(m.name, row["tokens_per_s"])
                row["speedup_vs_first_batch_size"] = metrics.ratio(row["tokens_per_s"], base_tps)
                rows.append(row)
                self.log(f"throughput: {m.name} batch {bs}: {row['tokens_per_s']:.1f} tokens/s")
                if progress is not None:
                    progress(len(rows), total)
        return rows

    def _hf_batched(self, prompts: Sequence[BenchPrompt], sampling: SamplingParams, bs: int) -> list[list[int]]:
        """transformers' generate() on consecutive batches of `bs` left-padded prompts; each
        row's completion is cut after its first end-of-sequence token."""
        import torch

        target = self.target
        eos = set(target.eos_token_ids)
        if not sampling.greedy:
            torch.manual_seed(sampling.seed)
        outputs: list[list[int]] = []
        for start in range(0, len(prompts), bs):
            chunk = prompts[start: start + bs]
            kw = self._hf_generate_kwargs(sampling, min(self._max_new(p.ids, sampling) for p in chunk))
            width = max(len(p.ids) for p in chunk)
            ids = torch.full((len(chunk), width), kw["pad_token_id"], dtype=torch.long)
            mask = torch.zeros(len(chunk), width, dtype=torch.long)
            for b, p in enumerate(chunk):
                ids[b, width - len(p.ids):] = torch.tensor(p.ids)
                mask[b, width - len(p.ids):] = 1
            with _quiet_transformers():
                out = target.model.generate(ids.to(target.device), attention_mask=mask.to(target.device),
                                            **kw)  # [b, width + new]
            for row in out[:, width:].tolist():
                cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
                outputs.append(row[:cut])
        return outputs

    def reference_method(self) -> str | None:
        for kind in REFERENCE_METHODS:
            for m in self.cfg.methods:
                if m.kind == kind:
                    return m.name
        return None

    def _score(self, prompt: BenchPrompt, runs: list[Run]) -> None:
        ref_name = self.reference_method()
        ref = next((r for r in runs if r.method == ref_name), None)
        nll_cache: dict[tuple[int, ...], list[float]] = {}
        rouge = prompt.reference is not None and metrics.rouge_available()
        for r in runs:
            if ref is not None:
                r.exact = metrics.exact_match(r.tokens, ref.tokens)
                r.prefix_share = metrics.prefix_share(r.tokens, ref.tokens)
                r.first_mismatch = metrics.first_mismatch(r.tokens, ref.tokens)
            key = tuple(r.tokens)
            if key not in nll_cache:  # identical outputs (strict, ar, hf-generate) score once
                nll_cache[key] = metrics.completion_nll(self.target.model, prompt.ids, r.tokens)
            r.nll = nll_cache[key]
            if rouge:
                text = self.target.tokenizer.decode(r.tokens, skip_special_tokens=True)
                r.rouge_l = metrics.rouge_l(text, prompt.reference)

    def correctness_failures(self, runs: Sequence[Run]) -> list[dict[str, Any]]:
        """Greedy ar/strict outputs that differ from the reference method's."""
        ref_name = self.reference_method()
        if not self.cfg.greedy or ref_name is None:
            return []
        kinds = {m.name: m.kind for m in self.cfg.methods}
        ref = {(r.prompt.id, r.seed): r for r in runs if r.method == ref_name}
        fails = []
        for r in runs:
            if kinds[r.method] in EXACT_METHODS and r.method != ref_name and r.exact is False:
                base = ref[(r.prompt.id, r.seed)]
                fails.append({
                    "method": r.method, "reference": ref_name, "id": r.prompt.id, "seed": r.seed,
                    "first_mismatch": r.first_mismatch, "completion_tokens": len(r.tokens),
                    "reference_tokens": len(base.tokens),
                    "token": r.tokens[r.first_mismatch] if r.first_mismatch < len(r.tokens) else None,
                    "reference_token": base.tokens[r.first_mismatch] if r.first_mismatch < len(base.tokens) else None,
                })
        return fails


def _forward_times(model, device, ids: list[int], max_n: int) -> list[float]:
    """Median seconds of one forward pass over n = 1..max_n new tokens after `ids` (cached)."""
    import torch

    from marscli.kvcache import new_cache, rollback

    cuda = device.type == "cuda"
    times: list[list[float]] = [[] for _ in range(max_n)]
    with torch.inference_mode():
        cache = new_cache(model)
        model(input_ids=torch.tensor([ids[:-1] or ids], device=device), past_key_values=cache,
              use_cache=True, logits_to_keep=1)
        base = cache.get_seq_length()
        filler = (ids * (max_n // max(len(ids), 1) + 1))[:max_n]  # any tokens: only time matters
        for rep in range(FORWARD_TIMING_REPEATS + 1):  # the first round warms up
            for n in range(1, max_n + 1):
                x = torch.tensor([filler[:n]], dtype=torch.long, device=device)  # [1, n]
                if cuda:  # pragma: no cover - needs a GPU
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                model(input_ids=x, past_key_values=cache, use_cache=True)
                if cuda:  # pragma: no cover
                    torch.cuda.synchronize()
                if rep:
                    times[n - 1].append(time.perf_counter() - t0)
                rollback(cache, base)
    return [metrics.median(t) for t in times]


def _peak_rss_mib() -> float | None:
    try:
        import resource
    except ImportError:  # pragma: no cover - Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / _MIB if sys.platform == "darwin" else peak / 1024  # bytes on macOS, KiB on Linux


# --------------------------------------------------------------------------------------------
# Aggregation


def aggregate(runs: Sequence[Run], spec: MethodSpec, t_target: Sequence[float] | None,
              t_draft: float) -> dict[str, Any]:
    """One method's figures over `runs` (one seed, or pooled)."""
    tokens = sum(len(r.tokens) for r in runs)
    seconds = sum(r.seconds for r in runs)
    forwards = sum(r.target_forwards for r in runs)
    per_prompt = [v for r in runs if (v := metrics.rate(len(r.tokens), r.seconds)) is not None]
    out: dict[str, Any] = {
        "kind": spec.kind, "theta": spec.theta, "runs": len(runs),
        "completion_tokens": tokens, "seconds": seconds,
        "tokens_per_s": metrics.rate(tokens, seconds),
        "median_tokens_per_s": metrics.median(per_prompt),
        "speedup_vs_hf_generate": None, "speedup_vs_ar": None,
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
    })
    return out


def _add_ratios(per_method: dict[str, dict[str, Any]], hf: str | None, ar: str | None) -> None:
    hf_tps = per_method[hf]["tokens_per_s"] if hf else None
    ar_tps = per_method[ar]["tokens_per_s"] if ar else None
    for a in per_method.values():
        a["speedup_vs_hf_generate"] = metrics.ratio(a["tokens_per_s"], hf_tps)
        a["speedup_vs_ar"] = metrics.ratio(a["tokens_per_s"], ar_tps)
        if a.get("ideal_speedup_vs_ar") is not None:
            a["measured_over_ideal"] = metrics.ratio(a["speedup_vs_ar"], a["ideal_speedup_vs_ar"])


def summarize(cfg: BenchConfig, runs: Sequence[Run], limit_info: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """Per-method figures: per seed, then across seeds (mean, and std as the spread)."""
    t_target = limit_info["_t_target"] if limit_info else None
    t_draft = limit_info["_t_draft"] if limit_info else 0.0
    hf = next((m.name for m in cfg.methods if m.kind == HF_GENERATE), None)
    ar = next((m.name for m in cfg.methods if m.kind == AR), None)
    per_seed: list[dict[str, dict[str, Any]]] = []
    for seed in cfg.seeds:
        seed_methods = {m.name: aggregate([r for r in runs if r.method == m.name and r.seed == seed], m, t_target, t_draft)
                        for m in cfg.methods}
        _add_ratios(seed_methods, hf, ar)
        per_seed.append(seed_methods)
    out: dict[str, dict[str, Any]] = {}
    for m in cfg.methods:
        pooled = aggregate([r for r in runs if r.method == m.name], m, t_target, t_draft)
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


# --------------------------------------------------------------------------------------------
# The whole run


def run_bench(cfg: BenchConfig, log: Log, *, console=None, quiet: bool = False) -> int:
    """Load models, run every method, print tables, write the report and plot; return the
    exit code (1 after writing everything when a correctness check failed)."""
    check_config(cfg)
    records, skipped, overridden = read_prompt_records(cfg.input, cfg.limit)
    if not records:
        raise InputError(f"{cfg.input}: no usable records to benchmark")
    from marscli.models import check_vocab_compatible, load_model

    t_load = time.perf_counter()
    target = load_model(cfg.target, role="target", log=log)
    draft = None
    if cfg.draft_model is not None and cfg.draft.kind == "eagle3":
        from marscli.eagle3 import load_head

        draft = load_head(str(cfg.draft_model.source), target, log=log)
    elif cfg.draft_model is not None:
        draft = load_model(cfg.draft_model, role="draft", log=log)
        check_vocab_compatible(target, draft)
    log(f"loaded {target.name} on {target.device} in {time.perf_counter() - t_load:.1f} s")
    bench = Bench(cfg, target, draft, log=log)
    report = bench_report(bench, records, skipped, overridden, console=console, quiet=quiet)
    failures = report["correctness_failures"]
    if console is not None:
        if not quiet:
            render_tables(report, console)
        for f in failures:
            console.print(f"[bold red]CORRECTNESS FAILURE: {f['method']} output differs from {f['reference']} "
                          f"on id {f['id']} (seed {f['seed']}) at token {f['first_mismatch']}[/]", soft_wrap=True)
    write_outputs(cfg, report, log)
    return EXIT_CORRECTNESS if failures else EXIT_OK


def bench_report(bench: Bench, records, skipped: list[dict], overridden: int = 0, *,
                 console=None, quiet: bool = True) -> dict[str, Any]:
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
    if not metrics.rouge_available():
        notes.append("rouge-score is not installed (pip install 'marscli[bench]'): no ROUGE-L")
    elif not any(p.reference for p in prompts):
        notes.append("no record has a reference answer: no ROUGE-L")
    names = ", ".join(m.name for m in cfg.methods)
    log(f"{len(prompts)} prompts x {len(cfg.seeds)} seed(s) x {len(cfg.methods)} methods: {names}")

    memory = bench.warm_up(prompts[0])
    lengths = sorted(len(p.ids) for p in prompts)
    context = sorted(prompts, key=lambda p: len(p.ids))[len(prompts) // 2].ids
    limit_info = bench.measure_forwards(context)
    runs = _with_progress(console, quiet, log, lambda update: bench.run(prompts, update))
    throughput: list[dict[str, Any]] = []
    if cfg.batch_sizes:
        log(f"throughput: batch sizes {', '.join(map(str, cfg.batch_sizes))} over all {len(prompts)} prompts")
        throughput = _with_progress(console, quiet, log, lambda update: bench.throughput(prompts, update))
    per_method = summarize(cfg, runs, limit_info)
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
        ("transformers' generate() ran on the same target model object as marscli, with marscli's CPU "
         "fast path (marscli/fastpath.py) installed on its linear layers")
        if target_is_cpu(bench) else "the target runs on CUDA: no CPU fast path",
        ("tokens_per_s counts completion tokens (an EOS included) over generation time only; "
         "prompt encoding and quality scoring are not timed"),
        ("peak_rss_mib is the process's peak resident memory right after the method's warm-up run "
         "(methods warm up in the listed order): it only grows, and includes the models, earlier "
         "methods and Python itself, so only increases between methods say anything about a method"),
        ("ideal_speedup_vs_ar: plain decoding costs one target forward a token; a perfect engine "
         "costs t(k+1) (+ k draft forwards) per step, for the draft lengths and acceptance measured; "
         "measured_over_ideal = speedup_vs_ar / ideal_speedup_vs_ar"),
    ]
    if cfg.batch_sizes:
        notes.append("throughput: each method decodes all prompts at each --batch-size, sizes in the given "
                     "order; marscli methods refill a finished row's place at once (continuous batching), "
                     "hf-generate runs consecutive left-padded batches (static batching); tokens_per_s "
                     "includes prompt prefill; outputs_equal_first_batch_size counts prompts whose output "
                     "equals the method's at the first batch size; peak_rss_mib only grows through the run"
                     + ("" if cfg.greedy else "; sampling: the first seed only"))
    if not cfg.greedy:
        notes.append("sampling: exact match and prefix share compare samples of different methods "
                     "with the same seed (different random streams), so they measure agreement, not "
                     "correctness; figures are means over seeds, 'spread' holds their std")
    report: dict[str, Any] = {
        "marscli_bench": REPORT_FORMAT,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "input": cfg.input,
        "settings": {
            "methods": [m.name for m in cfg.methods],
            "max_tokens": cfg.max_tokens, "temperature": cfg.temperature, "seeds": list(cfg.seeds),
            "limit": cfg.limit, "margin": cfg.margin,
            "thetas": sorted({m.theta for m in cfg.methods if m.kind in MARS_METHODS}),
            "drafter": {"kind": cfg.draft.kind, "model": cfg.draft.model,
                        "num_draft_tokens": cfg.draft.num_draft_tokens, "adaptive": cfg.draft.adaptive,
                        "ngram_max": cfg.draft.ngram_max, "ngram_min": cfg.draft.ngram_min,
                        **_tree_settings(cfg)},
            "hf_assisted": bench.hf_assisted,
            "warmup_max_tokens": min(WARMUP_MAX_TOKENS, cfg.max_tokens),
            "batch_sizes": list(cfg.batch_sizes),
        },
        "environment": _environment(bench),
        "target": bench.target.identity,
        "draft": bench.draft.identity if bench.draft is not None else None,
        "prompts": {
            "used": len(prompts), "skipped": skipped,
            "prompt_tokens": {"min": lengths[0], "median": metrics.median(lengths), "max": lengths[-1]},
            "with_reference": sum(p.reference is not None for p in prompts),
        },
        "reference_method": ref,
        "methods": per_method,
        "physical_limit": physical,
        "correctness": {"checked": bool(cfg.greedy and ref and exact_checked), "reference": ref,
                        "methods": exact_checked if cfg.greedy else [], "failures": len(failures)},
        "correctness_failures": failures,
        "throughput": throughput,
        "runs": [r.to_json() for r in runs],
        "notes": notes,
    }
    return _json_safe(report)


def chain_or_tree(draft: DraftConfig, tree: bool) -> DraftConfig:
    """The drafter of a chain method (no tree) or of a tree method (the --tree-* settings,
    else EAGLE-3's defaults)."""
    from dataclasses import replace

    if not tree:
        return replace(draft, tree_depth=None, tree_top_k=None, tree_tokens=None)
    if draft.tree:
        return draft
    from marscli.drafters.eagle3 import DEFAULT_TREE

    return replace(draft, tree_depth=DEFAULT_TREE.depth, tree_top_k=DEFAULT_TREE.top_k,
                   tree_tokens=DEFAULT_TREE.tokens)


def _tree_settings(cfg: BenchConfig) -> dict[str, Any]:
    if not any(m.kind in TREE_METHODS for m in cfg.methods):
        return {}
    t = chain_or_tree(cfg.draft, True)
    return {"tree": {"depth": t.tree_depth, "top_k": t.tree_top_k, "tokens": t.tree_tokens}}


def target_is_cpu(bench: Bench) -> bool:
    return bench.target.device.type == "cpu"


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


def write_outputs(cfg: BenchConfig, report: dict[str, Any], log: Log) -> None:
    from marscli.io.results import atomic_write_text

    text = json.dumps(report, indent=2, ensure_ascii=False, allow_nan=False) + "\n"
    if cfg.report == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
    elif cfg.report:
        try:
            atomic_write_text(cfg.report, text)
        except OSError as e:
            raise MarscliError(f"cannot write the report to {cfg.report}: {e.strerror or e}") from None
        log(f"report written to {cfg.report}")
    if cfg.plot:
        try:
            write_plot(report, cfg.plot)
        except OSError as e:
            raise MarscliError(f"cannot write the plot to {cfg.plot}: {e.strerror or e}") from None
        log(f"plot written to {cfg.plot}")


def _round(v: float | None, digits: int = 4) -> float | None:
    return None if v is None else round(v, digits)


def _json_safe(obj: Any) -> Any:
    """Floats rounded to 6 significant places; inf (theta that never relaxes) as a string."""
    if isinstance(obj, float):
        if not math.isfinite(obj):
            return None if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
        return float(f"{obj:.6g}")
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def _with_progress(console, quiet: bool, log: Log, work: Callable[[Callable[[int, int], None]], Any]) -> Any:
    """Run work(update) with a progress display that is closed however work ends."""
    progress = _Progress(console, quiet, log)
    progress.start()
    try:
        return work(progress.update)
    finally:
        progress.close()


class _Progress:
    """A rich bar on a terminal, a plain line every few seconds otherwise, nothing if quiet."""

    PLAIN_EVERY_S = 10.0

    def __init__(self, console, quiet: bool, log: Log):
        self.console, self.quiet, self.log = console, quiet, log
        self.bar = None
        self.t0 = self.last = time.perf_counter()

    def start(self) -> None:
        if not self.quiet and self.console is not None and self.console.is_terminal:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )

            self.bar = Progress(TextColumn("bench"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                console=self.console, redirect_stdout=False, redirect_stderr=False,
                                transient=True)
            self.task = self.bar.add_task("bench", total=None)
            self.bar.start()

    def update(self, done: int, total: int) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=done, total=total)
        elif not self.quiet and time.perf_counter() - self.last >= self.PLAIN_EVERY_S:
            self.last = time.perf_counter()
            self.log(f"{done}/{total} runs, {self.last - self.t0:.0f} s")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


# --------------------------------------------------------------------------------------------
# Tables


def _fmt(v: Any, spec: str) -> str:
    if v is None:
        return "-"
    return format(v, spec)


def _cell(a: dict[str, Any], f: str, spec: str) -> str:
    s = _fmt(a.get(f), spec)
    sd = (a.get("spread") or {}).get(f)
    return f"{s} ± {format(sd, spec)}" if sd is not None and s != "-" else s


TABLE_COLUMNS = (
    # (header, field, format)
    ("tok/s", "tokens_per_s", ".1f"),
    ("median tok/s", "median_tokens_per_s", ".1f"),
    ("x hf-gen", "speedup_vs_hf_generate", ".2f"),
    ("x ar", "speedup_vs_ar", ".2f"),
    ("tau", "acceptance_length", ".2f"),
    ("accept", "acceptance_rate", ".2f"),
    ("relaxed", "relaxed_share", ".3f"),
    ("exact", "exact_match_rate", ".2f"),
    ("prefix", "prefix_share", ".3f"),
    ("NLL/tok", "nll_per_token", ".3f"),
    ("ROUGE-L", "rouge_l", ".3f"),
    ("ideal x ar", "ideal_speedup_vs_ar", ".2f"),
    ("meas/ideal", "measured_over_ideal", ".2f"),
)


def render_tables(report: dict[str, Any], console) -> None:
    from rich.table import Table

    s = report["settings"]
    mode = "greedy" if s["temperature"] == 0 else f"temperature {s['temperature']:g}, seeds {s['seeds']}"
    d = s["drafter"]
    title = (f"marscli bench: {report['prompts']['used']} prompts, max {s['max_tokens']} tokens, {mode}, "
             f"drafter {d['kind'] if d['kind'] != 'model' else d['model']} (K<={d['num_draft_tokens']}), "
             f"target {report['target'].get('name')} on {report['environment']['device']}")
    methods = report["methods"]
    cols = [c for c in TABLE_COLUMNS if any(a.get(c[1]) is not None for a in methods.values())]
    table = Table(title=title, title_justify="left")
    table.add_column("method")
    for header, _, _ in cols:
        table.add_column(header, justify="right")
    for name, a in methods.items():
        table.add_row(name, *[_cell(a, f, spec) for _, f, spec in cols])
    console.print(table)

    spec_methods = {n: a for n, a in methods.items() if a.get("per_position_acceptance_rate")}
    if spec_methods:
        k = max(len(a["per_position_acceptance_rate"]) for a in spec_methods.values())
        pos = Table(title="acceptance rate by draft position", title_justify="left")
        pos.add_column("method")
        for i in range(k):
            pos.add_column(str(i + 1), justify="right")
        for name, a in spec_methods.items():
            pos.add_row(name, *[_fmt(v, ".2f") for v in a["per_position_acceptance_rate"]])
        console.print(pos)
    tp = report.get("throughput") or []
    if tp:
        t = Table(title="batched throughput (all prompts; tokens/s include prefill)", title_justify="left")
        for header in ("method", "batch", "tokens", "seconds", "tokens/s", "vs first batch", "tau",
                       "same output", "prefill s", "peak KV MiB", "peak RSS MiB"):
            t.add_column(header, justify="left" if header == "method" else "right")
        for r in tp:
            t.add_row(r["method"], str(r["batch_size"]), str(r["completion_tokens"]), _fmt(r["seconds"], ".1f"),
                      _fmt(r["tokens_per_s"], ".1f"), _fmt(r["speedup_vs_first_batch_size"], ".2f") + ("x" if r["speedup_vs_first_batch_size"] else ""),
                      _fmt(r["acceptance_length"], ".2f"), f"{r['outputs_equal_first_batch_size']}/{r['prompts']}",
                      _fmt(r.get("prefill_seconds"), ".1f"), _fmt(r.get("peak_kv_cache_mib"), ".1f"),
                      _fmt(r["peak_rss_mib"], ".0f"))
        console.print(t)
    p = report["physical_limit"]
    console.print(f"target forward over a {p['context_tokens']}-token context: 1 token {1e3 * p['t_1_s']:.1f} ms, "
                  f"K+1 = {len(p['target_forward_s'])} tokens {1e3 * p['t_k_plus_1_s']:.1f} ms"
                  + (f"; draft model 1 token {1e3 * p['draft_forward_s']:.1f} ms" if p.get("draft_forward_s") else ""),
                  markup=False, soft_wrap=True)
    c = report["correctness"]
    if c["checked"]:
        verdict = "OK" if not c["failures"] else f"{c['failures']} FAILURES"
        console.print(f"exactness of {', '.join(c['methods'])} against {c['reference']} (greedy, token for token): {verdict}",
                      markup=False, soft_wrap=True)
    for note in report["notes"]:
        if "no ROUGE-L" in note or "ignores them" in note or "generation_config" in note:
            console.print(f"note: {note}", markup=False, soft_wrap=True)


# --------------------------------------------------------------------------------------------
# Plot

#: Quality panels of --plot, when the report has the figure: (field, axis label).
PLOT_PANELS = (
    ("nll_per_token", "target NLL per token (lower is likelier)"),
    ("rouge_l", "ROUGE-L F1 against the reference"),
    ("prefix_share", "prefix share with the reference method"),
)


_PLOT_COLORS = {MARS: "tab:red", MARS_TREE: "tab:purple", STRICT_TREE: "tab:green"}


def write_plot(report: dict[str, Any], path: str) -> None:
    """Speedup against quality, one point per method, MARS thetas joined by a line."""
    try:
        import matplotlib
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install 'marscli[bench]'") from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    methods = report["methods"]
    x_field = "speedup_vs_hf_generate" if any(a.get("speedup_vs_hf_generate") for a in methods.values()) \
        else "speedup_vs_ar"
    panels = [(f, label) for f, label in PLOT_PANELS if any(a.get(f) is not None for a in methods.values())]
    if not panels:
        raise UsageError("--plot: the report has no quality figure to plot")
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.4), squeeze=False)
    for ax, (field_, label) in zip(axes[0], panels):
        mars_pts: dict[str, list] = {MARS: [], MARS_TREE: []}
        for name, a in sorted(methods.items(), key=lambda kv: (kv[1]["kind"] in MARS_METHODS, kv[1]["theta"] or 0.0)):
            x, y = a.get(x_field), a.get(field_)
            if x is None or y is None:
                continue
            spread = a.get("spread") or {}
            ax.errorbar(x, y, xerr=spread.get(x_field), yerr=spread.get(field_), fmt="o",
                        color=_PLOT_COLORS.get(a["kind"], "tab:blue"), capsize=3)
            ax.annotate(name, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
            if a["kind"] in mars_pts:
                mars_pts[a["kind"]].append((x, y))
        for kind, pts in mars_pts.items():
            if len(pts) > 1:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, "-", color=_PLOT_COLORS[kind], alpha=0.5)
        ax.set_xlabel(f"speedup ({x_field.removeprefix('speedup_vs_').replace('_', '-')} = 1)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    s = report["settings"]
    fig.suptitle(f"marscli bench: {report['target'].get('name')}, {report['prompts']['used']} prompts, "
                 f"max {s['max_tokens']} tokens, temperature {s['temperature']:g}", fontsize=10)
    fig.tight_layout()
    directory = os.path.dirname(os.path.abspath(path))
    import tempfile

    fd, tmp = tempfile.mkstemp(prefix=".plot.", suffix=".png", dir=directory)
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=120, format="png")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    finally:
        plt.close(fig)
