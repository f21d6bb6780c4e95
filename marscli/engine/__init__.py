"""The engine: one scheduler that decodes every record, batch size 1 being a batch of one.

- ``scheduler``: Engine (rows, refill, the per-step propose -> one target pass -> one
  verification -> one transfer -> commit loop, trees, out-of-memory halving).
- ``sequence``: one record's state (Sequence, its RowSettings, SpecStats, GenerationResult,
  StepObservation for observers such as calibration, RecordFailure).
- ``prompts``: chat template and context-window fitting (PromptEncoder).

``build_engine`` is THE place an engine is made.
"""

from __future__ import annotations

from marscli.config import RELAX_EVERY, DraftConfig, VerifyConfig
from marscli.drafters.factory import build_drafters
from marscli.drafters.kinds import drafter_kind
from marscli.engine.costs import step_costs
from marscli.engine.scheduler import Engine, step_plan
from marscli.errors import UsageError
from marscli.models.prefill import DEFAULT_PREFIX_CACHE_MIB
from marscli.models.slots import StepPlan
from marscli.verification.registry import STRICT


def build_engine(target, draft_model, verify_cfg: VerifyConfig, draft_cfg: DraftConfig,
                 batch_size: int = 1, note=None, spans=None,
                 job_corpus: bool | None = None, prefix_cache_mib: float = DEFAULT_PREFIX_CACHE_MIB,
                 compile_mode: str = "auto", relax_at: str = RELAX_EVERY, calibrating: bool = False):
    """An Engine for target with the drafter draft_cfg asks for (draft_model: the loaded draft
    model or EAGLE-3 head; None for ngram/none), verify_cfg's rule and batch_size rows.
    Its draft lengths follow the target's measured step costs (marscli.engine.costs.step_costs:
    cached per model, device and dtype; measured here the first time, narrated to note).
    spans: a config.SpanConfig (strict spans, marscli.verification.spans) or None.
    Under strict verification an n-gram drafter also drafts from the job's earlier records
    (drafters.ngram.JobCorpus): drafts cannot change the outputs, only their speed. Relaxed
    rules keep to each record's own text, so that one record's output never leans on
    another's. job_corpus: None follows draft_cfg.job_corpus (--no-job-corpus) and the rule;
    False turns it off (calibration collects margins under strict verification with the
    proposals the relaxed rule will judge), True turns it on whatever the rule.
    relax_at: where a relaxed rule judges proposals (config.RELAX_AT).
    calibrating: a strict engine collecting for calibration (Engine's ``calibrating``).
    prefix_cache_mib: the bound of the run's prefix cache (0: off; marscli.models.prefill).
    compile_mode: --compile (auto, on, off; the engine's StepPlan: marscli.engine.scheduler.step_plan).
    Raises UsageError for what the engine cannot run (trees or sliding-window models at
    batch size > 1)."""

    # A captured (compiled, static) engine's draft model and EAGLE-3 head step so too, at
    # batch size 1 as well.
    plan = step_plan(compile_mode, target.device, target.model)  # once: the engine, drafters, costs
    drafters = build_drafters(draft_cfg, target, draft_model, batch_size=batch_size,
                              job_corpus=(draft_cfg.job_corpus and verify_cfg.rule.name == STRICT)
                              if job_corpus is None else job_corpus, batched_model=plan.static)
    try:
        engine = Engine(target, drafters, verify_cfg.rule, draft_cfg, batch_size, guard=verify_cfg.guard,
                        spans=spans, prefix_cache_mib=prefix_cache_mib, compile_mode=compile_mode,
                        relax_at=relax_at, calibrating=calibrating, plan=plan)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if drafter_kind(draft_cfg.kind).drafts and draft_cfg.adaptive and (not draft_cfg.tree or draft_cfg.sibling_tree):
        # Compiled steps (a CPU's --compile on) are timed at their shapes, eagerly: compiling
        # each timed shape would take minutes (docs/engine.md, "The captured step").
        timed = StepPlan("static") if plan.compiled else plan
        try:  # after the engine installed its CPU kernels: the costs of the forwards it runs
            engine.costs = step_costs(target, draft_model, draft_cfg.kind, batch_size,
                                      note=note or (lambda _: None), step=timed)
        except ValueError as e:  # a $MARSCLI_COSTS file that does not read
            raise UsageError(str(e)) from None
    return engine
