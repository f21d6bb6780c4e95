"""Measuring helpers of the bench job: target forward counts and times, peak memory, and
quiet transformers calls. Only generation is timed; these never change what is generated."""

from __future__ import annotations

import contextlib
import sys
import time
import warnings
from collections.abc import Iterator
from typing import Any

from marscli.bench import metrics
from marscli.bench.methods import FORWARD_TIMING_REPEATS, MIB
from marscli.models.kvcache import cache_kw, new_cache, rollback


class ForwardCounter:
    """Counts calls of the target's forward (generate(), assisted or not, calls it per step)."""

    def __init__(self, model):
        self.count = 0
        self._handle = model.register_forward_pre_hook(self._hook)

    def _hook(self, *_: Any) -> None:
        self.count += 1

    def remove(self) -> None:
        self._handle.remove()


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers 5 warns about generation flags on every call; bench sets them on purpose."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(level)


def forward_times(model, device, ids: list[int], max_n: int) -> list[float]:
    """Median seconds of one forward pass over n = 1..max_n new tokens after `ids` (cached)."""
    import torch

    cuda = device.type == "cuda"
    times: list[list[float]] = [[] for _ in range(max_n)]
    with torch.inference_mode():
        cache = new_cache(model)
        model(input_ids=torch.tensor([ids[:-1] or ids], device=device), **cache_kw(model, cache),
              use_cache=True, logits_to_keep=1)
        base = cache.get_seq_length()
        filler = (ids * (max_n // max(len(ids), 1) + 1))[:max_n]  # any tokens: only time matters
        for rep in range(FORWARD_TIMING_REPEATS + 1):  # the first round warms up
            for n in range(1, max_n + 1):
                x = torch.tensor([filler[:n]], dtype=torch.long, device=device)  # [1, n]
                if cuda:  # pragma: no cover - needs a GPU
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                model(input_ids=x, **cache_kw(model, cache), use_cache=True)
                if cuda:  # pragma: no cover
                    torch.cuda.synchronize()
                if rep:
                    times[n - 1].append(time.perf_counter() - t0)
                rollback(cache, base)
    return [metrics.median(t) for t in times]


def peak_rss_mib() -> float | None:
    try:
        import resource
    except ImportError:  # pragma: no cover - Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / MIB if sys.platform == "darwin" else peak / 1024  # bytes on macOS, KiB on Linux
