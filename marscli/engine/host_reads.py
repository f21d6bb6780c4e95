"""Counting host reads of tensors: what would be a device-to-host transfer on a GPU.

On a CUDA device every ``.item()``, ``int(t)``, ``bool(t)``, ``float(t)``, ``.tolist()``,
``.cpu()`` or ``.numpy()`` of a device tensor copies to the host and waits for the stream:
a synchronisation. On a CPU the same calls cost nothing, so a CPU test cannot time them, but
it can count them. :func:`count_host_reads` patches those entry points on ``torch.Tensor``
for the length of a ``with`` block and counts each call (wherever it is made: marscli's
engine, its drafters, or the model's forward), so a test and ``scripts/gpu_check.py`` can
state the transfers per engine step on any machine.

A read made inside a read (``tolist`` calling ``item``) counts once, and so does a
``.cpu()`` followed by reads of the copy it returned (the copy is marked). Tensors that were
made on the host on purpose (a list turned into a tensor and read back) count too: on a CPU
the counter cannot tell them apart, so it over-counts rather than under-counts.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Iterator

import torch

#: The torch.Tensor methods that read a tensor's values on the host (nonzero: its size). Other
#: data-dependent shapes (torch.nonzero, boolean-mask indexing) also sync a GPU and are not
#: counted here: on a GPU, torch.cuda.set_sync_debug_mode("warn") finds them.
READS = ("item", "tolist", "cpu", "numpy", "__int__", "__bool__", "__float__", "__index__", "nonzero")

_lock = threading.Lock()
#: The mark of a tensor that a counted .cpu() returned: its own reads are host reads already.
ON_HOST = "_marscli_on_host"


class HostReads:
    """What a :func:`count_host_reads` block counted: ``total`` and ``by_kind`` (per method)."""

    def __init__(self) -> None:
        self.by_kind: Counter[str] = Counter()
        self._depth = 0

    @property
    def total(self) -> int:
        return sum(self.by_kind.values())

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Reads inside the block are not counted (as reads inside a read are not)."""
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1


@contextlib.contextmanager
def count_host_reads() -> Iterator[HostReads]:
    """Count the host reads of tensors made inside the block (one at a time: the patches are
    process-wide, so a second block waits for the first)."""
    counts = HostReads()
    with _lock:
        saved = {name: torch.Tensor.__dict__.get(name) for name in READS}
        originals = {name: getattr(torch.Tensor, name) for name in READS}

        def wrap(name: str):
            orig = originals[name]

            def read(self, *args, **kwargs):
                if self.device.type == "meta" or counts._depth or getattr(self, ON_HOST, False):
                    return orig(self, *args, **kwargs)
                counts.by_kind[name.strip("_")] += 1
                counts._depth += 1
                try:
                    out = orig(self, *args, **kwargs)
                finally:
                    counts._depth -= 1
                if name == "cpu":  # reading the copy later transfers nothing more
                    with contextlib.suppress(AttributeError, RuntimeError):
                        setattr(out, ON_HOST, True)
                return out

            read.__name__ = name
            return read

        try:
            for name in READS:
                setattr(torch.Tensor, name, wrap(name))
            yield counts
        finally:
            for name, value in saved.items():
                if value is None:
                    delattr(torch.Tensor, name)
                else:
                    setattr(torch.Tensor, name, value)
