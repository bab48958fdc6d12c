"""Shared by the observe tests (imported from their directory): a run's logs as they were while
it still hung, logs written by hand (`Job`), the verdict read from the end checked against the
full read, and the full read against itself with every line read as a dict (`same_verdict`,
`read_as_dicts`), and waiting for what another thread or process does."""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from commlib.observe import reading
from commlib.observe.diagnosis import Diagnosis, diagnose
from commlib.observe.events import read_events
from commlib.observe.verdict_from_end import verdict, verdict_fields


def live_copy(src: Path, dest: Path) -> Path:
    """The logs of `src` as they were before its first deadline expired: every event from
    the first `collective.timeout` on is left out (the timeout, the aborts, the SIGUSR1s the
    timed-out rank sent its peers), and so is every flight dump taken from then on."""
    dest.mkdir()
    files = sorted(src.glob("rank*.jsonl"))
    expired = min((e["ts_ns"] for f in files for e in read_events(f) if e["event"] == "collective.timeout"),
                  default=None)
    for log_file in files:
        lines = log_file.read_text().splitlines(keepends=True)
        (dest / log_file.name).write_text("".join(
            ln for ln in lines if expired is None or json.loads(ln).get("ts_ns", 0) < expired))
    for dump in src.glob("flight_*_sigusr1.json"):
        if expired is None or json.loads(dump.read_text())["dumped_ns"] < expired:
            shutil.copy(dump, dest)
    return dest



def same_verdict(logdir: Path, window: int = 600) -> Diagnosis:
    """The verdict read from the end of each rank's log (`commlib.observe.verdict_from_end`, with windows of
    `window` bytes, so that it must decide how far back to read), checked equal to the full read's."""
    full, tail = diagnose(logdir), verdict(logdir, window=window)
    assert tail.exit_code == full.exit_code, logdir
    assert [verdict_fields(a) for a in tail.attempts] == [verdict_fields(a) for a in full.attempts], logdir
    with read_as_dicts():
        assert diagnose(logdir).to_dict() == full.to_dict(), logdir
    return tail


@contextlib.contextmanager
def read_as_dicts() -> Iterator[None]:
    """Every line read as a dict, the general way (`commlib.observe.typed`: as where msgspec is
    not installed), not a collective's start or end as a typed `CollectiveLine`."""
    typed = reading.decode_collective, reading.decode_collectives
    reading.decode_collective, reading.decode_collectives = (lambda raw: None), (lambda lines: None)
    try:
        yield
    finally:
        reading.decode_collective, reading.decode_collectives = typed


def wait_for(predicate: Callable[[], object], timeout: float = 10.0) -> bool:
    """Whether `predicate()` came true within `timeout` seconds (polled every 5 ms)."""
    give_up = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > give_up:
            return False
        time.sleep(0.005)
    return True


class Job:
    """Logs written by hand, line by line as commlib writes them (a `log.open` line per process,
    then its events): for cases no real run can stage on one machine (two hosts, a pid that
    repeats, a line cut mid-write)."""

    def __init__(self, directory: Path, size: int, job: str = "job-1", t0_ns: int = 1_800_000_000_000_000_000,
                 tick_ms: float = 1.0) -> None:
        self.directory = directory
        self.tick_ms = tick_ms  # between two lines
        self.size = size
        self.job = job
        self.now = t0_ns
        self.procs: dict[int, dict[str, Any]] = {}  # rank -> its process's fields
        directory.mkdir(parents=True, exist_ok=True)

    def tick(self, ms: float | None = None) -> int:
        self.now += int((self.tick_ms if ms is None else ms) * 1e6)
        return self.now

    def start(self, rank: int, host: str, pid: int, attempt: int = 0) -> None:
        """A process of `rank` opens its log (appended to the rank's file, as a restart does)."""
        self.procs[rank] = {"rank": rank, "pid": pid, "attempt": attempt}
        self.append(rank, {"event": "log.open", "format": 2, "rank": rank, "size": self.size, "host": host,
                           "pid": pid, "attempt": attempt, "job": self.job, "ts_ns": self.tick()})

    def event(self, rank: int, name: str, **fields: Any) -> dict[str, Any]:
        e = {**fields, "event": name, "ts_ns": self.tick(), "mono_ns": self.now, **self.procs[rank]}
        self.append(rank, e)
        return e

    def append(self, rank: int, event: dict[str, Any] | str) -> None:
        with open(self.directory / f"rank{rank}.jsonl", "a") as f:
            f.write(event if isinstance(event, str) else json.dumps(event, separators=(",", ":")) + "\n")

    def comm(self, rank: int, name: str = "world", comm_rank: int | None = None, size: int | None = None) -> None:
        self.event(rank, "comm.init", comm=name, backend="gloo", comm_rank=rank if comm_rank is None else comm_rank,
                   comm_size=self.size if size is None else size, timeout_s=300.0)

    def collective(self, rank: int, seq: int, op: str = "all_reduce", comm: str = "world", end: bool = True,
                   comm_rank: int | None = None, deadline_s: float = 300.0, comm_size: int | None = None,
                   **context: Any) -> int:
        """A collective's start (and end); returns when it started."""
        fields = {"comm": comm, "comm_rank": rank if comm_rank is None else comm_rank,
                  "comm_size": self.size if comm_size is None else comm_size, "op": op, "seq": seq, **context}
        self.event(rank, "collective.start", shapes=[[4]], dtype="torch.float32", bytes=16, root=None, peer=None,
                   deadline_s=deadline_s, async_op=False, **fields)
        started = self.now
        if end:
            self.event(rank, "collective.end", bytes=16, peer=None, duration_s=0.001, status="ok", **fields)
        return started

    def flight_dump(self, rank: int, host: str, comm: str, comm_rank: int, entries: list[dict[str, Any]],
                    name: str) -> Path:
        proc = self.procs[rank]
        data = {"kind": "commlib.flight_recorder", "comm": comm, "rank": comm_rank, "world_rank": rank,
                "attempt": proc["attempt"], "host": host, "pid": proc["pid"], "reason": "sigusr1",
                "dumped_ns": self.tick(), "dumped_mono_ns": self.now, "capacity": 2000, "entries": entries}
        path = self.directory / name
        path.write_text(json.dumps(data))
        return path
