"""`commlib doctor` and the trace export, on the logs of real gloo runs that fail on purpose.

Spawning ranks is the expensive part, so one 2-rank run plays every scenario in turn, each
on a communicator of its own split from the world and logging into a directory of its own
(`log.configure` re-points the process's log between scenarios); a world barrier keeps the
ranks in step from one scenario to the next. A second, 3-rank run has the consistency check
on. Everything else is read from these logs, or from copies of them edited the way a
torchrun restart, a killed writer or a still-hung job would leave them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import commlib
from commlib.doctor import main, render
from commlib.observe import events
from commlib.observe.blame import FROZEN_GRACE_S, Kind
from commlib.observe.diagnosis import diagnose
from commlib.observe.trace import build_trace
from commlib.record import log
from commlib.testing import outcome, run
from doctor_logs import live_copy, same_verdict

DEADLINE = 1.5
CLEAN_STEPS = 50  # 4 collectives a step


def _sleep_until_logged(path: Path, event: str) -> None:
    """Sleep until `event` shows in `path`: past the peer's deadline however slow the machine is."""
    give_up = time.monotonic() + 30
    while f'"event":"{event}"' not in path.read_text() and time.monotonic() < give_up:
        time.sleep(0.05)


def _logged_ns(path: Path, event: str) -> int:
    return next(e["ts_ns"] for e in events.read_events(path) if e["event"] == event)


def _wait_stopped(pid: int) -> None:
    give_up = time.monotonic() + 30
    while Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
        assert time.monotonic() < give_up, f"process {pid} never stopped"
        time.sleep(0.01)


def _scenarios(world: commlib.Communicator, root: str) -> dict[str, Any]:
    rank = world.rank
    t = torch.ones(4)
    results: dict[str, Any] = {}
    pids = torch.zeros(2, dtype=torch.int64)
    world.all_gather_single(pids, torch.tensor([os.getpid()]))

    def enter(name: str, *comms: str) -> list[commlib.Communicator]:
        # A communicator keeps logging where the log pointed when it was made, so every
        # scenario works on communicators split after its directory is configured.
        world.barrier()  # every rank is done with the previous scenario
        log.configure(rank, world.size, Path(root) / name)
        subs = [world.split([0, 1], c) for c in comms or (name,)]
        assert all(subs)
        return subs  # type: ignore[return-value]

    ag, rs = enter("clean", "ag", "rs")  # two communicators, sync and async ops, step/phase context
    shard, full = torch.ones(4), torch.zeros(8)
    for step in range(CLEAN_STEPS):
        with commlib.context(step=step, phase="forward"):
            ag.all_reduce(t)
            ag.all_gather_single(full, shard)
        with commlib.context(step=step, phase="backward"):
            rs.reduce_scatter_single(shard, full, async_op=True).wait()
            rs.broadcast(t, root=0)

    [sub] = enter("skip")  # rank 1 never issues the second all_reduce
    sub.all_reduce(t, timeout=DEADLINE)
    if rank == 0:
        # What an operator does to a hung rank: SIGUSR1 dumps its flight recorder.
        threading.Timer(DEADLINE / 3, os.kill, (os.getpid(), signal.SIGUSR1)).start()
        results["skip"] = outcome(lambda: sub.all_reduce(t, timeout=DEADLINE))
    else:
        with commlib.context(step=3, phase="data"):
            commlib.get_logger().info("train.step", step=3, loss=1.0)  # other events share the log

    [sub] = enter("prehook")  # rank 1 sleeps past the deadline before the collective starts
    if rank == 1:
        sub.register_pre_hook(lambda call: _sleep_until_logged(Path(root) / "prehook" / "rank0.jsonl",
                                                               "collective.timeout"))
    results["prehook"] = outcome(lambda: sub.all_reduce(t, timeout=DEADLINE))

    [sub] = enter("mismatch")  # different ops at one seq, no consistency check
    sub.all_reduce(t, timeout=DEADLINE)
    results["mismatch"] = outcome(lambda: sub.all_reduce(t, timeout=DEADLINE) if rank == 0
                                   else sub.broadcast(t, 0, timeout=DEADLINE))

    [sub] = enter("stop")  # rank 1 is stopped inside the collective (SIGSTOP), past its own deadline
    if rank == 1:
        # Stop once the progress board (published every 50 ms) shows it started, well before its deadline.
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGSTOP)).start()
        results["stop"] = outcome(lambda: sub.all_reduce(t, timeout=DEADLINE))
    else:
        peer = int(pids[1])
        _wait_stopped(peer)
        results["stop"] = outcome(lambda: sub.all_reduce(t, timeout=DEADLINE))
        # Resume it only once its own deadline (and the doctor's grace) is long past, as a
        # chaos harness releases a hung rank after the survivors reported it.
        started = _logged_ns(Path(root) / "stop" / "rank1.jsonl", "collective.start")
        time.sleep(max(0.0, started / 1e9 + DEADLINE + FROZEN_GRACE_S + 0.3 - time.time()))
        os.kill(peer, signal.SIGCONT)

    [sub] = enter("kill")
    with commlib.context(step=7, phase="optimizer"):
        # Not under test, and rank 1 has just been resumed from SIGSTOP: on 2 loaded cores
        # (another xdist worker spinning collectives) this one took over DEADLINE now and then.
        sub.all_reduce(t, timeout=30.0)
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        results["kill"] = outcome(lambda: sub.all_reduce(t, timeout=DEADLINE))
    return results


def test_every_scenario_of_one_run(tmp_path: Path) -> None:
    """One spawned run; each check reads its scenario's directory (one test, so xdist spawns once)."""
    root = tmp_path / "logs"
    results = run(_scenarios, world_size=2, timeout=240, args=(str(root),), allow_dead_ranks=True,
                  log_dir=root / "init")
    assert results[1] is None, "rank 1 was to be killed in the last scenario"
    _check_timeouts_and_deaths(root, results[0], tmp_path)
    _check_clean_run_cli_json_and_trace(root, tmp_path)
    _check_truncated_last_line_and_unfinished_trace(root, tmp_path)
    # The verdict read from the end of each log is the full read's, on every directory of the run.
    for logdir in [*sorted(root.iterdir()), tmp_path / "live", tmp_path / "restarted", tmp_path / "kill"]:
        same_verdict(logdir)


def _doctor(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "commlib.doctor", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _problems(logdir: Path, kind: Kind) -> list[Any]:
    final = diagnose(logdir).final
    assert final is not None
    return [p for p in final.problems if p.kind is kind]


def _check_timeouts_and_deaths(root: Path, results: dict[str, Any], tmp_path: Path) -> None:
    # (1) a rank skips a collective: the error and the doctor both name it.
    assert results["skip"]["error"] == "CollectiveTimeout" and results["skip"]["missing_ranks"] == [1]
    [timeout] = _problems(root / "skip", Kind.TIMEOUT)
    assert (timeout.ranks, timeout.op, timeout.comm, timeout.seq) == ([1], "all_reduce", "skip", 2)
    assert timeout.details["arrived"] == [0]
    where = timeout.details["where"]["1"]  # at the deadline
    assert (where["last_event"], where["step"], where["phase"]) == ("train.step", 3, "data")
    assert (where["last_finished"]["op"], where["last_finished"]["seq"]) == ("all_reduce", 1)

    # (2) a rank sleeps past the deadline in a pre-hook: same, and it arrived late.
    assert results["prehook"]["error"] == "CollectiveTimeout" and results["prehook"]["missing_ranks"] == [1]
    d = diagnose(root / "prehook")
    assert d.final.culprits == [1]
    [timeout] = [p for p in d.final.problems if p.kind is Kind.TIMEOUT]
    assert timeout.ranks == [1] and timeout.details["late"] == [1] and timeout.op == "all_reduce"

    # A rank stopped (SIGSTOP) inside the collective: everyone arrived, and it is the one that froze.
    assert results["stop"]["error"] == "CollectiveTimeout" and results["stop"]["missing_ranks"] == []
    d = diagnose(root / "stop")
    [timeout] = [p for p in d.final.problems if p.kind is Kind.TIMEOUT and 0 in p.reporters]
    assert (timeout.ranks, timeout.details["arrived"], timeout.details["frozen"]) == ([1], [0, 1], [1])
    assert d.final.culprits == [1]

    # (3) a rank is SIGKILLed: the survivor's PeerFailure; the doctor names the dead rank and its last event.
    assert results["kill"]["error"] == "PeerFailure"
    d = diagnose(root / "kill")
    [peer] = [p for p in d.final.problems if p.kind is Kind.PEER_FAILURE]
    [dead] = [p for p in d.final.problems if p.kind is Kind.DEAD_RANK]
    assert peer.ranks == [1] and peer.reporters == [0] and dead.ranks == [1]
    where = dead.details["where"]
    assert where["last_event"] == "collective.end" and where["step"] == 7 and where["phase"] == "optimizer"
    assert (where["last_finished"]["op"], where["last_finished"]["comm"]) == ("all_reduce", "kill")

    # (5) different ops at one seq with the check off: it timed out, and the doctor still sees the mismatch.
    assert results["mismatch"]["error"] in ("CollectiveTimeout", "CommError", "PeerFailure")
    d = diagnose(root / "mismatch")
    [mismatch] = [p for p in d.final.problems if p.kind is Kind.MISMATCH]
    assert (mismatch.seq, mismatch.ranks, mismatch.comm) == (2, [0, 1], "mismatch")  # 1 vs 1: no majority
    assert "all_reduce" in mismatch.message and "broadcast" in mismatch.message
    assert d.final.status == "failed" and d.exit_code == 1

    # A job still hung, no deadline expired yet: the skip logs as they were before rank 0 timed out.
    d = diagnose(live_copy(root / "skip", tmp_path / "live"))
    [hang] = d.final.problems
    assert (hang.kind, hang.ranks, hang.op, hang.seq, hang.reporters) == (Kind.HANG, [1], "all_reduce", 2, [0])
    assert d.final.status == "incomplete" and d.exit_code == 1
    [dump] = [x for x in d.dumps if x.comm == "skip"]  # the SIGUSR1 dump, taken while rank 0 hung
    assert dump.reason == "sigusr1" and dump.unfinished == [{"comm": "skip", "op": "all_reduce", "seq": 2}]
    assert hang.details["dumps"] == [dump.path] and "alive and still in it" in hang.message

    # torchrun restarts: the killed attempt, then a clean one (attempt 1) appended to the same files.
    restarted = tmp_path / "restarted"
    restarted.mkdir()
    for r in (0, 1):
        again = (root / "clean" / f"rank{r}.jsonl").read_text().replace('"attempt":0}', '"attempt":1}')
        (restarted / f"rank{r}.jsonl").write_text((root / "kill" / f"rank{r}.jsonl").read_text() + again)
    d = diagnose(restarted)
    assert [(a.attempt, a.status, a.culprits) for a in d.attempts] == [(0, "failed", [1]), (1, "ok", [])]
    assert d.exit_code == 3


def _check_clean_run_cli_json_and_trace(root: Path, tmp_path: Path) -> None:
    clean = root / "clean"
    trace_path = tmp_path / "trace.json"
    # Each CLI process imports torch (through commlib): two of them, side by side.
    procs = [_doctor(str(clean), "--json", "--trace", str(trace_path)), _doctor(str(root / "skip"))]
    (json_out, _), (skip_text, _) = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 1]
    assert "[timeout] rank 1:" in skip_text and "all_reduce #2 on 'skip'" in skip_text
    assert main([str(tmp_path / "absent")]) == 2
    assert "No problem found" in render(diagnose(clean))

    found = json.loads(json_out)
    assert found["ok"] and found["exit_code"] == 0
    assert [(a["attempt"], a["status"], a["problems"]) for a in found["attempts"]] == [(0, "ok", [])]
    ops = {(o["op"], o["comm_size"], o["bytes"]): o for o in found["ops"]}
    all_reduce = ops[("all_reduce", 2, 16)]
    assert all_reduce["samples"] == 2 * CLEAN_STEPS  # both ranks' calls
    assert all_reduce["busbw_gbps"] == pytest.approx(all_reduce["algbw_gbps"])  # 2(n-1)/n = 1 for n = 2
    gather = ops[("all_gather_single", 2, 16)]  # S = n * 16 bytes, busbw = algbw * 1/2
    assert gather["algbw_gbps"] == pytest.approx(32 / gather["p50_s"] / 1e9)
    assert gather["busbw_gbps"] == pytest.approx(gather["algbw_gbps"] / 2)
    assert {s["rank"] for s in found["stragglers"]} == {0, 1}
    assert sum(s["last_count"] for s in found["stragglers"]) == 4 * CLEAN_STEPS

    trace = json.loads(trace_path.read_text())
    assert trace["displayTimeUnit"] == "ms"
    events = trace["traceEvents"]
    for e in events:
        assert {"name", "ph", "ts", "pid", "tid"} <= e.keys(), e
        if e["ph"] == "X":
            assert e["dur"] >= 0 and {"seq", "bytes", "step", "phase", "status"} <= e["args"].keys()
    for rank in (0, 1):
        threads = [e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"
                   and e["pid"] == rank]
        assert sorted(threads) == ["ag", "rs"]  # one track per communicator
        [proc] = [e for e in events if e["ph"] == "M" and e["name"] == "process_name" and e["pid"] == rank]
        assert proc["args"]["name"].startswith(f"rank {rank} (")
    assert sum(e["ph"] == "X" for e in events) == 2 * 4 * CLEAN_STEPS


def _check_truncated_last_line_and_unfinished_trace(root: Path, tmp_path: Path) -> None:
    shutil.copytree(root / "kill", tmp_path / "kill")
    with open(tmp_path / "kill" / "rank1.jsonl", "a") as f:
        f.write('{"event":"collective.start","op":"all_reduce","seq":3')  # the writer died mid-line
    d = diagnose(tmp_path / "kill")
    assert d.final.culprits == [1] and d.final.collectives == diagnose(root / "kill").final.collectives

    # A collective a rank never left is drawn up to its last event, marked unfinished.
    trace = build_trace(tmp_path / "live")
    unfinished = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["args"]["status"] == "unfinished"]
    assert [(e["pid"], e["name"], e["args"]["seq"]) for e in unfinished] == [(0, "all_reduce", 2)]


def _mismatch_checked(world: commlib.Communicator) -> dict[str, Any]:
    t = torch.ones(4)
    world.all_reduce(t)
    return outcome(lambda: world.broadcast(t, 0) if world.rank == 2 else world.all_reduce(t))


def test_mismatch_caught_by_consistency_check(tmp_path: Path) -> None:
    results = run(_mismatch_checked, world_size=3, timeout=240, log_dir=tmp_path, check_consistency=True)
    assert [r["error"] for r in results] == ["CollectiveMismatch"] * 3
    assert [r["differing_ranks"] for r in results] == [[2], [2], [0, 1]]
    d = diagnose(tmp_path)
    [mismatch] = d.final.problems
    assert (mismatch.kind, mismatch.ranks, mismatch.seq, mismatch.comm) == (Kind.MISMATCH, [2], 2, "world")
    assert mismatch.details["groups"] == [[0, 1], [2]] and mismatch.details["checked"]
    assert "ranks 0-1 issued all_reduce; rank 2 issued broadcast" in mismatch.message
    assert d.exit_code == 1


def test_backend_failure_outside_commlib_blames_the_rank_that_went_quiet(tmp_path: Path) -> None:
    # What a rank SIGSTOPped inside DCP's checkpoint collectives leaves: both ranks log
    # ckpt.start; rank 1 says nothing more; 10 s later rank 0's gloo call (not a commlib
    # collective) times out and the trainer logs train.error with gloo's text.
    def event(rank: int, t_s: float, name: str, **fields: object) -> str:
        base = {"event": name, "rank": rank, "size": 2, "host": "vm", "pid": 100 + rank, "attempt": 0,
                "level": fields.pop("level", "info"), "ts_ns": int(t_s * 1e9), "mono_ns": int(t_s * 1e9)}
        return json.dumps({**fields, **base}) + "\n"

    for rank in (0, 1):
        lines = [event(rank, 1.0, "comm.init", comm="world", backend="gloo", comm_rank=rank, comm_size=2),
                 event(rank, 2.0, "ckpt.start", step=4, phase="checkpoint")]
        if rank == 0:
            lines.append(event(0, 12.0, "train.error", level="error", error_type="RuntimeError", exit_code=1,
                               error="[gloo/transport/tcp/unbound_buffer.cc:129] Timed out waiting 10000ms "
                                     "for send operation to complete"))
        (tmp_path / f"rank{rank}.jsonl").write_text("".join(lines))

    [attempt] = diagnose(tmp_path).attempts
    assert attempt.status == "failed" and attempt.culprits == [1]
    kinds = {p.kind: p for p in attempt.problems}
    assert kinds[Kind.DEAD_RANK].ranks == [1] and "outside commlib" in kinds[Kind.DEAD_RANK].message
    assert kinds[Kind.ERROR].ranks == [1] and kinds[Kind.ERROR].reporters == [0]


def test_the_straggler_is_the_rank_most_often_last_not_the_one_late_once(tmp_path: Path) -> None:
    # Rank 0 reaches the first collective (the startup barrier) 5 s after rank 1: it compiled
    # longer. From then on rank 1 is 40 ms late at every collective. The pattern is rank 1's,
    # though rank 0's one wait is the larger total: the finding must name rank 1.
    t0, s = 1_000_000_000_000, 1_000_000_000
    for rank in (0, 1):
        fields = {"comm": "world", "comm_rank": rank, "comm_size": 2, "rank": rank, "size": 2, "pid": 100 + rank}
        lines = [{"event": "comm.init", "ts_ns": t0 - 1, **fields}]
        for seq in range(1, 21):
            ts = t0 + (5 * s if rank == 0 else 0) if seq == 1 else t0 + seq * 10 * s + (40_000_000 if rank else 0)
            lines.append({"event": "collective.start", "op": "all_reduce", "seq": seq, "ts_ns": ts, **fields})
        (tmp_path / f"rank{rank}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    [attempt] = diagnose(tmp_path).attempts
    [finding] = [p for p in attempt.problems if p.kind is Kind.STRAGGLER]
    assert (finding.ranks, finding.details["last_count"]) == ([1], 19), finding
