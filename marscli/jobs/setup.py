"""The one place a job gets its models and its engine.

Every job (generate, calibrate, bench) and the Python API come here to turn options into
configs, to apply the precedence rule "command line > profile > defaults" (target, drafter,
verification), to load the models (on this rank's device under a launcher), to choose the
profile and to build the engine (marscli.engine.build_engine). Nothing else does any of it.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from marscli.calibration.profiles import (
    ProfileError,
    drafter_description,
    find_matching_profile,
    load_profile,
    match_problems,
    resolve_profile,
)
from marscli.calibration.speed import strict_reason
from marscli.config import (
    COMPILE_MODES,
    DEFAULT_NUM_DRAFT_TOKENS,
    MODEL_TREE_DEFAULTS,
    OUTPUT_FORMATS,
    RELAX_AT,
    SPANS_OFF,
    STRICT_THETA,
    TREE_DEFAULTS,
    TRUNCATIONS,
    DraftConfig,
    GenerationOptions,
    GuardConfig,
    ModelConfig,
    ModelSetup,
    SamplingOptions,
    SamplingParams,
    SpanConfig,
    VerifyConfig,
    VerifyRequest,
)
from marscli.drafters.eagle3_files import load_head
from marscli.drafters.kinds import EAGLE3, MODEL, NGRAM, NONE
from marscli.engine import build_engine
from marscli.errors import ModelLoadError, UsageError
from marscli.heads import shipped_head_for
from marscli.io.distributed import place_device, rank_max_memory
from marscli.jobs.results import generate_results
from marscli.models.loading import (
    DEVICE_MAPS,
    QUANTS,
    check_vocab_compatible,
    load_model,
    max_memory_dict,
    parse_max_memory,
)
from marscli.verification.registry import (
    MARGINS,
    MARS,
    OTHER_KNOBS,
    OWNER,
    PAPER_THETA,
    RULEBOOK,
    RULES,
    STRICT,
    TYPICAL,
    mode_problem,
)
from marscli.verification.spans import compile_regex, parse_strict_in

#: --draft self: the target's own weights, loaded a second time with --draft-quant.
DRAFT_SELF = "self"
EAGLE3_PREFIX = "eagle3:"
#: The source of `--draft eagle3` (no path): the head shipped for the target (marscli.heads).
SHIPPED_HEAD = "<shipped head>"
#: --draft ngram+MODEL: hybrid drafting (prompt lookup, else the draft model)
HYBRID_PREFIX = "ngram+"
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEFAULT_NGRAM_MAX = 3
DEFAULT_NGRAM_MIN = 1
TREE_BATCH_MESSAGE = ("tree drafting runs one record at a time: drop --batch-size "
                      "or the --tree-* options (chain drafting batches)")

Note = Callable[[str], None]


def _silent(_: str) -> None:
    pass


# --------------------------------------------------------------------------- options -> configs


def parse_draft(draft: str) -> tuple[str, str | None]:
    """'none' | 'ngram' | 'eagle3:PATH' | 'self' | a model path or hub id -> (kind, model);
    'self' is a draft model whose source is the target's (``model_configs``)."""
    if draft in (NONE, NGRAM):
        return draft, None
    if draft in (EAGLE3, EAGLE3_PREFIX):  # the head marscli ships for the target, found once it is loaded
        return EAGLE3, SHIPPED_HEAD
    if draft.startswith(EAGLE3_PREFIX):
        return EAGLE3, draft[len(EAGLE3_PREFIX):]
    return MODEL, draft


def check_choices(margin: str | None = None, dtype: str = "auto", ngram_min: int | None = None,
                  ngram_max: int | None = None, verify: str | None = None,
                  truncate_prompt: str = "none", output_format: str = "default") -> None:
    """Values Typer cannot check by itself (free strings of a fixed set, pairs)."""

    if output_format not in OUTPUT_FORMATS:
        raise UsageError(f"--output-format must be 'default' or 'openai', got {output_format!r}")
    if verify is not None and verify not in RULES:
        raise UsageError(f"--verify must be one of {', '.join(RULES)}, got {verify!r}")
    if margin is not None and margin not in MARGINS:
        raise UsageError(f"--margin must be 'logit-ratio' or 'prob-ratio', got {margin!r}")
    low, high = ngram_min or DEFAULT_NGRAM_MIN, ngram_max or DEFAULT_NGRAM_MAX
    if low > high:
        raise UsageError(f"--ngram-min ({low}) must not exceed --ngram-max ({high})")
    if dtype not in DTYPES:
        raise UsageError(f"--dtype must be auto, float32, bfloat16 or float16, got {dtype!r}")
    if truncate_prompt not in TRUNCATIONS:
        raise UsageError(f"--truncate-prompt must be 'none' or 'left', got {truncate_prompt!r}")


def named_profile(name: str | None):
    """The profile asked for by name or path (--profile), or None."""
    if name is None:
        return None

    return resolve_profile(name)


def target_source(target: str | None, profile) -> str | None:
    """Command line > profile > the embedded default (None) for the target."""
    if target is not None or profile is None:
        return target
    return profile.target_source


def draft_config(o: GenerationOptions, profile=None) -> DraftConfig:
    """Command line > profile > defaults for the drafter (``o``'s drafting options). Any of
    --tree-depth, --tree-top-k, --tree-tokens turns EAGLE-3 tree drafting on;
    --job-corpus/--no-job-corpus: default on, profiles do not carry it."""
    draft, tree = o.draft, (o.tree_depth, o.tree_top_k, o.tree_tokens)
    pd = profile.data["drafter"] if profile is not None else {}
    if draft is None and pd:
        if pd["kind"] == MODEL:
            draft = (pd["model"] or {}).get("source")
            if draft and pd.get("hybrid"):
                draft = HYBRID_PREFIX + draft
        elif pd["kind"] == EAGLE3:
            draft = EAGLE3_PREFIX + str((pd["model"] or {}).get("source"))
        else:
            draft = pd["kind"]
    draft = draft or NGRAM
    hybrid = draft.startswith(HYBRID_PREFIX)
    if hybrid:
        draft = draft[len(HYBRID_PREFIX):]
        if draft in ("", NONE, NGRAM) or draft.startswith(EAGLE3_PREFIX):
            raise UsageError("--draft ngram+MODEL needs a draft model (a packaged name, path, "
                             "hub id or self), e.g. --draft ngram+qwen2.5-coder-0.5b-instruct")
    kind, model = parse_draft(draft)
    from_profile = bool(pd) and pd["kind"] == kind
    prof_tree = (pd.get("tree") or {}) if from_profile else {}
    if any(v is not None for v in tree) or prof_tree:
        depth, top_k, tokens = tree_settings(kind, tree, prof_tree)
    else:
        depth = top_k = tokens = None

    def pick(given, key, default):
        if given is not None:
            return given
        if from_profile and pd.get(key) is not None:
            return pd[key]
        return default

    return DraftConfig(
        kind, model,
        pick(o.num_draft_tokens, "num_draft_tokens", DEFAULT_NUM_DRAFT_TOKENS),
        pick(o.ngram_max, "ngram_max", DEFAULT_NGRAM_MAX),
        pick(o.ngram_min, "ngram_min", DEFAULT_NGRAM_MIN),
        pick(o.adaptive, "adaptive", True),
        depth, top_k, tokens,
        o.job_corpus is not False,
        hybrid,
        draft_context(o.draft_context, kind),
    )


def draft_context(context: int | None, kind: str) -> int | None:
    """--draft-context: a draft model's prompt window (None: the whole prompt)."""
    if context is not None and kind != MODEL:
        raise UsageError(f"--draft-context limits what a draft model reads of the prompt; the {kind} "
                         "drafter has no prefill to save (use --draft MODEL or ngram+MODEL)")
    return context


def tree_settings(kind: str, given: tuple, prof_tree: dict) -> tuple[int | None, int, int]:
    """(depth, top_k, tokens) of tree drafting from the --tree-* options given (None: not
    given) over the profile's tree: an EAGLE-3 head's EAGLE-2 tree, or a draft model's chain
    with sibling leaves (no depth: its chain's length is chosen per step)."""
    if kind == EAGLE3:
        return tuple(v if v is not None else prof_tree.get(key, default)
                     for v, key, default in zip(given, ("depth", "top_k", "tokens"), TREE_DEFAULTS))
    if kind != MODEL:
        raise UsageError("--tree-depth, --tree-top-k and --tree-tokens need a draft model "
                         "(--draft MODEL) or an EAGLE-3 drafter (--draft eagle3:PATH)")
    if given[0] is not None:
        raise UsageError("--tree-depth is EAGLE-3's: a draft model's tree is its chain (up to "
                         "--num-draft-tokens, the length chosen per step) with sibling leaves; "
                         "use --tree-top-k and --tree-tokens")
    top_k, tokens = (v if v is not None else (prof_tree.get(key) or default)
                     for v, key, default in zip(given[1:], ("top_k", "tokens"), MODEL_TREE_DEFAULTS))
    if top_k < 2:
        raise UsageError(f"--tree-top-k {top_k}: a draft model's tree needs at least 2 (its "
                         "first choice is the chain; the others are the siblings)")
    return None, top_k, tokens


def compile_mode(value: str) -> str:
    """--compile's value, checked before anything is loaded."""
    mode = str(value).strip().lower()
    if mode not in COMPILE_MODES:
        raise UsageError(f"--compile takes {', '.join(COMPILE_MODES)}; got {value!r}")
    return mode


def relax_at(value: str) -> str:
    """--relax-at's value, checked before anything is loaded."""
    where = str(value).strip().lower()
    if where not in RELAX_AT:
        raise UsageError(f"--relax-at takes {', '.join(RELAX_AT)}; got {value!r}")
    return where


def check_batch(draft: DraftConfig, batch_size: int) -> None:
    """Refused before anything is loaded: trees decode one record at a time."""
    if draft.tree and batch_size > 1:
        raise UsageError(TREE_BATCH_MESSAGE)


def model_configs(target: str | None, draft: DraftConfig, o: GenerationOptions):
    """Target and draft model configs from ``o``'s model and placement options. --max-memory
    bounds the target only: the draft model, loaded after it, is placed by accelerate in the
    memory left (a device map of its own). --offline: a hub id must already be in the local
    cache (never download)."""

    device_map, max_memory, bnb_compute_dtype = o.device_map, o.max_memory, o.bnb_compute_dtype
    if device_map is not None and device_map not in DEVICE_MAPS:
        raise UsageError(f"--device-map must be one of {', '.join(DEVICE_MAPS)}, got {device_map!r}")
    if bnb_compute_dtype not in DTYPES:
        raise UsageError(f"--bnb-compute-dtype must be auto, float32, bfloat16 or float16, got {bnb_compute_dtype!r}")
    pairs = None
    if max_memory is not None:
        try:
            pairs = parse_max_memory(max_memory)
        except ValueError as e:
            raise UsageError(f"--max-memory {e}") from None
        device_map = device_map or "auto"
    for flag, value in (("--quant", o.quant), ("--draft-quant", o.draft_quant)):
        if value is not None and value not in (*QUANTS, "none"):
            raise UsageError(f"{flag} must be none, {', '.join(QUANTS)}, got {value!r}")
    quant = None if o.quant in (None, "none") else o.quant
    # --load-in-8bit / --load-in-4bit are the older spelling of both options at once.
    legacy = "int8" if o.load_in_8bit else "4bit" if o.load_in_4bit else None
    draft_quant = legacy if o.draft_quant is None else None if o.draft_quant == "none" else o.draft_quant
    if o.draft_quant not in (None, "none") and draft.kind != MODEL:  # the old flags are for both, if any
        raise UsageError(f"--draft-quant applies to a draft model; the drafter is {draft.kind}")
    tcfg = ModelConfig(target, o.dtype, o.device, device_map, o.load_in_8bit, o.load_in_4bit, pairs,
                       bnb_compute_dtype, o.offline, quant)
    source = draft.model
    if draft.model == DRAFT_SELF:
        # A quantized copy of the target drafts for it: it agrees with the target most of the
        # time and reads a fraction of its bytes. The same weights as loaded would only
        # double every step's work, so the copy must differ.
        if draft_quant is None:
            raise UsageError("--draft self needs --draft-quant (int8 or 4bit): the target's "
                             "own weights, quantized, draft for it")
        if draft_quant == (quant or legacy):
            raise UsageError(f"--draft self with --draft-quant {draft_quant} and --quant {quant or legacy} "
                             "drafts with the target itself: quantize the draft copy differently")
        source = target
    dcfg = (ModelConfig(source, o.dtype, o.device, device_map, False, False, None,
                        bnb_compute_dtype, o.offline, draft_quant) if draft.model else None)
    return tcfg, dcfg


def check_rule_request(req: VerifyRequest, profile_rule: str | None = None,
                       profile_pending: bool = False) -> None:
    """The rule's knobs as asked, checked before anything is loaded: a knob needs its rule
    (--rho needs --verify ratio, or a profile of the ratio rule), a rule needs its main knob
    (--verify ratio needs --rho, unless a profile of that rule supplies it), and every knob
    lies in its range (marscli.verification.rules.Rule says which). ``profile_rule``: the rule of the
    profile in use; ``profile_pending``: a matching profile may still be found once the
    target is loaded (then what it could supply is not yet required)."""
    given = [k for k in OTHER_KNOBS if getattr(req, k) is not None]
    mode = req.mode or profile_rule
    for knob in given:
        option, owner = RULEBOOK[OWNER[knob]].knob(knob).option, OWNER[knob]
        if mode is None:
            if profile_pending:
                continue
            raise UsageError(f"{option} needs --verify {owner}")
        if mode != owner:
            raise UsageError(f"{option} belongs to --verify {owner}, not --verify {mode}")
    main = RULEBOOK[mode].main_knob if mode is not None else None
    if main is not None and mode != MARS:  # MARS's theta: a profile's, else the paper's
        supplied = mode == profile_rule or (profile_pending and profile_rule is None)
        if getattr(req, main.name) is None and not supplied:
            raise UsageError(f"--verify {mode} needs {main.option} ({main.bounds})")
        if req.theta is not None:
            raise UsageError(f"--theta belongs to --verify mars, not --verify {mode}")
    owners = {OWNER[k] for k in given}
    # building the Rule checks every knob's range (Rule.__post_init__)
    verify_config(mode=mode or (owners.pop() if len(owners) == 1 else STRICT), **{k: getattr(req, k) for k in given})


def verify_config(*args: Any, **kwargs: Any) -> VerifyConfig:
    """VerifyConfig(*args, **kwargs), its knobs checked: a knob out of range is a usage error
    naming its option."""
    try:
        return VerifyConfig(*args, **kwargs)
    except ValueError as e:
        raise UsageError(str(e)) from None


def resolve_verification(req: VerifyRequest, profile, note: Note = _silent) -> VerifyConfig:
    """Command line > profile > defaults for verification -> VerifyConfig.

    With a profile, its rule at its knobs is the default (MARS at its theta and margin
    statistic for profiles made before other rules existed); a knob given on the command
    line replaces the profile's, and --verify naming another rule takes that rule's knobs
    from the command line only. Without a profile, strict verification (or the paper's theta
    for an explicit --verify mars).
    """
    prule = profile.rule if profile is not None else None
    check_rule_request(req, prule.name if prule is not None else None)
    guard = resolve_guard(req, profile)
    given = {k: getattr(req, k) for k in OTHER_KNOBS if getattr(req, k) is not None}
    if prule is not None and (req.mode or prule.name) == prule.name:
        mode = prule.name
        speed = profile.speed
        if (req.mode is None and req.theta is None and not given and speed is not None
                and speed["verify_strictly"]):

            note(f"profile {profile.describe()}: {strict_reason(speed)}: verifying strictly "
                 f"(--verify {mode} relaxes anyway)")
            return verify_config(STRICT, STRICT_THETA, req.margin or prule.margin, guard)
        margin = req.margin or prule.margin
        if mode == MARS and req.theta is None and margin != prule.margin:
            raise ProfileError(
                f"{profile.describe()}: theta {prule.theta:g} was calibrated for "
                f"{prule.margin}, not {margin}: give --theta with --margin {margin}"
            )
        if mode == TYPICAL and "epsilon" in given and "alpha" not in given:
            given["alpha"] = None  # a new epsilon ties alpha to it again unless --alpha is given
        try:
            rule = dataclasses.replace(prule, margin=margin, **given,
                                       **({"theta": req.theta} if req.theta is not None else {}))
        except ValueError as e:
            raise UsageError(str(e)) from None
        return VerifyConfig.from_rule(rule, guard)
    mode = req.mode or "strict"
    margin = req.margin or "logit-ratio"
    theta = req.theta
    if mode == MARS and theta is None:
        theta = PAPER_THETA
        note(f"--verify mars without --theta or a profile of MARS: using the paper's theta = {PAPER_THETA}")
    if mode == STRICT and req.theta is not None:
        note("--theta has no effect with --verify strict")
    knobs = {k: v for k, v in given.items() if OWNER[k] == mode}
    return verify_config(mode, theta if mode == MARS else STRICT_THETA, margin, guard, **knobs)


def check_rule_modes(rule, sampling: SamplingParams, what: str = "--temperature") -> None:
    """A rule that does not define this decoding mode (regret: greedy only) is a usage error.
    rule: a marscli.verification.rules.Rule or a rule's name."""
    problem = mode_problem(rule if isinstance(rule, str) else rule.name, sampling.temperature)
    if problem is not None:
        raise UsageError(f"{what} {sampling.temperature:g}: {problem}")


def resolve_guard(req: VerifyRequest, profile) -> GuardConfig:
    """Command line > profile > defaults for the loop guard (on by default: marscli.verification.guard)."""
    base = profile.guard if profile is not None and profile.guard is not None else GuardConfig()
    try:
        return GuardConfig(
            base.repeat_ngram if req.repeat_ngram is None else req.repeat_ngram,
            base.repeat_window if req.repeat_window is None else req.repeat_window,
            base.max_relaxed_share if req.max_relaxed_share is None else req.max_relaxed_share,
            base.strict_first if req.strict_first is None else req.strict_first,
            base.strict_stops if req.strict_stops is None else req.strict_stops,
            base.loop_rewind if req.loop_rewind is None else req.loop_rewind)
    except ValueError as e:
        raise UsageError(str(e)) from None


def guard_request(o: GenerationOptions) -> dict[str, Any]:
    """The guard options of generate, calibrate and bench -> VerifyRequest fields."""
    repeat_guard, repeat_window, max_relaxed_share = o.repeat_guard, o.repeat_window, o.max_relaxed_share
    strict_first, strict_stops, loop_rewind = o.strict_first, None, o.loop_rewind
    if o.no_guard:  # the paper's rule alone; an explicit --strict-first N still applies
        if repeat_guard not in (None, 0) or max_relaxed_share not in (None, 1.0) or loop_rewind not in (None, 0):
            raise UsageError("--no-guard excludes --repeat-guard, --max-relaxed-share and --loop-rewind")
        repeat_guard, max_relaxed_share, strict_stops, loop_rewind = 0, 1.0, False, 0
        strict_first = 0 if strict_first is None else strict_first
    return {"repeat_ngram": repeat_guard, "repeat_window": repeat_window,
            "max_relaxed_share": max_relaxed_share, "strict_first": strict_first,
            "strict_stops": strict_stops, "loop_rewind": loop_rewind}


def span_config(strict_in: str | None = None, strict_regex: str | None = None) -> SpanConfig:
    """--strict-in KINDS and --strict-regex PATTERN -> SpanConfig (checked: the kinds exist,
    the pattern compiles)."""

    try:
        kinds = parse_strict_in(strict_in)
        if strict_regex is not None:
            compile_regex(strict_regex)
    except ValueError as e:
        raise UsageError(str(e)) from None
    return SpanConfig(kinds, strict_regex) if kinds or strict_regex is not None else SPANS_OFF


# --------------------------------------------------------------------------- loading


def place(model: ModelConfig | None, group) -> ModelConfig | None:
    """This rank's device: cuda:LOCAL_RANK for --device auto/cuda, its share of the GPUs for
    --device-map."""
    if model is None or group is None:
        return model

    if model.device_map is not None:
        share = rank_max_memory(group.launch, max_memory_dict(model.max_memory))
        pairs = None if share is None else tuple((str(k), v) for k, v in share.items())
        return dataclasses.replace(model, max_memory=pairs)
    return dataclasses.replace(model, device=place_device(model.device, group.launch))


def load_models(target_cfg: ModelConfig, draft_cfg: ModelConfig | None, note: Note = _silent,
                group=None, kind: str = MODEL):
    """Load the target and (if any) the draft model or EAGLE-3 head (kind "eagle3"); check
    that they fit each other. Under a launcher each model goes to this rank's device(s), the
    draft model's share reckoned with the memory the target left."""

    t0 = time.perf_counter()
    target = load_model(place(target_cfg, group), role="target", log=note)
    draft = None
    if draft_cfg is not None and kind == EAGLE3:
        source = str(draft_cfg.source)
        if source == SHIPPED_HEAD:
            found = shipped_head_for(target.identity)
            if found is None:
                name = target.identity.get("name")
                raise ModelLoadError(f"--draft eagle3: marscli ships no EAGLE-3 head for {name}; "
                                     "train one (marscli train-head) and pass --draft eagle3:FOLDER")
            source = str(found)
        draft = load_head(source, target, log=note)
    elif draft_cfg is not None:
        draft = load_model(place(draft_cfg, group), role="draft", log=note)
        check_vocab_compatible(target, draft)
    note(f"loaded {target.identity.get('name')} on {target.device} in {time.perf_counter() - t0:.1f} s")
    return target, draft


def choose_profile(target, draft_loaded, draft: DraftConfig, *, profile: str | None = None,
                   auto: bool = True, verify_mode: str | None = None, note: Note = _silent):
    """The profile a generation runs with: the one asked for, else the newest matching one."""

    drafter = drafter_description(draft.kind, draft_loaded.identity if draft_loaded else None, draft.hybrid)
    if profile is not None:
        prof = load_profile(profile)
        problems = match_problems(prof, target.identity, drafter)
        if problems is None:
            note(f"warning: profile {prof.describe()} was calibrated for other weights or another "
                 "drafter; using it because you asked")
        elif problems:
            note(f"warning: profile {prof.describe()} was calibrated with {'; '.join(problems)}")
        note(f"using profile {prof.describe()} (sha256 {prof.short_hash})")
        return prof
    if not auto or draft.kind == NONE:
        return None
    # --verify naming a relaxed rule looks for a profile of that rule only
    rule = verify_mode if verify_mode not in (None, "strict") else None
    prof = find_matching_profile(target.identity, drafter, note=note, rule=rule)
    if prof is not None:
        note(f"using profile {prof.describe()} (sha256 {prof.short_hash}), matched to the target")
    elif verify_mode is None:
        note("no calibrated profile for this target and drafter: verifying strictly "
             "(run `marscli calibrate` to make one)")
    return prof


def check_sampling_options(o: SamplingOptions) -> None:
    """The sampling and output options, checked before anything is loaded (the command
    line's bounds hold already; the API's keywords are checked here)."""
    check_choices(truncate_prompt=o.truncate_prompt, output_format=o.output_format)
    if o.n < 1:
        raise UsageError(f"n must be at least 1, got {o.n}")
    if o.top_logprobs is not None and not 0 <= o.top_logprobs <= 20:
        raise UsageError(f"top_logprobs must be in [0, 20], got {o.top_logprobs}")


def drafter_desc(d: DraftConfig) -> str:
    if d.kind == NONE:
        return "none"
    context = f", the prompt's last {d.context} tokens" if d.context else ""
    if d.sibling_tree:
        return (f"{'ngram+' if d.hybrid else ''}{d.kind} tree (chain K<={d.num_draft_tokens}, "
                f"top-k {d.tree_top_k}, {d.tree_tokens} tokens{context})")
    if d.tree:
        return f"{d.kind} tree (depth {d.tree_depth}, top-k {d.tree_top_k}, {d.tree_tokens} tokens)"
    return f"{'ngram+' if d.hybrid else ''}{d.kind} (K<={d.num_draft_tokens}{context})"


def verify_desc(v: VerifyConfig) -> str:
    """One line: "strict", "mars (theta=0.9, logit-ratio; repeat guard ...)",
    "ratio (rho=0.5; repeat guard ...)"."""
    if v.mode == STRICT:
        return v.mode
    g = v.guard
    guard = ", ".join(([f"repeat guard {g.repeat_ngram}-grams in {g.repeat_window} tokens"]
                       if g.repeat_ngram else []) +
                      ([f"at most {g.max_relaxed_share:g} relaxed"] if g.budgeted else []) +
                      ([f"first {g.strict_first} strict"] if g.strict_first else []) +
                      (["strict stops"] if g.strict_stops else [])) or "no guard"
    if v.mode == MARS:
        return f"mars (theta={v.theta:g}, {v.margin}; {guard})"
    knobs = ", ".join(f"{k}={x:g}" for k, x in v.rule.knobs().items())
    return f"{v.mode} ({knobs}; {guard})"


def json_knobs(rule) -> dict[str, Any]:
    """Rule.knobs() as JSON values: a knob at infinity (typical's alpha = inf: its strict
    end) as the string "inf", since result lines hold no Infinity."""
    return {k: (str(x) if isinstance(x, float) and not math.isfinite(x) else x) for k, x in rule.knobs().items()}


# --------------------------------------------------------------------------- generation


@dataclass
class Generator:
    """Loaded models with their engine, verification and profile: what `marscli generate`
    and `marscli.load(...)` generate with."""

    target: Any  # marscli.models.loading.LoadedModel
    draft_loaded: Any  # the draft model or EAGLE-3 head, or None
    draft: DraftConfig
    verify: VerifyConfig
    profile: Any  # marscli.calibration.profiles.Profile or None
    engine: Any
    batch_size: int = 1
    spans: SpanConfig = SPANS_OFF

    @property
    def spec_meta(self) -> dict[str, Any]:
        """The verification fields of every result's `spec`."""
        v = self.verify
        rule = v.rule
        return {"drafter": self.draft.kind, **({"hybrid": True} if self.draft.hybrid else {}),
                **({"draft_context": self.draft.context} if self.draft.context else {}), "verify": v.mode,
                "theta": v.theta if v.mode == MARS else None, "margin": v.margin,
                "knobs": json_knobs(rule),
                **({"guard": v.guard.to_dict()} if rule.relaxes else {}),
                **({"spans": self.spans.to_dict()} if self.spans.active and rule.relaxes else {}),
                "profile": self.profile.reference() if self.profile is not None else None,
                **({"quantization": quant} if any((quant := self.quantization).values()) else {}),
                **({"compile": kind} if (kind := self.engine.step_kind) != "eager" else {})}

    @property
    def quantization(self) -> dict[str, str | None]:
        """The target's and the draft model's quantization labels (None: the dtype's weights)."""
        draft = getattr(self.draft_loaded, "identity", None) if self.draft.kind == MODEL else None
        return {"target": self.target.identity.get("quantization"),
                "draft": (draft or {}).get("quantization")}

    def results(self, items: Iterable, sampling: SamplingParams, options) -> Iterator[tuple[Any, dict, float]]:
        """(item, result line, seconds generating) per record, as records finish; see
        marscli.jobs.results.generate_results."""

        return generate_results(self.engine, items, sampling, options, self.spec_meta, self.batch_size)


def load_setup(setup: ModelSetup, note: Note = _silent, group=None):
    """The setup's target and drafter model (or head), loaded: (target, draft_loaded)."""
    return load_models(setup.target, setup.draft_model, note, group, setup.draft.kind)


def build_generator(setup: ModelSetup, note: Note = _silent, group=None) -> Generator:
    """Load, choose the profile, resolve verification, build the engine."""
    target, draft_loaded = load_setup(setup, note, group)
    prof = choose_profile(target, draft_loaded, setup.draft, profile=setup.profile,
                          auto=setup.auto_profile, verify_mode=setup.verify.mode, note=note)
    verify = resolve_verification(setup.verify, prof, note)
    spans = resolve_spans(setup, prof, note) if verify.rule.relaxes else setup.spans
    engine = build_engine(target, draft_loaded, verify, setup.draft, setup.batch_size, note, spans=spans,
                          prefix_cache_mib=setup.prefix_cache, compile_mode=setup.compile,
                          relax_at=setup.relax_at)
    if setup.batch_size > 1:
        note(f"batch size {setup.batch_size}")
    if setup.spans.active and not verify.rule.relaxes:
        note("--strict-in / --strict-regex have no effect with strict verification")
    return Generator(target, draft_loaded, setup.draft, verify, prof, engine, setup.batch_size, spans)


def generation_setup(o: GenerationOptions, need_drafter: str | None = None) -> ModelSetup:
    """GenerationOptions -> ModelSetup, checked before anything is loaded: THE one path of
    `marscli generate`, `marscli calibrate`, `marscli bench`, `marscli train-head` and
    marscli.load. Command line > profile > defaults: a --profile supplies the target and the
    drafter's settings that are not given. need_drafter: the usage error when the drafter is
    none (calibrate needs one)."""
    check_choices(o.margin, o.dtype, o.ngram_min, o.ngram_max, o.verify)
    if o.profile is not None and not o.auto_profile:
        raise UsageError("--profile and --no-profile exclude each other")
    prof = named_profile(o.profile)
    dcfg = draft_config(o, prof)
    check_batch(dcfg, o.batch_size)
    if need_drafter is not None and dcfg.kind == NONE:
        raise UsageError(need_drafter)
    tcfg, dmcfg = model_configs(target_source(o.target, prof), dcfg, o)
    request = VerifyRequest(o.verify, o.theta, o.margin, **guard_request(o),
                            **{k: getattr(o, k) for k in OTHER_KNOBS})
    check_rule_request(request, prof.rule.name if prof is not None else None,
                       profile_pending=prof is None and o.auto_profile and dcfg.kind != NONE)
    spans = span_config(o.strict_in, o.strict_regex)
    return ModelSetup(tcfg, dcfg, dmcfg, request,
                      str(prof.path) if prof is not None else None, o.auto_profile, o.batch_size, spans,
                      o.strict_in is not None or o.strict_regex is not None,
                      o.prefix_cache, compile_mode(o.compile), relax_at(o.relax_at))


def resolve_spans(setup: ModelSetup, profile, note: Note = _silent) -> SpanConfig:
    """Command line > profile > none for strict spans: --strict-in / --strict-regex when given
    (--strict-in none: none), else the spans the profile was calibrated with."""
    if setup.spans_given or profile is None or not profile.spans.active:
        return setup.spans
    note(f"profile {profile.name}: strict spans {profile.spans.label()} (--strict-in none relaxes there too)")
    return profile.spans

