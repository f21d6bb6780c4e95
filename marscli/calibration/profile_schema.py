"""The calibration profile's schema (version 1): every key a profile may hold, its type and
range, and the checks across keys (a rule's knobs, the curve's column, the histogram's bins).

Each schema node is a callable (value, path) -> normalised value that raises _Invalid with
the key path; validate_profile turns the first problem into a ProfileError naming the file
and the key (marscli.calibration.profiles reads, writes and finds the files).
"""

from __future__ import annotations

import datetime as _dt
import math
import re
from typing import Any

from marscli.drafters.kinds import PROFILE_KINDS
from marscli.errors import UsageError
from marscli.verification.registry import (
    ALL_KNOBS,
    MARGINS,
    MARS,
    RELAXING_RULES,
    RULEBOOK,
    Rule,
)
from marscli.verification.spans import SPAN_KINDS

SCHEMA_VERSION = 1

POLICY_MAX_NLL = "max-nll-increase"
POLICY_RELAX_RATE = "relax-rate"
POLICY_FIXED = "fixed"
POLICIES = (POLICY_MAX_NLL, POLICY_RELAX_RATE, POLICY_FIXED)
RANK_KEYS = ("rank1", "rank2", "other")


class ProfileError(UsageError):
    """A profile that cannot be used: unreadable, malformed, or not found (exit code 2)."""


# --------------------------------------------------------------------------- schema

# A schema node is a callable (value, path) -> normalised value that raises _Invalid.


class _Invalid(Exception):
    def __init__(self, path: str, message: str):
        super().__init__(message)
        self.path = path
        self.message = message


def _describe(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"the boolean {str(v).lower()}"
    if isinstance(v, str):
        return f"the string {v!r}"
    if isinstance(v, (int, float)):
        return f"the number {v!r}"
    if isinstance(v, dict):
        return "a mapping"
    if isinstance(v, list):
        return "a list"
    return type(v).__name__


_NUMBER_LIKE = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^[-+]?\.?(inf|nan)$", re.I)


def _number(*, lo: float | None = None, hi: float | None = None, finite: bool = True):
    def check(v: Any, path: str) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            hint = ""
            if isinstance(v, str) and _NUMBER_LIKE.match(v.strip()):
                hint = (f" (YAML 1.1 reads {v!r} as a string: write it with a decimal point "
                        "and a signed exponent, e.g. 1.0e-3, or as a plain decimal)")
            raise _Invalid(path, f"expected a number, got {_describe(v)}{hint}")
        x = float(v)
        if finite and not math.isfinite(x):
            raise _Invalid(path, f"expected a finite number, got {v!r}")
        if lo is not None and x < lo:
            raise _Invalid(path, f"must be >= {lo:g}, got {x:g}")
        if hi is not None and x > hi:
            raise _Invalid(path, f"must be <= {hi:g}, got {x:g}")
        return x

    return check


def _integer(*, lo: int | None = None):
    def check(v: Any, path: str) -> int:
        if isinstance(v, bool) or not isinstance(v, int):
            hint = " (write it without quotes or decimals)" if isinstance(v, (str, float)) else ""
            raise _Invalid(path, f"expected an integer, got {_describe(v)}{hint}")
        if lo is not None and v < lo:
            raise _Invalid(path, f"must be >= {lo}, got {v}")
        return v

    return check


def _string(v: Any, path: str) -> str:
    if isinstance(v, str):
        return v
    hint = ""
    if isinstance(v, bool):
        hint = " (YAML 1.1 reads yes/no/on/off/true/false as booleans: quote the value)"
    elif isinstance(v, (int, float)):
        hint = " (quote it to keep it a string)"
    raise _Invalid(path, f"expected a string, got {_describe(v)}{hint}")


def _timestamp(v: Any, path: str) -> str:
    # An unquoted ISO date is a timestamp to YAML; keep it as the string it was.
    if isinstance(v, _dt.datetime):
        return v.isoformat()
    if isinstance(v, _dt.date):
        return v.isoformat()
    return _string(v, path)


def _boolean(v: Any, path: str) -> bool:
    if isinstance(v, bool):
        return v
    raise _Invalid(path, f"expected true or false, got {_describe(v)}")


def _choice(*options: str):
    def check(v: Any, path: str) -> str:
        s = _string(v, path)
        if s not in options:
            raise _Invalid(path, f"must be one of {', '.join(options)}; got {s!r}")
        return s

    return check


def _nullable(inner):
    def check(v: Any, path: str):
        return None if v is None else inner(v, path)

    return check


def _list(inner, *, min_len: int = 0):
    def check(v: Any, path: str) -> list:
        if not isinstance(v, list):
            raise _Invalid(path, f"expected a list, got {_describe(v)}")
        if len(v) < min_len:
            raise _Invalid(path, f"expected at least {min_len} entries, got {len(v)}")
        return [inner(x, f"{path}[{i}]") for i, x in enumerate(v)]

    return check


def _mapping(fields: dict[str, Any], optional: tuple[str, ...] = ()):
    def check(v: Any, path: str) -> dict:
        if not isinstance(v, dict):
            raise _Invalid(path or "(top level)", f"expected a mapping, got {_describe(v)}")
        out = {}
        for key in v:
            if not isinstance(key, str) or key not in fields:
                where = f"{path}.{key}" if path else str(key)
                known = ", ".join(fields)
                raise _Invalid(where, f"unknown key (known keys here: {known})")
        for key, node in fields.items():
            where = f"{path}.{key}" if path else key
            if key not in v:
                if key in optional:
                    continue
                raise _Invalid(where, "missing")
            out[key] = node(v[key], where)
        return out

    return check


_share = _number(lo=0.0, hi=1.0)


def _regex(v: Any, path: str) -> str:
    """A Python regular expression that compiles."""
    s = _string(v, path)
    try:
        re.compile(s)
    except re.error as e:
        raise _Invalid(path, f"not a regular expression ({e})") from None
    return s


#: Each rule's knobs in a profile (Rule.knobs(); a profile may hold any rule but strict,
#: which has nothing to calibrate: registry.RELAXING_RULES).
RULE_KNOB_KEYS = {r: RULEBOOK[r].profile_keys for r in RELAXING_RULES}
#: Each rule's main knob: the curve's column.
MAIN_KNOB = {r: RULEBOOK[r].main for r in RELAXING_RULES}
_count = _integer(lo=0)
_rank_counts = _mapping({k: _list(_count) for k in RANK_KEYS})
_IDENTITY = {
    "name": _string,
    "source": _nullable(_string),
    "kind": _string,
    "sha256": _nullable(_string),
    "fingerprint": _nullable(_string),
    "revision": _nullable(_string),
    "dtype": _string,
    "quantization": _nullable(_string),
    "device_type": _string,
}
_identity = _mapping(_IDENTITY)
#: The main knob of each relaxing rule (a curve row carries its rule's).
KNOB_KEYS = tuple(MAIN_KNOB.values())
_curve_row = _mapping({
    **{k: _number(finite=False) for k in KNOB_KEYS},
    "relaxable_share": _share,
    # optional (profiles before it load unchanged): the relax rate (marscli.calibration.policies)
    "relax_rate": _share,
    "relaxed_share": _share,
    "tau": _number(lo=0.0),
    "nll_increase": _number(lo=0.0),
}, optional=KNOB_KEYS + ("relax_rate",))

#: Optional (profiles before it load unchanged): the predicted speed (marscli.calibration.speed).
_speed = _mapping({
    "objective": _choice("quality", "speed"),
    "batch_size": _integer(lo=1),
    "costs": _string,
    "speedup_strict": _number(lo=0.0),
    "speedup_mars": _number(lo=0.0),
    "relaxed_gain": _number(),
    "min_gain": _number(lo=0.0),
    "verify_strictly": _boolean,
    "curve": _list(_mapping({**{k: _number(finite=False) for k in KNOB_KEYS}, "speedup": _number(lo=0.0)},
                            optional=KNOB_KEYS)),
})

#: Optional (profiles before it load unchanged): the derailment check (issue 62): the rule at
#: each knob value tried, run for real on the calibration records, and the records it ended
#: in a loop where strict decoding did not (marscli.jobs.calibrate).
_derailment = _mapping({
    "strict_loops": _count,
    "checks": _list(_mapping({**{k: _number(finite=False) for k in KNOB_KEYS}, "relax_rate": _share,
                              "loops": _count, "derailed": _count, "rewinds": _count}, optional=KNOB_KEYS)),
})

_SCHEMA = _mapping({
    "schema_version": _integer(),  # checked first, separately, for a clear message
    "name": _string,
    "created_at": _timestamp,
    "marscli_version": _string,
    "target": _identity,
    "drafter": _mapping({
        "kind": _choice(*PROFILE_KINDS),
        "model": _nullable(_identity),
        "num_draft_tokens": _integer(lo=1),
        "adaptive": _boolean,
        "ngram_max": _nullable(_integer(lo=1)),
        "ngram_min": _nullable(_integer(lo=1)),
        # tree drafting (absent or null: chains): eagle3, EAGLE's depth, top_k, total tokens;
        # model, depth null (the chain's length is chosen per step), top_k and total tokens
        "tree": _nullable(_mapping({"depth": _nullable(_integer(lo=0)), "top_k": _integer(lo=1),
                                    "tokens": _integer(lo=2)})),
        # model only: hybrid drafting, prompt lookup beside the draft model (absent: false)
        "hybrid": _boolean,
    }, optional=("tree", "hybrid")),
    "verification": _mapping({
        # the rule (absent in profiles before issue 14: mars) and its knobs (Rule.knobs;
        # mars: margin and theta; the others' knobs only with their rule: _check_verification)
        "rule": _choice(*RELAXING_RULES),
        "margin": _choice(*MARGINS),
        # each knob's range is checked by the Rule itself (_check_verification)
        **{k.name: _integer() if k.kind is int else _number() for k in ALL_KNOBS.values()},
        # the loop guard the theta was calibrated with (absent in older profiles: the
        # default guard applies, and the theta was calibrated without one)
        "guard": _mapping({
            "repeat_ngram": _integer(lo=0),
            "repeat_window": _integer(lo=1),
            "max_relaxed_share": _share,
            # issue 31 (absent in older profiles: the defaults apply)
            "strict_first": _integer(lo=0),
            "strict_stops": _boolean,
            # issue 62 (absent in older profiles: the default applies)
            "loop_rewind": _integer(lo=0),
        }, optional=("strict_first", "strict_stops", "loop_rewind")),
        # strict spans the knob was calibrated with (calibrate --strict-in / --strict-regex;
        # absent: none), generate's default when its command line names none
        "spans": _mapping({
            "strict_in": _list(_choice(*SPAN_KINDS)),
            "strict_regex": _nullable(_regex),
        }),
    }, optional=("guard", "rule", "margin", "spans", *ALL_KNOBS)),
    "policy": _mapping({
        "name": _choice(*POLICIES),
        "value": _number(),
    }),
    "sampling": _mapping({
        "temperature": _number(lo=0.0),
        "top_p": _number(lo=0.0, hi=1.0),
        "top_k": _integer(lo=0),
        "max_tokens": _integer(lo=1),
        "seed": _integer(lo=0),
    }),
    "calibration_data": _mapping({
        "file": _string,
        "sha256": _nullable(_string),
        "records": _count,
        "failed_records": _count,
        "tokens": _count,
        "steps": _count,
        "positions": _count,
        "seconds": _number(lo=0.0),
    }),
    "summary": _mapping({
        "relaxable_share": _share,
        "relaxed_share": _share,
        "tau_strict": _number(lo=0.0),
        "tau_mars": _number(lo=0.0),
        "nll_increase": _number(lo=0.0),
        "measured_tau_strict": _number(lo=0.0),
        "measured_tokens_per_s": _number(lo=0.0),
        "relax_rate": _share,  # optional: profiles before it load unchanged
    }, optional=("relax_rate",)),
    "histogram": _mapping({
        # a rule's statistic (registry.RuleSpec.statistic; mars: its margin statistic's)
        "statistic": _choice(*MARGINS, *(r.statistic for r in RULEBOOK.values() if r.statistic)),
        "edges": _list(_number(), min_len=2),
        "below": _mapping({k: _count for k in RANK_KEYS}),
        "counts": _rank_counts,
    }),
    "curve": _list(_curve_row),
    "speed": _speed,
    "derailment": _derailment,
}, optional=("speed", "derailment"))


def _check_verification(v: dict, path: str) -> None:
    """The knobs present are exactly the rule's, each in its range (the Rule checks)."""

    rule = v.get("rule", MARS)
    want = RULE_KNOB_KEYS[rule]
    for key in ("margin", *ALL_KNOBS):
        if key in v and key not in want:
            raise _Invalid(f"{path}.{key}", f"not a knob of rule {rule} (its knobs: {', '.join(want)})")
    for key in want:
        if key not in v:
            raise _Invalid(f"{path}.{key}", "missing" + ("" if rule == MARS else f" (rule {rule})"))
    for key in want:
        if key == "margin":
            continue
        try:
            Rule(rule, **{key: v[key]})
        except ValueError as e:  # "--rho must be in (0, 1], got 0" -> the profile's words
            raise _Invalid(f"{path}.{key}", str(e).replace(f"{ALL_KNOBS[key].option} ", "")) from None


def _check_curve_knobs(rows: list, knob: str, path: str) -> None:
    for i, row in enumerate(rows):
        keys = [k for k in KNOB_KEYS if k in row]
        if keys != [knob]:
            raise _Invalid(f"{path}[{i}]", f"expected the knob {knob} (and no other), got "
                           f"{', '.join(keys) or 'none'}")


def _check_histogram(h: dict, path: str) -> None:
    edges = h["edges"]
    if any(b <= a for a, b in zip(edges, edges[1:])):
        raise _Invalid(f"{path}.edges", "bin edges must increase")
    for k in RANK_KEYS:
        if len(h["counts"][k]) != len(edges) - 1:
            raise _Invalid(f"{path}.counts.{k}",
                           f"expected {len(edges) - 1} counts (one per bin), got {len(h['counts'][k])}")


def validate_profile(raw: Any, source: str) -> dict[str, Any]:
    """Check a parsed YAML document against schema 1; return the normalised dict."""
    if not isinstance(raw, dict):
        raise ProfileError(f"{source}: expected a mapping at the top level, got {_describe(raw)}")
    if "schema_version" not in raw:
        raise ProfileError(f"{source}: schema_version: missing (this marscli reads schema_version {SCHEMA_VERSION})")
    version = raw["schema_version"]
    if isinstance(version, bool) or not isinstance(version, int) or version != SCHEMA_VERSION:
        raise ProfileError(
            f"{source}: schema_version: unsupported value {version!r} "
            f"(this marscli reads schema_version {SCHEMA_VERSION})"
        )
    try:
        data = _SCHEMA(raw, "")
        _check_verification(data["verification"], "verification")
        knob = MAIN_KNOB[data["verification"].get("rule", MARS)]
        _check_curve_knobs(data["curve"], knob, "curve")
        if "speed" in data:
            _check_curve_knobs(data["speed"]["curve"], knob, "speed.curve")
        _check_histogram(data["histogram"], "histogram")
    except _Invalid as e:
        raise ProfileError(f"{source}: {e.path}: {e.message}") from None
    return data
