"""The calibrate job: collect margins under strict verification, choose a rule's knob (MARS's
theta by default; `--rule`), check that the rule at that knob does not derail, write and show
the profile.

The policies judge a knob on the replay of the strict run (marscli.calibration.policies),
which cannot see a relaxed continuation falling into a loop: a loop is likely text, so a
derailed record's NLL per token even falls. So the chosen rule is then run for real on the
calibration records (``derailment_check``): when it ends more records in a loop than strict
decoding does, the knob moves towards strict (half the relax rate) and is checked again, at
most MAX_DERAILMENT_CHECKS times; the profile records every check.

Under a launcher each process collects the margins of its shard of the records; the main
process gathers them, merges them in input order (so the profile is the one a single
process computes) and alone writes the profile.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
import time

from marscli.calibration.collect import MarginCollector
from marscli.calibration.policies import (
    DEFAULT_MAX_NLL_INCREASE,
    RuleFamily,
    analyse,
    curve_values,
    walk,
)
from marscli.calibration.profile_schema import POLICY_FIXED, POLICY_MAX_NLL, POLICY_RELAX_RATE
from marscli.calibration.profiles import (
    default_profile_name,
    dump_profile,
    identity_for_profile,
    parse_profile,
    save_profile,
    user_profile_dir,
)
from marscli.calibration.report import (
    build_profile,
    curve_table,
    histogram_text,
    plot_profile,
)
from marscli.calibration.speed import (
    OBJECTIVES,
    fastest_within_budget,
    speed_curve,
    speed_section,
)
from marscli.config import (
    CalibrateConfig,
    GenerationOptions,
    RecordError,
    SamplingParams,
    VerifyConfig,
)
from marscli.engine import build_engine
from marscli.engine.sequence import RecordFailure
from marscli.errors import (
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_RECORDS_FAILED,
    InputError,
    MarscliError,
    UsageError,
)
from marscli.io.console import Log, Progress
from marscli.io.distributed import ProgressPump, shard, solo_step
from marscli.io.input_index import read_input
from marscli.jobs.generate import start_group
from marscli.jobs.setup import (
    check_choices,
    generation_setup,
    load_setup,
    resolve_guard,
)
from marscli.verification.guard import ends_in_loop
from marscli.verification.registry import (
    ALL_KNOBS,
    LOGIT_RATIO,
    MARS,
    RELAXING_RULES,
    RULEBOOK,
    Rule,
)


def run_calibrate(cfg: CalibrateConfig, log: Log) -> int:
    """Returns the exit code; the profile is written (or printed) on success."""
    group = start_group(log, cfg.input)
    try:
        return _calibrate(cfg, log, group)
    finally:
        if group is not None:
            group.close()


#: Knob values the derailment check runs at most (each one generation of the records).
MAX_DERAILMENT_CHECKS = 3


def collect_margins(engine, items, sampling, observer_for, skipped, tick, loops: dict | None = None) -> None:
    """Generate every record under strict verification with a margin observer each.

    Records that cannot be parsed or generated are `skipped(item, message)`; a failure of
    the run itself (not of one record) is raised. Every batch size goes through engine.run.
    loops: filled with each record's index -> whether its output ends in a loop.
    """

    valid = []
    for item in items:
        if isinstance(item, RecordError):
            skipped(item, item.message)
        else:
            valid.append(item)

    def prepare(it):
        return engine.prompts.encode(it), sampling.with_overrides(it.overrides)

    for item, res in engine.run(valid, prepare, observer_for=observer_for):
        if isinstance(res, RecordFailure):
            skipped(item, res.message)
        elif isinstance(res, BaseException):
            raise res
        else:
            if loops is not None:
                loops[item.index] = ends_in_loop(res.token_ids)
            tick(res.completion_tokens)


def derailment_check(cfg: CalibrateConfig, target, draft_loaded, items, strict_loops: dict[int, bool]):
    """check(rule) -> {"loops", "derailed", "rewinds"}: ``rule`` (with cfg's guard, loop
    rewinds included) run for real on the records, how many end in a loop, how many of those
    strict decoding did not end in one (``strict_loops``: the collection run's), and the
    relaxations the run took back."""

    def check(rule: Rule) -> dict[str, int]:
        engine = build_engine(target, draft_loaded, VerifyConfig.from_rule(rule, cfg.guard), cfg.setup.draft,
                              cfg.setup.batch_size, compile_mode=cfg.setup.compile, spans=cfg.spans)
        valid = [it for it in items if not isinstance(it, RecordError) and it.index in strict_loops]
        loops = rewinds = 0
        derailed = 0

        def prepare(it):
            return engine.prompts.encode(it), cfg.sampling.with_overrides(it.overrides)
        for item, res in engine.run(valid, prepare):
            if isinstance(res, BaseException):
                continue  # it failed under strict decoding too, or is left out of the count
            looped = ends_in_loop(res.token_ids)
            loops += looped
            derailed += looped and not strict_loops[item.index]
            rewinds += res.stats.rewinds
        return {"loops": loops, "derailed": derailed, "rewinds": rewinds}
    return check


def choose_policy(max_nll_increase: float | None = None, relax_rate: float | None = None,
                  theta: float | None = None, knob: str = "theta") -> tuple[str, float]:
    """The one policy that picks the knob (theta, or ``knob``: another rule's main knob,
    whose fixed value comes in ``theta``) -> (name, value); the default:
    --max-nll-increase 0.02."""

    chosen = [(n, v) for n, v in ((POLICY_MAX_NLL, max_nll_increase), (POLICY_RELAX_RATE, relax_rate),
                                  (POLICY_FIXED, theta)) if v is not None]
    if len(chosen) > 1:
        raise UsageError(f"give one policy: --max-nll-increase, --relax-rate or --{knob} "
                         f"(got {', '.join('--' + n if n != POLICY_FIXED else '--' + knob for n, _ in chosen)})")
    if theta is not None and not math.isfinite(theta):
        raise UsageError(f"--{knob} must be a finite number")
    policy, value = chosen[0] if chosen else (POLICY_MAX_NLL, DEFAULT_MAX_NLL_INCREASE)
    return policy, float(value)


def choose_rule(rule: str = MARS, *, margin: str = LOGIT_RATIO, greedy: bool = True,
                **knobs: float | None):
    """`calibrate --rule NAME` and its knob options (``knobs``: registry.ALL_KNOBS names, None
    when not given) -> (rule template, fixed knob value or None, alpha given). The main knob
    given (--theta, --rho, --delta, --epsilon, --budget) is the fixed policy; the others
    (--top-n, --alpha) are kept while the main one is fitted."""

    if rule not in RELAXING_RULES:
        raise UsageError(f"--rule must be one of {', '.join(RELAXING_RULES)}; got {rule!r}")
    unknown = set(knobs) - set(ALL_KNOBS)
    if unknown:
        raise TypeError(f"choose_rule() got unknown knobs {sorted(unknown)}")
    spec = RULEBOOK[rule]
    stray = [k for k in ALL_KNOBS if knobs.get(k) is not None and k not in spec.knob_names]
    if stray:
        raise UsageError(f"{', '.join(ALL_KNOBS[k].option for k in stray)} "
                         f"{'is not a knob' if len(stray) == 1 else 'are not knobs'} of --rule {rule}")
    fixed = knobs.get(spec.main)
    if fixed is not None and not math.isfinite(fixed):
        raise UsageError(f"{spec.main_knob.option} must be a finite number")
    kw = {k: knobs[k] for k in spec.knob_names if knobs.get(k) is not None}
    alpha = knobs.get("alpha")
    try:
        template = Rule(rule, margin=margin, **kw)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if not greedy and "sampling" not in template.modes:
        raise UsageError(f"the {rule} rule is defined for greedy decoding only: calibrate it "
                         "with --temperature 0")
    return template, fixed, alpha is not None


def calibrate_config(input: str, o: GenerationOptions, sampling: SamplingParams, *, rule: str = MARS,
                     knobs: dict[str, float | None] | None = None, max_nll_increase: float | None = None,
                     relax_rate: float | None = None, objective: str = "quality", output: str | None = None,
                     name: str | None = None, limit: int | None = None, plot: str | None = None) -> CalibrateConfig:
    """calibrate's options -> CalibrateConfig, checked before anything is loaded: the model,
    placement, drafting, guard and batch options of ``o`` (generate's), the rule whose main
    knob is fitted and its knobs (``knobs``: registry knob names, None when not given; the
    main one given is the fixed policy), and one policy."""
    check_choices(o.margin, o.dtype, o.ngram_min, o.ngram_max)
    margin = o.margin or LOGIT_RATIO
    template, fixed, alpha_given = choose_rule(rule, margin=margin, greedy=sampling.greedy, **(knobs or {}))
    policy, value = choose_policy(max_nll_increase, relax_rate, fixed, knob=template.knob[0])
    if objective not in OBJECTIVES:
        raise UsageError(f"--objective must be 'quality' or 'speed', got {objective!r}")
    setup = generation_setup(o, need_drafter="calibrate needs a drafter: --draft ngram or a draft model")
    return CalibrateConfig(
        input=input, output=output, name=name, setup=setup, margin=margin, policy=policy,
        policy_value=value, sampling=sampling, limit=limit, plot=plot,
        guard=resolve_guard(setup.verify, None), spans=setup.spans, objective=objective, rule=template,
        alpha_given=alpha_given,
    )


def margins_profile(collector, failed: int, records: int, seconds: float, cfg: CalibrateConfig, target,
                    draft_loaded, *, input_name: str, input_sha256: str | None, costs=None,
                    derails=None, strict_loops: int = 0) -> dict:
    """The profile document for the margins collected (theta chosen by cfg's policy; with
    the engine's step costs, its predicted speed too: marscli.calibration.speed). derails:
    a derailment_check; the knob then moves towards strict while the rule derails."""

    data = collector.data(records=records - failed, failed=failed, guard=cfg.guard, spans=cfg.spans)
    if data.positions == 0:
        raise MarscliError(f"{cfg.input}: the drafter proposed no tokens on these prompts, so there "
                           "are no margins to calibrate on (try --fixed-k, more or longer prompts, or another drafter)")
    family = rule_family(cfg)
    try:
        cal = analyse(data, family, cfg.policy, cfg.policy_value, seconds)
    except ValueError as e:  # a rule the data cannot replay (regret on sampled steps)
        raise UsageError(str(e)) from None
    speed = None
    if costs is not None:
        cal, speed = speed_objective(cal, data, cfg, family, costs, seconds)
    derailment = None
    if derails is not None and cal.rule.relaxes:
        checks = []
        for attempt in range(MAX_DERAILMENT_CHECKS):
            got = derails(cal.rule)
            checks.append({family.knob: cal.theta, "relax_rate": cal.summary["relax_rate"], **got})
            if got["derailed"] == 0 or attempt + 1 == MAX_DERAILMENT_CHECKS:
                break
            half = cal.summary["relax_rate"] / 2
            value = walk(data, family, lambda r, h=half: r.relax_rate <= h)
            cal = dataclasses.replace(analyse(data, family, POLICY_FIXED, value, seconds),
                                      policy=cal.policy, policy_value=cal.policy_value)
        # the knob checked that derails least (ties: the most relaxing, checked first)
        best = min(range(len(checks)), key=lambda i: (checks[i]["derailed"], i))
        if best != len(checks) - 1:
            cal = dataclasses.replace(analyse(data, family, POLICY_FIXED, checks[best][family.knob], seconds),
                                      policy=cal.policy, policy_value=cal.policy_value)
        if costs is not None and len(checks) > 1:
            speed = speed_section(data, family, cal.theta, cfg.objective, costs, SPEED_BATCH_SIZE,
                                  curve_values(data, family, (cal.theta,)))
        derailment = {"strict_loops": int(strict_loops), "checks": checks}
    ident = target.identity
    name = cfg.name or default_profile_name(
        str(ident.get("name")), cfg.setup.draft.kind, draft_loaded.identity.get("name") if draft_loaded else None,
        str(ident.get("dtype")), ident.get("quantization"), rule=cal.chosen_rule().name)
    doc = build_profile(
        name=name, cal=cal, data=data, target_identity=ident, draft_cfg=cfg.setup.draft,
        draft_identity=draft_loaded.identity if draft_loaded else None, sampling=cfg.sampling,
        input_name=input_name, input_sha256=input_sha256, seconds=seconds,
    )
    if speed is not None:
        doc["speed"] = speed
    if derailment is not None:
        doc["derailment"] = derailment
    return doc


def rule_family(cfg: CalibrateConfig):
    """The rule whose main knob cfg calibrates, with that knob free (MARS for cfg.margin when
    cfg names no rule)."""

    if cfg.rule is None:
        return RuleFamily.mars(cfg.margin)
    return RuleFamily.of(cfg.rule, cfg.alpha_given)


#: The speed prediction is made for one row decoding alone, as the margins were collected.
SPEED_BATCH_SIZE = 1


def speed_objective(cal, data, cfg: CalibrateConfig, family: RuleFamily, costs, seconds: float):
    """(calibration, the profile's speed section): with cfg.objective "speed" the fastest
    knob value within the policy's budget replaces the policy's own choice (``family``: the
    rule whose knob cfg calibrates, rule_family(cfg))."""
    values = curve_values(data, family, (cal.theta,))
    if cfg.objective == "speed":
        value = fastest_within_budget(speed_curve(data, family, values, costs, SPEED_BATCH_SIZE), cal.theta,
                                      family)
        if value != cal.theta:
            cal = dataclasses.replace(analyse(data, family, POLICY_FIXED, value, seconds),
                                      policy=cal.policy, policy_value=cal.policy_value)
    return cal, speed_section(data, family, cal.theta, cfg.objective, costs, SPEED_BATCH_SIZE, values)


def calibration_engine(cfg: CalibrateConfig, target, draft_loaded, note=None):
    """The engine a calibration collects with: strict, with the guard (the engine records the
    guard's verdicts for the replay), proposing what a relaxed rule's engine proposes
    (``calibrating``: the proposal after every step's drafts too), so that every output
    position's proposal is judged as generate judges it. No job corpus: the n-gram drafter
    drafts what it will draft for the relaxed rule, which gets none."""
    return build_engine(target, draft_loaded, VerifyConfig(guard=cfg.guard), cfg.setup.draft, cfg.setup.batch_size,
                       note or (lambda _: None), job_corpus=False, compile_mode=cfg.setup.compile,
                       calibrating=True, spans=cfg.spans)


def collect_profile(cfg: CalibrateConfig, engine, items, target, draft_loaded, log: Log, *, input_name: str,
                    input_sha256: str | None, total: int | None = None, group=None,
                    all_items=None) -> dict | None:
    """Collect the margins of ``items`` (this process's share of ``total`` records under a
    launcher) and build the profile document (marscli.calibration.policies chooses the
    knob, and checks it for derailment on all_items, the whole input: items by default); None on
    a process other than the main one, which gathers and builds it.
    KeyboardInterrupt propagates: nothing is written."""
    total = len(items) if total is None else total
    # One collector per record, merged in input order: the profile does not depend on the
    # batch size or on how many processes shared the records.
    per_record: dict[int, MarginCollector] = {}
    strict_loops: dict[int, bool] = {}
    progress = Progress(log, total, label="calibrating")
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
        per_record.pop(item.index, None)
        log.note(f"{cfg.input}:{item.line}: skipped: {message}")
        tick(0)

    def observer_for(item):
        per_record[item.index] = MarginCollector()  # a restart starts afresh
        return per_record[item.index]

    pump = contextlib.nullcontext()
    if group is not None and group.is_main and not log.quiet:
        pump = ProgressPump(group, progress.set)
    try:
        with pump:
            collect_margins(engine, items, cfg.sampling, observer_for, skipped, tick, strict_loops)
            if group is not None:
                group.mark_done({"failed": failed})
                group.wait_all_done()
    finally:
        progress.close()
    if group is not None:
        gathered = group.gather((per_record, failed, strict_loops), "gathering the margins")
        if gathered is None:
            return None  # the main process builds the profile
        per_record = {i: c for part, _, _ in gathered for i, c in part.items()}
        failed = sum(f for _, f, _ in gathered)
        strict_loops = {i: v for _, _, part in gathered for i, v in part.items()}
    collector = MarginCollector()
    for index in sorted(per_record):
        collector.extend(per_record[index])
    # the main process checks every record (under a launcher too: the same profile)
    derails = derailment_check(cfg, target, draft_loaded, all_items if all_items is not None else items,
                               strict_loops)
    log.info("checking the chosen rule for derailment on the calibration records")
    doc = margins_profile(collector, failed, total, time.perf_counter() - t0, cfg, target, draft_loaded,
                          input_name=input_name, input_sha256=input_sha256, costs=engine.costs,
                          derails=derails, strict_loops=sum(strict_loops.values()))
    return doc


def _calibrate(cfg: CalibrateConfig, log: Log, group) -> int:
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
        target, draft_loaded = load_setup(cfg.setup, log.info, group)
        engine = calibration_engine(cfg, target, draft_loaded, log.info)
        s.value = (identity_for_profile(target.identity),
                   identity_for_profile(draft_loaded.identity) if draft_loaded else None)
    if group is not None and any(v != s.values[0] for v in s.values):
        differ = [r for r, v in enumerate(s.values) if v != s.values[0]]
        raise group.fail_all(f"rank(s) {', '.join(map(str, differ))} loaded other models (or "
                             "dtype, quantization, device type) than rank 0")

    mine = items if group is None else shard(items, group.rank, group.world_size)
    try:
        doc = collect_profile(cfg, engine, mine, target, draft_loaded, log, total=len(items), group=group,
                              all_items=items,
                              input_name="-" if cfg.input == "-" else os.path.basename(cfg.input),
                              input_sha256=input_sha)
    except KeyboardInterrupt:
        log.info("interrupted: no profile written")
        return EXIT_INTERRUPTED
    if doc is None:
        return EXIT_OK  # the main process writes the profile
    if cfg.output == "-":
        text = dump_profile(doc)
        prof = parse_profile(text, "<stdout>")
        sys.stdout.write(text)
        sys.stdout.flush()
    else:
        out = cfg.output or str(user_profile_dir() / f"{doc['name']}.yaml")
        existed = os.path.exists(out)
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        prof = save_profile(doc, out)
        log.info(f"{'replaced' if existed else 'wrote'} profile {out}")
    if not log.quiet:
        show_profile(prof, log.console)
    if cfg.plot:
        plot_profile(doc, cfg.plot)
        log.info(f"wrote plot {cfg.plot}")
    failed = doc["calibration_data"]["failed_records"]
    if failed:
        log.info(f"{failed} of {len(items)} records failed and were left out")
    return EXIT_RECORDS_FAILED if failed else EXIT_OK


def show_profile(p, con) -> None:
    """A profile's choice, summary, histogram and trade-off curve, on `con` (a rich Console)."""

    d = p.data
    s = d["summary"]
    cd = d["calibration_data"]
    con.print(f"profile {p.describe()}  sha256 {p.short_hash}", markup=False)
    con.print(f"target {d['target']['name']} ({d['target']['dtype']}, {d['target']['device_type']}); "
              f"drafter {d['drafter']['kind']} K<={d['drafter']['num_draft_tokens']}", markup=False)
    rule = p.rule
    chosen = f"theta {p.theta:.6g} ({p.margin})" if rule.name == MARS else rule.label()
    con.print(f"{chosen} by {d['policy']['name']} {d['policy']['value']:g}; "
              f"calibrated on {cd['file']}: {cd['records']} records, {cd['tokens']} tokens, "
              f"{cd['positions']} verified draft positions", markup=False)
    rate = f", relax rate {s['relax_rate']:.3f}" if "relax_rate" in s else ""
    con.print(f"estimated: tau strict {s['tau_strict']:.3f} -> {rule.name} {s['tau_mars']:.3f}, relaxable "
              f"{s['relaxable_share']:.3f}{rate}, relaxed {s['relaxed_share']:.3f}/token, "
              f"NLL +{s['nll_increase']:.4f} nats/token", markup=False)
    knob, value = p.knob
    con.print(histogram_text(d["histogram"], value, knob=knob), markup=False, highlight=False)
    con.print(curve_table(d, "trade-off curve (replayed on the calibration run)"))
