"""Measured step costs: the measurement, its cache (hit, changed key, corrupt file) and the
engine's use of it. No timing is asserted: only what was measured and where it went."""

from __future__ import annotations

import json

import pytest

import marscli.engine.costs as costs_mod
from marscli.config import DraftConfig, VerifyConfig
from marscli.engine import build_engine
from marscli.engine.costs import (
    COSTS_ENV,
    MEASURE_NEW_TOKENS,
    StepCosts,
    cost_key,
    costs_path,
    read_costs,
    step_costs,
)
from marscli.errors import UsageError
from marscli.models.fastpath import (
    BODY_ROWS,
    HEAD_ROWS,
    ONE_ROW,
    PACKED_FROM,
    packed_enabled,
    small_rows,
)
from marscli.models.slots import StepPlan


@pytest.fixture
def counted(monkeypatch):
    """Counts the real measurements (time_forwards calls) and makes them small; the machine
    reads as idle (no other process's CPU time), whatever else runs beside the tests."""
    monkeypatch.setattr(costs_mod, "_machine_busy", lambda: 100.0)
    calls = []
    real = costs_mod.time_forwards

    def timed(model, device, batch_sizes, new_tokens, context=costs_mod.MEASURE_CONTEXT, repeats=1, vocab=None,
              step="eager", usage=None):
        calls.append((tuple(batch_sizes), tuple(new_tokens), context))
        return real(model, device, batch_sizes, new_tokens, min(context, 16), 1, vocab, step, usage)

    monkeypatch.setattr(costs_mod, "time_forwards", timed)
    monkeypatch.setenv(COSTS_ENV, "measure")
    return calls


def test_measure_then_hit(target, counted):
    notes = []
    first = step_costs(target, None, "ngram", 4, note=notes.append)
    assert counted and counted[0][0] == (1, 2, 4) and counted[0][1] == MEASURE_NEW_TOKENS
    assert first.batch_sizes == (1, 2, 4) and all(v > 0 for r in first.target_s for v in r)
    assert first.draft_s == (0.0, 0.0, 0.0)  # prompt lookup
    path = costs_path(first.key)
    assert path.exists() and any("measured step costs" in n for n in notes)
    data = json.loads(path.read_text())
    assert data["key"]["target"]["dtype"] == "float32" and data["key"]["threads"] >= 1
    assert data["key"]["batch_sizes"] == [1, 2, 4] and "measured_in_seconds" in data
    counted.clear()
    again = step_costs(target, None, "ngram", 4)
    assert counted == []  # a hit: nothing measured
    assert again.target_s == first.target_s and again.key == first.key


def test_a_measurement_beside_other_work_serves_its_run_but_is_not_cached(target, counted, monkeypatch):
    """Other processes' CPU time during the timed forwards (read from /proc/stat, this
    process's own taken out) marks the figures a busy machine's: the run uses them, the cache
    does not keep them, the note says so, and the next run measures again; an idle machine's
    measurement is cached with the share it saw."""
    clock = [0.0]

    def busy_machine():  # every reading: 5 more seconds of other processes' work
        clock[0] += 5.0
        return clock[0]

    monkeypatch.setattr(costs_mod, "_machine_busy", busy_machine)
    notes = []
    got = step_costs(target, None, "ngram", 2, note=notes.append)
    assert got.others_share > costs_mod.BUSY_OTHERS_SHARE and got.source == "measured on a busy CPU"
    assert not costs_path(got.key).exists()
    assert any("not cached" in n and "busy" in n for n in notes), notes
    counted.clear()
    monkeypatch.setattr(costs_mod, "_machine_busy", lambda: 100.0)  # nothing else runs
    again = step_costs(target, None, "ngram", 2)
    assert len(counted) == 1 and again.others_share == 0.0
    assert json.loads(costs_path(again.key).read_text())["others_share"] == 0.0
    counted.clear()
    assert step_costs(target, None, "ngram", 2).others_share == 0.0 and counted == []  # a hit


def test_changed_key_measures_again(target, counted, monkeypatch):
    a = step_costs(target, None, "ngram", 2)
    counted.clear()
    import torch

    threads = torch.get_num_threads()
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads + 7)
    b = step_costs(target, None, "ngram", 2)
    assert len(counted) == 1 and b.key["threads"] == threads + 7
    assert costs_path(a.key) != costs_path(b.key)
    counted.clear()
    step_costs(target, None, "ngram", 8)  # another batch size: another grid, another file
    assert counted and counted[0][0] == (1, 2, 4, 8)


@pytest.mark.parametrize("damage", ["garbage", "other key", "bad table"])
def test_corrupt_file_is_measured_again(target, counted, damage):
    first = step_costs(target, None, "ngram", 2)
    path = costs_path(first.key)
    data = json.loads(path.read_text())
    if damage == "garbage":
        path.write_text("{not json")
    elif damage == "other key":
        data["key"]["torch"] = "0.0"
        path.write_text(json.dumps(data))
    else:
        data["target_seconds"] = [[1.0]]
        path.write_text(json.dumps(data))
    counted.clear()
    notes = []
    again = step_costs(target, None, "ngram", 2, note=notes.append)
    assert len(counted) == 1 and any("measuring again" in n for n in notes)
    assert read_costs(path, again.key).key == first.key  # rewritten whole


def test_remeasure_and_static_and_file(target, counted, monkeypatch, tmp_path):
    step_costs(target, None, "ngram", 1)
    counted.clear()
    step_costs(target, None, "ngram", 1, mode="remeasure")
    assert len(counted) == 1
    counted.clear()
    static = step_costs(target, None, "ngram", 1, mode="static")
    assert counted == [] and static.source == "static"
    f = tmp_path / "costs.json"
    f.write_text(json.dumps(StepCosts((1,), (1, 2), ((1.0, 1.5),), (0.0,), {"x": 1}).to_dict()))
    monkeypatch.setenv(COSTS_ENV, str(f))
    assert step_costs(target, None, "ngram", 1).target(1, 2) == 1.5
    f.write_text("[]")
    with pytest.raises(ValueError, match="costs.json"):
        step_costs(target, None, "ngram", 1)


def test_draft_model_is_timed_beside_the_target(target, counted):
    c = step_costs(target, target, "model", 2)
    assert len(counted) == 2 and counted[1][1] == (1,)  # the draft model: one new token
    assert all(v > 0 for v in c.draft_s)
    assert c.key["draft"]["dtype"] == "float32"


def test_engine_builds_with_measured_costs(target, counted, monkeypatch):
    engine = build_engine(target, None, VerifyConfig(), DraftConfig(kind="ngram"), batch_size=2)
    assert engine.costs.source == str(costs_path(engine.costs.key)) and len(counted) == 1
    counted.clear()
    build_engine(target, None, VerifyConfig(), DraftConfig(kind="none"), batch_size=2)
    build_engine(target, None, VerifyConfig(), DraftConfig(kind="ngram", adaptive=False))
    assert counted == []  # nothing to choose: nothing measured
    monkeypatch.setenv(COSTS_ENV, "/no/such/costs.json")
    with pytest.raises(UsageError, match="costs.json"):
        build_engine(target, None, VerifyConfig(), DraftConfig(kind="ngram"))


def test_cost_key_names_what_was_measured(target):
    key = cost_key(target, (1, 2), "ngram", None)
    assert key["device"] == "cpu" and key["batch_sizes"] == [1, 2]
    assert key["target"]["name"] == target.identity["name"] and key["draft"] is None
    small = small_rows()
    assert key["cpu_fastpath"] == {"head_rows": list(HEAD_ROWS), "body_rows": list(BODY_ROWS), "contiguous": True,
                                   "one_row": ONE_ROW if small == "transposed" else None, "small_rows": small,
                                   "packed_from": PACKED_FROM if packed_enabled() else None}


def test_a_changed_fast_path_is_measured_again(target, monkeypatch):
    """Costs timed with other CPU kernels are another measurement: another file."""
    from marscli.models import fastpath

    before = costs_path(cost_key(target, (1,), "ngram", None))
    monkeypatch.setattr(fastpath, "BODY_ROWS", (2, 3))
    assert costs_path(cost_key(target, (1,), "ngram", None)) != before
    monkeypatch.undo()
    other = "linear" if small_rows() == "transposed" else "transposed"
    monkeypatch.setenv(fastpath.SMALL_ROWS_ENV, other)  # the small products' kernels
    assert costs_path(cost_key(target, (1,), "ngram", None)) != before


def test_a_captured_step_is_timed_as_it_runs(target):
    """Engines whose steps run captured are timed on the captured step's slot cache, at every
    batch size (the eager B = 1 call is not what they run), and their key says so: a
    measurement of the eager step never serves them."""
    got = costs_mod.time_forwards(target.model, target.device, (1, 2), (1, 3), context=8, repeats=1,
                                  step=StepPlan("static"))
    assert len(got) == 2 and all(len(r) == 2 and all(t > 0 for t in r) for r in got)
    eager = costs_mod.cost_key(target, (1, 2), "ngram", None)
    captured = costs_mod.cost_key(target, (1, 2), "ngram", None, step=StepPlan("graphs"))
    assert eager["step"] == "eager" and captured["step"] == "graphs" and eager != captured


def test_a_noisy_grid_is_read_monotone_and_kept_as_measured():
    """A figure above a larger shape's (t(32, 1) measured at 204 ms beside t(32, 2) at 163,
    as on a busy VM) is read as the larger shape's: a longer draft or a larger batch never
    costs less, while the file keeps what was measured."""
    bs, ns = (1, 16, 32), (1, 2, 3, 5, 9)
    measured = ((0.030, 0.031, 0.029, 0.033, 0.040),   # 3 tokens below 2: 2 -> 0.029
                (0.110, 0.120, 0.125, 0.140, 0.220),
                (0.204, 0.163, 0.180, 0.170, 0.300))   # 1 above 2, 3 above 5
    c = StepCosts(bs, ns, measured, (0.0, 0.004, 0.003), source="measured")
    assert c.target_s == measured and c.to_dict()["target_seconds"] == [list(r) for r in measured]
    assert c.target(32, 1) == pytest.approx(0.163) and c.target(32, 3) == pytest.approx(0.170)
    assert c.target(1, 2) == pytest.approx(0.029)
    assert c.target(16, 1) == pytest.approx(0.110)  # already below every larger shape
    assert c.step(32, 0) <= c.step(32, 1)  # measured as is, one drafted token looked cheaper than none
    assert c.draft(16, 1) == pytest.approx(0.003)  # drafting 32 rows bounds drafting 16
    for B in (1, 2, 8, 16, 24, 32, 48):
        row = [c.target(B, n) for n in range(1, 12)]
        assert row == sorted(row)
        assert c.target(B, 3) <= c.target(B + 1, 3)
    # A grid already monotone (the synthetic curve) reads exactly as written.
    s = costs_mod.static_costs("cpu")
    assert all(s.target(b, n) == pytest.approx(s.target_s[i][j])
               for i, b in enumerate(s.batch_sizes) for j, n in enumerate(s.new_tokens))
    assert StepCosts.from_dict(c.to_dict(), "f").target(32, 1) == pytest.approx(0.163)
