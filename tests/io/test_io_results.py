"""Tests of marscli.io.results: ordered writing, atomic writes, reading an output back."""

from __future__ import annotations

import errno
import io
import json
import os
from pathlib import Path

import pytest

from marscli.errors import MarscliError, OutputInUseError, UsageError
from marscli.io.results import (
    OutputLock,
    ResultWriter,
    atomic_write_text,
    dump_json_line,
    find_parts,
    held_path,
    lock_path,
    scan_output,
)

# ---------------------------------------------------------------------------------------------
# Writing


class FlushSpy(io.StringIO):
    def __init__(self):
        super().__init__()
        self.flushed: list[str] = []

    def flush(self):
        super().flush()
        self.flushed.append(self.getvalue())


def test_dump_json_line():
    assert dump_json_line({"b": 1, "a": "é", "c": [1, 2]}) == '{"b": 1, "a": "é", "c": [1, 2]}'
    with pytest.raises(ValueError):
        dump_json_line({"x": float("nan")})


def test_writer_reorders_and_flushes_per_line():
    out = FlushSpy()
    w = ResultWriter(out)
    w.write(2, {"i": 2})
    w.write(1, {"i": 1})
    assert out.getvalue() == ""
    assert w.pending == [1, 2]
    w.write(0, {"i": 0})
    assert out.getvalue() == '{"i": 0}\n{"i": 1}\n{"i": 2}\n'
    assert out.flushed[:3] == ['{"i": 0}\n', '{"i": 0}\n{"i": 1}\n',
                               '{"i": 0}\n{"i": 1}\n{"i": 2}\n']
    assert w.written == 3 and w.next_index == 3
    w.close(strict=True, total=3)
    assert not out.closed  # a stream we did not open stays open


def test_writer_journals_results_waiting_behind_a_gap(tmp_path):
    """A result that finished ahead of an earlier one is in the held file, flushed, before
    the writer is closed: a killed process (no close, no handler) loses none of them."""
    out, held = tmp_path / "out.jsonl", held_path(tmp_path / "out.jsonl")
    w = ResultWriter(out, held=held)
    w.write(0, {"id": "a"})
    assert not os.path.exists(held)  # in order: nothing to journal, no file
    w.write(3, {"id": "d"})
    w.write(2, {"id": "c"})
    assert [json.loads(x)["id"] for x in Path(held).read_text().splitlines()] == ["d", "c"]
    assert out.read_text() == '{"id": "a"}\n'
    assert find_parts(out) == [held]  # --resume reads it like a part file
    w.close()
    assert Path(held).read_text().count("\n") == 2  # what waits behind the gap stays


def test_writer_start_index_and_skip():
    out = io.StringIO()
    w = ResultWriter(out, start_index=5, skip={6, 8})
    w.write(7, {"i": 7})
    assert out.getvalue() == ""
    w.write(5, {"i": 5})
    assert [json.loads(x)["i"] for x in out.getvalue().splitlines()] == [5, 7]
    assert w.next_index == 9
    for bad in (4, 5, 6, 8):
        with pytest.raises(ValueError):
            w.write(bad, {})
    w.close(strict=True)


def test_writer_skip_at_start():
    out = io.StringIO()
    w = ResultWriter(out, skip=[0, 1])
    assert w.next_index == 2
    w.write(2, {"i": 2})
    assert out.getvalue() == '{"i": 2}\n'


def test_writer_close_strict_reports_gaps():
    out = io.StringIO()
    w = ResultWriter(out)
    w.write(0, {})
    w.write(2, {})
    with pytest.raises(RuntimeError, match="missing for indices 1"):
        w.close(strict=True)
    assert out.getvalue() == "{}\n"  # results behind a gap are not written

    w = ResultWriter(io.StringIO())
    w.write(0, {})
    with pytest.raises(RuntimeError, match="1, 2"):
        w.close(strict=True, total=3)

    w = ResultWriter(io.StringIO())
    w.write(1, {})
    w.close()  # not strict: no error
    with pytest.raises(ValueError):
        w.write(0, {})


def test_writer_file_dest_and_append(tmp_path):
    p = tmp_path / "out.jsonl"
    with ResultWriter(p) as w:
        w.write(0, {"id": "a", "text": "ü"})
    with ResultWriter(str(p), append=True, start_index=1) as w:
        w.write(1, {"id": "b"})
    assert p.read_bytes() == '{"id": "a", "text": "ü"}\n{"id": "b"}\n'.encode()
    with ResultWriter(p) as w:
        w.write(0, {"id": "c"})
    assert p.read_text(encoding="utf-8") == '{"id": "c"}\n'
    with pytest.raises(MarscliError, match="cannot write output file"):
        ResultWriter(tmp_path / "no" / "such" / "dir.jsonl")


@pytest.mark.parametrize("dest", [None, "-"])
def test_writer_stdout(dest, capsys):
    with ResultWriter(dest) as w:
        w.write(0, {"ok": True})
    assert capsys.readouterr().out == '{"ok": true}\n'


class BrokenStream(io.StringIO):
    def __init__(self, fail_after: int):
        super().__init__()
        self.fail_after = fail_after
        self.writes = 0

    def write(self, s):
        self.writes += 1
        if self.writes > self.fail_after:
            raise BrokenPipeError(32, "Broken pipe")
        return super().write(s)


def test_writer_broken_pipe_is_quiet():
    out = BrokenStream(fail_after=1)
    w = ResultWriter(out)
    w.write(0, {"i": 0})
    assert not w.broken_pipe
    w.write(1, {"i": 1})  # raises inside, swallowed
    assert w.broken_pipe
    w.write(2, {"i": 2})  # silently dropped
    w.write(5, {"i": 5})
    assert out.writes == 2 and w.written == 1
    w.close(strict=True)  # no exception after a broken pipe
    assert out.getvalue() == '{"i": 0}\n'


def test_writer_broken_pipe_on_stdout(monkeypatch):
    class BrokenFlush(io.StringIO):
        def flush(self):
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr("sys.stdout", BrokenFlush())
    with ResultWriter("-") as w:
        w.write(0, {})
        w.write(1, {})
    assert w.broken_pipe


# ---------------------------------------------------------------------------------------------
# Atomic writes


def test_atomic_write_text_replaces_and_leaves_no_temp(tmp_path):
    p = tmp_path / "profile.yaml"
    atomic_write_text(p, "a: 1\n")
    assert p.read_text(encoding="utf-8") == "a: 1\n"
    os.chmod(p, 0o640)
    atomic_write_text(str(p), "a: 2\nb: é\n")
    assert p.read_bytes() == "a: 2\nb: é\n".encode()
    assert os.stat(p).st_mode & 0o777 == 0o640
    assert sorted(os.listdir(tmp_path)) == ["profile.yaml"]


def test_atomic_write_text_new_file_gets_umask_mode(tmp_path):
    old = os.umask(0o022)
    try:
        atomic_write_text(tmp_path / "r.json", "{}")
    finally:
        os.umask(old)
    assert os.stat(tmp_path / "r.json").st_mode & 0o777 == 0o644


def test_atomic_write_text_cleans_up_on_error(tmp_path, monkeypatch):
    p = tmp_path / "report.json"
    p.write_text("old", encoding="utf-8")

    def boom(src, dst):
        raise OSError("disk on fire")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk on fire"):
        atomic_write_text(p, "new")
    assert p.read_text(encoding="utf-8") == "old"
    assert sorted(os.listdir(tmp_path)) == ["report.json"]
    with pytest.raises(TypeError):
        atomic_write_text(p, b"bytes")  # type: ignore[arg-type]
    assert sorted(os.listdir(tmp_path)) == ["report.json"]


# ---------------------------------------------------------------------------------------------
# Reading an output back


def _result(rid, error=None):
    return dump_json_line({"id": rid, "output": "x", "error": error}) + "\n"


def test_scan_output_keeps_complete_lines_and_cuts_a_torn_one(tmp_path):
    p = tmp_path / "out.jsonl"
    body = _result("a") + _result("b", {"type": "invalid_json"}) + dump_json_line(
        {"custom_id": "c", "error": None}) + "\n"
    p.write_bytes(body.encode() + b'{"id": "d", "out')
    scan = scan_output(p)
    assert scan.done == {"a": False, "b": True, "c": False}
    assert scan.keep_bytes == len(body.encode()) and scan.torn_bytes == len(b'{"id": "d", "out')
    # A complete last line without its newline is torn too: it is regenerated.
    p.write_bytes(_result("a").encode() + _result("b").encode().rstrip(b"\n"))
    assert list(scan_output(p).done) == ["a"]


@pytest.mark.parametrize("content,fragment", [
    (b"garbage\n", "line 1 is not a marscli result (not valid JSON)"),
    (b'{"id": "a"}\n[1]\n', "line 2 is not a marscli result (a JSON array, not an object)"),
    (b'{"id": 3}\n', "no string 'id' or 'custom_id'"),
    (b'{"id": "a"}\n{"id": "a"}\n', "id 'a' appears twice (line 2)"),
    (b'\xff\xfe\n', "not valid JSON"),
])
def test_scan_output_refuses_files_it_did_not_write(tmp_path, content, fragment):
    p = tmp_path / "out.jsonl"
    p.write_bytes(content)
    with pytest.raises(UsageError) as exc:
        scan_output(p)
    assert fragment in str(exc.value) and "\n" not in str(exc.value)


# ---------------------------------------------------------------------------------------------
# The output lock


def test_output_lock_excludes_names_its_holder_and_cleans_up(tmp_path):
    out = tmp_path / "out.jsonl"
    lock = OutputLock.acquire(out)
    assert lock.held and lock.path == lock_path(out) == f"{out}.marscli.lock"
    holder = json.loads(open(lock.path).read())
    assert holder["pid"] == os.getpid() and holder["host"] and holder["started"]
    with pytest.raises(OutputInUseError, match=rf"pid {os.getpid()} on host .*, started "):
        OutputLock.acquire(out)  # a second open file description: flock refuses it
    lock.release()
    lock.release()  # twice is fine
    assert not os.path.exists(lock.path)
    with OutputLock.acquire(out) as again:
        assert again.held
    assert not os.path.exists(lock.path)


def test_output_lock_takes_over_a_lock_file_left_by_a_dead_run(tmp_path):
    out = tmp_path / "out.jsonl"
    with open(lock_path(out), "wb") as f:
        f.write(b"\xff garbage from a killed run, much longer than what we write" * 10)
    with OutputLock.acquire(out):
        holder = json.loads(open(lock_path(out)).read())  # rewritten whole, nothing left over
        assert holder["pid"] == os.getpid()


def test_output_lock_holder_unreadable_is_still_refused_in_one_line(tmp_path, monkeypatch):
    import marscli.io.results as results

    out = tmp_path / "out.jsonl"
    monkeypatch.setattr(results, "_HOLDER_WAIT_S", 0.05)
    with OutputLock.acquire(out):
        with open(lock_path(out), "wb") as f:
            f.write(b'{"pid": "1\n2", "host": ')  # an untrusted file: torn, control characters
        with pytest.raises(OutputInUseError, match="it has not said who it is") as exc:
            OutputLock.acquire(out)
        assert "\n" not in str(exc.value)
        with open(lock_path(out), "w") as f:
            f.write('{"pid": "1\\n2", "host": "h\\u0007", "started": "' + "x" * 500 + '"}')
        with pytest.raises(OutputInUseError) as exc:
            OutputLock.acquire(out)
        assert "pid 1?2 on host h?, started " + "x" * 64 + ")" in str(exc.value)


def test_output_lock_relocks_when_the_file_is_replaced_under_it(tmp_path, monkeypatch):
    """The holder before us unlinks the lock file as it releases: if that happens between our
    open and our flock, we must lock the file now at the path, not the unlinked one (else two
    runs would both think they hold the output)."""
    import marscli.io.results as results

    out = tmp_path / "out.jsonl"
    real_open = os.open
    opened = []

    def racing_open(path, flags, mode=0o777):
        fd = real_open(path, flags, mode)
        if not opened:  # first try: a releasing holder removes the file, a newcomer recreates it
            os.unlink(path)
            real_open(path, os.O_RDWR | os.O_CREAT, 0o666)
        opened.append(fd)
        return fd

    monkeypatch.setattr(results.os, "open", racing_open)
    with OutputLock.acquire(out) as lock:
        assert len(opened) == 2
        assert os.path.samestat(os.fstat(opened[1]), os.stat(lock.path))
        # ... and the lock really is on the file at the path: a third run is refused.
        monkeypatch.setattr(results.os, "open", real_open)
        with pytest.raises(OutputInUseError):
            OutputLock.acquire(out)


@pytest.mark.parametrize("err", [errno.ENOLCK, errno.EOPNOTSUPP])
def test_output_lock_on_a_filesystem_without_locks_goes_on_unlocked(tmp_path, monkeypatch, err):
    import fcntl

    def no_locks(fd, op):
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    lock = OutputLock.acquire(tmp_path / "out.jsonl")
    assert not lock.held
    lock.release()


def test_probing_a_new_output_leaves_no_trace(tmp_path):
    """The writability probe must not create (and then remove) the output itself: a watcher
    polling for the output's first line would see a file appear and vanish."""
    from marscli.io.resume import _probe_writable

    out = tmp_path / "out.jsonl"
    _probe_writable(str(out))
    assert list(tmp_path.iterdir()) == []
    out.write_text("kept\n")
    _probe_writable(str(out))
    assert out.read_text() == "kept\n" and list(tmp_path.iterdir()) == [out]
