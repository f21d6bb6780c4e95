"""Captured shapes: a static computation's shapes, each with buffers that outlive it, run
eagerly on them or (CUDA) captured once as a CUDA graph and replayed.

`CapturedShapes` keeps the shapes (at most MAX_GRAPHS, the least recently used dropped),
captures each once on a side stream with host syncs made errors, ends a failed capture cleanly
and gives up to eager steps, said once. Two computations build on it: the slot cache's steps
(marscli.models.slots.StaticSteps) and an EAGLE-3 head's passes
(marscli.drafters.eagle3_slots.HeadSlots).
"""

from __future__ import annotations

import sys
import time

import torch

#: At most this many captured graphs are kept (the least recently used goes).
MAX_GRAPHS = 64


def keep_outputs(st: dict, name: str, out):
    """Copy a static step's outputs (a tensor, or a tuple of tensors and Nones) into the
    shape's own buffers st[name] and return those: an eager static step then hands out memory
    that the shape's next step overwrites, as a replayed CUDA graph's outputs are, so a CPU's
    tests meet what a GPU's replays do (an output kept past the next step must be copied)."""
    if name not in st:
        st[name] = out.clone() if isinstance(out, torch.Tensor) else tuple(
            None if t is None else t.clone() for t in out)
    elif isinstance(out, torch.Tensor):
        st[name].copy_(out)
    else:
        for dst, src in zip(st[name], out):
            if src is not None:
                dst.copy_(src)
    return st[name]


class StepOutput:
    """What a static step returns: the logits of the real rows and tokens, and their target
    features when the cache has a tap ([B, S, F]; else None)."""

    def __init__(self, logits: torch.Tensor, features: torch.Tensor | None = None):
        self.logits = logits
        self.features = features


class CapturedShapes:
    """Shapes of a static computation, each with buffers (a dict per shape) that outlive it:
    at most MAX_GRAPHS kept, the least recently used dropped; on CUDA (`graphs`) each is
    warmed up once on a side stream and captured once as a torch.cuda.CUDAGraph (one memory
    pool for all), then replayed. A capture that fails is said once on stderr and the shapes
    run eagerly from then on (give_up). StaticSteps (a model's steps over a slot cache) and
    marscli.drafters.eagle3_slots.HeadSlots (an EAGLE-3 head's passes) are two."""

    #: What give_up says failed (the subclass's words).
    captured_what = "capturing a step as a CUDA graph"

    def __init__(self):
        self.shapes: dict[tuple, dict] = {}
        self.captures = 0  # shapes captured as graphs or compiled (for reports and tests)
        self.built = 0  # shapes built (their buffers made; captured or compiled where they are)
        self.capture_error: str | None = None  # why capturing failed (then steps run eagerly)
        self.capture_seconds = 0.0  # spent capturing or compiling (the first step of a shape)
        self.pool = None

    graphs = False  # capture and replay (a subclass's attribute or property)

    def clear(self) -> None:
        self.shapes.clear()
        self.pool = None

    def _shape(self, key, make) -> tuple[dict, bool]:
        """Shape `key`'s buffers (made by make() the first time: then fresh is True), now the
        most recently used: (st, fresh)."""
        st = self.shapes.pop(key, None)
        fresh = st is None
        if fresh:
            st = make()
            self.built += 1
        self._keep(key, st)
        return st, fresh

    def _keep(self, key, st: dict) -> None:
        """st is shape `key`'s, the most recently used."""
        self.shapes[key] = st
        while len(self.shapes) > MAX_GRAPHS:
            self.shapes.pop(next(iter(self.shapes)))

    def _replay(self, st: dict, run, name: str):
        """run(st), the shape's computation on its buffers, with its outputs in st[name]:
        eagerly (keep_outputs: as a replay would, in the shape's own memory), or captured once
        as a CUDA graph and replayed; if capturing fails, give_up and run eagerly."""
        if not self.graphs:
            return keep_outputs(st, name, run(st))
        if "graph" not in st:
            t0 = time.perf_counter()
            dev = st["at"].device
            try:
                graph = self._capture(st, run, name, dev)
            except Exception as e:  # noqa: BLE001 - a computation that cannot be captured still runs
                self.give_up(e)
                return run(st)
            self.pool = graph.pool()
            st["graph"] = graph
            self.captures += 1
            self.capture_seconds += time.perf_counter() - t0
            # the capture itself ran nothing: replay it for this step
        st["graph"].replay()
        return st[name]

    def _capture(self, st: dict, run, name: str, dev) -> torch.cuda.CUDAGraph:
        """Warm the shape up on a side stream with host syncs made errors (a computation that
        asks the host anything fails here, before any capture starts), then capture it. A
        capture that fails ends cleanly: capture_end runs whatever the body raised (so the
        allocator knows the capture is over), the thread leaves the capture stream (the
        stream context restores it), and the body's own error is the one raised, not
        capture_end's."""
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        debug = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            with torch.cuda.stream(side):
                run(st)
        finally:
            torch.cuda.set_sync_debug_mode(debug)
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        error: Exception | None = None
        with torch.cuda.stream(torch.cuda.Stream(dev)):
            graph.capture_begin(pool=self.pool)
            try:
                st[name] = run(st)
            except Exception as e:  # noqa: BLE001 - raised below, after the capture is ended
                error = e
            finally:
                try:
                    graph.capture_end()
                except Exception as e:  # noqa: BLE001 - the body's error, if any, is the cause
                    error = error or e
        if error is not None:
            torch.cuda.synchronize(dev)
            raise error
        return graph

    def _stop_capturing(self) -> None:
        """From now on everything runs eagerly (at the same shapes)."""
        self.graphs = False

    def give_up(self, error: Exception) -> None:
        """A capture (or compilation) failed: the shapes run eagerly from now on, said once on
        stderr; the records go on."""
        what = self.captured_what
        self._stop_capturing()
        self.capture_error = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        self.clear()
        sys.stderr.write(f"marscli: {what} failed ({self.capture_error}); "
                         "this run's steps run eagerly (--compile off skips it)\n")
