"""Wall time of `marscli generate` in one process against N launched processes, same output.

    python scripts/time_dataparallel.py prompts.jsonl --target ./model --processes 2 \
        --repeat 2 -- --max-tokens 64 --no-timing

Runs, alternating so that a change in machine load hits both alike: one process with
OMP_NUM_THREADS = the CPU count (torch's default on this machine), one process with
OMP_NUM_THREADS=1, and `accelerate launch --multi_gpu --num_processes N` (1 thread each, as
torchrun sets). Every run writes -o to a temp folder; the script checks all outputs are the same
bytes and prints one line per run and the medians. Times include process start-up and model
loading, which is what a user waits for.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("input")
    ap.add_argument("--target", required=True)
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=2)
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    a = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    cpus = os.cpu_count() or 1
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    common = ["generate", a.input, "--target", a.target, "-q", *extra]
    n = a.processes
    modes = {
        f"1 process, {cpus} threads": (["-m", "marscli"], {"OMP_NUM_THREADS": str(cpus)}),
        "1 process, 1 thread": (["-m", "marscli"], {"OMP_NUM_THREADS": "1"}),
        f"{n} processes, 1 thread each": (
            ["-m", "accelerate.commands.accelerate_cli", "launch", "--multi_gpu", "--num_processes", str(n),
             "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
             "--main_process_port", "{port}", "-m", "marscli"], {"OMP_NUM_THREADS": "1"}),
    }
    times: dict[str, list[float]] = {m: [] for m in modes}
    outputs: set[bytes] = set()
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(a.repeat):
            for mode, (prefix, extra_env) in modes.items():
                out = Path(tmp) / f"out-{rep}-{len(times[mode])}-{abs(hash(mode))}.jsonl"
                cmd = [sys.executable, *[p.replace("{port}", str(free_port())) for p in prefix],
                       *common, "-o", str(out)]
                t0 = time.perf_counter()
                r = subprocess.run(cmd, env={**env, **extra_env}, capture_output=True)
                dt = time.perf_counter() - t0
                if not out.exists() or out.stat().st_size == 0:
                    print(r.stderr.decode()[-2000:], file=sys.stderr)
                    return 1
                outputs.add(out.read_bytes())
                times[mode].append(dt)
                print(f"run {rep + 1}: {mode:<28} {dt:7.2f} s  (exit {r.returncode})", flush=True)
    print(f"outputs identical: {len(outputs) == 1}")
    for mode, ts in times.items():
        print(f"median {mode:<28} {statistics.median(ts):7.2f} s")
    return 0 if len(outputs) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
