"""Tests of marscli.io.resume: sidecars, fingerprints, RunOutput."""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from marscli.config import Request, SamplingParams
from marscli.errors import UsageError
from marscli.io.results import scan_output
from marscli.io.resume import (
    RunOutput,
    fingerprint_diff,
    read_sidecar,
    run_fingerprint,
    sidecar_path,
    write_sidecar,
)
from tests.test_io_records import json_values


def test_sidecar_round_trip_and_atomic(tmp_path):
    side = tmp_path / "out.jsonl.marscli.json"
    assert read_sidecar(side) is None
    fp = {"sampling": {"seed": 1}, "profile": None}
    write_sidecar(side, fp)
    assert read_sidecar(side) == fp
    assert sorted(os.listdir(tmp_path)) == [side.name]  # no temp file left


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=200) | json_values().map(lambda v: json.dumps(v).encode()))
def test_untrusted_sidecar_and_output_never_raise_unhandled(tmp_path_factory, data):
    d = tmp_path_factory.mktemp("untrusted")
    p = d / "f"
    p.write_bytes(data)
    for read in (read_sidecar, scan_output):
        try:
            read(p)
        except UsageError as e:
            assert str(e) and "\n" not in str(e)


def _cfg(**kw):
    from marscli.config import DraftConfig, GenerateConfig, ModelConfig, VerifyConfig

    base = {"input": "in.jsonl", "output": "out.jsonl", "target": ModelConfig("m"),
            "draft": DraftConfig(), "draft_model": None, "verify": VerifyConfig(),
            "sampling": SamplingParams()}
    return GenerateConfig(**{**base, **kw})


TARGET = {"name": "m", "source": "/m", "kind": "dir", "sha256": None, "revision": None,
          "dtype": "float32", "quantization": None, "device": "cuda:1"}


def test_run_fingerprint_components_and_what_it_leaves_out():
    extra = {"input": {"sha256": "ab"}, "profile": None}
    fp = run_fingerprint(_cfg(), TARGET, None, extra)
    assert fp["target"]["device"] == "cuda"  # which GPU does not change results
    assert fp["verify"] == {"mode": "strict", "theta": None, "margin": "logit-ratio"}
    assert fp["input"] == {"sha256": "ab"} and fp["profile"] is None
    json.dumps(fp, allow_nan=False)
    # Things that do not change the result bytes are not part of it.
    same = run_fingerprint(_cfg(limit=3, fail_fast=True, resume=True, output="other.jsonl"),
                               dict(TARGET, device="cuda:0"), None, extra)
    assert same == fp
    from marscli.config import DraftConfig

    none = run_fingerprint(_cfg(draft=DraftConfig(kind="none", ngram_max=5)), TARGET, None, extra)
    assert none["drafter"] == {"kind": "none"}
    # The verification really used (e.g. set by a profile) replaces the command line's.
    from marscli.config import VerifyConfig

    mars = run_fingerprint(_cfg(), TARGET, None, extra, verify=VerifyConfig("mars", 0.93))
    assert mars["verify"] == {"mode": "mars", "theta": 0.93, "margin": "logit-ratio"}


def test_fingerprint_diff_names_each_difference():
    old = {"sampling": {"temperature": 0.0, "seed": 1}, "profile": None, "input": {"sha256": "a"}}
    new = {"sampling": {"temperature": 0.7, "seed": 1}, "profile": {"name": "p"},
           "input": {"sha256": "a"}, "extra": 1}
    assert fingerprint_diff(old, new) == [
        "sampling.temperature: 0.0 in the existing run, 0.7 now",
        'profile: null in the existing run, {"name": "p"} now',
        "extra: (absent) in the existing run, 1 now",
    ]
    assert fingerprint_diff(old, new, ignore=["sampling", "profile", "extra"]) == []
    assert fingerprint_diff({"a": 1}, {"a": 1.0}) == []


def test_run_output_fresh_then_resume(tmp_path):
    out = tmp_path / "out.jsonl"
    items = [Request(index=i, line=i + 1, id=str(i), prompt="p") for i in range(3)]
    fp = {"sampling": {"seed": 1}}
    run = RunOutput(str(out), resume=False)
    assert not out.exists()  # validated without creating it
    w = run.open(fp, items)
    w.write(0, {"id": "0", "error": None})
    w.close()
    assert read_sidecar(sidecar_path(out)) == fp
    with open(out, "a") as f:
        f.write('{"id": "1", "err')  # torn by a crash
    run = RunOutput(str(out), resume=True)
    assert run.resuming and run.done == {"0": False} and run.scan.torn_bytes > 0
    with pytest.raises(UsageError, match="sampling.seed: 1 in the existing run, 2 now"):
        run.check({"sampling": {"seed": 2}})
    w = run.open(fp, items)
    w.write(1, {"id": "1", "error": None})
    w.write(2, {"id": "2", "error": None})
    w.close()
    assert [json.loads(x)["id"] for x in out.read_text().splitlines()] == ["0", "1", "2"]
    with pytest.raises(UsageError, match="--resume needs -o FILE"):
        RunOutput("-", resume=True)
