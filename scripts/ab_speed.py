"""ab.py speed: same-run A/B of generation speed for two trees (see ab.py's docstring)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ab_inputs import build_records, say, write_jsonl

# ---------------------------------------------------------------------------------- speed

DONE = re.compile(r"done: .*?(\d+) tokens, ([0-9.]+) tok/s")


def git_head(tree: Path) -> str:
    p = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return (p.stdout.strip() or "?") + (" (dirty)" if dirty else "")


def loadavg() -> str:
    try:
        return f"{os.getloadavg()[0]:.2f}"
    except OSError:
        return "?"


def run_once(tree: Path, work: Path, env: dict, input_path: Path, bs: int, verify: str,
             max_tokens: int, tag: str, extra: list[str] = ()) -> dict:
    out = work / f"{tag}.jsonl"
    out.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "marscli", "generate", str(input_path), "--batch-size", str(bs),
            "--max-tokens", str(max_tokens), "-o", str(out), *extra]
    rule, _, temperature = verify.partition("@")
    if rule == "strict":
        argv += ["--verify", "strict"]
    elif rule == "ar":  # plain decoding: no drafter
        argv += ["--verify", "strict", "--draft", "none"]
    elif rule != "mars":  # mars: no --verify, the shipped profile's theta
        raise SystemExit(f"--verify takes ar, strict and mars (each optionally @TEMPERATURE), not {verify!r}")
    if temperature:
        argv += ["--temperature", temperature, "--seed", "0"]
    t0 = time.perf_counter()
    p = subprocess.run(argv, env=dict(env, PYTHONPATH=str(tree)), cwd=work, stdin=subprocess.DEVNULL,
                       capture_output=True, text=True)
    wall = time.perf_counter() - t0
    (work / f"{tag}.stderr").write_text(p.stderr, encoding="utf-8")
    res = {"rc": p.returncode, "wall": wall, "tps": None, "source": "", "digest": None, "tokens": None}
    if p.returncode != 0 or not out.exists():
        say(f"    FAILED (exit {p.returncode}): {p.stderr.strip().splitlines()[-1:]}")
        return res
    recs = [json.loads(x) for x in out.read_text(encoding="utf-8").splitlines()]
    tokens = sum((r.get("usage") or {}).get("completion_tokens", 0) for r in recs)
    gen_seconds = sum((r.get("timing") or {}).get("seconds") or 0.0 for r in recs)
    for r in recs:
        r.pop("timing", None)
    res["digest"] = hashlib.sha256(
        "\n".join(json.dumps(r, sort_keys=True) for r in recs).encode()).hexdigest()
    res["tokens"] = tokens
    m = None
    for line in p.stderr.splitlines():
        m = DONE.search(line.rsplit("\r", 1)[-1]) or m
    if m and int(m.group(1)) != tokens:
        say(f"    note: the summary says {m.group(1)} tokens, the results {tokens}")
    if bs == 1 and gen_seconds > 0:
        # The summary's own definition (tokens over the sum of the records' generation
        # times), from the 4-decimal per-record seconds instead of its 1-decimal tok/s.
        res["tps"] = tokens / gen_seconds
    elif m:
        res["tps"] = float(m.group(2))
    else:
        res["tps"], res["source"] = tokens / wall, "*"
    return res


def fmt_ratio(x: float) -> str:
    return f"{x:.3f}"


def cmd_speed(args) -> int:
    extra = args.args.split()

    trees = {"A": Path(args.a).resolve(), "B": Path(args.b).resolve()}
    work = Path(args.work).resolve() if args.work else Path(tempfile.mkdtemp(prefix="ab-speed-"))
    work.mkdir(parents=True, exist_ok=True)
    (work / "user-profiles").mkdir(exist_ok=True)
    env = dict(os.environ, MARSCLI_PROFILE_DIR=str(work / "user-profiles"))
    if args.threads:
        env.update(OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    for _name, tree in trees.items():
        probe = subprocess.run([sys.executable, "-c", "import marscli; print(marscli.__file__)"],
                               env=dict(env, PYTHONPATH=str(tree)), capture_output=True, text=True, cwd=work)
        if not Path(probe.stdout.strip() or "/").resolve().is_relative_to(tree):
            raise SystemExit(f"PYTHONPATH={tree} imports marscli from {probe.stdout.strip() or probe.stderr}")
    input_path = work / "input.jsonl"
    if args.input:
        lines = Path(args.input).read_text(encoding="utf-8").splitlines()[: args.records]
        input_path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    else:
        write_jsonl(input_path, build_records(args.records))
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    verifies = [x.strip() for x in args.verify.split(",")]

    load_before = loadavg()
    if load_before != "?" and float(load_before) > 0.5:
        say(f"warning: load average {load_before}: this machine is not idle, the figures will be noisy")
    say(f"work folder {work}")
    for w in range(args.warmup):
        for side in ("A", "B"):
            say(f"[warmup {w + 1}/{args.warmup}] {side} ({trees[side]}), not counted")
            run_once(trees[side], work, env, input_path, sizes[0], verifies[0], args.max_tokens,
                     f"warmup-{side}-{w + 1}", extra)
    rows, failed = [], 0
    n_cases = len(sizes) * len(verifies)
    for ci, (bs, verify) in enumerate(((b, v) for b in sizes for v in verifies), 1):
        runs: dict[str, list[dict]] = {"A": [], "B": []}
        for rep in range(args.repeats):
            order = ("A", "B") if rep % 2 == 0 else ("B", "A")
            for side in order:
                say(f"[case {ci}/{n_cases}] batch {bs} {verify}, run {rep + 1}/{args.repeats} of {side} "
                    f"({trees[side]}), load {loadavg()}")
                r = run_once(trees[side], work, env, input_path, bs, verify, args.max_tokens,
                             f"{side}-bs{bs}-{verify}-{rep + 1}", extra)
                failed += r["rc"] != 0
                if r["tps"] is not None:
                    say(f"    {r['tps']:.2f} tok/s{r['source']}, {r['tokens']} tokens, {r['wall']:.1f} s wall")
                runs[side].append(r)
        ok = [(a, b) for a, b in zip(runs["A"], runs["B"]) if a["tps"] and b["tps"]]
        if not ok:
            rows.append(f"| {bs} | {verify} | failed | failed | | | | | |")
            continue
        ratios = [b["tps"] / a["tps"] for a, b in ok]
        med = {s: statistics.median(r["tps"] for r in runs[s] if r["tps"]) for s in runs}
        wall = {s: statistics.median(r["wall"] for r in runs[s]) for s in runs}
        mark = {s: "*" if any(r["source"] for r in runs[s]) else "" for s in runs}
        digests = {s: {r["digest"] for r in runs[s] if r["digest"]} for s in runs}
        same = len(digests["A"] | digests["B"]) == 1 and all(r["digest"] for s in runs for r in runs[s])
        ident = "yes" if same else f"NO ({len(digests['A'])} distinct in A, {len(digests['B'])} in B)"
        rows.append(f"| {bs} | {verify} | {med['A']:.1f}{mark['A']} | {med['B']:.1f}{mark['B']} | "
                    f"{fmt_ratio(statistics.median(ratios))} | {fmt_ratio(min(ratios))}-{fmt_ratio(max(ratios))} | "
                    f"{wall['A']:.1f} | {wall['B']:.1f} | {ident} |")

    print(f"- A: {trees['A']} @ {git_head(trees['A'])}")
    print(f"- B: {trees['B']} @ {git_head(trees['B'])}")
    print(f"- {args.records} records of {args.input or 'the built mix'}, --max-tokens {args.max_tokens}"
          f"{' ' + args.args if args.args else ''}, {args.repeats} runs per tree and case "
          f"(ABBA order, {args.warmup} untimed warm-up per tree); {os.cpu_count()} CPUs, "
          f"threads per run: {args.threads or 'torch default'}; "
          f"load average {load_before} before, {loadavg()} after")
    print("- tok/s: marscli's own figure (generation only); B/A: median of per-pair ratios; "
          "wall: whole process, model load included")
    print()
    print("| batch | verify | A tok/s | B tok/s | B/A | B/A min-max | A wall s | B wall s | outputs identical |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        print(row)
    if any("*" in row for row in rows):
        print("\n\\* no summary line: tok/s from the records' timing (batch 1) or the process wall time")
    return 1 if failed else 0
