"""Prefill: the prompts of records that join in one step, run together, over a cache of
shared prefixes.

- ``PrefixCache``: a radix tree keyed on token ids whose nodes hold the keys/values (and, for
  a drafter that reads them, the target features) of their tokens. A new prompt reuses the
  longest cached prefix and prefills only the rest; every prefilled prompt is inserted.
  Bounded in bytes; the least recently used leaves go first.
- ``Prefiller``: the joiners of one refill in as few forward passes as their token budget
  allows (rows sorted by length so that padding stays small), each row over its own cached
  prefix. A prefix that several joiners share and the cache lacks is prefilled once first
  (the few-shot examples of a whole batch of questions; the n choices of one request).

Joining alternates with decoding (vLLM's first scheduler, not chunked prefill): a refill runs
its prefill passes, then the step runs. On a CPU a forward is compute-bound, so mixing a
prefill into a decode pass would save no work; the token budget bounds how long one pass
stalls the decoding rows. A row's logits do not depend on who it was prefilled with nor on
whether its prefix came from the cache, up to float rounding of batched kernels
(docs/verification.md, "The reproducibility contract").
"""

from __future__ import annotations

import heapq
import itertools
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Callable

import torch

from marscli.config import DEFAULT_PREFIX_CACHE_MIB  # noqa: F401 - the engine's default, re-exported
from marscli.models.kvcache import GrowingLayer, cache_kw, new_cache
from marscli.models.slots import RUN_ATTENTION, attention_implementation, attention_mask, supports

MIB = 1 << 20
#: A draft model's own prefix cache (its keys/values are a fraction of the target's).
DRAFT_PREFIX_CACHE_MIB = 128
#: Most padded prompt tokens (rows x longest prompt) one prefill pass runs: a longer pass
#: stalls the decoding rows longer and, on a CPU, runs no faster per token.
PREFILL_TOKENS = {"cpu": 1024}
PREFILL_TOKENS_ACCELERATOR = 8192
#: Joiners that share at least this many tokens beyond the cache's match get that shared
#: prefix prefilled once first (below it the second pass costs more than it saves).
MIN_SHARED = 16

#: A layer's keys and values ([1, H, n, D] each), or None for a layer that holds nothing
#: (KV-sharing layers).
LayerKV = "tuple[torch.Tensor, torch.Tensor] | None"


def prefill_budget(device: torch.device) -> int:
    return PREFILL_TOKENS.get(device.type, PREFILL_TOKENS_ACCELERATOR)


def _common(a: tuple[int, ...], ids: list[int], start: int) -> int:
    n = min(len(a), len(ids) - start)
    i = 0
    while i < n and a[i] == ids[start + i]:
        i += 1
    return i


class _Node:
    __slots__ = ("tokens", "kv", "features", "children", "parent", "last", "removed")

    def __init__(self, tokens: tuple[int, ...], kv: list | None, features: torch.Tensor | None, parent):
        self.tokens = tokens
        self.kv = kv  # per layer LayerKV over these tokens
        self.features = features  # [len(tokens), F] or None
        self.children: dict[int, _Node] = {}
        self.parent = parent
        self.last = 0
        self.removed = False

    def nbytes(self) -> int:
        n = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in
                (p for p in (self.kv or []) if p is not None))
        if self.features is not None:
            n += self.features.numel() * self.features.element_size()
        return n


def _slice(kv: list, lo: int, hi: int | None) -> list:
    """Positions [lo, hi) of per-layer keys/values [1, H, n, D], as owned copies."""
    return [None if p is None else (p[0][:, :, lo:hi].clone(), p[1][:, :, lo:hi].clone()) for p in kv]


class PrefixCache:
    """Recent prompts' keys/values as a radix tree over token ids, bounded to `capacity` bytes.

    ``match(ids)`` gives the longest cached prefix of ids (its keys/values per layer
    [1, H, m, D], concatenated from the nodes on its path, and its features [m, F] when the
    cache holds them); ``insert(ids, kv, features)`` stores what is new of a prefilled prompt
    (a node is split where prompts part). Eviction removes the least recently used leaf until
    the cache fits again; a node whose children are all gone becomes a leaf itself.
    """

    def __init__(self, capacity_bytes: int, *, features: bool = False):
        self.capacity = max(int(capacity_bytes), 0)
        self.features = features
        self.clear()

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def clear(self) -> None:
        self.root = _Node((), None, None, None)
        self.nbytes = 0
        self.nodes = 0
        self._tick = itertools.count(1)
        self._heap: list[tuple[int, int, _Node]] = []  # (last use, tie, leaf): lazily invalidated
        self._tie = itertools.count()
        self.evicted_tokens = 0

    # ------------------------------------------------------------------ reading

    def _walk(self, ids: list[int]) -> list[tuple[_Node, int]]:
        """The nodes along ids, each with how many of its tokens ids follows."""
        node, i, path = self.root, 0, []
        while i < len(ids):
            child = node.children.get(ids[i])
            if child is None:
                break
            c = _common(child.tokens, ids, i)
            path.append((child, c))
            if c < len(child.tokens):
                break
            node, i = child, i + c
        return path

    def lookup(self, ids: list[int]) -> int:
        """How many leading tokens of ids the cache holds (nothing is touched)."""
        return sum(c for _, c in self._walk(ids)) if self.enabled else 0

    def match(self, ids: list[int]) -> tuple[int, list | None, torch.Tensor | None]:
        """(m, keys/values per layer [1, H, m, D], features [m, F] or None) of the longest
        cached prefix of ids; (0, None, None) when none."""
        if not self.enabled:
            return 0, None, None
        path = self._walk(ids)
        m = sum(c for _, c in path)
        if m == 0:
            return 0, None, None
        for node, _ in path:
            self._touch(node)
        layers = len(path[0][0].kv)
        kv = []
        for li in range(layers):
            if path[0][0].kv[li] is None:
                kv.append(None)
                continue
            ks = [n.kv[li][0][:, :, :c] for n, c in path]
            vs = [n.kv[li][1][:, :, :c] for n, c in path]
            kv.append((torch.cat(ks, 2), torch.cat(vs, 2)))
        feats = torch.cat([n.features[:c] for n, c in path], 0) if self.features else None
        return m, kv, feats

    # ------------------------------------------------------------------ writing

    def insert(self, ids: list[int], kv: list, features: torch.Tensor | None = None) -> None:
        """Store prompt ids whose keys/values are kv (per layer [1, H, len(ids), D], views are
        fine: what is stored is copied) and features [len(ids), F] (when the cache keeps them)."""
        if not self.enabled or not ids:
            return
        assert (features is not None) == self.features, "features must come with every insert or none"
        node, i = self.root, 0
        for child, c in self._walk(ids):
            if c < len(child.tokens):
                if i + c == len(ids):  # ids end inside this node: nothing new to store
                    self._touch(child)
                    return
                child = self._split(child, c)  # ids part from it here
            node, i = child, i + c
            self._touch(node)
        if i < len(ids):
            leaf = _Node(tuple(ids[i:]), _slice(kv, i, len(ids)),
                         None if features is None else features[i:].clone(), node)
            node.children[ids[i]] = leaf
            self.nbytes += leaf.nbytes()
            self.nodes += 1
            self._touch(leaf)
        self._evict()

    def _split(self, node: _Node, c: int) -> _Node:
        """Cut node after its first c tokens; returns the new upper part."""
        before = node.nbytes()
        upper = _Node(node.tokens[:c], _slice(node.kv, 0, c),
                      None if node.features is None else node.features[:c].clone(), node.parent)
        upper.last = node.last
        node.parent.children[node.tokens[0]] = upper
        node.tokens, node.kv = node.tokens[c:], _slice(node.kv, c, None)
        if node.features is not None:
            node.features = node.features[c:].clone()
        node.parent = upper
        upper.children[node.tokens[0]] = node
        self.nbytes += upper.nbytes() + node.nbytes() - before
        self.nodes += 1
        return upper

    def _touch(self, node: _Node) -> None:
        node.last = next(self._tick)
        if not node.children:
            heapq.heappush(self._heap, (node.last, next(self._tie), node))

    def _evict(self) -> None:
        while self.nbytes > self.capacity and self._heap:
            last, _, node = heapq.heappop(self._heap)
            if node.removed or node.children or last != node.last:
                continue  # stale: touched again since, no longer a leaf, or gone
            node.removed = True
            del node.parent.children[node.tokens[0]]
            self.nbytes -= node.nbytes()
            self.nodes -= 1
            self.evicted_tokens += len(node.tokens)
            parent = node.parent
            if parent is not self.root and not parent.children:
                heapq.heappush(self._heap, (parent.last, next(self._tie), parent))
        if len(self._heap) > 4 * self.nodes + 64:  # drop stale entries now and then
            self._heap = [e for e in self._heap if not e[2].removed and not e[2].children
                          and e[0] == e[2].last]
            heapq.heapify(self._heap)


def shared_prefixes(prompts: list[list[int]], cache: PrefixCache, min_shared: int = MIN_SHARED) -> list[list[int]]:
    """Prefixes that two or more prompts share, at least min_shared tokens longer than what
    the cache holds of them: one per run of neighbours (in sorted order) sharing that much,
    the run's common prefix."""
    order = sorted(range(len(prompts)), key=lambda i: prompts[i])
    out: list[list[int]] = []
    run_len = None  # the current run's common prefix length
    for a, b in zip(order, order[1:]):
        pa, pb = prompts[a], prompts[b]
        c = _common(tuple(pa), pb, 0)
        if c >= min_shared:
            run_len = c if run_len is None else min(run_len, c)
            continue
        if run_len is not None:
            out.append(pa[:run_len])
        run_len = None
    if run_len is not None:
        out.append(prompts[order[-1]][:run_len])
    return [p for p in out if len(p) - cache.lookup(p) >= min_shared]


def layer_costs(model) -> tuple[int | None, int | None]:
    """(multiply-adds of one token through a decoder layer's weight matrices, of one query-key
    pair through its attention: scores and values, every query head), from the first decoder
    layer and the config; (None, None) when the model does not say."""
    config = getattr(model, "config", None)
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    heads = getattr(config, "num_attention_heads", None)
    if not layers or not heads:
        return None, None
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    weights = sum(t.numel() for t in (*layers[0].parameters(), *layers[0].buffers()) if t.dim() == 2)
    return weights, 2 * heads * head_dim


@dataclass
class RowPrefill:
    """One prefilled prompt: its keys/values (per layer LayerKV [1, H, length, D]; None when
    length is 0), its target features [length, F] (None when nobody reads them), how
    many of its tokens came from the prefix cache, and the target's logits [V] at its last
    position (when the prefill was asked for them: the record's first output position)."""

    kv: list | None
    length: int
    features: torch.Tensor | None
    reused: int
    logits: torch.Tensor | None = None


@contextmanager
def last_positions(model, rows: torch.Tensor, at: torch.Tensor):
    """Inside: the model's output embedding (lm_head) reads only position at[b] of row rows[b]
    ([n] long each), so a forward's logits are [n, 1, V], each prompt's at its own last token
    (wherever padding or packing put it), whatever the model does after the head (Gemma's
    soft cap)."""
    head = model.get_output_embeddings()

    def gather(_module, args):
        hidden = args[0]  # [rows, S, H]
        return (hidden[rows, at].unsqueeze(1),) + args[1:]

    handle = head.register_forward_pre_hook(gather)
    try:
        yield
    finally:
        handle.remove()


class Prefiller:
    """Prefills the prompts of joining rows for one model: batched, over the prefix cache.

    run(forward) wraps each model call (the engine captures target features there) and
    features() then gives that pass's features [n, S, F] (None when none are captured)."""

    def __init__(self, model, device, cache: PrefixCache, pad_id: int = 0, *,
                 features: Callable[[], torch.Tensor | None] = lambda: None, budget: int | None = None,
                 packing: bool = False):
        self.model = model
        self.device = device
        self.cache = cache
        self.pad_id = pad_id
        self.features = features
        self.budget = budget or prefill_budget(torch.device(device))
        #: multiply-adds per layer of a token through the linear layers, and of a query-key
        #: pair through attention; None: passes are never packed (packing off, or a model whose
        #: attention takes no 4D mask)
        self.token_cost = self.pair_cost = None
        if packing and supports(model):
            self.token_cost, self.pair_cost = layer_costs(model)
        #: packed passes attend prompt by prompt (``packed_segments``: each over its own prefix
        #: and rest, not the whole row through a mask): an attention that takes them
        self.segmented = self.pair_cost is not None and attention_implementation(model) in RUN_ATTENTION
        self.reset_counters()

    def reset_counters(self) -> None:
        self.passes = 0  # prefill forward passes run
        self.tokens = 0  # prompt tokens those passes computed (padding not counted)
        self.padded = 0  # padding positions they computed
        self.reused = 0  # prompt tokens that came from the prefix cache

    def prefill(self, prompts: list[list[int]], run: Callable[[Callable[[], Any]], Any] | None = None,
                *, logits: bool = False) -> list[RowPrefill]:
        """Every prompt's keys/values (and features), in the prompts' order; with `logits`,
        the target's logits at each prompt's last position too (every prompt then computes
        at least its last token, cached or not)."""
        run = run or (lambda f: f())
        if self.cache.enabled and len(prompts) > 1:
            shared = shared_prefixes(prompts, self.cache)
            if shared:  # computed once, inserted, and matched below like any cached prefix
                self._passes(shared, run, keep=False)
        return self._passes(prompts, run, keep=True, logits=logits)

    def _passes(self, prompts: list[list[int]], run, keep: bool, logits: bool = False) -> list[RowPrefill]:
        done: list[RowPrefill | None] = [None] * len(prompts)
        # with logits, a prompt's last token is always computed (its logits are the point)
        reuse = [self.cache.lookup(p[:-1] if logits else p) for p in prompts]
        todo = []
        first: dict[tuple[int, ...], int] = {}
        copies: list[tuple[int, int]] = []  # (row, the row with the same prompt that computes it)
        for i, (p, m) in enumerate(zip(prompts, reuse)):
            if m == len(p):  # all cached (or empty): no forward
                if keep:
                    m, kv, feats = self.cache.match(p) if p else (0, None, None)
                    done[i] = RowPrefill(kv, len(p), feats, m)
                    self.reused += m
            elif tuple(p) in first:  # the same prompt twice (the n choices of a request)
                copies.append((i, first[tuple(p)]))
            else:
                first[tuple(p)] = i
                todo.append(i)
        todo.sort(key=lambda i: len(prompts[i]) - reuse[i])
        group: list[int] = []
        for i in todo:
            width = len(prompts[i]) - reuse[i]
            if group and (len(group) + 1) * width > self.budget:
                self._pass([prompts[j] for j in group], group, run, done, keep, logits)
                group = []
            group.append(i)
        if group:
            self._pass([prompts[j] for j in group], group, run, done, keep, logits)
        if keep:
            for i, j in copies:  # its keys/values are the other row's (add_rows copies them)
                r = done[j]
                done[i] = RowPrefill(r.kv, r.length, r.features, r.length, r.logits)
                self.reused += r.length
        return done if keep else []

    def _pass(self, prompts: list[list[int]], where: list[int], run, done: list, keep: bool,
              logits: bool = False) -> None:
        """One forward over these prompts, each after its cached prefix; results into done
        (with `logits`, each row's logits at its last token: the cached prefix stops before
        it). The rows run right-padded to the longest ([n, S]), or packed into one row with
        no padding where the model takes a 4D mask and that costs less (``packs``)."""
        pasts = [self.cache.match(p[:-1] if logits else p) for p in prompts]
        ms = [m for m, _, _ in pasts]
        rests = [p[m:] for p, m in zip(prompts, ms)]
        packed = self.packs(ms, [len(r) for r in rests])
        cache = new_cache(self.model)
        ids, mask, pos, rows, at, shift = (self._packed if packed else self._padded)(cache, pasts, rests)
        kw = {}
        if packed and self.segmented:
            # (its queries' start and count, its prefix's keys' start and count, its rest's keys' start)
            starts = list(itertools.accumulate([0] + ms))
            kw["packed_segments"] = [(int(a), len(r), s0, m, shift + int(a))
                                     for a, r, s0, m in zip(at.tolist(), rests, starts, ms)]
        dev = self.device
        ids, mask, pos = ids.to(dev), mask.to(dev), pos.to(dev)
        # each prompt's last token in the pass: row rows_d[b], position last_d[b]
        rows_d, last_d = rows.to(dev), (at + torch.tensor([len(r) - 1 for r in rests], dtype=torch.long)).to(dev)
        with last_positions(self.model, rows_d, last_d) if logits else nullcontext():
            out = run(lambda: self.model(input_ids=ids, attention_mask=mask, position_ids=pos,
                                         **cache_kw(self.model, cache), use_cache=True,
                                         logits_to_keep=0 if logits else 1, **kw))
        last_logits = None
        if logits:
            last_logits = out.logits  # [n, 1, V]; a head no hook reached gives every position
            if last_logits.shape[:2] != (len(prompts), 1):
                last_logits = last_logits[rows_d, last_d].unsqueeze(1)
        feats = self.features()  # [the pass's rows, its width, F] or None
        self.passes += 1
        real = sum(len(r) for r in rests)
        self.tokens += real
        self.padded += ids.numel() - real
        for b, (p, (m, past, past_f), r) in enumerate(zip(prompts, pasts, rests)):
            row, lo = int(rows[b]), int(at[b]) + shift  # where its rest's keys/values are
            hi = lo + len(r)
            if not packed:
                lo -= m  # its cached prefix sits right before them in the row
            kv = []
            for li, layer in enumerate(cache.layers):
                if not layer.is_initialized or layer.keys is None:
                    kv.append(None)
                    continue
                k, v = layer.keys[row: row + 1, :, lo: hi], layer.values[row: row + 1, :, lo: hi]
                if packed and m:  # owned copies, prefix first (the prefix cache's own tensors)
                    k, v = torch.cat([past[li][0], k], 2), torch.cat([past[li][1], v], 2)
                kv.append((k, v))
            f = None
            if feats is not None:
                f = feats[row, int(at[b]): int(at[b]) + len(r)]
                if m:
                    f = torch.cat([past_f, f], 0)
            self.cache.insert(p, kv, f if self.cache.features else None)
            if keep:
                done[where[b]] = RowPrefill(kv, len(p), f, m, None if last_logits is None else last_logits[b, -1])
                self.reused += m

    def packs(self, ms: list[int], rs: list[int]) -> bool:
        """Does a pass over rests of rs tokens after cached prefixes of ms cost less packed into
        one row (no padding; attention over every row's keys, masked) than right-padded to the
        longest (attention over the row's own)? Counted in multiply-adds per layer: the linear
        layers' per token, the attention's per query-key pair."""
        if self.pair_cost is None or len(rs) < 2:
            return False
        S, M, R = max(rs), max(ms), sum(rs)
        padded = len(rs) * S * (self.token_cost + (M + S) * self.pair_cost)
        if self.segmented:  # each prompt's queries over its own keys only
            pairs = sum(r * (m + r) for m, r in zip(ms, rs))
        else:
            pairs = R * (sum(ms) + R)
        packed = R * self.token_cost + pairs * self.pair_cost
        return packed < padded

    def _padded(self, cache, pasts: list, rests: list[list[int]]):
        """A pass's inputs with row b's prefix right-aligned at a common length M and its rest
        right-padded to S: ids [n, S], its 2D mask, position ids, where each rest starts
        (rows, at: [n] each) and how far its keys sit past that (M)."""
        n = len(rests)
        ms = [m for m, _, _ in pasts]
        M, S = max(ms), max(len(r) for r in rests)
        if M:
            self._seed(cache, [(b, M - m, kv) for b, (m, kv, _) in enumerate(pasts) if m], n, M, S)
        mask = torch.zeros(n, M + S, dtype=torch.long)
        ids = torch.full((n, S), self.pad_id, dtype=torch.long)
        for b, (m, r) in enumerate(zip(ms, rests)):
            mask[b, M - m: M + len(r)] = 1
            ids[b, : len(r)] = torch.tensor(r, dtype=torch.long)
        pos = torch.tensor(ms, dtype=torch.long)[:, None] + torch.arange(S)[None, :]
        return ids, mask, pos, torch.arange(n), torch.zeros(n, dtype=torch.long), M

    def _packed(self, cache, pasts: list, rests: list[list[int]]):
        """A pass's inputs packed into one row: every prefix first (P positions), then every
        rest (R), each query seeing its own prompt's prefix and rest up to itself (a 4D mask
        [1, 1, R, P + R]); ids [1, R], position ids, where each rest starts (row 0, at) and
        how far its keys sit past that (P)."""
        ms = [m for m, _, _ in pasts]
        P = sum(ms)
        starts = itertools.accumulate([0] + ms)  # where each prefix begins
        if P:
            self._seed(cache, [(0, o, kv) for o, (m, kv, _) in zip(starts, pasts) if m], 1, P,
                       sum(len(r) for r in rests))
        owner_q = torch.cat([torch.full((len(r),), b, dtype=torch.long) for b, r in enumerate(rests)])
        R = owner_q.numel()
        owner_k = torch.cat([torch.repeat_interleave(torch.arange(len(ms)), torch.tensor(ms)), owner_q])
        order_k = torch.cat([torch.full((P,), -1, dtype=torch.long), torch.arange(R)])
        seen = (owner_k[None, :] == owner_q[:, None]) & (order_k[None, :] <= torch.arange(R)[:, None])
        ids = torch.tensor([t for r in rests for t in r], dtype=torch.long)[None]
        pos = torch.cat([m + torch.arange(len(r)) for m, r in zip(ms, rests)])[None]
        at = torch.tensor([0] + [len(r) for r in rests], dtype=torch.long).cumsum(0)[:-1]
        return ids, attention_mask(self.model, seen[None, None]), pos, torch.zeros(len(rests), dtype=torch.long), at, P

    @staticmethod
    def _seed(cache, placed: list, n: int, M: int, S: int) -> None:
        """Put cached prefixes into [0, M) of n-row buffers with room for S more positions:
        placed holds (row, start, keys/values per layer) per prefix (padding zeros: masked
        out, but 0 x NaN would be NaN)."""
        ref = placed[0][2]
        for li, layer in enumerate(cache.layers):
            if ref[li] is None:
                continue
            k0, v0 = ref[li]
            kbuf = k0.new_zeros(n, k0.shape[1], M + S, k0.shape[3])
            vbuf = v0.new_zeros(n, v0.shape[1], M + S, v0.shape[3])
            for row, start, kv in placed:
                k, v = kv[li]
                kbuf[row, :, start: start + k.shape[2]] = k[0]
                vbuf[row, :, start: start + v.shape[2]] = v[0]
            if isinstance(layer, GrowingLayer):  # the pass appends into the room after M
                layer.adopt(kbuf, vbuf, M)
            else:
                layer.lazy_initialization(kbuf[:, :, :M], vbuf[:, :, :M])
                layer.keys, layer.values = kbuf[:, :, :M], vbuf[:, :, :M]
