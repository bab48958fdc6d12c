"""What a run leaves on the machine when its harness dies, and its removal.

A run makes things that outlive a killed harness: the job's processes (torchrun starts its
workers in sessions of their own, so nothing ties them to the harness), the ``disk_full``
tmpfs (`chaos.disk`) and the nodes' network namespaces (`chaos.net`). `Guard`, one per
`chaos.harness.run_job`, ties them to the harness's life:

- every process of the job carries the run's token, and each agent gets SIGTERM when the
  harness dies (`chaos.processes`): torchrun then stops its own workers;
- each mount and namespace is appended to the run's record,
  ``{state dir}/{harness pid}-{token}.jsonl``, *before* it is made;
- the record is locked (``flock``) from before it has its name until the harness and its
  supervisor are both gone: the harness takes the lock on the file it then renames into
  place, and hands the very descriptor to the supervisor, so that the lock is held while
  either lives and released by the kernel when both are dead, however they died;
- a supervisor (``python -m chaos.cleanup``, in a session of its own, so that a signal to the
  harness's process group spares it) holds the read end of a pipe whose write end only the
  harness has. When the harness dies, whatever killed it, the pipe closes and the supervisor
  removes what the record names (`clean`: the token's processes and any process in the run's
  namespaces, SIGTERM then SIGKILL; the mounts; the namespaces), writes what it did to
  ``{run dir}/cleanup.log`` and deletes the record.

A run that ends normally removes everything itself, deletes its record, then closes the
pipe; the supervisor finds no record and exits. When the supervisor died too, the record
stays, and the next `Guard` to start sweeps it (`sweep`: every record whose lock is free).
The lock, not a pid, says whether a run is alive: a pid means nothing outside its PID
namespace (a harness on a node of the local Slurm cluster, `chaos.slurm.cluster`, shares
this state dir), and a lock holds across them. A sweep also leaves alone a dead run whose
processes it cannot see (a record made in a PID namespace that is neither its own nor one
below it): another sweep, which can, removes it. The state dir is ``/run/chaos`` (gone at
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
INITIAL_PID_NAMESPACE = 0xEFFFFFFC  # the kernel's fixed inode for the machine's first PID namespace


def state_dir() -> Path:
    """Where the records of running harnesses are (made here, owned by this user: a record names
    processes to kill and mounts to detach, so no one else may write one)."""
    path = Path("/run/chaos") if os.access("/run", os.W_OK) else Path(tempfile.gettempdir()) / f"chaos-{os.getuid()}"
    path.mkdir(mode=0o700, exist_ok=True)
    if path.stat().st_uid != os.getuid():
        raise PermissionError(
            f"chaos.cleanup: expected the state dir {path} to be owned by uid {os.getuid()}; "
            f"found uid {path.stat().st_uid}"
        )
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
        self._lock = -1
        self._pipe = -1
        self._supervisor: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Guard:
        sweep()
        header = {
            "harness_pid": os.getpid(),
            "pid_ns": _pid_namespace(),
            "run_dir": str(self.run_dir),
            "token": self.token,
        }
        # Whole or absent: a record is never seen without its header, nor unlocked while its run lives.
        partial = self.record.with_suffix(".tmp")
        self._lock = os.open(partial, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        read = -1
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX)
            os.write(self._lock, (json.dumps(header) + "\n").encode())
            partial.rename(self.record)
            read, self._pipe = os.pipe()  # both ends close-on-exec: the agents never hold the write end
            self._supervisor = subprocess.Popen(
                [sys.executable, "-m", "chaos.cleanup", str(self.record), str(read), str(self._lock)],
                pass_fds=(read, self._lock),
                start_new_session=True,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
            )
        except BaseException:
            for path in (partial, self.record):
                path.unlink(missing_ok=True)
            for fd in (self._pipe, self._lock):
                if fd >= 0:
                    os.close(fd)
            raise
        finally:
            if read >= 0:
                os.close(read)
        return self

    def note_mount(self, path: Path) -> None:
        _append(self.record, {"mount": str(path)})

    def note_namespaces(self, names: list[str]) -> None:
        for name in names:
            _append(self.record, {"netns": name})

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.record.unlink(missing_ok=True)  # before the pipe closes: the supervisor then has nothing to do
        os.close(self._pipe)
        assert self._supervisor is not None
        self._supervisor.wait()
        os.close(self._lock)


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
    """Clean every record whose lock is free (its harness and its supervisor are gone) and whose
    processes this process can see."""
    done = []
    for path in sorted(state_dir().glob("*.jsonl")):
        try:
            f = open(path)
        except FileNotFoundError:  # its harness just ended
            continue
        with f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # its harness or its supervisor is alive
                continue
            entries = _read(f)
            if entries is None or not _sweepable(entries[0]):
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


def _pid_namespace(pid: int | str = "self") -> int | None:
    """The inode of a process's PID namespace (None once the process is gone)."""
    try:
        return os.stat(f"/proc/{pid}/ns/pid").st_ino
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None


def _sweepable(header: dict[str, Any]) -> bool:
    """Whether an unlocked record's run is this sweep's to remove (module docstring)."""
    if "pid_ns" not in header:
        # Written by an earlier harness, which locked its record only once its supervisor ran
        # (another checkout's, on a shared machine): its pid must be gone as well.
        return not psutil.pid_exists(header["harness_pid"])
    return _sees(header["pid_ns"])


def _sees(namespace: int) -> bool:
    """Whether this process sees every process of PID namespace `namespace`: its own, one below
    it (some process of it is visible), or any, from the machine's first namespace."""
    own = _pid_namespace()
    if namespace == own or own == INITIAL_PID_NAMESPACE:
        return True
    return any(_pid_namespace(p) == namespace for p in psutil.pids())


def _clean_record(path: Path, entries: list[dict[str, Any]], by: str) -> Cleaned:
    cleaned = clean(entries, by)
    try:
        with open(Path(cleaned.run_dir) / LOG, "a") as log:
            log.write(json.dumps({"ts_ns": time.time_ns(), **asdict(cleaned)}) + "\n")
    except FileNotFoundError:  # the run directory was deleted: nothing to tell there
        pass
    path.unlink(missing_ok=True)
    return cleaned


def supervise(record: Path, pipe: int, lock: int) -> None:
    """Wait for the harness to end (the pipe closes); clean up after it unless it did. `lock`:
    the record's descriptor, locked by the harness (module docstring), kept open until done."""
    with os.fdopen(lock, "r") as f:
        while os.read(pipe, 4096):
            pass
        entries = _read(f)
        if entries is not None:
            _clean_record(record, entries, "supervisor")


if __name__ == "__main__":
    supervise(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
