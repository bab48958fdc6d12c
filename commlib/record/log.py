"""Structured logs as a rank writes them: structlog, JSON lines, one file per rank, and their budget.

Configured once per process by `commlib.init` (or `configure` directly):
- with a log dir (`init(log_dir=...)` or `COMMLIB_LOG_DIR`), every event at INFO and above
  goes to `{log_dir}/rank{R}.jsonl`;
- without one, only warnings and errors go to stderr.
A rank run as a thread of a process that runs other ranks too (the tests' fast lane,
`commlib.testing.run_threads`) writes inside `rank_log`, a log of its own: its file, its rank.

Each line is written with a single `os.write` on an `O_APPEND` descriptor, so a process
killed mid-write leaves at most one truncated last line, ranks restarted by torchrun
append to the same file, and a second thread of the process (a GPU watchdog) never splits
a line. A process that opens a file whose last line was cut short ends that line first, so
its own first line stands alone. The file and its rotation are `commlib.record.logfile`'s;
a name that holds something else than a regular file (a FIFO, a device) is refused.

The budget: when a rank's file reaches `COMMLIB_LOG_MAX_MB` (at least 0.01, a few tens of
lines) it is renamed `rank{R}.jsonl.{n}` (n counting up, never reused) and a new one is
started; only the newest `COMMLIB_LOG_KEEP` renamed files are kept. A rank's logs therefore
never exceed (KEEP + 1) x MAX_MB, plus one line. Both are read with `commlib.settings`'
rules (an empty value is unset; out of range is refused, naming the variable).

Every line carries what tells it apart in its file (`rank`, `pid`, `attempt`); what is
fixed per process (`host`, the world `size`, the `job`) is written once, in the
`log.open` line that starts each file the process writes and each file a rotation starts.
The readers (`commlib.observe.events`) put those fields back into every event, and an `info`
line leaves out its level, so what a reader gets is the documented schema.

The job: torchrun's `TORCHELASTIC_RUN_ID`, or else an id the ranks agree through the
store they are configured with (the first rank to ask sets it), so that the logs of two
jobs written into one directory are never read as one.

The pipeline is one structlog processor (`_LineRenderer`, one call and not five): merge
the caller's context (`commlib.context(step=..., phase=...)`, a ContextVar, so threads and
asyncio tasks keep their own), add the level and wall and monotonic clocks, render JSON,
and append the fields of the process, which are encoded once per `configure` instead of
once per event. The process's fields, the level and the clocks win over an event's own keys
of the same name. It belongs to commlib's own logger (`get_logger`), never to structlog's
global configuration: a library must leave the host application's `structlog.configure`
alone. A collective's own two events skip structlog and take `EventWriter`, the same steps
without the generic dispatch, for the same line.

A logger bound before a `configure` keeps writing where the log pointed when it was bound
(a communicator logs into the directory of its creation); a log file's descriptor is
closed once the last logger writing to it is gone, so reconfiguring leaks nothing.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import socket
import sys
import threading
import time
import uuid
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from commlib import settings

# This process's attempt, as every rank of the job agreed it at init (`commlib.attempt`); with
# an environment, or before the agreement, its estimate from torchrun's and Slurm's counts.
from commlib.attempt import attempt_number
from commlib.record.codec import encode
from commlib.record.logfile import LogFile

LOG_DIR_ENV = "COMMLIB_LOG_DIR"
MAX_MB_ENV = "COMMLIB_LOG_MAX_MB"
KEEP_ENV = "COMMLIB_LOG_KEEP"
DEFAULT_MAX_MB = 100.0
MAX_MB_RANGE = (0.01, 1e6)  # a file holds tens of lines at least, a terabyte at most
DEFAULT_KEEP = 4
MAX_KEEP = 10_000
RUN_ID_ENV = "TORCHELASTIC_RUN_ID"
JOB_KEY = "commlib/job"  # where ranks without torchrun agree on their job id
# What the header alone carries; every other line carries the rest of ProcessFields.
HEADER_ONLY = ("host", "size", "job")
# What of a communicator's own fields a collective's two lines leave to its other events
# (`comm.init` first): the readers put them back. Its size stays in every line (it costs
# bytes, not time: it is in the line's pre-encoded tail), so that the last lines of a log say
# who the members are (`commlib.observe.verdict_from_end` reads only those).
COMM_ONLY = ("backend",)

# The default is shared, but never mutated: `context` sets a fresh dict, and readers only read.
_CONTEXT: contextvars.ContextVar[dict[str, Any]] = contextvars.ContextVar("commlib_context", default={})  # noqa: B039


@contextlib.contextmanager
def context(**fields: Any) -> Iterator[None]:
    """Add `fields` (e.g. step=12, phase="backward") to every event logged inside the block."""
    token = _CONTEXT.set({**_CONTEXT.get(), **fields})
    try:
        yield
    finally:
        _CONTEXT.reset(token)


# The caller's fields (`context`), read on every collective: the ContextVar's own getter, a C call.
current_context = _CONTEXT.get


def job_id(store: Any = None, environ: Mapping[str, str] = os.environ) -> str | None:
    """The job this process belongs to: torchrun's run id, else an id agreed through `store`
    (the first rank to ask sets it: no rank waits for another), else the one this process had."""
    run_id = environ.get(RUN_ID_ENV)
    if run_id:
        return run_id
    if store is not None:
        return store.compare_set(JOB_KEY, "", uuid.uuid4().hex).decode()
    return _state().job


@dataclass(frozen=True)
class ProcessFields:
    """Fields every event of this process carries (`HEADER_ONLY` ones through its `log.open` line)."""

    rank: int
    size: int
    host: str
    pid: int
    attempt: int  # `attempt_number()`: sequence numbers start over in each attempt
    job: str | None


_STAMPED = ("level", "ts_ns", "mono_ns")  # what the pipeline itself adds to every event
# structlog's method names as levels; info, the commonest, is left out of the line.
_LEVELS = {
    "debug": "debug",
    "warning": "warning",
    "warn": "warning",
    "error": "error",
    "exception": "error",
    "critical": "critical",
    "fatal": "critical",
    "msg": "info",
    "info": "info",
}


def _tail_of(fields: dict[str, Any], then: bytes = b"}\n") -> bytes:
    """`fields` as the end of a line: `,"rank":0,...,"attempt":0` and `then`."""
    return (b"," + encode(fields)[1:-1] if fields else b"") + then


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
    return encode(event)[:-1] + tail  # never `{}`: the clocks are in it


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
        level = _LEVELS.get(method, method)
        if level != "info":
            event["level"] = level
        elif "level" in event:
            del event["level"]
        return _line(event, self.reserved, self.tail)


class EventWriter:
    """The direct path of `get_logger(**bound).info(event, **fields)`, for the two events
    every collective writes: the same fields in one line, without structlog's generic
    dispatch (its context copy and update, processor loop and method lookups cost more
    than encoding and writing the line; scripts/bench_overhead.py). Everything else logs
    through structlog. Like a bound logger, it writes where the log pointed when it was
    made; below the INFO level it writes nothing. The communicator's `COMM_ONLY` fields are
    left out of its lines (its other events have them; the readers put them back): a
    shorter line that costs nothing to write, being part of the pre-encoded tail. (Leaving out
    fields that are None would save 35 bytes a collective but cost half a microsecond an
    event to filter: they stay.)
    """

    __slots__ = ("_file", "_reserved", "_tail", "info")

    def __init__(self, sink: _Sink, bound: dict[str, Any]) -> None:
        self._file = sink.writer.target
        renderer = sink.renderer
        # The line ends with the bound fields, then the process's (their values win, as in
        # the structlog path, so the caller's context may not repeat them).
        self._reserved = renderer.reserved.union(bound, ("event",))
        self._tail = _tail_of(
            {k: v for k, v in bound.items() if k not in renderer.static and k not in COMM_ONLY}, renderer.tail
        )
        self.info = self._info if sink.level <= logging.INFO else _write_nothing

    def _info(self, event: str, fields: dict[str, Any]) -> None:
        """Write `event` with `fields` (this dict is used up: the line's own keys go into it)."""
        fields["event"] = event
        self._file.write(_line(fields, self._reserved, self._tail))


def _write_nothing(event: str, fields: dict[str, Any]) -> None:
    pass


# Every rank log this process writes, by path: loggers of one file share its LogFile.
_FILES: weakref.WeakValueDictionary[Path, LogFile] = weakref.WeakValueDictionary()


class _Descriptor:
    """A descriptor this module does not own (stderr), written like a `LogFile`."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def write(self, line: bytes) -> None:
        os.write(self.fd, line)


class LineWriter:
    """A structlog logger that writes each rendered event as one line in one write(2): to a
    log file (`LogFile`), or to a descriptor it does not own (stderr).

    It holds its file, so a logger bound earlier never writes to a closed descriptor or to
    a file that reused its number.
    """

    def __init__(self, target: LogFile | _Descriptor) -> None:
        self.target = target

    def msg(self, line: bytes) -> None:
        self.target.write(line)  # rendered with its newline (`_LineRenderer`)

    debug = info = warning = error = critical = exception = msg


@dataclass(frozen=True)
class _Sink:
    """Where a logger's lines go, and how they end: what an `EventWriter` writes with."""

    writer: LineWriter
    renderer: _LineRenderer
    level: int


@dataclass(eq=False)
class _State:
    path: Path | None = None
    # Read on `STATE` only, by the communicators: INFO events are written, by the process's log
    # or by an open rank log (`_open_gate`).
    enabled: bool = False
    logger: Any = None  # commlib's own structlog logger; None until the first use
    sink: _Sink | None = None  # the logger's writer and renderer
    job: str | None = None  # the job of this log's last configure


# The one piece of global state this module owns: where this process logs, and where each rank
# run as a thread of it logs instead (`rank_log`), the rank's own read through a ContextVar.
STATE = _State()
_RANK_LOG = contextvars.ContextVar[_State | None]("commlib_rank_log", default=None)
_RANK_LOGS: set[_State] = set()  # the rank logs open now
_RANK_LOGS_LOCK = threading.Lock()


def _state() -> _State:
    """The log this code writes to: its rank's own inside `rank_log`, else the process's."""
    return _RANK_LOG.get() or STATE


@contextlib.contextmanager
def rank_log() -> Iterator[None]:
    """Inside the block, a log of the calling rank's own in place of the process's: for a rank run
    as a thread of a process that runs others (`commlib.testing.run_threads`), so that its lines
    carry its own rank and go to its own file. `configure`, `get_logger`, `event_writer`,
    `log_dir`, `release` and `job_id` concern it; the process's log stays as it was. A thread the
    rank starts begins outside it, as it begins outside `context` (a communicator's own threads
    write with the logger it bound at its creation, in the rank's log)."""
    state = _State()
    token = _RANK_LOG.set(state)
    with _RANK_LOGS_LOCK:
        _RANK_LOGS.add(state)
    try:
        yield
    finally:
        _RANK_LOG.reset(token)
        with _RANK_LOGS_LOCK:
            _RANK_LOGS.discard(state)
            _open_gate()


def _open_gate() -> None:
    """Set `STATE.enabled`, the one test a communicator makes before it builds a collective's lines
    (each line's writer still writes only at its own level): true while the process's log or an
    open rank log writes INFO events. Under `_RANK_LOGS_LOCK`."""
    STATE.enabled = STATE.path is not None or any(log.path is not None for log in _RANK_LOGS)


def _build_logger(target: LogFile | _Descriptor, level: int, static: dict[str, Any]) -> tuple[Any, _Sink]:
    """commlib's logger: its own processor, filter and writer, none of structlog's global config."""
    # Imported here, not with the module: the doctor imports this module for the lines' format and
    # never writes one, and structlog (with the asyncio it imports) was a third of its imports.
    import structlog

    sink = _Sink(LineWriter(target), _LineRenderer(static), level)
    wrapper = structlog.make_filtering_bound_logger(level)
    # structlog types the class it makes as its FilteringBoundLogger protocol; the class itself is
    # a BoundLoggerBase, built from (logger, processors, context).
    return wrapper(sink.writer, processors=[sink.renderer], context={}), sink  # type: ignore[call-arg]


def event_log(path: str | os.PathLike[str], **static: Any) -> Any:
    """A logger appending to `path` in the ranks' format (same renderer and writer), with
    `static` in every line: the events of a process that is not a rank (the chaos harness's
    journal), never rotated. Its file is closed when the logger is garbage."""
    return _build_logger(LogFile(Path(path), sys.maxsize, 0, None), logging.INFO, static)[0]


def budget(environ: Mapping[str, str] = os.environ) -> tuple[int, int]:
    """(bytes a rank's file may reach before it is rotated, rotated files kept), from the environment."""
    max_mb = settings.env_number(
        MAX_MB_ENV, DEFAULT_MAX_MB, environ=environ, low=MAX_MB_RANGE[0], high=MAX_MB_RANGE[1], unit="MB"
    )
    keep = settings.env_integer(KEEP_ENV, DEFAULT_KEEP, environ=environ, low=0, high=MAX_KEEP)
    return int(max_mb * 1e6), keep


def configure(rank: int, size: int, log_dir: str | os.PathLike[str] | None = None, store: Any = None) -> Path | None:
    """Point this process's events (a rank's, inside `rank_log`) at `{log_dir}/rank{rank}.jsonl`
    (or stderr, warnings only).

    `store`: one every rank of the job shares, to agree on a job id without torchrun.
    Returns the log file's path, or None when logging to stderr.
    """
    source = "log_dir" if log_dir is not None else LOG_DIR_ENV
    log_dir = log_dir if log_dir is not None else settings.env(LOG_DIR_ENV)
    if log_dir is not None and not os.fspath(log_dir):
        raise ValueError(f"commlib log: expected {source} to be a directory; found ''")
    max_bytes, keep = budget()  # bad settings fail here, before anything is written
    process = ProcessFields(
        rank=rank, size=size, host=socket.gethostname(), pid=os.getpid(), attempt=attempt_number(), job=job_id(store)
    )
    fields = asdict(process)
    static = {k: v for k, v in fields.items() if k not in HEADER_ONLY}
    target: LogFile | _Descriptor
    if log_dir is not None:
        directory = Path(log_dir)
        file_path = directory / f"rank{rank}.jsonl"
        path: Path | None = file_path
        file = _FILES.get(file_path)
        if file is None or file.header != fields:
            try:
                directory.mkdir(parents=True, exist_ok=True)
                file = _FILES[file_path] = LogFile(file_path, max_bytes, keep, fields)
            except OSError as exc:
                raise ValueError(
                    f"commlib log: expected {source} to be a directory where rank {rank} can write "
                    f"its log; found {exc.filename or directory}: {exc.strerror or exc}"
                ) from None
        target, level = file, logging.INFO
    else:
        path, target, level = None, _Descriptor(sys.stderr.fileno()), logging.WARNING
    # Replacing the logger drops the previous writer: its file is closed once no logger
    # bound to it is left.
    state = _state()
    state.logger, state.sink = _build_logger(target, level, static)
    state.path = path
    state.job = process.job
    with _RANK_LOGS_LOCK:
        _open_gate()
    return path


def get_logger(**bound: Any) -> Any:
    """commlib's structlog logger, with `bound` fields, writing into this rank's log (the
    trainer and chaos use it too). Before `configure`: warnings and errors to stderr."""
    state = _state()
    if state.logger is None:
        stderr = _Descriptor(sys.stderr.fileno())
        state.logger, state.sink = _build_logger(stderr, logging.WARNING, {})
    return state.logger.bind(**bound) if bound else state.logger


def event_writer(**bound: Any) -> EventWriter:
    """The direct path of `get_logger(**bound).info` (`EventWriter`), where the log points now."""
    get_logger()
    sink = _state().sink
    assert sink is not None
    return EventWriter(sink, bound)


def log_dir() -> Path | None:
    """The configured log directory, or None."""
    path = _state().path
    return path.parent if path else None


def release() -> None:
    """Close this process's log file, even for loggers still bound to it, and log to stderr
    again, warnings only: the last communicator is gone (`commlib.record.flight.release`)."""
    state = _state()
    if state.path is not None:
        log_file = _FILES.pop(state.path, None)
        if log_file is not None:
            log_file.close()
        state.logger = state.sink = None
        state.path = None
        with _RANK_LOGS_LOCK:
            _open_gate()
