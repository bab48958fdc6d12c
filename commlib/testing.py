"""Run a function on N ranks, for tests: N real processes (`run`) or N threads (`run_threads`).

`run(fn, world_size=2, backend="gloo", timeout=60.0, args=())` starts a fresh TCPStore on
a free loopback port in the calling process, spawns one process per rank (with RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT set, as torchrun would), and in each
calls `fn(comm, *args)` with `comm = commlib.init(backend, ...)` on that store, or
`fn(*args)` when `backend` is None (for code that builds its own communicator from the
environment). It returns each rank's result in rank order, re-raises the first failing
rank's exception as `RankError` with that rank and its traceback, and never outlives its
timeout: ranks still running then are killed and `RankTimeout` says which.

Ranks fork from a server process that imported torch, commlib and pytest once
(multiprocessing's forkserver), so a rank costs a fork, not a fresh interpreter importing
torch (about 2 s of CPU each, most of a small test's time), nor commlib and the test
module's pytest (0.3 s of CPU each; `scripts/bench_forked_ranks.py`). torch reads part of
the environment when it is imported (whether to route through torchcomms, and whether
torchcomms is importable), so the server is used only while the variables read at import
(`_READ_AT_IMPORT`, less `_READ_LATER`) are as they were when this module was imported (the
server starts with them); a call made under others (a test that set one) spawns fresh
interpreters, as before. The server also starts only under PYTHONPATH as it was then: its
`import torch` looks once for torchcomms on the path, and a server started inside a test that
put the torchcomms stand-in there would hand it to every later rank; so a call made under
another PYTHONPATH before the server is up spawns fresh interpreters too (this process's
environment is never changed to start it). Each rank gets the caller's whole environment
either way. A forked rank's stdout and stderr are the server's, those
of the call that started it (under pytest, that test's captured output): a rank's
exception still comes back whole in `RankError`, but what it printed shows in no later
test's report.

`run_threads(fn, world_size=2, ...)` runs the ranks as threads of this process instead, each
with a communicator of its own over one shared store (torchft's way): no process to start, so a
contract test of a few ranks costs its waits and little else. A rank's log is its own
(`commlib.record.log.rank_log`); what stays one per process is said at `run_threads`, and a
test about processes (kills, signals, /proc, torchrun, torch's default group) uses `run`.

`outcome(fn)` is for a rank that expects a commlib error: what `fn()` raised, as plain data.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import pickle
import queue
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

# The variables the fork server's imports may have read (the interpreter, torch, the OpenMP
# and MKL runtimes torch loads, the dynamic loader): a rank forked from it has what they
# made of them then.
_READ_AT_IMPORT = ("TORCH", "PYTORCH", "PYTHON", "OMP_", "GOMP_", "KMP_", "MKL_", "LD_")
# Except inductor's: the server does not import inductor (a rank that does reads them from
# its own environment), and torch.compile writes its cache dir into this process's. And
# PYTHONPATH: the interpreter reads it only to build sys.path, and a forked rank gets the
# caller's sys.path as it is at the call (multiprocessing sends it with each process), so a
# test that puts a package on both (the torchcomms stand-in) still forks once the server is up
# (`_context`). torch's one import-time look at what is importable (distributed_c10d's probe for torchcomms) counts only
# under TORCH_DISTRIBUTED_USE_TORCHCOMMS, a TORCH variable, which still sends a call to spawn.
_READ_LATER = ("TORCHINDUCTOR_", "PYTHONPATH")


def _import_time_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(_READ_AT_IMPORT) and not k.startswith(_READ_LATER)}


# The fork server's environment: this process's as this module was imported (before any
# test set a variable), whichever call starts the server.
_SERVER_ENV = _import_time_env()
_SERVER_PYTHONPATH = os.environ.get("PYTHONPATH")
_server_started = False  # whether a call has forked from the server (so started it), under _SERVER_PYTHONPATH
# What every rank imports: torch, commlib, and pytest (a test's function is found in its test
# module, which imports it). One not installed is skipped (multiprocessing ignores its ImportError).
multiprocessing.set_forkserver_preload(["torch", "commlib", "commlib.testing", "pytest"])


def outcome(fn: Callable[[], Any]) -> dict[str, Any]:
    """{"error": None} when `fn()` returns, else the commlib error's type name and fields."""
    from commlib.errors import CommError

    try:
        fn()
        return {"error": None}
    except CommError as exc:
        return {"error": type(exc).__name__, **exc.fields()}


class RankError(RuntimeError):
    """A rank's function raised. `exc` is the original exception (when it could be pickled)."""

    def __init__(self, rank: int, exc: BaseException | None, tb: str) -> None:
        super().__init__(f"rank {rank} raised:\n{tb}")
        self.rank = rank
        self.exc = exc
        self.traceback = tb


class RankTimeout(RuntimeError):
    """Some ranks did not finish within the timeout; they were killed."""

    def __init__(self, ranks: list[int], timeout: float) -> None:
        super().__init__(f"ranks {ranks} did not finish within {timeout} s; killed")
        self.ranks = ranks


@dataclass
class _Outcome:
    rank: int
    ok: bool
    value: Any = None
    exc: bytes | None = None
    tb: str = ""


def _context() -> multiprocessing.context.ForkServerContext | multiprocessing.context.SpawnContext:
    """The fork server while this process's environment is `_SERVER_ENV` and the server is up or
    starts under `_SERVER_PYTHONPATH` (module docstring; it starts with the first rank it forks,
    so in that environment); fresh interpreters otherwise."""
    global _server_started
    if _import_time_env() != _SERVER_ENV:
        return multiprocessing.get_context("spawn")
    if os.environ.get("PYTHONPATH") == _SERVER_PYTHONPATH:
        _server_started = True
    if not _server_started:
        return multiprocessing.get_context("spawn")
    return multiprocessing.get_context("forkserver")


def _child(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    backend: str | None,
    args: tuple[Any, ...],
    init_kwargs: dict[str, Any],
    env: dict[str, str],
    results: Any,
) -> None:
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    try:
        if backend is None:
            value = fn(*args)
        else:
            import commlib

            store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False)
            comm = commlib.init(backend, rank=rank, world_size=world_size, store=store, **init_kwargs)
            value = fn(comm, *args)
        outcome = _Outcome(rank, True, value)
    except BaseException as exc:  # report everything, SystemExit included
        try:
            blob = pickle.dumps(exc)
        except Exception:
            blob = None
        outcome = _Outcome(rank, False, exc=blob, tb=traceback.format_exc())
    # Pickled here, by value: the queue's own pickler would share tensor storage through
    # file descriptors that die with this process.
    results.put(pickle.dumps(outcome))
    results.close()
    results.join_thread()  # flush the queue's feeder thread before the hard exit below
    # Skip interpreter teardown: process groups whose peers died can block it.
    os._exit(0)


def run(
    fn: Callable[..., Any],
    world_size: int = 2,
    backend: str | None = "gloo",
    timeout: float = 60.0,
    args: tuple[Any, ...] = (),
    allow_dead_ranks: bool = False,
    **init_kwargs: Any,
) -> list[Any]:
    """Run `fn` on `world_size` ranks; see the module docstring. `init_kwargs` go to `commlib.init`.

    With `allow_dead_ranks`, a rank that exits without a result (killed on purpose by a
    test) gets None instead of failing the run.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1; found {world_size}")
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    ctx = _context()
    results = ctx.Queue()
    env = dict(os.environ)
    procs = [
        ctx.Process(
            target=_child, args=(fn, r, world_size, store.port, backend, args, init_kwargs, env, results), daemon=True
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    outcomes: dict[int, _Outcome] = {}
    try:
        while len(outcomes) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                out = pickle.loads(results.get(timeout=min(left, 0.2)))
                outcomes[out.rank] = out
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in outcomes and p.exitcode is not None]
                if dead and all(p.exitcode is not None for p in procs):
                    break  # every process is gone; the missing ones died without reporting
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
        del store
    failed = sorted(r for r, o in outcomes.items() if not o.ok)
    if failed:
        o = outcomes[failed[0]]
        raise RankError(o.rank, pickle.loads(o.exc) if o.exc else None, o.tb)
    missing = [r for r in range(world_size) if r not in outcomes]
    if missing and time.monotonic() < deadline and allow_dead_ranks:
        return [outcomes[r].value if r in outcomes else None for r in range(world_size)]
    if missing:
        codes = {r: procs[r].exitcode for r in missing}
        if time.monotonic() >= deadline:
            raise RankTimeout(missing, timeout)
        raise RankError(missing[0], None, f"rank(s) {missing} exited without a result (exit codes {codes})")
    return [outcomes[r].value for r in range(world_size)]


def run_threads(
    fn: Callable[..., Any],
    world_size: int = 2,
    backend: str | None = "gloo",
    timeout: float = 60.0,
    args: tuple[Any, ...] = (),
    *,
    log_dir: str | os.PathLike[str] | None = None,
    check_consistency: bool | None = None,
    deadline: float = 300.0,
) -> list[Any]:
    """Run `fn` on `world_size` ranks, each a thread of this process; returns each rank's result
    in rank order.

    Each rank gets a store client of its own on a TCPStore this call starts, its own log (to
    `{log_dir}/rank{R}.jsonl`, or stderr; `commlib.record.log.rank_log`), and calls
    `fn(comm, *args)` with the communicator `commlib.init(backend, rank=, world_size=, store=,
    timeout=deadline, log_dir=, check_consistency=)` would make ("world", a commlib process
    group's, `commlib.process_group.group_over_store`), but outside torch's registry and its
    default group, which are one per process. With `backend` None it calls `fn(store, rank,
    world_size, *args)` and the rank builds what it needs. `backend` is an engine whose rank is
    its communicator's: "gloo" (torchcomms takes its rank from the process's environment).

    A rank whose `fn` returns finalizes its communicator, and one whose `fn` raises aborts it,
    as a process's exit would end its connections: its peers are not left waiting. The first
    rank to raise is re-raised as `RankError` with its rank and traceback. Past `timeout`, the
    ranks still running have their communicators aborted and `RankTimeout` names them (a
    thread cannot be killed: one asleep finishes later, on its own).

    One per process, shared by the ranks: hooks registered process-wide (they see every rank's
    calls), `commlib.dist`'s default communicator, the flight recorder's signal handlers (not
    installed here: `run` tests signals), the progress board's publisher thread and the pid
    every board entry carries (a rank is never found gone: `run` tests that), and the attempt.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1; found {world_size}")
    if backend not in ("gloo", None):
        raise ValueError(f"run_threads: expected backend 'gloo' or None; found {backend!r}")
    server = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    ranks = [
        _ThreadRank(r, world_size, server.port, backend, log_dir, check_consistency, deadline)
        for r in range(world_size)
    ]
    threads = [rank.start(fn, args) for rank in ranks]
    until = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(0.0, until - time.monotonic()))
    running = [rank.rank for rank, thread in zip(ranks, threads, strict=True) if thread.is_alive()]
    # Taken before the aborts below, whose errors are their consequence.
    failed = sorted((r for r in ranks if r.error is not None), key=lambda r: r.failed_at)
    for r in running:
        ranks[r].abort(f"commlib.testing.run_threads: rank {r} still running after {timeout} s")
    if failed:
        first = failed[0]
        raise RankError(first.rank, first.error, first.traceback)
    if running:
        raise RankTimeout(running, timeout)
    return [rank.value for rank in ranks]


@dataclass
class _ThreadRank:
    """One rank of `run_threads`: its communicator's making and ending, and what its `fn` gave."""

    rank: int
    world_size: int
    port: int
    backend: str | None
    log_dir: str | os.PathLike[str] | None
    check_consistency: bool | None
    deadline: float
    comm: Any = None
    value: Any = None
    error: BaseException | None = None
    traceback: str = ""
    failed_at: float = 0.0  # monotonic: the first rank to raise is the one reported

    def start(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> threading.Thread:
        """A thread of its own, started, that runs `fn` as this rank."""
        thread = threading.Thread(target=self._run, args=(fn, args), name=f"rank{self.rank}")
        thread.daemon = True  # one still running past the timeout is left behind (`run_threads`)
        thread.start()
        return thread

    def _run(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        from commlib.record import log

        with log.rank_log():
            try:
                store = dist.TCPStore("127.0.0.1", self.port, self.world_size, is_master=False)
                log.configure(self.rank, self.world_size, self.log_dir, store=store)
                if self.backend is None:
                    self.value = fn(store, self.rank, self.world_size, *args)
                else:
                    self.comm = self._communicator(store)
                    self.value = fn(self.comm, *args)
                    self.comm.finalize()
            except BaseException as exc:  # report everything, as `run` does
                self.error, self.traceback = exc, traceback.format_exc()
                self.failed_at = time.monotonic()
                self.abort(f"rank {self.rank}'s function raised {type(exc).__name__}")

    def _communicator(self, store: dist.Store) -> Any:
        from commlib.engines import EngineOptions
        from commlib.process_group import group_over_store

        options = EngineOptions(engine="gloo", check_consistency=self.check_consistency)
        group = group_over_store(store, self.rank, self.world_size, self.deadline, "world", options)
        return group.communicator()

    def abort(self, reason: str) -> None:
        comm = self.comm
        if comm is not None and not comm.broken:
            comm.abort(reason)
