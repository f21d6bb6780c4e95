#!/usr/bin/env python
"""Same-run A/B of generation speed for two source trees (e.g. the commit before a refactor,
checked out with `git worktree add`, and the refactor).

    git worktree add /tmp/before HEAD~1
    python scripts/ab_speed.py --a /tmp/before --b . --batch-sizes 1,8 --verify strict,mars \\
        --records 16 --max-tokens 64 --repeats 3 > ab.md

RUN IT ON AN IDLE MACHINE. Every figure is a rate over wall-clock time on a CPU: another
process (a test suite, a second A/B) takes cores from whichever run it overlaps, and the
ratio then measures the neighbour, not the code. The script prints the 1-minute load average
before and after; with a load much above 0 the table is not evidence of anything.

For each (batch size, verify) case it runs `python -m marscli generate` as a fresh
subprocess per run (PYTHONPATH=tree chooses the code; MARSCLI_PROFILE_DIR is an empty folder,
so "mars" is the shipped profile's theta), --repeats times per tree, on one input file built
as scripts/compare_outputs.py builds it (the first N/4 records of mt_bench, humaneval, gsm8k
and sum). Runs alternate between the trees in ABBA order (A B, B A, A B, ...) so that neither
tree always runs first, i.e. a slow drift of the machine's speed does not favour one side.
Pair i is the i-th run of A with the i-th run of B. Before measuring, --warmup untimed runs
per tree (default 1) fill the page cache and pay first-use costs: without them the very first
run of a session came out at 1.6 tok/s against 9.6 for the same tree right after it.

tokens/s is marscli's own figure: completion tokens over generation time, which leaves
model loading out. Batch 1: the sum of the records' timing.seconds, which is what the stderr
summary line ("done: ... T tokens, R tok/s") divides by, but with 4 decimals instead of R's
one. Batch N (records overlap): R from that summary line (the wall time of the decoding
loop); if a tree prints no such line, the process wall time (marked with *). The wall
seconds of the whole process (load included) are reported beside it.
--threads N sets OMP_NUM_THREADS/MKL_NUM_THREADS for the runs (default: torch's own choice,
the setting users get).

stdout: a markdown table: per case the median tok/s of A and B, B/A as the median of the
per-pair ratios with their min-max, median wall seconds, and whether every run of both trees
wrote the same results (timing fields removed). stderr: progress. Exit 1 if a run failed.
"""

from __future__ import annotations

import argparse
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_outputs import build_records, write_jsonl  # noqa: E402  (same input as the byte comparison)

DONE = re.compile(r"done: .*?(\d+) tokens, ([0-9.]+) tok/s")


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def git_head(tree: Path) -> str:
    p = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return (p.stdout.strip() or "?") + (" (dirty)" if dirty else "")


def load() -> str:
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", required=True, help="tree A (the old code)")
    ap.add_argument("--b", required=True, help="tree B (the new code)")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--verify", default="strict,mars",
                    help="ar (--draft none), strict and/or mars (the shipped profile); NAME@T samples at "
                         "temperature T (seed 0), e.g. strict@0.8")
    ap.add_argument("--records", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="runs per tree and case")
    ap.add_argument("--warmup", type=int, default=1,
                    help="untimed runs per tree before measuring (page cache, first-use costs)")
    ap.add_argument("--threads", type=int, default=0, help="OMP/MKL threads per run (0: torch's default)")
    ap.add_argument("--work", default=None, help="folder for inputs, outputs and logs (default: a temp dir)")
    ap.add_argument("--input", default=None,
                    help="a JSONL prompt file to use instead of the built mix (its first --records records)")
    ap.add_argument("--args", default="", help="more generate arguments, one string (e.g. '--target X --draft Y')")
    args = ap.parse_args(argv)
    extra = args.args.split()

    trees = {"A": Path(args.a).resolve(), "B": Path(args.b).resolve()}
    work = Path(args.work).resolve() if args.work else Path(tempfile.mkdtemp(prefix="ab_speed-"))
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

    load_before = load()
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
                    f"({trees[side]}), load {load()}")
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
          f"load average {load_before} before, {load()} after")
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


if __name__ == "__main__":
    sys.exit(main())
