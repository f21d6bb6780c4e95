"""Helpers shared by test modules of several folders that need no torch at import: hypothesis
strategies, synthetic calibration data and random verification steps, and `python -m marscli`
subprocesses on this checkout's code (fixtures are in conftest.py, oracles in oracles.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest
from hypothesis import strategies as st

if TYPE_CHECKING:
    from marscli.calibration.collect import MarginData

ROOT = Path(__file__).resolve().parents[1]

# --------------------------------------------------------------------------- JSON values


def json_values():
    keys = st.sampled_from([
        "id", "prompt", "messages", "role", "content", "max_tokens", "temperature", "top_p",
        "top_k", "seed", "stop", "custom_id", "method", "url", "body", "max_completion_tokens",
        "question_id", "turns", "/v1/chat/completions",
    ]) | st.text(max_size=8)
    scalars = (st.none() | st.booleans() | st.integers() | st.floats()
               | st.sampled_from(["user", "POST", "/v1/completions", "bot", "", " "])
               | st.text(max_size=12))
    return st.recursive(
        scalars,
        lambda children: st.lists(children, max_size=5)
        | st.dictionaries(keys, children, max_size=6),
        max_leaves=25,
    )


# --------------------------------------------------------------------------- calibration data

#: The vocabulary and draft length of _step's random verification steps.
STEP_V, STEP_K = 12, 5


def _step(gen, scale: float = 3.0):
    """Random logits [1, K+1, V] and drafts mixing top-1, top-2 and other tokens."""
    import torch

    V, K = STEP_V, STEP_K
    logits = torch.randn(1, K + 1, V, generator=gen) * scale + 1.0
    order = logits[0, :K].argsort(dim=-1, descending=True)  # [K, V]
    pick = torch.randint(0, 10, (K,), generator=gen)
    col = torch.where(pick < 5, 0, torch.where(pick < 8, 1, 2 + pick % 3))
    drafts = order[torch.arange(K), col].unsqueeze(0)  # [1, K]
    return drafts, logits


def synthetic(n_steps: int = 400, k: int = 4, seed: int = 0) -> MarginData:
    """Greedy-style data: rank 1 positions accepted strictly, rank 2 relaxable by statistic."""
    from marscli.calibration.collect import MarginData

    rng = np.random.default_rng(seed)
    P = n_steps * k
    rank = rng.choice([1, 2, 3], size=P, p=[0.5, 0.3, 0.2])
    stat = rng.uniform(0.5, 1.0, size=P)
    logp1 = np.log(rng.uniform(0.3, 0.9, size=P))
    logp2 = logp1 - rng.exponential(0.5, size=P)
    logpd = np.where(rank == 1, logp1, np.where(rank == 2, logp2, logp2 - 1.0))
    strict_ok = (rank == 1).astype(float)
    ok = strict_ok.reshape(n_steps, k)
    n = np.cumprod(ok, axis=1).sum(axis=1)
    return MarginData(
        step_k=np.full(n_steps, k), step_n=n.astype(np.int64), tokens=int(n.sum() + n_steps),
        records=10, failed_records=0, logit_ratio=stat, prob_ratio=stat ** 3, z1=np.full(P, 10.0),
        rank=rank.astype(float), logp1=logp1, logp2=logp2, logp_draft=logpd, strict_ok=strict_ok,
    )


# --------------------------------------------------------------------------- subprocesses


def _subprocess_env() -> dict[str, str]:
    env = dict(os.environ)  # carries the isolation fixture's HF offline and cache settings
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _start(args: list[str], **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "marscli", "generate", *args],
                            env=_subprocess_env(), stderr=subprocess.PIPE, **kw)


def _wait_for_lines(proc: subprocess.Popen, out: Path, n: int, timeout: float = 120.0) -> None:
    """Poll until `out` holds n complete lines or the process ended."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if out.read_bytes().count(b"\n") >= n:
                return
        except FileNotFoundError:
            pass
        time.sleep(0.005)
    if proc.poll() is None:
        proc.kill()
        pytest.fail(f"no {n} results in {timeout} s")
