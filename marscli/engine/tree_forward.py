"""Tree drafts (EAGLE-2-style dynamic trees): the tree, and one target forward over all of it.

The rules walked over a tree live in the rulebook (``marscli.verification.tree.verify_tree``). A
tree step is ``SlotCache.forward`` (marscli.models.slots) with ``tree_block``'s inputs, eager,
static or captured as the engine's plan says; keeping only the accepted path in the cache
afterwards is ``SlotCache.keep_path``.

Words are those of marscli.verification.chain (target, drafter, step, accepted, relaxed, correction, bonus,
margin statistic, theta, relaxable). A tree adds:

- **root**: the last committed token, not yet in the KV cache; it is fed first and its logits
  row (row 0) scores the root's children.
- **node** i: a draft token; its row i + 1 scores node i's children. Siblings are in priority
  order: a lower index is the drafter's preferred choice.
- **path**: the accepted nodes, root to leaf; verifying a chain tree (``DraftTree.chain``) gives
  exactly what ``marscli.verification.chain.verify`` gives for the same drafts.

The tree's mask is the slot cache's (``marscli.models.slots.attention_mask``: bool for sdpa, additive
for eager attention, which adds the mask to the scores) with the ancestor block in place of the
chain's triangle; ``position_ids`` are past_len + depth, so a path's keys carry the positions
its chain would. Sliding-window layers would get the tree mask too and lose their window, and
their cache layers drop old positions: trees are refused for such models (ValueError).
"""

from __future__ import annotations

import torch

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


def tree_block(tree: DraftTree, root_token: int, past_len: int, device
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A tree step's inputs for a slot cache (marscli.models.slots, which writes root + nodes at
    past_len .. past_len + N and masks the cache itself): input_ids [1, N+1], position_ids
    [1, N+1] (past_len + depth) and the ancestor mask [1, N+1, N+1] bool (ancestors and self)."""
    ids = torch.tensor([root_token] + tree.token_list, dtype=torch.long)
    pos = torch.tensor([past_len] + [past_len + d for d in tree.depth_list()], dtype=torch.long)
    return ids[None].to(device), pos[None].to(device), tree.ancestor_mask()[None].to(device)


def check_tree_support(model) -> None:
    """Raise ValueError when a tree forward would not be exact for `model`."""
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
