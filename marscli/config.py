"""Frozen configuration and request types shared by the library and the CLI.

The CLI parses options into these dataclasses once; everything below the CLI takes them as
plain values. Nothing here imports torch, so `marscli --help` stays fast.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from marscli.verification.registry import ALL_KNOBS, LOGIT_RATIO, STRICT

#: A rule's name (marscli.verification.registry.RULES) and a margin statistic's (MARGINS).
VerifyMode = str
MarginKind = str

#: theta that makes no position relaxable: MARS degenerates to strict verification.
STRICT_THETA = math.inf

DEFAULT_MAX_TOKENS = 256
DEFAULT_NUM_DRAFT_TOKENS = 8
#: EAGLE-3 tree drafting defaults, EAGLE-3's own (eagle/model/ea_model.py): depth 7, top-k 10,
#: 60 tokens (the MARS paper's runs: depth 6-7, top-k 10, 50-60 tokens).
TREE_DEFAULTS = (7, 10, 60)


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


#: The loop guard's defaults (marscli.verification.guard; measured in docs/calibration.md, "Loops").
DEFAULT_GUARD_NGRAM = 4
DEFAULT_GUARD_WINDOW = 256
#: Default relaxation budget per record, as a share of its max tokens (1.0: no budget).
DEFAULT_MAX_RELAXED_SHARE = 0.25


@dataclass(frozen=True)
class GuardConfig:
    """What keeps a relaxed rule from running away (issue 17; marscli.verification.guard).

    repeat_ngram: never relax a draft token that completes an n-gram of this size already
    seen in the last ``repeat_window`` tokens of the record's output (0: no loop guard).
    max_relaxed_share: a record relaxes at most floor(share * max_tokens) tokens, then is
    verified strictly (1.0: no budget). Neither changes strict verification.
    """

    repeat_ngram: int = DEFAULT_GUARD_NGRAM
    repeat_window: int = DEFAULT_GUARD_WINDOW
    max_relaxed_share: float = DEFAULT_MAX_RELAXED_SHARE

    def __post_init__(self) -> None:
        if self.repeat_ngram != 0 and self.repeat_ngram < 2:
            raise ValueError(f"--repeat-guard must be 0 (off) or at least 2, got {self.repeat_ngram}")
        if self.repeat_ngram and self.repeat_window < self.repeat_ngram:
            raise ValueError(f"--repeat-window ({self.repeat_window}) must be at least the "
                             f"n-gram size ({self.repeat_ngram})")
        if not 0.0 <= self.max_relaxed_share <= 1.0 or math.isnan(self.max_relaxed_share):
            raise ValueError(f"--max-relaxed-share must be in [0, 1], got {self.max_relaxed_share}")

    @property
    def budgeted(self) -> bool:
        return self.max_relaxed_share < 1.0

    def budget(self, max_tokens: int) -> int | None:
        """Relaxations a record of max_tokens may make (None: no budget)."""
        return math.floor(self.max_relaxed_share * max_tokens + 1e-9) if self.budgeted else None

    def to_dict(self) -> dict[str, Any]:
        return {"repeat_ngram": self.repeat_ngram, "repeat_window": self.repeat_window,
                "max_relaxed_share": self.max_relaxed_share}


#: Both guards off: a relaxed rule behaves as it did before the guard existed.
GUARD_OFF = GuardConfig(0, DEFAULT_GUARD_WINDOW, 1.0)


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


#: No strict span.
SPANS_OFF = SpanConfig()


@dataclass(frozen=True)
class VerifyConfig:
    """How draft tokens are checked against the target."""

    mode: VerifyMode = STRICT
    theta: float = STRICT_THETA
    margin: MarginKind = LOGIT_RATIO
    #: The loop guard. Off here (the paper's rule, as the library's building block); the jobs
    #: layer turns the default guard on for generate, bench and the Python API. It applies to
    #: every rule that relaxes.
    guard: GuardConfig = GUARD_OFF
    #: The knobs of the other rules (registry.OTHER_KNOBS), each at its strict end by default:
    #: only the knobs of `mode` matter.
    rho: float = ALL_KNOBS["rho"].default
    top_n: int = ALL_KNOBS["top_n"].default
    delta: float = ALL_KNOBS["delta"].default
    epsilon: float = ALL_KNOBS["epsilon"].default
    alpha: float | None = ALL_KNOBS["alpha"].default  # None: sqrt(epsilon)
    budget: float = ALL_KNOBS["budget"].default

    @property
    def rule(self):
        """The rulebook's Rule for this configuration (strict never relaxes, whatever theta).
        Raises ValueError for a knob out of its range (jobs.setup turns it into a usage error)."""
        from marscli.verification.rules import Rule  # torch: this module stays light

        return Rule(self.mode, margin=self.margin, **{k: getattr(self, k) for k in ALL_KNOBS})

    @classmethod
    def from_rule(cls, rule, guard: GuardConfig = GUARD_OFF) -> VerifyConfig:
        """The configuration of a marscli.verification.rules.Rule (the inverse of ``rule``)."""
        return cls(rule.name, margin=rule.margin, guard=guard, **{k: getattr(rule, k) for k in ALL_KNOBS})


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
    tree_depth / tree_top_k / tree_tokens (eagle3 only): draft an EAGLE-2 dynamic tree instead
    of a chain (see marscli.drafters.eagle3.TreeShape); all three or none.
    job_corpus (ngram only): under strict verification, fall back on the job's finished
    records when a record's own text has no long match (marscli.drafters.ngram.JobCorpus).
    """

    kind: Literal["none", "ngram", "model", "eagle3"] = "ngram"
    model: str | None = None  # path or hub id when kind is "model" or "eagle3"
    num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS
    ngram_max: int = 3
    ngram_min: int = 1
    adaptive: bool = True
    tree_depth: int | None = None
    tree_top_k: int | None = None
    tree_tokens: int | None = None
    job_corpus: bool = True

    @property
    def tree(self) -> bool:
        return self.tree_depth is not None


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

    def as_error(self) -> dict[str, Any]:
        return {"type": self.type, "message": self.message, "line": self.line}


@dataclass(frozen=True)
class GenerateConfig:
    """Everything `marscli generate` needs, parsed from the command line."""

    input: str
    output: str | None
    target: ModelConfig
    draft: DraftConfig
    draft_model: ModelConfig | None
    verify: VerifyRequest
    sampling: SamplingParams
    limit: int | None = None
    timing: bool = True
    token_ids: bool = False
    profile: str | None = None  # name or path; None: look for one matching the target
    auto_profile: bool = True  # False (--no-profile): never pick a profile by itself
    resume: bool = False  # keep the finished results already in `output`, append the rest
    fail_fast: bool = False  # stop at the first record that fails
    truncate_prompt: Literal["none", "left"] = "none"  # a prompt too long for the window
    batch_size: int = 1  # records decoded together (1: the single-record engine)
    output_format: Literal["default", "openai"] = "default"  # result lines: marscli's or OpenAI batch
    strict_keys: bool = False  # a record with keys marscli does not act on is an error result
    spans: SpanConfig = SPANS_OFF  # strict spans (--strict-in, --strict-regex)


@dataclass(frozen=True)
class CalibrateConfig:
    """Everything `marscli calibrate` needs, parsed from the command line."""

    input: str
    output: str | None  # None: <user profile dir>/<name>.yaml; "-": YAML on stdout
    name: str | None
    target: ModelConfig
    draft: DraftConfig
    draft_model: ModelConfig | None
    margin: MarginKind
    policy: str  # max-nll-increase | relax-rate | fixed
    policy_value: float
    sampling: SamplingParams
    limit: int | None = None
    plot: str | None = None
    batch_size: int = 1  # records decoded together (same profile as 1)
    #: The loop guard the replay applies (and the profile records): calibrate and generate
    #: must agree on which relaxations can happen.
    guard: GuardConfig = GuardConfig()
    objective: str = "quality"  # quality: the policy's theta; speed: the fastest within its budget
    #: The rule whose main knob is fitted (a verify.Rule; its other knobs kept); None: mars
    #: with ``margin``. ``alpha_given``: typical's alpha was given (else tied to sqrt(epsilon)).
    rule: Any = None
    alpha_given: bool = False
