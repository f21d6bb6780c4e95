"""Data parallelism under a launcher: `accelerate launch`, `torchrun` (one process per device).

The launcher starts WORLD_SIZE copies of `marscli generate` (or `calibrate`) and tells each its
RANK, and its LOCAL_RANK on its machine. Every process reads the whole input and the finished
results (--resume), then takes its **shard** of the records still to do: the j-th of them goes
to rank j % WORLD_SIZE. Round robin balances an input sorted by length as well as a shuffled
one, and on --resume the missing records are dealt out afresh, whichever rank had them before.
Every record is generated from its own seed, so which process runs it changes nothing in the
result.

Results never cross the network. Each rank writes its own part file beside the output
(``results.jsonl.rank1-of-8.part``), a line per finished record, flushed as it is written, so a
killed rank loses nothing it wrote; the main process (rank 0) merges the parts in input order
into the output once every rank is done (marscli.io.results). That needs the output's folder
on a filesystem every process sees: one machine always does; several machines need a shared
one (NFS, Lustre...), which is checked before any record is generated.

Coordination is small and goes through a gloo process group and its key-value store, on GPUs
too (no tensor ever crosses processes, so NCCL would buy nothing):

- `Group.step`: a point every rank passes after reading the input, loading the models and
  opening the parts; a failure on any rank stops every rank there, and the main process says
  which rank failed and why (the others stay silent, so an error shows once, not 8 times);
- progress counters (records, tokens) every rank adds to and the main process shows as one bar;
- heartbeats, so that the main process waiting for the others notices a rank that stopped
  (SIGKILL, a hung device) instead of waiting forever; `wait_all_done` then fails with the
  rank's number and how to go on (--resume);
- the end-of-run hand-over: each rank posts its totals; calibrate gathers the margins.

Under torchrun and accelerate a rank that dies makes the launcher stop the others (SIGTERM):
they write what they finished and exit 143, and a rerun with --resume does only what is missing.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from marscli.errors import MarscliError, UsageError

#: Seconds a collective step may wait for the slowest rank (model loading included).
ENV_TIMEOUT = "MARSCLI_DIST_TIMEOUT"
DEFAULT_TIMEOUT_S = 1800.0
#: Seconds without a heartbeat after which a rank that has not finished counts as lost.
ENV_STALL = "MARSCLI_DIST_STALL_TIMEOUT"
DEFAULT_STALL_S = 300.0
HEARTBEAT_S = 2.0
POLL_S = 0.25
_PREFIX = "marscli/"


@dataclass(frozen=True)
class Launch:
    """Where this process sits in a launched job (from the launcher's environment)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def machines(self) -> int:
        return max(1, self.world_size // max(1, self.local_world_size))


def launch_from_env(environ: dict[str, str] | None = None) -> Launch | None:
    """The launch this process is part of, or None when it runs alone (no WORLD_SIZE, or 1).

    accelerate launch and torchrun both set WORLD_SIZE, RANK, LOCAL_RANK and LOCAL_WORLD_SIZE.
    """
    env = os.environ if environ is None else environ
    raw = env.get("WORLD_SIZE")
    if raw in (None, ""):
        return None

    def number(key: str, default: int | None = None) -> int:
        value = env.get(key)
        if value in (None, ""):
            if default is None:
                raise UsageError(f"WORLD_SIZE is set ({raw}) but {key} is not: start marscli "
                                 "with a launcher (accelerate launch, torchrun) or unset WORLD_SIZE")
            return default
        try:
            return int(value)
        except ValueError:
            raise UsageError(f"{key}={value!r} is not an integer") from None

    world = number("WORLD_SIZE")
    if world < 1:
        raise UsageError(f"WORLD_SIZE={world} must be at least 1")
    if world == 1:
        return None
    rank = number("RANK")
    if not 0 <= rank < world:
        raise UsageError(f"RANK={rank} is outside 0..{world - 1} (WORLD_SIZE={world})")
    local_rank = number("LOCAL_RANK", rank)
    local_world = number("LOCAL_WORLD_SIZE", world)
    return Launch(rank, world, local_rank, local_world)


def shard(items: Sequence[Any], rank: int, world_size: int) -> list[Any]:
    """This rank's records: every world_size-th one, starting at its rank."""
    return list(items[rank::world_size])


def ids_digest(ids: Iterator[str] | Sequence[str]) -> str:
    """A short digest of an ordered id list: ranks compare what they are about to share out."""
    h = hashlib.sha256()
    for i in ids:
        h.update(i.encode("utf-8", "surrogatepass") + b"\0")
    return h.hexdigest()[:16]


def env_seconds(key: str, default: float) -> float:
    raw = os.environ.get(key)
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise UsageError(f"{key}={raw!r} must be a number of seconds") from None
    if value <= 0:
        raise UsageError(f"{key}={raw!r} must be positive")
    return value


# --------------------------------------------------------------------------- devices


def place_device(device: str, launch: Launch) -> str:
    """The device a rank uses for --device: 'auto' and 'cuda' become this rank's own GPU
    (cuda:LOCAL_RANK, wrapping around when there are fewer GPUs than processes)."""
    import torch

    spec = (device or "auto").strip().lower()
    if spec in ("auto", "cuda") and torch.cuda.is_available():
        n = torch.cuda.device_count()
        index = launch.local_rank % n
        torch.cuda.set_device(index)
        return f"cuda:{index}"
    return device


def rank_max_memory(launch: Launch | None, given: dict[Any, str] | None) -> dict[Any, str] | None:
    """With --device-map under a launcher: this rank's slice of the machine's GPUs.

    The GPUs are split evenly between the processes of a machine (8 GPUs, 2 processes: 0-3 and
    4-7), so replicas of a model spread over several GPUs do not land on the same ones. The
    sizes come from --max-memory when given, else the free memory of each GPU. Without a
    launcher, --max-memory passes through unchanged.
    """
    if launch is None:
        return given
    import torch

    if not torch.cuda.is_available():
        return given
    n = torch.cuda.device_count()
    per = n // launch.local_world_size
    if per < 1:
        raise UsageError(
            f"--device-map under {launch.local_world_size} processes per machine needs at least "
            f"one GPU per process; this machine has {n}"
        )
    mine = range(launch.local_rank * per, (launch.local_rank + 1) * per)
    out: dict[Any, str] = {}
    for i in mine:
        if given is not None and i in given:
            out[i] = given[i]
        elif given is None or not any(isinstance(k, int) for k in given):
            free, _ = torch.cuda.mem_get_info(i)
            out[i] = f"{int(free * 0.9) // (1 << 20)}MiB"
    if given is not None:
        out.update({k: v for k, v in given.items() if not isinstance(k, int)})
    if not any(isinstance(k, int) for k in out):
        raise UsageError(f"--max-memory names no GPU of this rank's share ({list(mine)})")
    return out


# --------------------------------------------------------------------------- errors


class PeerFailed(MarscliError):
    """A step failed on some rank. Every rank raises it; only the main process prints it."""

    def __init__(self, message: str, exit_code: int, *, print_here: bool):
        super().__init__(message)
        self.exit_code = exit_code
        self.reported_elsewhere = not print_here


class RankLost(MarscliError):
    """A rank stopped before finishing (no heartbeat)."""


# --------------------------------------------------------------------------- the group


class Group:
    """The process group of one launched run: steps, counters, heartbeats, hand-over."""

    def __init__(self, launch: Launch):
        self.launch = launch
        self.rank = launch.rank
        self.world_size = launch.world_size
        self.is_main = launch.is_main
        self.timeout_s = env_seconds(ENV_TIMEOUT, DEFAULT_TIMEOUT_S)
        self.stall_s = env_seconds(ENV_STALL, DEFAULT_STALL_S)
        self.store: Any = None
        self._beat_stop = threading.Event()
        self._beat: threading.Thread | None = None
        self._owns_pg = False

    # ------------------------------------------------------------------ life cycle

    def start(self) -> Group:
        import torch.distributed as dist

        timeout = _dt.timedelta(seconds=self.timeout_s)
        try:
            if dist.is_initialized():
                base = dist.distributed_c10d._get_default_store()
            else:
                base, _, _ = next(dist.rendezvous("env://", rank=self.rank,
                                                  world_size=self.world_size, timeout=timeout))
                dist.init_process_group("gloo", store=base, rank=self.rank,
                                        world_size=self.world_size, timeout=timeout)
                self._owns_pg = True
        except (RuntimeError, ValueError, OSError) as e:
            raise MarscliError(f"rank {self.rank} of {self.world_size}: cannot join the other "
                               f"processes (MASTER_ADDR/MASTER_PORT): {_first_line(e)}") from None
        self.store = dist.PrefixStore(_PREFIX, base)
        self._beat = threading.Thread(target=self._heartbeat, name="marscli-heartbeat", daemon=True)
        self._beat.start()
        return self

    def close(self) -> None:
        self._beat_stop.set()
        if self._beat is not None:
            self._beat.join(timeout=5)
            self._beat = None
        if self._owns_pg:
            import torch.distributed as dist

            with contextlib.suppress(Exception):
                dist.destroy_process_group()
            self._owns_pg = False

    def _heartbeat(self) -> None:
        key = f"hb/{self.rank}"
        while not self._beat_stop.is_set():
            try:
                self.store.add(key, 1)
            except Exception:  # noqa: BLE001 - the store went away: the run is ending anyway
                return
            self._beat_stop.wait(HEARTBEAT_S)

    # ------------------------------------------------------------------ collective steps

    def exchange(self, value: Any, what: str) -> list[Any]:
        """Every rank's value, in rank order (all ranks must call this at the same point)."""
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        try:
            dist.all_gather_object(out, value)
        except RuntimeError as e:
            raise MarscliError(f"rank {self.rank}: lost the other processes while {what} "
                               f"({_first_line(e)}); see their messages above") from None
        return out

    @contextlib.contextmanager
    def step(self, what: str) -> Iterator[_Step]:
        """A block every rank runs and leaves together. A MarscliError raised inside on any rank
        is raised on every rank (as PeerFailed, printed by the main process only). What the
        block puts in `step.value` is gathered into `step.values` (rank order)."""
        s = _Step()
        error: MarscliError | None = None
        try:
            yield s
        except MarscliError as e:
            error = e
        payload = (None if error is None else (error.exit_code, str(error),
                                               getattr(error, "reported_elsewhere", False)), s.value)
        got = self.exchange(payload, what)
        failures = [(r, f) for r, (f, _) in enumerate(got) if f is not None]
        if failures:
            raise self._combined(failures, what)
        s.values = [v for _, v in got]

    def _combined(self, failures: list[tuple[int, tuple[int, str, bool]]], what: str) -> PeerFailed:
        messages = {msg for _, (_, msg, _) in failures}
        code = failures[0][1][0]
        if len(messages) == 1 and len(failures) == self.world_size:
            text = messages.pop()  # every rank failed alike (a bad option, a missing model)
        else:
            text = "; ".join(f"rank {r}: {msg}" for r, (_, msg, _) in failures)
            if len(failures) < self.world_size:
                text = f"{text} (while {what})"
        return PeerFailed(text, code, print_here=self.is_main)

    def fail_all(self, message: str, exit_code: int = 2) -> PeerFailed:
        """An error every rank found alike (from exchanged values): the main process says it."""
        return PeerFailed(message, exit_code, print_here=self.is_main)

    def gather(self, value: Any, what: str) -> list[Any] | None:
        """Every rank's value on the main process (None elsewhere)."""
        import torch.distributed as dist

        out: list[Any] | None = [None] * self.world_size if self.is_main else None
        try:
            dist.gather_object(value, out, dst=0)
        except RuntimeError as e:
            raise MarscliError(f"rank {self.rank}: lost the other processes while {what} "
                               f"({_first_line(e)})") from None
        return out

    # ------------------------------------------------------------------ counters

    def add_progress(self, records: int, tokens: int) -> None:
        self.store.add("progress/records", records)
        self.store.add("progress/tokens", tokens)

    def progress(self) -> tuple[int, int]:
        return self.store.add("progress/records", 0), self.store.add("progress/tokens", 0)

    def request_stop(self, reason: dict[str, Any]) -> None:
        """--fail-fast: ask every rank to stop after its current record."""
        if not self.store.check(["stop"]):
            self.store.set("stop", json.dumps(reason))

    def stop_requested(self) -> dict[str, Any] | None:
        if not self.store.check(["stop"]):
            return None
        return json.loads(self.store.get("stop"))

    # ------------------------------------------------------------------ the end

    def mark_done(self, payload: dict[str, Any]) -> None:
        """This rank finished its shard; `payload` (JSON) goes to whoever waits for it."""
        self.store.set(f"done/{self.rank}", json.dumps(payload))
        self.store.add("done", 1)

    def wait_all_done(self, on_tick: Callable[[], None] | None = None) -> list[dict[str, Any]]:
        """Wait until every rank marked itself done; their payloads in rank order.

        Raises RankLost when a rank that has not finished sends no heartbeat for
        MARSCLI_DIST_STALL_TIMEOUT seconds (killed, or hung in a device call).
        """
        last: dict[int, tuple[int, float]] = {}
        while True:
            if self.store.add("done", 0) >= self.world_size:
                break
            now = time.monotonic()
            for r in range(self.world_size):
                if r == self.rank or self.store.check([f"done/{r}"]):
                    continue
                beats = self.store.add(f"hb/{r}", 0)
                seen = last.get(r)
                if seen is None or seen[0] != beats:
                    last[r] = (beats, now)
                elif now - seen[1] > self.stall_s:
                    raise RankLost(
                        f"rank {r} of {self.world_size} stopped responding (no heartbeat for "
                        f"{now - seen[1]:.0f} s; {ENV_STALL} sets the limit) before finishing its "
                        "records"
                    )
            if on_tick is not None:
                on_tick()
            time.sleep(POLL_S)
        return [json.loads(self.store.get(f"done/{r}")) for r in range(self.world_size)]


class _Step:
    def __init__(self) -> None:
        self.value: Any = None
        self.values: list[Any] = []


@contextlib.contextmanager
def solo_step(what: str) -> Iterator[_Step]:
    """Group.step for a process that runs alone: errors pass through unchanged."""
    s = _Step()
    yield s
    s.values = [s.value]


class ProgressPump:
    """On the main process: copies the group's counters into the progress display while the
    run goes on (a thread, so the bar moves during the main process's own long records)."""

    def __init__(self, group: Group, set_progress: Callable[[int, int], None], every_s: float = 0.5):
        self.group = group
        self.set_progress = set_progress
        self.every_s = every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="marscli-progress", daemon=True)

    def __enter__(self) -> ProgressPump:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.tick()

    def tick(self) -> None:
        try:
            records, tokens = self.group.progress()
        except Exception:  # noqa: BLE001 - a display must never end a run
            return
        self.set_progress(records, tokens)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.tick()


def _first_line(exc: BaseException) -> str:
    for line in str(exc).splitlines():
        if line.strip():
            return line.strip()
    return type(exc).__name__
