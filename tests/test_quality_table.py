"""scripts/report.py quality: arms of a quality run scored and compared with the baseline on
the records every arm has, with each arm's decoding figures and its wall time per record."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "report.py"
PROMPTS = ROOT / "examples" / "gsm8k.jsonl"
ANSWERS = [18, 3, 70000, 540, 20, 64, 260, 160]  # examples/gsm8k.jsonl's references, in order


def write_arm(d: Path, arm: str, answers: dict[int, int], *, tokens: int, steps: int, relaxed: int,
              truncated=(), log: str = "") -> None:
    with open(d / f"{arm}.jsonl", "w", encoding="utf-8") as f:
        for qid, ans in answers.items():
            f.write(json.dumps({
                "question_id": qid, "output": f"Step by step.\n#### {ans}",
                "finish_reason": "length" if qid in truncated else "stop",
                "usage": {"prompt_tokens": 50, "completion_tokens": tokens},
                "spec": {"steps": steps, "relaxed": relaxed, "accepted": 0, "drafted": 0}}) + "\n")
        f.write(json.dumps({"question_id": 99, "output": None, "error": {"type": "x", "message": "y"}}) + "\n")
    (d / f"{arm}.log").write_text(log)


def test_arms_are_compared_on_their_common_records(tmp_path):
    right = dict(enumerate(ANSWERS))
    loaded = "marscli: loaded target on cpu in 1.0 s\n"
    # stopped for 20 s while the machine did something else (SIGSTOP): not its time
    write_arm(tmp_path, "strict", right, tokens=10, steps=5, relaxed=0, truncated={3},
              log=loaded + "paused seconds: 20\n" + "wall seconds: 100, exit code: 0\n")
    mars = {**right, 2: 1, 5: 1}  # two answers lost
    # two runs started, one killed before its wall line: no time per record
    write_arm(tmp_path, "mars", mars, tokens=8, steps=2, relaxed=1,
              log=loaded + "wall seconds: 30, exit code: 0\n" + loaded)
    ratio = {k: v for k, v in right.items() if k != 7}  # still running: record 7 not written yet
    ratio[1] = 4  # one lost
    write_arm(tmp_path, "ratio", ratio, tokens=10, steps=4, relaxed=2, log=loaded + "wall seconds: 70, exit code: 0\n")
    out = subprocess.run([sys.executable, str(SCRIPT), "quality", str(tmp_path), "--task", "gsm8k",
                          "--prompts", str(PROMPTS), "--arms", "strict,mars,mars-code,ratio"],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    table = json.loads((tmp_path / "table.json").read_text())
    assert table["records"] == 7  # record 7 is missing from ratio; error lines never count
    rows = {r["arm"]: r for r in table["arms"]}
    assert list(rows) == ["strict", "mars", "ratio"]  # no mars-code.jsonl: left out
    s, m, r = rows["strict"], rows["mars"], rows["ratio"]
    assert all(row["n"] == 7 for row in rows.values())
    assert s["score"] == 1.0 and s["paired"] is None
    assert s["truncated"] == 1 and s["tokens_per_step"] == 2.0 and s["relaxed_per_token"] == 0.0
    assert s["seconds_per_record"] == 10.0  # 100 - 20 s over the 8 records written
    assert abs(m["score"] - 5 / 7) < 1e-5
    assert m["paired"]["flips"] == {"down": 2, "up": 0, "same": 5}
    assert abs(m["paired"]["diff"] + 2 / 7) < 1e-5 and m["paired"]["diff_ci95"][0] < 0
    assert abs(m["paired"]["length_ratio"] - 0.8) < 1e-5
    assert m["tokens_per_step"] == 4.0 and m["relaxed_per_token"] == 1 / 8
    assert m["seconds_per_record"] is None and m["runs_started"] == 2 and m["runs_finished"] == 1
    assert r["paired"]["flips"]["down"] == 1 and r["seconds_per_record"] == 10.0  # 70 s / 7 records
    lines = out.stdout.splitlines()
    assert lines[0].startswith("| arm | n | gsm8k score")
    assert len(lines) == 5 and "(wall incomplete)" in lines[3] and "| 2 / 0 |" in lines[3]
    scored = [json.loads(x) for x in (tmp_path / "mars.scored.jsonl").read_text().splitlines()]
    assert [x["score"] for x in scored] == [1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0]
