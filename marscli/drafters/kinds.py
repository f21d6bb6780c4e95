"""The drafter kinds, declared once: their names (``DraftConfig.kind``, ``--draft``, profiles'
``drafter.kind``) and what each one is (a model to load? does it read the target's hidden
states? can it draft trees?). Everything that asks "which drafter?" asks this table instead
of comparing strings.

Pure data: no torch, nothing else of marscli imported (the base layer, like
marscli.verification.registry), so marscli.config builds on it and ``--help`` stays fast.
"""

from __future__ import annotations

from dataclasses import dataclass

NONE = "none"
NGRAM = "ngram"
MODEL = "model"
EAGLE3 = "eagle3"


@dataclass(frozen=True)
class DrafterKind:
    name: str
    summary: str
    drafts: bool = True  # proposes tokens at all (none: plain autoregressive decoding)
    model: bool = False  # a draft model or head is loaded for it (its weights identify it)
    features: bool = False  # drafts from the target's hidden states (an EAGLE-3 head)
    trees: bool = False  # can draft a tree (--tree-*)
    hybrid: bool = False  # may run beside prompt lookup (--draft ngram+MODEL)


DRAFTERS: dict[str, DrafterKind] = {d.name: d for d in (
    DrafterKind(NONE, "plain autoregressive decoding", drafts=False),
    DrafterKind(NGRAM, "prompt lookup"),
    DrafterKind(MODEL, "a draft model", model=True, trees=True, hybrid=True),
    DrafterKind(EAGLE3, "an EAGLE-3 head drafting from the target's hidden states", model=True,
                features=True, trees=True),
)}
DRAFTER_KINDS = tuple(DRAFTERS)
#: The kinds a calibrated profile can be made for (a profile describes some drafter's drafts).
PROFILE_KINDS = tuple(k for k, d in DRAFTERS.items() if d.drafts)


def drafter_kind(name: str) -> DrafterKind:
    """The table's entry for ``name`` (ValueError naming the kinds for another name)."""
    if name not in DRAFTERS:
        raise ValueError(f"unknown drafter kind {name!r}; expected one of {DRAFTER_KINDS}")
    return DRAFTERS[name]
