"""commlib on a stream-ordered engine (what a GPU's is), on CPU: the emulated device of
emulated_device.py under real processes over gloo.

What these pin: the CPU never waits for an op (every entry point: the Communicator, the
process group, commlib.dist, fsdp_overlap's comms); the deadline counts from the op's start
on the device, so a deep queue of earlier work is no timeout; an op that starts and does not
end is failed by the watchdog within its deadline + 0.5 s, naming the rank that never issued
it, raised at the caller's next call, `Work.wait()` or `commlib.check()`; the process lives
on, and in-job recovery rebuilds the engines and the job goes on.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

import commlib
import commlib.dist as cdist
from commlib import testing

from emulated_device import device, init as _init, raised as _raised

DEADLINE_S = 1.0
DETECTION_S = 0.5  # the issue's bound on seeing an expired deadline


def _never_blocks() -> dict[str, object]:
    """Every entry point issues behind 2 s of device work: the CPU returns at once, and the
    values are right once the device is done; and the deadline (1 s) counts from the start on
    the device, not from the issue, so that queue raises nothing."""
    from fsdp_overlap.comms import CommlibAllGather

    comm = _init()
    rank, rt = comm.rank, device()
    assert comm.stream_ordered
    ones = [torch.full((4,), float(rank + 1)) for _ in range(6)]
    gathered = torch.empty(8)
    rt.busy(2.0)
    issue_from = time.monotonic()
    comm.all_reduce(ones[0], timeout=DEADLINE_S)
    work = comm.all_reduce(ones[1], async_op=True, timeout=DEADLINE_S)
    completed_at_issue = work.is_completed()
    work.wait()
    dist.all_reduce(ones[2])  # the process group, sync
    dist.all_reduce(ones[3], async_op=True).wait()  # the process group, async
    cdist.all_reduce(ones[4], group=comm)  # commlib.dist
    CommlibAllGather(comm)(gathered, ones[5], dist.group.WORLD, async_op=True).wait()  # fsdp_overlap
    issue_s = time.monotonic() - issue_from
    before_sync = [t.tolist() for t in ones[:2]]
    rt.synchronize()
    waited_s = time.monotonic() - issue_from
    commlib.check(wait=True)
    return {"issue_s": issue_s, "waited_s": waited_s, "completed_at_issue": completed_at_issue,
            "completed_after": work.is_completed(), "before_sync": before_sync,
            "values": [t.tolist() for t in ones[:5]], "gathered": gathered.tolist(), "seq": comm.seq,
            "flight": [e.state for e in comm.recorder.entries()]}


def test_no_entry_point_blocks_the_cpu_and_a_queue_is_no_timeout() -> None:
    for r in testing.run(_never_blocks, 2, backend=None, timeout=90):
        assert r["issue_s"] < 0.5, r  # blocking on any op would take the device's 2 s
        assert r["waited_s"] >= 2.0, r  # the device really was busy: the ops ran behind it
        assert not r["completed_at_issue"] and r["completed_after"]
        assert r["before_sync"] != [[3.0] * 4] * 2  # not yet reduced when the calls returned
        assert r["values"] == [[3.0] * 4] * 5
        assert r["gathered"] == [1.0] * 4 + [2.0] * 4
        assert r["seq"] == 6 and r["flight"] == ["completed"] * 6  # no false timeout from the queue


def _rank1_never_issues(deliver_at: str) -> dict[str, object]:
    comm = _init()
    rank, rt = comm.rank, device()
    t = torch.ones(4)
    comm.all_reduce(t, timeout=DEADLINE_S)
    rt.synchronize()
    if rank == 1:
        time.sleep(DEADLINE_S + 2.0)  # never issues #2 in time; then finds rank 0's abort announced
        comm.all_reduce(t, timeout=30.0)
        outcome = _raised(lambda: (time.sleep(1.0), commlib.check()))
        return {"rank1": outcome}
    issued = time.monotonic()
    comm.all_reduce(t, timeout=DEADLINE_S)
    returned_s = time.monotonic() - issued
    if deliver_at == "check":
        error = None
        while error is None and time.monotonic() - issued < 10:
            error = _raised(commlib.check)
            time.sleep(0.01)
        detected_s = time.monotonic() - issued
    else:  # the next call on the communicator
        time.sleep(DEADLINE_S + DETECTION_S + 0.2)
        error = _raised(lambda: comm.all_reduce(t))
        detected_s = None
    after = _raised(lambda: comm.all_reduce(t))
    return {"returned_s": returned_s, "detected_s": detected_s, "error": error, "after": after,
            "watched": commlib.watchdog.watched_count()}


def test_a_collective_that_never_completes_is_failed_by_the_watchdog_and_raised_at_check() -> None:
    r0, r1 = testing.run(_rank1_never_issues, 2, backend=None, timeout=90, args=("check",))
    assert r0["returned_s"] < 0.2  # the CPU did not wait for the op
    error = r0["error"]
    assert error["type"] == "CollectiveTimeout", r0
    assert r0["detected_s"] < DEADLINE_S + DETECTION_S, r0
    assert error["missing_ranks"] == [1] and (error["op"], error["seq"]) == ("all_reduce", 2)
    assert "rank 1 never started it" in error["message"]
    assert "counts from its start on the device" in error["message"]
    assert r0["after"]["type"] == "CommAborted"  # raised once; later calls find the communicator broken
    # The late rank hears of rank 0's abort from its own watchdog: rank 0 is named.
    assert r1["rank1"]["type"] == "PeerFailure" and r1["rank1"]["failed_ranks"] == [0], r1


def test_the_watchdogs_error_is_raised_at_the_next_call() -> None:
    r0, _ = testing.run(_rank1_never_issues, 2, backend=None, timeout=90, args=("next call",))
    assert r0["error"]["type"] == "CollectiveTimeout" and r0["error"]["missing_ranks"] == [1], r0
    assert r0["after"]["type"] == "CommAborted"


def _rank0s_log_stalls_as_it_fails() -> dict[str, object]:
    """Rank 0's #2 times out (rank 1 never issues it in time) while rank 0's log is on a
    filesystem that has stopped answering: the line of its failure never comes."""
    from commlib import lifecycle

    comm = _init()
    rank, rt = comm.rank, device()
    if rank == 0:
        fields = lifecycle._error_fields

        def stalled(error: commlib.CommError) -> dict[str, object]:
            time.sleep(60.0)
            return fields(error)

        lifecycle._error_fields = stalled  # this rank's process only
    t = torch.ones(4)
    comm.all_reduce(t, timeout=DEADLINE_S)
    rt.synchronize()
    if rank == 0:
        issued = time.monotonic()
        comm.all_reduce(t, timeout=DEADLINE_S)
        error = None
        while error is None and time.monotonic() - issued < 10:
            error = _raised(commlib.check)
            time.sleep(0.01)
        return {"error": error, "detected_s": time.monotonic() - issued}
    # Rank 1 issues #2 once rank 0's watchdog has given up on it, and past the longest the
    # failure's line may hold back the news (LINE_BEFORE_NEWS_S).
    time.sleep(DEADLINE_S + lifecycle.LINE_BEFORE_NEWS_S + 2.0)
    comm.all_reduce(t, timeout=30.0)
    return {"error": _raised(lambda: (time.sleep(1.0), commlib.check()))}


def test_a_failure_whose_log_line_stalls_is_still_announced_and_aborted_in_seconds() -> None:
    """The failure's line goes before the announcement (commlib/lifecycle.py), but a line that
    never comes must not hold back the news, nor the engine's abort, nor the caller: otherwise
    rank 1's late #2 would complete against rank 0's half of an op rank 0 had already declared
    failed, and rank 0's `commlib.check()` would wait on the watchdog's thread, itself stuck
    in the write, for as long as the filesystem does."""
    from commlib.lifecycle import LINE_BEFORE_NEWS_S

    r0, r1 = testing.run(_rank0s_log_stalls_as_it_fails, 2, backend=None, timeout=90)
    assert r0["error"]["type"] == "CollectiveTimeout", r0
    assert r0["detected_s"] < DEADLINE_S + LINE_BEFORE_NEWS_S + 1.5, r0
    assert r1["error"] is not None and r1["error"]["type"] == "PeerFailure", r1
    assert r1["error"]["failed_ranks"] == [0], r1


def _hang_then_recover() -> dict[str, object]:
    """Rank 1's device hangs in op #2 after its start (a long kernel behind the start event, as
    chaos's device hang does): rank 0's #2 times out; both recover in-job and go on."""
    comm = _init()
    rank, rt = comm.rank, device()
    hang = commlib.register_pre_hook(lambda call: rt.busy(4.0) if rank == 1 and call.seq == 2 else None)
    t = torch.ones(4)
    comm.all_reduce(t, timeout=DEADLINE_S)
    comm.all_reduce(t, timeout=DEADLINE_S)
    error = None
    give_up = time.monotonic() + 15
    while error is None and time.monotonic() < give_up:
        try:
            commlib.check()
        except commlib.CommError as exc:
            error = exc
        time.sleep(0.02)
    hang.remove()
    done = commlib.Recovery(commlib.RecoveryPolicy(join_timeout_s=20)).recover(error)
    new = commlib.current()
    x = torch.full((4,), float(rank + 1))
    new.all_reduce(x)
    dist.all_reduce(x)  # the same group object, its engine rebuilt
    commlib.check(wait=True)
    return {"error": type(error).__name__, "message": str(error), "missing": getattr(error, "missing_ranks", None),
            "epoch": done.epoch, "value": x.tolist(), "new": new is not comm}


def test_recovery_rebuilds_a_stream_ordered_engine_and_the_job_goes_on() -> None:
    r0, r1 = testing.run(_hang_then_recover, 2, backend=None, timeout=120)
    assert r0["error"] == "CollectiveTimeout", r0
    # Rank 1 issued #2 and its device started it, but its kernel never got to the collective.
    assert "rank 1" not in r0["message"] or "never started it" not in r0["message"], r0
    assert r1["error"] in ("CollectiveTimeout", "PeerFailure"), r1
    for r in (r0, r1):
        assert r["epoch"] == 1 and r["new"]
        assert r["value"] == [6.0] * 4  # (1 + 2), then doubled through torch.distributed


def _mismatch() -> dict[str, object]:
    comm = _init(check_consistency=True)
    comm.all_reduce(torch.ones(4))
    outcome = _raised(lambda: comm.all_reduce(torch.ones(3 + comm.rank)))
    return {"outcome": outcome, "launched": len(comm._backend.launched)}


def test_the_consistency_check_holds_on_a_stream_ordered_engine() -> None:
    # Compared through the store (the engine's answer would need the host to wait for the
    # device): every rank raises instead of launching a mismatched op.
    for r in testing.run(_mismatch, 2, backend=None, timeout=60):
        assert r["outcome"]["type"] == "CollectiveMismatch" and r["outcome"]["differing_ranks"], r
        assert r["launched"] == 1, r


def _abort_with_an_op_in_flight() -> dict[str, object]:
    comm = _init()
    t = torch.ones(4)
    comm.all_reduce(t)
    device().synchronize()
    if comm.rank == 1:
        time.sleep(3.0)  # never joins #2
        return {}
    comm.all_reduce(t)  # in flight: its peer never comes
    time.sleep(0.3)
    start = time.monotonic()
    comm.abort("the trainer gave up")  # what in-job recovery does to every communicator
    return {"abort_s": time.monotonic() - start, "flight": [e.state for e in comm.recorder.entries()]}


def test_an_abort_with_an_op_in_flight_returns_at_once() -> None:
    # Dropping the work of an op that still runs blocks until the op ends (torchcomms' works
    # do; the emulated ones too): the engine is aborted first, and the work kept until then.
    r0, _ = testing.run(_abort_with_an_op_in_flight, 2, backend=None, timeout=60)
    assert r0["abort_s"] < 2.0, r0
    assert r0["flight"] == ["completed", "failed"], r0


def _p2p_lanes() -> dict[str, object]:
    """Rank 0 sends to ranks 1 and 2 (async); rank 2 posts its recv 2.5 s late, within that
    send's 30 s deadline, while the send to rank 1, with a 1 s deadline, ends at once: its own
    lane, so it is no false timeout behind the other send."""
    comm = _init()
    t = torch.full((4,), 7.0)
    if comm.rank == 0:
        late = comm.send(t, 2, async_op=True, timeout=30.0)
        prompt = comm.send(t, 1, async_op=True, timeout=1.0)
        late.wait()
        prompt.wait()
        time.sleep(1.5)
        prompt_done = prompt.is_completed()
        error = _raised(lambda: commlib.check(wait=True))
        return {"prompt_done_early": prompt_done, "error": error}
    if comm.rank == 2:
        time.sleep(2.5)
    comm.recv(t := torch.zeros(4), 0)
    device().synchronize()
    commlib.check(wait=True)
    return {"value": t.tolist()}


def test_send_recv_with_each_peer_have_a_lane_of_their_own() -> None:
    r0, r1, r2 = testing.run(_p2p_lanes, 3, backend=None, timeout=60)
    assert r0["error"] is None and r0["prompt_done_early"], r0
    assert r1["value"] == r2["value"] == [7.0] * 4


def _watchdog_cannot_judge() -> dict[str, object]:
    comm = _init()
    launch = comm._backend.launch

    def broken_verdicts(call: object, timeout: object) -> object:
        work = launch(call, timeout)
        work.failure = lambda: 1 / 0  # a bug in judging the op, once it has ended
        return work

    comm._backend.launch = broken_verdicts
    comm.all_reduce(torch.ones(2))
    device().synchronize()
    time.sleep(0.5)  # the watchdog's next passes
    return {"next": _raised(lambda: comm.all_reduce(torch.ones(2)))}


def test_a_watchdog_that_cannot_judge_a_communicator_aborts_it_saying_why() -> None:
    [r] = testing.run(_watchdog_cannot_judge, 1, backend=None, timeout=60)
    assert r["next"]["type"] == "CommAborted", r
    assert "the watchdog could not judge its ops (ZeroDivisionError" in r["next"]["message"], r
