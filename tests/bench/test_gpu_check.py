"""scripts/gpu_check.py, the prepared GPU measurement, runs end to end on a CPU with a tiny
random model (the GPU run then only changes the device and the shape)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load_script():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_gpu_check_runs_on_a_cpu_with_a_tiny_model(tmp_path):
    """Every section of the GPU script, eager and at the captured step's static shapes (run
    eagerly: a CPU has no graphs): the drafters' rows, the t(B, n) table with its bandwidth
    fraction, and the short-output job against generate()."""
    out = tmp_path / "gpu.json"
    rc = load_script().main(["--device", "cpu", "--tiny", "--paths", "bf16", "--modes", "ar,ngram,model",
                             "--batch-sizes", "1,2", "--max-tokens", "6", "--jobs", "4", "--compile", "off,static",
                             "--steps", "1,3", "--step-batch-sizes", "1,2", "--step-context", "16",
                             "--json", str(out), "--workdir", str(tmp_path)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["copy_bandwidth_bytes_per_s"] > 0
    assert {(r["mode"], r["batch"], r["compile"]) for r in report["rows"]} == {
        (m, b, c) for m in ("ar", "ngram", "model") for b in (1, 2) for c in ("off", "static")}
    assert all(r["tokens_per_s"] > 0 and "error" not in r for r in report["rows"])
    # the overhead outside the forwards is wall - forwards - prefill of the timed run alone
    assert all(0 < r["prefill_s"] < r["wall_s"] and r["fwd_s"] + r["prefill_s"] <= r["wall_s"] for r in report["rows"])
    assert all(r["same_as_ar"] for r in report["rows"] if r["mode"] != "ar")  # float32: strict is exact
    static = [r for r in report["rows"] if r["compile"] == "static"]
    assert all(r["step_kind"] == "static" and r["capture_error"] is None for r in static)
    assert all(r["step_kind"] == "eager" for r in report["rows"] if r["compile"] == "off")
    assert all(r["same_as_static"] for r in report["rows"])  # float32: the static shapes are the eager step
    kinds = {t["kind"]: t for t in report["steps"]}
    assert set(kinds) == {"eager", "static"}
    for t in kinds.values():
        assert [r["batch"] for r in t["rows"]] == [1, 2]
        assert all(set(r["t_ms"]) == {"1", "3"} and min(r["t_ms"].values()) > 0 and r["bandwidth_fraction"] > 0
                   for r in t["rows"])
    assert {j["compile"] for j in report["jobs"]} == {"off", "static"}
    for job in report["jobs"]:
        assert job["batch"] == 4 and job["records"] == 8 and job["records_per_s"] > 0
        assert job["same_as_hf"] == job["records"]  # greedy, float32: the engine's tokens are generate()'s


def test_gpu_check_measures_a_real_target(tmp_path, tiny_model_dir):
    """--model: a saved target instead of the random one (how the CPU's compiled-against-eager
    figures are measured), with a random draft model of its vocabulary for mode "model"."""
    out = tmp_path / "real.json"
    rc = load_script().main(["--device", "cpu", "--model", str(tiny_model_dir), "--modes", "ar,ngram,model",
                             "--batch-sizes", "2", "--max-tokens", "5", "--jobs", "", "--compile", "off,static",
                             "--steps", "1,2", "--step-batch-sizes", "2", "--step-context", "16",
                             "--json", str(out), "--workdir", str(tmp_path)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert {(r["path"], r["mode"], r["compile"]) for r in report["rows"]} == {
        ("model", m, c) for m in ("ar", "ngram", "model") for c in ("off", "static")}
    assert all("error" not in r and r["tokens_per_s"] > 0 for r in report["rows"])
    assert all(r["same_as_static"] for r in report["rows"])
    assert {t["kind"] for t in report["steps"]} == {"eager", "static"}


def test_gpu_check_quick_on_a_cpu(tmp_path):
    """--quick, the first command of a GPU loan, on a CPU (a tiny model, static steps): the
    probe first (versions, attention, each cache's step kind and shapes after a first run, host
    reads per step, t(1,1) static), and for each mode the shapes built by two runs of one
    engine (none the second time), host reads per step and the outputs against static; the JSON
    is written after each section."""
    out = tmp_path / "quick.json"
    rc = load_script().main(["--device", "cpu", "--quick", "--compile", "static,off", "--json", str(out),
                             "--workdir", str(tmp_path)])
    assert rc == 0
    report = json.loads(out.read_text())
    probe = report["probe"]
    assert probe["torch"] and probe["transformers"] and probe["attention"] and probe["t_1_1_ms"]["static"] > 0
    assert set(probe["engines"]) == {"ngram", "eagle3", "model"}
    for row in probe["engines"].values():
        assert row["caches"]["target"]["step_kind"] == "static" and row["caches"]["target"]["built"] > 0
        assert row["second_run_shapes_built"] == 0 and row["host_reads_per_step"] > 0
    assert probe["engines"]["eagle3"]["caches"]["head"]["step_kind"] == "static"
    assert probe["engines"]["model"]["caches"]["draft"]["step_kind"] == "static"
    assert report["costs"] == "static" and report["skipped"] == []
    modes = {r["mode"] for r in report["rows"]}
    assert modes == {"ar", "ngram", "eagle3", "eagle3-tree", "model"}
    for r in report["rows"]:
        assert "error" not in r, r
        assert len(r["shapes_built"]) == 2 and r["shapes_built"][1] == 0, r
        assert r["transfers_per_step"] > 0 and r["same_as_static"], r
        assert r["shapes_built"][0] > 0 or r["step_kind"] == "eager"
    assert report["jobs"] and report["steps"]
