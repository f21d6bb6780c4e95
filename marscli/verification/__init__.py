"""The rulebook: every verification rule of marscli, chain and tree, greedy and sampling, and
what keeps a relaxed rule in check (strict spans, the loop guard). Pure functions of tensors
and text: no model, no I/O. Callers import from the submodules; nothing is re-exported here
(``import marscli.verification.registry`` stays free of torch).

- ``registry``: THE registry of rule names, knobs, bounds, option names and bench spellings,
  and the ``Rule`` value (a rule at its knob values); everything that names a rule derives
  from it.
- ``rules``: what each rule accepts: the position facts, the margin statistics, one small
  function per rule, and ``decide``, the per-position decision the walks and calibration's
  replay share.
- ``chain``: the chain walk (``verify``, ``verify_rows``), position by position; the sampling law.
- ``draws``: each sampled position's draw (Gumbel-max with the record's seed and the position).
- ``tree``: ``DraftTree`` and the tree walk (``verify_tree``).
- ``spans``: strict spans (code blocks, final answers, a regex).
- ``guard``: the loop guard's n-gram index and the repetition statistics.

Words used throughout marscli (fixed here, kept everywhere):

- **target**: the model whose output we want. **drafter**: what proposes tokens.
- **step**: the drafter proposes up to K tokens; the target scores them in one forward pass
  and returns K+1 rows of logits (row i scores the token that follows draft i-1; row 0 scores
  the first draft, row K the token after all K drafts).
- **accepted**: draft tokens kept in a step (always a prefix of the drafts).
- **relaxed**: emitted only because a lossy rule relaxed the check (MARS: the proposal equals
  the target's top-2 token at a low-margin position; sampling: it is the top-1 or top-2 but
  not the position's draw).
- **correction**: the token the target emits at the first rejected position.
- **bonus**: the token emitted after all drafts of a row were accepted: the rule's verdict on
  the drafter's proposal for that position (relaxed to it, or the target's own token).
- **margin statistic**: from the target's raw float32 logits z1 >= z2 (top-1, top-2) at a
  position: ``logit-ratio`` r = z2 / z1 (the paper's; relaxable only if z1 > 0) or
  ``prob-ratio`` p2 / p1 = exp(z2 - z1) (invariant to a constant logit shift).
- **theta**: the threshold; a position is **relaxable** when its statistic exceeds theta.
- **acceptance length** (tau): tokens emitted per step, bonus/correction included.

How a rule is built (the seam the next rules plug into):

1. The chain walk (``chain.verify``) or the tree walk (``tree.verify_tree``) gathers, per
   verified draft position, what the target says: the margin statistics, whether the draft
   is among the target's top two with p > 0 (``in_top2``) and whether the strict check
   accepts it on its own (``strict_ok``).
2. ``rules.decide(rule, facts)`` judges every position on its own: ``ok`` and
   ``relaxable``. It uses elementwise operators only, so calibration's numpy replay
   (marscli.calibration.collect) calls the very same function on recorded facts.
3. The walk keeps the accepted prefix or path: a position's token is the proposal where the
   rule keeps it, else the target's own (greedy: its top-1; sampling: the position's draw,
   marscli.verification.draws), so every output token is a function of the record's own text
   and no schedule of draft lengths changes it.

A rule is ``Rule(name, theta, margin, **knobs)``; ``strict`` never relaxes whatever its
theta, and MARS at theta = +inf behaves as strict. Nothing else in marscli restates an
acceptance rule.
"""
