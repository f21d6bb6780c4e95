"""The engine: one scheduler that decodes every record, batch size 1 being a batch of one.

- ``scheduler``: Engine (rows, refill, the per-step propose -> one target pass -> one
  verification -> one transfer -> commit loop, trees, out-of-memory halving).
- ``sequence``: one record's state (Sequence, its RowSettings, SpecStats, GenerationResult,
  StepObservation for observers such as calibration, RecordFailure).
- ``prompts``: chat template and context-window fitting (PromptEncoder).

``build_engine`` is THE place an engine is made.
"""

from __future__ import annotations

from marscli.config import DraftConfig, VerifyConfig


def build_engine(target, draft_model, verify_cfg: VerifyConfig, draft_cfg: DraftConfig,
                 batch_size: int = 1):
    """An Engine for target with the drafter draft_cfg asks for (draft_model: the loaded draft
    model or EAGLE-3 head; None for ngram/none), verify_cfg's rule and batch_size rows.
    Raises UsageError for what the engine cannot run (trees or sliding-window models at
    batch size > 1)."""
    from marscli.drafters.factory import build_drafters
    from marscli.engine.scheduler import Engine
    from marscli.errors import UsageError

    drafters = build_drafters(draft_cfg, target, draft_model, batch_size=batch_size)
    try:
        return Engine(target, drafters, verify_cfg.rule, draft_cfg, batch_size, guard=verify_cfg.guard)
    except ValueError as e:
        raise UsageError(str(e)) from None
