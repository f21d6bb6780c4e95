"""The run fingerprint: the named components that decide a generate run's result bytes, and
the run key made from it (the OpenAI format's ids), for `marscli generate` and ``LLM.stream``
alike.

Made here from a ModelSetup, the SamplingOptions and the loaded models' identities, then
handed on as plain JSON data: marscli.io.resume stores it in the output's sidecar and compares it on --resume,
and the ranks of a data-parallel run compare theirs with rank 0's. Nothing in marscli.io
knows the config classes.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from marscli.config import RELAX_EVERY, ModelSetup, SamplingOptions
from marscli.drafters.kinds import NGRAM, NONE
from marscli.verification.registry import MARS, OTHER_KNOBS, RULES, STRICT

#: Fingerprint components known only once the models are loaded, so compared only then: the
#: model identities, and the verification and profile, which a profile matched to the loaded
#: target can decide.
LOADED_COMPONENTS = ("target", "draft_model", "verify", "profile")
#: Identity keys of a loaded model that change results ("device" is reduced to its type).
#: "fingerprint" is a model folder's content fingerprint where models.py records one (folders
#: have no sha256): with it, weights changed in place between a crash and a resume are caught.
_MODEL_KEYS = ("name", "source", "kind", "sha256", "fingerprint", "revision", "dtype",
               "quantization", "device")


def run_fingerprint(
    setup: ModelSetup,
    options: SamplingOptions,
    target_identity: dict[str, Any] | None,
    draft_identity: dict[str, Any] | None,
    extra: dict[str, Any],
    *,
    verify: Any = None,
) -> dict[str, Any]:
    """The named components that decide a run's result bytes (JSON values only).

    setup and options: a GenerateConfig's (or an LLM's setup and a stream's options); the
    identities come from LoadedModel.identity (None before the models are loaded: see
    LOADED_COMPONENTS); extra: further components, which replace
    those of the same name, e.g. {"profile": {"name": ..., "sha256": ...} or None,
    "input": {"sha256": ...}}; verify: the VerifyConfig the run really uses when it differs
    from setup.verify (a profile applied). Left out on purpose: --limit (may grow on resume),
    --quiet, progress, --fail-fast.
    """
    d = setup.draft
    drafter: dict[str, Any] = {"kind": d.kind}
    if d.kind != NONE:
        drafter.update(num_draft_tokens=d.num_draft_tokens, adaptive=d.adaptive)
    if d.kind == NGRAM or getattr(d, "hybrid", False):
        drafter.update(ngram_max=d.ngram_max, ngram_min=d.ngram_min)
    if getattr(d, "hybrid", False):
        drafter.update(hybrid=True)
    if getattr(d, "context", None):
        drafter.update(context=d.context)
    if getattr(d, "tree", False):
        drafter.update(tree={"depth": d.tree_depth, "top_k": d.tree_top_k, "tokens": d.tree_tokens})
    v = verify if verify is not None else setup.verify
    s = options.params()
    fp: dict[str, Any] = {
        "target": _model_fingerprint(target_identity),
        "drafter": drafter,
        "draft_model": _model_fingerprint(draft_identity),
        "verify": {
            "mode": v.mode,
            "theta": None if v.mode in RULES and v.mode != MARS else v.theta,  # None: not asked yet
            "margin": v.margin,
        },
        "sampling": {
            "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k,
            "max_tokens": s.max_tokens, "seed": s.seed, "stop": list(s.stop),
        },
        "truncate_prompt": options.truncate_prompt,
        "output": {"timing": options.timing, "token_ids": options.token_ids},
        "profile": None,
    }
    rule = getattr(v, "rule", None)  # a VerifyConfig's; a VerifyRequest's rule is not resolved yet
    if rule is not None and rule.name not in (STRICT, MARS):  # strict, mars: as before rules
        fp["verify"]["knobs"] = rule.knobs()
    elif rule is None:
        asked = {k: getattr(v, k, None) for k in OTHER_KNOBS}
        if any(x is not None for x in asked.values()):
            fp["verify"]["knobs"] = asked
    guard = getattr(v, "guard", None)  # a VerifyConfig's; a VerifyRequest has the options asked
    if guard is not None and v.mode != STRICT:
        fp["verify"]["guard"] = guard.to_dict()  # it decides which drafts are relaxed
    elif guard is None:
        asked = {k: getattr(v, k, None) for k in ("repeat_ngram", "repeat_window", "max_relaxed_share",
                                                  "strict_first", "strict_stops", "loop_rewind")}
        if any(x is not None for x in asked.values()):
            fp["verify"]["guard"] = asked
    # Newer settings join only when set, so the sidecars of runs without them still match.
    if s.n != 1:
        fp["sampling"]["n"] = s.n
    if s.logprobs:
        fp["sampling"].update(logprobs=True, top_logprobs=s.top_logprobs)
    if options.output_format != "default":
        fp["output"]["format"] = options.output_format
    if options.strict_keys:
        fp["output"]["strict_keys"] = True
    if setup.spans.active or setup.spans_given:  # they decide which drafts may be relaxed (given: over a profile's)
        fp["verify"]["spans"] = setup.spans.to_dict()
    if getattr(setup, "relax_at", RELAX_EVERY) != RELAX_EVERY:  # Algorithm 1: the text follows K
        fp["verify"]["relax_at"] = setup.relax_at
    if s.provenance:
        fp["output"]["provenance"] = True
    if s.temperature > 0:
        # A sampled row's text does not follow its batch by design (the reproducibility
        # contract), but a batched kernel's rounding can move an inverse-CDF draw: --resume
        # never mixes two batch sizes in one sampled file (docs/verification.md).
        fp["sampling"]["batch_size"] = int(setup.batch_size)
    fp.update(extra)
    return json.loads(json.dumps(fp))  # plain JSON values, as read back from a sidecar


def run_key(fingerprint: dict[str, Any]) -> str:
    """The run's key: the OpenAI format's ids come from it (the same on --resume, on every
    rank, and for ``LLM.stream`` with the same models, settings and records)."""
    return hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()


def _model_fingerprint(identity: dict[str, Any] | None) -> dict[str, Any] | None:
    if identity is None:
        return None
    out = {k: identity.get(k) for k in _MODEL_KEYS}
    if isinstance(out["device"], str):  # cuda:0 and cuda:1 compute alike
        out["device"] = out["device"].split(":")[0]
    return out
