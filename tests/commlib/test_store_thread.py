"""The failure path's store calls: answered, or given up on at their bound, never waited on longer."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from commlib import store_thread
from commlib.store_thread import StoreSilent, StoreThread

pytestmark = pytest.mark.contract


class _Store:
    """Stands in for a store client: the calls under test never touch it."""


def test_a_call_returns_its_answer_or_raises_its_error() -> None:
    """The result of `fn(client)` comes back; its exception is raised to the caller."""
    calls = StoreThread(_Store(), "world")
    assert calls.call(lambda store: type(store).__name__) == "_Store"

    def fail(store: Any) -> None:
        raise ValueError("no such key")

    with pytest.raises(ValueError, match="no such key"):
        calls.call(fail)


def test_a_silent_store_is_given_up_on_at_the_bound_then_at_once() -> None:
    """A call unanswered past its bound raises StoreSilent; the next does not wait its own bound."""
    calls, answered = StoreThread(_Store(), "world"), threading.Event()
    start = time.monotonic()
    with pytest.raises(StoreSilent, match="has not answered a call for 0.2 s"):
        calls.call(lambda store: answered.wait(30), bound_s=0.2)
    assert 0.2 <= time.monotonic() - start < 1.0
    start = time.monotonic()
    with pytest.raises(StoreSilent, match="has not answered a call for"):
        calls.call(lambda store: "queued behind it", bound_s=0.2)
    assert time.monotonic() - start < 0.1
    answered.set()  # the store answers again: so do the calls
    assert calls.call(lambda store: "answered", bound_s=5.0) == "answered"


def test_the_thread_ends_when_idle_and_the_next_call_starts_another(monkeypatch: pytest.MonkeyPatch) -> None:
    """No thread is kept for a communicator that makes no store call."""
    monkeypatch.setattr(store_thread, "IDLE_S", 0.05)
    calls = StoreThread(_Store(), "idle-test")
    threads = []
    for _ in range(2):
        calls.call(lambda store: threads.append(threading.current_thread()))
        deadline = time.monotonic() + 5
        while threads[-1].is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not threads[-1].is_alive()
    assert threads[0] is not threads[1]
