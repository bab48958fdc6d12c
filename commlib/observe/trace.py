"""Chrome/Perfetto trace export of a run's collectives, written as the log model reads the logs.

Layout (JSON object format, open it in https://ui.perfetto.dev or chrome://tracing):
- one process per rank (pid = global rank, named "rank R (host)"), shared by all torchrun
  attempts: attempts follow each other in time on the same tracks, and an instant event
  "attempt N" marks where each begins (every event's args carry its attempt too);
- one thread (track) per communicator (tid stable across ranks, named after the
  communicator, sorted by first use), so FSDP's all-gather and reduce-scatter
  communicators are separate tracks;
- a complete event ("X") per collective: name = op, ts/dur in microseconds, args = seq,
  bytes, step, phase, status, attempt; a collective never finished is drawn up to the rank's
  last event with status "unfinished";
- send/recv likewise, on their communicator's track, named "send -> R" / "recv <- R" (R the
  peer's global rank; args.seq is the pair's own count of its tag), a tagged one with
  " (tag N)" after it and args.tag, and a flow arrow from each send to the recv it matched;
- instant events ("i") for timeouts, peer failures, errors, mismatches, aborts, and any
  other event logged at warning level or above (chaos faults, for instance).

Timestamps are microseconds since the run's first event (wall clock, `ts_ns`); the origin
is in `otherData.origin_ts_ns`.

Streaming: `TraceWriter` is an observer of the model's one pass (`commlib.observe.run_logs`):
each event goes to the file once it is final, and the names of processes and tracks at
the end, so the trace of any log size takes the memory of the model alone. `TraceFile`
checks where the trace goes before anything is read, writes it beside its destination and
moves it there only once whole, and never in place of what is not a regular file.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import stat
import tempfile
from pathlib import Path
from typing import IO, Any

from commlib.observe.records import NOTICE_EVENTS, AttemptLog, Call, CommLog, Observer, tag_text
from commlib.observe.run_logs import RunLogs, load
from commlib.record.codec import encode
from commlib.record.files import kind

# Fields every event carries: the track already says them.
_COMMON_FIELDS = (
    "event",
    "level",
    "ts_ns",
    "mono_ns",
    "rank",
    "size",
    "host",
    "pid",
    "backend",
    "comm_rank",
    "comm_size",
    "label",
    "job",
)


class TracePathError(ValueError):
    """The trace cannot be written where it was asked to go."""


class TraceWriter(Observer):
    """Writes a run's trace into `out` as the model's pass goes (module docstring); `finish` ends it."""

    def __init__(self, out: IO[bytes]) -> None:
        self.out = out
        self.origin: int | None = None
        self._written = 0
        self._tids: dict[str, int] = {}  # communicator label -> track, in order of first sight
        self._first_use: dict[str, int] = {}  # label -> its first call's start: the tracks' order
        self._tracks: set[tuple[int, int]] = set()
        self._flows = 0
        self.out.write(b'{"traceEvents":[')

    def _emit(self, event: dict[str, Any]) -> None:
        self.out.write(b"," + encode(event) if self._written else encode(event))
        self._written += 1

    def _us(self, ts_ns: int) -> float:
        return (ts_ns - (self.origin or 0)) / 1e3

    def begin(self, ts_ns: int) -> None:
        self.origin = ts_ns

    def _tid(self, label: str, start_ns: int | None) -> int:
        tid = self._tids.get(label)
        if tid is None:
            tid = self._tids[label] = len(self._tids) + 1
        if start_ns is not None and start_ns < self._first_use.get(label, start_ns + 1):
            self._first_use[label] = start_ns
        return tid

    def call(self, att: AttemptLog, c: Call) -> None:
        if c.start_ns is None:
            return
        if c.status == "started":
            rl = att.ranks[c.rank]
            status, dur_us = "unfinished", (max(rl.last_ns, c.start_ns) - c.start_ns) / 1e3
        elif c.duration_s is not None:  # monotonic: finer than the difference of wall clocks
            status, dur_us = c.status, c.duration_s * 1e6
        else:
            status, dur_us = c.status, ((c.end_ns or c.start_ns) - c.start_ns) / 1e3
        tid = self._tid(c.comm, c.start_ns)
        self._tracks.add((c.rank, tid))
        args = {
            "seq": c.seq,
            "bytes": c.bytes,
            "step": c.step,
            "phase": c.phase,
            "status": status,
            "attempt": att.attempt,
            "comm": c.comm,
        }
        name, cat = c.op, "collective"
        if c.peer is not None:
            peer, tag = att.comms[c.comm].global_rank(c.peer), c.tag
            name, cat = f"{c.op} {'->' if c.op == 'send' else '<-'} {peer}{tag_text(tag)}", "p2p"
            args["peer"] = peer
            if tag:
                args["tag"] = tag
        self._emit(
            {
                "name": name,
                "cat": cat,
                "ph": "X",
                "ts": self._us(c.start_ns),
                "dur": dur_us,
                "pid": c.rank,
                "tid": tid,
                "args": args,
            }
        )

    def pair(self, att: AttemptLog, comm: CommLog, seq: int, send: Call, recv: Call) -> None:
        """An arrow from the send to the recv it matched, ending just inside the recv's slice."""
        assert send.start_ns is not None and recv.start_ns is not None
        self._flows += 1
        flow = {
            "name": "p2p",
            "cat": "p2p",
            "id": self._flows,
            "tid": self._tid(comm.label, None),
            "args": {"seq": seq, "attempt": att.attempt, **({"tag": send.tag} if send.tag else {})},
        }
        if recv.duration_s is not None:
            end_ns = recv.start_ns + int(recv.duration_s * 1e9)
        else:
            end_ns = recv.end_ns if recv.end_ns is not None else recv.start_ns
        self._emit({**flow, "ph": "s", "ts": self._us(send.start_ns), "pid": send.rank})
        self._emit({**flow, "ph": "f", "bp": "e", "ts": self._us(max(end_ns - 1000, recv.start_ns)), "pid": recv.rank})

    def notice(self, att: AttemptLog, e: dict[str, Any], label: str | None) -> None:
        """Failures on their communicator's track; other notices on the rank's process track."""
        name = e.get("event")
        tid = self._tids.get(label, 0) if name in NOTICE_EVENTS and label is not None else 0
        rank = e.get("rank")
        if tid:
            self._tracks.add((rank, tid))  # type: ignore[arg-type]
        args = {k: v for k, v in e.items() if k not in _COMMON_FIELDS}
        self._emit(
            {
                "name": name,
                "cat": "failure" if name in NOTICE_EVENTS else "event",
                "ph": "i",
                "s": "t" if tid else "p",
                "ts": self._us(e["ts_ns"]),
                "pid": rank,
                "tid": tid,
                "args": args,
            }
        )

    def finish(self, run: RunLogs) -> None:
        """The attempts' marks, the processes' and tracks' names, and the end of the JSON."""
        hosts: dict[int, list[str]] = {}
        for att in run.attempts.values():
            for rank, rl in sorted(att.ranks.items()):
                if rl.host and rl.host not in hosts.setdefault(rank, []):
                    hosts[rank].append(rl.host)
                self._emit(
                    {
                        "name": f"attempt {att.attempt}",
                        "ph": "i",
                        "s": "p",
                        "ts": self._us(rl.first_ns),
                        "pid": rank,
                        "tid": 0,
                        "args": {"attempt": att.attempt, "pid": rl.pid},
                    }
                )
        for rank, names in sorted(hosts.items()):
            self._emit(
                {
                    "name": "process_name",
                    "ph": "M",
                    "ts": 0,
                    "pid": rank,
                    "tid": 0,
                    "args": {"name": f"rank {rank} ({', '.join(names)})"},
                }
            )
            self._emit(
                {"name": "process_sort_index", "ph": "M", "ts": 0, "pid": rank, "tid": 0, "args": {"sort_index": rank}}
            )
        order = {
            label: i + 1
            for i, label in enumerate(sorted(self._tids, key=lambda k: (self._first_use.get(k, float("inf")), k)))
        }
        labels = {tid: label for label, tid in self._tids.items()}
        for rank, tid in sorted(self._tracks):
            self._emit(
                {"name": "thread_name", "ph": "M", "ts": 0, "pid": rank, "tid": tid, "args": {"name": labels[tid]}}
            )
            self._emit(
                {
                    "name": "thread_sort_index",
                    "ph": "M",
                    "ts": 0,
                    "pid": rank,
                    "tid": tid,
                    "args": {"sort_index": order[labels[tid]]},
                }
            )
        self.out.write(
            b'],"displayTimeUnit":"ms","otherData":'
            + json.dumps({"origin_ts_ns": self.origin or 0, "logdir": run.logdir}).encode()
            + b"}"
        )


class TraceFile:
    """Where a trace goes: checked at once (`TracePathError`, saying why), written beside it, and
    moved there by `commit` only once whole; `discard` leaves nothing behind, not even the
    directories made for it.

    Only a regular file, or a new one, is written: a name that holds a FIFO, a device, a socket
    (or a symlink to one: /dev/stdout, /proc/self/fd/1) is refused, never replaced by a file. A
    symlink to a regular file is written through: its target is replaced, the link kept.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        if not os.fspath(path):
            raise TracePathError("--trace '': expected a file to write; found an empty path")
        self.path = Path(path)
        self.target = self._target()
        self._made: list[Path] = []  # directories made for the trace, outermost first
        try:
            for parent in reversed(self.target.parents):
                if not parent.exists():
                    parent.mkdir()
                    self._made.append(parent)
            fd, tmp = tempfile.mkstemp(prefix=f".{self.target.name}.", suffix=".tmp", dir=self.target.parent)
            self._tmp = Path(tmp)
        except OSError as exc:
            self._remove_made()
            raise TracePathError(
                f"--trace {self.path}: expected a file that can be written; found "
                f"{type(exc).__name__}: {exc.strerror or exc}"
            ) from None
        os.fchmod(fd, 0o644)
        self.writer = TraceWriter(os.fdopen(fd, "wb"))

    def _target(self) -> Path:
        """The file the trace replaces: the path, or the regular file it links to."""
        above = next((p for p in self.path.parents if p.exists()), None)
        if above is not None and not above.is_dir():
            raise TracePathError(f"--trace {self.path}: expected a file in a directory; found {above} is a file")
        try:
            mode = os.stat(self.path).st_mode  # through symlinks
        except FileNotFoundError:
            if self.path.is_symlink():
                raise TracePathError(
                    f"--trace {self.path}: expected a file to write; found a symlink to "
                    f"{os.readlink(self.path)}, which does not exist"
                ) from None
            mode = None
        except OSError as exc:
            raise TracePathError(
                f"--trace {self.path}: expected a file that can be written; found "
                f"{type(exc).__name__}: {exc.strerror or exc}"
            ) from None
        if mode is not None and not stat.S_ISREG(mode):
            link = f"a symlink to {os.path.realpath(self.path)}, " if self.path.is_symlink() else ""
            raise TracePathError(
                f"--trace {self.path}: expected a regular file to write (or a new one); found {link}{kind(mode)}"
            )
        return Path(os.path.realpath(self.path)) if mode is not None else self.path

    def commit(self, run: RunLogs) -> Path:
        self.writer.finish(run)
        self.writer.out.close()
        try:
            self._target()  # what is there now, once more: never replace what is not a regular file
            os.replace(self._tmp, self.target)
        except BaseException:
            self.discard()
            raise
        return self.path

    def discard(self) -> None:
        self.writer.out.close()
        self._tmp.unlink(missing_ok=True)
        self._remove_made()

    def _remove_made(self) -> None:
        for directory in reversed(self._made):
            with contextlib.suppress(OSError):  # not empty: something else was put there meanwhile
                directory.rmdir()
        self._made = []


def build_trace(logdir: str | os.PathLike[str], job: str | None = None) -> dict[str, Any]:
    """The trace of `logdir` as a JSON-serializable dict (for logs of a size that fits in memory)."""
    out = io.BytesIO()
    writer = TraceWriter(out)
    writer.finish(load(logdir, job=job, observers=[writer]))
    return json.loads(out.getvalue())
