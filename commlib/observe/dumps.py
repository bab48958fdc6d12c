"""What the processes left beside their logs, read into the log model: flight-recorder dumps and stacks.

`flight_dumps(directory)` finds the `flight_rank*.json` dumps (`commlib.record.flight`)
and `dump_calls` reads one's entries as calls. `add_dump(builder, path, data)` attributes a
dump to the process that wrote it (by its host and pid, which the dump names with its attempt and
communicator rank) and adds to the model the entries its log lacks (a log cut short by a kill); a call its
log has gets the dump's call stack. `add_stacks(builder, directory)` gives each rank the main
thread's innermost frames of its faulthandler stacks (`stacks_{host}_{pid}.txt`,
`commlib.observe.stacks`), which its position shows when no flight-recorder stack says
where it was.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from commlib.observe.builder import ModelBuilder, find_call
from commlib.observe.records import Call, CommLog, DumpInfo, peer_of, tag_of
from commlib.observe.stacks import read_main_stacks
from commlib.record.files import open_regular, safe_host

FLIGHT_DUMP_KIND = "commlib.flight_recorder"


def flight_dumps(
    directory: str | os.PathLike[str], skipped: list[tuple[str, str]] | None = None
) -> list[tuple[Path, dict[str, Any]]]:
    """Every flight-recorder dump (`flight_rank*.json`) of `directory` that reads as one, with its
    path; (path, why) of each that could not be read goes into `skipped`."""
    out = []
    for path in sorted(Path(directory).glob("flight_rank*.json")):
        try:
            with os.fdopen(open_regular(path), "rb") as f:
                data = json.loads(f.read())
        except OSError as exc:  # a FIFO or a device among them is named, never waited on
            if skipped is not None:
                skipped.append((str(path), f"{type(exc).__name__}: {exc.strerror or exc}"))
            continue
        except ValueError:
            if skipped is not None:
                skipped.append((str(path), "not JSON"))
            continue
        if isinstance(data, dict) and data.get("kind") == FLIGHT_DUMP_KIND:
            out.append((path, data))
    return out


def dump_calls(data: dict[str, Any]) -> list[Call]:
    """The entries of one flight-recorder dump as calls, as the dump names them: `rank` is the
    communicator rank, `comm` its name, `source` "flight"."""
    status: dict[Any, str] = {"completed": "ok", "started": "started"}  # looked up by the dump's own values
    calls = []
    for x in data.get("entries") or []:
        if not isinstance(x, dict) or not isinstance(x.get("seq"), int):
            continue
        peer = peer_of(x)
        end, start_mono = x.get("end_mono_ns"), x.get("start_mono_ns")
        duration = (end - start_mono) / 1e9 if end and start_mono else None
        call = Call.of(
            data.get("rank", -1),
            str(data.get("comm")),
            x["seq"],
            str(x.get("op")),
            x.get("start_ns"),
            peer=peer,
            status=status.get(x.get("state")) or x.get("state") or "started",
            source="flight",
            bytes=x.get("nbytes"),
            shapes=x.get("shapes"),
            dtype=x.get("dtype"),
            root=x.get("root"),
            step=x.get("step"),
            phase=x.get("phase"),
            duration_s=duration,
            stack=x.get("stack") or None,
            pid=data.get("pid"),
            start_mono_ns=start_mono,
            end_mono_ns=end,
            async_op=x.get("async_op"),
            tag=tag_of(x),
        )
        if duration is not None and call.start_ns is not None:
            call.end_ns = call.start_ns + int(duration * 1e9)
        calls.append(call)
    return calls


def _dump_owner(builder: ModelBuilder, data: dict[str, Any]) -> tuple[int, int] | None:
    """(attempt, global rank) of the process that wrote a dump, which names its host, pid, attempt
    and communicator rank: pids repeat across hosts, and a host may reuse one (a restarted
    container), so the process is its (host, pid), then the one of the dump's attempt, then the
    one whose communicator has the dump's rank."""
    comm_rank: Any
    host, pid, comm_name, comm_rank = data.get("host"), data.get("pid"), str(data.get("comm")), data.get("rank")
    if not isinstance(pid, int):
        return None
    if host is None:  # a dump that does not say its host: any host's process with that pid
        candidates = {c for (h, p), cs in builder.pids.items() if p == pid for c in cs}
    else:
        candidates = set(builder.pids.get((host, pid), ()))
    if len(candidates) > 1 and isinstance(data.get("attempt"), int):
        candidates = {(a, r) for a, r in candidates if a == data["attempt"]}
    if len(candidates) > 1:
        candidates = {
            (a, r)
            for a, r in candidates
            if (c := builder.attempts[a].comms.get(builder.label(a, r, comm_name))) is not None
            and c.members.get(comm_rank) == r
        }
    return next(iter(candidates)) if len(candidates) == 1 else None


def add_dump(builder: ModelBuilder, path: Path, data: dict[str, Any]) -> DumpInfo:
    """Record a dump, and add its entries that the logs lack (a log that was cut short)."""
    comm_name = str(data.get("comm"))
    where = _dump_owner(builder, data)
    dumped = dump_calls(data)
    info = DumpInfo(
        path=str(path),
        rank=data.get("rank", -1),
        comm=comm_name,
        attempt=where[0] if where else None,
        reason=str(data.get("reason")),
        dumped_ns=data.get("dumped_ns"),
        entries=sum(1 for x in data.get("entries") or [] if isinstance(x, dict)),
        unfinished=[
            {
                "comm": comm_name,
                "op": c.op,
                "seq": c.seq,
                **({"peer": c.peer} if c.peer is not None else {}),
                **({"tag": c.tag} if c.tag else {}),
            }
            for c in dumped
            if c.status == "started"
        ],
        host=data.get("host") if isinstance(data.get("host"), str) else None,
        pid=data.get("pid") if isinstance(data.get("pid"), int) else None,
    )
    if where is None:
        return info
    attempt, rank = where
    info.rank = rank
    att = builder.attempts[attempt]
    comm = att.comms.get(builder.label(attempt, rank, comm_name))
    if comm is None:
        return info
    for u in info.unfinished:  # the entries name the peer by its rank in the communicator
        if "peer" in u:
            u["peer"] = comm.global_rank(u["peer"])
    rl = att.ranks[rank]
    comm_rank = data.get("rank")
    for d in dumped:
        call = find_call(comm, rank, d.seq, d.peer, d.tag)
        if call is None:
            same = (comm.label, d.seq, d.peer, d.tag)
            for known in (rl.last_started, rl.last_finished):
                if known is not None and (known.comm, known.seq, known.peer, known.tag) == same:
                    call = known
        if call is None and not _logged(comm, rank, d):
            d.rank, d.comm = rank, comm.label
            builder.place(att, comm, d, comm_rank)
            rl.last_started, rl.last_finished = _later(rl.last_started, rl.last_finished, d, None)
            for t, snapshot in att.snapshots.items():  # where the rank was then, had its log had it
                place = snapshot.get(rank)
                if place is not None:
                    snapshot[rank] = (*place[:4], *_later(place[4], place[5], d, t))
        elif call is not None and d.stack and call.stack is None:
            call.stack = d.stack
    return info


def _later(
    started: Call | None, finished: Call | None, call: Call, at_ns: int | None
) -> tuple[Call | None, Call | None]:
    """(last started, last finished) by `at_ns` (None: ever) once `call` is counted too."""
    start = call.start_ns or 0
    if at_ns is None or start <= at_ns:
        if started is None or (started.start_ns or 0) < start:
            started = call
        end = call.end_ns or 0
        if (
            call.status == "ok"
            and (at_ns is None or end <= at_ns)
            and (finished is None or (finished.end_ns or 0) < end)
        ):
            finished = call
    return started, finished


def _logged(comm: CommLog, rank: int, call: Call) -> bool:
    """Whether `rank`'s log reaches `call` (of a dump): a dump adds to a log only what comes
    after its end (a log cut short), not what a rotation took from its start."""
    key = rank if call.peer is None else (rank, call.peer, call.tag)
    return call.seq <= comm.logged.get(key, 0)


def add_stacks(builder: ModelBuilder, directory: Path, skipped: list[tuple[str, str]] | None = None) -> None:
    """Each rank's main-thread stack from the last faulthandler dump of its process, where there
    is one; (path, why) of each stacks file that could not be read goes into `skipped`."""
    stacks = read_main_stacks(directory, skipped)
    for att in builder.attempts.values():
        for rl in att.ranks.values():
            # A file named by pid alone (written before files named their host) is any host's.
            pid = rl.pid
            frames = (stacks.get((safe_host(rl.host), pid)) or stacks.get((None, pid))) if pid is not None else None
            if frames:
                rl.signal_stack = [f.traceback_line() for f in reversed(frames)]
