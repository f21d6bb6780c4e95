"""Tree drafts (EAGLE-2-style dynamic trees): one target forward over a whole draft tree, the
verification rules of marscli.verify walked over the tree, and the cache compaction after.

Words are those of marscli.verify (target, drafter, step, accepted, relaxed, correction, bonus,
margin statistic, theta, relaxable). A tree adds:

- **root**: the last committed token, not yet in the KV cache; it is fed first and its logits
  row (row 0) scores the root's children.
- **node** i: a draft token; its row i + 1 scores node i's children. Siblings are in priority
  order: a lower index is the drafter's preferred choice.
- **path**: the accepted nodes, root to leaf; verifying a chain tree (``DraftTree.chain``) gives
  exactly what ``marscli.verify.verify`` gives for the same drafts.

transformers 5 and a custom 4D mask (what ``tree_inputs`` builds and why):

- ``masking_utils.create_causal_mask`` (and the sliding-window variant) returns a 4D tensor mask
  untouched, so the mask goes straight to the attention function.
- sdpa accepts a bool mask (True = attend) or an additive float one; **eager adds the mask to the
  scores**, so a bool mask there is silently wrong (True adds 1, False adds 0). An additive float
  mask in the model's dtype (0 = attend, ``finfo(dtype).min`` = hidden, as transformers' own
  ``eager_mask`` does) is right for both.
- ``position_ids`` must be passed: without them the model numbers the tree block
  past_len .. past_len + N as if it were a chain.
- Sliding-window layers would get the tree mask too and lose their window, and their cache
  layers drop old positions: trees are refused for such models (ValueError).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import torch

from marscli.verify import (
    LOGIT_RATIO,
    _residual,
    margin_statistic,
    sample_from,
    sampling_probs,
    strict_sampling_accepts,
    top2,
)

#: Parent index of the root's children.
ROOT = -1

#: Attention implementations known to take the additive 4D float mask as is.
#: marscli_gqa_sdpa is marscli's CPU attention (marscli.fastpath): torch's SDPA, which takes
#: the same additive float mask.
TREE_ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "marscli_gqa_sdpa")

#: Cache layer types (transformers' ``layer_types``) a tree forward is exact for.
FULL_ATTENTION = "full_attention"
SLIDING_LAYER_TYPES = ("sliding_attention", "chunked_attention", "hybrid_sliding",
                       "reference_sliding_attention")


# ----------------------------------------------------------------------------- the tree


@dataclass
class DraftTree:
    """A draft tree: node i holds ``tokens[i]`` and hangs under ``parents[i]`` (ROOT = the root).

    ``parents[i] < i``, so index order is a topological order (every parent before its
    children) and siblings appear in the drafter's priority order.
    """

    tokens: torch.Tensor  # [N] long: each node's draft token (target vocabulary ids)
    parents: torch.Tensor  # [N] long: parent node index, ROOT for the root's children

    def __post_init__(self) -> None:
        self.tokens = torch.as_tensor(self.tokens, dtype=torch.long)
        self.parents = torch.as_tensor(self.parents, dtype=torch.long)
        assert self.tokens.dim() == 1, f"tokens must be [N], got {tuple(self.tokens.shape)}"
        assert self.parents.shape == self.tokens.shape, (
            f"parents {tuple(self.parents.shape)} must match tokens {tuple(self.tokens.shape)}"
        )
        idx = torch.arange(len(self.parents))
        bad = (self.parents >= idx) | (self.parents < ROOT)
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            raise ValueError(
                f"node {i} has parent {int(self.parents[i])}: a parent must be ROOT ({ROOT}) or "
                "an earlier node"
            )

    def __len__(self) -> int:
        return int(self.tokens.numel())

    @staticmethod
    def chain(tokens: list[int]) -> DraftTree:
        """A path (the chain case): node i is the child of node i - 1."""
        n = len(tokens)
        return DraftTree(torch.tensor(tokens, dtype=torch.long).reshape(n),
                         torch.arange(n, dtype=torch.long) - 1)

    def depth(self) -> torch.Tensor:
        """[N] long: 1 for the root's children, parent's depth + 1 below."""
        out = [0] * len(self)
        for i, p in enumerate(self.parents.tolist()):
            out[i] = 1 if p == ROOT else out[p] + 1
        return torch.tensor(out, dtype=torch.long)

    def child_lists(self) -> list[list[int]]:
        """All children at once: entry 0 the root's, entry i + 1 node i's (index order).

        Indexed like the logits rows: row r scores the tokens of child_lists()[r].
        """
        out: list[list[int]] = [[] for _ in range(len(self) + 1)]
        for i, p in enumerate(self.parents.tolist()):
            out[p + 1].append(i)
        return out

    def children(self, i: int) -> list[int]:
        """Children of node i (i = ROOT: of the root), in index order."""
        assert ROOT <= i < len(self), f"no node {i} in a tree of {len(self)}"
        return [j for j, p in enumerate(self.parents.tolist()) if p == i]

    def leaves(self) -> list[int]:
        """Nodes without children, in index order."""
        has_child = set(self.parents.tolist())
        return [i for i in range(len(self)) if i not in has_child]

    def path_to(self, i: int) -> list[int]:
        """Node indices from the root's child down to node i (i included)."""
        assert 0 <= i < len(self), f"no node {i} in a tree of {len(self)}"
        parents = self.parents.tolist()
        path = []
        while i != ROOT:
            path.append(i)
            i = parents[i]
        return path[::-1]

    def ancestor_mask(self) -> torch.Tensor:
        """[N+1, N+1] bool over (root, nodes): row r sees column c when c is r or an ancestor
        of r (the root is everyone's ancestor)."""
        n = len(self)
        m = torch.zeros(n + 1, n + 1, dtype=torch.bool)
        m[:, 0] = True
        for i, p in enumerate(self.parents.tolist()):
            m[i + 1] = m[p + 1]  # parents come first, so row p + 1 is complete
            m[i + 1, i + 1] = True
        return m


# ----------------------------------------------------------------------------- target forward


def tree_inputs(
    tree: DraftTree, root_token: int, past_len: int, dtype: torch.dtype, device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Model inputs for one forward over root + all nodes on top of a cache of past_len positions.

    Returns input_ids [1, N+1] (root, then the nodes), position_ids [1, N+1] (past_len for the
    root, past_len + depth for a node) and an additive float attention mask
    [1, 1, N+1, past_len+N+1] in `dtype` (the model's dtype): 0 where a row may look (the whole
    past, its ancestors and itself), finfo(dtype).min elsewhere. Float, not bool, because
    eager attention adds the mask to the scores (see the module docstring).
    """
    assert dtype.is_floating_point, f"the mask is additive: need a float dtype, got {dtype}"
    assert past_len >= 0, f"past_len must be >= 0, got {past_len}"
    n = len(tree)
    ids = torch.cat([torch.tensor([root_token], dtype=torch.long), tree.tokens.cpu()])
    pos = past_len + torch.cat([torch.zeros(1, dtype=torch.long), tree.depth()])
    visible = torch.cat(
        [torch.ones(n + 1, past_len, dtype=torch.bool), tree.ancestor_mask()], dim=1
    )  # [N+1, past_len+N+1]
    hidden = torch.finfo(dtype).min
    mask = torch.zeros(n + 1, past_len + n + 1, dtype=dtype).masked_fill(~visible, hidden)
    return (
        ids.unsqueeze(0).to(device),
        pos.unsqueeze(0).to(device),
        mask[None, None].to(device),
    )


def check_tree_support(model, cache=None) -> None:
    """Raise ValueError when a tree forward would not be exact for `model` (or `cache`)."""
    config = model.config
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs

        layer_types = list(get_layer_types_and_kwargs(text)[0])
    except (ImportError, AttributeError, TypeError):
        layer_types = list(getattr(text, "layer_types", None) or [])
        if getattr(text, "sliding_window", None) is not None and not layer_types:
            layer_types = ["sliding_attention"]
    sliding = [i for i, t in enumerate(layer_types) if t in SLIDING_LAYER_TYPES]
    if cache is not None:
        sliding += [i for i, layer in enumerate(getattr(cache, "layers", []))
                    if getattr(layer, "is_sliding", False) and i not in sliding]
    if sliding:
        raise ValueError(
            "draft trees are not supported for models with sliding-window attention layers "
            f"(layers {sorted(sliding)[:4]}...): the tree mask would replace their window; "
            "use chain drafts"
        )
    other = sorted({t for t in layer_types if t != FULL_ATTENTION})
    if other:
        raise ValueError(
            f"draft trees need full-attention layers only; this model has {other} layers"
        )
    impl = getattr(config, "_attn_implementation", None)
    if impl not in TREE_ATTN_IMPLEMENTATIONS:
        raise ValueError(
            f"draft trees need attn_implementation in {TREE_ATTN_IMPLEMENTATIONS} (a custom 4D "
            f"float mask); this model uses {impl!r}"
        )
    if cache is not None:
        _check_cache_layers(cache)


def _check_cache_layers(cache) -> None:
    from transformers.cache_utils import DynamicLayer

    from marscli.kvcache import GrowingLayer

    for i, layer in enumerate(cache.layers):
        # Subclasses keep extra per-position state (sliding windows, indexer keys, quantized
        # residuals) that a gather of keys/values would leave out of step.
        if type(layer) not in (DynamicLayer, GrowingLayer):
            raise ValueError(
                f"draft trees need a plain DynamicCache; layer {i} is a {type(layer).__name__}"
            )


@torch.inference_mode()
def tree_forward(
    model,
    cache,
    tree: DraftTree,
    root_token: int,
    past_len: int,
    output_hidden_states: bool = False,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
    """One target forward over root + every node with the tree mask.

    `cache` (a DynamicCache) must hold exactly past_len positions; afterwards it holds
    past_len + 1 + N (root, then the nodes in index order) until compact_cache keeps the
    accepted path. Returns float32 logits [N+1, V] (row 0: the root's position, row i + 1:
    node i's) and, if asked, the model's hidden states (a tuple of [1, N+1, H], embeddings
    first) or None.
    """
    check_tree_support(model, cache)
    have = cache.get_seq_length()
    assert have == past_len, f"cache holds {have} positions, past_len says {past_len}"
    ids, pos, mask = tree_inputs(tree, root_token, past_len, model.dtype, model.device)
    out = model(
        input_ids=ids,
        position_ids=pos,
        attention_mask=mask,
        past_key_values=cache,
        use_cache=True,
        output_hidden_states=output_hidden_states,
    )
    logits = out.logits[0].float()  # [N+1, V]
    assert logits.shape[0] == len(tree) + 1, f"logits {tuple(logits.shape)} for {len(tree)} nodes"
    return logits, (tuple(out.hidden_states) if output_hidden_states else None)


def compact_cache(cache, past_len: int, path: list[int]) -> None:
    """Keep the past, the root and the accepted path's nodes (path order); drop the rest.

    Afterwards every layer holds past_len + 1 + len(path) positions, contiguous, as if root and
    path had been fed as a chain (their keys carry the rotary positions past_len + depth, which
    are exactly the chain positions along a path).
    """
    _check_cache_layers(cache)
    # In place, so inference mode: the engine's cache tensors are inference tensors, which
    # refuse in-place writes outside it.
    with torch.inference_mode():
        _compact(cache, past_len, path)


def _compact(cache, past_len: int, path: list[int]) -> None:
    start = past_len + 1  # first tree node's slot
    k = len(path)
    # A path is root-to-leaf, so its indices increase; prefix paths (0, 1, ..., k-1) need only
    # the crop.
    assert all(a < b for a, b in pairwise(path)), f"path {path} is not increasing"
    for layer in cache.layers:
        if not layer.is_initialized:
            continue  # KV-sharing layers hold nothing
        total = layer.keys.shape[-2]
        assert total >= start and all(0 <= i < total - start for i in path), (
            f"cache layer of {total} positions cannot hold path {path} after {start}"
        )
        if path != list(range(k)):
            src = torch.tensor(path, dtype=torch.long, device=layer.keys.device) + start
            # In place, O(len(path)) instead of copying the whole cache: the gather copies the
            # path's entries before the (overlapping) write.
            layer.keys[..., start:start + k, :] = layer.keys[..., src, :]
            layer.values[..., start:start + k, :] = layer.values[..., src, :]
        # A view: the next update concatenates into a fresh tensor anyway.
        layer.keys = layer.keys[..., : start + k, :]
        layer.values = layer.values[..., : start + k, :]


# ----------------------------------------------------------------------------- verification


@dataclass
class TreeVerifyResult:
    """Outcome of verifying one draft tree."""

    path: list[int]  # accepted node indices, root-to-leaf
    next_token: int  # correction (a rejection ended the path) or bonus (ended at a leaf)
    relaxed: list[bool]  # per accepted node: accepted only thanks to MARS
    statistic: torch.Tensor  # [N+1] float32: margin statistic of each row (row 0 = root's)
    relaxable: torch.Tensor  # [N+1] bool: statistic > theta at a row that has children

    @property
    def num_accepted(self) -> int:
        return len(self.path)

    def emitted(self, tree: DraftTree) -> list[int]:
        """Tokens this step emits: the accepted path's tokens, then the next token."""
        return [int(tree.tokens[i]) for i in self.path] + [self.next_token]


def verify_tree(
    tree: DraftTree,
    logits: torch.Tensor,  # [N+1, V] raw target logits: row 0 root's children, row i+1 node i's
    *,
    theta: float,
    margin: str = LOGIT_RATIO,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    u_accept: torch.Tensor | None = None,  # [N] uniforms in [0, 1), one per node
    u_sample: torch.Tensor | None = None,  # [] or [1] uniform in [0, 1) for the next token
) -> TreeVerifyResult:
    """Verify a draft tree: greedy when temperature == 0, else sampling; strict for theta = +inf.

    Greedy: a node is ok when its token is the top-1 at its parent's row, or (MARS) the top-2
    there and that row is relaxable. The accepted path is the longest root path of ok nodes
    (ties: fewer relaxed nodes, then the first in depth-first order with children in index
    order); the next token is the top-1 of the row after it.

    Sampling: walk from the root. At a strict row with distribution p, try the children in index
    order; child x is accepted when u_accept[x's node] < p(x) (a deterministic drafter: one-hot
    q); a rejection sets p to the residual (x zeroed, renormalised) for the next sibling. At a
    relaxable row (MARS) the first child that is the top-1 (else the top-2) with p > 0 is
    accepted outright; if there is none, the correction comes from that row's p itself. A leaf's
    bonus comes from its row's p. With theta = +inf this reproduces the target's law exactly.
    """
    n = len(tree)
    assert logits.dim() == 2 and logits.shape[0] == n + 1, (
        f"logits must be [N+1, V] = [{n + 1}, V], got {tuple(logits.shape)}"
    )
    z1, z2, t1, t2 = top2(logits)  # each [N+1]
    stat = margin_statistic(z1, z2, margin)  # [N+1]
    kids = tree.child_lists()
    has_children = torch.zeros(n + 1, dtype=torch.bool, device=logits.device)
    has_children[tree.parents.to(logits.device) + 1] = True
    relaxable = (stat > theta) & has_children  # +inf theta: never
    if temperature == 0.0:
        path, relaxed, nxt = _greedy(tree, kids, t1.tolist(), t2.tolist(), relaxable.tolist())
    else:
        assert u_accept is not None and u_sample is not None, "sampling needs uniforms"
        assert u_accept.shape == (n,), f"u_accept must be [N] = [{n}], got {tuple(u_accept.shape)}"
        assert u_sample.numel() == 1, f"u_sample must be [] or [1], got {tuple(u_sample.shape)}"
        u_accept, u_sample = u_accept.to(logits.device), u_sample.to(logits.device)
        p = sampling_probs(logits, temperature, top_k, top_p)  # [N+1, V]
        path, relaxed, nxt = _sampling(tree, kids, p, t1.tolist(), t2.tolist(),
                                       relaxable.tolist(), u_accept, u_sample.reshape(1))
    return TreeVerifyResult(path, nxt, relaxed, stat, relaxable)


def _greedy(tree, kids, t1, t2, relaxable) -> tuple[list[int], list[bool], int]:
    """Longest ok path. Nodes are visited in depth-first order (children in index order), so
    the first path found of a given (length, relaxed count) wins its ties."""
    tokens = tree.tokens.tolist()
    parents = tree.parents.tolist()
    best: tuple[int, int] = (0, 0)  # (length, -relaxed count) of the best path so far
    best_path: list[int] = []
    best_relaxed: list[bool] = []
    # stack entries: (node, path to its parent, relaxed flags so far); children pushed reversed
    stack = [(c, [], []) for c in reversed(kids[0])]
    while stack:
        i, path, flags = stack.pop()
        row = parents[i] + 1  # the row that scores node i
        tok = tokens[i]
        if tok == t1[row]:
            was_relaxed = False
        elif tok == t2[row] and relaxable[row]:
            was_relaxed = True
        else:
            continue  # not ok: nothing below it is reachable
        path = path + [i]
        flags = flags + [was_relaxed]
        key = (len(path), -sum(flags))
        if key > best:
            best, best_path, best_relaxed = key, path, flags
        stack.extend((c, path, flags) for c in reversed(kids[i + 1]))
    last_row = best_path[-1] + 1 if best_path else 0
    return best_path, best_relaxed, t1[last_row]


def _sampling(tree, kids, p, t1, t2, relaxable, u_accept, u_sample):
    """The sampling walk (strict rows: sequential rejection over siblings; relaxable rows: MARS)."""
    tokens = tree.tokens.tolist()
    path: list[int] = []
    relaxed: list[bool] = []
    row = 0
    while True:
        children = kids[row]
        p_row = p[row].unsqueeze(0)  # [1, V]
        if not children:
            dist = p_row  # bonus: from the plain target distribution
            break
        if relaxable[row]:
            chosen = None
            for want in (t1[row], t2[row]):
                if p_row[0, want] > 0:
                    chosen = next((c for c in children if tokens[c] == want), None)
                if chosen is not None:
                    break
            if chosen is None:
                dist = p_row  # MARS: the correction comes from p itself, not a residual
                break
            strict_ok = _strict_ok(tokens[chosen], p_row, u_accept[chosen])
            path.append(chosen)
            relaxed.append(not strict_ok)
            row = chosen + 1
            continue
        accepted = None
        for c in children:
            if _strict_ok(tokens[c], p_row, u_accept[c]):
                accepted = c
                break
            # q is one-hot at the rejected token: the residual zeroes it and renormalises
            p_row = _residual(p_row, None, torch.tensor([tokens[c]], device=p_row.device))
        if accepted is None:
            dist = p_row  # correction from the residual left after every sibling
            break
        path.append(accepted)
        relaxed.append(False)
        row = accepted + 1
    nxt = int(sample_from(dist, u_sample)[0])
    return path, relaxed, nxt


def _strict_ok(token: int, p_row: torch.Tensor, u: torch.Tensor) -> bool:
    """Strict check of one token against p_row [1, V] (one-hot q: u < p(x), p(x) > 0)."""
    drafts = torch.tensor([[token]], device=p_row.device)
    return bool(strict_sampling_accepts(drafts, p_row.unsqueeze(1), u.reshape(1, 1))[0, 0])


__all__ = [
    "ROOT",
    "DraftTree",
    "TreeVerifyResult",
    "check_tree_support",
    "compact_cache",
    "tree_forward",
    "tree_inputs",
    "verify_tree",
]

