"""The progress board: every rank's last started and finished collective, in the store.

Each communicator owns a `ProgressBoard`. On the critical path a collective only updates a
few attributes of it; a single daemon thread per process publishes changed boards to the
communicator's store (at most every `PUBLISH_INTERVAL_S`, or less often in a job so large that
every rank's boards would crowd its store: `publish_interval_s`) together with a heartbeat. So
publishing never puts a store round trip on a collective's path, and a board is at most one
interval behind. When a deadline expires, the rank that timed out reads every peer's entry
(`commlib.missing_ranks` names who never started the collective, and who stopped beating).

The board holds collectives only: send/recv have their own per-peer numbering, which no
peer outside the pair can compare with.

On a stream-ordered communicator (a GPU engine, `commlib.device`) "started" and "finished"
are what the rank's host issued and enqueued: its device runs the op later.

The publisher writes through a store client of its own (`Store.clone()`, `side_client`): a
TCPStore client serializes its operations, so sharing the communicator's would stop the
heartbeat while the main thread blocks in a `store.wait` (the consistency check's store
exchange), and peers would call a live rank dead. The communicator's store thread
(`commlib.store_thread`) shares it: its calls never wait on the server, and the connection is
made at creation, not on a failure's path, where a new connection to a busy store server has
taken seconds. A failed publication is retried at the next interval and logged (rate-limited);
the board stops publishing only once the store has failed `GIVE_UP_FAILURES` times in a
row over at least `GIVE_UP_S` (the job is ending, or the store's host is gone).

The thread ends when the last board closes, and at interpreter exit (`atexit`) before
Python finalizes: a daemon thread that comes back from a store call (which releases the
GIL) into a finalizing interpreter is ended by `pthread_exit`, whose forced unwinding
through pybind11's frames aborts the process (SIGABRT) after a clean run.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import threading
import time
import weakref
from dataclasses import asdict, dataclass
from typing import Any

import torch.distributed as dist

from commlib.record import log as _log
from commlib.record.flight import install_sigusr1
from commlib.store_reads import present

PUBLISH_INTERVAL_S = 0.05  # between the publisher's passes, in a job small enough (`publish_interval_s`)
# What the boards of a whole job may ask of its store, in sets per second: about a tenth of what
# one TCPStore server took here from 16 writing processes (386,000-483,000 a second; docs/measurements.md).
JOB_SETS_PER_S = 40_000
HEARTBEAT_S = 0.5
STALE_AFTER_S = 3.0  # a heartbeat older than this: the rank is stopped or dead (see `stale_after_s`)
MIN_STALE_S = 1.0  # never less: two missed heartbeats and a busy machine's delay
GIVE_UP_FAILURES = 20  # consecutive failed publications ...
GIVE_UP_S = 10.0  # ... spanning at least this long: the store is gone, stop publishing
WARN_EVERY_S = 5.0  # at most one warning per board this often while publications fail
HOST = socket.gethostname()


@dataclass
class BoardEntry:
    started_seq: int = -1
    started_op: str | None = None
    finished_seq: int = -1
    finished_op: str | None = None
    step: Any = None
    phase: Any = None
    heartbeat_ns: int = 0  # wall clock of the last publication
    pid: int = 0
    host: str = ""
    dumps_stacks: bool = False  # STACKS_SIGNAL makes it write its stacks (else the signal would kill it)
    started: int = 0  # the process's start time (`process_start_time`): tells it from a later one with its pid
    # Why this rank broke the communicator itself (the error's type), published before it
    # raised: a rank that met a peer's failure and then exits is no culprit.
    broken: str | None = None

    def inside(self) -> bool:
        """Whether it is inside a collective now (started, not finished)."""
        return self.started_seq > self.finished_seq


class ProgressBoard:
    def __init__(self, store: dist.Store, rank: int, size: int, pid: int) -> None:
        self._store = store
        self.side_client = own_client(store, rank)  # see the module docstring
        self.rank = rank
        self.size = size
        self.entry = BoardEntry(
            pid=pid,
            host=HOST,
            dumps_stacks=bool(getattr(install_sigusr1, "installed", False)),
            started=process_start_time(pid) or 0,
        )
        self._version = 0
        self._published_version = -1
        self._published_ns = 0
        self._failures = 0  # consecutive failed publications
        self._failing_since_ns = 0
        self._warned_ns = 0
        self.closed = False
        # Published once at once, not at the thread's next pass: a rank killed in its first
        # milliseconds is still found gone by its pid (`commlib.verdicts.Judge`).
        try:
            self.publish_if_due(time.time_ns())
        except Exception as exc:
            self.publish_failed(exc, time.time_ns())
        _Publisher.register(self)

    # The critical path: attribute stores only.
    def started(self, seq: int, op: str, ctx: dict[str, Any]) -> None:
        e = self.entry
        e.started_seq, e.started_op = seq, op
        e.step, e.phase = (ctx.get("step"), ctx.get("phase")) if ctx else (None, None)
        self._version += 1

    def finished(self, seq: int, op: str) -> None:
        e = self.entry
        e.finished_seq, e.finished_op = seq, op
        self._version += 1

    def publish_if_due(self, now_ns: int) -> None:
        due = now_ns - self._published_ns >= HEARTBEAT_S * 1e9
        if self.closed or (self._version == self._published_version and not due):
            return
        version = self._version
        self.entry.heartbeat_ns = now_ns
        self.side_client.set(f"board/{self.rank}", json.dumps(asdict(self.entry)))
        self._published_version, self._published_ns = version, now_ns

    def publish_failed(self, exc: Exception, now_ns: int) -> None:
        """Count a failed publication; warn now and then; close once the store is clearly gone."""
        if self._failures == 0:
            self._failing_since_ns = now_ns
        self._failures += 1
        failing_s = (now_ns - self._failing_since_ns) / 1e9
        gone = self._failures >= GIVE_UP_FAILURES and failing_s >= GIVE_UP_S
        if gone or now_ns - self._warned_ns >= WARN_EVERY_S * 1e9:
            self._warned_ns = now_ns
            _log.get_logger().warning(
                "board.publish_failed",
                board_rank=self.rank,
                failures=self._failures,
                failing_s=round(failing_s, 3),
                error=_summary(exc),
                gave_up=gone,
            )
        if gone:
            self.close()

    def publish_succeeded(self) -> None:
        if self._failures:
            _log.get_logger().info("board.publish_recovered", board_rank=self.rank, failures=self._failures)
        self._failures = 0

    def read(self, store: dist.Store | None = None) -> dict[int, BoardEntry | None]:
        """Every rank's published entry (None: never published), in a few store round trips
        (`commlib.store_reads`: every survivor of a failure reads the whole board at once).
        Never blocks on a missing key.

        `store`: a client of the board's store for a thread other than the owner's (a TCPStore
        client serializes its calls)."""
        published = present(store or self._store, [f"board/{r}" for r in range(self.size)])
        return {r: BoardEntry(**json.loads(published[r])) if r in published else None for r in range(self.size)}

    def close(self) -> None:
        self.closed = True
        _Publisher.unregister(self)

    def publish_broken(self, why: str) -> None:
        """Publish now that this rank broke the communicator (`BoardEntry.broken`)."""
        if not self.closed:
            self.entry.broken = why
            self._version += 1
            self.publish_if_due(time.time_ns())


class _Publisher:
    """The process's one publishing thread: runs while any board is open (see the module docstring)."""

    _boards: weakref.WeakSet[ProgressBoard] = weakref.WeakSet()
    _lock = threading.Lock()
    _thread: threading.Thread | None = None
    _stop = threading.Event()
    EXIT_JOIN_S = 5.0  # a store call in flight at exit is bounded by the store's own timeout

    @classmethod
    def register(cls, board: ProgressBoard) -> None:
        with cls._lock:
            cls._boards.add(board)
            if cls._thread is None and not cls._stop.is_set():
                cls._thread = threading.Thread(target=cls._run, name="commlib-board", daemon=True)
                cls._thread.start()

    @classmethod
    def unregister(cls, board: ProgressBoard) -> None:
        with cls._lock:
            cls._boards.discard(board)

    @classmethod
    def stop_at_exit(cls) -> None:
        cls._stop.set()
        thread = cls._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(cls.EXIT_JOIN_S)

    @classmethod
    def _run(cls) -> None:
        interval = PUBLISH_INTERVAL_S
        while not cls._stop.wait(interval):
            published = cls._publish_all(time.time_ns())
            if published is None:
                return
            interval = publish_interval_s(*published)

    @classmethod
    def _publish_all(cls, now: int) -> tuple[int, int] | None:
        """Publish every open board; returns (the largest one's size, how many), or None (and
        the thread's slot freed) once none is open."""
        # A function of its own so that its list of boards dies with each pass: held across
        # the sleep, it would keep closed boards (and their store clients) alive for good.
        with cls._lock:  # a board registered meanwhile would break the iteration
            boards = list(cls._boards)
            if not boards:
                cls._thread = None
                return None
        for board in boards:
            try:
                board.publish_if_due(now)
            except Exception as exc:
                # A store hiccup (a busy server, a reconnect) must not silence the board for good.
                try:
                    board.publish_failed(exc, now)
                except Exception:  # logging itself failed (a closed log): keep the thread alive
                    pass
            else:
                if board._failures:
                    board.publish_succeeded()
        return max(board.size for board in boards), len(boards)


def publish_interval_s(world_size: int, boards: int) -> float:
    """How long the publisher waits between passes, for a process with `boards` open boards in a
    job of `world_size` ranks (its largest board's size): `PUBLISH_INTERVAL_S`, or longer where
    every rank's boards would together ask more than `JOB_SETS_PER_S` of the job's one store
    server (20 a second per board per rank: at 8,000 ranks and two boards each, 320,000), but
    never over half of `HEARTBEAT_S` (0.25 s), so that a live rank's heartbeat is at most 0.75 s old
    when a peer reads it, under the 1 s (`MIN_STALE_S`) that may call it stopped."""
    return min(HEARTBEAT_S / 2, max(PUBLISH_INTERVAL_S, world_size * boards / JOB_SETS_PER_S))


atexit.register(_Publisher.stop_at_exit)


def own_client(store: dist.Store, rank: int) -> dist.Store:
    """A client of `store` for one thread alone (the publisher's: see the module docstring).

    A store that cannot be cloned (a Python `dist.Store` subclass, say) is shared, with a
    warning: that thread's calls may then pause while the main thread waits on it.
    """
    try:
        return store.clone()
    except Exception as exc:
        _log.get_logger().warning(
            "board.shared_store_client", board_rank=rank, store=type(store).__name__, error=_summary(exc)
        )
        return store


def _summary(exc: BaseException) -> str:
    """The exception's type and first line: c10d appends its whole C++ stack to the message."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:300] if lines else ''}"


def stale_after_s(deadline_s: float) -> float:
    """How old a heartbeat must be, at an op's expired deadline, for its rank to be called
    stopped or dead: `STALE_AFTER_S`, or half the deadline where that is shorter (at least
    `MIN_STALE_S`), so that a rank frozen inside a collective at its start is named by a
    deadline shorter than the threshold as well."""
    return min(STALE_AFTER_S, max(MIN_STALE_S, deadline_s / 2))


def _stat_fields(pid: int) -> list[bytes] | None:
    """/proc/PID/stat's fields from the third on (state first); None where there is no such process or no /proc."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: count from its closing one.
    return stat[stat.rindex(b")") + 2 :].split()


def process_start_time(pid: int) -> int | None:
    """When process `pid` started, in clock ticks since boot (/proc/PID/stat's 22nd field);
    None where there is no such process or no /proc."""
    fields = _stat_fields(pid)
    return None if fields is None else int(fields[19])


def process_gone(pid: int, started: int) -> bool:
    """Whether the process that published an entry (its pid, and its start time where known) has
    exited on this host: no such process, another one under its pid, or a zombie (killed, not
    yet reaped by its parent). False where /proc cannot tell."""
    fields = _stat_fields(pid)
    if fields is None:
        return os.path.isdir("/proc/self")  # without /proc nothing can be told
    return fields[0] in (b"Z", b"X") or (started != 0 and int(fields[19]) != started)
