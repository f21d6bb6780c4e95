"""scripts/report.py merge: chunked `bench --task` reports merge into the figures one
run over every record would give, and chunks that cannot be merged are refused."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from marscli.scoring import stats

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "report.py"


@pytest.fixture(scope="module")
def mod():
    spec = importlib.util.spec_from_file_location("report", SCRIPT)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


def report(ids, scores, *, methods=("ar", "strict", "mars@0.9"), seconds=None, max_tokens=8, tokens=None):
    """A minimal bench --task report: `scores[method][i]` for record ids[i]; every run makes
    `tokens[method][i]` completion tokens (default 4) in `seconds[method]` seconds."""
    kinds = {"ar": "ar", "strict": "strict"}
    tokens = tokens or {m: [4] * len(ids) for m in methods}
    seconds = seconds or {m: 1.0 for m in methods}
    runs, recs, ms = [], [], {}
    for m in methods:
        for i, rid in enumerate(ids):
            runs.append({"id": rid, "seed": 0, "method": m, "completion_tokens": tokens[m][i],
                         "ends_in_loop": False})
            recs.append({"id": rid, "seed": 0, "method": m, "score": scores[m][i]})
        n_tok = sum(tokens[m])
        ms[m] = {"kind": kinds.get(m, "mars"), "theta": None if m in kinds else float(m.split("@")[1]),
                 "runs": len(ids), "completion_tokens": n_tok, "seconds": seconds[m],
                 "target_forwards": n_tok, "steps": n_tok if m == "ar" else n_tok // 2,
                 "drafted": 0, "accepted": 0, "relaxed": 1 if m.startswith("mars") else 0}
    thetas = sorted(v["theta"] for v in ms.values() if v["theta"] is not None)
    return {"settings": {"methods": list(methods), "max_tokens": max_tokens, "temperature": 0.0, "seeds": [0],
                         "margin": "logit_ratio", "thetas": thetas, "guard": None, "drafter": "d"},
            "target": {"sha256": "t", "dtype": "float32"}, "draft": {"sha256": "d", "dtype": "float32"},
            "task": {"task": "humaneval", "baseline": "strict", "score_name": "pass@1", "records": recs},
            "runs": runs, "methods": ms}


A_SCORES = {"ar": [1, 0, 1], "strict": [1, 0, 1], "mars@0.9": [1, 0, 0]}
B_SCORES = {"ar": [1, 1], "strict": [1, 1], "mars@0.9": [1, 0]}


def test_merge_equals_one_run_over_all_records(mod):
    a = report(["a", "b", "c"], A_SCORES, seconds={"ar": 2.0, "strict": 1.0, "mars@0.9": 1.0})
    b = report(["d", "e"], B_SCORES, seconds={"ar": 2.0, "strict": 1.0, "mars@0.9": 0.5})
    merged = mod.merge([a, b])
    assert merged["records"] == 5
    mars, strict = merged["methods"]["mars@0.9"], merged["methods"]["strict"]
    # speed: summed tokens over summed seconds, against ar's
    assert mars["tokens_per_s"] == pytest.approx(20 / 1.5)
    assert mars["speedup_vs_ar"] == pytest.approx((20 / 1.5) / (20 / 4.0))
    # scores: the mean and paired comparison over all five records, as one run would compute them
    all_mars = A_SCORES["mars@0.9"] + B_SCORES["mars@0.9"]
    all_strict = A_SCORES["strict"] + B_SCORES["strict"]
    assert mars["task"]["mean"] == pytest.approx(2 / 5)
    assert strict["task"]["mean"] == pytest.approx(4 / 5)
    want = stats.compare(all_mars, all_strict)
    got = mars["task"]["vs_baseline"]
    assert got["flips"] == {"down": 2, "up": 0, "same": 3} == want["flips"]
    assert got["diff"] == pytest.approx(want["diff"]) and got["diff_ci95"] == pytest.approx(want["diff_ci95"])


def test_refuses_different_methods_and_overlapping_records(mod, tmp_path):
    a = report(["a", "b", "c"], A_SCORES)
    b = report(["d", "e"], {k: v for k, v in B_SCORES.items() if k != "ar"}, methods=("strict", "mars@0.9"))
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(b))
    with pytest.raises(SystemExit):
        mod.load([str(pa), str(pb)])
    pc = tmp_path / "c.json"
    pc.write_text(json.dumps(report(["c", "d"], B_SCORES)))
    with pytest.raises(SystemExit):
        mod.load([str(pa), str(pc)], quality_only=True)
    # other settings must still match under --quality-only
    d = report(["d", "e"], B_SCORES, max_tokens=16)
    pd = tmp_path / "d.json"
    pd.write_text(json.dumps(d))
    with pytest.raises(SystemExit):
        mod.load([str(pa), str(pd)], quality_only=True)


def test_quality_only_keeps_common_methods_and_drops_speed(tmp_path):
    a = report(["a", "b", "c"], A_SCORES)
    b = report(["d", "e"], {k: v for k, v in B_SCORES.items() if k != "ar"}, methods=("strict", "mars@0.9"))
    pa, pb, out = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "m.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(b))
    proc = subprocess.run([sys.executable, str(SCRIPT), "merge", str(pa), str(pb), "--quality-only",
                           "--report", str(out)], capture_output=True, text=True, cwd=ROOT, check=False)
    assert proc.returncode == 0, proc.stderr
    merged = json.loads(out.read_text())
    assert list(merged["methods"]) == ["strict", "mars@0.9"]
    assert merged["records"] == 5 and merged["quality_only"]
    assert all(m["tokens_per_s"] is None and m["speedup_vs_ar"] is None for m in merged["methods"].values())
    assert merged["methods"]["mars@0.9"]["task"]["vs_baseline"]["flips"] == {"down": 2, "up": 0, "same": 3}
    assert "left out, not run in every chunk: ar" in proc.stdout
    # without the flag the same chunks are refused, naming the setting
    proc = subprocess.run([sys.executable, str(SCRIPT), "merge", str(pa), str(pb)], capture_output=True, text=True,
                          cwd=ROOT, check=False)
    assert proc.returncode == 2 and "settings.methods differs" in proc.stderr


def test_merge_recomputes_time_per_task(mod):
    # mars writes answers 3x as long as ar's at 2x its tokens/s: 2/3 of ar's speed per task;
    # strict answers as long as ar in 0.8 of its time.
    tok = {"ar": 4, "strict": 4, "mars@0.9": 12}
    per_record = {"ar": 1.0, "strict": 0.8, "mars@0.9": 1.5}

    def chunk(ids, scores):
        return report(ids, scores, tokens={m: [n] * len(ids) for m, n in tok.items()},
                      seconds={m: s * len(ids) for m, s in per_record.items()})

    merged = mod.merge([chunk(["a", "b", "c"], A_SCORES), chunk(["d", "e"], B_SCORES)])
    mars, strict, ar = (merged["methods"][n] for n in ("mars@0.9", "strict", "ar"))
    assert mars["seconds_per_record"] == pytest.approx(1.5) and mars["mean_completion_tokens"] == pytest.approx(12)
    assert mars["speedup_vs_ar"] == pytest.approx(2.0)
    assert mars["task_speedup_vs_ar"] == pytest.approx(2 / 3) and mars["length_ratio_vs_ar"] == pytest.approx(3.0)
    assert mars["task_speedup_vs_strict"] == pytest.approx(0.8 / 1.5)
    assert mars["length_ratio_vs_strict"] == pytest.approx(3.0)
    assert strict["task_speedup_vs_ar"] == pytest.approx(1.25) and ar["task_speedup_vs_ar"] == pytest.approx(1.0)
    assert mars["task_speedup_vs_hf_generate"] is None  # no hf-generate in the chunks
    # the task section: against its baseline (strict)
    assert mars["task"]["seconds_per_record"] == pytest.approx(1.5)
    assert mars["task"]["task_speedup_vs_baseline"] == pytest.approx(0.8 / 1.5)
    assert strict["task"]["task_speedup_vs_baseline"] == pytest.approx(1.0)
    md = mod.markdown(merged)
    assert "| s/record | task x ar |" in md
    assert "| mars@0.9 | 8.00 | 2.00 | 1.50 | 0.67 |" in md
    # --quality-only: no time, the length ratio stays
    q = mod.merge([chunk(["a", "b", "c"], A_SCORES), chunk(["d", "e"], B_SCORES)], quality_only=True)
    qm = q["methods"]["mars@0.9"]
    assert qm["seconds_per_record"] is None and qm["task_speedup_vs_ar"] is None
    assert qm["task"]["task_speedup_vs_baseline"] is None and qm["length_ratio_vs_ar"] == pytest.approx(3.0)
