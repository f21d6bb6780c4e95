"""The batched EAGLE-3 head's KV cache in slot buffers, as the target's (marscli.models.slots).

The head has one decoder layer, so its cache is one pair of buffers, keys and values
[slots, kv heads, capacity, head dim]: batch row b lives in slot b, its committed entry j at
column j (the head's position j), and its newest committed output in ``out[b]``. Nothing is
copied per step: a step's catch-up pass writes each row's newly committed entries at its own
columns (n_b .. n_b + p_b - 1), a draft position i writes each row's draft entry at n_b + i,
and attention reads the rows' first L columns through a mask (column <= the query's own
position): a draft entry past n_b is scratch that the next catch-up overwrites. What a step
writes is the rows' new entries only, whatever the rows' lengths (before, every row's cache
was left-padded and concatenated for every step: O(rows x length) bytes and O(rows) launches
a step). A row that leaves moves the rows after it down (SlotCache.keep_rows' rule); a row
that joins takes the next free slot, and its prompt's entries are computed in a pass of the
joining rows alone (they have nothing committed) and written into their slots.

Shapes. With static steps (Engine.step_kind "static" or "graphs") a step's passes run at
bucketed shapes on buffers that outlive them: rows up to a ROW_BUCKETS size, a catch-up's
entries per row up to a TOKEN_BUCKETS size, the span up to HEAD_SPAN_BUCKET x a power of two;
on CUDA each shape is captured once as a CUDA graph and replayed (CapturedShapes). Padding
rows are free slots (they write at their columns 0 .. and are never read); padding entries of
a row write past its committed length (scratch). A prompt's pass, and a catch-up of more than
CATCH_UP_TOKENS entries a row, run eagerly. The passes' small inputs (tokens, lengths) are
built on the host and go over through pinned memory without blocking (kvcache.to_device).
"""

from __future__ import annotations

import torch

from marscli.drafters.eagle3_head import Eagle3Head
from marscli.models.captured import CapturedShapes
from marscli.models.kvcache import to_device
from marscli.models.slots import ROW_BUCKETS, TOKEN_BUCKETS, bucket_of, span_bucket

#: A pass attends over HEAD_SPAN_BUCKET x a power of two columns (static shapes), and the
#: buffers' capacity grows in these steps.
HEAD_SPAN_BUCKET = 64
#: A catch-up of at most this many entries a row runs at a static shape (a step's: its
#: accepted drafts and the correction); a longer one runs eagerly.
CATCH_UP_TOKENS = 32


def _round_up(n: int, bucket: int) -> int:
    return -(-n // bucket) * bucket


class HeadSlots(CapturedShapes):
    """The batched head's cache and passes (see the module's docstring). ``lengths[b]``: row
    b's committed entries (host side)."""

    captured_what = "capturing the EAGLE-3 head's step as a CUDA graph"

    def __init__(self, head: Eagle3Head, *, static: bool = False, graphs: bool = False):
        super().__init__()  # shapes: ("draft", rows, span); ("catch-up", rows, entries, span)
        self.head = head
        self.static = static or graphs
        self.graphs = graphs
        a = head.midlayer.self_attn
        self.nkv, self.hd = a.nkv, a.hd
        self.slots = self.capacity = 0
        self.k: torch.Tensor | None = None  # [slots, kv, capacity, hd]
        self.v: torch.Tensor | None = None
        self.out: torch.Tensor | None = None  # [slots, H]: each row's newest committed output
        self.lengths: list[int] = []
        #: key/value entries written into the buffers (new entries, moved rows and grown
        #: buffers' copies): what a step's cache work is, for tests.
        self.written = 0

    @property
    def rows(self) -> int:
        return len(self.lengths)

    def clear_rows(self) -> None:
        """No row; the buffers and the shapes stay (the next run builds nothing again)."""
        self.lengths = []

    def nbytes(self) -> int:
        if self.k is None:
            return 0
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.out))

    def _room(self, slots: int, length: int) -> None:
        """Buffers of at least `slots` slots of `length` columns (grown by doubling; the old
        contents copied over; captured graphs, which read the old buffers, dropped)."""
        if slots <= self.slots and length <= self.capacity:
            return
        head = self.head
        new_slots, new_cap = self.slots, self.capacity
        if slots > self.slots:
            new_slots = max(slots, 2 * self.slots)
        if length > self.capacity:
            new_cap = _round_up(max(length, 2 * self.capacity), HEAD_SPAN_BUCKET)
        dev, dt = head.device, head.dtype
        k = torch.zeros(new_slots, self.nkv, new_cap, self.hd, dtype=dt, device=dev)
        v = torch.zeros_like(k)
        out = torch.zeros(new_slots, head.cfg.hidden_size, dtype=dt, device=dev)
        if self.k is not None:
            s, c = self.slots, self.capacity
            k[:s, :, :c] = self.k
            v[:s, :, :c] = self.v
            out[:s] = self.out
            self.written += s * c
        self.k, self.v, self.out = k, v, out
        self.slots, self.capacity = new_slots, new_cap
        if self.graphs:
            self.clear()

    # ------------------------------------------------------------------ rows

    def add_rows(self, n: int) -> None:
        """n rows with nothing committed, in the next free slots."""
        self.lengths.extend([0] * n)

    @torch.inference_mode()
    def keep_rows(self, keep: list[int]) -> None:
        """Only these rows, in this order, in the first slots: the rows whose slot changes move
        (their committed entries and newest output, gathered first)."""
        moves = [(i, src) for i, src in enumerate(keep) if src != i]
        if moves and self.k is not None:
            span = max(self.lengths[src] for _, src in moves)
            dst = torch.tensor([i for i, _ in moves], dtype=torch.long, device=self.k.device)
            src = torch.tensor([s for _, s in moves], dtype=torch.long, device=self.k.device)
            if span:
                for buf in (self.k, self.v):
                    buf[:, :, :span].index_copy_(0, dst, buf[:, :, :span].index_select(0, src))
                self.written += len(moves) * span
            self.out.index_copy_(0, dst, self.out.index_select(0, src))
        self.lengths = [self.lengths[src] for src in keep]

    # ------------------------------------------------------------------ committed entries

    @torch.inference_mode()
    def commit(self, feats: list[torch.Tensor | None], tokens: list[list[int]]) -> None:
        """Row b's pending target features feats[b] [p_b, F] (None: nothing new), each with
        the token after its position (tokens[b], p_b ids), become the row's committed entries
        n_b .. n_b + p_b - 1; its newest output is the last one's."""
        fresh = [b for b, f in enumerate(feats) if f is not None and self.lengths[b] == 0]
        if fresh:
            self._prompts(fresh, feats, tokens)
        rest = [b for b, f in enumerate(feats) if f is not None and b not in fresh]
        if rest:
            self._catch_up(rest, feats, tokens)

    def _inputs(self, rows: list[int], places: list[int], feats, tokens, B: int, P: int):
        """A pass's inputs, row rows[i] in pass row places[i] (zeros elsewhere): x [B, P, F]
        on the device, tok [B, P] built on the host, and the rows' entry counts."""
        dev = self.head.device
        F = feats[rows[0]].shape[1]
        lens = [feats[b].shape[0] for b in rows]
        tok_h = torch.zeros(B, P, dtype=torch.long)
        where: list[int] = []
        for b, i, p in zip(rows, places, lens):
            tok_h[i, :p] = torch.tensor(tokens[b], dtype=torch.long)
            where.extend(range(i * P, i * P + p))
        x = torch.zeros(B * P, F, dtype=feats[rows[0]].dtype, device=dev)
        x.index_copy_(0, to_device(torch.tensor(where, dtype=torch.long), dev),
                      torch.cat([feats[b] for b in rows], 0).to(dev, x.dtype))
        return x.view(B, P, F), tok_h, lens

    def _take_outputs(self, rows: list[int], out: torch.Tensor, at_row: list[int], lens: list[int]) -> None:
        """Each row's newest output: out[at_row[i], lens[i] - 1] into out[rows[i]]."""
        dev = out.device
        src = out[to_device(torch.tensor(at_row), dev), to_device(torch.tensor([p - 1 for p in lens]), dev)]
        self.out.index_copy_(0, to_device(torch.tensor(rows, dtype=torch.long), dev), src.to(self.out.dtype))
        for b, p in zip(rows, lens):
            self.lengths[b] += p

    def _prompts(self, rows: list[int], feats, tokens) -> None:
        """Joining rows' prompt entries: one pass of those rows alone (nothing committed to
        read), written into their slots."""
        head, dev = self.head, self.head.device
        B, P = len(rows), max(feats[b].shape[0] for b in rows)
        self._room(max(rows) + 1, P)
        x, tok_h, lens = self._inputs(rows, list(range(B)), feats, tokens, B, P)
        pos = torch.arange(P, device=dev)
        n = torch.tensor(lens, device=dev)
        # causal, and a row's padding entries see its real ones only (never an empty row)
        mask = (pos[None, :] <= pos[:, None])[None] & (pos[None, None, :] < n[:, None, None])
        mask = mask | torch.eye(P, dtype=torch.bool, device=dev)[None]
        out, k, v = head(x, to_device(tok_h, dev), pos.expand(B, P), None, mask[:, None], target_features=True)
        slots = torch.tensor(rows, dtype=torch.long, device=dev)
        self.k[:, :, :P].index_copy_(0, slots, k.to(self.k.dtype))
        self.v[:, :, :P].index_copy_(0, slots, v.to(self.v.dtype))
        self.written += B * P
        self._take_outputs(rows, out, list(range(B)), lens)

    def _catch_up(self, rows: list[int], feats, tokens) -> None:
        """A step's newly committed entries of `rows`, in one pass over every row (rows with
        nothing new run padding entries past their lengths: scratch)."""
        B = self.rows
        P = max(feats[b].shape[0] for b in rows)
        static = self.static and P <= CATCH_UP_TOKENS
        Bb, Pb = (bucket_of(B, ROW_BUCKETS), bucket_of(P, TOKEN_BUCKETS)) if static else (B, P)
        need = max(self.lengths) + Pb
        L = span_bucket(need, HEAD_SPAN_BUCKET) if static else need
        self._room(Bb, L)
        # each row in its own pass row, the shape's padding included
        x, tok_h, lens = self._inputs(rows, rows, feats, tokens, Bb, Pb)
        dev = self.head.device
        n_h = torch.tensor(self.lengths + [0] * (Bb - B), dtype=torch.long)
        if static:
            key = ("catch-up", Bb, Pb, L)
            st, _ = self._shape(key, lambda: {
                "x": torch.zeros_like(x), "tok": torch.zeros(Bb, Pb, dtype=torch.long, device=dev),
                "at": torch.zeros(Bb, dtype=torch.long, device=dev), "L": L})
            st["x"].copy_(x)
            st["tok"].copy_(to_device(tok_h, dev))
            st["at"].copy_(to_device(n_h, dev))
            out = self._replay(st, self._run_catch_up, "res")
        else:
            out = self._catch_up_pass(x, to_device(tok_h, dev), to_device(n_h, dev), L)
        self.written += Bb * Pb
        self._take_outputs(rows, out, rows, lens)

    def _catch_up_pass(self, x: torch.Tensor, tok: torch.Tensor, n: torch.Tensor, L: int) -> torch.Tensor:
        """Entries j of row b at column n_b + j, each seeing the row's columns up to its own."""
        P = x.shape[1]
        pos = n[:, None] + torch.arange(P, device=n.device)[None, :]  # [B, P]
        mask = torch.arange(L, device=n.device)[None, None, :] <= pos[:, :, None]  # [B, P, L]
        B = x.shape[0]
        out, _, _ = self.head(x, tok, pos, None, mask[:, None], target_features=True,
                              into=(self.k[:B, :, :L], self.v[:B, :, :L], pos))
        return out

    def _run_catch_up(self, st: dict) -> torch.Tensor:
        return self._catch_up_pass(st["x"], st["tok"], st["at"], st["L"])

    # ------------------------------------------------------------------ draft positions

    def drafting(self, kmax: int):
        """A chain of up to kmax draft positions for every row: returns the first draft
        logits [B, Dv] (from each row's newest output) and a function step(out, toks, i) ->
        (out [B, 1, H], logits [B, Dv]) running draft position i's pass (every row's draft
        entry i at column n_b + i, seeing its committed entries and its drafts up to i)."""
        B = self.rows
        dev = self.head.device
        static = self.static
        Bb = bucket_of(B, ROW_BUCKETS) if static else B
        need = max(self.lengths) + kmax
        L = span_bucket(need, HEAD_SPAN_BUCKET) if static else need
        self._room(Bb, L)
        out0 = self.out[:B].unsqueeze(1)  # [B, 1, H]
        first = self.head.draft_logits(self.out[:B])
        if kmax <= 1:
            return out0, first, None
        n_h = torch.tensor(self.lengths + [0] * (Bb - B), dtype=torch.long)
        if not static:
            n = to_device(n_h, dev)

            def step(out, toks, i):
                self.written += B
                return self._draft_pass(out, toks.view(B, 1), n + i, L)

            return out0, first, step
        st, _ = self._shape(("draft", Bb, L), lambda: {
            "out": torch.zeros(Bb, 1, self.out.shape[1], dtype=self.out.dtype, device=dev),
            "tok": torch.zeros(Bb, 1, dtype=torch.long, device=dev),
            "n": torch.zeros(Bb, dtype=torch.long, device=dev),
            "i": torch.zeros(1, dtype=torch.long, device=dev),
            "at": torch.zeros(Bb, dtype=torch.long, device=dev), "L": L})
        st["n"].copy_(to_device(n_h, dev))

        def static_step(out, toks, i):
            st["out"][:B] = out
            st["tok"][:B, 0] = toks
            st["i"].fill_(i)
            self.written += Bb
            res = self._replay(st, self._run_draft, "res")
            return res[0][:B], res[1][:B]

        return out0, first, static_step

    def _draft_pass(self, out: torch.Tensor, tok: torch.Tensor, pos: torch.Tensor, L: int):
        """Every row's draft entry at column pos[b] (its head position), seeing columns <= it."""
        mask = torch.arange(L, device=pos.device)[None, :] <= pos[:, None]  # [B, L]
        B = out.shape[0]
        at = pos[:, None]
        new, _, _ = self.head(out, tok, at, None, mask[:, None, None], target_features=False,
                              into=(self.k[:B, :, :L], self.v[:B, :, :L], at))
        return new, self.head.draft_logits(new[:, 0])

    def _run_draft(self, st: dict):
        st["at"].copy_(st["n"] + st["i"])
        return self._draft_pass(st["out"], st["tok"], st["at"], st["L"])
