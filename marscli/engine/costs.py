"""Measured step costs: what one target forward over B rows of n new tokens takes, t(B, n).

The draft-length policy (marscli.drafters.base.choose_draft_lengths) weighs expected tokens
against these costs, so they are measured on the machine that decodes, with the model,
device, dtype, torch version and thread count that decode, not read from a table: on a CPU
a forward over 9 new tokens costs about 1.4 forwards over one at batch size 1 and much more
at batch size 16; on a GPU it is flat until the batch becomes compute bound.

Measuring takes a few seconds, once: the result goes to ``<cache>/costs/<key hash>.json``
with the key it was measured for (a changed key is another file; a file whose key or body
does not check out is measured again). ``$MARSCLI_COSTS`` picks the source:

- ``measure`` (the default): the cached measurement, measured now if there is none;
- ``remeasure``: measure now and replace the cached file;
- ``static``: a fixed synthetic curve (no timing at all: runs are reproducible anywhere);
- a path to a costs JSON file written earlier.

Every row follows these costs: a record's text is defined position by position from its own
text (marscli.verification.chain), so no measurement, batch or draft length enters it (the
reproducibility contract, docs/verification.md); the costs decide only how fast it comes.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from marscli.drafters.kinds import EAGLE3, MODEL, NGRAM
from marscli.models.fastpath import signature as fastpath_signature
from marscli.models.int8_decoder import SIGNATURE as INT8_DECODER
from marscli.models.kvcache import ContiguousCache, rollback
from marscli.models.quant import CPU_INT8
from marscli.models.slots import EAGER, SlotCache, StepPlan, supports
from marscli.models.sources import cache_root

COSTS_ENV = "MARSCLI_COSTS"
COSTS_MEASURE = "measure"
COSTS_REMEASURE = "remeasure"
COSTS_STATIC = "static"
COSTS_FORMAT = 3  # 2: batched rows timed over the slot cache; 3: batch size 1 too
#: Context length (tokens already cached per row) the forwards are timed at.
MEASURE_CONTEXT = 256
#: New tokens per row the forwards are timed at (others are interpolated).
MEASURE_NEW_TOKENS = (1, 2, 3, 5, 9)
MEASURE_REPEATS = 2
#: A CPU measurement during which other processes kept more than this share of the machine's
#: cores busy (/proc/stat's busy time less this process's own) was made on a busy machine:
#: its figures are a contended machine's, not the model's (a measurement taken beside another
#: job had t(1, 1) at 2.2x the idle figure and a flat curve at batch 1), so it serves the run
#: it was made for but is not cached: the next run measures again.
BUSY_OTHERS_SHARE = 0.25

Note = Callable[[str], None]


def _silent(_: str) -> None:
    pass


def monotone_grid(grid: tuple[tuple[float, ...], ...]) -> tuple[tuple[float, ...], ...]:
    """The measured grid [batch size][new tokens] made non-decreasing along both axes: each
    figure becomes the least of itself and every figure of a larger shape (more rows, more new
    tokens, or both). A forward over a larger shape does at least the work of a smaller one, and
    a timing errs upward only (the fastest of a few rounds, slowed by whatever else ran), so a
    figure above a larger shape's is an overstatement: t(32, 1) measured at 204 ms beside
    t(32, 2) at 163 ms made one drafted token look cheaper than none. Fitting it to the larger
    shape's figure keeps every comparison the policy makes (a longer draft never costs less)."""
    rows = [list(r) for r in grid]
    for r in rows:  # along new tokens, from the longest down
        for j in range(len(r) - 2, -1, -1):
            r[j] = min(r[j], r[j + 1])
    for i in range(len(rows) - 2, -1, -1):  # along batch sizes, from the largest down
        rows[i] = [min(a, b) for a, b in zip(rows[i], rows[i + 1])]
    return tuple(tuple(r) for r in rows)


def _interp(xs: tuple[int, ...], ys: list[float], x: float) -> float:
    """Piecewise linear through (xs, ys); linear beyond the ends from the nearest segment."""
    if len(xs) == 1:
        return ys[0] * max(x, 1) / xs[0]
    i = min(max(bisect.bisect_right(xs, x) - 1, 0), len(xs) - 2)
    x0, x1 = xs[i], xs[i + 1]
    return ys[i] + (ys[i + 1] - ys[i]) * (x - x0) / (x1 - x0)


@dataclass(frozen=True)
class StepCosts:
    """Seconds of one decoding step, from a grid of measured target forwards.

    target_s[i][j]: one target forward over batch_sizes[i] rows of new_tokens[j] new tokens
    each. draft_s[i]: one drafter pass (one draft position) over batch_sizes[i] rows (0 for
    prompt lookup, whose per-step host work is microseconds against milliseconds). Between
    grid points t is interpolated linearly (in n, then in B); beyond the largest batch it
    grows in proportion to B. target_s is what was measured (and what to_dict writes);
    target() and draft() read it made monotone (monotone_grid), which for a synthetic curve
    changes nothing.
    """

    batch_sizes: tuple[int, ...]
    new_tokens: tuple[int, ...]
    target_s: tuple[tuple[float, ...], ...]
    draft_s: tuple[float, ...]
    key: dict[str, Any] = field(default_factory=dict)
    source: str = COSTS_STATIC
    #: CPU measurements: the share of the machine's cores other processes kept busy while
    #: timing (BUSY_OTHERS_SHARE); None for static costs, device measurements and systems
    #: without /proc/stat.
    others_share: float | None = None
    _fit: tuple[tuple[float, ...], ...] = field(default=(), init=False, repr=False, compare=False)
    _draft_fit: tuple[float, ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.target_s) != len(self.batch_sizes) or any(len(r) != len(self.new_tokens) for r in self.target_s):
            raise ValueError("target_s must be [batch_sizes][new_tokens]")
        if len(self.draft_s) != len(self.batch_sizes):
            raise ValueError("draft_s must have one entry per batch size")
        if any(not (v > 0) for r in self.target_s for v in r):
            raise ValueError("every measured target cost must be positive")
        object.__setattr__(self, "_fit", monotone_grid(self.target_s))
        object.__setattr__(self, "_draft_fit", monotone_grid((self.draft_s,))[0] if self.draft_s else ())

    def _over_b(self, values: list[float], B: int) -> float:
        bs = self.batch_sizes
        if B >= bs[-1]:
            return values[-1] * B / bs[-1]
        if B <= bs[0]:
            return values[0]
        return _interp(bs, values, B)

    def target(self, B: int, n: int) -> float:
        """Seconds of one target forward over B rows of n new tokens."""
        per_b = [max(_interp(self.new_tokens, list(row), n), 1e-9) for row in self._fit]
        return self._over_b(per_b, max(B, 1))

    def draft(self, B: int, k: int) -> float:
        """Seconds of drafting k positions for B rows."""
        return 0.0 if k <= 0 else k * self._over_b(list(self._draft_fit), max(B, 1))

    def step(self, B: int, longest: int) -> float:
        """Seconds of a step whose longest row drafts `longest` tokens (0: a plain step)."""
        return self.target(B, longest + 1) + self.draft(B, longest)

    def to_dict(self) -> dict[str, Any]:
        d = {"format": COSTS_FORMAT, "key": self.key, "batch_sizes": list(self.batch_sizes),
             "new_tokens": list(self.new_tokens), "target_seconds": [list(r) for r in self.target_s],
             "draft_seconds": list(self.draft_s)}
        if self.others_share is not None:
            d["others_share"] = self.others_share
        return d

    @staticmethod
    def from_dict(d: dict[str, Any], source: str) -> StepCosts:
        if d.get("format") != COSTS_FORMAT:
            raise ValueError(f"format {d.get('format')!r}, expected {COSTS_FORMAT}")
        return StepCosts(tuple(int(b) for b in d["batch_sizes"]), tuple(int(n) for n in d["new_tokens"]),
                         tuple(tuple(float(v) for v in r) for r in d["target_seconds"]),
                         tuple(float(v) for v in d["draft_seconds"]), dict(d["key"]), source,
                         None if d.get("others_share") is None else float(d["others_share"]))


def static_costs(device_type: str = "cpu", draft_ratio: float = 0.0) -> StepCosts:
    """A synthetic curve, no timing: t(B, n) = 1 + c (B n - 1) in units of a one-token
    forward (c = 0.04 on a CPU, from the embedded model's batch-1 timings; 0.002 on a GPU,
    flat until compute bound). draft_ratio: a draft pass's cost per row in the same units."""
    c = 0.002 if device_type == "cuda" else 0.04
    bs = (1, 2, 4, 8, 16, 32)
    ns = MEASURE_NEW_TOKENS
    return StepCosts(bs, ns, tuple(tuple(1.0 + c * (b * n - 1) for n in ns) for b in bs),
                     tuple(draft_ratio * (1.0 + c * (b - 1)) for b in bs),
                     {"static": device_type, "draft_ratio": draft_ratio}, COSTS_STATIC)


# --------------------------------------------------------------------------- measuring


def measure_batch_sizes(batch_size: int) -> tuple[int, ...]:
    """Powers of two up to the engine's batch size, and the batch size itself."""
    out, b = [], 1
    while b < batch_size:
        out.append(b)
        b *= 2
    out.append(batch_size)
    return tuple(out)


def _sync(device) -> None:
    import torch

    if getattr(device, "type", str(device)) == "cuda":
        torch.cuda.synchronize(device)


def _machine_busy() -> float | None:
    """CPU seconds every core of the machine has spent busy since boot (/proc/stat), or None."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    if len(fields) < 5:
        return None
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def time_forwards(model, device, batch_sizes: tuple[int, ...], new_tokens: tuple[int, ...],
                  context: int = MEASURE_CONTEXT, repeats: int = MEASURE_REPEATS,
                  vocab: int | None = None, step: StepPlan = EAGER,
                  usage: list[float] | None = None) -> list[list[float]]:
    """Seconds [len(batch_sizes)][len(new_tokens)] of one forward of `model` over B rows of n
    new tokens after `context` cached tokens, through the engine's own cache (rows in slots
    at every B, captured in the warm-up round under a static step plan: Engine.plan; the
    plain one-row call for a model slots cannot hold, at B = 1 only). The fastest of
    `repeats` rounds after a warm-up round: the shape's cost, not the machine's load.
    usage: [the machine's busy CPU seconds less this process's, wall seconds] of the timed
    rounds, added to (BUSY_OTHERS_SHARE; nothing where /proc/stat cannot be read)."""
    import torch

    vocab = vocab or model.get_input_embeddings().weight.shape[0]
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (context,), generator=gen).tolist()
    out: list[list[float]] = []
    with torch.inference_mode():
        one = ContiguousCache(model, device)
        one.add_prefilled(prompt)
        kv = one.row_kv(context)
        slots = supports(model)
        for B in batch_sizes:
            if slots:
                kvc = SlotCache.for_step(model, device, step, slots=B)
                kvc.add_rows([(kv, context)] * B)
            elif B == 1:
                kvc = one
            else:
                raise ValueError("time_forwards: a model slots cannot hold decodes one row at a time")
            inputs = []
            for n in new_tokens:
                ids = torch.randint(0, vocab, (B, n), generator=gen).to(device)
                new_mask = torch.ones(B, n, dtype=torch.long, device=device)
                pos = (context + torch.arange(n))[None, :].expand(B, n).to(device)
                inputs.append((ids, new_mask, pos))
            row = [float("inf")] * len(new_tokens)
            # Rounds over all shapes (the first a warm-up): a burst of load on a shared
            # machine then spoils one round of every shape, not every round of one shape.
            busy0 = None
            for rnd in range(repeats + 1):
                if rnd == 1 and usage is not None:  # the timed rounds begin
                    busy0, c0, w0 = _machine_busy(), time.process_time(), time.perf_counter()
                for j, (ids, new_mask, pos) in enumerate(inputs):
                    _sync(device)
                    t0 = time.perf_counter()
                    kvc.forward(ids, new_mask, pos)
                    _sync(device)
                    dt = time.perf_counter() - t0
                    if not isinstance(kvc, SlotCache):  # a slot cache only counts what commit() keeps
                        rollback(kvc.cache, context)
                    if rnd:
                        row[j] = min(row[j], dt)
            busy1 = _machine_busy() if busy0 is not None else None
            if busy1 is not None:  # other processes' busy time over the timed rounds
                usage[0] += max(busy1 - busy0 - (time.process_time() - c0), 0.0)
                usage[1] += time.perf_counter() - w0
            out.append(row)
    return out


def cost_key(target, batch_sizes: tuple[int, ...], draft_kind: str, draft_identity: dict | None,
             context: int = MEASURE_CONTEXT, step: StepPlan = EAGER) -> dict[str, Any]:
    """What a measurement depends on: the weights, device, dtype, software and threads."""
    import torch

    ident = target.identity
    return {
        "format": COSTS_FORMAT,
        "target": {k: ident.get(k) for k in ("name", "sha256", "fingerprint", "dtype", "quantization", "device")},
        "device": str(target.device),
        "device_name": torch.cuda.get_device_name(target.device) if target.device.type == "cuda" else None,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        # The engine patches CPU float32 linear layers (marscli.models.fastpath): their kernels are
        # part of what was timed.
        "cpu_fastpath": fastpath_signature() if target.device.type == "cpu" else None,
        # int8 CPU models run their decoder layers through TorchScript (marscli.models.int8_decoder).
        "int8_decoder": INT8_DECODER if CPU_INT8 in (ident.get("quantization"),
                                                     (draft_identity or {}).get("quantization")) else None,
        "context": context,
        "step": step.kind,  # eager, or the captured step (Engine.plan)
        "batch_sizes": list(batch_sizes),
        "new_tokens": list(MEASURE_NEW_TOKENS),
        "drafter": draft_kind,
        "draft": ({k: draft_identity.get(k) for k in ("name", "sha256", "fingerprint", "dtype", "quantization")}
                  if draft_identity else None),
    }


def key_hash(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]


def costs_path(key: dict[str, Any]) -> Path:

    return cache_root() / "costs" / f"{key_hash(key)}.json"


def _draft_seconds(target, draft_model, draft_kind: str, batch_sizes: tuple[int, ...],
                   target_s: list[list[float]], context: int, step: StepPlan = EAGER,
                   usage: list[float] | None = None) -> list[float]:
    """One draft position's seconds per batch size: a draft model is timed like the target
    (one new token); an EAGLE-3 head is reckoned from the target's one-token forward by its
    share of the weights (a decoder layer and a head against the whole target); prompt
    lookup costs nothing measurable."""
    if draft_kind == MODEL and draft_model is not None:
        model = getattr(draft_model, "model", draft_model)
        device = model.get_input_embeddings().weight.device
        return [r[0] for r in time_forwards(model, device, batch_sizes, (1,), context, step=step.on(device),
                                            usage=usage)]
    if draft_kind == EAGLE3 and draft_model is not None:
        head = getattr(draft_model, "head", draft_model)
        t_params = sum(p.numel() for p in target.model.parameters())
        d_params = sum(p.numel() for p in head.parameters())
        ratio = d_params / max(t_params, 1)
        return [ratio * row[0] for row in target_s]
    return [0.0 for _ in batch_sizes]


def measure_costs(target, draft_model=None, draft_kind: str = NGRAM, batch_size: int = 1,
                  context: int = MEASURE_CONTEXT, step: StepPlan = EAGER) -> StepCosts:
    """Time the target (and the drafter) now; no cache."""
    ctx = context
    if target.context_length:
        ctx = max(8, min(context, int(target.context_length) // 2))
    bs = measure_batch_sizes(batch_size)
    draft_ident = getattr(draft_model, "identity", None)
    key = cost_key(target, bs, draft_kind, draft_ident, ctx, step)
    usage = [0.0, 0.0]
    t = time_forwards(target.model, target.device, bs, MEASURE_NEW_TOKENS, ctx, step=step, usage=usage)
    d = _draft_seconds(target, draft_model, draft_kind, bs, t, ctx, step, usage)
    share = None
    if target.device.type == "cpu" and usage[1] > 0:
        share = round(usage[0] / (usage[1] * (os.cpu_count() or 1)), 3)
    return StepCosts(bs, MEASURE_NEW_TOKENS, tuple(tuple(r) for r in t), tuple(d), key, "measured", share)


def _write_atomic(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def read_costs(path: Path, key: dict[str, Any] | None = None) -> StepCosts:
    """A costs file; ValueError naming the file when it is unreadable or (with key) was
    measured for another key."""
    try:
        data = json.loads(Path(path).read_text())
        costs = StepCosts.from_dict(data, str(path))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path}: not a marscli costs file ({e})") from None
    if key is not None and costs.key != key:
        raise ValueError(f"{path}: measured for another key")
    return costs


def step_costs(target, draft_model=None, draft_kind: str = NGRAM, batch_size: int = 1,
               note: Note = _silent, mode: str | None = None, step: StepPlan = EAGER) -> StepCosts:
    """The costs an engine's draft-length policy uses ($MARSCLI_COSTS, see the module), of the
    steps it runs (step: the engine's StepPlan; a captured step is timed captured)."""
    mode = mode or os.environ.get(COSTS_ENV) or COSTS_MEASURE
    if mode == COSTS_STATIC:
        return static_costs(target.device.type)
    if mode not in (COSTS_MEASURE, COSTS_REMEASURE):
        costs = read_costs(Path(mode))
        note(f"step costs from {mode}")
        return costs
    ctx = MEASURE_CONTEXT
    if target.context_length:
        ctx = max(8, min(ctx, int(target.context_length) // 2))
    key = cost_key(target, measure_batch_sizes(batch_size), draft_kind,
                   getattr(draft_model, "identity", None), ctx, step)
    path = costs_path(key)
    if mode == COSTS_MEASURE and path.exists():
        try:
            return read_costs(path, key)
        except ValueError as e:
            note(f"{e}: measuring again")
    t0 = time.perf_counter()
    costs = measure_costs(target, draft_model, draft_kind, batch_size, ctx, step)
    busy = costs.others_share is not None and costs.others_share > BUSY_OTHERS_SHARE
    costs = StepCosts(costs.batch_sizes, costs.new_tokens, costs.target_s, costs.draft_s, costs.key,
                      "measured on a busy CPU" if busy else str(path), costs.others_share)
    where = f"cached in {path}"
    if busy:
        where = (f"not cached: other processes kept {costs.others_share:.0%} of the CPU busy, so these "
                 "are a busy machine's figures; measured again next run")
    else:
        try:
            _write_atomic(path, costs.to_dict() | {"measured_in_seconds": round(time.perf_counter() - t0, 3)})
        except OSError as e:  # a read-only cache: the measurement still serves this run
            note(f"cannot cache step costs at {path}: {e}")
    B = costs.batch_sizes[-1]
    note(f"measured step costs in {time.perf_counter() - t0:.1f} s: t({B}, 1) = "
         f"{costs.target(B, 1) * 1e3:.1f} ms, t({B}, 9) = {costs.target(B, 9) * 1e3:.1f} ms ({where})")
    return costs
