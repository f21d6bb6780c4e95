"""marscli bench's report: the JSON file, the tables on stderr and the PNG plot.

Column meanings: docs/bench.md.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
from typing import Any

from marscli.bench.methods import (
    AR,
    HF_GENERATE,
    MARS,
    MARS_METHODS,
    MARS_TREE,
    STRICT,
    STRICT_TREE,
    TIME_REFERENCES,
    BenchConfig,
    Log,
)
from marscli.drafters.kinds import MODEL
from marscli.errors import MarscliError, UsageError
from marscli.io.results import atomic_write_text
from marscli.scoring.compare import render_task_table

#: Width of the tables when stderr is not a terminal: one row per line.
REPORT_WIDTH = 200


def write_outputs(cfg: BenchConfig, report: dict[str, Any], log: Log) -> None:

    text = json.dumps(report, indent=2, ensure_ascii=False, allow_nan=False) + "\n"
    if cfg.report == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
    elif cfg.report:
        try:
            atomic_write_text(cfg.report, text)
        except OSError as e:
            raise MarscliError(f"cannot write the report to {cfg.report}: {e.strerror or e}") from None
        log(f"report written to {cfg.report}")
    if cfg.plot:
        try:
            write_plot(report, cfg.plot)
        except OSError as e:
            raise MarscliError(f"cannot write the plot to {cfg.plot}: {e.strerror or e}") from None
        log(f"plot written to {cfg.plot}")


def json_safe(obj: Any) -> Any:
    """Floats rounded to 6 significant places; inf (theta that never relaxes) as a string."""
    if isinstance(obj, float):
        if not math.isfinite(obj):
            return None if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
        return float(f"{obj:.6g}")
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


# --------------------------------------------------------------------------------------------
# Tables


def _fmt(v: Any, spec: str) -> str:
    if v is None:
        return "-"
    return format(v, spec)


def _cell(a: dict[str, Any], f: str, spec: str) -> str:
    s = _fmt(a.get(f), spec)
    sd = (a.get("spread") or {}).get(f)
    return f"{s} ± {format(sd, spec)}" if sd is not None and s != "-" else s


TABLE_COLUMNS = (
    # (header, field, format)
    ("tok/s", "tokens_per_s", ".1f"),
    ("median tok/s", "median_tokens_per_s", ".1f"),
    ("s/record", "seconds_per_record", ".3f"),
    ("x hf-gen", "speedup_vs_hf_generate", ".2f"),
    ("x ar", "speedup_vs_ar", ".2f"),
    ("task x hf-gen", "task_speedup_vs_hf_generate", ".2f"),
    ("task x ar", "task_speedup_vs_ar", ".2f"),
    ("tau", "acceptance_length", ".2f"),
    ("accept", "acceptance_rate", ".2f"),
    ("relaxed", "relaxed_share", ".3f"),
    ("exact", "exact_match_rate", ".2f"),
    ("prefix", "prefix_share", ".3f"),
    ("NLL/tok", "nll_per_token", ".3f"),
    ("ROUGE-L", "rouge_l", ".3f"),
    ("repeat", "repeat_share", ".3f"),
    ("loops", "loop_share", ".2f"),
    ("ideal x ar", "ideal_speedup_vs_ar", ".2f"),
    ("meas/ideal", "measured_over_ideal", ".2f"),
)


#: The reference of the time-per-task verdicts, in order of preference (method kinds).
VERDICT_REFERENCES = (AR, HF_GENERATE, STRICT)


def time_verdicts(methods: dict[str, dict[str, Any]]) -> list[str]:
    """One line per method: its speed-up in tokens/s and per task (time per record) against
    ar (else hf-generate, else strict), with its answers' length ratio; and, when it is faster
    than that reference or than strict in tokens/s yet slower per task, a plain sentence
    saying so (its answers are longer)."""
    suffix = {kind: s for s, kind in TIME_REFERENCES}
    first: dict[str, str] = {}
    for name, a in methods.items():
        first.setdefault(a["kind"], name)
    kind = next((k for k in VERDICT_REFERENCES if k in first), None)
    if kind is None:
        return []
    lines = []
    for name, a in methods.items():
        if name == first[kind]:
            continue
        tps, task, length = (a.get(f"{p}_vs_{suffix[kind]}") for p in ("speedup", "task_speedup", "length_ratio"))
        if tps is None or task is None:
            continue
        conj = "but" if round(task, 2) < round(tps, 2) else "and"
        line = f"{name}: {tps:.2f}x tokens/s {conj} {task:.2f}x per task vs {first[kind]}"
        if length is not None:
            line += f" (answers {length:.2f}x as long)"
        for other in dict.fromkeys((kind, STRICT)):
            if other not in first or name == first[other]:
                continue
            o_tps, o_task, o_len = (a.get(f"{p}_vs_{suffix[other]}")
                                    for p in ("speedup", "task_speedup", "length_ratio"))
            if o_tps is not None and o_task is not None and o_tps > 1 > o_task:
                line += f"; slower per task than {first[other]}: its answers are longer"
                if other != kind:
                    line += (f" ({o_tps:.2f}x tokens/s but {o_task:.2f}x per task"
                             + (f", answers {o_len:.2f}x as long)" if o_len is not None else ")"))
        lines.append(line)
    return lines


def run_title(report: dict[str, Any]) -> str:
    """What was run: prompts, max tokens, greedy or sampled, drafter, target and device."""
    s = report["settings"]
    mode = "greedy" if s["temperature"] == 0 else f"temperature {s['temperature']:g}, seeds {s['seeds']}"
    d = s["drafter"]
    drafter = d["kind"] if d["kind"] != MODEL else ("ngram+" if d.get("hybrid") else "") + str(d["model"])
    return (f"marscli bench: {report['prompts']['used']} prompts, max {s['max_tokens']} tokens, {mode}, "
            f"drafter {drafter} (K<={d['num_draft_tokens']}"
            f"{', prompt window ' + str(d['context']) if d.get('context') else ''}), "
            f"target {report['target'].get('name')} on {report['environment']['device']}")


def render_tables(report: dict[str, Any], console) -> None:
    """The tables on stderr; a --throughput report (settings.throughput_only) has only the
    batched throughput one."""
    from rich.table import Table

    if report["settings"].get("throughput_only"):
        render_throughput(report, console, f"{run_title(report)}: batched throughput only")
        _print_notes(report, console, throughput=True)
        return
    methods = report["methods"]
    cols = [c for c in TABLE_COLUMNS if any(a.get(c[1]) is not None for a in methods.values())]
    if any(f == "task_speedup_vs_ar" for _, f, _ in cols):  # one task speed-up: vs ar, else vs hf-generate
        cols = [c for c in cols if c[1] != "task_speedup_vs_hf_generate"]
    table = Table(title=run_title(report), title_justify="left")
    table.add_column("method")
    for header, _, _ in cols:
        table.add_column(header, justify="right")
    for name, a in methods.items():
        table.add_row(name, *[_cell(a, f, spec) for _, f, spec in cols])
    console.print(table)
    for line in time_verdicts(methods):
        console.print(line, markup=False, soft_wrap=True)

    spec_methods = {n: a for n, a in methods.items() if a.get("per_position_acceptance_rate")}
    if spec_methods:
        k = max(len(a["per_position_acceptance_rate"]) for a in spec_methods.values())
        pos = Table(title="acceptance rate by draft position", title_justify="left")
        pos.add_column("method")
        for i in range(k):
            pos.add_column(str(i + 1), justify="right")
        for name, a in spec_methods.items():
            pos.add_row(name, *[_fmt(v, ".2f") for v in a["per_position_acceptance_rate"]])
        console.print(pos)
    if report.get("throughput"):
        render_throughput(report, console, "batched throughput (all prompts; tokens/s include prefill)")
    p = report["physical_limit"]
    console.print(f"target forward over a {p['context_tokens']}-token context: 1 token {1e3 * p['t_1_s']:.1f} ms, "
                  f"K+1 = {len(p['target_forward_s'])} tokens {1e3 * p['t_k_plus_1_s']:.1f} ms"
                  + (f"; draft model 1 token {1e3 * p['draft_forward_s']:.1f} ms" if p.get("draft_forward_s") else ""),
                  markup=False, soft_wrap=True)
    c = report["correctness"]
    if c["checked"]:
        verdict = "OK" if not c["failures"] else f"{c['failures']} FAILURES"
        console.print(f"exactness of {', '.join(c['methods'])} against {c['reference']} "
                      f"(greedy, token for token): {verdict}",
                      markup=False, soft_wrap=True)
    if report.get("task"):
        render_task_table(report["task"], console)
    _print_notes(report, console, throughput=False)


#: The batched throughput table: (header, row field, format); "x" formats end in "x".
THROUGHPUT_COLUMNS = (
    ("batch", "batch_size", "d"),
    ("tokens", "completion_tokens", "d"),
    ("seconds", "seconds", ".1f"),
    ("tokens/s", "tokens_per_s", ".1f"),
    ("records/s", "records_per_s", ".2f"),
    ("x hf-gen", "speedup_vs_hf_generate", ".2fx"),
    ("vs first batch", "speedup_vs_first_batch_size", ".2fx"),
    ("tau", "acceptance_length", ".2f"),
    ("k/step", "mean_draft_length", ".2f"),
    ("loops", "loops", "d"),
    ("same output", "outputs_equal_first_batch_size", "/prompts"),
    ("prefill s", "prefill_seconds", ".1f"),
    ("prefix reused", "prefix_tokens_reused", "d"),
    ("peak KV MiB", "peak_kv_cache_mib", ".1f"),
    ("peak RSS MiB", "peak_rss_mib", ".0f"),
)


def _throughput_cell(r: dict[str, Any], field_: str, spec: str) -> str:
    if spec == "/prompts":
        return f"{r[field_]}/{r['prompts']}"
    if spec.endswith("x"):
        v = r.get(field_)
        return "-" if v is None else f"{v:{spec[:-1]}}x"
    return _fmt(r.get(field_), spec)


def render_throughput(report: dict[str, Any], console, title: str) -> None:
    """One row per (method, batch size): speed (tokens/s and records/s, against hf-generate
    at the same size and the method at the first size), equal outputs, the prefill's cost and
    the prompt tokens the prefix cache saved, memory."""
    from rich.table import Table

    t = Table(title=title, title_justify="left")
    t.add_column("method", justify="left")
    for header, _, _ in THROUGHPUT_COLUMNS:
        t.add_column(header, justify="right")
    for r in report["throughput"]:
        t.add_row(r["method"], *[_throughput_cell(r, f, spec) for _, f, spec in THROUGHPUT_COLUMNS])
    console.print(t)


def _print_notes(report: dict[str, Any], console, throughput: bool) -> None:
    """The notes that change how the figures read (the report holds them all); a --throughput
    run also prints how its rows were measured, having no other table to explain them."""
    for note in report["notes"]:
        if ("no ROUGE-L" in note or "ignores them" in note or "generation_config" in note
                or (throughput and note.startswith(("throughput", "--throughput")))):
            console.print(f"note: {note}", markup=False, soft_wrap=True)

# --------------------------------------------------------------------------------------------
# Plot

#: Quality panels of --plot, when the report has the figure: (field, axis label).
PLOT_PANELS = (
    ("nll_per_token", "target NLL per token (lower is likelier)"),
    ("rouge_l", "ROUGE-L F1 against the reference"),
    ("prefix_share", "prefix share with the reference method"),
)


_PLOT_COLORS = {MARS: "tab:red", MARS_TREE: "tab:purple", STRICT_TREE: "tab:green"}


def write_plot(report: dict[str, Any], path: str) -> None:
    """Speedup against quality, one point per method, MARS thetas joined by a line."""
    try:
        import matplotlib
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install 'marscli[bench]'") from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    methods = report.get("methods")
    if not methods:
        raise UsageError("--plot: the report has no per-method figures (a --throughput run has none)")
    x_field = "speedup_vs_hf_generate" if any(a.get("speedup_vs_hf_generate") for a in methods.values()) \
        else "speedup_vs_ar"
    panels = [(f, label) for f, label in PLOT_PANELS if any(a.get(f) is not None for a in methods.values())]
    if not panels:
        raise UsageError("--plot: the report has no quality figure to plot")
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.4), squeeze=False)
    for ax, (field_, label) in zip(axes[0], panels):
        mars_pts: dict[str, list] = {MARS: [], MARS_TREE: []}
        for name, a in sorted(methods.items(), key=lambda kv: (kv[1]["kind"] in MARS_METHODS, kv[1]["theta"] or 0.0)):
            x, y = a.get(x_field), a.get(field_)
            if x is None or y is None:
                continue
            spread = a.get("spread") or {}
            ax.errorbar(x, y, xerr=spread.get(x_field), yerr=spread.get(field_), fmt="o",
                        color=_PLOT_COLORS.get(a["kind"], "tab:blue"), capsize=3)
            ax.annotate(name, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
            if a["kind"] in mars_pts:
                mars_pts[a["kind"]].append((x, y))
        for kind, pts in mars_pts.items():
            if len(pts) > 1:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, "-", color=_PLOT_COLORS[kind], alpha=0.5)
        ax.set_xlabel(f"speedup ({x_field.removeprefix('speedup_vs_').replace('_', '-')} = 1)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    s = report["settings"]
    fig.suptitle(f"marscli bench: {report['target'].get('name')}, {report['prompts']['used']} prompts, "
                 f"max {s['max_tokens']} tokens, temperature {s['temperature']:g}", fontsize=10)
    fig.tight_layout()
    directory = os.path.dirname(os.path.abspath(path))
    import tempfile

    fd, tmp = tempfile.mkstemp(prefix=".plot.", suffix=".png", dir=directory)
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=120, format="png")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    finally:
        plt.close(fig)
