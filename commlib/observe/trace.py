"""Chrome/Perfetto trace export of a run's collectives, built from the log model (`commlib.observe.model`).

Layout (JSON object format, open it in https://ui.perfetto.dev or chrome://tracing):
- one process per rank (pid = global rank, named "rank R (host)"), shared by all torchrun
  attempts: attempts follow each other in time on the same tracks, and an instant event
  "attempt N" marks where each begins (every event's args carry its attempt too);
- one thread (track) per communicator (tid stable across ranks, named after the
  communicator), so FSDP's all-gather and reduce-scatter communicators are separate tracks;
- a complete event ("X") per collective: name = op, ts/dur in microseconds, args = seq,
  bytes, step, phase, status, attempt; a collective never finished is drawn up to the rank's
  last event with status "unfinished";
- send/recv likewise, on their communicator's track, named "send -> R" / "recv <- R" (R the
  peer's global rank; args.seq is the pair's own count), and a flow arrow from each send to
  the recv it matched;
- instant events ("i") for timeouts, peer failures, errors, mismatches, aborts, and any
  other event logged at warning level or above (chaos faults, for instance).

Timestamps are microseconds since the run's first event (wall clock, `ts_ns`); the origin
is in `otherData.origin_ts_ns`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from commlib.observe.model import NOTICE_EVENTS, RunLogs

# Fields every event carries: the track already says them.
_COMMON_FIELDS = ("event", "level", "ts_ns", "mono_ns", "rank", "size", "host", "pid", "backend", "comm_rank",
                  "comm_size", "label")


def build_trace(run: RunLogs) -> dict[str, Any]:
    """The trace of `run` as a JSON-serializable dict."""
    atts = list(run.attempts.values())
    starts = [rl.first_ns for att in atts for rl in att.ranks.values()]
    origin = min(starts) if starts else 0

    def us(ts_ns: int) -> float:
        return (ts_ns - origin) / 1e3

    # A communicator keeps its track across ranks and attempts; order tracks by first use
    # (of a collective or a send/recv: a communicator may carry only point-to-point traffic).
    first_use: dict[str, int] = {}
    for att in atts:
        for rl in att.ranks.values():
            for c in rl.calls:
                if c.start_ns is not None:
                    first_use[c.comm] = min(first_use.get(c.comm, c.start_ns), c.start_ns)
    tids = {label: i + 1 for i, label in enumerate(sorted(first_use, key=lambda k: (first_use[k], k)))}

    events: list[dict[str, Any]] = []
    hosts: dict[int, list[str]] = {}
    tracks: set[tuple[int, int]] = set()
    for att in atts:
        for rank, rl in sorted(att.ranks.items()):
            if rl.host and rl.host not in hosts.setdefault(rank, []):
                hosts[rank].append(rl.host)
            events.append({"name": f"attempt {att.attempt}", "ph": "i", "s": "p", "ts": us(rl.first_ns),
                           "pid": rank, "tid": 0, "args": {"attempt": att.attempt, "pid": rl.pid}})
            for c in rl.calls:
                if c.start_ns is None:
                    continue
                if c.status == "started":
                    status, dur_us = "unfinished", (max(rl.last_ns, c.start_ns) - c.start_ns) / 1e3
                elif c.duration_s is not None:  # monotonic: finer than the difference of wall clocks
                    status, dur_us = c.status, c.duration_s * 1e6
                else:
                    status, dur_us = c.status, ((c.end_ns or c.start_ns) - c.start_ns) / 1e3
                tid = tids[c.comm]
                tracks.add((rank, tid))
                args = {"seq": c.seq, "bytes": c.bytes, "step": c.step, "phase": c.phase,
                        "status": status, "attempt": att.attempt, "comm": c.comm}
                name, cat = c.op, "collective"
                if c.peer is not None:
                    peer = att.comms[c.comm].global_rank(c.peer)
                    name, cat = f"{c.op} {'->' if c.op == 'send' else '<-'} {peer}", "p2p"
                    args["peer"] = peer
                events.append({"name": name, "cat": cat, "ph": "X", "ts": us(c.start_ns), "dur": dur_us,
                               "pid": rank, "tid": tid, "args": args})
    events += _flows(run, us, tids)
    events += _instants(run, us, tids, tracks)
    meta: list[dict[str, Any]] = []
    for rank, names in sorted(hosts.items()):
        meta.append({"name": "process_name", "ph": "M", "ts": 0, "pid": rank, "tid": 0,
                     "args": {"name": f"rank {rank} ({', '.join(names)})"}})
        meta.append({"name": "process_sort_index", "ph": "M", "ts": 0, "pid": rank, "tid": 0,
                     "args": {"sort_index": rank}})
    labels = {tid: label for label, tid in tids.items()}
    for rank, tid in sorted(tracks):
        meta.append({"name": "thread_name", "ph": "M", "ts": 0, "pid": rank, "tid": tid,
                     "args": {"name": labels[tid]}})
        meta.append({"name": "thread_sort_index", "ph": "M", "ts": 0, "pid": rank, "tid": tid,
                     "args": {"sort_index": tid}})
    return {"traceEvents": meta + events, "displayTimeUnit": "ms",
            "otherData": {"origin_ts_ns": origin, "logdir": run.logdir}}


def _flows(run: RunLogs, us: Any, tids: dict[str, int]) -> list[dict[str, Any]]:
    """An arrow from each send to the recv it matched (same pair, same pair seq)."""
    out: list[dict[str, Any]] = []
    for att in run.attempts.values():
        for comm in att.comms.values():
            for (_, _, seq), calls in sorted(comm.pairs().items()):
                sends = [c for c in calls.values() if c.op == "send" and c.start_ns is not None]
                recvs = [c for c in calls.values() if c.op == "recv" and c.start_ns is not None]
                if len(sends) != 1 or len(recvs) != 1:
                    continue
                send, recv = sends[0], recvs[0]
                flow = {"name": "p2p", "cat": "p2p", "id": len(out) // 2 + 1, "tid": tids[comm.label],
                        "args": {"seq": seq, "attempt": att.attempt}}
                # The arrow ends just inside the end of the recv's slice (at its start if it never ended).
                if recv.duration_s is not None:
                    end_ns = recv.start_ns + int(recv.duration_s * 1e9)
                else:
                    end_ns = recv.end_ns if recv.end_ns is not None else recv.start_ns
                out.append({**flow, "ph": "s", "ts": us(send.start_ns), "pid": send.rank})
                out.append({**flow, "ph": "f", "bp": "e", "ts": us(max(end_ns - 1000, recv.start_ns)),
                            "pid": recv.rank})
    return out


def _instants(run: RunLogs, us: Any, tids: dict[str, int], tracks: set[tuple[int, int]]) -> list[dict[str, Any]]:
    """Failures on their communicator's track; other notices on the rank's process track."""
    out = []
    for att in run.attempts.values():
        for rank, rl in sorted(att.ranks.items()):
            for e in rl.notices:
                name = e.get("event")
                tid = tids.get(e["label"], 0) if name in NOTICE_EVENTS else 0
                if tid:
                    tracks.add((rank, tid))
                args = {k: v for k, v in e.items() if k not in _COMMON_FIELDS}
                out.append({"name": name, "cat": "failure" if name in NOTICE_EVENTS else "event", "ph": "i",
                            "s": "t" if tid else "p", "ts": us(e["ts_ns"]), "pid": rank, "tid": tid, "args": args})
    return out


def write_trace(run: RunLogs, path: str | os.PathLike[str]) -> Path:
    """Write `run`'s trace to `path` (JSON) and return the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(build_trace(run), default=str))
    return out
