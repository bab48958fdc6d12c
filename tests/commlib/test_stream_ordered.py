"""commlib on a stream-ordered engine (what a GPU's is), on CPU: the emulated device and c10d
NCCL engine of emulated_device.py, under real processes over gloo.

What these pin: the CPU never waits for an op (every entry point: the Communicator, the process
group, commlib.dist, fsdp_overlap's comms); an op a peer never issues fails at its deadline,
counted from its issue (as c10d counts from the enqueue), naming the rank that never issued it,
raised at the caller's next call, `Work.wait()` or `commlib.check()`; a peer that dies during
a synchronous op fails it as soon as the engine says so, not at the deadline; the process
lives on, and in-job recovery rebuilds the engines and the job goes on.
"""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist

import commlib
import commlib.dist as cdist
from commlib import testing

from emulated_device import device, init as _init, raised as _raised

DEADLINE_S = 1.0
DETECTION_S = 0.5  # a deadline that passed, or an engine's error, is seen within this (a tick and the wording)


def _first_error(within_s: float) -> tuple[dict[str, object] | None, float]:
    """`commlib.check()` until it raises (at most `within_s`): what it raised, and when."""
    start, error = time.monotonic(), None
    while error is None and time.monotonic() - start < within_s:
        error = _raised(commlib.check)
        time.sleep(0.01)
    return error, time.monotonic()


def _never_blocks() -> dict[str, object]:
    """Every entry point issues behind 2 s of device work: the CPU returns at once, and the
    values are right once the device is done."""
    from fsdp_overlap.comms import CommlibAllGather

    comm = _init()
    rank, gpu = comm.rank, device()
    assert comm.stream_ordered
    ones = [torch.full((4,), float(rank + 1)) for _ in range(6)]
    gathered = torch.empty(8)
    gpu.busy(2.0)
    issue_from = time.monotonic()
    comm.all_reduce(ones[0], timeout=30.0)
    work = comm.all_reduce(ones[1], async_op=True, timeout=30.0)
    completed_at_issue = work.is_completed()
    work.wait()
    dist.all_reduce(ones[2])  # the process group, sync
    dist.all_reduce(ones[3], async_op=True).wait()  # the process group, async
    cdist.all_reduce(ones[4], group=comm)  # commlib.dist
    CommlibAllGather(comm)(gathered, ones[5], dist.group.WORLD, async_op=True).wait()  # fsdp_overlap
    issue_s = time.monotonic() - issue_from
    before_sync = [t.tolist() for t in ones[:2]]
    gpu.synchronize()
    waited_s = time.monotonic() - issue_from
    commlib.check(wait=True)
    time.sleep(0.3)  # the deadline thread's passes: it marks what the device completed
    return {"issue_s": issue_s, "waited_s": waited_s, "completed_at_issue": completed_at_issue,
            "completed_after": work.is_completed(), "before_sync": before_sync,
            "values": [t.tolist() for t in ones[:5]], "gathered": gathered.tolist(), "seq": comm.seq,
            "flight": [e.state for e in comm.recorder.entries()]}


def test_no_entry_point_blocks_the_cpu() -> None:
    """Sync and async ops of every entry point return at once behind busy device work."""
    for r in testing.run(_never_blocks, 2, backend=None, timeout=90):
        assert r["issue_s"] < 0.5, r  # blocking on any op would take the device's 2 s
        assert r["waited_s"] >= 2.0, r  # the device really was busy: the ops ran behind it
        assert not r["completed_at_issue"] and r["completed_after"]
        assert r["before_sync"] != [[3.0] * 4] * 2  # not yet reduced when the calls returned
        assert r["values"] == [[3.0] * 4] * 5
        assert r["gathered"] == [1.0] * 4 + [2.0] * 4
        assert r["seq"] == 6 and r["flight"] == ["completed"] * 6


def _rank1_never_issues(deliver_at: str) -> dict[str, object]:
    comm = _init()
    t = torch.ones(4)
    comm.all_reduce(t, timeout=DEADLINE_S)
    device().synchronize()
    if comm.rank == 1:
        time.sleep(DEADLINE_S + 2.0)  # never issues #2 in time; then finds rank 0's abort announced
        comm.all_reduce(t, timeout=30.0)
        error, at = _first_error(10.0)
        return {"error": error}
    issued = time.monotonic()
    comm.all_reduce(t, timeout=DEADLINE_S)
    returned_s = time.monotonic() - issued
    if deliver_at == "check":
        error, at = _first_error(10.0)
        detected_s = at - issued
    else:  # the next call on the communicator
        time.sleep(DEADLINE_S + DETECTION_S)
        error, detected_s = _raised(lambda: comm.all_reduce(t)), None
    after = _raised(lambda: comm.all_reduce(t))
    return {"returned_s": returned_s, "detected_s": detected_s, "error": error, "after": after, "pid": os.getpid()}


def test_an_op_a_peer_never_issues_times_out_at_its_deadline_raised_at_check() -> None:
    """The deadline counts from the issue; the error names the rank that never issued it."""
    r0, r1 = testing.run(_rank1_never_issues, 2, backend=None, timeout=90, args=("check",))
    assert r0["returned_s"] < 0.2  # the CPU did not wait for the op
    error = r0["error"]
    assert error["type"] == "CollectiveTimeout", r0
    assert DEADLINE_S <= r0["detected_s"] < DEADLINE_S + DETECTION_S, r0
    assert error["missing_ranks"] == [1] and (error["op"], error["seq"]) == ("all_reduce", 2)
    assert "rank 1 never started it" in error["message"] and "counts from its issue" in error["message"]
    assert r0["after"]["type"] == "CommAborted"  # raised once; later calls find the communicator broken
    # The late rank reads rank 0's abort announcement while its op is in flight: rank 0 is named.
    assert r1["error"]["type"] == "PeerFailure" and r1["error"]["failed_ranks"] == [0], r1


def test_the_deadlines_error_is_raised_at_the_next_call() -> None:
    """Without `check()`, the caller's next call on the communicator raises it."""
    r0, _ = testing.run(_rank1_never_issues, 2, backend=None, timeout=90, args=("next call",))
    assert r0["error"]["type"] == "CollectiveTimeout" and r0["error"]["missing_ranks"] == [1], r0
    assert r0["after"]["type"] == "CommAborted"


def _rank1_dies_in_a_sync_op() -> dict[str, object]:
    comm = _init()
    t = torch.ones(1 << 12)
    comm.all_reduce(t)
    device().synchronize()
    if comm.rank == 1:
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    issued = time.monotonic()
    comm.all_reduce(t, timeout=60.0)  # synchronous: c10d hands back no work for it
    error, at = _first_error(20.0)
    return {"error": error, "detected_s": at - issued}


def test_a_peer_that_dies_in_a_sync_op_fails_it_at_once_not_at_its_deadline() -> None:
    """c10d's watchdog sees the dead peer (an error on the engine): a PeerFailure within a
    second of the death, naming the dead rank, where its deadline was 60 s."""
    r0, r1 = testing.run(_rank1_dies_in_a_sync_op, 2, backend=None, timeout=90, allow_dead_ranks=True)
    assert r1 is None
    assert r0["error"]["type"] == "PeerFailure" and r0["error"]["failed_ranks"] == [1], r0
    assert r0["detected_s"] < 0.5 + 1.0, r0  # within a second of the kill at 0.5 s


def _rank0s_log_stalls_as_it_fails() -> dict[str, object]:
    """Rank 0's #2 times out (rank 1 never issues it in time) while rank 0's log is on a
    filesystem that has stopped answering: the line of its failure never comes."""
    from commlib import communicator

    comm = _init()
    if comm.rank == 0:
        fields = communicator._error_fields

        def stalled(error: commlib.CommError) -> dict[str, object]:
            time.sleep(60.0)
            return fields(error)

        communicator._error_fields = stalled  # this rank's process only
    t = torch.ones(4)
    comm.all_reduce(t, timeout=DEADLINE_S)
    device().synchronize()
    if comm.rank == 0:
        issued = time.monotonic()
        comm.all_reduce(t, timeout=DEADLINE_S)
        error, at = _first_error(15.0)
        return {"error": error, "detected_s": at - issued}
    # Rank 1 issues #2 once rank 0 has given up on it, and past the longest the failure's line
    # may hold back the news (LINE_BEFORE_NEWS_S).
    time.sleep(DEADLINE_S + communicator.LINE_BEFORE_NEWS_S + 2.0)
    comm.all_reduce(t, timeout=30.0)
    error, _ = _first_error(10.0)
    return {"error": error}


def test_a_failure_whose_log_line_stalls_is_still_announced_and_raised_in_seconds() -> None:
    """A log line that never comes holds back neither the engine's abort, nor the news to the
    peers, nor the caller's error for more than LINE_BEFORE_NEWS_S."""
    from commlib.communicator import LINE_BEFORE_NEWS_S

    r0, r1 = testing.run(_rank0s_log_stalls_as_it_fails, 2, backend=None, timeout=90)
    assert r0["error"]["type"] == "CollectiveTimeout", r0
    assert r0["detected_s"] < DEADLINE_S + LINE_BEFORE_NEWS_S + 1.5, r0
    assert r1["error"] is not None and r1["error"]["type"] == "PeerFailure", r1
    assert r1["error"]["failed_ranks"] == [0], r1


def _hang_then_recover() -> dict[str, object]:
    """Rank 1's device hangs in op #2 (a long kernel a pre-hook enqueues before it, as chaos's
    device hang does): rank 0's #2 times out; both recover in-job and go on."""
    comm = _init()
    rank, gpu = comm.rank, device()
    hang = commlib.register_pre_hook(lambda call: gpu.busy(4.0) if rank == 1 and call.seq == 2 else None)
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
    return {"error": type(error).__name__, "epoch": done.epoch, "value": x.tolist(), "new": new is not comm}


def test_recovery_rebuilds_a_stream_ordered_engine_and_the_job_goes_on() -> None:
    """After a device hang both ranks recover in-job; the rebuilt engine computes right."""
    r0, r1 = testing.run(_hang_then_recover, 2, backend=None, timeout=120)
    assert r0["error"] in ("CollectiveTimeout", "PeerFailure"), r0
    assert r1["error"] in ("CollectiveTimeout", "PeerFailure"), r1
    assert "CollectiveTimeout" in (r0["error"], r1["error"]), (r0, r1)
    for r in (r0, r1):
        assert r["epoch"] == 1 and r["new"]
        assert r["value"] == [6.0] * 4  # (1 + 2), then doubled through torch.distributed


def _mismatch() -> dict[str, object]:
    comm = _init(check_consistency=True)
    comm.all_reduce(torch.ones(4))
    outcome = _raised(lambda: comm.all_reduce(torch.ones(3 + comm.rank)))
    return {"outcome": outcome, "launched": len(comm._backend.launched)}


def test_the_consistency_check_holds_on_a_stream_ordered_engine() -> None:
    """Compared through the store (the engine's answer would need a host sync): every rank
    raises instead of launching a mismatched op."""
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
    """The engine's abort ends the op stuck on its peer; nothing waits for that peer."""
    r0, _ = testing.run(_abort_with_an_op_in_flight, 2, backend=None, timeout=60)
    assert r0["abort_s"] < 2.0, r0
    assert r0["flight"] == ["completed", "enqueued"], r0


def _barrier_with_a_late_peer(async_op: bool) -> dict[str, object]:
    comm = _init()
    comm.barrier()  # on time: a rendezvous that returns
    if comm.rank == 1:
        time.sleep(2.5)  # misses the next one, then leaves
        return {}
    start = time.monotonic()
    if async_op:
        work = comm.barrier(async_op=True, timeout=DEADLINE_S)
        issue_s = time.monotonic() - start
        error = _raised(work.wait)
    else:
        issue_s, error = None, _raised(lambda: comm.barrier(timeout=DEADLINE_S))
    return {"issue_s": issue_s, "s": time.monotonic() - start, "error": error, "engine": comm._backend.launched}


def test_a_barrier_waits_on_the_cpu_within_its_deadline() -> None:
    """c10d's NCCL barrier blocks the CPU with no deadline: commlib launches a one-element
    all_reduce instead and the host waits for it under its deadline, sync and async alike."""
    for async_op in (False, True):
        r0, _ = testing.run(_barrier_with_a_late_peer, 2, backend=None, timeout=40, args=(async_op,))
        assert r0["error"]["type"] == "CollectiveTimeout" and r0["error"]["missing_ranks"] == [1], r0
        assert r0["error"]["op"] == "barrier", r0
        assert r0["s"] < DEADLINE_S + DETECTION_S + 0.5, r0
        assert "barrier" not in r0["engine"], r0
        if async_op:
            assert r0["issue_s"] < 0.2, r0


def _hooks_that_call_back() -> dict[str, object]:
    comm = _init()
    seen: list[str] = []

    def post(call: object, duration_s: float) -> None:
        commlib.check()  # a post-hook that asks for news, as a trainer's metrics hook may
        seen.append("post")

    def failure(call: object, error: BaseException) -> None:
        commlib.check()
        comm.abort("a failure hook aborts")  # and one that aborts
        seen.append("failure")

    commlib.register_post_hook(post)
    commlib.register_failure_hook(failure)
    t = torch.ones(4)
    comm.all_reduce(t)
    comm.barrier()
    if comm.rank == 1:
        time.sleep(DEADLINE_S + 2.0)
        return {"seen": seen}
    comm.all_reduce(t, timeout=DEADLINE_S)
    error, _ = _first_error(10.0)
    return {"seen": seen, "error": error}


def test_hooks_that_call_commlib_back_never_deadlock() -> None:
    """Post-hooks run on the caller's thread, failure hooks where the error is raised: one that
    calls `check()`, a barrier or `abort()` is an ordinary call there (no lock held)."""
    r0, r1 = testing.run(_hooks_that_call_back, 2, backend=None, timeout=60)
    assert r0["error"]["type"] == "CollectiveTimeout", r0
    assert r0["seen"] == ["post", "post", "post", "failure"], r0
    assert r1["seen"] == ["post", "post"], r1


def _a_broken_device() -> dict[str, object]:
    comm = _init()
    other = comm.split([0], "other")
    if comm.rank == 1:
        return {}
    events = comm._backend.events
    mark = events.mark

    class Poisoned:  # what a device-side assert leaves: every query of the context raises
        def query(self) -> bool:
            raise RuntimeError("CUDA error: device-side assert triggered")

    events.mark = lambda: Poisoned()
    comm.all_reduce(torch.ones(2))
    time.sleep(0.5)  # the deadline thread's passes
    events.mark = mark
    broken = _raised(lambda: comm.all_reduce(torch.ones(2)))
    x = torch.full((2,), 3.0)
    other.all_reduce(x, timeout=30.0)  # a communicator made before: still watched
    commlib.check(wait=True)
    return {"broken": broken, "value": x.tolist()}


def test_a_communicator_whose_device_breaks_is_aborted_and_the_others_stay_watched() -> None:
    """A query that raises aborts that communicator, saying why; the deadline thread goes on."""
    r0, _ = testing.run(_a_broken_device, 2, backend=None, timeout=60)
    assert r0["broken"]["type"] == "CommAborted", r0
    assert "its ops could not be watched (RuntimeError: CUDA error: device-side assert" in r0["broken"]["message"]
    assert r0["value"] == [3.0, 3.0], r0
