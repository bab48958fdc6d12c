"""A harness killed with SIGKILL leaves nothing behind (`chaos.cleanup`); a live one is never
swept; a second Ctrl-C never cuts short the stop of a job.

`python -m chaos run` on the toy trainer, with a ``disk_full`` tmpfs on its checkpoint dir and,
in the first test, two nodes in network namespaces with a ``net_delay`` on; the harness gets a
real SIGKILL while the job trains:

- alone: its supervisor stops every process of the job (hung in the namespaces, since the
  forwarder died with the harness), unmounts the tmpfs and deletes the namespaces, within
  `BOUND_S`;
- together with its supervisor: the agents' parent-death signal stops the job all the same,
  the tmpfs stays until the next harness starts, which sweeps it.

A harness in a PID namespace of its own (as on a node of the local Slurm cluster, which shares
the records) is swept from this namespace again and again while it starts, and left alone. A
network-fault run gets two SIGINTs, or two SIGTERMs: every process of its job is gone by the
time the harness says it stopped the job.

Root is needed (tmpfs, namespaces); without it the runs fail, saying so. They never skip.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from chaos.cleanup import LOG, Guard, state_dir, sweep
from chaos.disk import unmount
from chaos.harness import journal
from chaos.net import delete_namespace, namespaces
from commlib.observe.events import read_events

TOY = str(Path(__file__).with_name("toy_trainer.py"))
# The supervisor's part: the job gets TERM_GRACE_S (5 s) after SIGTERM before SIGKILL, then the
# mounts and namespaces go. Twice that, for a loaded machine.
BOUND_S = 12.0


def _start(run_dir: Path, *args: str, prefix: tuple[str, ...] = (), steps: int = 100000) -> subprocess.Popen:
    """`python -m chaos run` of the toy trainer (endless by default), with `args` (faults,
    topology), its command line after `prefix`."""
    cmd = [*prefix, sys.executable, "-m", "chaos", "run", "--run-dir", str(run_dir), "--trainer", TOY, "--no-verify",
           "--no-png", "--job-timeout", "300", *args, "--", "--steps", str(steps), "--step-time", "0.05"]
    with open(run_dir.parent / "harness.out", "wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _wait_training(harness: subprocess.Popen, run_dir: Path, faults: int) -> None:
    """Until `faults` faults fired and a rank then completed a step."""
    give_up = time.monotonic() + 120
    while time.monotonic() < give_up:
        assert harness.poll() is None, (run_dir.parent / "harness.out").read_text()
        fired = [n["ts_ns"] for n in journal(run_dir) if n["event"] == "chaos.fault"]
        if len(fired) == faults:
            steps = [e for p in (run_dir / "logs").glob("rank*.jsonl") for e in read_events(p)
                     if e["event"] == "train.step" and e["ts_ns"] > max(fired)]
            if steps:
                return
        time.sleep(0.2)
    raise AssertionError(f"the job did not train past its faults: {(run_dir.parent / 'harness.out').read_text()}")


def _mounted(path: Path) -> bool:
    return any(line.split()[1] == str(path) for line in Path("/proc/self/mounts").read_text().splitlines())


def _records(harness_pid: int) -> list[Path]:
    return list(state_dir().glob(f"{harness_pid}-*.jsonl"))


def _until(done, bound_s: float, every_s: float = 0.1) -> float:
    """Seconds until `done()` held; fails past `bound_s`."""
    start = time.monotonic()
    while not done():
        assert time.monotonic() - start < bound_s, f"not within {bound_s} s"
        time.sleep(every_s)
    return time.monotonic() - start


def _scrub(run_dir: Path, leftovers, names: list[str]) -> None:
    """Whatever a failed test left (a test that fails must not break the next ones)."""
    for pid, _ in leftovers(run_dir):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    sweep()
    unmount(run_dir / "work")
    for name in names:
        delete_namespace(name)


def test_a_killed_harness_leaves_no_process_mount_or_namespace(tmp_path, leftovers):
    run_dir = tmp_path / "run"
    harness = _start(run_dir, "--nnodes", "2", "--nproc-per-node", "1", "--fault", "disk_full:step=3",
                     "--fault", "net_delay:rank=1,step=4,ms=5,duration_s=200")
    names: list[str] = []
    try:
        _wait_training(harness, run_dir, faults=2)
        [made] = [n for n in journal(run_dir) if n["event"] == "harness.network"]
        names = made["namespaces"]
        tag = names[0].split("-")[2]
        assert _mounted(run_dir / "work") and set(names) <= set(namespaces()) and leftovers(run_dir)
        harness.send_signal(signal.SIGKILL)
        harness.wait()

        def gone() -> bool:
            links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
            return not (leftovers(run_dir) or _mounted(run_dir / "work") or set(names) & set(namespaces())
                        or f"cn{tag}" in links or _records(harness.pid))

        took = _until(gone, BOUND_S)
        print(f"everything gone {took:.1f} s after the SIGKILL")
        [cleaned] = [json.loads(line) for line in (run_dir / LOG).read_text().splitlines()]
        assert cleaned["by"] == "supervisor" and cleaned["harness_pid"] == harness.pid, cleaned
        assert cleaned["mounts"] == [str(run_dir / "work")] and sorted(cleaned["namespaces"]) == sorted(names)
    finally:
        harness.kill()
        _scrub(run_dir, leftovers, names)


def test_a_harness_killed_with_its_supervisor_is_swept_at_the_next_start(tmp_path, leftovers):
    run_dir = tmp_path / "run"
    harness = _start(run_dir, "--fault", "disk_full:step=3")
    try:
        _wait_training(harness, run_dir, faults=1)
        [supervisor] = [p for p in psutil.Process(harness.pid).children() if "chaos.cleanup" in p.cmdline()]
        supervisor.kill()  # SIGKILL: it runs no more code of its own, whether reaped yet or not
        harness.send_signal(signal.SIGKILL)
        harness.wait()
        # The agents' parent-death signal: torchrun stops its workers and exits.
        took = _until(lambda: not leftovers(run_dir), BOUND_S)
        print(f"the job stopped {took:.1f} s after the SIGKILL")

        # The next harness's start (the Guard run_job enters before it launches anything) sweeps
        # the tmpfs and the record: this one, or one that a test running beside this one starts
        # first. Either way a sweep did it, not the killed supervisor.
        with Guard(tmp_path / "next"):
            # A neighbour's sweep that began first holds the record's lock while it cleans: this
            # Guard's own sweep then leaves the record to it (a run's suite failed at once here).
            _until(lambda: not _mounted(run_dir / "work") and not _records(harness.pid), BOUND_S)
        [cleaned] = [json.loads(line) for line in (run_dir / LOG).read_text().splitlines()]
        assert cleaned["by"].startswith("sweep by ") and cleaned["mounts"] == [str(run_dir / "work")], cleaned
    finally:
        harness.kill()
        _scrub(run_dir, leftovers, [])


def test_a_sweep_spares_a_harness_in_another_pid_namespace_from_its_first_moment(tmp_path, leftovers):
    """Its pid means nothing here (it is process 1 of its namespace): only its record's lock,
    held from the record's first moment, says it is alive."""
    run_dir = tmp_path / "run"
    harness = _start(run_dir, prefix=("unshare", "--pid", "--fork", "--mount-proc"), steps=40)
    swept = []
    try:
        def trained() -> bool:
            assert harness.poll() is None, (run_dir.parent / "harness.out").read_text()
            swept.extend(c for c in sweep() if c.run_dir == str(run_dir))
            logs = run_dir / "logs"
            return logs.is_dir() and any(e["event"] == "train.step" for p in logs.glob("rank*.jsonl")
                                         for e in read_events(p))

        _until(trained, 120, every_s=0.005)  # from before its record exists to its job training
        assert swept == []
        assert harness.wait(timeout=120) == 0, (run_dir.parent / "harness.out").read_text()
        assert not (run_dir / LOG).exists() and leftovers(run_dir) == []
    finally:
        harness.kill()
        _scrub(run_dir, leftovers, [])


def test_a_second_signal_never_cuts_short_the_stop_of_a_network_fault_run(tmp_path, leftovers):
    """Two runs at once (the cost of one): one gets SIGINT twice (Ctrl-C), the other SIGTERM twice."""
    signals = (signal.SIGINT, signal.SIGTERM)
    for sig in signals:
        (tmp_path / sig.name).mkdir()
    harnesses = {sig: _start(tmp_path / sig.name / "run", "--nnodes", "2", "--nproc-per-node", "1",
                             "--fault", "net_delay:rank=1,step=3,ms=5,duration_s=200") for sig in signals}
    names: dict[signal.Signals, list[str]] = {sig: [] for sig in signals}
    try:
        for sig, harness in harnesses.items():
            run_dir = tmp_path / sig.name / "run"
            _wait_training(harness, run_dir, faults=1)
            [made] = [n for n in journal(run_dir) if n["event"] == "harness.network"]
            names[sig] = made["namespaces"]
        for sig, harness in harnesses.items():
            run_dir = tmp_path / sig.name / "run"
            harness.send_signal(sig)
            _until(lambda: any(n["event"] == "harness.interrupt" for n in journal(run_dir)), 30, every_s=0.01)
            harness.send_signal(sig)  # while it stops the job
            harness.wait(timeout=60)
            left = leftovers(run_dir)  # the moment it said so and ended
            said = (run_dir.parent / "harness.out").read_text()
            assert harness.returncode == 130 and "the job was stopped" in said, (sig.name, said)
            assert left == [] and not set(names[sig]) & set(namespaces()) and not _records(harness.pid), \
                (sig.name, left)
    finally:
        for sig, harness in harnesses.items():
            harness.kill()
            _scrub(tmp_path / sig.name / "run", leftovers, names[sig])


def test_the_cleanup_process_starts_without_torch():
    """`python -m chaos.cleanup`, started beside every harness, imports no torch (1.7 s of CPU)."""
    code = "import sys, chaos.cleanup; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:3])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
