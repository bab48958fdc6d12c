"""What a run leaves on the machine when its harness dies, and its removal.

A run makes things that outlive a killed harness: the job's processes (torchrun starts its
workers in sessions of their own, so nothing ties them to the harness), the ``disk_full``
tmpfs (`chaos.disk`) and the nodes' network namespaces (`chaos.net`). `Guard`, one per
`chaos.harness.run_job`, ties them to the harness's life:

- every process of the job carries the run's token, and each agent gets SIGTERM when the
  harness dies (`chaos.processes`): torchrun then stops its own workers;
- each mount and namespace is appended to the run's record,
  ``{state dir}/{harness pid}-{token}.jsonl``, *before* it is made;
- a supervisor (``python -m chaos.cleanup``, in a session of its own, so that a signal to the
  harness's process group spares it) holds the read end of a pipe whose write end only the
  harness has. When the harness dies, whatever killed it, the pipe closes and the supervisor
  removes what the record names (`clean`: the token's processes and any process in the run's
  namespaces, SIGTERM then SIGKILL; the mounts; the namespaces), writes what it did to
  ``{run dir}/cleanup.log`` and deletes the record.

A run that ends normally removes everything itself, deletes its record, then closes the
pipe; the supervisor finds no record and exits. When the supervisor died too, the record
stays, and the next `Guard` to start sweeps it (`sweep`: every record whose harness is gone
and whose supervisor no longer holds its lock). The state dir is ``/run/chaos`` (gone at
reboot, with every mount and namespace) or, without root, ``chaos-<uid>`` in the temp dir.

The TUN devices of `chaos.net` need nothing: they live only as long as the harness's
descriptors.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import psutil

from chaos.disk import unmount
from chaos.net import delete_namespace, namespace_pids
from chaos.processes import members, terminate

LOG = "cleanup.log"  # in the run directory: what was removed after its harness died


def state_dir() -> Path:
    """Where the records of running harnesses are (made here, owned by this user: a record names
    processes to kill and mounts to detach, so no one else may write one)."""
    path = Path("/run/chaos") if os.access("/run", os.W_OK) else Path(tempfile.gettempdir()) / f"chaos-{os.getuid()}"
    path.mkdir(mode=0o700, exist_ok=True)
    if path.stat().st_uid != os.getuid():
        raise PermissionError(f"chaos.cleanup: expected the state dir {path} to be owned by uid {os.getuid()}; "
                              f"found uid {path.stat().st_uid}")
    return path


@dataclass(frozen=True)
class Cleaned:
    """What `clean` removed of one dead harness's run."""

    run_dir: str
    harness_pid: int
    by: str  # "supervisor", or "sweep by <pid>"
    pids: list[int]  # processes stopped
    mounts: list[str]  # tmpfs unmounted
    namespaces: list[str]  # network namespaces deleted


class Guard:
    """One run's record and supervisor; see the module docstring. Use as a context manager
    around everything the run makes; `note_mount` / `note_namespaces` before making them."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.token = secrets.token_hex(8)
        self.record = state_dir() / f"{os.getpid()}-{self.token}.jsonl"
        self._pipe = -1
        self._supervisor: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Guard:
        sweep()
        me = psutil.Process()
        header = {"harness_pid": me.pid, "harness_started": me.create_time(), "run_dir": str(self.run_dir),
                  "token": self.token}
        # Whole or absent: a record is never seen without its header.
        partial = self.record.with_suffix(".tmp")
        partial.write_text(json.dumps(header) + "\n")
        partial.rename(self.record)
        read, self._pipe = os.pipe()  # both ends close-on-exec: the agents never hold the write end
        try:
            self._supervisor = subprocess.Popen(
                [sys.executable, "-m", "chaos.cleanup", str(self.record), str(read)], pass_fds=(read,),
                start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        except BaseException:
            self.record.unlink()
            os.close(self._pipe)
            raise
        finally:
            os.close(read)
        return self

    def note_mount(self, path: Path) -> None:
        _append(self.record, {"mount": str(path)})

    def note_namespaces(self, names: list[str]) -> None:
        for name in names:
            _append(self.record, {"netns": name})

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.record.unlink(missing_ok=True)  # before the pipe closes: the supervisor then has nothing to do
        os.close(self._pipe)
        assert self._supervisor is not None
        self._supervisor.wait()


def _append(record: Path, entry: dict[str, Any]) -> None:
    with open(record, "a") as f:
        f.write(json.dumps(entry) + "\n")


def clean(entries: list[dict[str, Any]], by: str) -> Cleaned:
    """Remove what a record names: processes first (a namespace lives on while a process is in it,
    a busy mount is only detached), then the mounts, then the namespaces."""
    header = entries[0]
    netns = [e["netns"] for e in entries if "netns" in e]

    def job() -> list[psutil.Process]:
        inside = {pid for name in netns for pid in namespace_pids(name)}
        found = {p.pid: p for p in members(header["token"])}
        for pid in inside - set(found):
            try:
                found[pid] = psutil.Process(pid)
            except psutil.NoSuchProcess:
                continue
        return list(found.values())

    pids = sorted(terminate(job))
    mounts = [e["mount"] for e in entries if "mount" in e and unmount(Path(e["mount"]))]
    namespaces = [name for name in netns if delete_namespace(name)]
    return Cleaned(header["run_dir"], header["harness_pid"], by, pids, mounts, namespaces)


def sweep() -> list[Cleaned]:
    """Clean every record whose harness is gone and whose supervisor is gone too."""
    done = []
    for path in sorted(state_dir().glob("*.jsonl")):
        try:
            f = open(path)
        except FileNotFoundError:  # its harness just ended
            continue
        with f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # its supervisor is alive: it is the one to clean
                continue
            entries = _read(f)
            if entries is None or _alive(entries[0]):
                continue
            done.append(_clean_record(path, entries, f"sweep by {os.getpid()}"))
    return done


def _read(f: IO[str]) -> list[dict[str, Any]] | None:
    """A locked record's entries; None once it was deleted (its run is over, or another cleaned it)."""
    if os.fstat(f.fileno()).st_nlink == 0:
        return None
    f.seek(0)
    entries = []
    for line in f:
        try:
            entries.append(json.loads(line))
        except ValueError:  # the harness died writing it, so before making what it names
            break
    return entries


def _alive(header: dict[str, Any]) -> bool:
    try:
        return abs(psutil.Process(header["harness_pid"]).create_time() - header["harness_started"]) < 0.01
    except psutil.NoSuchProcess:
        return False


def _clean_record(path: Path, entries: list[dict[str, Any]], by: str) -> Cleaned:
    cleaned = clean(entries, by)
    run_dir = Path(cleaned.run_dir)
    if run_dir.is_dir():
        with open(run_dir / LOG, "a") as log:
            log.write(json.dumps({"ts_ns": time.time_ns(), **asdict(cleaned)}) + "\n")
    path.unlink()
    return cleaned


def supervise(record: Path, pipe: int) -> None:
    """Wait for the harness to end (the pipe closes); clean up after it unless it did."""
    try:
        f = open(record)
    except FileNotFoundError:  # the run ended before this process started
        return
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)  # held while it lives: `sweep` leaves the record to it
        while os.read(pipe, 4096):
            pass
        entries = _read(f)
        if entries is not None:
            _clean_record(record, entries, "supervisor")


if __name__ == "__main__":
    supervise(Path(sys.argv[1]), int(sys.argv[2]))
