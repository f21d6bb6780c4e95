"""ab.py's inputs: the prompt records both of its tools run, and its narration."""

from __future__ import annotations

import json
import sys
from pathlib import Path

# The full prompt sets: beside the repository on the developers' machine (--prompts-dir).
PROMPT_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "prompts"
PROMPT_SETS = ("mt_bench", "humaneval", "gsm8k", "sum")


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------- inputs

def build_records(n: int, prompt_dir: Path = PROMPT_DIR) -> list[dict]:
    """The first n/4 records of each prompt set (the remainder goes to the first sets), in the
    order of PROMPT_SETS, with question_id made unique as "<set>/<id>"."""
    per, extra = divmod(n, len(PROMPT_SETS))
    out = []
    for i, name in enumerate(PROMPT_SETS):
        take = per + (1 if i < extra else 0)
        with open(prompt_dir / f"{name}.jsonl", encoding="utf-8") as f:
            for line in f:
                if take == 0:
                    break
                if not line.strip():
                    continue
                rec = json.loads(line)
                rec["question_id"] = f"{name}/{rec['question_id']}"
                out.append(rec)
                take -= 1
    return out


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.write_bytes("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode())
