"""Making drafters: THE place a DraftConfig becomes the drafter an engine runs with."""

from __future__ import annotations

from marscli.config import DraftConfig
from marscli.drafters.base import BatchedDrafter, Drafter, RowDrafters
from marscli.drafters.eagle3 import BatchedEagle3Drafter, Eagle3Drafter, TreeShape
from marscli.drafters.hybrid import HybridDrafter
from marscli.drafters.kinds import EAGLE3, MODEL, NGRAM, NONE
from marscli.drafters.model import BatchedModelDrafter, ModelDrafter, SiblingTree
from marscli.drafters.ngram import JobCorpus, NgramDrafter, NoDrafter
from marscli.models.fastpath import install_cpu_fastpath, install_folded_gqa_attention
from marscli.models.quant import output_rows
from marscli.models.slots import supports as supports_slots


def _tree_shape(draft_cfg: DraftConfig):
    """The tree the drafter drafts (None: chains): an EAGLE-2 dynamic tree for an EAGLE-3
    head, a chain with sibling leaves for a draft model (hybrid included)."""
    if not draft_cfg.tree:
        return None
    if draft_cfg.sibling_tree:
        return SiblingTree(draft_cfg.num_draft_tokens, draft_cfg.tree_top_k, draft_cfg.tree_tokens)
    return TreeShape(draft_cfg.tree_depth, draft_cfg.tree_top_k, draft_cfg.tree_tokens)


def build_drafter(draft_cfg: DraftConfig, target, draft_model=None, corpus=None) -> Drafter:
    """One record's drafter for draft_cfg (draft_model: a LoadedModel for kind "model", an
    EAGLE-3 head for kind "eagle3"; corpus: the job's JobCorpus, for kind "ngram" and hybrid
    drafting)."""

    vocab = output_rows(target.model)
    if draft_cfg.kind == EAGLE3:
        if draft_model is None:
            raise ValueError("an EAGLE-3 drafter needs a loaded head (marscli.drafters.eagle3_files.load_head)")
        head = getattr(draft_model, "head", draft_model)
        return Eagle3Drafter(head, draft_cfg.num_draft_tokens, vocab_size=vocab, tree=_tree_shape(draft_cfg))
    if draft_cfg.kind == NONE:
        return NoDrafter()
    if draft_cfg.kind == NGRAM:
        return NgramDrafter(draft_cfg.num_draft_tokens, ngram_max=draft_cfg.ngram_max,
                            ngram_min=draft_cfg.ngram_min, corpus=corpus)
    if draft_model is None:
        raise ValueError("a model drafter needs a loaded draft model")
    if draft_model.device.type == "cpu":
        install_cpu_fastpath(draft_model.model)
    elif draft_model.device.type == "cuda":
        install_folded_gqa_attention(draft_model.model)
    model = ModelDrafter(draft_model.model, draft_cfg.num_draft_tokens, vocab_size=vocab,
                         tree=_tree_shape(draft_cfg), context=draft_cfg.context)
    if not draft_cfg.hybrid:
        return model
    ngram = NgramDrafter(draft_cfg.num_draft_tokens, ngram_max=draft_cfg.ngram_max,
                         ngram_min=draft_cfg.ngram_min, corpus=corpus)
    return HybridDrafter(ngram, model)


def build_drafters(draft_cfg: DraftConfig, target, draft_model=None, *, batch_size: int = 1,
                   job_corpus: bool = False, batched_model: bool = False) -> BatchedDrafter:
    """The BatchedDrafter for an engine: at batch size > 1 a draft model (one a slot cache
    can hold: marscli.models.slots.supports) or an EAGLE-3 head drafting chains drafts for all rows in one pass
    per position; everything else (and every drafter at batch size 1) runs one drafter per
    row. job_corpus: n-gram drafters share a JobCorpus of the job's finished records.
    Hybrid drafting (an n-gram drafter and a draft model per row) runs one drafter per row at
    every batch size.
    batched_model: a draft model drafts through BatchedModelDrafter, and an EAGLE-3 head's
    chains through BatchedEagle3Drafter, at batch size 1 too (their steps are static or
    captured when the engine's are: Engine.step_kind)."""
    one = build_drafter(draft_cfg, target, draft_model)
    if (batch_size > 1 or batched_model) and draft_cfg.kind == EAGLE3 and not draft_cfg.tree:
        return BatchedEagle3Drafter(one.head, one.k_max, vocab_size=one.vocab_size)
    if ((batch_size > 1 or batched_model) and draft_cfg.kind == MODEL and not draft_cfg.hybrid and not draft_cfg.tree
            and supports_slots(draft_model.model)):
        # (a model slots cannot hold, e.g. with windowed layers: a ModelDrafter per row)
        return BatchedModelDrafter(one.model, one.k_max, vocab_size=one.vocab_size, context=draft_cfg.context)
    corpus = None
    if job_corpus and (draft_cfg.kind == NGRAM or draft_cfg.hybrid):
        corpus = JobCorpus(draft_cfg.ngram_max, draft_cfg.ngram_min)
    return RowDrafters(lambda: build_drafter(draft_cfg, target, draft_model, corpus),
                       feature_layers=one.feature_layers, tree=_tree_shape(draft_cfg), corpus=corpus)
