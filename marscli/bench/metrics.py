"""Metrics for `marscli bench`: an output against the reference method's, and speed summaries.

Pure functions over token lists and numbers, except `completion_nll` (one target forward
pass). ROUGE-L and a record's reference text are task scoring's (marscli.scoring.rouge).

Definitions (docs/bench.md reads them column by column):

- **exact match**: the two token sequences are identical (EOS included when generated).
- **prefix share**: length of the longest common prefix divided by the length of the longer
  sequence. 1.0 exactly when the sequences are identical; a method that agrees for 30 of 40
  tokens and then wanders off scores 0.75; two empty sequences score 1.0.
- **target NLL**: mean of -log p_target(token | everything before it) over the completion
  tokens, from the target's raw distribution (temperature 1, no top-k/top-p), scored in one
  forward pass over prompt + completion. Lower means the target finds the text more likely;
  a lossy method that picks runner-up tokens raises it.
- **ROUGE-L**: F1 of the longest common subsequence of words (Google's `rouge-score`, with
  stemming) between the decoded completion and the prompt set's reference text.
- **ideal speedup**: what an engine with no overhead beyond the target's forward passes (and
  the draft model's, when there is one) would reach over plain decoding, given the draft
  lengths and acceptance a method actually had.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

# --------------------------------------------------------------------------------------------
# Token sequences


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Number of leading positions where `a` and `b` agree."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def exact_match(output: Sequence[int], reference: Sequence[int]) -> bool:
    return list(output) == list(reference)


def prefix_share(output: Sequence[int], reference: Sequence[int]) -> float:
    """Longest common prefix / length of the longer sequence (1.0 iff identical)."""
    longest = max(len(output), len(reference))
    if longest == 0:
        return 1.0
    return common_prefix_len(output, reference) / longest


def first_mismatch(output: Sequence[int], reference: Sequence[int]) -> int | None:
    """Index of the first differing token (a length difference counts); None if identical."""
    if exact_match(output, reference):
        return None
    return common_prefix_len(output, reference)


# --------------------------------------------------------------------------------------------
# Numbers


def mean(xs: Sequence[float]) -> float | None:
    return statistics.fmean(xs) if len(xs) else None


def median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if len(xs) else None


def std(xs: Sequence[float]) -> float | None:
    """Sample standard deviation (n - 1); None for fewer than two values."""
    return statistics.stdev(xs) if len(xs) >= 2 else None


def ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den == 0 or not math.isfinite(den):
        return None
    return num / den


def rate(tokens: int, seconds: float) -> float | None:
    return tokens / seconds if seconds > 0 else None


# --------------------------------------------------------------------------------------------
# Acceptance


def steps_by_draft_length(drafted_per_position: Sequence[int], steps: int) -> list[int]:
    """How many steps drafted exactly k tokens, k = 0..K.

    drafted_per_position[i] counts the steps that drafted more than i tokens (SpecStats), so
    steps with exactly k drafts = drafted_per_position[k-1] - drafted_per_position[k].
    """
    counts_gt = [steps, *drafted_per_position, 0]
    out = [counts_gt[k] - counts_gt[k + 1] for k in range(len(drafted_per_position) + 1)]
    assert all(c >= 0 for c in out), (drafted_per_position, steps)
    return out


def per_position_rates(accepted: Sequence[int], drafted: Sequence[int]) -> list[float | None]:
    """Acceptance rate at draft position i: accepted there / drafted there (None if never)."""
    return [a / d if d else None for a, d in zip(accepted, drafted)]


def ideal_speedup(k_counts: Sequence[int], emitted: int, t_forward: Sequence[float],
                  t_draft: float = 0.0) -> float | None:
    """Speedup over plain decoding of an engine whose only cost is the forward passes.

    k_counts[k]: steps that drafted k tokens (`steps_by_draft_length`); emitted: tokens the
    steps produced; t_forward[n-1]: target forward time for n new tokens over a cached
    context; t_draft: draft model forward time for one token (0 for prompt lookup).
    Plain decoding needs `emitted` one-token forwards. With every step drafting K this is
    tau * t(1) / (t(K+1) + K * t_draft), tau = emitted / steps.
    """
    steps = sum(k_counts)
    if steps == 0 or emitted == 0:
        return None
    if len(k_counts) > len(t_forward):
        raise ValueError(f"forward times for up to {len(t_forward)} tokens; need {len(k_counts)}")
    spec = sum(c * (t_forward[k] + k * t_draft) for k, c in enumerate(k_counts))
    return emitted * t_forward[0] / spec if spec > 0 else None


# --------------------------------------------------------------------------------------------
# Target likelihood


def completion_nll(model: Any, prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> list[float]:
    """-log p(token) under `model` for each completion token, in one forward pass.

    The input is prompt + completion without its last token: position P-1+i scores
    completion token i. Only the needed logit rows are computed (logits_to_keep).
    """
    import torch

    if not prompt_ids:
        raise ValueError("completion_nll needs at least one prompt token")
    c = len(completion_ids)
    if c == 0:
        return []
    device = model.get_input_embeddings().weight.device
    seq = list(prompt_ids) + list(completion_ids[:-1])
    x = torch.tensor([seq], dtype=torch.long, device=device)  # [1, P + C - 1]
    with torch.inference_mode():
        logits = model(input_ids=x, use_cache=False, logits_to_keep=c).logits  # [1, C, V]
        assert logits.shape[:2] == (1, c), (tuple(logits.shape), c)
        logp = torch.log_softmax(logits[0].float(), dim=-1)  # [C, V]
        target = torch.tensor(list(completion_ids), dtype=torch.long, device=device)  # [C]
        nll = -logp.gather(-1, target[:, None])[:, 0]  # [C]
    return [float(v) for v in nll.cpu()]
