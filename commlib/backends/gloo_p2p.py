"""gloo's send and recv, each waited for in one piece on a thread of its peer's: what lets
commlib wait for them in slices, as for any other op.

A gloo send/recv cannot be waited for in slices as gloo's collectives can: a `wait(timeout)`
that times out closes every connection of the engine's context ("Application timeout caused
pair closure"), which breaks the communicator for a peer that was merely a little late; and
its `is_completed()` turns True only inside `wait()` (torch 2.13: a recv whose data had
arrived still said False 10 s later), so it cannot be polled either. So each one is waited
for here in one piece, bounded by the op's own deadline, on a thread of its lane (one per
peer and tag, in issue order: a late peer must not hold up the end of a prompt peer's op, nor
a message of one tag the end of another's, which gloo matches apart), and the
caller waits on its end (`OnePieceWait.done`) in slices like any op's, reading its peers'
abort announcements between them; a caller's shorter wait leaves the op running. A peer
that dies still ends the wait within a fraction of a second (gloo: "Connection closed by
peer").

A lane's thread starts with its first op and ends after `LINGER_S` without one.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

LINGER_S = 1.0  # how long a lane's thread waits for its next op before it ends


@dataclass(slots=True)
class OnePieceWait:
    """One send/recv's wait on its lane's thread: set `done` once the engine's wait returned."""

    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None  # what the engine's wait raised


class _Lane:
    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: queue.SimpleQueue[tuple[Any, timedelta, OnePieceWait]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def add(self, work: Any, timeout: timedelta) -> OnePieceWait:
        waited = OnePieceWait()
        self._queue.put((work, timeout, waited))
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
        return waited

    def _run(self) -> None:
        while True:
            try:
                work, timeout, waited = self._queue.get(timeout=LINGER_S)
            except queue.Empty:
                with self._lock:  # an op added meanwhile found the thread still set: it is served
                    if self._queue.empty():
                        self._thread = None
                        return
                continue
            try:
                work.wait(timeout)
            except BaseException as exc:  # the caller's thread raises it, as the engine's own wait would
                waited.error = exc
            waited.done.set()
            del work, waited  # not held while the thread waits for the next op


class PeerLanes:
    """One engine's send/recv lanes, one per peer and tag (module docstring)."""

    def __init__(self, engine_name: str) -> None:
        self._engine_name = engine_name
        self._lanes: dict[tuple[int, int], _Lane] = {}

    def wait_for(self, peer_and_tag: tuple[int, int], work: Any, timeout: timedelta) -> OnePieceWait:
        """Wait for `work` (a send/recv with a peer, under a tag) in one piece, at most `timeout`, on their lane."""
        lane = self._lanes.get(peer_and_tag)
        if lane is None:
            peer, tag = peer_and_tag
            lane = self._lanes[peer_and_tag] = _Lane(f"commlib-{self._engine_name}-p2p-{peer}-{tag}")
        return lane.add(work, timeout)
