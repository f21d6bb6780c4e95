"""Tests of marscli.jobs.fingerprint: what decides a run's result bytes, and what does not."""

from __future__ import annotations

import json

from marscli.config import (
    GUARD_OFF,
    DraftConfig,
    GenerateConfig,
    GuardConfig,
    ModelConfig,
    ModelSetup,
    SamplingOptions,
    VerifyConfig,
)
from marscli.io.resume import fingerprint_diff
from marscli.jobs.fingerprint import LOADED_COMPONENTS, run_fingerprint


def _cfg(**kw):
    """A GenerateConfig; setup fields (target, draft, verify, batch_size...) and sampling
    options (sampling: a SamplingOptions) by keyword."""
    setup = {k: kw.pop(k) for k in ("target", "draft", "draft_model", "verify", "batch_size") if k in kw}
    setup = ModelSetup(**{"target": ModelConfig("m"), "draft": DraftConfig(), "draft_model": None,
                          "verify": VerifyConfig(), **setup})
    return GenerateConfig(**{"input": "in.jsonl", "output": "out.jsonl", "setup": setup,
                             "options": kw.pop("sampling", SamplingOptions()), **kw})


def _fp(cfg, *args, **kw):
    return run_fingerprint(cfg.setup, cfg.options, *args, **kw)


TARGET = {"name": "m", "source": "/m", "kind": "dir", "sha256": None, "revision": None,
          "dtype": "float32", "quantization": None, "device": "cuda:1"}


def test_run_fingerprint_components_and_what_it_leaves_out():
    extra = {"input": {"sha256": "ab"}, "profile": None}
    fp = _fp(_cfg(), TARGET, None, extra)
    assert fp["target"]["device"] == "cuda"  # which GPU does not change results
    assert fp["verify"] == {"mode": "strict", "theta": None, "margin": "logit-ratio"}
    assert fp["input"] == {"sha256": "ab"} and fp["profile"] is None
    json.dumps(fp, allow_nan=False)
    # Things that do not change the result bytes are not part of it.
    same = _fp(_cfg(limit=3, fail_fast=True, resume=True, output="other.jsonl"),
                           dict(TARGET, device="cuda:0"), None, extra)
    assert same == fp
    none = _fp(_cfg(draft=DraftConfig(kind="none", ngram_max=5)), TARGET, None, extra)
    assert none["drafter"] == {"kind": "none"}
    # The verification really used (e.g. set by a profile) replaces the command line's.
    mars = _fp(_cfg(), TARGET, None, extra, verify=VerifyConfig("mars", 0.93))
    assert mars["verify"] == {"mode": "mars", "theta": 0.93, "margin": "logit-ratio",
                              "guard": GUARD_OFF.to_dict()}
    # The loop guard decides which drafts are relaxed: a relaxed run's fingerprint holds it.
    guarded = _fp(_cfg(), TARGET, None, extra,
                              verify=VerifyConfig("mars", 0.93, guard=GuardConfig(4, 256, 0.25)))
    assert guarded["verify"]["guard"] == {"repeat_ngram": 4, "repeat_window": 256, "max_relaxed_share": 0.25,
                                        "strict_first": 2, "strict_stops": True, "loop_rewind": 64}
    assert fingerprint_diff(mars, guarded)


def test_sampled_runs_record_their_batch_size_greedy_runs_do_not():
    """Batched kernels round differently, which can move a sampled draw: a sampled run's
    --resume refuses another batch size; a greedy run's does not care."""
    extra = {"input": {"sha256": "ab"}, "profile": None}
    hot = SamplingOptions(temperature=0.8)
    one = _fp(_cfg(sampling=hot, batch_size=1), TARGET, None, extra)
    four = _fp(_cfg(sampling=hot, batch_size=4), TARGET, None, extra)
    assert fingerprint_diff(one, four) == ["sampling.batch_size: 1 in the existing run, 4 now"]
    assert _fp(_cfg(batch_size=1), TARGET, None, extra) == \
        _fp(_cfg(batch_size=4), TARGET, None, extra)


def test_loaded_components_cover_everything_loading_the_models_can_change():
    """generate checks a resume before loading the models with ignore=LOADED_COMPONENTS: the
    fingerprint made then must differ from the final one only in those components."""
    extra = {"input": {"sha256": "ab"}, "profile": None}
    before = _fp(_cfg(), None, None, extra)
    after = _fp(_cfg(), TARGET, dict(TARGET, name="d"),
                            dict(extra, profile={"name": "p", "sha256": "0f"}),
                            verify=VerifyConfig("mars", 0.93))
    changed = {d.split(":")[0].split(".")[0] for d in fingerprint_diff(before, after)}
    assert changed == set(LOADED_COMPONENTS)
    assert fingerprint_diff(before, after, ignore=LOADED_COMPONENTS) == []
    # Anything else still counts before the models are loaded.
    hotter = _fp(_cfg(sampling=SamplingOptions(temperature=0.7)), None, None, extra)
    assert fingerprint_diff(before, hotter, ignore=LOADED_COMPONENTS) == [
        "sampling.temperature: 0.0 in the existing run, 0.7 now",
        "sampling.batch_size: (absent) in the existing run, 1 now"]
