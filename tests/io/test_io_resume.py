"""Tests of marscli.io.resume: sidecars, fingerprints, RunOutput."""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from marscli.config import Request
from marscli.errors import EXIT_USAGE, OutputInUseError, UsageError
from marscli.io.results import lock_path, scan_output
from marscli.io.resume import (
    RunOutput,
    fingerprint_diff,
    read_sidecar,
    sidecar_path,
    write_sidecar,
)
from tests.helpers import json_values


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
    run.close()  # the run is over: the next may take the output
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
    run.close()
    assert [json.loads(x)["id"] for x in out.read_text().splitlines()] == ["0", "1", "2"]
    with pytest.raises(UsageError, match="--resume needs -o FILE"):
        RunOutput("-", resume=True)


# ---------------------------------------------------------------------------------------------
# One run per output: RunOutput holds the output's lock from construction to close()


def test_run_output_refuses_a_second_run_on_the_same_output(tmp_path):
    out = tmp_path / "out.jsonl"
    items = [Request(index=0, line=1, id="0", prompt="p")]
    first = RunOutput(str(out), resume=False)
    w = first.open({"s": 1}, items)
    w.write(0, {"id": "0", "error": None})
    w.close()
    before = out.read_bytes()
    for resume in (False, True):
        with pytest.raises(OutputInUseError) as exc:
            RunOutput(str(out), resume=resume)
        message = str(exc.value)
        holder = f"(pid {os.getpid()} on host "
        assert f"output {out} is in use by another marscli run {holder}" in message
        assert "started 20" in message and "\n" not in message
        assert exc.value.exit_code == EXIT_USAGE
    assert out.read_bytes() == before  # the refused runs touched nothing
    # Another rank of a data-parallel run (lock=False) and results on stdout take no lock.
    RunOutput(str(out), resume=True, lock=False).close()
    RunOutput(None, resume=False).close()
    RunOutput("-", resume=False).close()
    first.close()
    assert not os.path.exists(lock_path(out))  # a clean end leaves no lock file
    with RunOutput(str(out), resume=True) as again:  # free once the first run is over
        assert again.done == {"0": False}
        assert os.path.exists(lock_path(out))


def test_run_output_that_fails_its_checks_releases_the_lock(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text("not a result\n")
    with pytest.raises(UsageError, match="line 1 is not a marscli result"):
        RunOutput(str(out), resume=True)
    assert not os.path.exists(lock_path(out))
    RunOutput(str(out), resume=False).close()  # not left locked by the failed one
