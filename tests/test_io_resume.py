"""Tests of marscli.io.resume: sidecars, fingerprints, RunOutput."""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from marscli.config import Request
from marscli.errors import UsageError
from marscli.io.results import scan_output
from marscli.io.resume import (
    RunOutput,
    fingerprint_diff,
    read_sidecar,
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
