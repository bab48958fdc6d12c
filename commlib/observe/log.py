"""Structured logs: structlog, JSON lines, one file per rank, and the caller's context.

Configured once per process by `commlib.init` (or `configure` directly):
- with a log dir (`init(log_dir=...)` or `COMMLIB_LOG_DIR`), every event at INFO and above
  goes to `{log_dir}/rank{R}.jsonl`;
- without one, only warnings and errors go to stderr.

Each line is written with a single `os.write` on an `O_APPEND` descriptor, so a process
killed mid-write leaves at most one truncated last line, and ranks restarted by torchrun
append to the same file. `read_events` (a whole file) and `LogTail` (a live log dir) are
the readers of these files; both skip a truncated line instead of failing.

The pipeline is one structlog processor (`_LineRenderer`, one call and not five): merge
the caller's context (`commlib.context(step=..., phase=...)`, a ContextVar, so threads and
asyncio tasks keep their own), add the level and wall and monotonic clocks, render JSON,
and append the fields of the process (rank, size, host, pid, attempt), which are encoded
once per `configure` instead of once per event.
The process's fields, the level and the clocks win over an event's own keys of the same
name. It belongs to commlib's own logger (`get_logger`), never to structlog's global
configuration: a library must leave the host application's `structlog.configure` alone.
A collective's own two events skip structlog and take `EventWriter`, the same steps
without the generic dispatch, for the same line.

A logger bound before a `configure` keeps writing where the log pointed when it was bound
(a communicator logs into the directory of its creation); a log file's descriptor is
closed once the last logger writing to it is gone, so reconfiguring leaks nothing.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import os
import socket
import sys
import time
import weakref
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import structlog

LOG_DIR_ENV = "COMMLIB_LOG_DIR"

_CONTEXT: contextvars.ContextVar[dict[str, Any]] = contextvars.ContextVar("commlib_context", default={})


@contextlib.contextmanager
def context(**fields: Any) -> Iterator[None]:
    """Add `fields` (e.g. step=12, phase="backward") to every event logged inside the block."""
    token = _CONTEXT.set({**_CONTEXT.get(), **fields})
    try:
        yield
    finally:
        _CONTEXT.reset(token)


def current_context() -> dict[str, Any]:
    return _CONTEXT.get()


@dataclass(frozen=True)
class ProcessFields:
    """Fields every event of this process carries."""

    rank: int
    size: int
    host: str
    pid: int
    attempt: int  # torchrun restart count: sequence numbers start over in each attempt


_STAMPED = ("level", "ts_ns", "mono_ns")  # what the pipeline itself adds to every event


def _tail_of(fields: dict[str, Any], then: bytes = b"}\n") -> bytes:
    """`fields` as the end of a line: `,"rank":0,...,"attempt":0` and `then`."""
    return (b"," + _encode(fields)[1:-1] if fields else b"") + then


def _line(event: dict[str, Any], reserved: frozenset[str], tail: bytes) -> bytes:
    """The common end of both paths: the caller's context (its keys in `reserved` are the
    pipeline's own and left out), the clocks, the JSON, and the pre-encoded `tail`."""
    ctx = _CONTEXT.get()
    if ctx:
        for k, v in ctx.items():
            if k not in reserved:
                event.setdefault(k, v)
    event["ts_ns"] = time.time_ns()
    event["mono_ns"] = time.monotonic_ns()
    return _encode(event)[:-1] + tail  # never `{}`: the level and clocks are in it


class _LineRenderer:
    """commlib's whole processor chain (module docstring): an event dict in, its JSON line out."""

    def __init__(self, static: dict[str, Any]) -> None:
        self.static = static
        self._names = tuple(static)
        self.reserved = frozenset(static).union(_STAMPED)  # keys the caller's context may not set
        # Each line is the event's JSON with its closing brace replaced by this tail.
        self.tail = _tail_of(static)

    def __call__(self, logger: Any, method: str, event: dict[str, Any]) -> bytes:
        for name in self._names:  # the process's own value is the one written
            if name in event:
                del event[name]
        event = structlog.processors.add_log_level(logger, method, event)
        return _line(event, self.reserved, self.tail)


class EventWriter:
    """The direct path of `get_logger(**bound).info(event, **fields)`, for the two events
    every collective writes: the same fields in one line, without structlog's generic
    dispatch (its context copy and update, processor loop and method lookups cost more
    than encoding and writing the line; scripts/bench_overhead.py). Everything else logs
    through structlog. Like a bound logger, it writes where the log pointed when it was
    made; below the INFO level it writes nothing.
    """

    __slots__ = ("_writer", "_reserved", "_tail", "info")

    def __init__(self, sink: "_Sink", bound: dict[str, Any]) -> None:
        self._writer = sink.writer
        renderer = sink.renderer
        # The line ends with the bound fields, then the process's (their values win, as in
        # the structlog path, so the caller's context may not repeat them).
        self._reserved = renderer.reserved.union(bound, ("event",))
        self._tail = _tail_of({k: v for k, v in bound.items() if k not in renderer.static}, renderer.tail)
        self.info = self._info if sink.level <= logging.INFO else _write_nothing

    def _info(self, event: str, fields: dict[str, Any]) -> None:
        """Write `event` with `fields` (this dict is used up: the line's own keys go into it)."""
        fields["event"] = event
        fields["level"] = "info"
        self._writer.msg(_line(fields, self._reserved, self._tail))


def _write_nothing(event: str, fields: dict[str, Any]) -> None:
    pass


class LineWriter:
    """A structlog logger that writes each rendered event as one line in one write(2).

    With `owned`, the descriptor is this writer's: it is closed when the writer is garbage
    (every logger bound to it is gone), not before, so a logger bound earlier never writes
    to a closed descriptor or to a file that reused its number.
    """

    def __init__(self, fd: int, owned: bool = False) -> None:
        self._fd = fd
        if owned:
            weakref.finalize(self, os.close, fd)

    def msg(self, line: bytes) -> None:
        os.write(self._fd, line)  # rendered with its newline (`_LineRenderer`)

    debug = info = warning = error = critical = exception = msg


@dataclass(frozen=True)
class _Sink:
    """Where a logger's lines go, and how they end: what an `EventWriter` writes with."""

    writer: LineWriter
    renderer: _LineRenderer
    level: int


@dataclass
class _State:
    path: Path | None = None
    enabled: bool = False  # INFO events are written (a log dir is configured)
    logger: Any = None  # commlib's own structlog logger; None until the first use
    sink: _Sink | None = None  # the logger's writer and renderer


# The one piece of global state this module owns: where this process logs.
STATE = _State()


def _build_logger(fd: int, owned: bool, level: int, static: dict[str, Any]) -> tuple[Any, _Sink]:
    """commlib's logger: its own processor, filter and writer, none of structlog's global config."""
    sink = _Sink(LineWriter(fd, owned), _LineRenderer(static), level)
    wrapper = structlog.make_filtering_bound_logger(level)
    return wrapper(sink.writer, processors=[sink.renderer], context={}), sink


def event_log(path: str | os.PathLike[str], **static: Any) -> Any:
    """A logger appending to `path` in the ranks' format (same renderer and writer), with
    `static` in every line: the events of a process that is not a rank (the chaos harness's
    journal). Its file is closed when the logger is garbage."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    return _build_logger(fd, True, logging.INFO, static)[0]


def configure(rank: int, size: int, log_dir: str | os.PathLike[str] | None = None) -> Path | None:
    """Point this process's events at `{log_dir}/rank{rank}.jsonl` (or stderr, warnings only).

    Returns the log file's path, or None when logging to stderr.
    """
    log_dir = log_dir if log_dir is not None else os.environ.get(LOG_DIR_ENV) or None
    if log_dir is not None:
        directory = Path(log_dir)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"rank{rank}.jsonl"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        level = logging.INFO
    else:
        path, fd, level = None, sys.stderr.fileno(), logging.WARNING
    process = ProcessFields(
        rank=rank,
        size=size,
        host=socket.gethostname(),
        pid=os.getpid(),
        attempt=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
    )
    # Replacing the logger drops the previous writer: its file is closed once no logger
    # bound to it is left.
    STATE.logger, STATE.sink = _build_logger(fd, path is not None, level, asdict(process))
    STATE.path = path
    STATE.enabled = path is not None
    return path


def _plain(obj: Any) -> Any:
    """What JSON has no type for: tuples (torch.Size among them) as lists, the rest as text."""
    return list(obj) if isinstance(obj, tuple) else str(obj)


try:
    import orjson
except ImportError:  # the doctor reads logs where commlib's dependencies may not all be
    orjson = None

# Built once: `json.dumps` with options builds a new encoder per call.
_ENCODER = json.JSONEncoder(default=_plain, separators=(",", ":"))


def _encode(obj: dict[str, Any]) -> bytes:
    """`obj` as compact JSON: orjson where installed (a collective's two events are on the
    hot path: it encodes ~5x faster than the stdlib), the stdlib otherwise; both give the
    same JSON."""
    if orjson is not None:
        return orjson.dumps(obj, default=_plain, option=orjson.OPT_NON_STR_KEYS)
    return _ENCODER.encode(obj).encode()


def get_logger(**bound: Any) -> Any:
    """commlib's structlog logger, with `bound` fields, writing into this rank's log (the
    trainer and chaos use it too). Before `configure`: warnings and errors to stderr."""
    if STATE.logger is None:
        STATE.logger, STATE.sink = _build_logger(sys.stderr.fileno(), False, logging.WARNING, {})
    return STATE.logger.bind(**bound) if bound else STATE.logger


def event_writer(**bound: Any) -> EventWriter:
    """The direct path of `get_logger(**bound).info` (`EventWriter`), where the log points now."""
    get_logger()
    assert STATE.sink is not None
    return EventWriter(STATE.sink, bound)


def log_dir() -> Path | None:
    """The configured log directory, or None."""
    return STATE.path.parent if STATE.path else None


def read_events(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """Events of one JSON-lines file in order; a truncated or garbled line is skipped."""
    return (event for _, event in _scan(path, 0) if event is not None)


class LogTail:
    """New events of every ``rank*.jsonl`` in a log dir since the last poll, each file's in order.

    For watching a live run: a line still being written is left for the next poll.
    """

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self._offsets: dict[Path, int] = {}

    def poll(self) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for path in sorted(self.log_dir.glob("rank*.jsonl")):
            for self._offsets[path], event in _scan(path, self._offsets.get(path, 0)):
                if event is not None:
                    events.append(event)
        return events


def _scan(path: str | os.PathLike[str], offset: int) -> Iterator[tuple[int, dict[str, Any] | None]]:
    """(offset after the line, its event or None if garbled) for each complete line from `offset`.

    A last line without its newline is being written, or was cut short by a kill: it is
    not read, so its offset is never passed.
    """
    with open(path, "rb") as f:
        f.seek(offset)
        for raw in f:
            if not raw.endswith(b"\n"):
                return
            offset += len(raw)
            try:
                event = json.loads(raw)
            except ValueError:
                event = None
            yield offset, event if isinstance(event, dict) else None
