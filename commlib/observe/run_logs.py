"""The one model of a run's logs, read in one streaming pass: attempts, ranks, communicators,
and what the doctor's verdicts need of their collectives.

Every tool that reads commlib's JSON-lines logs reads them through this module (the
doctor's rules and statistics, the trace, `fsdp_overlap.timeline`, `chaos.verify`):
`load(logdir)` reads every rank's files (`log.rank_segments`: rotated ones too, in order),
then its `flight_rank*.json` dumps and the faulthandler stacks of `stacks_{pid}.txt` into a
`RunLogs`; `build(events)` does the same for events already in memory. Nothing here talks
to a process group or a store, and nothing imports torch (`python -m commlib.doctor` runs
where only the logs are).

The model is made of plain types (`commlib.observe.records`); the reading
(`commlib.observe.reading`: files, rotations, descriptors, the streaming pass) feeds the builder
(`commlib.observe.builder`: events into attempts, ranks, communicators and calls, keeping
only what verdicts are made of); `commlib.observe.dumps` adds what the processes left
beside their logs; `commlib.observe.position` says where a rank was at the end of its log,
or when a deadline expired. This module composes them.

Jobs: each process's `log.open` line names its job (`log.job_id`). A directory holding the
logs of more than one job is refused (`MixedJobsError`, naming each) unless one job is asked for.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from commlib.observe.builder import Context, ModelBuilder, Unplaceable
from commlib.observe.dumps import add_dump, add_stacks, flight_dumps
from commlib.observe.events import Inflater, rank_segments, read_run
from commlib.observe.reading import read
from commlib.observe.records import AttemptLog, Call, DumpInfo, FileReport, LogDirError, Observer
from commlib.record.files import kind

LISTED = 10  # files an error names one by one


@dataclass
class RunLogs:
    logdir: str
    attempts: dict[int, AttemptLog]
    dumps: list[DumpInfo]
    files: list[FileReport]
    job: str | None = None
    skipped: list[tuple[str, str]] | None = None  # (path, why) of the dumps and stacks files that could not be read
    # How to read the same logs again (`events`, `calls`): the directory, or the events given to `build`.
    _source: list[dict[str, Any]] | None = None
    _job_filter: str | None = None

    @property
    def unreadable(self) -> list[FileReport]:
        """The files nothing could be read from; but a file that holds nothing yet (a rotation
        has just started it) is no loss where its rank's other files were read."""
        read = {f.rank for f in self.files if f.unreadable() is None}
        return [
            f
            for f in self.files
            if f.unreadable() is not None and not (f.rank in read and f.problem is None and f.garbled == 0)
        ]

    def events(self) -> list[dict[str, Any]]:
        """Every rank's events of every attempt as one stream, in wall-clock order (read again,
        and kept: for tools that need the events themselves, on logs of a test's size)."""
        if self._source is not None:
            return sorted((e for e in self._source if isinstance(e.get("ts_ns"), int)), key=lambda e: e["ts_ns"])
        return [e for e in read_run(self.logdir) if self._job_filter is None or e.get("job") == self._job_filter]

    def calls(self) -> list[tuple[int, Call]]:
        """(attempt, call) for every call of the run (read again), as the trace sees them."""
        collect = _Collect()
        if self._source is not None:
            build(self._source, observers=[collect])
        else:
            load(self.logdir, job=self._job_filter, observers=[collect])
        return collect.calls


class _Collect(Observer):
    def __init__(self) -> None:
        self.calls: list[tuple[int, Call]] = []

    def call(self, att: AttemptLog, call: Call) -> None:
        self.calls.append((att.attempt, call))


def load(
    logdir: str | os.PathLike[str],
    job: str | None = None,
    observers: Iterable[Observer] = (),
) -> RunLogs:
    """Read every rank's logs, every flight-recorder dump and every stack dump of `logdir`, in
    one pass (`commlib.observe.reading.read`); with `job`, only that job's events. Raises LogDirError when
    the directory is missing or no file in it holds a readable event, MixedJobsError when it
    holds more than one job's logs and `job` does not pick one."""
    if not os.fspath(logdir):  # an unset shell variable: never the current directory by accident
        raise LogDirError("expected a log directory; found an empty path")
    directory = Path(logdir)
    if not directory.is_dir():
        try:
            found = f"{kind(os.stat(directory).st_mode)} at {directory}"
        except OSError as exc:
            found = f"no directory at {directory} ({exc.strerror or exc})"
        raise LogDirError(f"expected a log directory; found {found}")
    segments = rank_segments(directory)
    if not segments:
        nested = directory / "logs"
        hint = (
            f"they are in {nested}"
            if nested.is_dir() and rank_segments(nested)
            else "was the job run with log_dir= or COMMLIB_LOG_DIR set?"
        )
        raise LogDirError(f"expected rank*.jsonl logs in {directory}; found none ({hint})")
    builder, files = read(directory, segments, job, list(observers))
    if all(f.unreadable() is not None for f in files):
        listing = "; ".join(f"{Path(f.path).name}: {f.unreadable()}" for f in files[:LISTED])
        more = f"; and {len(files) - LISTED} more" if len(files) > LISTED else ""
        raise LogDirError(f"expected at least one readable event in {directory}; found none: {listing}{more}")
    if job is not None and not builder.attempts:
        raise LogDirError(
            f"expected events of job {job!r} in {directory}; found only "
            + "; ".join(info.describe() for info in builder.jobs.values())
        )
    skipped: list[tuple[str, str]] = []
    dumps = [add_dump(builder, path, data) for path, data in flight_dumps(directory, skipped)]
    add_stacks(builder, directory, skipped)
    builder.finish()
    return RunLogs(
        str(directory), dict(sorted(builder.attempts.items())), dumps, files, builder.job_seen(), skipped, None, job
    )


def build(events: Iterable[dict[str, Any]], logdir: str = "", observers: Iterable[Observer] = ()) -> RunLogs:
    """The model of events already read (each carrying its `rank`; no dumps, no stacks), in their order."""
    source = [e for e in events if isinstance(e.get("rank"), int)]
    builder = ModelBuilder(None, list(observers))
    clocks = [e["ts_ns"] for e in source if isinstance(e.get("ts_ns"), int)]
    for observer in builder.observers if clocks else ():
        observer.begin(min(clocks))
    streams: dict[int, tuple[Context, Inflater]] = {}  # per rank, as its file would be read
    for event in source:
        if isinstance(event.get("ts_ns"), int):
            stream = streams.get(event["rank"])
            if stream is None:
                stream = streams[event["rank"]] = (Context(event["rank"]), Inflater())
            context, inflate = stream
            with contextlib.suppress(Unplaceable):  # an event of no rank or attempt the model can keep
                builder.add(inflate(dict(event)) or event, context)  # a log.open line: the builder keeps its header
    builder.finish()
    return RunLogs(logdir, dict(sorted(builder.attempts.items())), [], [], builder.job_seen(), None, source)
