"""The doctor and the trace on tagged send/recv: a send is paired with the recv of its tag.

One 2-rank gloo run, on a communicator "tags" whose ranks are in the other order than the
world's (global 0 is its rank 1): rank 0 sends tag 2, then tag 1, then untagged; rank 1
receives tag 1, then tag 2, then untagged (gloo matches them by tag), each the first of its
tag with that peer (#1). Then rank 1 posts a recv of tag 3, which rank 0 never sends: it
times out, and a SIGUSR1 dump taken while it waited shows it in that recv. Rank 0 meanwhile
waits in a barrier of the world.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import commlib
from commlib.doctor import render
from commlib.observe.diagnosis import diagnose
from commlib.observe.findings import Kind
from commlib.observe.trace import build_trace
from commlib.testing import outcome, run
from doctor_logs import live_copy, same_verdict

DEADLINE = 1.5
ORDER = [1, 0]  # global ranks in the order of their rank in "tags"


def _program(world: commlib.Communicator) -> dict[str, Any]:
    sub = world.split(ORDER, "tags")
    assert sub is not None
    to = ORDER.index  # a global rank's rank in `sub`
    results: dict[str, Any] = {}
    if world.rank == 0:
        late = sub.send(torch.full((2,), 2.0), to(1), tag=2, async_op=True)
        sub.send(torch.full((2,), 1.0), to(1), tag=1)
        late.wait()
        sub.send(torch.full((2,), 0.0), to(1))
    else:
        got = [torch.zeros(2) for _ in range(3)]
        sub.recv(got[0], to(0), tag=1)
        sub.recv(got[1], to(0), tag=2)
        sub.recv(got[2], to(0))
        results["values"] = [g[0].item() for g in got]
        threading.Timer(DEADLINE / 3, os.kill, (os.getpid(), signal.SIGUSR1)).start()
        results["unmatched"] = outcome(lambda: sub.recv(torch.zeros(2), to(0), tag=3, timeout=DEADLINE))
    world.barrier()
    return results


@pytest.fixture(scope="module")
def logs(once: Callable[[str, Callable[[Path], Any]], tuple[Path, Any]]) -> tuple[Path, list[dict[str, Any]]]:
    return once("doctor-tags", lambda root: run(_program, world_size=2, timeout=120, log_dir=root))


def test_sends_received_in_another_order_are_paired(logs: tuple[Path, list[dict[str, Any]]]) -> None:
    """Each send is paired with the recv of its tag: no problem but the unmatched recv's."""
    root, results = logs
    assert results[1]["values"] == [1.0, 2.0, 0.0]
    final = diagnose(root).final
    assert final is not None
    assert [(p.kind, p.comm, p.op, p.seq) for p in final.problems] == [(Kind.TIMEOUT, "tags", "recv", 1)]
    assert final.p2p_ops == 4  # (pair, tag, seq): tag 1 #1, tag 2 #1, untagged #1, tag 3 #1
    events = build_trace(root)["traceEvents"]
    slices = sorted((e["pid"], e["name"], e["args"]["seq"], e["args"]["status"])
                    for e in events if e["ph"] == "X" and e.get("cat") == "p2p")
    assert slices == [(0, "send -> 1", 1, "ok"), (0, "send -> 1 (tag 1)", 1, "ok"), (0, "send -> 1 (tag 2)", 1, "ok"),
                      (1, "recv <- 0", 1, "ok"), (1, "recv <- 0 (tag 1)", 1, "ok"),
                      (1, "recv <- 0 (tag 2)", 1, "ok"),
                      (1, "recv <- 0 (tag 3)", 1, "timed_out")]
    starts = {(e["pid"], e["args"].get("tag", 0)): e["ts"] for e in events
              if e["ph"] == "X" and e.get("cat") == "p2p"}
    flows: dict[int, dict[str, Any]] = {}
    for e in events:
        if e["ph"] in ("s", "f"):
            flows.setdefault(e["id"], {})[e["ph"]] = e
    # One arrow per matched pair, from the send of a tag to the recv of that tag.
    assert sorted(f["s"]["args"].get("tag", 0) for f in flows.values()) == [0, 1, 2]
    for f in flows.values():
        tag = f["s"]["args"].get("tag", 0)
        assert (f["s"]["pid"], f["f"]["pid"], f["f"]["args"].get("tag", 0)) == (0, 1, tag)
        assert f["s"]["ts"] == starts[(0, tag)] and f["f"]["ts"] >= starts[(1, tag)]


def test_unmatched_tagged_recv_is_named_with_its_tag(logs: tuple[Path, list[dict[str, Any]]]) -> None:
    """The recv no send matches is named with its tag, and so is the send its peer never posted."""
    root, results = logs
    assert (results[1]["unmatched"]["error"], results[1]["unmatched"]["seq"]) == ("CollectiveTimeout", 1)
    d = diagnose(root)
    [timeout] = d.final.problems
    assert (timeout.ranks, timeout.reporters, timeout.details["pair"], timeout.details["tag"]) == ([0], [1], [0, 1], 3)
    assert timeout.message.startswith("recv #1 from rank 0 (tag 3) on 'tags' timed out after 1.5 s on rank 1: "
                                      "rank 0 never posted the matching send #1 to rank 1 (tag 3).")
    assert "culprit rank 0" in render(d)


def test_hung_tagged_recv_is_named_with_its_tag(logs: tuple[Path, list[dict[str, Any]]], tmp_path: Path) -> None:
    """Before its deadline, the recv is a hang of that tag alone; the dump shows it, with its tag."""
    root, _ = logs
    d = diagnose(live_copy(root, tmp_path / "live"))
    # Rank 0 waits in the world's barrier for rank 1, which waits in the recv: both hang.
    assert sorted((p.kind, p.comm, p.op) for p in d.final.problems) == [(Kind.HANG, "tags", "recv"),
                                                                        (Kind.HANG, "world", "barrier")]
    [hang] = [p for p in d.final.problems if p.comm == "tags"]
    assert (hang.ranks, hang.reporters, hang.seq, hang.details["tag"]) == ([0], [1], 1, 3)
    assert hang.message.startswith("recv #1 from rank 0 (tag 3) on 'tags' never finished and no deadline expired")
    assert "rank 0 never posted the matching send #1 to rank 1 (tag 3)" in hang.message
    [dump] = [x for x in d.dumps if x.comm == "tags"]
    assert (dump.rank, dump.reason) == (1, "sigusr1")
    assert dump.unfinished == [{"comm": "tags", "op": "recv", "seq": 1, "peer": 0, "tag": 3}]  # global ranks
    assert hang.details["dumps"] == [dump.path] and "alive and still in it" in hang.message


def test_the_verdict_from_the_end_is_the_full_reads(logs: tuple[Path, list[dict[str, Any]]], tmp_path: Path) -> None:
    """Read from the end, tagged send/recv give the full read's verdict."""
    root, _ = logs
    same_verdict(root)
    same_verdict(live_copy(root, tmp_path / "live"))
