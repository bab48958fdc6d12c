"""A communicator's abort on a CPU engine waits for nothing: not for its peers, not for a thread."""

from __future__ import annotations

import threading
import time

import pytest

import commlib
from commlib import testing


def _aborted_twice(comm: commlib.Communicator) -> float:
    aborted, release = threading.Event(), threading.Event()

    def quorum_thread() -> None:  # torchft aborts its process group from its own thread, which lives on
        comm.abort("from another thread")
        aborted.set()
        release.wait(30)

    threading.Thread(target=quorum_thread, daemon=True).start()
    aborted.wait(10)
    start = time.monotonic()
    comm.abort("again, from the trainer")
    took = time.monotonic() - start
    release.set()
    return took


@pytest.mark.contract
def test_an_abort_after_another_threads_abort_returns_at_once() -> None:
    """The second abort of a CPU engine's communicator never waits for the thread of the first."""
    [took] = testing.run_threads(_aborted_twice, 1, timeout=30)
    assert took < 1.0, took
