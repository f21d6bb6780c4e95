"""The slot cache: one preallocated key/value buffer per layer, a row per slot, per-row
lengths.

Every layer holds keys and values in buffers ``[slots, kv heads, capacity, head dim]``. A batch
row lives in a slot, and its tokens sit at positions ``0 .. length - 1`` of that slot: no left
padding, no holes. A forward writes each row's new tokens at that row's own positions
(``scatter_`` along the time axis) and attends over the first ``span`` positions of the first
B slots through a mask that lets query j of row b see positions ``<= length_b + j``. So:

- rolling back rejected drafts is a length change, never a copy (``commit``, ``truncate_row``);
- a joining row's keys and values are written once into its slot (``add_rows``);
- a leaving row frees its slot; rows are kept in the first slots (``keep_rows`` moves only the
  rows whose place changes);
- shapes depend only on (rows, new tokens, span), so a step can be captured once per bucket
  (``span`` rounds up to ``bucket`` positions; at bucket 1 it is exactly what the rows need).

With ``static`` every forward runs at bucketed shapes on input buffers that outlive it; with
``graphs`` (CUDA) each shape is captured once as a CUDA graph and replayed, and with
``compiled`` (``--compile on`` on a CPU) each shape is compiled once by torch.compile
(`StaticSteps`; the engine's `--compile`, docs/engine.md "The captured step").

It holds the engine's rows at every batch size and step kind, batch size 1 and tree steps
included, and the batched draft model's. What it cannot hold (`supports` says which: models
with sliding-window layers, whose cache layers keep a window of their own, or an attention
that takes no custom mask) decodes one record at a time in marscli.models.kvcache's
ContiguousCache, which shares its interface (forward / commit / truncate_row / keep_rows /
trim / nbytes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from marscli.models.captured import MAX_GRAPHS, CapturedShapes, StepOutput
from marscli.models.fastpath import GQA_SDPA
from marscli.models.kvcache import cache_kw, new_cache, sliding_layers

#: Room a slot's time axis grows by when a row outgrows it: GROW x what is needed, rounded up
#: to the bucket.
GROW = 1.25
#: Static steps: rows and new tokens per row are padded up to one of these (a graph each).
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256)
#: Static steps on a GPU attend over a span rounded up to this many positions.
SPAN_BUCKET = 256


def span_bucket(need: int, bucket: int) -> int:
    """The span a static step attends over: `bucket` times the next power of two that holds
    `need` (few shapes over a run: each doubling of the longest row adds one)."""
    blocks = -(-need // bucket)
    return bucket * (1 << (blocks - 1).bit_length())


#: Causal LMs whose logits are exactly lm_head(decoder output): their static step captures
#: the decoder, and the head runs on the real rows only (a graph's output is then hidden
#: states, not a vocabulary's logits for every padded position).
SPLIT_HEAD = frozenset({"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"})


#: Attention implementations that attend row group by row group in eager steps (row_runs):
#: the CPU's float32 SDPA (marscli.models.fastpath.cpu_sdpa_forward).
RUN_ATTENTION = (GQA_SDPA,)
#: What one more attention call costs, in rows x columns of keys read (row_runs): about 30 us
#: of dispatch and slicing against 0.18 us a row-column (batch 16 over 1,530 columns: 4.5 ms
#: a layer, read-bound, on the 2-core CPU of docs/results.md).
RUN_CALL_COST = 160
#: Split only where it saves at least this share of the single call's reads.
RUN_MIN_SAVING = 0.15


def row_runs(needs: list[int], call_cost: int = RUN_CALL_COST) -> list[tuple[int, int, int]] | None:
    """Contiguous groups of rows (slots first .. end - 1) and the columns each group attends
    over, the longest need among its rows, so that a row reads about its own length instead
    of the batch's longest: the grouping of least reads plus call_cost a group (an exact
    dynamic program over the rows, in slot order). None when one call over everything is
    within RUN_MIN_SAVING of it. needs[b]: the columns row b's queries can see (its length
    plus the step's new tokens)."""
    B = len(needs)
    if B < 2:
        return None
    span = max(needs)
    best = [0.0] + [float("inf")] * B
    cut = [0] * (B + 1)
    for j in range(1, B + 1):
        m = 0
        for i in range(j - 1, -1, -1):
            m = max(m, needs[i])
            c = best[i] + (j - i) * m + call_cost
            if c < best[j]:
                best[j], cut[j] = c, i
    if best[B] > (1.0 - RUN_MIN_SAVING) * (B * span + call_cost):
        return None
    runs, j = [], B
    while j > 0:
        i = cut[j]
        runs.append((i, j, max(needs[i:j])))
        j = i
    return runs[::-1]


def write_positions(lengths: list[int], S: int, device) -> torch.Tensor:
    """Where each row's S new tokens go: length_b + j, [B, S]."""
    return torch.tensor(lengths, dtype=torch.long, device=device)[:, None] + torch.arange(S, device=device)[None, :]


def visible(at: torch.Tensor, span: int, block: torch.Tensor | None = None) -> torch.Tensor:
    """The 4D attention mask [B, 1, S, span] of a step writing at `at` [B, S] (each row's S new
    tokens at length_b .. length_b + S - 1): query j of row b sees the row's cache and then,
    among the new tokens, those up to its own (block None: a chain) or those block[b, j] says
    (block [B, S, S] bool: a draft tree's ancestor mask, each token seeing its ancestors and
    itself)."""
    p = torch.arange(span, device=at.device)[None, None, None, :]
    if block is None:
        return p <= at[:, None, :, None]
    B, S = at.shape
    rel = p[0, 0] - at[:, :1]  # [B, span]: a position's place among the new tokens (< 0: cached)
    inside = (rel >= 0) & (rel < S)
    seen = block.gather(2, rel.clamp(0, S - 1)[:, None, :].expand(B, S, span))  # [B, S, span]
    return ((rel < 0)[:, None, :] | (inside[:, None, :] & seen))[:, None]


#: Attention implementations that take a 4D bool mask (True: attend) as is.
BOOL_MASK_ATTENTION = ("sdpa", "marscli_gqa_sdpa", "marscli_f64_sdpa", "marscli_gqa_fold")
#: Attention implementations that add the mask to the scores: they get the additive float form
#: (0: attend, finfo.min: hidden; a bool mask there would be silently wrong).
ADDITIVE_MASK_ATTENTION = ("eager",)


def attention_implementation(model) -> str | None:
    return getattr(model.config, "_attn_implementation", None)


def attention_mask(model, mask: torch.Tensor) -> torch.Tensor:
    """`mask` (bool, True: attend) in the form `model`'s attention takes."""
    if attention_implementation(model) not in ADDITIVE_MASK_ATTENTION:
        return mask
    return torch.zeros(mask.shape, dtype=model.dtype, device=mask.device).masked_fill(
        ~mask, torch.finfo(model.dtype).min)


def bucket_of(n: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket >= n (n itself past the largest)."""
    for b in buckets:
        if b >= n:
            return b
    return n


def supports(model) -> bool:
    """Whether a slot cache can hold `model`'s keys and values: no sliding-window layer, and an
    attention that takes a custom 4D mask (not flash or flex attention)."""
    takes_mask = attention_implementation(model) in BOOL_MASK_ATTENTION + ADDITIVE_MASK_ATTENTION
    return not sliding_layers(model) and takes_mask


def graphs_blocker(model) -> str | None:
    """Why `model`'s forward cannot be captured as a CUDA graph, or None: bitsandbytes 8-bit
    layers (their outlier handling asks the host `outliers.any()` inside the forward),
    weights offloaded to the CPU or disk (moved in by hooks during the forward), and dynamic
    RoPE scaling (the rotary frequencies are recomputed from the sequence length on the
    host). Such a model's steps run at the static shapes eagerly, said once."""
    if any(type(m).__name__ in ("Linear8bitLt", "Int8Params") for m in model.modules()):
        return "bitsandbytes 8-bit layers"
    device_map = getattr(model, "hf_device_map", None) or {}
    if any(str(d) in ("cpu", "disk") for d in device_map.values()):
        return "weights offloaded to the CPU or disk"
    scaling = getattr(model.config, "rope_scaling", None) or {}
    kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else None
    if kind in ("dynamic", "longrope"):
        return f"{kind} RoPE scaling"
    return None


#: How a step's forwards can run (StepPlan.kind).
STEP_KINDS = ("eager", "static", "graphs", "compiled")


@dataclass(frozen=True)
class StepPlan:
    """How a loaded engine's forwards run: one frozen value, decided once for the engine
    (marscli.engine.scheduler.step_plan) and handed to everything that runs forwards at its
    step's shapes: the target's slot cache, a batched draft model's, the EAGLE-3 head's slots
    (``use_plan``) and the cost measurement (timed as it runs).

    kind: "eager"; "static" (bucketed shapes on buffers that outlive a step, run eagerly:
    what a CPU's tests run, and a model that cannot be captured); "graphs" (those shapes
    captured once each as CUDA graphs and replayed); "compiled" (compiled by torch.compile)."""

    kind: str = "eager"

    def __post_init__(self) -> None:
        if self.kind not in STEP_KINDS:
            raise ValueError(f"a step runs {', '.join(STEP_KINDS)}, not {self.kind!r}")

    @property
    def static(self) -> bool:
        """Static shapes (graphs and compiled steps are static too)."""
        return self.kind != "eager"

    @property
    def graphs(self) -> bool:
        return self.kind == "graphs"

    @property
    def compiled(self) -> bool:
        return self.kind == "compiled"

    def on(self, device) -> StepPlan:
        """The plan a cache on `device` runs: CUDA graphs need CUDA (a draft model placed
        elsewhere than its target runs eagerly); a compiled step runs anywhere."""
        return EAGER if self.graphs and torch.device(device).type != "cuda" else self


EAGER = StepPlan()


def _round_up(n: int, bucket: int) -> int:
    return -(-n // bucket) * bucket


class SlotLayer(DynamicLayer):
    """One layer of a SlotCache: writes the forward's new keys and values at each row's own
    positions and hands attention the first rows x span of its buffers."""

    def __init__(self, owner: SlotCache):
        super().__init__()
        self.owner = owner
        self.kbuf: torch.Tensor | None = None
        self.vbuf: torch.Tensor | None = None

    def allocate(self, like: torch.Tensor) -> None:
        """Buffers for the owner's slots and capacity, shaped like `like` ([B, H, T, D])."""
        o = self.owner
        shape = (o.slots, like.shape[1], o.capacity, like.shape[3])
        # zeros, not empty: positions past a row's length are masked out, but 0 x NaN is NaN
        self.kbuf = like.new_zeros(shape)
        self.vbuf = like.new_zeros(shape)
        if not self.is_initialized:
            self.lazy_initialization(like, like)

    def resize(self, slots: int, capacity: int) -> None:
        """New buffers for `slots` x `capacity`, the old contents copied over."""
        for name in ("kbuf", "vbuf"):
            old = getattr(self, name)
            if old is None:
                continue
            new = old.new_zeros(slots, old.shape[1], capacity, old.shape[3])
            s, c = min(slots, old.shape[0]), min(capacity, old.shape[2])
            new[:s, :, :c] = old[:s, :, :c]
            setattr(self, name, new)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.kbuf is None:
            self.allocate(key_states)
        o = self.owner
        B, H, S, D = key_states.shape
        index = o.write_index.expand(B, H, S, D)
        self.kbuf[:B].scatter_(2, index, key_states)
        self.vbuf[:B].scatter_(2, index, value_states.to(self.vbuf.dtype))
        self.keys = self.kbuf[:B, :, : o.span]
        self.values = self.vbuf[:B, :, : o.span]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return max(self.owner.lengths, default=0)

    def reset(self) -> None:
        self.kbuf = self.vbuf = None
        super().reset()


class SlotCache:
    """A model's KV cache for a batch of records, a slot each (see the module's docstring)."""

    def __init__(self, model, device, *, slots: int = 1, bucket: int = 1, static: bool = False,
                 graphs: bool = False, compiled: bool = False, pad_id: int = 0, tap=None):
        self.model = model
        self.device = device
        #: A FeatureTap (EAGLE-3): static steps hook its features out of the forward (in a
        #: graph, as outputs of the graph) and return them with the logits.
        self.tap = tap
        #: static: every forward runs at bucketed shapes (rows, new tokens, span) on buffers
        #: that outlive it (StaticSteps); graphs: and is captured as a CUDA graph per shape;
        #: compiled: and is compiled by torch.compile (inductor) per shape (`--compile on` on
        #: a CPU).
        self.static = static or graphs or compiled
        self.graphs = graphs
        self.compiled = compiled and not graphs
        self.bucket = max(1, bucket if not self.static or bucket > 1 else
                          (SPAN_BUCKET if graphs else 1))
        self.initial_slots = max(1, bucket_of(slots, ROW_BUCKETS) if self.static else slots)
        self.pad_id = pad_id
        self.steps = StaticSteps(self) if self.static else None
        self.reset()

    def reset(self) -> None:
        self.cache = DynamicCache(config=self.model.config)
        if not getattr(self.cache, "layers", None):  # a config whose cache builds layers lazily
            self.cache = new_cache(self.model)
        self.cache.layers[:] = [SlotLayer(self) for _ in self.cache.layers]
        self.slots = self.initial_slots
        self.capacity = 0
        if self.steps is not None:
            self.steps.clear()
        self.lengths: list[int] = []  # per row (= slot), host side
        self.span = 0
        self.write_index: torch.Tensor | None = None

    def clear_rows(self) -> None:
        """No row: every slot free again. The buffers and the captured (or compiled, or
        static) shapes stay, so a next run at the same shapes builds nothing."""
        self.lengths = []
        self.span = 0
        self.write_index = None

    @classmethod
    def for_step(cls, model, device, plan: StepPlan, **kw) -> SlotCache:
        """A slot cache whose forwards run as `plan` says on `device` (StepPlan.on)."""
        plan = plan.on(device)
        return cls(model, device, static=plan.static, graphs=plan.graphs, compiled=plan.compiled, **kw)

    @property
    def rows(self) -> int:
        return len(self.lengths)

    def layers(self) -> list[SlotLayer]:
        return [layer for layer in self.cache.layers if layer.kbuf is not None]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers() for t in (layer.kbuf, layer.vbuf))

    def _room(self, rows: int, length: int) -> None:
        """Make the buffers hold at least `rows` slots of `length` positions."""
        slots, capacity = self.slots, self.capacity
        if rows > slots:
            slots = max(rows, 2 * slots)
        if length > capacity:  # static steps double it: each growth drops every captured shape
            capacity = _round_up(max(length, 2 * capacity if self.static else int(capacity * GROW)), self.bucket)
        if (slots, capacity) != (self.slots, self.capacity):
            self.slots, self.capacity = slots, capacity
            for layer in self.layers():
                layer.resize(slots, capacity)
            if self.steps is not None and (self.graphs or self.compiled):
                self.steps.clear()  # graphs and compiled steps read the old buffers; static shapes do not

    # ------------------------------------------------------------------ forward and commit

    def forward(self, ids: torch.Tensor, new_mask: torch.Tensor | None, pos: torch.Tensor, *,
                block: torch.Tensor | None = None, **kw):
        """Run the model on ids [B, S] over the cache, row b's tokens written at length_b ..
        length_b + S - 1 with position ids pos [B, S] (for a chain the same positions; for a
        tree, length + depth) and seeing each other as `visible` says (block: a tree's [B, S, S]
        ancestor mask; None: a chain). new_mask is not read: padding at the end of a row is
        written past its length and never seen. The new positions count once commit() (or
        keep_path(), after a tree) says which stay."""
        B, S = ids.shape
        assert B == self.rows, (B, self.rows)
        if self.steps is not None and not kw:
            return self.steps.run(ids, pos, block)
        need = max(self.lengths, default=0) + S
        self._room(B, need)
        self.span = min(self.capacity, _round_up(need, self.bucket))
        at = write_positions(self.lengths, S, ids.device)
        self.write_index = at[:, None, :, None]
        mask = attention_mask(self.model, visible(at, self.span, block))
        if attention_implementation(self.model) in RUN_ATTENTION:
            # rows attend over their own lengths, group by group (row_runs), not all over the longest
            runs = row_runs([n + S for n in self.lengths])
            if runs is not None:
                kw = {**kw, "row_runs": runs}
        return self.model(input_ids=ids, attention_mask=mask, position_ids=pos,
                          **cache_kw(self.model, self.cache), use_cache=True, **kw)

    def commit(self, new_mask: torch.Tensor, kept: list[int] | None = None) -> None:
        """Each row keeps the first new_mask[b].sum() of the last forward's new positions
        (what a row keeps is always a prefix of what it fed), or kept[b] when the caller
        knows them (the engine and the draft model do: the commit then reads no tensor)."""
        if kept is None:
            kept = new_mask.sum(1).tolist()
        self.lengths = [n + int(k) for n, k in zip(self.lengths, kept)]

    def truncate_row(self, b: int, keep: int) -> None:
        """Row b keeps its first `keep` positions (a rollback: a length change)."""
        self.lengths[b] = min(self.lengths[b], keep)

    def keep_path(self, b: int, path: list[int]) -> None:
        """After a tree step on row b (root at its length, node i at length + 1 + i): the row
        keeps the root and the accepted path's nodes (path order), moved to follow the root,
        as if fed as a chain (their keys carry the positions length + depth, the chain's)."""
        start = self.lengths[b] + 1
        n = len(path)
        if path != list(range(n)):
            src = torch.tensor(path, dtype=torch.long, device=self.device) + start
            for layer in self.layers():
                for buf in (layer.kbuf, layer.vbuf):
                    buf[b, :, start:start + n] = buf[b, :, src]  # the gather copies first
        self.lengths[b] = start + n

    def trim(self) -> None:
        """Nothing to trim: a row has no holes."""

    # ------------------------------------------------------------------ rows

    def add_rows(self, rows: list[tuple[list | None, int]]) -> None:
        """Append rows, each (kv, L): its L cached positions per layer ([1, H, L, D], None for
        a layer that holds nothing; kv None when L == 0), written into the next free slots."""
        B = self.rows
        self._room(B + len(rows), max([L for _, L in rows], default=0))
        for j, (kv, L) in enumerate(rows):
            if L:
                for layer, pair in zip(self.cache.layers, kv):
                    if pair is None:
                        continue
                    k, v = pair
                    if layer.kbuf is None:
                        layer.allocate(k)
                    layer.kbuf[B + j, :, :L] = k[0]
                    layer.vbuf[B + j, :, :L] = v[0]
            self.lengths.append(L)

    def add_prefilled(self, ids: list[int], run=None, *, past=None) -> None:
        """Append a row for a record whose cached tokens are `ids`, prefilled alone."""
        assert past is None, "a slot cache takes cached prefixes through add_rows"
        run = run or (lambda f: f())
        kv = None
        if ids:
            c = new_cache(self.model)
            x = torch.tensor([ids], dtype=torch.long, device=self.device)
            run(lambda: self.model(input_ids=x, **cache_kw(self.model, c), use_cache=True, logits_to_keep=1))
            kv = [(layer.keys, layer.values) if layer.is_initialized and layer.keys is not None
                  and layer.keys.numel() else None for layer in c.layers]
        self.add_rows([(kv, len(ids))])

    def keep_rows(self, keep: list[int]) -> None:
        """Keep only these rows, in this order, in the first slots: only the rows whose slot
        changes move (their valid positions, gathered first, so no source is overwritten
        before it is read)."""
        if not keep:
            self.lengths = []
            return
        moves = [(i, src) for i, src in enumerate(keep) if src != i]
        if moves:
            span = max(self.lengths[src] for _, src in moves)
            if span:
                dst = torch.tensor([i for i, _ in moves], dtype=torch.long, device=self.device)
                src = torch.tensor([s for _, s in moves], dtype=torch.long, device=self.device)
                for layer in self.layers():
                    for buf in (layer.kbuf, layer.vbuf):
                        buf[:, :, :span].index_copy_(0, dst, buf[:, :, :span].index_select(0, src))
        self.lengths = [self.lengths[src] for src in keep]


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
