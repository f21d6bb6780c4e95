"""What a calibration shows and writes: the trade-off curve as a table, the histogram as
text or a PNG, and the profile document (marscli.calibration.policies decides; this presents)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from marscli._version import __version__
from marscli.calibration.collect import MarginData
from marscli.calibration.policies import Calibration
from marscli.calibration.profile_schema import MAIN_KNOB, RANK_KEYS, SCHEMA_VERSION
from marscli.calibration.profiles import identity_for_profile
from marscli.drafters.kinds import NGRAM
from marscli.errors import UsageError


def curve_table(profile_data: dict[str, Any], title: str | None = None):
    """A rich Table of a profile's trade-off curve; the chosen theta's row is marked."""
    from rich.table import Table

    knob, theta = chosen_knob(profile_data)
    rows = profile_data["curve"]
    t = Table(title=title, title_justify="left")
    for col in (knob, "relaxable", "relax rate", "relaxed/token", "tau (est.)", "NLL +nats/token"):
        t.add_column(col, justify="right")
    for i, row in enumerate(rows):
        strict = i == len(rows) - 1 or not math.isfinite(row[knob])  # the last row is strict's
        chosen = not strict and row[knob] == theta
        th = "strict" if strict else f"{row[knob]:.6g}"
        rate = row.get("relax_rate")
        t.add_row(
            ("> " if chosen else "") + th,
            f"{row['relaxable_share']:.3f}",
            "-" if rate is None else f"{rate:.3f}",
            f"{row['relaxed_share']:.3f}",
            f"{row['tau']:.3f}",
            f"{row['nll_increase']:.4f}",
            style="bold" if chosen else None,
        )
    return t


def chosen_knob(profile_data: dict[str, Any]) -> tuple[str, float]:
    """(name, value) of a profile document's main knob (theta for mars)."""

    v = profile_data["verification"]
    name = MAIN_KNOB[v.get("rule", "mars")]
    return name, v[name]


def histogram_text(hist: dict[str, Any], theta: float | None = None, rows: int = 20,
                   width: int = 40, knob: str = "theta") -> str:
    """A terminal histogram of the statistic, split by draft rank (1 = top-1 '#', 2 = top-2
    '=', other '.'), over the occupied part of its range; the bin holding the knob's value
    (``theta``, named ``knob``) is marked."""
    edges = np.asarray(hist["edges"])
    counts = np.stack([np.asarray(hist["counts"][k]) for k in RANK_KEYS])  # [3, bins]
    total = counts.sum(axis=0)
    lines = [f"{hist['statistic']} by draft rank  (# top-1  = top-2  . other)"]
    below = [hist["below"][k] for k in RANK_KEYS]
    if sum(below):
        lines.append(f"  below {edges[0]:g}: top-1 {below[0]}, top-2 {below[1]}, other {below[2]}")
    nz = np.nonzero(total)[0]
    if len(nz) == 0:
        lines.append("  (no positions)")
        return "\n".join(lines)
    lo, hi = int(nz[0]), int(nz[-1]) + 1
    groups = np.array_split(np.arange(lo, hi), min(rows, hi - lo))
    sums = [counts[:, g].sum(axis=1) for g in groups]
    peak = max(int(s.sum()) for s in sums) or 1
    for g, s in zip(groups, sums):
        a, b = edges[g[0]], edges[g[-1] + 1]
        bar = ""
        for ch, c in zip("#=.", s):
            bar += ch * int(round(width * int(c) / peak))
        mark = f" <- {knob}" if theta is not None and a < theta <= b else ""
        lines.append(f" {a:.3f}-{b:.3f} |{bar:<{width}}|{int(s.sum()):>7}{mark}")
    return "\n".join(lines)


def plot_profile(profile_data: dict[str, Any], path: str) -> None:
    """Histogram by draft rank and the trade-off curve, side by side, as a PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install 'marscli[plot]'") from None
    hist = profile_data["histogram"]
    knob, theta = chosen_knob(profile_data)
    edges = np.asarray(hist["edges"])
    centers = (edges[:-1] + edges[1:]) / 2
    width = np.diff(edges)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    bottom = np.zeros(len(centers))
    for key, label in zip(RANK_KEYS, ("draft = top-1", "draft = top-2", "other")):
        c = np.asarray(hist["counts"][key], dtype=float)
        ax1.bar(centers, c, width=width, bottom=bottom, label=label, align="center")
        bottom += c
    nz = np.nonzero(bottom)[0]
    if len(nz):
        ax1.set_xlim(edges[nz[0]], edges[nz[-1] + 1])
    ax1.axvline(theta, color="k", linestyle="--", label=f"{knob} = {theta:.4g}")
    ax1.set_xlabel(hist["statistic"])
    ax1.set_ylabel("verified draft positions")
    ax1.legend()
    rows = [r for r in profile_data["curve"][:-1] if math.isfinite(r[knob])]
    xs = [r["nll_increase"] for r in rows]
    ys = [r["tau"] for r in rows]
    ax2.plot(xs, ys, marker="o")
    for r in rows:
        ax2.annotate(f"{r[knob]:.3g}", (r["nll_increase"], r["tau"]), fontsize=7)
    strict = profile_data["summary"]["tau_strict"]
    ax2.axhline(strict, color="gray", linestyle=":", label=f"strict tau = {strict:.3g}")
    s = profile_data["summary"]
    ax2.scatter([s["nll_increase"]], [s["tau_mars"]], color="red", zorder=3, label="chosen")
    ax2.set_xlabel("estimated NLL increase (nats / token)")
    ax2.set_ylabel("estimated mean acceptance length")
    ax2.legend()
    fig.suptitle(f"{profile_data['name']}: {profile_data['policy']['name']} "
                 f"{profile_data['policy']['value']:g} -> {knob} {theta:.4g}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- the profile


def verification_section(cal: Calibration, data: MarginData) -> dict[str, Any]:
    """The profile's verification: the rule, its knobs (Rule.knobs), the guard and the strict
    spans (when the calibration had any)."""
    rule = cal.chosen_rule()
    return {"rule": rule.name, **rule.knobs(), "guard": data.guard.to_dict(),
            **({"spans": data.spans.to_dict()} if data.spans.active else {})}


def build_profile(*, name: str, cal: Calibration, data: MarginData, target_identity: dict,
                  draft_cfg, draft_identity: dict | None, sampling, input_name: str,
                  input_sha256: str | None, seconds: float) -> dict[str, Any]:
    """The profile document (schema_version 1) for a calibration."""
    import datetime as dt

    return {
        "schema_version": SCHEMA_VERSION,
        "name": name,
        "created_at": dt.datetime.now(dt.timezone.utc).replace(microsecond=0).isoformat(),
        "marscli_version": __version__,
        "target": identity_for_profile(target_identity),
        "drafter": {
            "kind": draft_cfg.kind,
            "model": identity_for_profile(draft_identity) if draft_identity else None,
            "num_draft_tokens": draft_cfg.num_draft_tokens,
            "adaptive": draft_cfg.adaptive,
            "ngram_max": draft_cfg.ngram_max if draft_cfg.kind == NGRAM else None,
            "ngram_min": draft_cfg.ngram_min if draft_cfg.kind == NGRAM else None,
            **({"tree": {"depth": draft_cfg.tree_depth, "top_k": draft_cfg.tree_top_k,
                         "tokens": draft_cfg.tree_tokens}} if getattr(draft_cfg, "tree", False) else {}),
            **({"hybrid": True} if getattr(draft_cfg, "hybrid", False) else {}),
        },
        "verification": verification_section(cal, data),
        "policy": {"name": cal.policy, "value": cal.policy_value},
        "sampling": {
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k,
            "max_tokens": sampling.max_tokens,
            "seed": sampling.seed,
        },
        "calibration_data": {
            "file": input_name,
            "sha256": input_sha256,
            "records": data.records,
            "failed_records": data.failed_records,
            "tokens": data.tokens,
            "steps": data.steps,
            "positions": data.positions,
            "seconds": round(seconds, 2),
        },
        "summary": cal.summary,
        "histogram": cal.histogram,
        "curve": cal.curve,
    }
