"""The captured step: a slot cache's forwards at bucketed shapes on buffers that outlive them.

CapturedShapes keeps the shapes of a static computation, each with its own buffers: on CUDA
each is warmed up on a side stream, captured once as a CUDA graph and replayed; with
``compiled`` (``--compile on`` on a CPU) each is compiled once by torch.compile; otherwise it
runs eagerly in the same buffers, so a CPU's tests meet what a GPU's replays do. StaticSteps
is a model's steps over a marscli.models.slots.SlotCache (docs/engine.md "The captured
step"); marscli.drafters.eagle3_slots.HeadSlots is an EAGLE-3 head's passes.
"""

from __future__ import annotations

import torch

from marscli.models.kvcache import cache_kw
from marscli.models.slots import (
    MAX_GRAPHS,
    ROW_BUCKETS,
    SPLIT_HEAD,
    TOKEN_BUCKETS,
    SlotCache,
    attention_mask,
    bucket_of,
    span_bucket,
    visible,
    write_positions,
)


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
        import time

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
        import sys

        what = self.captured_what
        self._stop_capturing()
        self.capture_error = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        self.clear()
        sys.stderr.write(f"marscli: {what} failed ({self.capture_error}); "
                         "this run's steps run eagerly (--compile off skips it)\n")


class StaticSteps(CapturedShapes):
    """A SlotCache's forwards at fixed shapes: rows padded up to a ROW_BUCKETS size, new
    tokens per row to a TOKEN_BUCKETS size, the attended span to the cache's bucket. Each shape
    has input buffers (ids, position ids, write positions, mask) that outlive the forward; on
    CUDA with graphs the forward is captured once per shape (torch.cuda.CUDAGraph: the eager
    kernels, replayed without Python or launches) and replayed after the inputs are copied in.

    Padding rows are free slots past the batch's rows (there are always enough: the cache
    keeps a ROW_BUCKETS number of slots); their tokens are the pad id, at position 0, seeing
    position 0 only. Padding tokens of a real row are written past its length and seen by no
    real token. So every real row's logits are what the eager step gives it.
    """

    def __init__(self, cache: SlotCache):
        super().__init__()
        self.cache = cache
        self.compiled_forward = None  # torch.compile of _forward (compiled caches), made once
        model = cache.model
        self.head = model.get_output_embeddings() if type(model).__name__ in SPLIT_HEAD else None
        self.split = self.head is not None and hasattr(model, "get_decoder")
        #: What a step runs (the decoder alone with a split head) and the keyword that takes
        #: the cache, read once (outside what a compiled step traces).
        self.model = model.get_decoder() if self.split else model
        self.cache_keyword = next(iter(cache_kw(self.model, None)))
        #: The probe's replay check (_check_replay): off in a run.
        self.check_replays = False
        self.replay_delta: float | None = None
        self.replays_checked = 0

    @property
    def graphs(self) -> bool:
        return self.cache.graphs

    @property
    def captured_what(self) -> str:
        return "compiling a step (torch.compile)" if self.cache.compiled else "capturing a step as a CUDA graph"

    def _stop_capturing(self) -> None:
        self.cache.graphs = self.cache.compiled = False
        self.compiled_forward = None

    def _inputs(self, Bb: int, Sb: int, L: int, device) -> dict:
        return {
            "ids": torch.full((Bb, Sb), self.cache.pad_id, dtype=torch.long, device=device),
            "pos": torch.zeros(Bb, Sb, dtype=torch.long, device=device),
            "at": torch.zeros(Bb, 1, Sb, 1, dtype=torch.long, device=device),
            "mask": attention_mask(self.cache.model, torch.zeros(Bb, 1, Sb, L, dtype=torch.bool, device=device)),
        }

    def _forward(self, st: dict, L: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The shape's forward on its buffers: (hidden states [Bb, Sb, H] (split head) or
        logits [Bb, Sb, V]; the tap's features [Bb, Sb, F] or None)."""
        c = self.cache
        c.write_index = st["at"]
        c.span = L
        model = self.model
        run = lambda: model(input_ids=st["ids"], attention_mask=st["mask"], position_ids=st["pos"],  # noqa: E731
                            **{self.cache_keyword: c.cache}, use_cache=True)
        features = None
        if c.tap is not None:
            with c.tap.capture():
                out = run()
            features = c.tap.features
        else:
            out = run()
        return (out.last_hidden_state if self.split else out.logits), features

    def _logits(self, out: tuple[torch.Tensor, torch.Tensor | None], B: int, S: int,
                replayed: bool = False) -> StepOutput:
        """The real rows' logits and features. A replayed graph's outputs are its own memory,
        which the next replay overwrites: they are copied (features outlive the step in a
        drafter's pending list; the split head's logits are a new tensor anyway)."""
        hidden, features = out
        hidden = hidden[:B, :S]
        logits = self.head(hidden) if self.split else (hidden.clone() if replayed else hidden)
        if features is not None:
            features = features[:B, :S].clone() if replayed else features[:B, :S]
        return StepOutput(logits, features)

    def run(self, ids: torch.Tensor, pos: torch.Tensor, block: torch.Tensor | None = None) -> StepOutput:
        """One step (block: a tree's ancestor mask, see SlotCache.forward) at its shape."""
        c = self.cache
        B, S = ids.shape
        Bb, Sb = bucket_of(B, ROW_BUCKETS), bucket_of(S, TOKEN_BUCKETS)
        need = max(c.lengths, default=0) + Sb
        c._room(Bb, need)  # may drop every captured shape: the buffers changed
        L = min(c.capacity, span_bucket(need, c.bucket))
        st, fresh = self._shape((Bb, Sb, L), lambda: self._inputs(Bb, Sb, L, ids.device))
        # This step's inputs into the shape's buffers: rows past B and tokens past S are padding.
        at = write_positions(c.lengths + [0] * (Bb - B), Sb, ids.device)
        real = torch.arange(Bb, device=ids.device)[:, None] < B  # [Bb, 1]
        at = torch.where(real, at, torch.zeros_like(at))
        st["ids"].fill_(c.pad_id)
        st["ids"][:B, :S] = ids
        st["pos"].copy_(at)
        st["pos"][:B, :S] = pos
        st["at"].copy_(at[:, None, :, None])
        if block is not None:  # padding tokens see as a chain's would; real ones never see them
            full = torch.ones(Sb, Sb, dtype=torch.bool, device=ids.device).tril().repeat(Bb, 1, 1)
            full[:B, :S, :S] = block
            block = full
        st["mask"].copy_(attention_mask(c.model, visible(at, L, block)))
        if c.compiled:
            return self._logits(self._compiled(st, L, fresh), B, S)
        out = self._replay(st, lambda st: self._forward(st, L), "out")
        if self.check_replays and "graph" in st:
            self._check_replay(st, L, out)
        return self._logits(out, B, S, replayed=True)

    def _check_replay(self, st: dict, L: int, out: tuple) -> None:
        """The probe's check (check_replays, scripts/gpu_check.py): the shape's forward run
        eagerly on the same buffers right after its replay (it writes the same keys and values
        at the same positions), the largest |difference| of the outputs kept in replay_delta."""
        replayed = out[0].float().clone()
        eager = self._forward(st, L)[0].float()
        delta = float((replayed - eager).abs().max())
        self.replay_delta = max(self.replay_delta or 0.0, delta)
        self.replays_checked += 1

    def _compiled(self, st: dict, L: int, fresh: bool):
        """The shape's forward compiled by torch.compile (inductor; one compilation per shape,
        kept by dynamo's cache for the run), or eagerly if compiling fails (give_up)."""
        import time

        if self.compiled_forward is None:
            import torch._dynamo

            config = torch._dynamo.config
            for name in ("recompile_limit", "cache_size_limit"):  # a compilation per shape
                if hasattr(config, name):
                    setattr(config, name, max(getattr(config, name), MAX_GRAPHS))
            self.compiled_forward = torch.compile(self._forward, dynamic=False)
        t0 = time.perf_counter()
        try:
            out = self.compiled_forward(st, L)
        except Exception as e:  # noqa: BLE001 - a forward that cannot be compiled still runs
            if not fresh:
                raise
            self.give_up(e)
            return self._forward(st, L)
        if fresh:
            self.captures += 1
            self.capture_seconds += time.perf_counter() - t0
        return out
