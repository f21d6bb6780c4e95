"""The bench protocol on loaded models: every method's runner (transformers' generate() and
assisted generation, marscli's engines), the warm-up, methods rotating per prompt with their
timings, the forward-pass costs, batched throughput, quality against the reference method,
and the correctness check. The bench job (marscli.jobs.bench) loads the models, runs it and
writes the report; what the methods are: marscli.bench.methods.
"""

from __future__ import annotations

import gc
import hashlib
import json
import time
from collections.abc import Callable, Sequence
from typing import Any

from marscli.bench import metrics
from marscli.bench.measure import (
    ForwardCounter,
    forward_times,
    peak_rss_mib,
    quiet_transformers,
)
from marscli.bench.methods import (
    AR,
    BATCHED_METHODS,
    EXACT_METHODS,
    FORWARD_TIMING_REPEATS,
    HF_ASSISTED,
    HF_GENERATE,
    MARS_METHODS,
    MARS_NOGUARD,
    MIB,
    REFERENCE_METHODS,
    TREE_METHODS,
    WARMUP_MAX_TOKENS,
    BenchConfig,
    BenchPrompt,
    Log,
    Run,
    chain_or_tree,
    round_or_none,
)
from marscli.config import (
    GUARD_OFF,
    SPANS_OFF,
    STRICT_THETA,
    DraftConfig,
    GuardConfig,
    Request,
    SamplingParams,
    VerifyConfig,
)
from marscli.drafters.kinds import EAGLE3, NGRAM, NONE
from marscli.engine import build_engine
from marscli.engine.sequence import RecordFailure
from marscli.scoring import rouge
from marscli.verification.guard import ends_in_loop
from marscli.verification.registry import MARS, PAPER_THETA, STRICT


def method_verification(kind: str, theta: float | None, margin: str,
                        guard: GuardConfig = GUARD_OFF, rule=None) -> VerifyConfig:
    """A bench method's verification, by generate's rule (MARS at its theta, else the paper's;
    another rule at its knobs; or strict), with the margin statistic already resolved;
    `mars-noguard` without the loop guard. rule: the marscli.verification.registry.Rule of a
    rule method (MethodSpec.rule)."""
    if rule is not None:  # guarded like mars: the guard is the run's
        return VerifyConfig.from_rule(rule, guard)
    if kind not in MARS_METHODS:
        return VerifyConfig(STRICT, STRICT_THETA, margin, guard)
    return VerifyConfig(MARS, PAPER_THETA if theta is None else theta, margin,
                        GUARD_OFF if kind == MARS_NOGUARD else guard)


Runner = Callable[[list[int], SamplingParams], tuple[list[int], Any]]


class Bench:
    """Runs the methods of a BenchConfig on loaded models and builds the report.

    `runners[name](prompt_ids, sampling) -> (completion token ids, SpecStats or None)` is the
    one seam between methods and the protocol; tests replace a runner to check that a wrong
    output is caught.
    """

    def __init__(self, cfg: BenchConfig, target, draft=None, *, log: Log = lambda _: None):
        self.cfg = cfg
        self.target = target
        self.draft = draft
        self.log = log
        self.notes: list[str] = []
        self.hf_assisted: dict[str, Any] | None = None
        none_cfg = DraftConfig(kind=NONE)
        # Building any engine installs marscli's CPU fast path on the target model object,
        # which transformers' generate() then shares (see the report's notes).
        self._encoder = build_engine(target, None, VerifyConfig(), none_cfg, spans=SPANS_OFF)
        self.runners: dict[str, Runner] = {}
        self.engines: dict[str, Any] = {}
        # --throughput runs no record alone: the rows build their own engines.
        for m in () if cfg.throughput_only else cfg.methods:
            if m.kind == HF_GENERATE:
                self.runners[m.name] = self._hf_runner({})
            elif m.kind == HF_ASSISTED:
                self.runners[m.name] = self._hf_runner(self._assisted_kwargs())
            else:
                dcfg = none_cfg if m.kind == AR else chain_or_tree(cfg.draft, m.kind in TREE_METHODS)
                verify = method_verification(m.kind, m.theta, cfg.margin, cfg.guard, m.rule)
                engine = build_engine(target, draft, verify, dcfg, note=log, spans=cfg.spans,
                                      prefix_cache_mib=cfg.prefix_cache, compile_mode=cfg.compile)
                self.engines[m.name] = engine
                self.runners[m.name] = self._engine_runner(engine, drafts=dcfg.kind != NONE)
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
            with quiet_transformers():
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
        if d.kind == NGRAM:
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

    def _engine_runner(self, engine, drafts: bool) -> Runner:
        def run(ids: list[int], sampling: SamplingParams):
            res = engine.generate_ids(ids, sampling)
            return res.token_ids, (res.stats if drafts else None)

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
        prompts, skipped = [], []
        for req, ref in records:
            try:
                ids = self._encoder.prompts.encode(req)
            except RecordFailure as e:
                skipped.append({"id": req.id, "line": req.line, "reason": f"{e.type}: {e.message}"})
                continue
            prompts.append(BenchPrompt(req.id, req.line, ids, ref))
        return prompts, skipped

    def _timed(self, name: str, ids: list[int], sampling: SamplingParams) -> tuple[list[int], Any, float, int]:
        import torch

        cuda = self.target.device.type == "cuda"
        counter = ForwardCounter(self.target.model)
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
                "peak_rss_mib": round_or_none(peak_rss_mib(), 1),
                "cuda_peak_mib": round_or_none(torch.cuda.max_memory_allocated() / MIB, 1)
                if self.target.device.type == "cuda" else None,
            }
        return memory

    def measure_forwards(self, ids: list[int]) -> dict[str, Any]:
        """Median target forward time for n = 1..K+1 new tokens over a cached context of
        `ids`, and the draft model's for one token."""
        k = self.cfg.draft.num_draft_tokens if self.cfg.draft.kind != NONE else 0
        if any(m.kind in TREE_METHODS for m in self.cfg.methods):  # a tree pass scores N+1 tokens
            k = max(k, chain_or_tree(self.cfg.draft, True).tree_tokens - 1)
        t_target = forward_times(self.target.model, self.target.device, ids, k + 1)
        t_draft = None
        if self.draft is not None and self.cfg.draft.kind != EAGLE3:  # a head has no forward of its own here
            t_draft = forward_times(self.draft.model, self.draft.device, ids, 1)[0]
        return {
            "context_tokens": len(ids),
            "repeats": FORWARD_TIMING_REPEATS,
            "target_forward_s": {str(n + 1): round_or_none(t, 6) for n, t in enumerate(t_target)},
            "t_1_s": round_or_none(t_target[0], 6),
            "t_k_plus_1_s": round_or_none(t_target[-1], 6),
            "draft_forward_s": round_or_none(t_draft, 6),
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
            # Each seed's pass is one job: strict's n-gram drafter may draft from the pass's
            # earlier prompts, never from the warm-up or another seed's output of this prompt.
            for engine in self.engines.values():
                engine.forget_earlier_records()
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

                        cuda_peak[name] = max(cuda_peak.get(name, 0.0), torch.cuda.max_memory_allocated() / MIB)
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
        its users get). Each (method, batch size) first warms up on the first prompt
        (`_warm_up_row`), then decodes the whole set timed. Each row: tokens/s and records/s
        over the whole set, records/s against hf-generate's at the same batch size, the
        engine's prefill counters, and whether the outputs equal the method's outputs at the
        first batch size.
        """

        import torch

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
                # The previous row's engine goes before the next is built: its slot buffers
                # live with it (reused across its runs), and cycles keep it past `engine = None`.
                engine = None
                gc.collect()
                if m.kind != HF_GENERATE:  # built untimed: the first build measures step costs
                    dcfg = DraftConfig(kind=NONE) if m.kind == AR else cfg.draft
                    verify = method_verification(m.kind, m.theta, cfg.margin, cfg.guard, m.rule)
                    engine = build_engine(self.target, self.draft, verify, dcfg, bs, self.log, spans=cfg.spans,
                                          prefix_cache_mib=cfg.prefix_cache, compile_mode=cfg.compile)
                self._warm_up_row(engine, prompts[0], bs)
                if cuda:  # pragma: no cover - needs a GPU
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                t0 = time.perf_counter()
                if engine is None:
                    outputs = self._hf_batched(prompts, sampling, bs)
                    stats = None
                else:
                    results: dict[int, Any] = {}
                    for i, res in engine.run(range(len(prompts)), lambda i: (prompts[i].ids, sampling)):
                        if isinstance(res, BaseException):
                            raise res
                        results[i] = res
                    outputs = [results[i].token_ids for i in range(len(prompts))]
                    stats = [results[i].stats for i in range(len(prompts))]
                if cuda:  # pragma: no cover
                    torch.cuda.synchronize()
                seconds = time.perf_counter() - t0
                tokens = sum(len(o) for o in outputs)
                ref = first_outputs.setdefault(m.name, outputs)
                row = {
                    "method": m.name, "kind": m.kind, "batch_size": bs, "prompts": len(prompts),
                    "completion_tokens": tokens, "seconds": seconds,
                    "tokens_per_s": metrics.rate(tokens, seconds),
                    "records_per_s": metrics.rate(len(prompts), seconds),
                    "speedup_vs_first_batch_size": None,  # below, once tokens/s is known
                    "speedup_vs_hf_generate": None,  # once every row is in: hf-generate may come later
                    "acceptance_length": (metrics.ratio(sum(s.emitted for s in stats), sum(s.steps for s in stats))
                                          if stats and self.cfg.draft.kind != NONE and m.kind != AR else None),
                    # the draft length the policy chose at this batch size: drafts per step
                    "mean_draft_length": (metrics.ratio(sum(s.drafted for s in stats), sum(s.steps for s in stats))
                                          if stats and self.cfg.draft.kind != NONE and m.kind != AR else None),
                    "outputs_equal_first_batch_size": sum(a == b for a, b in zip(outputs, ref)),
                    # records whose output ends in a loop, and relaxations taken back (--loop-rewind)
                    "loops": sum(ends_in_loop(o) for o in outputs),
                    "rewinds": sum(getattr(s, "rewinds", 0) for s in stats) if stats else None,
                    "outputs_sha256": hashlib.sha256(json.dumps(outputs).encode()).hexdigest()[:16],
                    "peak_rss_mib": round_or_none(peak_rss_mib(), 1),
                    "cuda_peak_mib": round_or_none(torch.cuda.max_memory_allocated() / MIB, 1) if cuda else None,
                    **batch_counters(engine),
                }
                base_tps = first_tps.setdefault(m.name, row["tokens_per_s"])
                row["speedup_vs_first_batch_size"] = metrics.ratio(row["tokens_per_s"], base_tps)
                rows.append(row)
                self.log(f"throughput: {m.name} batch {bs}: {row['tokens_per_s']:.1f} tokens/s, "
                         f"{row['records_per_s'] or 0.0:.2f} records/s")
                if progress is not None:
                    progress(len(rows), total)
        hf_rps = {r["batch_size"]: r["records_per_s"] for r in rows if r["kind"] == HF_GENERATE}
        for r in rows:
            if r["batch_size"] in hf_rps:
                r["speedup_vs_hf_generate"] = metrics.ratio(r["records_per_s"], hf_rps[r["batch_size"]])
        return rows

    def _warm_up_row(self, engine, prompt: BenchPrompt, bs: int) -> None:
        """The first prompt once, a few tokens, through the row's own engine (or hf generate)
        before it is timed: kernels, allocator and lazy initialisation are warm, but the
        engine's prefix cache is emptied and its prefill counters zeroed, so that the timed
        run starts cold for prefixes (the first prompt is not cached yet) and counts only its
        own prefills."""
        sampling = self.cfg.sampling(self.cfg.seeds[0], self.cfg.throughput_warmup_tokens)
        if engine is None:
            self._hf_batched([prompt], sampling, bs)
            return
        for _, res in engine.run([0], lambda _: (prompt.ids, sampling)):
            if isinstance(res, BaseException):
                raise res
        engine.reset_measurements()

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
            with quiet_transformers():
                new = generate_padded(target, [p.ids for p in chunk], **kw)
            for row in new:
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
        with_rouge = prompt.reference is not None and rouge.rouge_available()
        for r in runs:
            if ref is not None:
                r.exact = metrics.exact_match(r.tokens, ref.tokens)
                r.prefix_share = metrics.prefix_share(r.tokens, ref.tokens)
                r.first_mismatch = metrics.first_mismatch(r.tokens, ref.tokens)
            key = tuple(r.tokens)
            if key not in nll_cache:  # identical outputs (strict, ar, hf-generate) score once
                nll_cache[key] = metrics.completion_nll(self.target.model, prompt.ids, r.tokens)
            r.nll = nll_cache[key]
            if with_rouge:
                text = self.target.tokenizer.decode(r.tokens, skip_special_tokens=True)
                r.rouge_l = rouge.rouge_l(text, prompt.reference)

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


def generate_padded(target, prompts: list[list[int]], **kw: Any) -> list[list[int]]:
    """transformers' generate() on one batch of prompts, left-padded with kw["pad_token_id"]
    (what its users run): each row's new tokens, as generate() returns them."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), kw["pad_token_id"], dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, width - len(p):] = torch.tensor(p)
        mask[b, width - len(p):] = 1
    out = target.model.generate(ids.to(target.device), attention_mask=mask.to(target.device), **kw)
    return out[:, width:].tolist()  # [b, new]


def batch_counters(engine) -> dict[str, Any]:
    """The throughput row's engine counters (every batch size keeps them); all None without
    an engine (hf-generate's rows), so that every row has the same fields."""
    if engine is None:
        return dict.fromkeys(BATCH_COUNTER_FIELDS)
    return {"prefill_seconds": engine.prefill_seconds,
            "peak_kv_cache_mib": engine.peak_cache_bytes / MIB,
            "oom_halvings": engine.oom_retries,
            "prefix_tokens_reused": engine.prefix_tokens_reused,
            "prefill_passes": engine.prefiller.passes,
            "prefill_tokens": engine.prefiller.tokens,
            "prefill_padding": engine.prefiller.padded,
            "step_kind": engine.step_kind,  # eager; graphs (captured) or compiled (--compile)
            "graphs_captured": getattr(getattr(engine.kv, "steps", None), "captures", 0)}


#: batch_counters' fields, in order.
BATCH_COUNTER_FIELDS = ("prefill_seconds", "peak_kv_cache_mib", "oom_halvings", "prefix_tokens_reused",
                        "prefill_passes", "prefill_tokens", "prefill_padding", "step_kind", "graphs_captured")
