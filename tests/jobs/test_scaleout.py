"""Scale-out (issue 7): data parallel under a launcher, device maps, bitsandbytes.

The launcher tests really start `accelerate launch` (and torchrun) with two CPU processes on
the tiny model: gloo over localhost, the part files and the merge, a rank killed mid-run and
a --resume, calibrate's gathered margins. Each launch costs seconds, so there are few of them;
sharding, merging, step failures and lost ranks are also tested in-process.

accelerate 1.x starts ONE process for `accelerate launch --cpu --num_processes 2` (several CPU
processes need --mpirun_hostfile); `--multi_gpu` starts them through torchrun, on a machine
without a GPU too, and marscli then runs each on the CPU.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from marscli.cli import app
from marscli.errors import EXIT_OK, EXIT_RECORDS_FAILED, EXIT_USAGE, UsageError
from marscli.io.distributed import Group, Launch, RankLost, launch_from_env, shard
from marscli.io.results import OutputLock, find_parts, merge_results, part_path
from marscli.io.resume import sidecar_path

ROOT = Path(__file__).resolve().parents[2]
N_RECORDS = 24
#: Sampling, so each record's own seed matters; no timing, so runs compare byte for byte.
RUN = ["--no-timing", "--max-tokens", "12", "--temperature", "0.8", "--seed", "5"]
LAUNCH_TIMEOUT = 240


# ------------------------------------------------------------------------------ helpers


def write_lines(path: Path, lines: list) -> Path:
    with open(path, "wb") as f:
        for line in lines:
            f.write((line if isinstance(line, str) else json.dumps(line)).encode() + b"\n")
    return path


def ids_in(data: bytes) -> list[str]:
    return [json.loads(line)["id"] for line in data.splitlines()]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_env(marker: str = "") -> dict[str, str]:
    env = dict(os.environ)  # the isolation fixture's offline, cache and profile settings
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1",
               MARSCLI_TEST_MARKER=marker)
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def accelerate_cmd(*args: str, n: int = 2) -> list[str]:
    return [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--multi_gpu",
            "--num_processes", str(n), "--num_machines", "1", "--mixed_precision", "no",
            "--dynamo_backend", "no", "--main_process_port", str(free_port()),
            "-m", "marscli", *args]


def torchrun_cmd(*args: str, n: int = 2) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n),
            "--master_port", str(free_port()), "-m", "marscli", *args]


def run_launch(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=launch_env(), capture_output=True, timeout=LAUNCH_TIMEOUT, **kw)


def marscli_lines(stderr: bytes) -> list[str]:
    return [line for line in stderr.decode(errors="replace").splitlines() if line.startswith("marscli")]


# In-process runs use one thread, as each launched process does (OMP_NUM_THREADS=1): the
# same float sums as the launched runs, and no thread contention on a busy machine.
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def records_file(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("records")
    lines: list = [{"id": f"r{i:02d}", "prompt": f"the quick brown fox {i} jumps over the lazy dog"}
                   for i in range(N_RECORDS)]
    lines[7] = "{broken"  # an error result is merged in its place like any other
    return write_lines(d / "in.jsonl", lines)


@pytest.fixture(scope="module")
def reference(records_file, tiny_model_dir, tmp_path_factory) -> Path:
    """One process, the same settings: what every launched run must reproduce."""
    out = tmp_path_factory.mktemp("reference") / "out.jsonl"
    r = CliRunner().invoke(app, ["generate", str(records_file), "--target", str(tiny_model_dir),
                                 "-o", str(out), "-q", *RUN])
    assert r.exit_code == EXIT_RECORDS_FAILED, r.stderr
    assert out.read_bytes().count(b"\n") == N_RECORDS
    return out


# ------------------------------------------------------------------------------ launched runs


def test_two_processes_write_the_single_process_file_byte_for_byte(records_file, tiny_model_dir,
                                                                    reference, tmp_path):
    out = tmp_path / "out.jsonl"
    r = run_launch(accelerate_cmd("generate", str(records_file), "--target", str(tiny_model_dir),
                                  "-o", str(out), *RUN))
    notes = marscli_lines(r.stderr)
    # exit 3 (a record failed) is what the launcher reports as its child's exit code
    assert f"exitcode  : {EXIT_RECORDS_FAILED}".encode() in r.stderr, r.stderr.decode()
    assert out.read_bytes() == reference.read_bytes()
    assert Path(sidecar_path(out)).read_bytes() == Path(sidecar_path(reference)).read_bytes()
    assert find_parts(out) == [] and sorted(os.listdir(tmp_path)) == ["out.jsonl", "out.jsonl.marscli.json"]
    # The main process speaks for the run: one start line, one summary with the summed figures.
    assert any(n.startswith("marscli: data parallel: 2 processes on 1 machine(s)") for n in notes)
    summary = [n for n in notes if n.startswith("marscli: done:")]
    assert len(summary) == 1 and summary[0].endswith("(2 processes)")
    assert f"done: {N_RECORDS - 1}/{N_RECORDS} records ok, 1 failed" in summary[0]
    assert not any("rank 1" in n for n in notes if "skipped" not in n), notes


def _rank_pid(marker: str, rank: int) -> int | None:
    """The pid of the launched process with RANK=rank in this test's launch (Linux /proc)."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"MARSCLI_TEST_MARKER={marker}".encode() in env and f"RANK={rank}".encode() in env:
            return int(pid)
    return None


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the rank through /proc")
def test_rank_killed_mid_run_then_resume_completes_without_duplicates(records_file, tiny_model_dir,
                                                                      reference, tmp_path):
    out = tmp_path / "out.jsonl"
    args = ["generate", str(records_file), "--target", str(tiny_model_dir), "-o", str(out), *RUN]
    marker = f"kill-{os.getpid()}-{time.monotonic_ns()}"
    proc = subprocess.Popen(accelerate_cmd(*args), env=launch_env(marker),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    part1 = Path(part_path(out, 1, 2))
    deadline = time.monotonic() + LAUNCH_TIMEOUT
    victim = None
    while time.monotonic() < deadline and proc.poll() is None:
        if part1.exists() and part1.read_bytes().count(b"\n") >= 2:
            victim = _rank_pid(marker, 1)
            if victim is not None:
                os.kill(victim, signal.SIGKILL)
                break
        time.sleep(0.002)
    _, stderr = proc.communicate(timeout=LAUNCH_TIMEOUT)
    assert victim is not None, "rank 1 finished before it could be killed"
    assert proc.returncode != 0
    # The launcher stopped rank 0 (SIGTERM): it kept what it finished and said how to go on.
    assert b"terminated (SIGTERM)" in stderr and b"--resume" in stderr, stderr.decode()
    parts = find_parts(out)
    assert parts, "the finished results are in the part files"
    written = sum(Path(p).read_bytes().count(b"\n") for p in parts)
    assert 2 <= written < N_RECORDS
    # Resume with two processes: the missing records are shared out afresh.
    r = run_launch(accelerate_cmd(*args, "--resume"))
    notes = marscli_lines(r.stderr)
    assert any(f"{written} of {N_RECORDS} records already done" in n for n in notes), notes
    data = out.read_bytes()
    assert len(ids_in(data)) == len(set(ids_in(data))) == N_RECORDS
    assert data == reference.read_bytes()
    assert find_parts(out) == []


def test_an_output_in_use_refuses_the_whole_launched_run(records_file, tiny_model_dir, tmp_path):
    """Rank 0 owns the output and takes its lock (the other ranks write only part files, and
    the launched runs above show they take none); when another run holds it, every rank stops
    before loading a model and the error names the holder once."""
    out = tmp_path / "out.jsonl"
    out.write_bytes(b"another run's results\n")
    with OutputLock.acquire(out):
        r = run_launch(torchrun_cmd("generate", str(records_file), "--target", str(tiny_model_dir),
                                    "-o", str(out), *RUN))
    assert f"exitcode  : {EXIT_USAGE}".encode() in r.stderr, r.stderr.decode()
    refused = [n for n in marscli_lines(r.stderr) if "is in use by another marscli run" in n]
    assert len(refused) == 1 and f"(pid {os.getpid()} on host " in refused[0], r.stderr.decode()
    assert out.read_bytes() == b"another run's results\n" and find_parts(out) == []
    assert sorted(os.listdir(tmp_path)) == ["out.jsonl"]


def test_calibrate_under_two_processes_writes_the_same_histogram(runner, records_file, tiny_model_dir,
                                                                 tmp_path):
    args = ["--target", str(tiny_model_dir), "--max-tokens", "16", "-q"]
    one, two = tmp_path / "one.yaml", tmp_path / "two.yaml"
    r = runner.invoke(app, ["calibrate", str(records_file), "-o", str(one), *args])  # 1 thread
    assert r.exit_code == EXIT_RECORDS_FAILED, r.stderr
    r2 = run_launch(torchrun_cmd("calibrate", str(records_file), "-o", str(two), *args))
    assert b"exitcode  : 3" in r2.stderr, r2.stderr.decode()
    a, b = yaml.safe_load(one.read_text()), yaml.safe_load(two.read_text())
    assert a["histogram"]["counts"] == b["histogram"]["counts"]
    assert sum(map(sum, a["histogram"]["counts"].values())) > 0
    assert a["histogram"] == b["histogram"]
    for key in ("verification", "curve", "target", "drafter"):
        assert a[key] == b[key], key
    timing = ("seconds",)
    assert ({k: v for k, v in a["calibration_data"].items() if k not in timing}
            == {k: v for k, v in b["calibration_data"].items() if k not in timing})


def test_stdout_under_two_processes_is_the_merged_stream(records_file, tiny_model_dir, reference):
    r = run_launch(torchrun_cmd("generate", str(records_file), "--target", str(tiny_model_dir),
                                "-q", *RUN))
    assert r.stdout == reference.read_bytes(), r.stderr.decode()


# ------------------------------------------------------------------------------ sharding


def test_launch_from_env():
    assert launch_from_env({}) is None
    assert launch_from_env({"WORLD_SIZE": "1", "RANK": "0"}) is None
    got = launch_from_env({"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})
    assert got == Launch(rank=3, world_size=4, local_rank=1, local_world_size=2)
    assert got.machines == 2 and not got.is_main
    assert launch_from_env({"WORLD_SIZE": "2", "RANK": "0"}) == Launch(0, 2, 0, 2)
    for env, fragment in [({"WORLD_SIZE": "2"}, "RANK is not"),
                          ({"WORLD_SIZE": "2", "RANK": "2"}, "outside 0..1"),
                          ({"WORLD_SIZE": "two", "RANK": "0"}, "not an integer")]:
        with pytest.raises(UsageError, match=fragment):
            launch_from_env(env)


@pytest.mark.parametrize("n,world", [(0, 2), (1, 2), (7, 2), (24, 3), (5, 8)])
def test_shards_are_disjoint_balanced_and_cover_everything(n, world):
    items = list(range(n))
    shards = [shard(items, r, world) for r in range(world)]
    flat = sorted(x for s in shards for x in s)
    assert flat == items
    sizes = [len(s) for s in shards]
    assert max(sizes) - min(sizes) <= 1
    assert shards[0][:2] == items[0:2 * world:world]


# ------------------------------------------------------------------------------ parts and merge


def test_part_names(tmp_path):
    out = tmp_path / "res.jsonl"
    assert part_path(out, 1, 8) == f"{out}.rank1-of-8.part"
    for name in ("res.jsonl.rank1-of-2.part", "res.jsonl.rank0-of-2.part", "res.jsonl.rank0-of-4.part",
                 "res.jsonl2.rank0-of-2.part", "res.jsonl.rank0-of-2.part.tmp", "res.jsonl.rankx-of-2.part"):
        (tmp_path / name).write_text("")
    assert [Path(p).name for p in find_parts(out)] == [
        "res.jsonl.rank0-of-2.part", "res.jsonl.rank1-of-2.part", "res.jsonl.rank0-of-4.part"]


def _result(rid: str, error: bool = False) -> dict:
    return {"id": rid, "output": None if error else f"out {rid}",
            "error": {"type": "x", "message": "m", "line": 1} if error else None}


def _items(ids: list[str]):
    from marscli.config import Request

    return [Request(index=i, line=i + 1, id=rid, prompt="p") for i, rid in enumerate(ids)]


def test_merge_orders_dedups_and_reports_missing(tmp_path):
    from marscli.io.results import dump_json_line

    line = lambda rid, **kw: dump_json_line(_result(rid, **kw)) + "\n"  # noqa: E731
    final = tmp_path / "out.jsonl"
    final.write_text(line("a") + line("c"))
    p0, p1 = Path(part_path(final, 0, 2)), Path(part_path(final, 1, 2))
    p0.write_text(line("e") + line("c", error=True) + '{"id": "f", "outp')  # c again, a torn tail
    p1.write_text(line("b", error=True) + line("zz"))
    report = merge_results([str(final), str(p0), str(p1)], _items(["a", "b", "c", "d", "e", "f"]), str(final))
    assert ids_in(final.read_bytes()) == ["a", "b", "c", "e", "zz"]  # zz: not an input record, kept last
    assert json.loads(final.read_bytes().splitlines()[2])["error"] is None  # the first source wins
    assert report.missing == ["d", "f"] and report.written == 5 and report.failed == 1


def test_a_fresh_run_removes_stale_parts(runner, tiny_model_dir, tmp_path):
    src = write_lines(tmp_path / "in.jsonl", [{"id": "a", "prompt": "hi"}])
    out = tmp_path / "out.jsonl"
    Path(part_path(out, 1, 2)).write_text('{"id": "a", "output": "stale"}\n')
    r = runner.invoke(app, ["generate", str(src), "--target", str(tiny_model_dir), "-o", str(out),
                                 "--draft", "none", "--max-tokens", "2", "-q"])
    assert r.exit_code == EXIT_OK, r.stderr
    assert find_parts(out) == [] and "stale" not in out.read_text()


def test_one_process_resumes_what_two_left_in_parts(runner, records_file, tiny_model_dir, reference, tmp_path):
    """A crash under 2 processes leaves an empty output, 2 parts (one torn) and the sidecar;
    a single-process --resume finishes it: each record once, in input order."""
    lines = reference.read_bytes().splitlines(keepends=True)
    out = tmp_path / "out.jsonl"
    out.write_bytes(b"")
    shutil.copy(sidecar_path(reference), sidecar_path(out))
    Path(part_path(out, 0, 2)).write_bytes(b"".join(lines[0:10:2]))
    Path(part_path(out, 1, 2)).write_bytes(b"".join(lines[1:8:2]) + lines[9][:20])
    r = runner.invoke(app, ["generate", str(records_file), "--target", str(tiny_model_dir),
                                 "-o", str(out), "--resume", *RUN])
    assert r.exit_code == EXIT_RECORDS_FAILED, r.stderr
    assert "resuming" in r.stderr and "2 part file(s): 9 of 24 records already done" in r.stderr
    assert out.read_bytes() == reference.read_bytes()
    assert find_parts(out) == []


# ------------------------------------------------------------------------------ the group, in-process


class _FakeStore:
    """The few TCPStore calls Group makes, in one process."""

    def __init__(self) -> None:
        self.data: dict[str, object] = {}

    def add(self, key: str, n: int) -> int:
        self.data[key] = int(self.data.get(key, 0)) + n
        return int(self.data[key])

    def set(self, key: str, value: str) -> None:
        self.data[key] = value

    def get(self, key: str) -> bytes:
        return str(self.data[key]).encode()

    def check(self, keys: list[str]) -> bool:
        return all(k in self.data for k in keys)


def test_a_rank_without_heartbeat_is_reported_not_waited_for(monkeypatch):
    monkeypatch.setenv("MARSCLI_DIST_STALL_TIMEOUT", "0.3")
    group = Group(Launch(0, 3, 0, 3))
    group.store = _FakeStore()
    group.mark_done({"n": 0})
    group.store.set("done/1", json.dumps({"n": 1}))  # rank 1 finished; rank 2 never beats
    group.store.add("done", 1)
    t0 = time.monotonic()
    with pytest.raises(RankLost, match="rank 2 of 3 stopped responding"):
        group.wait_all_done()
    assert time.monotonic() - t0 < 5
    group.store.set("done/2", json.dumps({"n": 2}))
    group.store.add("done", 1)
    assert [p["n"] for p in group.wait_all_done()] == [0, 1, 2]


def test_one_bar_counts_every_rank(monkeypatch):
    from marscli.io.distributed import ProgressPump

    group = Group(Launch(0, 2, 0, 2))
    group.store = _FakeStore()
    seen: list[tuple[int, int]] = []
    with ProgressPump(group, lambda n, t: seen.append((n, t)), every_s=0.01):
        group.add_progress(1, 10)  # rank 0's record
        group.add_progress(1, 7)  # rank 1's, through the shared store
        time.sleep(0.1)
    assert seen[-1] == (2, 17)


def test_step_failures_are_said_once_by_the_main_process():
    main, other = Group(Launch(0, 2, 0, 2)), Group(Launch(1, 2, 1, 2))
    alike = [(0, (2, "model not found: x", False)), (1, (2, "model not found: x", False))]
    err = main._combined(alike, "loading the models")
    assert str(err) == "model not found: x" and err.exit_code == 2 and not err.reported_elsewhere
    assert other._combined(alike, "loading the models").reported_elsewhere  # silent on rank 1
    err = main._combined([(1, (1, "CUDA out of memory", False))], "loading the models")
    assert str(err) == "rank 1: CUDA out of memory (while loading the models)"


def test_stdin_under_a_launcher_is_refused_before_joining(runner, monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    r = runner.invoke(app, ["generate", "-"], input='{"prompt": "hi"}\n')
    assert r.exit_code == EXIT_USAGE and "give a file, not '-'" in r.stderr
    r = runner.invoke(app, ["bench", str(tmp_path / "x.jsonl")])
    assert r.exit_code == EXIT_USAGE and "run it without a launcher" in r.stderr


# ------------------------------------------------------------------------------ device maps, bitsandbytes


def test_parse_max_memory():
    from marscli.models.loading import max_memory_dict, parse_max_memory

    pairs = parse_max_memory("0=20GiB, 1=20GiB,CPU=64GiB")
    assert pairs == (("0", "20GiB"), ("1", "20GiB"), ("cpu", "64GiB"))
    assert max_memory_dict(pairs) == {0: "20GiB", 1: "20GiB", "cpu": "64GiB"}
    for bad, fragment in [("0=20", "with a unit"), ("gpu0=1GiB", "GPU index, cpu or disk"),
                          ("0", "DEVICE=SIZE"), ("0=1GiB,0=2GiB", "given twice"), ("", "expected")]:
        with pytest.raises(ValueError, match=fragment):
            parse_max_memory(bad)


def _real_to():
    from transformers import PreTrainedModel

    return PreTrainedModel.to


_REAL_TO = _real_to()


@pytest.fixture
def no_to(monkeypatch):
    """Fail if anything moves a model with .to(): device-mapped and quantized models must not."""
    from transformers import PreTrainedModel

    def to(self, *a, **kw):
        raise AssertionError(".to() called on a placed model")

    monkeypatch.setattr(PreTrainedModel, "to", to)


def test_max_memory_goes_to_from_pretrained_and_nothing_is_moved(tiny_model_dir, monkeypatch, no_to):
    from transformers import AutoModelForCausalLM

    from marscli.config import ModelConfig
    from marscli.models.loading import load_model

    seen = {}
    real = AutoModelForCausalLM.from_pretrained

    def spy(*a, **kw):
        seen.update({k: dict(v) if isinstance(v, dict) else v for k, v in kw.items()})
        return real(*a, **kw)  # (it converts max_memory in place)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", spy)
    lm = load_model(ModelConfig(str(tiny_model_dir), max_memory=(("cpu", "1GiB"),)))
    assert seen["device_map"] == "auto" and seen["max_memory"] == {"cpu": "1GiB"}
    assert lm.identity["device"] == "auto-map"
    assert lm.device == lm.model.get_input_embeddings().weight.device


def test_device_map_run_equals_the_plain_run(runner, tiny_model_dir, tiny_draft_dir, tmp_path):
    src = write_lines(tmp_path / "in.jsonl", [{"id": str(i), "prompt": f"hello {i}"} for i in range(3)])
    base = ["generate", str(src), "--target", str(tiny_model_dir), "--draft", str(tiny_draft_dir),
            "--no-timing", "--max-tokens", "8", "-q"]
    plain = runner.invoke(app, base)
    mapped = runner.invoke(app, [*base, "--device-map", "auto", "--max-memory", "cpu=2GiB"])
    assert plain.exit_code == mapped.exit_code == EXIT_OK, mapped.stderr
    assert [json.loads(x)["output"] for x in plain.stdout.splitlines()] == \
        [json.loads(x)["output"] for x in mapped.stdout.splitlines()]


def test_bad_model_options_are_usage_errors(runner, tmp_path):
    src = write_lines(tmp_path / "in.jsonl", [{"prompt": "hi"}])
    for args, fragment in [(["--device-map", "everywhere"], "--device-map must be one of auto"),
                           (["--max-memory", "0=20"], "--max-memory '0=20': the size must"),
                           (["--bnb-compute-dtype", "int8"], "--bnb-compute-dtype must be")]:
        r = runner.invoke(app, ["generate", str(src), *args])
        assert r.exit_code == EXIT_USAGE and fragment in r.stderr, r.stderr


def test_missing_bitsandbytes_is_a_clear_error(tiny_model_dir, monkeypatch):
    import importlib.util

    from marscli.config import ModelConfig
    from marscli.errors import ModelLoadError
    from marscli.models.loading import load_model

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    with pytest.raises(ModelLoadError, match="--load-in-4bit needs bitsandbytes, which is not installed"):
        load_model(ModelConfig(str(tiny_model_dir), device="cpu", load_in_4bit=True))
    with pytest.raises(ModelLoadError, match="--bnb-compute-dtype needs --load-in-4bit"):
        load_model(ModelConfig(str(tiny_model_dir), device="cpu", bnb_compute_dtype="float16"))


def _has_bitsandbytes() -> bool:
    import importlib.util

    return importlib.util.find_spec("bitsandbytes") is not None


@pytest.mark.skipif(not _has_bitsandbytes(), reason="bitsandbytes is not installed")
def test_4bit_on_cpu_profiles_record_the_quantization(runner, tiny_model_dir, tmp_path, monkeypatch, no_to):
    """The bitsandbytes path end to end on its CPU backend: load (never .to()), generate,
    calibrate; a profile made under 4-bit is not picked for an unquantized target or another
    compute dtype, and stderr says why."""
    src = write_lines(tmp_path / "in.jsonl", [{"id": str(i), "prompt": f"the quick brown fox {i} the quick"}
                                              for i in range(4)])
    q4 = ["--target", str(tiny_model_dir), "--device", "cpu", "--load-in-4bit", "--max-tokens", "8"]
    r = runner.invoke(app, ["calibrate", str(src), *q4, "--relax-rate", "0.5", "-q"])
    assert r.exit_code == EXIT_OK, r.stderr
    (made,) = Path(os.environ["MARSCLI_PROFILE_DIR"]).glob("*.yaml")
    name = made.stem
    assert name.endswith(".ngram.float32.bnb-4bit-nf4-float32")
    assert yaml.safe_load(made.read_text())["target"]["quantization"] == "bnb-4bit-nf4-float32"

    r = runner.invoke(app, ["generate", str(src), *q4])
    assert r.exit_code == EXIT_OK, r.stderr
    assert f"using profile {name}" in r.stderr
    assert all(json.loads(x)["spec"]["profile"]["name"] == name for x in r.stdout.splitlines())

    from transformers import PreTrainedModel

    monkeypatch.setattr(PreTrainedModel, "to", _REAL_TO)  # an unquantized model is moved as usual
    plain = ["--target", str(tiny_model_dir), "--max-tokens", "4"]
    r = runner.invoke(app, ["generate", str(src), *plain])
    assert r.exit_code == EXIT_OK
    assert "calibrated with quantization bnb-4bit-nf4-float32 (loaded: none): not used" in r.stderr
    r = runner.invoke(app, ["generate", str(src), *q4, "--bnb-compute-dtype", "bfloat16"])
    assert r.exit_code == EXIT_OK
    assert ("calibrated with quantization bnb-4bit-nf4-float32 (loaded: bnb-4bit-nf4-bfloat16): "
            "not used") in r.stderr
