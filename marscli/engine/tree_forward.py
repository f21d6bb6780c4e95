"""Tree drafts (EAGLE-2-style dynamic trees): the tree, and one target forward over all of it.

The rules walked over a tree live in the rulebook (``marscli.verification.tree.verify_tree``); keeping only
the accepted path in the cache afterwards is ``compact_cache`` (marscli.models.kvcache: the contiguous
cache of an eager step at batch size 1) or ``SlotCache.keep_path`` (marscli.models.slots: a static or
captured step, whose tree forward is ``SlotCache.forward`` with ``tree_block``'s inputs). Both are
``keep_path`` on the engine's cache.

Words are those of marscli.verification.chain (target, drafter, step, accepted, relaxed, correction, bonus,
margin statistic, theta, relaxable). A tree adds:

- **root**: the last committed token, not yet in the KV cache; it is fed first and its logits
  row (row 0) scores the root's children.
- **node** i: a draft token; its row i + 1 scores node i's children. Siblings are in priority
  order: a lower index is the drafter's preferred choice.
- **path**: the accepted nodes, root to leaf; verifying a chain tree (``DraftTree.chain``) gives
  exactly what ``marscli.verification.chain.verify`` gives for the same drafts.

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

import torch

from marscli.models.kvcache import cache_kw, check_plain_layers
from marscli.verification.tree import DraftTree

#: Attention implementations known to take the additive 4D float mask as is.
#: marscli_gqa_sdpa and marscli_f64_sdpa are marscli's CPU attentions (marscli.models.fastpath, and
#: int8 models' float64 one in marscli.models.quant): torch's SDPA, which takes the same additive
#: float mask.
TREE_ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "marscli_gqa_sdpa", "marscli_f64_sdpa")

#: Cache layer types (transformers' ``layer_types``) a tree forward is exact for.
FULL_ATTENTION = "full_attention"
SLIDING_LAYER_TYPES = ("sliding_attention", "chunked_attention", "hybrid_sliding",
                       "reference_sliding_attention")


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
    ids, pos, block = tree_block(tree, root_token, past_len, "cpu")
    visible = torch.cat(
        [torch.ones(n + 1, past_len, dtype=torch.bool), block[0]], dim=1
    )  # [N+1, past_len+N+1]
    hidden = torch.finfo(dtype).min
    mask = torch.zeros(n + 1, past_len + n + 1, dtype=dtype).masked_fill(~visible, hidden)
    return ids.to(device), pos.to(device), mask[None, None].to(device)


def tree_block(tree: DraftTree, root_token: int, past_len: int, device
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A tree step's inputs for a slot cache (marscli.models.slots, which writes root + nodes at
    past_len .. past_len + N and masks the cache itself): input_ids [1, N+1], position_ids
    [1, N+1] (past_len + depth) and the ancestor mask [1, N+1, N+1] bool (ancestors and self)."""
    ids = torch.tensor([root_token] + tree.token_list, dtype=torch.long)
    pos = torch.tensor([past_len] + [past_len + d for d in tree.depth_list()], dtype=torch.long)
    return ids[None].to(device), pos[None].to(device), tree.ancestor_mask()[None].to(device)


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
        check_plain_layers(cache)


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
        **cache_kw(model, cache),
        use_cache=True,
        output_hidden_states=output_hidden_states,
    )
    logits = out.logits[0].float()  # [N+1, V]
    assert logits.shape[0] == len(tree) + 1, f"logits {tuple(logits.shape)} for {len(tree)} nodes"
    return logits, (tuple(out.hidden_states) if output_hidden_states else None)
