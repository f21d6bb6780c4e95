"""Frozen configuration and request types shared by the library and the CLI.

The CLI parses options into these dataclasses once; everything below the CLI takes them as
plain values. Nothing here imports torch, so `marscli --help` stays fast.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

from marscli.drafters.kinds import MODEL, NGRAM
from marscli.verification.guard import (
    DEFAULT_GUARD_NGRAM,
    DEFAULT_GUARD_WINDOW,
    DEFAULT_LOOP_REWIND,
    DEFAULT_MAX_RELAXED_SHARE,
    DEFAULT_STRICT_FIRST,
)
from marscli.verification.registry import ALL_KNOBS, LOGIT_RATIO, STRICT, Rule, verify_help

#: A rule's name (marscli.verification.registry.RULES) and a margin statistic's (MARGINS).
VerifyMode = str
MarginKind = str

#: theta that makes no position relaxable: MARS degenerates to strict verification.
STRICT_THETA = math.inf

DEFAULT_MAX_TOKENS = 256
DEFAULT_NUM_DRAFT_TOKENS = 8
#: The bound of a run's prefix cache, MiB (--prefix-cache; marscli.models.prefill).
DEFAULT_PREFIX_CACHE_MIB = 512
#: --compile: auto (captured steps on CUDA, eager on a CPU), on (captured on CUDA, compiled by
#: torch.compile on a CPU), off (marscli.models.slots, docs/engine.md "The captured step").
COMPILE_MODES = ("auto", "on", "off")
#: Where a relaxed rule judges the drafter's proposals (--relax-at): at every output position,
#: from the record's own text, so the text does not depend on draft lengths, the batch or
#: timings (the default); or only at the drafted positions of a fixed-K chain, the paper's
#: Algorithm 1 (reference checks: its text depends on K).
RELAX_EVERY = "every"
RELAX_DRAFTED = "drafted"
RELAX_AT = (RELAX_EVERY, RELAX_DRAFTED)
#: EAGLE-3 tree drafting defaults, EAGLE-3's own (eagle/model/ea_model.py): depth 7, top-k 10,
#: 60 tokens (the MARS paper's runs: depth 6-7, top-k 10, 50-60 tokens).
TREE_DEFAULTS = (7, 10, 60)
#: Draft-model tree defaults (top-k, tokens): the chain plus the draft model's second choice as a
#: sibling leaf at its least certain positions, 16 tokens in all counting the root (measured on a
#: CPU in lab/benchmarks-history.md: there the extra verified tokens cost more than they keep).
MODEL_TREE_DEFAULTS = (2, 16)


@dataclass(frozen=True)
class SamplingParams:
    """Per-record decoding settings. temperature == 0 means greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k filtering
    max_tokens: int = DEFAULT_MAX_TOKENS
    seed: int = 0
    stop: tuple[str, ...] = ()
    #: Completions per request: choice i decodes with seed + i (marscli.jobs.results).
    n: int = 1
    #: Report the target's log-probability of each completion token, with the top_logprobs
    #: most likely alternatives (raw target logits, whatever the sampling settings).
    logprobs: bool = False
    top_logprobs: int = 0
    #: Report where each completion token came from (marscli.engine.provenance): accepted
    #: draft, relaxed draft (with the rule's statistic), correction, bonus or target token.
    provenance: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def with_overrides(self, overrides: dict[str, Any]) -> SamplingParams:
        """Apply per-record overrides (already validated by marscli.io.records)."""
        if not overrides:
            return self
        kw = dict(overrides)
        if "stop" in kw:
            kw["stop"] = tuple(kw["stop"])
        return replace(self, **kw)


@dataclass(frozen=True)
class GuardConfig:
    """What keeps a relaxed rule from running away (issue 17; marscli.verification.guard).

    repeat_ngram: never relax a draft token that completes an n-gram of this size already
    seen in the last ``repeat_window`` tokens of the record's output (0: no loop guard).
    max_relaxed_share: a record relaxes at most floor(share * max_tokens) tokens, then is
    verified strictly (1.0: no budget).
    strict_first: the first N generated tokens of every output are verified strictly, like a
    strict span (0: none).
    strict_stops: a relaxed rule never decides where an output ends: it never accepts a stop
    token (an EOS token, or a stop string's first token) the target did not choose, and never
    relaxes at a position whose target top-1 is a stop token (False: the paper's rule).
    loop_rewind: take back a relaxation that derails: when the output falls into a loop
    (guard.loop_period's test) whose periodic tail begins at most this many tokens after a
    relaxed token, the record rewinds to the earliest such token, decides its position
    strictly and relaxes no more (0: never; the position-wise rules only:
    marscli.engine.sequence.Sequence.commit).
    None changes strict verification.
    """

    repeat_ngram: int = DEFAULT_GUARD_NGRAM
    repeat_window: int = DEFAULT_GUARD_WINDOW
    max_relaxed_share: float = DEFAULT_MAX_RELAXED_SHARE
    strict_first: int = DEFAULT_STRICT_FIRST
    strict_stops: bool = True
    loop_rewind: int = DEFAULT_LOOP_REWIND

    def __post_init__(self) -> None:
        if self.repeat_ngram != 0 and self.repeat_ngram < 2:
            raise ValueError(f"--repeat-guard must be 0 (off) or at least 2, got {self.repeat_ngram}")
        if self.repeat_ngram and self.repeat_window < self.repeat_ngram:
            raise ValueError(f"--repeat-window ({self.repeat_window}) must be at least the "
                             f"n-gram size ({self.repeat_ngram})")
        if not 0.0 <= self.max_relaxed_share <= 1.0 or math.isnan(self.max_relaxed_share):
            raise ValueError(f"--max-relaxed-share must be in [0, 1], got {self.max_relaxed_share}")
        if self.strict_first < 0:
            raise ValueError(f"--strict-first must be 0 (off) or more, got {self.strict_first}")
        if self.loop_rewind < 0:
            raise ValueError(f"--loop-rewind must be 0 (off) or more, got {self.loop_rewind}")

    @property
    def budgeted(self) -> bool:
        return self.max_relaxed_share < 1.0

    def budget(self, max_tokens: int) -> int | None:
        """Relaxations a record of max_tokens may make (None: no budget)."""
        return math.floor(self.max_relaxed_share * max_tokens + 1e-9) if self.budgeted else None

    def to_dict(self) -> dict[str, Any]:
        return {"repeat_ngram": self.repeat_ngram, "repeat_window": self.repeat_window,
                "max_relaxed_share": self.max_relaxed_share, "strict_first": self.strict_first,
                "strict_stops": self.strict_stops, "loop_rewind": self.loop_rewind}


#: Every guard off: a relaxed rule is the paper's rule alone (its Algorithm 1).
GUARD_OFF = GuardConfig(0, DEFAULT_GUARD_WINDOW, 1.0, 0, False, 0)


@dataclass(frozen=True)
class SpanConfig:
    """Strict spans (marscli.verification.spans): parts of the output verified strictly whatever the rule.

    strict_in: span kinds among marscli.verification.spans.SPAN_KINDS ("code": inside fenced code blocks;
    "answer": after a final-answer marker); strict_regex: positions whose text before matches
    this Python regex (re.search). Empty: no strict span.
    """

    strict_in: tuple[str, ...] = ()
    strict_regex: str | None = None

    @property
    def active(self) -> bool:
        return bool(self.strict_in) or self.strict_regex is not None

    def to_dict(self) -> dict[str, Any]:
        return {"strict_in": list(self.strict_in), "strict_regex": self.strict_regex}

    def label(self) -> str:
        """'in code, answer; regex '...'' (for notes)."""
        parts = ([f"in {', '.join(self.strict_in)}"] if self.strict_in else []) + (
            [f"regex {self.strict_regex!r}"] if self.strict_regex is not None else [])
        return "; ".join(parts) or "none"


#: No strict span.
SPANS_OFF = SpanConfig()


@dataclass(frozen=True, init=False)
class VerifyConfig:
    """How draft tokens are checked against the target: a rule at its knob values (a
    registry.Rule, which declares the knobs) and the loop guard.

    ``VerifyConfig(mode, theta, margin, guard, **knobs)`` builds the Rule (the knobs:
    registry.OTHER_KNOBS; each at its rule's strict end unless given, and only the knobs of
    ``mode`` matter); a knob out of its range raises ValueError (jobs.setup turns it into a
    usage error naming the option). ``from_rule`` wraps a Rule. ``mode``, ``theta``,
    ``margin`` and every knob read through to the rule."""

    rule: Rule
    #: The loop guard. Off here (the paper's rule, as the library's building block); the jobs
    #: layer turns the default guard on for generate, bench and the Python API. It applies to
    #: every rule that relaxes.
    guard: GuardConfig

    def __init__(self, mode: VerifyMode = STRICT, theta: float = STRICT_THETA, margin: MarginKind = LOGIT_RATIO,
                 guard: GuardConfig = GUARD_OFF, **knobs: Any) -> None:
        object.__setattr__(self, "rule", Rule(mode, theta, margin, **knobs))
        object.__setattr__(self, "guard", guard)

    @classmethod
    def from_rule(cls, rule: Rule, guard: GuardConfig = GUARD_OFF) -> VerifyConfig:
        cfg = cls.__new__(cls)
        object.__setattr__(cfg, "rule", rule)
        object.__setattr__(cfg, "guard", guard)
        return cfg

    @property
    def mode(self) -> VerifyMode:
        return self.rule.name

    def __getattr__(self, name: str) -> Any:
        if name == "margin" or name in ALL_KNOBS:  # theta, rho, ...: the rule's
            return getattr(self.rule, name)
        raise AttributeError(f"'VerifyConfig' object has no attribute {name!r}")


@dataclass(frozen=True)
class VerifyRequest:
    """Verification as asked on the command line; None = not given (a profile or the default
    decides). Resolved into a VerifyConfig once the target (and so its profile) is known."""

    mode: VerifyMode | None = None
    theta: float | None = None
    margin: MarginKind | None = None
    repeat_ngram: int | None = None
    repeat_window: int | None = None
    max_relaxed_share: float | None = None
    strict_first: int | None = None
    strict_stops: bool | None = None
    loop_rewind: int | None = None
    #: The other rules' knobs as given (registry.OTHER_KNOBS: --rho, --top-n, ...).
    rho: float | None = None
    top_n: int | None = None
    delta: float | None = None
    epsilon: float | None = None
    alpha: float | None = None
    budget: float | None = None


@dataclass(frozen=True)
class DraftConfig:
    """Which drafter proposes tokens and how many.

    kind: "none" (plain autoregressive decoding), "ngram" (prompt lookup), "model" (a draft
    model) or "eagle3" (an EAGLE-3 head drafting from the target's hidden states).
    num_draft_tokens: the most drafts per step (K). With adaptive=True the engine chooses every
    row's draft length per step (0 included) from its acceptance estimate and the target's
    measured step costs (marscli.drafters.base.choose_draft_lengths, marscli.engine.costs).
    tree_depth / tree_top_k / tree_tokens: draft a tree instead of a chain. eagle3: an EAGLE-2
    dynamic tree (marscli.drafters.eagle3.TreeShape), all three or none. model: the chain the
    engine chooses the length of, plus the draft model's top-k alternatives as sibling leaves
    (marscli.drafters.model.SiblingTree): depth None, top_k and tokens set.
    job_corpus (ngram only): under strict verification, fall back on the job's finished
    records when a record's own text has no long match (marscli.drafters.ngram.JobCorpus).
    hybrid (model only): an n-gram drafter beside the draft model, the better one each step.
    context (model only): the draft model reads only the last `context` prompt tokens (and
    all it drafts after them), so its prefill of a long prompt costs `context` tokens; None:
    the whole prompt.
    """

    kind: Literal["none", "ngram", "model", "eagle3"] = NGRAM  # drafters.kinds.DRAFTER_KINDS
    model: str | None = None  # path or hub id when kind is "model" or "eagle3"
    num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS
    ngram_max: int = 3
    ngram_min: int = 1
    adaptive: bool = True
    tree_depth: int | None = None
    tree_top_k: int | None = None
    tree_tokens: int | None = None
    job_corpus: bool = True
    #: kind "model" only: prompt lookup drafts where its match promises more tokens per
    #: second than the draft model (marscli.drafters.hybrid; --draft ngram+MODEL)
    hybrid: bool = False
    context: int | None = None

    @property
    def tree(self) -> bool:
        return self.tree_tokens is not None

    @property
    def sibling_tree(self) -> bool:
        """A draft model's tree (its chain with sibling leaves): the engine chooses the chain's
        length per step by measured costs, as for a chain."""
        return self.tree and self.kind == MODEL


@dataclass(frozen=True)
class ModelConfig:
    """Where and how to load a model."""

    source: str | None = None  # None: the embedded default (SmolLM2-135M-Instruct)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: str = "auto"  # auto, cpu, cuda, cuda:N
    device_map: str | None = None  # "auto" (or balanced, balanced_low_0, sequential) -> accelerate
    load_in_8bit: bool = False
    load_in_4bit: bool = False
    #: --max-memory as (device, size) pairs, e.g. (("0", "20GiB"), ("cpu", "64GiB")); implies a
    #: device map. Devices are GPU indices, "cpu" or "disk".
    max_memory: tuple[tuple[str, str], ...] | None = None
    bnb_compute_dtype: str = "auto"  # 4-bit matmul dtype: auto (= the model dtype) or a dtype
    #: Never download: a hub id must already be in the local Hugging Face cache (as with
    #: HF_HUB_OFFLINE=1). False: a hub id not in the cache is downloaded into it.
    offline: bool = False
    #: Quantized weights: None (the dtype's), "int8" (CPU: marscli.models.quant, fbgemm;
    #: CUDA: bitsandbytes 8-bit) or "4bit" (bitsandbytes NF4). load_in_8bit / load_in_4bit
    #: are the older spellings of "int8" / "4bit".
    quant: str | None = None

    @property
    def quantization(self) -> str | None:
        """"int8", "4bit" or None, from `quant` or the older flags (both given: a conflict
        the loader reports)."""
        return self.quant or ("int8" if self.load_in_8bit else "4bit" if self.load_in_4bit else None)


# --------------------------------------------------------------------------- options, declared once

#: Help panels of the command line.
PANEL_MODEL = "Models"
PANEL_DRAFT = "Drafting"
PANEL_VERIFY = "Verification"
PANEL_SAMPLING = "Sampling"
PANEL_OUTPUT = "Input and output"
PANEL_POLICY = "Choosing the knob (one policy)"


@dataclass(frozen=True)
class Flag:
    """How a setting is written on the command line (marscli.cli builds its Typer option):
    its option group, help text and panel, its flags (default: --field-name) and bounds."""

    group: str
    help: str
    panel: str
    flags: tuple[str, ...] = ()
    min: float | None = None
    max: float | None = None


def _opt(default: Any, group: str, panel: str, help: str, *flags: str, **bounds: float) -> Any:
    return field(default=default, metadata={"flag": Flag(group, help, panel, flags, **bounds)})


def _knob(name: str) -> Any:
    """A rule's knob as an option of the "rule" group: help and option name from the registry."""
    knob = ALL_KNOBS[name]
    return _opt(None, "rule", PANEL_VERIFY, knob.help, knob.option)


@dataclass(frozen=True)
class GenerationOptions:
    """What loads the models and builds a generator: `marscli generate`'s options,
    ``marscli.load``'s keywords and (its model, drafting, guard and spans groups) bench's.
    Declared once, here: the command line's Typer options (marscli.cli.options), load's
    signature and marscli.jobs.setup.generation_setup all come from these fields, so a new
    option is one field. None means "not given": the profile or the default decides."""

    # model
    target: str | None = _opt(None, "model", PANEL_MODEL, "Target model: a packaged model's short name (`marscli models`), local dir, .gguf file or hub id (downloaded into the Hugging Face cache unless --offline). Default: embedded SmolLM2-135M-Instruct (or the --profile's target).")
    dtype: str = _opt("auto", "model", PANEL_MODEL, "auto, float32, bfloat16 or float16.")
    device: str = _opt("auto", "model", PANEL_MODEL, "auto, cpu, cuda or cuda:N.")
    offline: bool = _opt(False, "model", PANEL_MODEL, "Never download: a hub id must already be in the local cache (as with HF_HUB_OFFLINE=1).", "--offline")
    # placement
    device_map: str | None = _opt(None, "placement", PANEL_MODEL, "'auto' to spread the target and the draft model over the GPUs (then the CPU) with accelerate, for models larger than one GPU; also balanced, balanced_low_0, sequential. Under a launcher each process takes its share of the machine's GPUs.")
    quant: str | None = _opt(None, "model", PANEL_MODEL, "Quantized target weights: 'int8' (on CPU marscli's fbgemm int8 kernels, about a quarter of float32's bytes per token; on CUDA bitsandbytes 8-bit) or '4bit' (bitsandbytes NF4; CUDA). Strict output equals plain decoding of the model as quantized.")
    draft_quant: str | None = _opt(None, "model", PANEL_DRAFT, "Quantized draft-model weights: 'none', 'int8' or '4bit', as --quant. The target is untouched, so strict output stays the target's.")
    load_in_8bit: bool = _opt(False, "placement", PANEL_MODEL, "Older spelling of --quant int8 --draft-quant int8.")
    load_in_4bit: bool = _opt(False, "placement", PANEL_MODEL, "Older spelling of --quant 4bit --draft-quant 4bit (bitsandbytes; CUDA, or --device cpu for its slow CPU backend).")
    max_memory: str | None = _opt(None, "placement", PANEL_MODEL, "With a device map, the most the target may take per device, e.g. '0=20GiB,1=20GiB,cpu=64GiB' (implies --device-map auto).")
    bnb_compute_dtype: str = _opt("auto", "placement", PANEL_MODEL, "dtype of the 4-bit matmuls: auto (= --dtype), float32, bfloat16 or float16.", "--bnb-compute-dtype")
    # drafting
    draft: str | None = _opt(None, "drafting", PANEL_DRAFT, "Drafter: 'ngram' (prompt lookup, default), 'none' (plain decoding), a draft model (packaged short name, path or hub id), 'self' (the target's own weights quantized by --draft-quant), 'ngram+MODEL' (prompt lookup where its match pays more, MODEL elsewhere; MODEL may be self), or 'eagle3:PATH' (an EAGLE-3 head folder / hub id; see docs/drafters.md).")
    num_draft_tokens: int | None = _opt(None, "drafting", PANEL_DRAFT, f"Most draft tokens per step (K); default {DEFAULT_NUM_DRAFT_TOKENS}.", "--num-draft-tokens", "-k", min=1, max=64)
    adaptive: bool | None = _opt(None, "drafting", PANEL_DRAFT, "Choose each row's draft length per step from how often drafts pass and the measured forward costs (default) or always draft K.", "--adaptive/--fixed-k")
    ngram_max: int | None = _opt(None, "drafting", PANEL_DRAFT, "Longest suffix n-gram to match (default 3).", min=1, max=16)
    ngram_min: int | None = _opt(None, "drafting", PANEL_DRAFT, "Shortest suffix n-gram to match (default 1).", min=1, max=16)
    tree_depth: int | None = _opt(None, "drafting", PANEL_DRAFT, "EAGLE-3 tree drafting: expansions after the first top-k (EAGLE's depth; paths hold up to depth+1 drafts). Any --tree-* option turns tree drafting on (default depth 7). A draft model's tree has the depth of its chain (up to --num-draft-tokens).", min=0, max=32)
    tree_top_k: int | None = _opt(None, "drafting", PANEL_DRAFT, "Tree drafting. EAGLE-3: children per expanded node and nodes expanded per level (default 10). Draft model: its top-k tokens per chain position, the first on the chain and the others as sibling leaves (default 2).", min=1, max=64)
    tree_tokens: int | None = _opt(None, "drafting", PANEL_DRAFT, "Tree drafting: tokens per tree counting the root, i.e. tokens-1 draft nodes (EAGLE-3: EAGLE's total_token, default 60; draft model: chain plus its likeliest siblings, default 16).", min=2, max=1024)
    draft_context: int | None = _opt(None, "drafting", PANEL_DRAFT, "A draft model reads only the last N prompt tokens (and everything generated): its prefill of a long prompt costs N tokens. Default: the whole prompt. Strict output is unchanged.", min=1, max=1 << 20)
    job_corpus: bool | None = _opt(None, "drafting", PANEL_DRAFT, "Strict verification: the n-gram drafter also drafts from the job's finished records (default on; outputs are the same either way, the drafts' statistics are not). Relaxed rules and calibrate never draft from it.", "--job-corpus/--no-job-corpus")
    margin: str | None = _opt(None, "drafting", PANEL_VERIFY, "Margin statistic: 'logit-ratio' (z2/z1, the paper's; default) or 'prob-ratio' (p2/p1).")
    # the loop guard
    repeat_guard: int | None = _opt(None, "guard", PANEL_VERIFY, "Loop guard of relaxed rules: never relax a draft token that completes an N-gram already in the last --repeat-window tokens of the output (0 = off). Default: the profile's, else 4.", min=0)
    repeat_window: int | None = _opt(None, "guard", PANEL_VERIFY, "Tokens of recent output the loop guard looks back over. Default: the profile's, else 256.", min=1)
    max_relaxed_share: float | None = _opt(None, "guard", PANEL_VERIFY, "Relaxation budget: a record relaxes at most this share of its max tokens, then is verified strictly (1 = no budget). Default: the profile's, else 0.25.", min=0.0, max=1.0)
    strict_first: int | None = _opt(None, "guard", PANEL_VERIFY, "Relaxed rules verify the first N generated tokens of every output strictly, like a strict span (0 = off). Default: the profile's, else 2.", min=0)
    loop_rewind: int | None = _opt(None, "guard", PANEL_VERIFY, "Take back a relaxation that derails: when the output falls into a loop within N tokens after a relaxed token, the record rewinds to the earliest such token, decides it strictly and relaxes no more (0 = off). Default: the profile's, else 64.", min=0)
    no_guard: bool = _opt(False, "guard", PANEL_VERIFY, "No loop guard, no budget, no strict first tokens, no loop rewinds, and relaxed stops allowed: the paper's rule alone (--strict-first N still applies when given).", "--no-guard")
    # the rule and its knobs (marscli.verification.registry)
    verify: str | None = _opt(None, "rule", PANEL_VERIFY, verify_help(), "--verify", "--rule")
    theta: float | None = _knob("theta")
    rho: float | None = _knob("rho")
    top_n: int | None = _knob("top_n")
    delta: float | None = _knob("delta")
    epsilon: float | None = _knob("epsilon")
    alpha: float | None = _knob("alpha")
    budget: float | None = _knob("budget")
    relax_at: str = _opt(RELAX_EVERY, "rule", PANEL_VERIFY, "Where a relaxed rule judges the drafter's proposals: 'every' output position (default: a record's text never depends on the draft lengths, the batch or timings) or only the 'drafted' positions of a fixed-K chain (the paper's Algorithm 1, for reference checks: the text then depends on --num-draft-tokens).", "--relax-at")
    # strict spans
    strict_in: str | None = _opt(None, "spans", PANEL_VERIFY, "Strict spans: verify every position strictly, whatever the rule, inside fenced code blocks ('code') and/or after a final-answer marker such as '####', '\\boxed{' or 'Final answer:' ('answer'); e.g. --strict-in code,answer; 'none': no strict span, not even a profile's. Decided from the output before each position (docs/verification.md, 'Strict spans'). A profile calibrated with spans keeps them unless this or --strict-regex is given.", "--strict-in")
    strict_regex: str | None = _opt(None, "spans", PANEL_VERIFY, "Strict span: a position is verified strictly when this Python regex matches (re.search) the output before it; e.g. '(?i)answer:' for everything after the first 'answer:'.", "--strict-regex")
    # the profile
    profile: str | None = _opt(None, "profile", PANEL_VERIFY, "Calibration profile (name or YAML path) to take the rule and its knobs, target and drafter from. Default: the newest profile matching the loaded target and drafter.")
    auto_profile: bool = _opt(True, "profile", PANEL_VERIFY, "Pick a profile matching the target and drafter by itself (default), or not (--no-profile).", "--auto-profile/--no-profile")
    # batching
    batch_size: int = _opt(1, "batch", PANEL_MODEL, "Records decoded together, each with its own drafts and acceptance; a finished record's place goes to the next one. Same outputs as 1 (the default).", "--batch-size", min=1)
    compile: str = _opt("auto", "batch", PANEL_MODEL, "Captured steps: the target's and draft model's keys and values stay in slots, and each step shape is captured once (on CUDA a CUDA graph, replayed every step; on a CPU compiled by torch.compile). 'auto' (default): captured on CUDA, eager on a CPU (where compiling costs more than it saves on a typical run: docs/engine.md); 'on': captured on CUDA, compiled on a CPU; 'off': every forward eager. CUDA graphs give the eager tokens; compiled kernels may round differently at near-ties.", "--compile")
    prefix_cache: float = _opt(DEFAULT_PREFIX_CACHE_MIB, "batch", PANEL_MODEL, f"MiB of prompt keys/values kept so that a prompt prefix shared by several records (a system prompt, few-shot examples, a document with many questions, the n choices of a record) is computed once; least recently used first out; 0 = off. Default {DEFAULT_PREFIX_CACHE_MIB}. Same outputs either way.", "--prefix-cache", min=0.0)



#: Result line formats: marscli's own, or OpenAI Batch API output lines (marscli.io.openai_format).
OUTPUT_FORMATS = ("default", "openai")
#: What generate does with a prompt too long for the context window: an error result, or drop
#: its oldest tokens to leave room for max_tokens.
TRUNCATIONS = ("none", "left")


@dataclass(frozen=True)
class SamplingOptions:
    """The sampling and output options of a generation: `marscli generate`'s (groups
    sampling, choices and output; calibrate takes the sampling group), ``LLM.stream``'s and
    ``LLM.generate``'s keywords, and what lm-eval passes. Declared once, here, as
    GenerationOptions is: the Typer options (marscli.cli.options), the API's keywords, the
    SamplingParams the engine decodes with (``params``), the result lines' options and the run
    fingerprint (marscli.jobs.fingerprint) come from these fields, so a new sampling option is
    a field here plus the code that acts on it (and its key in marscli.io.records if records
    may override it)."""

    # sampling: the settings a record may override (marscli.io.records), in the order it checks them
    max_tokens: int = _opt(DEFAULT_MAX_TOKENS, "sampling", PANEL_SAMPLING, "Most new tokens per record.", min=1)
    temperature: float = _opt(0.0, "sampling", PANEL_SAMPLING, "0 = greedy.", min=0.0)
    top_p: float = _opt(1.0, "sampling", PANEL_SAMPLING, "Nucleus sampling mass.", min=0.0, max=1.0)
    top_k: int = _opt(0, "sampling", PANEL_SAMPLING, "Top-k filter (0 = off).", min=0)
    seed: int = _opt(0, "sampling", PANEL_SAMPLING, "Random seed (per record unless the record sets one).", min=0)
    stop: tuple[str, ...] = _opt((), "sampling", PANEL_SAMPLING, "Stop string (repeatable).")
    # choices: what each record's completions are and carry
    truncate_prompt: str = _opt("none", "choices", PANEL_SAMPLING, "A prompt too long for the context window: 'none' (error result) or 'left' (drop its oldest tokens to leave room for --max-tokens).", "--truncate-prompt")
    n: int = _opt(1, "choices", PANEL_SAMPLING, "Completions per record (a record's own 'n' wins); choice i decodes with seed + i. One result line per record, with 'choices'.", "--n", min=1, max=128)
    logprobs: bool = _opt(False, "choices", PANEL_OUTPUT, "Report the target's log-probability of every completion token (log_softmax of the raw target logits); a record's own 'logprobs' wins.", "--logprobs")
    top_logprobs: int | None = _opt(None, "choices", PANEL_OUTPUT, "With the logprobs, the N most likely alternatives per token (implies --logprobs).", "--top-logprobs", min=0, max=20)
    provenance: bool = _opt(False, "choices", PANEL_OUTPUT, "Add to each result where each token came from: accepted draft, relaxed draft (with the rule's statistic), correction, bonus or plain target token, and the share of relaxed tokens (docs/engine.md, 'Provenance').", "--provenance")
    # output: what result lines hold
    timing: bool = _opt(True, "output", PANEL_OUTPUT, "Include wall-clock timing in results (off: byte-identical reruns).", "--timing/--no-timing")
    token_ids: bool = _opt(False, "output", PANEL_OUTPUT, "Include the generated token ids in results.", "--token-ids")
    output_format: str = _opt("default", "output", PANEL_OUTPUT, "'default' (marscli's result lines) or 'openai' (the OpenAI Batch API output format; marscli's statistics under the key 'marscli').", "--output-format")
    strict_keys: bool = _opt(False, "output", PANEL_OUTPUT, "A record with request keys marscli does not act on (tools, response_format, presence_penalty...) becomes an error result instead of a result with 'warnings'.", "--strict-keys")

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):  # one stop string
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop or ()))

    @classmethod
    def group(cls, name: str) -> tuple[str, ...]:
        """The names of a group's fields ("sampling", "choices", "output")."""
        return tuple(f.name for f in fields(cls) if f.metadata["flag"].group == name)

    def params(self) -> SamplingParams:
        """The SamplingParams records decode with (top_logprobs implies logprobs)."""
        return SamplingParams(self.temperature, self.top_p, self.top_k, self.max_tokens, self.seed, self.stop,
                              self.n, self.logprobs or self.top_logprobs is not None, self.top_logprobs or 0,
                              self.provenance)


@dataclass
class Request:
    """One validated input record."""

    index: int  # 0-based position among input records (output order)
    line: int  # 1-based line number in the input file
    id: str
    prompt: str | None = None
    messages: list[dict[str, str]] | None = None
    overrides: dict[str, Any] = field(default_factory=dict)
    id_key: str = "id"  # "custom_id" for OpenAI batch lines: echoed back under the same key
    #: Keys of the record that marscli does not act on, as key paths ("body.tools"): reported
    #: as warnings in the result, or an error result with --strict-keys.
    ignored: list[str] = field(default_factory=list)


@dataclass
class RecordError:
    """An input record that could not be turned into a Request."""

    index: int
    line: int
    id: str
    type: str  # e.g. "invalid_json", "invalid_record"
    message: str
    id_key: str = "id"


@dataclass(frozen=True)
class ModelSetup:
    """What a generator is made of, resolved from GenerationOptions before anything is
    loaded (marscli.jobs.setup.generation_setup, the one place): models, drafter,
    verification as asked, profile choice, batch size and strict spans."""

    target: ModelConfig
    draft: DraftConfig
    draft_model: ModelConfig | None
    verify: VerifyRequest
    profile: str | None = None  # a profile's path: use it; None: look for a matching one
    auto_profile: bool = True  # False (--no-profile): never pick a profile by itself
    batch_size: int = 1  # records decoded together (same outputs as 1)
    spans: SpanConfig = SPANS_OFF  # strict spans (marscli.verification.spans)
    #: --strict-in or --strict-regex was given (--strict-in none: none); else the profile's
    #: spans apply (Profile.spans).
    spans_given: bool = False
    prefix_cache: float = DEFAULT_PREFIX_CACHE_MIB  # MiB of the prefix cache (same outputs at any size)
    compile: str = "auto"  # captured steps (COMPILE_MODES; same tokens in float32)
    relax_at: str = RELAX_EVERY  # where relaxed rules judge proposals (RELAX_AT)


@dataclass(frozen=True)
class GenerateConfig:
    """Everything `marscli generate` needs: the setup (models, drafter, verification as
    asked), the sampling and output options, and the run's own options."""

    input: str
    output: str | None
    setup: ModelSetup
    options: SamplingOptions = SamplingOptions()
    limit: int | None = None
    resume: bool = False  # keep the finished results already in `output`, append the rest
    fail_fast: bool = False  # stop at the first record that fails

    @property
    def sampling(self) -> SamplingParams:
        return self.options.params()


@dataclass(frozen=True)
class CalibrateConfig:
    """Everything `marscli calibrate` needs, parsed from the command line."""

    input: str
    output: str | None  # None: <user profile dir>/<name>.yaml; "-": YAML on stdout
    name: str | None
    setup: ModelSetup  # models, drafter and batch size (its verification: strict, cfg.guard's)
    margin: MarginKind
    policy: str  # max-nll-increase | relax-rate | fixed
    policy_value: float
    sampling: SamplingParams
    limit: int | None = None
    plot: str | None = None
    #: The loop guard the replay applies (and the profile records): calibrate and generate
    #: must agree on which relaxations can happen.
    guard: GuardConfig = GuardConfig()
    #: Strict spans (calibrate --strict-in / --strict-regex): collected, replayed and checked
    #: with them, and recorded in the profile, whose spans generate then uses by default.
    spans: SpanConfig = SPANS_OFF
    objective: str = "quality"  # quality: the policy's theta; speed: the fastest within its budget
    #: The rule whose main knob is fitted (a Rule; its other knobs kept); None: mars
    #: with ``margin``. ``alpha_given``: typical's alpha was given (else tied to sqrt(epsilon)).
    rule: Any = None
    alpha_given: bool = False
