"""Split communicators, hooks, structured logs with context, and the SIGUSR1 flight dump.

Ranks are threads (`ranks`: the fast lane, marked `contract`), but for the signal's test.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import commlib
from commlib import testing
from commlib.observe.events import LogTail, read_events


def _split_and_hooks(comm: commlib.Communicator) -> dict[str, object]:
    seen: list[tuple[str, str, int]] = []
    me = threading.current_thread()

    def pre(call: commlib.Collective) -> None:
        # A process-wide hook sees every rank's calls where ranks are threads of one process
        # (pre-hooks run on the caller's thread): this rank keeps its own.
        if threading.current_thread() is me:
            seen.append(("pre", call.comm, call.seq))

    process_wide = commlib.register_pre_hook(pre)
    local = comm.register_post_hook(lambda call, duration: seen.append(("post", call.comm, call.seq)))
    # Ranks 2 and 0, in that order: rank numbering in the new communicator follows the list.
    sub = comm.split([2, 0], "pair")
    result: dict[str, object] = {"member": sub is not None}
    if sub is not None:
        t = torch.tensor([float(comm.rank)])
        sub.all_reduce(t)
        result.update(sub_rank=sub.rank, sub_size=sub.size, sum=t.item(), name=sub.name)
    comm.barrier()
    process_wide.remove()
    local.remove()
    comm.barrier()  # no hook sees this one
    result["seen"] = seen
    return result


def test_split_renumbers_and_hooks_apply(ranks: Callable[..., list]) -> None:
    """A split numbers its members in list order; process-wide hooks see it, the world's own not."""
    r0, r1, r2 = ranks(_split_and_hooks, 3)
    assert r1["member"] is False
    assert (r2["sub_rank"], r0["sub_rank"], r0["sub_size"], r0["sum"], r2["name"]) == (0, 1, 2, 2.0, "pair")
    # Process-wide pre-hooks see the split's collectives too; the world's post-hook only the world's.
    assert r0["seen"] == [("pre", "pair", 1), ("pre", "world", 1), ("post", "world", 1)]
    assert r1["seen"] == [("pre", "world", 1), ("post", "world", 1)]


def _logged_run(comm: commlib.Communicator) -> None:
    with commlib.context(step=3, phase="forward"):
        comm.all_reduce(torch.ones(8))
        comm.all_reduce(torch.ones(8), commlib.premul_sum(1.0))
        comm.broadcast(torch.ones(8), root=0)

        log = commlib.get_logger()  # this rank's: a thread a rank starts may log with it

        def in_thread() -> None:
            with commlib.context(phase="side"):
                log.info("side.event")

        th = threading.Thread(target=in_thread)
        th.start()
        th.join()
    commlib.get_logger().info("train.step", loss=1.5)


def test_logs_are_json_lines_with_context(ranks: Callable[..., list], tmp_path: Path) -> None:
    """Each rank's file holds JSON lines with its rank, the op, the caller's context, and clocks."""
    ranks(_logged_run, 2, log_dir=str(tmp_path))
    for rank in (0, 1):
        events = list(read_events(tmp_path / f"rank{rank}.jsonl"))
        by_name = {e["event"]: e for e in events}  # the last of each event
        starts = [e for e in events if e["event"] == "collective.start"]
        # The reduction is on the start (a premul_sum(1.0) once had to be found with a hook).
        assert [e.get("reduce_op") for e in starts] == ["sum", "premul_sum(1.0)", None]
        start, end = starts[0], next(e for e in events if e["event"] == "collective.end")
        for e in (start, end):
            assert (e["rank"], e["size"], e["comm"], e["op"], e["seq"], e["step"], e["phase"]) == (
                rank, 2, "world", "all_reduce", 1, 3, "forward")
            assert e["pid"] > 0 and e["host"] and e["ts_ns"] > 0 and e["mono_ns"] > 0
        assert start["bytes"] == 32 and start["shapes"] == [[8]] and start["dtype"] == "torch.float32"
        assert end["status"] == "ok" and end["duration_s"] > 0
        # A thread starts from an empty context (contextvars), then adds its own.
        assert "step" not in by_name["side.event"] and by_name["side.event"]["phase"] == "side"
        assert "step" not in by_name["train.step"] and by_name["train.step"]["loss"] == 1.5


@pytest.mark.contract
def test_reader_tolerates_a_truncated_last_line(tmp_path: Path) -> None:
    """A log's truncated last line is skipped."""
    path = tmp_path / "rank0.jsonl"
    path.write_text('{"event": "a"}\n{"event": "b"}\n{"event": "c", "trunc')
    assert [e["event"] for e in read_events(path)] == ["a", "b"]


@pytest.mark.contract
def test_tail_returns_each_complete_line_once(tmp_path: Path) -> None:
    """LogTail returns each complete line once, across files and partial writes."""
    tail = LogTail(tmp_path / "logs")
    assert tail.poll() == []  # no log dir yet
    (tmp_path / "logs").mkdir()
    path = tmp_path / "logs" / "rank1.jsonl"
    path.write_text('{"event": "a"}\nnot json\n{"event": "b", "half')
    assert [e["event"] for e in tail.poll()] == ["a"]
    with open(path, "a") as f:
        f.write('": 1}\n{"event": "c"}\n')
    (tmp_path / "logs" / "rank0.jsonl").write_text('{"event": "z"}\n')
    assert [e["event"] for e in tail.poll()] == ["z", "b", "c"]
    assert tail.poll() == []


def _async_then_sync(comm: commlib.Communicator) -> None:
    work = comm.all_reduce(torch.ones(8), async_op=True)
    time.sleep(0.2)  # long enough for a 2-rank all_reduce to finish before the wait begins
    work.wait()
    comm.all_reduce(torch.ones(8))


def test_async_end_says_how_long_its_wait_blocked(
    ranks: Callable[..., list], tmp_path: Path
) -> None:
    """An async op's collective.end says how long its wait blocked; a sync one's does not."""
    ranks(_async_then_sync, 2, log_dir=str(tmp_path))
    for rank in (0, 1):
        ends = [e for e in read_events(tmp_path / f"rank{rank}.jsonl") if e["event"] == "collective.end"]
        async_end, sync_end = ends
        assert 0 <= async_end["wait_s"] < 0.2 and async_end["done_before_wait"] is True
        assert "wait_s" not in sync_end and "done_before_wait" not in sync_end  # the caller waited for all of it


def _hung_rank_dumps_on_sigusr1(comm: commlib.Communicator, log_dir: str) -> list[str]:
    comm.all_reduce(torch.ones(1))
    if comm.rank == 1:
        time.sleep(3)
        return []

    def poke() -> None:
        time.sleep(1.0)  # by now the main thread is blocked inside the collective's wait
        os.kill(os.getpid(), signal.SIGUSR1)

    threading.Thread(target=poke, daemon=True).start()
    try:
        comm.all_reduce(torch.ones(1), timeout=2.5)
    except commlib.CollectiveTimeout:
        pass
    return sorted(p.name for p in Path(log_dir).glob("flight_rank0_*sigusr1.json"))


def test_sigusr1_dumps_flight_recorder_while_blocked(backend: str, tmp_path: Path) -> None:
    """SIGUSR1 dumps a rank's flight recorder while it is blocked in a collective."""
    dumps = testing.run(_hung_rank_dumps_on_sigusr1, 2, backend=backend, args=(str(tmp_path),),
                        log_dir=str(tmp_path))[0]
    assert len(dumps) == 1
    data = json.loads((tmp_path / dumps[0]).read_text())
    entries = data["entries"]
    assert data["reason"] == "sigusr1" and data["rank"] == 0
    assert [(e["seq"], e["state"]) for e in entries] == [(1, "completed"), (2, "started")]
    # The timeout that followed wrote its own dump.
    assert list(tmp_path.glob("flight_rank0_*collective_timeout.json"))
