"""bench --match-relax-rate S: every relaxed method's main knob fitted, before anything is
timed, so that all relax the same share S of verified draft positions on a calibration
split of the prompts (marscli.calibration.policies.match_relax_rate): the fair setting to
compare rules.

The calibration split is never measured: the records of --calibrate-on FILE, or of the
input after the measured ones (after --limit); up to --calibration-records of them either
way, and any whose prompt tokens equal a measured prompt's are dropped. The same input
given as --calibrate-on is read as if it were not given (its records after --limit). The
split is decoded strictly, as calibrate does (batch size 1, a fixed K), by the
bench's target and drafter at its max tokens, temperature and first seed; the replay then
applies the bench's loop guard (none for mars-noguard, which runs without one).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from marscli.bench.methods import (
    MARS_NOGUARD,
    MARS_TREE,
    MATCHED_METHODS,
    BenchConfig,
    MethodSpec,
    chain_or_tree,
    read_prompt_records,
)
from marscli.bench.metrics import ratio
from marscli.bench.report import json_safe
from marscli.calibration.collect import MarginCollector
from marscli.calibration.policies import RELAXED, match_relax_rate, relaxed_per_position
from marscli.config import GUARD_OFF, Request, VerifyConfig
from marscli.engine import build_engine
from marscli.engine.sequence import RecordFailure
from marscli.errors import InputError, UsageError
from marscli.verification.registry import MARS, Rule

Log = Callable[[str], None]
#: How the measured run's relaxed share is counted (the report's notes say it too).
MEASURED_DEFINITION = ("relaxed_per_position: relaxed draft tokens accepted / draft positions verified "
                       "(the engine's relaxed / drafted); the calibration replay's figure counts the same way. "
                       "That is what is matched (relaxed_per_position_calibration <= share). relax_rate, "
                       "reported beside it, also counts positions a step never reaches after its first "
                       "rejection, judged on their own, so on the same steps it is at least as large. "
                       "within_share false: even the knob's strict end relaxes more than the share "
                       "(typical at epsilon 1 still relaxes where p(draft) > alpha e^-H)")


def check_match(cfg: BenchConfig, theta_given: bool, records_given: bool) -> None:
    """Usage errors of --match-relax-rate and its companions, before any model loads."""
    s = cfg.match_relax_rate
    if s is None:
        for given, option in ((cfg.calibrate_on is not None, "--calibrate-on"),
                              (records_given, "--calibration-records")):
            if given:
                raise UsageError(f"{option} gives the prompts --match-relax-rate calibrates on: "
                                 "give --match-relax-rate too")
        return
    if not 0.0 < s < 1.0:
        raise UsageError(f"--match-relax-rate must be in (0, 1), got {s:g}")
    if cfg.calibration_records < 1:
        raise UsageError(f"--calibration-records must be at least 1, got {cfg.calibration_records}")
    if theta_given:
        raise UsageError("--theta sets MARS's threshold and --match-relax-rate fits it: give one")
    trees = [m.name for m in cfg.methods if m.kind == MARS_TREE]
    if trees:
        raise UsageError(f"--match-relax-rate fits chain methods only; drop {', '.join(trees)}")
    if not any(m.kind in MATCHED_METHODS for m in cfg.methods):
        raise UsageError("--match-relax-rate fits the knobs of mars, mars-noguard, ratio, topk, typical "
                         "and regret; none is in --methods")
    if calibration_source(cfg)[0] == "-" and cfg.input == "-":
        raise UsageError("--match-relax-rate on stdin: pass --calibrate-on FILE (the input cannot be read twice)")


def calibration_source(cfg: BenchConfig) -> tuple[str, int]:
    """(file, records to skip there): --calibrate-on, or the input after the measured ones."""
    other = cfg.calibrate_on
    if other is not None and not _same_file(other, cfg.input):
        return other, 0
    return cfg.input, cfg.limit if cfg.limit is not None else -1


def _same_file(a: str, b: str) -> bool:
    if a == b:
        return True
    try:
        return a != "-" and b != "-" and os.path.samefile(a, b)
    except OSError:
        return False


def read_calibration(cfg: BenchConfig) -> list[tuple[Request, str | None]]:
    """The calibration split's records (a usage error when there are none)."""
    source, start = calibration_source(cfg)
    if start < 0:  # the input, every record of it measured
        raise UsageError(f"--match-relax-rate: every record of {cfg.input} is measured; pass --calibrate-on "
                         "FILE (or --limit N to calibrate on the records after the first N)")
    records, _, _ = read_prompt_records(source, cfg.calibration_records, start=start)
    if not records:
        where = f"after the first {start} records of {source}" if source == cfg.input else f"in {source}"
        raise UsageError(f"--match-relax-rate: no usable calibration records {where}; pass --calibrate-on FILE")
    return records


@dataclass
class Match:
    """What --match-relax-rate did: the report's ``match_relax_rate`` section."""

    share: float
    file: str
    records: int
    positions: int
    tokens: int
    dropped_overlap: int
    skipped: int
    notes: list[str]
    #: label -> {template, rule, knobs, relax_rate_calibration, relaxed_per_position_calibration}
    methods: dict[str, dict[str, Any]]


def collect_split(engine, prompts: Sequence[list[int]], sampling) -> tuple[Any, int]:
    """Strict decoding of every prompt with a margin collector each, merged in input order
    -> (the merged collector, failed records)."""

    per: dict[int, MarginCollector] = {}

    def observer_for(item):
        per[item[0]] = MarginCollector()  # a restart starts afresh
        return per[item[0]]

    failed = 0
    for (i, _), res in engine.run(list(enumerate(prompts)), lambda it: (it[1], sampling), observer_for=observer_for):
        if isinstance(res, RecordFailure):
            failed += 1
            per.pop(i, None)
        elif isinstance(res, BaseException):  # not one record's failure: the run's
            raise res
    merged = MarginCollector()
    for i in sorted(per):
        merged.extend(per[i])
    return merged, failed


@dataclass
class Split:
    """The calibration split decoded strictly: every rule's facts at its verified positions."""

    data: Any  # marscli.calibration.collect.MarginData
    source: str
    dropped: int  # prompts equal to a measured one
    skipped: int  # unusable records and failed decodes


def collect_calibration(cfg: BenchConfig, calibration: Sequence[tuple[Request, str | None]],
                        measured: Sequence[tuple[Request, str | None]], target, draft, log: Log) -> Split:
    """Strict decoding of the calibration split by the bench's target and drafter (batch size
    1, proposing as a relaxed rule's engine does, no job corpus), prompts equal to a measured
    one left out."""

    # No job corpus: the relaxed methods whose knobs this fits draft from their own text only.
    engine = build_engine(target, draft, VerifyConfig(guard=cfg.guard), chain_or_tree(cfg.draft, False), 1,
                         log, job_corpus=False, calibrating=True, spans=cfg.spans)
    seen = set()
    for req, _ in measured:
        try:
            seen.add(tuple(engine.prompts.encode(req)))
        except RecordFailure:  # an unusable measured record: bench skips it, it overlaps nothing
            continue
    prompts, dropped, skipped = [], 0, 0
    for req, _ in calibration:
        try:
            ids = engine.prompts.encode(req)
        except RecordFailure as e:  # a record the engine cannot encode is left out
            log(f"calibration record {req.id} (line {req.line}) skipped: {e.message}")
            skipped += 1
            continue
        if tuple(ids) in seen:
            dropped += 1
            continue
        prompts.append(ids)
    source = calibration_source(cfg)[0]
    if not prompts:
        raise UsageError(f"--match-relax-rate: no calibration prompt of {source} is left apart from the measured "
                         "ones; pass --calibrate-on FILE")
    share = "" if cfg.match_relax_rate is None else f" {cfg.match_relax_rate:g}"
    log(f"--match-relax-rate{share}: strict decoding of {len(prompts)} calibration prompts from {source}")
    collector, failed = collect_split(engine, prompts, cfg.sampling(cfg.seeds[0]))
    data = collector.data(records=len(prompts) - failed, failed=failed, guard=cfg.guard, spans=cfg.spans)
    if data.positions == 0:
        raise InputError(f"{source}: the drafter proposed no tokens on the calibration prompts: nothing to "
                         "match (more or longer prompts, or another drafter)")
    return Split(data, source, dropped, skipped + failed)


def fit_to_share(data, template, share: float, name: str) -> tuple[Any, dict[str, Any]]:
    """``template`` (a marscli.verification.rules.Rule) with its main knob fitted to relax at most ``share``
    of ``data``'s verified draft positions (by the relaxed drafts its replay accepts), and what
    the fit found on the calibration data (the report's entry; ``name``: the method as written)."""

    rule = match_relax_rate(data, [template], share, by=RELAXED)[0]
    at = data.replay(rule)
    relaxed = relaxed_per_position(data, at)
    return rule, {"template": name, "rule": rule.name, "knobs": rule.knobs(),
                  "relax_rate_calibration": at.relax_rate, "within_share": relaxed <= share,
                  "relaxed_per_position_calibration": relaxed}


def fit_methods(cfg: BenchConfig, calibration: Sequence[tuple[Request, str | None]],
                measured: Sequence[tuple[Request, str | None]], target, draft,
                log: Log) -> tuple[BenchConfig, Match]:
    """The bench config with every MATCHED_METHODS method at its fitted knob (renamed to its
    label), and what was matched."""

    split = collect_calibration(cfg, calibration, measured, target, draft, log)
    data, s = split.data, cfg.match_relax_rate
    unguarded = dataclasses.replace(data, guard=GUARD_OFF)
    methods: list[MethodSpec] = []
    fitted: dict[str, dict[str, Any]] = {}
    for m in cfg.methods:
        if m.kind not in MATCHED_METHODS:
            if m not in methods:
                methods.append(m)
            continue
        on = unguarded if m.kind == MARS_NOGUARD else data
        template = m.rule if m.rule is not None else Rule(MARS, m.theta, cfg.margin)
        try:
            rule, fit = fit_to_share(on, template, s, m.name)
        except ValueError as e:  # a rule the data cannot replay
            raise UsageError(f"--match-relax-rate, method {m.name}: {e}") from None
        if m.rule is not None:
            spec = MethodSpec(rule.label(), m.kind, None, rule)
        else:
            spec = MethodSpec(f"{m.kind}@{rule.theta:g}", m.kind, rule.theta)
        if spec in methods:
            log(f"--match-relax-rate: {m.name} fits to {spec.name}, already in --methods: measured once")
            continue
        methods.append(spec)
        fitted[spec.name] = fit
        relaxed = fit["relaxed_per_position_calibration"]
        log(f"--match-relax-rate {s:g}: {m.name} -> {spec.name} ({relaxed:.4f} relaxed per position, relax "
            f"rate {fit['relax_rate_calibration']:.4f}, on {on.positions} calibration positions)" + (
                "" if relaxed <= s else ": NOT matched, it relaxes more even at its strict end"))
    notes = []
    match = Match(s, split.source, data.records, data.positions, data.tokens, split.dropped, split.skipped,
                  notes=notes, methods=fitted)
    return dataclasses.replace(cfg, methods=tuple(methods)), match


def match_section(match: Match, per_method: dict[str, dict[str, Any]], log: Log) -> dict[str, Any]:
    """The report's ``match_relax_rate`` section, each method's measured relaxed share beside
    the calibration's (one stderr line each)."""

    methods = {}
    for label, fit in match.methods.items():
        a = per_method.get(label, {})
        measured = ratio(a.get("relaxed"), a.get("drafted")) if a.get("drafted") else None
        methods[label] = {**fit, "relaxed_per_position_measured": measured}
        if measured is not None:
            log(f"{label}: relaxed {measured:.4f} of verified positions on the measured run, "
                f"{fit['relaxed_per_position_calibration']:.4f} in the calibration replay "
                f"(relax rate {fit['relax_rate_calibration']:.4f}, matched to {match.share:g})")
    return json_safe({
        "share": match.share,
        "calibration": {"file": match.file, "records": match.records, "positions": match.positions,
                        "tokens": match.tokens, "dropped_overlap": match.dropped_overlap,
                        "skipped": match.skipped},
        "methods": methods,
        "definition": MEASURED_DEFINITION,
        "notes": match.notes,
    })
