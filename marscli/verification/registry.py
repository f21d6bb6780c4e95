"""The rulebook's registry: every verification rule's name, knobs, their bounds and their
spellings, declared once.

Everything that names a rule or a knob derives from ``RULEBOOK``: the ``Rule`` value and its
range checks (marscli.verification.rules), the settings values (marscli.config), the command
line's ``--verify`` choices and knob options with their help (marscli.cli), the Python API's
keywords, what a knob needs and which rule owns it (marscli.jobs.setup), calibrate's
``--rule`` and its fixed-knob options, the profile schema's knob keys
(marscli.calibration.profiles), the calibration curve's grid, and bench's method spellings
(``ratio@R``, ``topk@N:D``; marscli.bench.methods). A rule's judgement itself (its formula, its statistic, its
critical values), lives in its block of marscli.verification.rules (``RuleBehaviour``).

Pure data: no torch, nothing else of marscli imported, so ``marscli --help`` stays fast and
marscli.config may build on it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

STRICT = "strict"
MARS = "mars"
RATIO = "ratio"
TOPK = "topk"
TYPICAL = "typical"
REGRET = "regret"

#: MARS's margin statistics: z2 / z1 (the paper's) or p2 / p1 = exp(z2 - z1).
LOGIT_RATIO = "logit-ratio"
PROB_RATIO = "prob-ratio"
MARGINS = (LOGIT_RATIO, PROB_RATIO)

#: Decoding modes a rule may define: greedy, and sampling (each position's coupled draw:
#: marscli.verification.draws; a drafter's law never enters the verdict).
GREEDY_MODE = "greedy"
SAMPLING_MODE = "sampling"
MODES = (GREEDY_MODE, SAMPLING_MODE)

#: The MARS paper's global threshold (Shi et al., arXiv 2601.15498).
PAPER_THETA = 0.9


@dataclass(frozen=True)
class Knob:
    """One numeric knob of a rule: a field of ``Rule``, of config.VerifyRequest and of
    config.GenerationOptions (tests/cli/test_rules_cli.py holds them to this registry), and an
    option of generate, calibrate and the Python API (``option``)."""

    name: str  # the field: "rho"
    symbol: str  # its letter in bounds and bench spellings: "R"
    kind: type  # float or int
    default: float | int | None  # the rule's strict end (None: derived, typical's alpha)
    bounds: str  # its range in the symbol's terms: "0 < R <= 1"
    requirement: str  # the range as a range error says it: "in (0, 1]"
    valid: Callable[[float], bool]  # the range test (False for nan)
    help: str  # what the knob does, for its command-line option
    optional: bool = False  # may be left out of a bench spelling (typical's alpha)
    #: Round values the calibration curve shows beside the data's quantiles (main knobs).
    round_values: tuple[float, ...] = ()

    @property
    def option(self) -> str:
        """The command-line option: top_n -> --top-n."""
        return "--" + self.name.replace("_", "-")

    def problem(self, value: float) -> str | None:
        """Why ``value`` is out of range (the message of the ValueError a Rule raises), or None."""
        if isinstance(value, float) and math.isnan(value):
            if self.requirement == "positive":  # the range test refuses nan in its own words
                return f"{self.option} must be {self.requirement}, got {value}"
            return f"{self.name} must be a number, got nan"
        if not self.valid(value):
            return f"{self.option} must be {self.requirement}, got {value}"
        return None


@dataclass(frozen=True)
class RuleSpec:
    """A rule of the rulebook: its knobs (in spelling order), its main knob (the one
    calibrate fits, and which way it relaxes), the decoding modes it defines, the position
    facts its decision reads, and the name of the statistic it judges a position by."""

    name: str
    summary: str  # one phrase for --verify's help
    knobs: tuple[Knob, ...] = ()
    main: str | None = None  # the main knob (None: strict, nothing to fit)
    direction: int = 0  # +1: larger main-knob values relax more; -1: smaller ones do
    strict_end: float = math.inf  # the main knob's least relaxing value
    modes: tuple[str, ...] = MODES
    needs: frozenset[str] = frozenset()  # PositionFacts fields rules.decide reads
    statistic: str | None = None  # its histogram's statistic (MARS: the margin statistic's name)
    uses_margin: bool = False  # MARS's margin statistic is one of its knobs (a choice)
    note: str = ""  # what a bench spelling adds after the bounds
    #: Whether a Rule at its knob values can relax any position (False: strict, or a rule at
    #: its strict end). Plain Python on the knobs: the settings values ask it without torch.
    relaxes: Callable[[Rule], bool] = lambda rule: False

    def knob(self, name: str) -> Knob:
        return next(k for k in self.knobs if k.name == name)

    @property
    def knob_names(self) -> tuple[str, ...]:
        return tuple(k.name for k in self.knobs)

    @property
    def main_knob(self) -> Knob | None:
        return self.knob(self.main) if self.main else None

    @property
    def greedy_only(self) -> bool:
        return self.modes == (GREEDY_MODE,)

    @property
    def profile_keys(self) -> tuple[str, ...]:
        """The keys of a profile's verification section that hold this rule's knobs."""
        return (("margin",) if self.uses_margin else ()) + self.knob_names

    @property
    def spelling(self) -> str:
        """How bench writes a method of this rule: "topk@N:D (N >= 1 tokens, D >= 0)"."""
        full = f"{self.name}@" + ":".join(k.symbol for k in self.knobs)
        short = f"{self.name}@" + ":".join(k.symbol for k in self.knobs if not k.optional)
        notes = "; ".join(n for n in (self.note, "greedy only" if self.greedy_only else "") if n)
        bounds = ", ".join(k.bounds for k in self.knobs)
        return (full + (f" or {short}" if short != full else "")
                + f" ({bounds}{'; ' + notes if notes else ''})")

    @property
    def verify_help(self) -> str:
        """This rule in --verify's help: "'topk' (--top-n, --delta)"."""
        parts = [self.summary] if self.summary else []
        if self.knobs:
            parts.append(", ".join(k.option for k in self.knobs))
        if self.greedy_only:
            parts[-1] += "; greedy only"
        return f"'{self.name}'" + (f" ({'; '.join(parts)})" if parts else "")


THETA = Knob("theta", "T", float, math.inf, "e.g. the paper's 0.9", "a number", lambda v: True,
             "mars: relax where the margin statistic exceeds theta. Default: the profile's, else "
             f"{PAPER_THETA} (the paper's).",
             round_values=(0.5, 0.8, 0.85, 0.9, 0.95, 0.98, 0.99))
RHO = Knob("rho", "R", float, 1.0, "0 < R <= 1", "in (0, 1]", lambda v: 0.0 < v <= 1.0,
           "ratio: relax a draft x where p(x) >= R * p1 (0 < R <= 1; 1 = strict).",
           round_values=(0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9))
TOP_N = Knob("top_n", "N", int, 2, "N >= 1 tokens", "at least 1", lambda v: v >= 1,
             "topk: the draft must be among the target's N most likely tokens (N >= 1; default 2).")
DELTA = Knob("delta", "D", float, 0.0, "D >= 0", "at least 0", lambda v: v >= 0.0,
             "topk: ... and p(x) >= p1 - D (D >= 0; 0 = strict).",
             round_values=(0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5))
EPSILON = Knob("epsilon", "E", float, 1.0, "0 < E <= 1", "in (0, 1]", lambda v: 0.0 < v <= 1.0,
               "typical: relax where p(x) > min(E, A * exp(-H(p))) (0 < E <= 1).",
               round_values=(0.01, 0.05, 0.09, 0.2, 0.3, 0.5, 0.9))
ALPHA = Knob("alpha", "A", float, None, "A > 0", "positive", lambda v: v > 0.0,
             "typical: A > 0 (default sqrt(E)).", optional=True)
BUDGET = Knob("budget", "B", float, 0.0, "B >= 0", "at least 0", lambda v: v >= 0.0,
              "regret: accept a step's drafts while their summed logit gap z1 - z(x) stays <= B "
              "(B >= 0; 0 = strict).",
              round_values=(0.5, 1.0, 2.0, 4.0, 8.0, 16.0))

RULEBOOK: dict[str, RuleSpec] = {r.name: r for r in (
    RuleSpec(STRICT, "exact"),
    RuleSpec(MARS, "relax at low-margin positions", (THETA,), "theta", -1, math.inf,
             needs=frozenset({"statistics", "in_top2"}), uses_margin=True,
             relaxes=lambda r: r.theta != math.inf),
    RuleSpec(RATIO, "", (RHO,), "rho", -1, 1.0, needs=frozenset({"p_draft", "p1"}), statistic="p-ratio",
             relaxes=lambda r: r.rho < 1.0),
    RuleSpec(TOPK, "", (TOP_N, DELTA), "delta", +1, 0.0, needs=frozenset({"p_draft", "p1", "rank"}),
             statistic="p-gap", relaxes=lambda r: r.delta > 0.0 and r.top_n > 1),
    RuleSpec(TYPICAL, "", (EPSILON, ALPHA), "epsilon", -1, 1.0, needs=frozenset({"p_draft", "entropy"}),
             statistic="p-draft", note="A = sqrt(E) by default",
             relaxes=lambda r: not (r.epsilon >= 1.0 and r.alpha == math.inf)),
    RuleSpec(REGRET, "", (BUDGET,), "budget", +1, 0.0, modes=(GREEDY_MODE,), needs=frozenset({"regret"}),
             statistic="regret", relaxes=lambda r: r.budget > 0.0),
)}

RULES = tuple(RULEBOOK)
#: Rules with a knob to calibrate (all but strict), in rulebook order.
RELAXING_RULES = tuple(r for r in RULES if RULEBOOK[r].main)
#: Every numeric knob of every rule, in rulebook order (each belongs to one rule).
ALL_KNOBS: dict[str, Knob] = {k.name: k for r in RULEBOOK.values() for k in r.knobs}
#: The knobs of the rules other than MARS (MARS's theta has options of its own: bench's
#: --theta takes a list).
OTHER_KNOBS = tuple(k for k in ALL_KNOBS if k != "theta")
#: The rule each knob belongs to.
OWNER = {k.name: r.name for r in RULEBOOK.values() for k in r.knobs}
#: Each rule's main knob (the one calibrate fits), which way it relaxes (+1: larger values
#: relax more) and its strict end.
KNOBS = {r.name: (r.main, r.direction, r.strict_end) for r in RULEBOOK.values() if r.main}


@dataclass(frozen=True)
class Rule:
    """A verification rule and its knob values: the value every layer passes around (the
    command line's --verify and knobs, profiles, results' spec, bench's methods). A Rule
    carries every rule's knobs, each at its strict end unless given; only its own matter.
    What each rule accepts, its formula and source: marscli.verification.rules.
    """

    # The knobs of every rule, each at its rule's strict end (registry.ALL_KNOBS).
    name: str = STRICT
    theta: float = ALL_KNOBS["theta"].default
    margin: str = LOGIT_RATIO
    rho: float = ALL_KNOBS["rho"].default
    top_n: int = ALL_KNOBS["top_n"].default
    delta: float = ALL_KNOBS["delta"].default
    epsilon: float = ALL_KNOBS["epsilon"].default
    alpha: float | None = ALL_KNOBS["alpha"].default  # None: sqrt(epsilon)
    budget: float = ALL_KNOBS["budget"].default

    def __post_init__(self) -> None:
        rule_spec(self.name)  # refuses an unknown name
        if self.margin not in MARGINS:
            raise ValueError(f"unknown margin statistic {self.margin!r}; expected one of {MARGINS}")
        for knob in ALL_KNOBS.values():  # every rule's knobs: a Rule carries all of them
            value = getattr(self, knob.name)
            if value is None and knob.name == "alpha":
                continue
            problem = knob.problem(value)
            if problem is not None:
                raise ValueError(problem)
        if self.alpha is None:
            object.__setattr__(self, "alpha", math.sqrt(self.epsilon))

    @property
    def relaxes(self) -> bool:
        """Whether any position can be relaxed (never: strict, or a rule at its strict end)."""
        return self.spec.relaxes(self)

    @property
    def spec(self) -> RuleSpec:
        """The rule's registry entry (marscli.verification.registry)."""
        return RULEBOOK[self.name]

    @property
    def modes(self) -> tuple[str, ...]:
        """The decoding modes this rule defines (the jobs layer refuses the others)."""
        return self.spec.modes

    @property
    def knob(self) -> tuple[str, float] | None:
        """(name, value) of the main knob (the one calibrate fits); None for strict."""
        main = self.spec.main
        return None if main is None else (main, float(getattr(self, main)))

    def with_knob(self, value: float) -> Rule:
        """This rule with its main knob set to ``value``."""
        return replace(self, **{self.spec.main: value})

    @property
    def needs(self) -> frozenset[str]:
        """The PositionFacts fields beyond strict_ok (and guarded) that ``decide`` reads."""
        return self.spec.needs

    def knobs(self) -> dict[str, Any]:
        """The rule's knobs as written in profiles, results' spec and reports (MARS: theta,
        then its margin statistic)."""
        out: dict[str, Any] = {k: getattr(self, k) for k in self.spec.knob_names}
        if self.spec.uses_margin:
            out["margin"] = self.margin
        return out

    def label(self) -> str:
        """Short name: strict, mars@0.9, ratio@0.5, topk@3:0.1, typical@0.09:0.3, regret@2."""
        if not self.spec.knobs:
            return self.name
        return f"{self.name}@" + ":".join(f"{getattr(self, k):g}" for k in self.spec.knob_names)


def rule_spec(name: str) -> RuleSpec:
    """The registry entry of rule ``name`` (ValueError naming the rules for another name)."""
    if name not in RULEBOOK:
        raise ValueError(f"unknown verification rule {name!r}; expected one of {RULES}")
    return RULEBOOK[name]


def mode_problem(rule: str, temperature: float) -> str | None:
    """Why rule ``rule`` cannot decode at ``temperature``, or None (RuleSpec.modes)."""
    spec = rule_spec(rule)
    mode = GREEDY_MODE if temperature == 0.0 else SAMPLING_MODE
    if mode in spec.modes:
        return None
    if spec.greedy_only:
        return f"the {rule} rule is defined for greedy decoding only (temperature 0)"
    return f"the {rule} rule does not define {mode} decoding (only {', '.join(spec.modes)})"


def verify_help() -> str:
    """The help of --verify: every rule with its knobs' options."""
    rules = [r.verify_help for r in RULEBOOK.values()]
    return ("Verification rule: " + ", ".join(rules[:-1]) + " or " + rules[-1] + ". See "
            "docs/verification.md. Default: mars when a calibrated profile matches the target and "
            "drafter, else strict.")
