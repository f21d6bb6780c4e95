"""Statistics for task scores: a file's mean with its 95% interval, the paired comparison of
a method against strict decoding on the same records, and label-free warning signs.

Definitions (docs/bench.md, "Task scores", reads them):

- **mean CI**: scores that are all 0 or 1 (pass@1, accuracy) get the Wilson score interval
  (right at 0 % and 100 %, where a percentile bootstrap collapses to a point); other scores
  (ROUGE-L) get the percentile bootstrap of the mean.
- **paired bootstrap**: the records are resampled with replacement B times (the same
  records for both methods, so what the pair shares cancels); the 2.5th and 97.5th
  percentiles of mean(method - strict) over the resamples are the 95% CI of the difference.
  A CI that contains 0 means the difference is **inside the noise**.
- **flips**: records where the method scored lower than strict (pass -> fail for 0/1
  scores) and higher (fail -> pass).
- **quality recovery**: method mean / strict mean (the paper's), with the same bootstrap.
- **length ratio**: the method's completion tokens / strict's, over the same records.
- **truncated share**: share of outputs cut at max tokens (no end of sequence).
- **loop share**: share of outputs that end in a repeated n-gram loop (`ends_in_loop`).

Pure functions over lists of numbers; numpy is imported inside the bootstrap.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from marscli.verification.guard import (  # noqa: F401
    LOOP_MIN_REPEATS,
    LOOP_MIN_SPAN,
    LOOP_MIN_SPAN_CHARS,
)
from marscli.verification.guard import ends_in_loop as loops

#: Bootstrap resamples: the Monte Carlo error of a 95% percentile is then ~0.2% of its width.
BOOTSTRAP_RESAMPLES = 10_000
BOOTSTRAP_SEED = 0
CONFIDENCE = 0.95
#: z for a two-sided 95% interval.
Z_95 = 1.959963984540054


# --------------------------------------------------------------------------------------------
# One file


def is_binary(scores: Sequence[float]) -> bool:
    return all(s in (0, 1) for s in scores)


def wilson_ci(successes: float, n: int, z: float = Z_95) -> tuple[float, float]:
    """Wilson score interval of a proportion (Wilson 1927); (0, 1) for n = 0."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    den = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    # At 0 or n successes the bound is exactly 0 or 1 (the formula leaves rounding noise).
    lo = 0.0 if successes == 0 else max(0.0, centre - half)
    hi = 1.0 if successes == n else min(1.0, centre + half)
    return lo, hi


def bootstrap_mean_ci(values: Sequence[float], resamples: int = BOOTSTRAP_RESAMPLES,
                      seed: int = BOOTSTRAP_SEED) -> tuple[float, float]:
    """Percentile bootstrap 95% CI of the mean of `values` (seeded: the same data, the same CI)."""
    import numpy as np

    x = np.asarray(values, dtype=np.float64)  # [n]
    if x.size == 0:
        raise ValueError("bootstrap of no values")
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, x.size, size=(resamples, x.size))].mean(axis=1)  # [B]
    lo, hi = np.quantile(means, [(1 - CONFIDENCE) / 2, (1 + CONFIDENCE) / 2])
    return float(lo), float(hi)


@dataclass(frozen=True)
class MeanCI:
    n: int
    mean: float | None
    low: float | None
    high: float | None
    method: str  # "wilson" or "bootstrap"

    def to_json(self) -> dict[str, Any]:
        return {"n": self.n, "mean": self.mean, "ci95": [self.low, self.high] if self.n else None,
                "ci_method": self.method}

    def describe(self, digits: int = 3) -> str:
        if not self.n or self.mean is None:
            return "no scored records"
        return (f"{self.mean:.{digits}f}, 95% CI [{self.low:.{digits}f}, {self.high:.{digits}f}] "
                f"({self.method}), n = {self.n}")


def mean_ci(scores: Sequence[float], binary: bool | None = None) -> MeanCI:
    """Mean of per-record scores with its 95% interval: Wilson for a 0/1 score (`binary`, by
    default inferred from the values; a task says it, so that ROUGE-L values that happen to be
    0 or 1 still get the bootstrap), else the percentile bootstrap."""
    n = len(scores)
    if n == 0:
        return MeanCI(0, None, None, None, "none")
    m = math.fsum(scores) / n
    if (is_binary(scores) if binary is None else binary) and is_binary(scores):
        lo, hi = wilson_ci(math.fsum(scores), n)
        return MeanCI(n, m, lo, hi, "wilson")
    lo, hi = bootstrap_mean_ci(scores)
    return MeanCI(n, m, lo, hi, "bootstrap")


# --------------------------------------------------------------------------------------------
# Paired comparison


def paired_bootstrap(method: Sequence[float], strict: Sequence[float],
                     resamples: int = BOOTSTRAP_RESAMPLES,
                     seed: int = BOOTSTRAP_SEED) -> dict[str, Any]:
    """Paired bootstrap of mean(method - strict) and of mean(method) / mean(strict).

    `method[i]` and `strict[i]` score the same record. Returns diff, its 95% CI, recovery and
    its 95% CI (None where strict's mean is 0; resamples with a strict mean of 0 are left out
    of the recovery's percentiles).
    """
    import numpy as np

    a = np.asarray(method, dtype=np.float64)  # [n]
    b = np.asarray(strict, dtype=np.float64)  # [n]
    if a.shape != b.shape:
        raise ValueError(f"paired scores differ in length: {a.size} and {b.size}")
    if a.size == 0:
        raise ValueError("paired bootstrap of no records")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, a.size, size=(resamples, a.size))  # [B, n]
    ma, mb = a[idx].mean(axis=1), b[idx].mean(axis=1)  # [B], [B]
    q = [(1 - CONFIDENCE) / 2, (1 + CONFIDENCE) / 2]
    d_lo, d_hi = np.quantile(ma - mb, q)
    out: dict[str, Any] = {"diff": float(a.mean() - b.mean()), "diff_ci95": [float(d_lo), float(d_hi)],
                           "recovery": None, "recovery_ci95": None}
    if b.mean() > 0:
        ok = mb > 0
        r_lo, r_hi = np.quantile(ma[ok] / mb[ok], q)
        out["recovery"] = float(a.mean() / b.mean())
        out["recovery_ci95"] = [float(r_lo), float(r_hi)]
    return out


def flips(method: Sequence[float], strict: Sequence[float]) -> dict[str, int]:
    """Records the method scored below strict ("down": pass -> fail) and above ("up")."""
    down = sum(m < s for m, s in zip(method, strict))
    up = sum(m > s for m, s in zip(method, strict))
    return {"down": down, "up": up, "same": len(method) - down - up}


def inside_noise(ci: Sequence[float] | None) -> bool:
    """A difference whose 95% CI contains 0 cannot be told from noise at this sample size."""
    return ci is None or (ci[0] <= 0.0 <= ci[1])


def compare(method: Sequence[float], strict: Sequence[float]) -> dict[str, Any]:
    """The paired comparison of a method's per-record scores with strict's on the same records."""
    if len(method) != len(strict):
        raise ValueError(f"paired scores differ in length: {len(method)} and {len(strict)}")
    n = len(method)
    out: dict[str, Any] = {"n": n, "score": math.fsum(method) / n if n else None,
                           "strict_score": math.fsum(strict) / n if n else None}
    if n:
        out.update(paired_bootstrap(method, strict))
    else:
        out.update({"diff": None, "diff_ci95": None, "recovery": None, "recovery_ci95": None})
    out["flips"] = flips(method, strict)
    out["inside_noise"] = inside_noise(out["diff_ci95"])
    return out


def verdict(c: dict[str, Any], digits: int = 3) -> str:
    """One plain sentence on a comparison: the difference and whether it is inside the noise."""
    if not c.get("n"):
        return "no paired records"
    lo, hi = c["diff_ci95"]
    f = c["flips"]
    text = (f"diff {c['diff']:+.{digits}f} (95% CI [{lo:+.{digits}f}, {hi:+.{digits}f}], n = {c['n']}, "
            f"{f['down']} down / {f['up']} up)")
    if f["down"] == 0 and f["up"] == 0:
        return text + ": the same score on every record"
    if c["inside_noise"]:
        return text + ": inside the noise (the CI contains 0)"
    return text + (": worse than strict beyond the noise" if c["diff"] < 0 else ": better than strict beyond the noise")


# --------------------------------------------------------------------------------------------
# Label-free warnings


def ends_in_loop(seq: Sequence[Any] | str, *, min_repeats: int = LOOP_MIN_REPEATS,
                 min_span: int | None = None) -> bool:
    """Does `seq` end in a repeated n-gram loop? The one definition marscli uses everywhere
    (``marscli.verification.guard.ends_in_loop``: results' `spec`, bench, scoring): token ids, or the
    characters of a str."""

    kw: dict[str, Any] = {"min_repeats": min_repeats}
    if min_span is not None:
        kw["min_span"] = min_span
    return loops(seq, **kw)


def share(flags: Sequence[bool]) -> float | None:
    return sum(map(bool, flags)) / len(flags) if flags else None
