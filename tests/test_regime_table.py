"""scripts/report.py regime: bench_head_regime.sh's reports as one table, a row per drafter,
temperature and method, with the paired task difference and each run's wall time."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "report.py"


def method(tps: float, x: float, tau: float | None, relaxed: float | None) -> dict:
    return {"tokens_per_s": tps, "speedup_vs_ar": x, "acceptance_length": tau, "relaxed_share": relaxed,
            "exact_match_rate": 1.0 if not relaxed else 0.5, "nll_per_token": 0.4, "seconds_per_record": 2.0}


def test_rows_per_drafter_temperature_and_method(tmp_path):
    rep = {"methods": {"ar": method(10.0, 1.0, None, None), "strict": method(20.0, 2.0, 1.9, 0.0),
                       "mars@0.9": method(24.0, 2.4, 2.3, 0.05)},
           "task": {"methods": {
               "strict": {"mean": 0.2, "vs_baseline": None},
               "mars@0.9": {"mean": 0.19, "vs_baseline": {"diff": -0.01, "diff_ci95": [-0.03, 0.02],
                                                          "flips": {"down": 3, "up": 1}}}}}}
    (tmp_path / "eagle3-t1.json").write_text(json.dumps(rep))
    (tmp_path / "eagle3-t1.log").write_text("bench tables\nwall seconds: 123, exit code: 0\n")
    (tmp_path / "ngram-t0.json").write_text(json.dumps({"methods": {"strict": method(15.0, 1.5, 1.4, 0.0)}}))
    out = subprocess.run([sys.executable, str(SCRIPT), "regime", str(tmp_path)], capture_output=True, text=True,
                         check=True)
    lines = out.stdout.splitlines()
    rows = [ln for ln in lines if ln.startswith("| head") or ln.startswith("| ngram")]
    # temperature 0 first, then 1; within one, the head before n-gram
    assert [r.split("|")[1].strip() for r in rows] == ["ngram, 0", "head, 1", "head, 1", "head, 1"]
    mars = next(r for r in rows if "mars@0.9" in r)
    cells = [c.strip() for c in mars.strip("|").split("|")]
    assert cells[2:] == ["24.0", "2.40", "2.30", "0.050", "0.50", "0.400", "0.190",
                         "-0.010 [-0.030, +0.020] (3/1)", "2.0"]
    strict = [c.strip() for c in rows[2].strip("|").split("|")]
    assert strict[1] == "strict" and strict[8:10] == ["0.200", "-"]  # the baseline has no paired cell
    assert "eagle3 T=1: 123 s (exit 0)" in lines[-1]


def test_ratios_reads_a_batch_size_report(tmp_path):
    """report.py ratios: per batch size, strict and MARS against ar, then strict against assisted generation."""
    rep = {"throughput": [{"method": m, "batch_size": b, "tokens_per_s": t}
                          for m, b, t in (("ar", 1, 10.0), ("strict", 1, 14.0), ("mars@0.9", 1, 15.0),
                                          ("ar", 4, 30.0), ("strict", 4, 33.0))],
           "methods": {"strict": {"tokens_per_s": 14.0}, "hf-assisted": {"tokens_per_s": 10.0}},
           "correctness": {"strict_equals_ar": True}}
    (tmp_path / "b.json").write_text(json.dumps(rep))
    out = subprocess.run([sys.executable, str(SCRIPT), "ratios", str(tmp_path / "b.json")], capture_output=True,
                         text=True, check=True).stdout
    assert "| 1 | 10.0 | 14.0 | 15.0 | 1.400 | 1.500 |" in out
    assert "| 4 | 30.0 | 33.0 | - | 1.100 | - |" in out
    assert "strict / hf-assisted = 1.400" in out
