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
    out = tmp_path / "gpu.json"
    rc = load_script().main(["--device", "cpu", "--tiny", "--paths", "bf16", "--modes", "ar,ngram",
                             "--batch-sizes", "1,2", "--max-tokens", "6", "--jobs", "4", "--json", str(out),
                             "--workdir", str(tmp_path)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert {(r["mode"], r["batch"]) for r in report["rows"]} == {("ar", 1), ("ngram", 1), ("ar", 2), ("ngram", 2)}
    assert all(r["tokens_per_s"] > 0 and "error" not in r for r in report["rows"])
    assert all(r["same_as_ar"] for r in report["rows"] if r["mode"] != "ar")  # float32: strict is exact
    (job,) = report["jobs"]
    assert job["batch"] == 4 and job["records"] == 8 and job["records_per_s"] > 0
    assert job["same_as_hf"] == job["records"]  # greedy, float32: the engine's tokens are generate()'s
