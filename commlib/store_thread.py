"""The store calls of a communicator's failure path, each waited for at most a bound.

A collective's deadline, and the error that says who did not arrive, must not wait on the
store. The job's store is one server (on rank 0's host, or torchrun's agent) that can stop
answering: frozen, cut off by a partition, or gone without a reset. A TCPStore client then
blocks for the store's own timeout (the job's init timeout: minutes), so a 2 s deadline whose
wait read the peers' abort announcements through it would hang for minutes and say nothing.

So the failure path (a wait's reads of the announcements, the board read that names the missing
ranks, the announcement of this rank's own abort, the board's "broken" mark) calls the store
on a thread of its own, through a client other than the waiting thread's (the progress board's,
made with the communicator: a new connection to a busy store server has taken seconds, too long
to make on a failure's path), and waits for each answer at most a bound
(`STORE_ANSWER_S`) before it goes on without it; the error then says the store did not answer.
c10d does the same with the side work of a timeout: ProcessGroupNCCL runs its debug dump
asynchronously and waits for it at most a bound (`waitForFutureOrTimeout`), and reads peers'
signals from the store on its monitor thread, never on the thread that waits for an op.

A call left behind finishes on the thread whenever the store answers; the calls after it wait
their turn. A caller gives up (`StoreSilent`) once the call under way, its own or one before
it, has waited the bound: so a store that stopped answering costs the failure path one bound in
all, however many calls it makes.

The thread ends when it has had no call for `IDLE_S` (the next call starts another), so a job
that rebuilds its communicators keeps no thread or connection per old one. At interpreter exit
the calls under way get at most `STORE_ANSWER_S` to finish: a daemon thread that comes back from
a store call into a finalizing interpreter aborts the process (`commlib.record.board`).
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

import torch.distributed as dist

# The longest the failure path waits for one answer of the store: a store slower than this is
# not answering. Its answers take well under a millisecond, a read of a 1,000-rank board by 32
# ranks at once 90 ms (`commlib.store_reads`); but under the full test suite's load a call
# (on a connection then opened for it) has taken about 2 s, this 2-core machine stalls every
# process for up to 5 s at times (docs/testing.md), and an error that waits a little longer
# still names the ranks that never came.
STORE_ANSWER_S = 5.0
IDLE_S = 10.0  # a thread with no call for this long ends

_T = TypeVar("_T")


class StoreSilent(TimeoutError):
    """The store did not answer a call within its bound."""


class StoreThread:
    """One communicator's failure-path store calls, on a daemon thread started at the first."""

    def __init__(self, client: dist.Store, name: str) -> None:
        self._client = client  # not the waiting thread's: see the module docstring
        self._name = name
        self._calls: queue.SimpleQueue[tuple[Callable[[dist.Store], Any], Future[Any]]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._busy_since: float | None = None  # monotonic: when the call under way began

    def submit(self, fn: Callable[[dist.Store], _T]) -> Future[_T]:
        """`fn(client)` on the thread, after the calls before it; its future."""
        future: Future[_T] = Future()
        self._calls.put((fn, future))
        with self._lock:
            if self._thread is None:
                _LIVE.add(self)
                # A daemon thread, not an executor's: one blocked on a silent store must not
                # hold the interpreter's exit (concurrent.futures joins its workers at exit).
                self._thread = threading.Thread(target=self._run, name=f"commlib-store-{self._name}", daemon=True)
                self._thread.start()
        return future

    def call(self, fn: Callable[[dist.Store], _T], bound_s: float | None = None) -> _T:
        """`fn(client)`'s result, or `StoreSilent` once the thread's call under way (this one,
        or one before it) has waited `bound_s` (`STORE_ANSWER_S`) for the store's answer."""
        bound_s = STORE_ANSWER_S if bound_s is None else bound_s
        future = self.submit(fn)
        while True:
            busy = self._busy_since
            left = bound_s if busy is None else busy + bound_s - time.monotonic()
            try:
                return future.result(timeout=max(left, 0.0))
            except FutureTimeout:
                if self._busy_since in (busy, None):  # no call answered meanwhile
                    waited = bound_s if busy is None else time.monotonic() - busy
                    raise StoreSilent(f"the store has not answered a call for {waited:.1f} s") from None

    def idle(self) -> bool:
        """Whether no call is under way or waiting."""
        return self._busy_since is None and self._calls.empty()

    def _run(self) -> None:
        while True:
            try:
                fn, future = self._calls.get(timeout=IDLE_S)
            except queue.Empty:
                with self._lock:  # `submit` starts a thread under the lock once this one is gone
                    if self._calls.empty():
                        self._thread = None
                        return
                continue
            self._busy_since = time.monotonic()
            try:
                future.set_result(fn(self._client))
            except BaseException as exc:
                future.set_exception(exc)
            finally:
                self._busy_since = None


_LIVE: weakref.WeakSet[StoreThread] = weakref.WeakSet()


def _let_calls_finish_at_exit() -> None:
    until = time.monotonic() + STORE_ANSWER_S
    while any(not t.idle() for t in list(_LIVE)) and time.monotonic() < until:
        time.sleep(0.01)


atexit.register(_let_calls_finish_at_exit)
