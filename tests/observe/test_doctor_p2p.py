"""The doctor and the trace on a program that mixes send/recv with collectives, and the doctor
run where torch is not installed.

One 3-rank gloo run plays two scenarios, each on a communicator of its own logging into a
directory of its own: rank 0 sends to rank 1, every rank all_reduces, then
- "skip": rank 2 never joins the next all_reduce (ranks 0 and 1 time out, rank 0 first);
- "pipe": rank 1 posts a second recv from rank 0, which sends to rank 2 instead (rank 1's
  recv times out; a SIGUSR1 dump shows it in that recv). The communicator numbers its
  ranks in another order than the world, and every rank reported must be the global one.
Global ranks throughout. Send/recv are numbered per pair of ranks, so the all_reduce is #1 on every rank whatever
point-to-point traffic came before it, and rank 0's send to rank 2 is that pair's #1.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import structlog
import torch

import commlib
from commlib.doctor import render
from commlib.observe.blame import Kind
from commlib.observe.diagnosis import diagnose
from commlib.observe.trace import build_trace
from commlib.record import log
from commlib.testing import outcome, run
from doctor_logs import live_copy, same_verdict

DEADLINE = 1.5
PIPE_ORDER = [2, 0, 1]  # global ranks in the order of their rank in "pipe"
REPO = Path(__file__).resolve().parents[2]


def _program(world: commlib.Communicator, root: str) -> dict[str, Any]:
    rank = world.rank
    t = torch.ones(4)
    results: dict[str, Any] = {}

    def enter(name: str, order: list[int]) -> tuple[commlib.Communicator, Any]:
        world.barrier()  # every rank is done with the previous scenario
        log.configure(rank, world.size, Path(root) / name)
        sub = world.split(order, name)
        assert sub is not None
        to = order.index  # a global rank's rank in `sub`
        if rank == 0:
            sub.send(t, to(1))
        elif rank == 1:
            sub.recv(t, to(0))
        sub.all_reduce(t)
        return sub, to

    sub, _ = enter("skip", [0, 1, 2])
    if rank == 2:
        commlib.get_logger().info("train.step", step=5)  # and on to the next scenario
    else:
        # Rank 1's deadline is the longer: rank 0's expiry, announced, ends rank 1's wait early,
        # and rank 1 must still report the same timeout naming rank 2, not blame rank 0.
        results["skip"] = outcome(lambda: sub.all_reduce(t, timeout=DEADLINE if rank == 0 else 4 * DEADLINE))

    # Communicator ranks differ from global ranks here (global 0 is rank 1 of "pipe"): every
    # rank the doctor and the trace name is global.
    sub, to = enter("pipe", PIPE_ORDER)
    if rank == 0:
        sub.send(t, to(2))
    elif rank == 1:
        # What an operator does to a hung rank: SIGUSR1 dumps its flight recorder.
        threading.Timer(DEADLINE / 3, os.kill, (os.getpid(), signal.SIGUSR1)).start()
        results["pipe"] = outcome(lambda: sub.recv(t, to(0), timeout=DEADLINE))
    else:
        sub.recv(t, to(0))
    world.barrier()
    return results


@pytest.fixture(scope="module")
def logs(once: Callable[[str, Callable[[Path], Any]], tuple[Path, Any]]) -> tuple[Path, list[dict[str, Any]]]:
    return once("doctor-p2p", _logs)


def _logs(root: Path) -> list[dict[str, Any]]:
    return run(_program, world_size=3, timeout=180, args=(str(root),), log_dir=root / "init")


def test_rank_skipping_a_collective_after_send_recv_is_named(logs: tuple[Path, list[dict[str, Any]]],
                                                             tmp_path: Path) -> None:
    root, results = logs
    for r in (0, 1):
        assert (results[r]["skip"]["error"], results[r]["skip"]["missing_ranks"]) == ("CollectiveTimeout", [2])
    assert results[1]["skip"]["elapsed"] < 2 * DEADLINE < results[1]["skip"]["deadline"], results[1]
    d = diagnose(root / "skip")
    final = d.final
    assert final is not None and final.status == "failed" and final.culprits == [2]
    [timeout] = [p for p in final.problems if p.kind is Kind.TIMEOUT]
    assert (timeout.ranks, timeout.op, timeout.seq, timeout.comm, timeout.reporters) == ([2], "all_reduce", 2,
                                                                                         "skip", [0, 1])
    assert timeout.details["arrived"] == [0, 1]
    where = timeout.details["where"]["2"]
    assert (where["last_finished"]["op"], where["last_finished"]["seq"], where["last_event"]) == (
        "all_reduce", 1, "train.step")
    # No problem is about the send/recv, which matched; no mismatch from p2p shifting seqs.
    assert [p.kind for p in final.problems] == [Kind.TIMEOUT]

    # While still hung (no deadline expired yet), the hang analysis sees past the send/recv.
    live = diagnose(live_copy(root / "skip", tmp_path / "live"))
    assert [(p.kind, p.ranks, p.op, p.seq, p.reporters) for p in live.final.problems] == [
        (Kind.HANG, [2], "all_reduce", 2, [0, 1])], render(live)
    assert live.final.status == "incomplete" and live.final.culprits == [2]

    assert (final.collectives, final.p2p_ops) == (2, 1)
    text = render(d)
    assert "2 collectives, 1 send/recv" in text and "culprit rank 2" in text


def test_recv_that_times_out_names_the_rank_that_never_sent(logs: tuple[Path, list[dict[str, Any]]]) -> None:
    root, results = logs
    assert (results[1]["pipe"]["error"], results[1]["pipe"]["op"], results[1]["pipe"]["seq"]) == (
        "CollectiveTimeout", "recv", 2)
    d = diagnose(root / "pipe")
    final = d.final
    assert final is not None and final.culprits == [0]
    assert (final.collectives, final.p2p_ops) == (1, 3)  # pair (0, 1): #1 and #2; pair (0, 2): #1
    [timeout] = final.problems
    assert (timeout.kind, timeout.ranks, timeout.op, timeout.seq, timeout.reporters) == (
        Kind.TIMEOUT, [0], "recv", 2, [1])
    assert (timeout.details["pair"], timeout.details["peer"], timeout.details["missing"]) == ([0, 1], 0, [0])
    msg = timeout.message
    assert "recv #2 from rank 0 on 'pipe' timed out after 1.5 s on rank 1" in msg
    assert "rank 0 never posted the matching send #2 to rank 1" in msg
    assert "rank 0: last started send #1 to rank 2 on 'pipe' (finished)" in msg  # the pair (0, 2)'s own count
    assert "culprit rank 0" in render(d) and "3 send/recv" in render(d)


def test_recv_hung_before_any_deadline(logs: tuple[Path, list[dict[str, Any]]], tmp_path: Path) -> None:
    root, _ = logs
    d = diagnose(live_copy(root / "pipe", tmp_path / "live"))  # while rank 1 still waited
    [hang] = d.final.problems
    assert (hang.kind, hang.ranks, hang.op, hang.seq, hang.reporters) == (Kind.HANG, [0], "recv", 2, [1])
    assert hang.message.startswith("recv #2 from rank 0 on 'pipe' never finished and no deadline expired")
    assert "rank 0 never posted the matching send #2 to rank 1" in hang.message
    assert d.final.status == "incomplete" and d.final.culprits == [0]
    # The SIGUSR1 dump rank 1 took while it waited shows it alive in that recv.
    [dump] = [x for x in d.dumps if x.comm == "pipe"]
    assert (dump.rank, dump.reason) == (1, "sigusr1")
    assert dump.unfinished == [{"comm": "pipe", "op": "recv", "seq": 2, "peer": 0}]  # global ranks
    assert hang.details["dumps"] == [dump.path] and "alive and still in it" in hang.message
    assert "still in recv #2 (peer 0)" in render(d)


def test_trace_draws_send_recv_and_their_arrows(logs: tuple[Path, list[dict[str, Any]]]) -> None:
    root, _ = logs
    events = build_trace(root / "pipe")["traceEvents"]
    slices = sorted((e["pid"], e["name"], e["args"]["seq"], e["args"]["status"]) for e in events
                    if e["ph"] == "X" and e.get("cat") == "p2p")
    assert slices == [(0, "send -> 1", 1, "ok"), (0, "send -> 2", 1, "ok"),
                      (1, "recv <- 0", 1, "ok"), (1, "recv <- 0", 2, "timed_out"),
                      (2, "recv <- 0", 1, "ok")]
    assert sorted(e["pid"] for e in events if e["ph"] == "X" and e["name"] == "all_reduce") == [0, 1, 2]
    tid = next(e["tid"] for e in events if e["ph"] == "X" and e["name"] == "send -> 2")
    flows: dict[int, dict[str, Any]] = {}
    for e in events:
        if e["ph"] in ("s", "f"):
            assert e["tid"] == tid and e["cat"] == "p2p"
            flows.setdefault(e["id"], {})[e["ph"]] = e
    # One arrow per matched send/recv (the recv that timed out has none), from the send's
    # start to within the recv.
    assert sorted((f["s"]["pid"], f["f"]["pid"]) for f in flows.values()) == [(0, 1), (0, 2)]
    for f in flows.values():
        assert f["s"]["ts"] <= f["f"]["ts"] and f["f"]["bp"] == "e"


def test_the_verdict_from_the_end_is_the_full_reads(logs: tuple[Path, list[dict[str, Any]]], tmp_path: Path) -> None:
    root, _ = logs
    for logdir in sorted(p for p in root.iterdir() if p.is_dir()):
        same_verdict(logdir)
    same_verdict(live_copy(root / "pipe", tmp_path / "live"))


def test_doctor_runs_without_torch(logs: tuple[Path, list[dict[str, Any]]], tmp_path: Path) -> None:
    """`python -m commlib.doctor` where only the logs are: a venv with structlog and no torch."""
    root, _ = logs
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    python = venv / "bin" / "python"
    # structlog is the doctor's one dependency: linked from this environment, not installed from an index.
    deps = tmp_path / "deps"
    deps.mkdir()
    (deps / "structlog").symlink_to(Path(structlog.__file__).parent)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(deps)])
    probe = subprocess.run([str(python), "-c", "import torch"], env=env, capture_output=True, text=True, timeout=60)
    assert probe.returncode != 0 and "No module named 'torch'" in probe.stderr, "expected a venv without torch"

    trace = tmp_path / "trace.json"
    done = subprocess.run([str(python), "-m", "commlib.doctor", str(root / "pipe"), "--trace", str(trace)],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert "No module named" not in done.stderr, done.stderr
    assert done.returncode == 1, f"expected exit 1 (the final attempt failed); found {done.returncode}: {done.stderr}"
    text = " ".join(done.stdout.split())  # as read, not as wrapped
    assert "culprit rank 0" in text and "rank 0 never posted the matching send #2 to rank 1" in text
    assert json.loads(trace.read_text())["traceEvents"]

    as_json = subprocess.run([str(python), "-m", "commlib.doctor", str(root / "skip"), "--json"],
                             env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert as_json.returncode == 1, as_json.stderr
    [attempt] = json.loads(as_json.stdout)["attempts"]
    assert (attempt["status"], attempt["culprits"]) == ("failed", [2])
    shutil.rmtree(venv)
