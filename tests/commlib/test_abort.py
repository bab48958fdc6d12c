"""A communicator's abort on a CPU engine waits for nothing: not for its peers, not for a thread."""

from __future__ import annotations

import threading
import time

import pytest
import torch

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


def _blocked_then_aborted(comm: commlib.Communicator, release: threading.Event) -> tuple[str, float] | None:
    if comm.rank == 1:  # never comes to the all_reduce
        release.wait(30)
        return None
    timer = threading.Timer(0.5, comm.abort, args=("from the quorum thread",))
    timer.start()
    start = time.monotonic()
    try:
        comm.all_reduce(torch.ones(1))
    except commlib.CommError as exc:
        return type(exc).__name__, time.monotonic() - start
    finally:
        release.set()
        timer.join()
    return "completed", time.monotonic() - start


@pytest.mark.contract
def test_a_collective_blocked_when_another_thread_aborts_raises_comm_aborted_within_a_slice() -> None:
    """gloo's abort does not wake a wait already in it: the wait ends at its next slice, with
    CommAborted, not at its deadline (torchft aborts a blocked process group from its own thread)."""
    release = threading.Event()
    outcome, _ = testing.run_threads(_blocked_then_aborted, 2, timeout=30, args=(release,))
    name, took = outcome
    assert name == "CommAborted" and took < 0.5 + 3.0, outcome  # a slice of 1 s at most, and a stall's slack
