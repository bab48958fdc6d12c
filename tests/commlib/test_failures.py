"""Deadlines, dead peers and mismatched collectives become typed errors, never silent hangs.

Ranks are threads (`ranks`, and `testing.run_threads`: the fast lane, marked `contract`), but
where a test kills a process.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable

import pytest
import torch

import commlib
from commlib import store_thread, testing
from commlib.engines import EngineOptions
from commlib.process_group import group_over_store
from store_relay import StoreRelay


def _rank1_never_joins(comm: commlib.Communicator) -> dict[str, object]:
    t = torch.ones(2)
    with commlib.context(step=7, phase="backward"):
        comm.all_reduce(t)
        if comm.rank == 1:
            time.sleep(4)  # skips the next collective and outlives the peer's deadline
            return {}
        start = time.monotonic()
        try:
            comm.all_reduce(t, timeout=1.5)
        except commlib.CollectiveTimeout as exc:
            elapsed = time.monotonic() - start
            error = exc
        start = time.monotonic()
        try:
            comm.all_reduce(t)
        except commlib.CommAborted as exc:
            after = (str(exc), time.monotonic() - start)
    return {"elapsed": elapsed, "message": str(error), "missing": error.missing_ranks, "op": error.op,
            "seq": error.seq, "rank": error.rank, "deadline": error.deadline, "after": after}


def test_rank_that_never_joins_gives_timeout_naming_it(ranks: Callable[..., list]) -> None:
    """A rank that skips a collective is named by its peer's timeout; later calls fail at once."""
    r0 = ranks(_rank1_never_joins, 2)[0]
    assert r0["elapsed"] < 1.5 + 1.0, r0
    assert r0["missing"] == [1]
    assert (r0["op"], r0["seq"], r0["rank"], r0["deadline"]) == ("all_reduce", 2, 0, 1.5)
    assert "all_reduce #2 on 'world' timed out after 1.5 s on rank 0: rank 1 never started it" in r0["message"]
    assert "rank 1 never started it (last reported finishing all_reduce #1, at step 7, phase backward)" in r0["message"]
    message, blocked_for = r0["after"]
    assert "CollectiveTimeout in all_reduce #2" in message and blocked_for < 0.1


def _rank1_killed(comm: commlib.Communicator) -> dict[str, object]:
    t = torch.ones(2)
    comm.all_reduce(t)
    if comm.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        comm.all_reduce(t, timeout=30)
    except commlib.PeerFailure as exc:
        return {"elapsed": time.monotonic() - start, "message": str(exc), "cause": repr(exc.__cause__)}
    return {"elapsed": time.monotonic() - start, "message": "no error"}


def test_killed_peer_gives_peer_failure_within_a_second(backend: str) -> None:
    """A SIGKILLed peer ends the wait with a PeerFailure within a second."""
    r0, r1 = testing.run(_rank1_killed, 2, backend=backend, allow_dead_ranks=True)
    assert r1 is None
    assert r0["elapsed"] < 1.0, r0
    assert "all_reduce #2 on 'world' failed on rank 0" in r0["message"]
    assert "closed by peer" in r0["cause"] or "reset by peer" in r0["cause"]


def _check_through(comm: commlib.Communicator, transport: str) -> None:
    """"store": compare fingerprints through the store alone, as a communicator on a GPU
    does; "engine": first as digests on the engine, as a CPU one does (`commlib.consistency`)."""
    comm._consistency.via_engine = transport == "engine"


def _rank1_leaves(
    comm: commlib.Communicator, how: str, check: str | None, rank0_done: threading.Event
) -> dict[str, object]:
    if check is not None:
        _check_through(comm, check)
    t = torch.ones(2)
    comm.all_reduce(t)
    if comm.rank == 1:
        time.sleep(0.5)  # rank 0 is blocked in all_reduce #2 by now
        if how == "abort":
            comm.abort("in-job recovery after ValueError: bad batch")
        else:  # a failure inside this rank's collective (here: its pre-hook raises)
            def refuse(call: object) -> None:
                raise ValueError("injected in the pre-hook")
            comm.register_pre_hook(refuse)
            try:
                comm.all_reduce(t)
            except ValueError:
                pass
        # Alive, keeping its engine open: only the announcement can end rank 0's wait.
        rank0_done.wait(30)
        return {}
    start = time.monotonic()
    try:
        comm.all_reduce(t, timeout=30)
    except commlib.PeerFailure as exc:
        return {"elapsed": time.monotonic() - start, "message": str(exc), "failed": exc.failed_ranks}
    finally:
        rank0_done.set()
    return {"elapsed": time.monotonic() - start, "message": "no error"}


@pytest.mark.contract
@pytest.mark.parametrize(("how", "check"), [("abort", None), ("broken", None), ("abort", "engine"),
                                           ("abort", "store")])
def test_a_peer_that_leaves_the_communicator_ends_the_wait_at_once(how: str, check: str | None) -> None:
    """A live peer that aborts or breaks the communicator ends the others' waits, named."""
    # gloo only: the torchcomms engine waits in one piece (TorchcommsBackend.resumable_wait).
    # `check`: rank 0 waits in the consistency check for rank 1's part of #2, which never
    # comes (the digest exchange on the engine, or the store wait for its fingerprint),
    # instead of in the op.
    r0, _ = testing.run_threads(
        _rank1_leaves, 2, args=(how, check, threading.Event()), check_consistency=check is not None
    )
    # Its deadline is 30 s; the announcement is read between slices of the wait.
    assert r0["elapsed"] < 0.5 + 1.5, r0
    assert r0["failed"] == [1], r0
    reason = ("in-job recovery after ValueError: bad batch" if how == "abort"
              else "broken by ValueError in all_reduce #2")
    assert ("all_reduce #2 on 'world' failed on rank 0" in r0["message"]
            and f"found rank 1 had aborted the communicator ({reason})" in r0["message"]), r0


def _rank2_skips_and_rank0_expires_first(
    comm: commlib.Communicator, done: threading.Barrier
) -> dict[str, object]:
    t = torch.ones(2)
    comm.all_reduce(t)
    if comm.rank == 2:
        done.wait(30)  # never joins #2, and outlives both peers' waits
        return {}
    start = time.monotonic()
    try:  # rank 0's deadline expires long before rank 1's
        comm.all_reduce(t, timeout=1.0 if comm.rank == 0 else 30.0)
    except commlib.CommError as exc:
        return {"elapsed": time.monotonic() - start, "error": type(exc).__name__, "message": str(exc),
                "missing": getattr(exc, "missing_ranks", None)}
    finally:
        done.wait(30)
    return {"error": None}


@pytest.mark.contract
def test_a_peer_timing_out_first_in_the_same_collective_is_no_culprit() -> None:
    """A peer whose deadline expired first is no culprit: the rank that never came is named."""
    # Rank 0 arrived like rank 1 did: its announcement ends rank 1's wait, and rank 1 reports
    # the same timeout naming rank 2 (a PeerFailure naming rank 0 before, when the two
    # deadlines expired a moment apart; seen in CI on test_doctor_p2p).
    done = threading.Barrier(3)
    r0, r1, _ = testing.run_threads(_rank2_skips_and_rank0_expires_first, 3, args=(done,))
    assert (r0["error"], r0["missing"]) == ("CollectiveTimeout", [2]), r0
    assert (r1["error"], r1["missing"]) == ("CollectiveTimeout", [2]), r1
    assert r1["elapsed"] < 1.0 + 1.5, r1
    assert "all_reduce #2 on 'world' timed out after 1." in r1["message"] and "rank 2 never started it" in r1["message"]
    assert "rank 0's deadline for it expired first: this rank stopped waiting before its own 30 s" in r1["message"]


def _store_stops_answering(store: object, rank: int, size: int, relay: StoreRelay,
                           rank0_done: threading.Event) -> dict[str, object]:
    relayed = torch.distributed.TCPStore("127.0.0.1", relay.port, size, is_master=False)
    comm = group_over_store(relayed, rank, size, 1.0, "world", EngineOptions(engine="gloo")).communicator()
    t = torch.ones(2)
    comm.all_reduce(t)
    if rank == 1:  # never joins #2; ends once the store answers again
        rank0_done.wait(30)
        comm.finalize()
        return {}
    relay.stop()
    start = time.monotonic()
    try:
        comm.all_reduce(t)
    except commlib.CollectiveTimeout as exc:
        return {"elapsed": time.monotonic() - start, "message": str(exc)}
    finally:
        relay.resume()
        rank0_done.set()
    return {"elapsed": time.monotonic() - start, "message": "no error"}


@pytest.mark.contract
def test_a_deadline_holds_while_the_store_does_not_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    """A store that stops answering neither holds a wait past its deadline nor its error."""
    # The wait reads the peers' abort announcements from the store, and the timeout reads the
    # board and announces the abort there: each call is waited for a bounded time
    # (commlib.store_thread). Without that the wait blocked in the store's client for its
    # timeout (5 minutes), once per slice.
    monkeypatch.setattr(store_thread, "STORE_ANSWER_S", 1.0)  # 5 s in a job; the ranks are threads of this process
    server = torch.distributed.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    relay = StoreRelay(server.port)
    try:
        r0, _ = testing.run_threads(_store_stops_answering, 2, backend=None, timeout=30,
                                    args=(relay, threading.Event()))
    finally:
        relay.close()
    # 1 s deadline; the board's read given up on once the store's oldest unanswered call (the
    # announcement read between the wait's slices) waited STORE_ANSWER_S.
    assert 1.0 <= r0["elapsed"] < 1.0 + 1.0 + 1.0, r0
    assert ("all_reduce #2 on 'world' timed out after 1.0 s on rank 0; the progress board could not be read "
            "(the store has not answered a call for 1.") in r0["message"], r0


def _mismatch(comm: commlib.Communicator, transport: str) -> str:
    _check_through(comm, transport)
    try:
        if comm.rank == 0:
            comm.all_reduce(torch.ones(4))
        else:
            comm.broadcast(torch.ones(4), 0)
    except commlib.CollectiveMismatch as exc:
        assert exc.seq == 1 and exc.op in ("all_reduce", "broadcast")
        return f"{exc.differing_ranks}|{exc}"
    return "no error"


@pytest.mark.parametrize("transport", ["engine", "store"])
def test_consistency_check_names_mismatch_on_every_rank(
    ranks: Callable[..., list], transport: str
) -> None:
    """Different collectives at one sequence number raise CollectiveMismatch on every rank."""
    r0, r1 = ranks(_mismatch, 2, args=(transport,), check_consistency=True)
    assert r0.startswith("[1]|") and r1.startswith("[0]|")
    for message in (r0, r1):
        assert "expected every rank to issue the same collective" in message
        assert '"op": "all_reduce"' in message and '"op": "broadcast"' in message


def _shape_mismatch_then_recover(comm: commlib.Communicator) -> list[float]:
    try:
        comm.all_reduce(torch.ones(4 + comm.rank))
    except commlib.CollectiveMismatch as exc:
        assert "[4]" in str(exc) and "[5]" in str(exc)
    t = torch.ones(3)
    comm.all_reduce(t)  # a mismatch caught before launch leaves the communicator usable
    return t.tolist()


def test_shape_mismatch_caught_before_launch(
    ranks: Callable[..., list], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shape mismatch is caught before launch (the environment's switch); the comm lives on."""
    monkeypatch.setenv("COMMLIB_CHECK_CONSISTENCY", "1")  # the environment switch, inherited by the ranks
    assert ranks(_shape_mismatch_then_recover, 2) == [[2.0] * 3] * 2


def _rank1_late_for_a_reused_slot(comm: commlib.Communicator) -> dict[str, object]:
    _check_through(comm, "store")  # the slots are the store exchange's, which GPU communicators use for every call
    for _ in range(3):  # both fingerprint slots now hold values of earlier calls, of 3 elements
        comm.all_reduce(torch.ones(3))
    if comm.rank == 1:
        # Rank 0 meets rank 1's value of #2 in the slot of #4: it must wait for #4's, not
        # compare the two and report a mismatch that is not there.
        time.sleep(0.5)
    t = torch.ones(2)
    comm.all_reduce(t)
    try:  # and a mismatch in a reused slot is still one, on both ranks
        comm.all_reduce(torch.ones(2 + comm.rank))
    except commlib.CollectiveMismatch as exc:
        return {"sum": t.tolist(), "differing": exc.differing_ranks, "seq": exc.seq}
    return {"sum": t.tolist(), "differing": None}


def test_a_late_rank_is_waited_for_when_the_check_reuses_its_slot(
    ranks: Callable[..., list],
) -> None:
    """A late rank's old value in a reused fingerprint slot is waited past, not a mismatch."""
    r0, r1 = ranks(_rank1_late_for_a_reused_slot, 2, check_consistency=True)
    assert r0 == {"sum": [2.0, 2.0], "differing": [1], "seq": 5}, r0
    assert r1 == {"sum": [2.0, 2.0], "differing": [0], "seq": 5}, r1


def _rank1_skips_a_checked_collective(comm: commlib.Communicator, transport: str) -> dict[str, object]:
    _check_through(comm, transport)
    comm.all_reduce(torch.ones(2))
    if comm.rank == 1:
        time.sleep(3)  # never posts its part of #2's check
        return {}
    start = time.monotonic()
    with pytest.raises(commlib.CollectiveTimeout) as info:
        comm.all_reduce(torch.ones(2), timeout=1.0)
    return {"elapsed": time.monotonic() - start, "message": str(info.value), "missing": info.value.missing_ranks,
            "reported": info.value.elapsed}


@pytest.mark.parametrize("transport", ["engine", "store"])
def test_a_timeout_inside_the_consistency_check_reports_the_time_waited(
    ranks: Callable[..., list], transport: str
) -> None:
    """A deadline that expires inside the consistency check reports the time really waited."""
    r0 = ranks(_rank1_skips_a_checked_collective, 2, args=(transport,), check_consistency=True)[0]
    # The upper bound keeps slack for the machine's ~5 s stalls under the full suite
    # (docs/testing.md), far below what it must catch: the wait held to a longer deadline.
    assert 1.0 <= r0["elapsed"] < 10.0 and 0.9 <= r0["reported"] <= r0["elapsed"], r0
    # The message states the time it reports (1.0 s, or 1.1 s when the timer's tick runs late).
    assert f"all_reduce #2 on 'world' timed out after {r0['reported']:.1f} s on rank 0" in r0["message"], r0
    assert r0["missing"] == [1]


def _fingerprints_written(comm: commlib.Communicator) -> list[bool]:
    return [comm._store.check([f"fp/{slot}/{r}"]) for slot in range(2) for r in range(comm.size)]


def _agree_then_differ(comm: commlib.Communicator) -> dict[str, object]:
    t = torch.ones(3)
    for _ in range(4):
        comm.all_reduce(t)
    agreed = _fingerprints_written(comm)
    try:
        comm.all_reduce(torch.ones(2 + comm.rank))
    except commlib.CollectiveMismatch as exc:
        return {"sum": t.tolist(), "agreed": agreed, "differing": exc.differing_ranks, "message": str(exc),
                "after": _fingerprints_written(comm)}
    return {"sum": t.tolist(), "agreed": agreed, "differing": None}


def test_a_cpu_engine_compares_digests_and_swaps_fingerprints_only_on_a_mismatch(
    ranks: Callable[..., list],
) -> None:
    """Agreeing calls write no fingerprint; a digest mismatch makes every rank write its own."""
    # Agreeing calls cost one small all_reduce on the engine and no store round trip; a
    # mismatch of digests sends every rank to the store, for the fingerprints that say who differs.
    r0, r1 = ranks(_agree_then_differ, 2, check_consistency=True)
    for r, other in ((r0, 1), (r1, 0)):
        assert r["sum"] == [16.0] * 3 and r["agreed"] == [False] * 4, r
        assert r["differing"] == [other] and r["after"] == [False, False, True, True], r  # #5: slot 1, both ranks
        assert "all_reduce #5 on 'world'" in r["message"] and '"shapes": [[2]]' in r["message"], r
        assert '"shapes": [[3]]' in r["message"], r


def _half_checked_group(store: object, rank: int, size: int) -> str:
    try:  # COMMLIB_CHECK_CONSISTENCY set on one rank only, say
        options = EngineOptions(engine="gloo", check_consistency=rank == 0)
        group_over_store(store, rank, size, 30.0, "group1", options)
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.contract
def test_ranks_that_disagree_on_the_check_fail_at_creation() -> None:
    """Ranks that create a group with and without the check fail at creation, saying who differs."""
    # A checked rank's digest exchange would otherwise pair with an unchecked peer's real
    # collective on the engine, and mix their data.
    for rank, message in enumerate(testing.run_threads(_half_checked_group, 2, backend=None)):
        assert f"on rank {rank}: expected every rank to create it with the same check_consistency" in message, message
        assert "found it on for ranks [0] and off for ranks [1]" in message, message
