"""fsdp_overlap.timeline: exact interval math on synthetic events, and real logs of a sharded run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import commlib
from commlib import testing
from commlib.observe.events import read_events
from fsdp_overlap import timeline
from fsdp_overlap.shard import shard

MS = 1_000_000  # ns


def _collective(comm: str, seq: int, op: str, start_ms: float, end_ms: float, *, step: int | None = 0,
                async_op: bool = False, wait_ms: float | None = None, done_before_wait: bool = False,
                label: str | None = "dual", rank: int = 0, pid: int = 100) -> list[dict]:
    ctx = {k: v for k, v in (("step", step), ("label", label)) if v is not None}
    base = {"rank": rank, "pid": pid, "attempt": 0, "comm": comm, "seq": seq, "op": op, **ctx}
    wait = {} if wait_ms is None else {"wait_s": wait_ms / 1e3, "done_before_wait": done_before_wait}
    return [{**base, "event": "collective.start", "ts_ns": int(start_ms * MS), "mono_ns": int(start_ms * MS),
             "async_op": async_op},
            {**base, "event": "collective.end", "ts_ns": int(end_ms * MS), "mono_ns": int(end_ms * MS),
             "duration_s": (end_ms - start_ms) / 1e3, "status": "ok", **wait}]


def _one_step(done_before_wait: bool = False, **kw: object) -> list[dict]:
    """Step 0: an async all-gather waited 10 ms, reduce-scatters on a second communicator, an all-reduce."""
    return [
        *_collective("world", 1, "all_gather_single", 0, 100, async_op=True, wait_ms=10,
                     done_before_wait=done_before_wait, **kw),
        *_collective("world.reduce_scatter", 1, "reduce_scatter_single", 50, 80, **kw),
        *_collective("world", 2, "all_gather_single", 120, 150, **kw),
        *_collective("world.reduce_scatter", 2, "reduce_scatter_single", 140, 170, **kw),
        *_collective("world", 3, "all_reduce", 200, 210, **kw),
    ]


def test_interval_math() -> None:
    assert timeline.union([(5, 7), (0, 2), (1, 3), (7, 8)]) == [(0, 3), (5, 8)]
    assert timeline.intersect([(0, 3), (5, 8)], [(2, 6), (7, 9)]) == [(2, 3), (5, 6), (7, 8)]
    assert timeline.intersect([(0, 1)], [(1, 2)]) == []
    assert timeline.length([(0, 3), (5, 8)]) == 6


def test_synthetic_step_exact() -> None:
    [t] = timeline.timelines(timeline.records_from_events(_one_step()))
    assert (t.rank, t.step, t.label, t.collectives) == (0, 0, "dual", 5)
    assert t.all_gather_s == pytest.approx(0.130)  # [0,100] + [120,150]
    assert t.reduce_scatter_s == pytest.approx(0.060)  # [50,80] + [140,170]
    assert t.overlap_s == t.overlap_min_s == pytest.approx(0.040)  # [50,80] + [140,150]
    assert t.overlap_fraction == pytest.approx(40 / 60)
    assert t.comm_s == pytest.approx(0.160)  # [0,100] + [120,170] + [200,210]
    # blocked: the async all-gather's wait [90,100], and every sync op: [50,80] [120,170] [200,210]
    assert t.exposed_s == pytest.approx(0.100)
    assert not t.exposed_upper_bound
    # Had the async all-gather finished before its wait began, its flight would be uncertain:
    # only the sync all-gather's overlap [140,150] is sure; the rest is unchanged.
    [u] = timeline.timelines(timeline.records_from_events(_one_step(done_before_wait=True)))
    assert (u.overlap_s, u.overlap_min_s) == (pytest.approx(0.040), pytest.approx(0.010))
    assert u.exposed_s == t.exposed_s and not u.exposed_upper_bound


def test_grouping_and_unwaited_async() -> None:
    events = [
        *_one_step(),
        *_one_step(label="single", pid=101),
        *_collective("world", 9, "barrier", 300, 400, step=None),  # outside any step: ignored
        # step 1: an async op never waited through FSDPWork counts whole, flagged as an upper bound
        *_collective("world", 4, "all_gather_single", 0, 40, step=1, async_op=True),
        *_collective("world", 5, "reduce_scatter_single", 30, 50, step=1),
        {"event": "collective.start", "rank": 0, "pid": 100, "comm": "world", "seq": 6, "op": "all_reduce",
         "ts_ns": 0, "mono_ns": 0, "step": 1, "async_op": False},  # started, never ended: not counted
    ]
    steps = timeline.timelines(timeline.records_from_events(events))
    assert [(t.label, t.step) for t in steps] == [("dual", 0), ("dual", 1), ("single", 0)]
    step1 = steps[1]
    assert (step1.collectives, step1.exposed_upper_bound) == (2, True)
    assert (step1.overlap_s, step1.overlap_min_s) == (pytest.approx(0.010), 0)
    assert step1.exposed_s == pytest.approx(0.050)
    [dual, single] = timeline.summarize(steps)
    assert (dual.label, dual.steps, single.label, single.steps) == ("dual", 2, "single", 1)
    assert dual.overlap_fraction == pytest.approx((40 + 10) / (60 + 20))
    assert dual.exposed_upper_bound and not single.exposed_upper_bound


def test_analyze_files_and_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "rank0.jsonl").write_text("".join(json.dumps(e) + "\n" for e in _one_step()) + '{"event": "trunc')
    (logs / "rank1.jsonl").write_text("".join(json.dumps(e) + "\n" for e in _one_step(rank=1, pid=200)))
    steps = timeline.analyze(logs)
    assert [(t.rank, t.exposed_s) for t in steps] == [(0, pytest.approx(0.1)), (1, pytest.approx(0.1))]
    assert timeline.main([str(logs)]) == 0
    out = capsys.readouterr().out
    assert "overlap=40.00 ms (at least 40.00 ms; 67% of RS) exposed=100.00 ms" in out
    assert timeline.main([str(logs), "--json"]) == 0
    assert [json.loads(line)["overlap_fraction"] for line in capsys.readouterr().out.splitlines()] == \
        [pytest.approx(2 / 3)] * 2

    # Flight-recorder dumps (no log files): same intervals, no wait times, so an upper bound.
    flight = tmp_path / "flight"
    flight.mkdir()
    for comm in ("world", "world.reduce_scatter"):
        events = _one_step()
        entries = [{"seq": e["seq"], "op": e["op"], "async_op": e["async_op"], "state": "completed",
                    "start_mono_ns": e["mono_ns"], "end_mono_ns": end["mono_ns"], "step": 0}
                   for e, end in zip(events, events[1:])
                   if e["event"] == "collective.start" and end["event"] == "collective.end" and e["comm"] == comm]
        dump = {"kind": "commlib.flight_recorder", "comm": comm, "rank": 0, "pid": 7, "entries": entries}
        for n in (1, 2):  # two dumps of the same ring: entries counted once
            (flight / f"flight_rank0_{comm}_7_{n}_test.json").write_text(json.dumps(dump))
    [t] = timeline.analyze(flight)
    assert (t.collectives, t.all_gather_s, t.reduce_scatter_s, t.overlap_s, t.overlap_min_s) == \
        (5, pytest.approx(0.13), pytest.approx(0.06), pytest.approx(0.04), pytest.approx(0.01))
    assert t.exposed_upper_bound and t.exposed_s == pytest.approx(0.16)  # [0,100] + [120,170] + [200,210]

    with pytest.raises(FileNotFoundError, match="neither"):
        timeline.analyze(tmp_path)
    with pytest.raises(FileNotFoundError, match="no directory"):
        timeline.analyze(tmp_path / "missing")


# -- real logs ------------------------------------------------------------------------------
class _Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(4))
        self.head = nn.Linear(64, 1)  # the root's own parameters

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x).square().mean()


def _logged_run(comm: commlib.Communicator, steps: int) -> None:
    model = _Chain()
    shard(model, comm, mode="dual", prefetch=1)
    for step in range(steps):
        with commlib.context(step=step, label="dual"):
            model(torch.randn(16, 64)).backward()
    comm.barrier()  # outside any step: the timeline ignores it


def test_real_logs(tmp_path: Path) -> None:
    steps = 2
    testing.run(_logged_run, 2, timeout=120, args=(steps,), log_dir=str(tmp_path))
    result = timeline.analyze(tmp_path)
    assert [(t.label, t.rank, t.step) for t in result] == [("dual", r, s) for r in range(2) for s in range(steps)]
    for t in result:
        assert t.all_gather_s > 0 and t.reduce_scatter_s > 0
        assert 0 <= t.overlap_min_s <= t.overlap_s <= min(t.all_gather_s, t.reduce_scatter_s)
        assert t.exposed_s <= t.comm_s + 1e-9
        assert not t.exposed_upper_bound  # every async all-gather was waited through FSDPWork
        # all-gathers: the root and 4 blocks in forward, the 4 blocks again in backward; 5 reduce-scatters
        assert t.collectives == 9 + 5
    rs_comms = {e["comm"] for e in read_events(tmp_path / "rank0.jsonl")
                if e.get("op") == "reduce_scatter_single"}
    assert rs_comms == {"world.reduce_scatter"}
