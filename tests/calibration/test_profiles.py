"""Profiles: round trip, every malformed case names the file and key path (exit 2), arbitrary
bytes never crash the loader, matching picks the right file."""

from __future__ import annotations

import math
import re

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from marscli.calibration.policies import RuleFamily, analyse
from marscli.calibration.profiles import (
    ProfileError,
    drafter_description,
    dump_profile,
    find_matching_profile,
    load_profile,
    parse_profile,
    resolve_profile,
    save_profile,
    user_profile_dir,
)
from marscli.calibration.report import build_profile
from marscli.config import DraftConfig, SamplingParams
from marscli.errors import EXIT_USAGE
from tests.helpers import synthetic

IDENTITY = {
    "name": "Tiny", "source": "/models/tiny", "kind": "dir", "sha256": None,
    "fingerprint": "folder-v1:abc", "revision": None, "dtype": "float32", "quantization": None,
    "device": "cpu",
}


def make_profile(name: str = "tiny.ngram.float32", identity: dict | None = None, **policy) -> dict:
    data = synthetic()
    pol, val = next(iter(policy.items())) if policy else ("max-nll-increase", 0.02)
    cal = analyse(data, RuleFamily.mars("logit-ratio"), pol.replace("_", "-"), val, seconds=2.0)
    return build_profile(
        name=name, cal=cal, data=data, target_identity=identity or IDENTITY,
        draft_cfg=DraftConfig(), draft_identity=None, sampling=SamplingParams(max_tokens=64),
        input_name="calib.jsonl", input_sha256="0" * 64, seconds=2.0,
    )


def test_round_trip(tmp_path):
    doc = make_profile()
    path = tmp_path / "p.yaml"
    prof = save_profile(doc, path)
    again = load_profile(path)
    assert again.data == doc == prof.data
    assert again.sha256 == prof.sha256 and len(again.sha256) == 64
    assert again.theta == doc["verification"]["theta"] and math.isfinite(again.theta)
    assert not list(tmp_path.glob("*.tmp*"))  # atomic write leaves no temp file behind
    text = path.read_text()
    assert text.startswith("schema_version: 1\n")
    assert "counts:\n" in text and "rank1: [" in text  # arrays on one line each


def _mutate(text: str, old: str, new: str) -> str:
    assert old in text, old
    return text.replace(old, new, 1)


BAD = [
    # (name, how to break the text, message fragment)
    ("wrong type", lambda t: re.sub(r"theta: [0-9.e-]+\n", "theta: high\n", t, count=1),
     "verification.theta: expected a number, got the string 'high'"),
    ("yaml 1.1 float trap", lambda t: re.sub(r"theta: [0-9.e-]+\n", "theta: 1e-3\n", t, count=1),
     "verification.theta: expected a number, got the string '1e-3' (YAML 1.1 reads '1e-3' as a string"),
    ("yaml 1.1 boolean trap", lambda t: _mutate(t, "name: Tiny", "name: no"),
     "target.name: expected a string, got the boolean false (YAML 1.1 reads yes/no/on/off"),
    ("unknown key", lambda t: _mutate(t, "policy:\n", "policy:\n  colour: red\n"),
     "policy.colour: unknown key"),
    ("unknown top-level key", lambda t: t + "extra: 1\n", "extra: unknown key"),
    ("missing field", lambda t: re.sub(r"  margin: logit-ratio\n", "", t, count=1),
     "verification.margin: missing"),
    ("bad schema version", lambda t: _mutate(t, "schema_version: 1", "schema_version: 2"),
     "schema_version: unsupported value 2 (this marscli reads schema_version 1)"),
    ("schema version as string", lambda t: _mutate(t, "schema_version: 1", "schema_version: '1'"),
     "schema_version: unsupported value '1'"),
    ("no schema version", lambda t: _mutate(t, "schema_version: 1\n", ""),
     "schema_version: missing"),
    ("bad choice", lambda t: _mutate(t, "margin: logit-ratio", "margin: z-score"),
     "verification.margin: must be one of logit-ratio, prob-ratio; got 'z-score'"),
    ("out of range", lambda t: re.sub(r"relaxable_share: [0-9.e-]+\n", "relaxable_share: 1.5\n", t, count=1),
     "summary.relaxable_share: must be <= 1, got 1.5"),
    ("bool for int", lambda t: _mutate(t, "num_draft_tokens: 8", "num_draft_tokens: true"),
     "drafter.num_draft_tokens: expected an integer, got the boolean true"),
    ("infinite theta", lambda t: re.sub(r"theta: [0-9.e-]+\n", "theta: .inf\n", t, count=1),
     "verification.theta: expected a finite number"),
    ("histogram length", lambda t: re.sub(r"rank2: \[[0-9,\s]+\]", "rank2: [1, 2]", t, count=1),
     "histogram.counts.rank2: expected 200 counts (one per bin), got 2"),
    ("list entry", lambda t: re.sub(r"- theta: [0-9.e-]+\n", "- theta: x\n", t, count=1),
     "curve[0].theta: expected a number"),
    ("duplicate key", lambda t: _mutate(t, "policy:\n", "policy:\n  name: fixed\n"),
     "duplicate key 'name'"),
    ("alias", lambda t: _mutate(t, "target:\n", "target: &t\n") + "x: *t\n",
     "YAML aliases are not allowed"),
    ("not a mapping", lambda t: "- 1\n- 2\n", "expected a mapping at the top level, got a list"),
    ("invalid yaml", lambda t: "a: [1, 2\n", "line 2, column 1"),
    ("empty file", lambda t: "", "expected a mapping at the top level, got null"),
]


@pytest.mark.parametrize("name, breaker, fragment", BAD, ids=[b[0] for b in BAD])
def test_bad_profiles_fail_with_file_and_key(runner, name, breaker, fragment, tmp_path):
    from marscli.cli import app

    path = tmp_path / "bad.yaml"
    path.write_text(breaker(dump_profile(make_profile())))
    with pytest.raises(ProfileError) as err:
        load_profile(path)
    assert str(err.value).startswith(f"{path}: ")
    assert fragment in str(err.value)
    assert err.value.exit_code == EXIT_USAGE
    r = runner.invoke(app, ["profile", "validate", str(path)])
    assert r.exit_code == EXIT_USAGE and fragment in r.stderr and r.stdout == ""
    g = runner.invoke(app, ["generate", str(path), "--profile", str(path)])
    assert g.exit_code == EXIT_USAGE and fragment in g.stderr and g.stdout == ""


def test_non_utf8_and_missing_files(tmp_path):
    bad = tmp_path / "bin.yaml"
    bad.write_bytes(b"schema_version: 1\nname: \xff\xfe\n")
    with pytest.raises(ProfileError, match=r"bin.yaml: not valid UTF-8"):
        load_profile(bad)
    with pytest.raises(ProfileError, match="no such profile file"):
        resolve_profile(str(tmp_path / "none.yaml"))
    with pytest.raises(ProfileError, match="no profile named 'nope'"):
        resolve_profile("nope")


def test_quoted_timestamp_and_unquoted_date_both_load(tmp_path):
    text = dump_profile(make_profile())
    text = re.sub(r"created_at: '([^']+)'", r"created_at: \1", text)
    prof = parse_profile(text, "p.yaml")
    assert isinstance(prof.data["created_at"], str)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=400))
def test_arbitrary_bytes_never_crash_the_loader(raw):
    try:
        parse_profile(raw, "fuzz.yaml")
    except ProfileError as e:
        assert str(e).startswith("fuzz.yaml: ")


@settings(max_examples=300, deadline=None)
@given(json_values)
def test_arbitrary_documents_never_crash_the_loader(value):
    text = yaml.safe_dump(value)
    try:
        parse_profile(text, "fuzz.yaml")
    except ProfileError as e:
        assert str(e).startswith("fuzz.yaml: ")


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(["target", "drafter", "verification", "policy", "summary", "histogram", "curve",
                        "sampling", "calibration_data", "name"]), json_values)
def test_any_field_replaced_by_junk_fails_cleanly(key, junk):
    doc = make_profile_cached()
    doc = {**doc, key: junk}
    try:
        parse_profile(yaml.safe_dump(doc, sort_keys=False), "fuzz.yaml")
    except ProfileError as e:
        assert str(e).startswith("fuzz.yaml: ")


_CACHED: dict = {}


def make_profile_cached() -> dict:
    if "doc" not in _CACHED:
        _CACHED["doc"] = make_profile()
    return _CACHED["doc"]


# --------------------------------------------------------------------------- matching


def test_matching_prefers_user_dir_then_newest(tmp_path, monkeypatch):
    udir = user_profile_dir()
    udir.mkdir(parents=True)
    old = make_profile("old")
    old["created_at"] = "2026-01-01T00:00:00+00:00"
    new = make_profile("new")
    new["created_at"] = "2026-06-01T00:00:00+00:00"
    other = make_profile("other", identity={**IDENTITY, "fingerprint": "folder-v1:zzz"})
    for doc in (old, new, other):
        save_profile(doc, udir / f"{doc['name']}.yaml")
    (udir / "broken.yaml").write_text("schema_version: 9\n")
    notes = []
    ngram = drafter_description("ngram", None)
    assert find_matching_profile(IDENTITY, ngram, notes.append).name == "new"
    assert any("broken.yaml: schema_version" in n for n in notes)
    assert find_matching_profile({**IDENTITY, "fingerprint": "folder-v1:zzz"}, ngram).name == "other"
    assert find_matching_profile({**IDENTITY, "fingerprint": "folder-v1:???"}, ngram) is None
    assert find_matching_profile(IDENTITY, drafter_description("model", IDENTITY)) is None
    notes.clear()
    assert find_matching_profile({**IDENTITY, "dtype": "bfloat16"}, ngram, notes.append) is None
    assert any("dtype float32 (loaded: bfloat16): not used" in n for n in notes)
    assert resolve_profile("new").name == "new"
