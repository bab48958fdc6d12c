"""The doctor at cluster scale, and what a log costs: the figures of docs/measurements.md, "The doctor and the logs".

    .venv/bin/python scripts/bench_doctor.py scale [--ranks 1000] [--lines 1000000 10000000] [--verdict-only]
    .venv/bin/python scripts/bench_doctor.py hangs [--ranks 1000] [--lines 1000000] [--at 0.01 0.5 0.99]
    .venv/bin/python scripts/bench_doctor.py tails DIR [DIR ...]
    .venv/bin/python scripts/bench_doctor.py windows DIR [DIR ...] [--sizes 4096 6144 8192 12288]
    .venv/bin/python scripts/bench_doctor.py verdicts --ref 00cc0ef DIR [DIR ...]
    .venv/bin/python scripts/bench_doctor.py full DIR [DIR ...] [--refs af3dcc2 ...] [--rounds 1]
    .venv/bin/python scripts/bench_doctor.py bytes --ref 00cc0ef [--collectives 2000]

`scale`: logs of a 1,000-rank job are generated (`generate`, below) at each line count, then
`python -m commlib.doctor DIR --verdict --json` (read from the end) and the full report
`python -m commlib.doctor DIR --json` each run on them in a fresh process: wall time, CPU time
and peak resident memory (the process's own `ru_maxrss`) are reported, with the verdict
printed and whether the two verdicts are the same (`_verdict_fields`). With `--old-lines`, the
doctor of `--ref` (a git revision, extracted to a temporary directory) runs on logs of that
size too, in the same run.

`hangs`: the same, on generated logs where the culprit stops at 1 %, 50 % and 99 % of the steps
and the others poll the all_reduce it never starts until the end (`generate`'s `hang_at`), and
on the deadline that expires at the end. `tails`: `--verdict` against the full report on each
directory given (the tests' logs: `pytest --basetemp DIR`, then every directory holding a rank
log). Each exits 1 if any verdict differs.

`windows`: the verdict from the end on each directory with each first window size
(`commlib.observe.verdict_from_end.verdict(DIR, window=W)`, each in a fresh process, imports not counted):
its CPU, the bytes it read and its rounds, with the verdict, which must be the same at every size.

`verdicts`: every directory given is diagnosed by the doctor of `--ref` and by this one
(`--json`, each in its own process); the two diagnoses must be equal but for the fields this
one added (`job`, `unreadable`, `skipped_lines`) and float rounding; every difference is
printed, and the exit status is 1 if there is any.

`full`: the full report (`--json`) of each revision of `--refs` and of this tree on each
directory, `--rounds` rounds of each in turn, each in a fresh process: the best wall time of
each, its CPU time and peak memory (of the process and what it forked), its ratio to the first
revision's, and whether this tree's diagnosis is the last revision's (as `scale` compares them).

`bytes`: a 2-rank gloo job (real processes, `commlib.testing.run`) issues `--collectives`
all_reduces under `commlib.context(step=..., phase=...)`, once with the commlib of `--ref`
and once with this one; each rank's log bytes per collective are reported, and the CPU time
of writing one collective's two events (`EventWriter.info`, each version's own, in one process,
interleaved) as the price of the shorter lines.

The generated logs: each rank logs its process's `log.open` line, `comm.init` for the world
and for its tensor-parallel group of 8 (comm "tp{N}"), then steps of four collectives (an
all_reduce on the world, an all_gather_single and a reduce_scatter_single on its group, a
broadcast on the world), start and end events as `Communicator` writes them (the lines of
this checkout's own writer, with the clocks, sequence numbers and step filled in), ranks
starting each collective a few microseconds apart and rank 5 always 30 ms late; at the end
rank 637 never starts the last world all_reduce, and every other rank logs its
`collective.timeout` naming it. The expected verdict: attempt 0 failed, culprit [637], a
straggler finding for rank 5.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from commlib.record import log  # noqa: E402
from commlib.record.logfile import LOG_FORMAT  # noqa: E402

TP = 8
STRAGGLER, CULPRIT = 5, 637
STEP_NS = 200_000_000  # a step of four collectives, each in its own 50 ms
LATE_NS = 30_000_000  # the straggler's lag
POLL_NS = 25_000_000  # a hung rank's short waits (`generate`, hang_at)


# ---------------------------------------------------------------------------------------
# Generated logs
# ---------------------------------------------------------------------------------------
def _templates() -> dict[str, str]:
    """The lines this checkout's writer writes for a collective's two events, as format strings."""
    with tempfile.TemporaryDirectory() as tmp:
        log.configure(0, 2, tmp)
        writer = log.event_writer(comm="world", backend="gloo", comm_rank=0, comm_size=2)
        with log.context(step=7, phase="forward"):
            writer.info("collective.start", {"op": "all_reduce", "seq": 11, "shapes": [[1024]],
                                             "dtype": "torch.float32", "bytes": 4096, "root": None, "peer": None,
                                             "deadline_s": 300.0, "async_op": False, "reduce_op": "sum"})
            writer.info("collective.end", {"op": "all_reduce", "seq": 11, "bytes": 4096, "peer": None,
                                           "duration_s": 0.000123, "status": "ok"})
        log.configure(0, 2, None)
        start, end = (Path(tmp) / "rank0.jsonl").read_text().splitlines()[1:3]
    out = {}
    for name, line in (("start", start), ("end", end)):
        event = json.loads(line)
        line = line.replace("{", "{{").replace("}", "}}")
        for key, placeholder in (("ts_ns", "{ts}"), ("mono_ns", "{mono}"), ("seq", "{seq}"), ("step", "{step}"),
                                 ("comm_rank", "{comm_rank}"), ("comm_size", "{comm_size}"), ("rank", "{rank}"),
                                 ("pid", "{pid}"), ("bytes", "{bytes}"), ("duration_s", "{duration}"),
                                 ("phase", "{phase}"), ("op", "{op}"), ("comm", "{comm}"), ("shapes", "{shapes}")):
            if key in event:
                old = f'"{key}":{json.dumps(event[key], separators=(",", ":"))}'
                assert old in line, (old, line)
                line = line.replace(old, f'"{key}":' + (f'"{placeholder}"' if isinstance(event[key], str)
                                                         else placeholder), 1)
        out[name] = line + "\n"
    return out


def _line(event: dict[str, Any]) -> str:
    return json.dumps(event, separators=(",", ":")) + "\n"


def generate(directory: Path, ranks: int, lines: int, seed: int = 0, hang_at: float | None = None) -> dict[str, Any]:
    """Logs of a `ranks`-rank job, about `lines` lines in all (module docstring); returns what was written.

    `hang_at`: instead, the culprit stops at that fraction of the steps (0.01: near the start)
    and the others, in the world all_reduce it never starts, poll it with short waits until the
    end (a `collective.wait_timeout` line every 25 ms, as many lines as the steps left would have
    written): no deadline expires, and the hang lies that far back in every rank's log."""
    directory.mkdir(parents=True, exist_ok=True)
    templates = _templates()
    steps = max(1, (lines // ranks - 4) // 8)
    culprit = CULPRIT if ranks > CULPRIT else ranks - 1
    hang_step = steps - 1 if hang_at is None else min(steps - 1, int(hang_at * steps))
    t0 = 1_800_000_000_000_000_000
    plan = [("all_reduce", "world", 4096), ("all_gather_single", "tp", 2048), ("reduce_scatter_single", "tp", 16384),
            ("broadcast", "world", 512)]
    written = 0
    for rank in range(ranks):
        rng = random.Random(seed * 100_003 + rank)
        pid, host = 100_000 + rank, f"node{rank // TP:04d}"
        out = [_line({"event": "log.open", "format": LOG_FORMAT, "rank": rank, "size": ranks, "host": host,
                      "pid": pid, "attempt": 0, "job": "bench-job", "ts_ns": t0 - 10_000_000, "mono_ns": 1_000})]
        names = {"world": "world", "tp": f"tp{rank // TP}"}
        for comm, comm_rank, comm_size in (("world", rank, ranks), ("tp", rank % TP, TP)):
            out.append(_line({"comm": names[comm], "backend": "gloo", "comm_rank": comm_rank, "comm_size": comm_size,
                              "timeout_s": 300.0, "check_consistency": False, "event": "comm.init",
                              "ts_ns": t0 - 5_000_000, "mono_ns": 5_000_000, "rank": rank, "pid": pid,
                              "attempt": 0}))
        seqs = {"world": 0, "tp": 0}
        mono_base = 1_000_000_000 + rank * 7
        for step in range(steps):
            for k, (op, comm, nbytes) in enumerate(plan):
                seqs[comm] += 1
                start = t0 + step * STEP_NS + k * (STEP_NS // 4) + rng.randrange(0, 20_000)
                if rank == STRAGGLER:
                    start += LATE_NS
                elif step == hang_step and k == 0 and rank == culprit:
                    break
                duration = (LATE_NS if rank != STRAGGLER else 0) + rng.randrange(100_000, 400_000)
                if step == hang_step and k == 0:  # the world all_reduce the culprit never comes to
                    fields = dict(ts=start, mono=start - t0 + mono_base, seq=seqs[comm], step=step, phase="forward",
                                  comm_rank=rank, comm_size=ranks, rank=rank, pid=pid, bytes=nbytes, op=op,
                                  comm=names[comm], shapes=json.dumps([[nbytes // 4]]), duration=0.0)
                    out.append(templates["start"].format(**fields))
                    if hang_at is not None:
                        out += [_line({"op": op, "seq": seqs[comm], "peer": None, "waited_s": 0.025,
                                       "elapsed_s": (i + 1) * 0.025, "deadline_s": 300.0,
                                       "event": "collective.wait_timeout", "step": step, "phase": "forward",
                                       "ts_ns": start + (i + 1) * POLL_NS, "mono_ns": start - t0 + mono_base + (i + 1) * POLL_NS,
                                       "comm": comm, "backend": "gloo", "comm_rank": rank, "comm_size": ranks,
                                       "rank": rank, "pid": pid, "attempt": 0}) for i in range((steps - step) * 8)]
                        break
                    out.append(_line({"op": op, "seq": seqs[comm], "error": "all_reduce timed out",
                                      "error_type": "CollectiveTimeout", "deadline": 1.5, "missing_ranks": [culprit],
                                      "duration_s": 1.5, "status": "timed_out", "event": "collective.timeout",
                                      "level": "error", "step": step, "phase": "forward",
                                      "ts_ns": start + 1_500_000_000, "mono_ns": start - t0 + mono_base + 1_500_000_000,
                                      "comm": comm, "backend": "gloo", "comm_rank": rank, "comm_size": ranks,
                                      "rank": rank, "pid": pid, "attempt": 0}))
                    break
                comm_rank, comm_size = (rank, ranks) if comm == "world" else (rank % TP, TP)
                phase = "forward" if k < 2 else "backward"
                shapes = json.dumps([[nbytes // 4]])
                for name, ts, dur in (("start", start, 0.0), ("end", start + duration, duration / 1e9)):
                    out.append(templates[name].format(ts=ts, mono=ts - t0 + mono_base, seq=seqs[comm], step=step,
                                                      phase=phase, comm_rank=comm_rank, comm_size=comm_size,
                                                      rank=rank, pid=pid, bytes=nbytes, op=op, comm=names[comm],
                                                      shapes=shapes, duration=dur))
            else:
                continue
            break
        (directory / f"rank{rank}.jsonl").write_text("".join(out))
        written += len(out)
    return {"ranks": ranks, "lines": written, "bytes": sum(p.stat().st_size for p in directory.iterdir()),
            "steps": steps}


# ---------------------------------------------------------------------------------------
# Measuring the doctor
# ---------------------------------------------------------------------------------------
def _checkout(ref: str, into: Path) -> Path:
    """The packages of git revision `ref`, extracted into `into` (for its doctor and its writer)."""
    into.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", ref, "commlib", "chaos", "fsdp_overlap"],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def _doctor(tree: Path, logdir: Path, *extra: str) -> dict[str, Any]:
    """`python -m commlib.doctor LOGDIR --json` of the checkout at `tree`, in a process of its own:
    its wall time, its peak resident memory (its own `ru_maxrss`, read by a parent of its own
    that runs nothing else), its CPU time, exit status and output."""
    code = ("import json, resource, subprocess, sys, time\n"
            "t = time.perf_counter()\n"
            "p = subprocess.run(sys.argv[1:], capture_output=True)\n"
            "wall = time.perf_counter() - t\n"
            "r = resource.getrusage(resource.RUSAGE_CHILDREN)\n"
            "print(json.dumps({'wall_s': wall, 'cpu_s': r.ru_utime + r.ru_stime, 'peak_mb': r.ru_maxrss / 1024, "
            "'exit': p.returncode, 'stdout': p.stdout.decode(), 'stderr': p.stderr.decode()[-2000:]}))\n")
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run([sys.executable, "-c", code, sys.executable, "-m", "commlib.doctor", str(logdir), "--json",
                           *extra], cwd=tree, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def _verdict(stdout: str) -> str:
    try:
        d = json.loads(stdout)
    except ValueError:
        return "no JSON"
    parts = [f"exit {d['exit_code']}"]
    for a in d["attempts"]:
        kinds = sorted({p["kind"] for p in a["problems"]})
        parts.append(f"attempt {a['attempt']} {a['status']} culprits {a['culprits']} problems {kinds} "
                     f"{a['collectives']} collectives")
    return "; ".join(parts)


def _verdict_fields(diagnosis: dict[str, Any]) -> dict[str, Any]:
    """What a diagnosis (`--json`) concludes that `--verdict` concludes too (`tail.verdict_fields`):
    no statistics, no straggler, no counts of collectives, not when the logs begin."""
    attempts = []
    for a in diagnosis["attempts"]:
        problems = [p for p in a["problems"] if p["kind"] != "straggler"]
        attempts.append({**{k: v for k, v in a.items() if k not in ("collectives", "p2p_ops", "start_ns")},
                         "problems": problems, "culprits": next((sorted(p["ranks"]) for p in problems if p["ranks"]), [])})
    return {"exit_code": diagnosis["exit_code"], "attempts": attempts}


def _tail_and_full(logdir: Path, full: bool = True) -> tuple[dict[str, Any], dict[str, Any] | None, list[str]]:
    """`--verdict` and (with `full`) the full report on `logdir`, each in a process of its own, and
    where their verdicts differ."""
    tail = _doctor(REPO, logdir, "--verdict")
    if not tail["stdout"]:  # refused: the full read must refuse alike
        tail["read"] = f"refused: {tail['stderr'].strip()[:100]}"
        whole = _doctor(REPO, logdir)
        return tail, whole, [] if (whole["exit"], whole["stderr"]) == (tail["exit"], tail["stderr"]) else ["refusal"]
    read = json.loads(tail["stdout"])["read"]
    tail["read"] = (f"read {_mb(read['bytes_read'])} of {_mb(read['bytes_total'])}"
                    + (f", in full: {read['full_read_because']}" if read["full_read_because"] else ""))
    if not full:
        return tail, None, []
    whole = _doctor(REPO, logdir)
    found = _differences(_verdict_fields(json.loads(whole["stdout"])), _verdict_fields(json.loads(tail["stdout"])))
    return tail, whole, found


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def _say(what: str, m: dict[str, Any]) -> str:
    return f"{what}: {m['wall_s']:.2f} s wall, {m['cpu_s']:.2f} s CPU, peak {m['peak_mb']:.0f} MB"


def scale(args: argparse.Namespace) -> None:
    root = Path(tempfile.mkdtemp(prefix="bench_doctor_"))
    try:
        old_tree = _checkout(args.ref, root / "old") if args.old_lines else None
        for lines in args.lines:
            logdir = root / f"logs_{lines}"
            t = time.perf_counter()
            made = generate(logdir, args.ranks, lines)
            print(f"generated {made['lines']:,} lines, {made['bytes'] / 1e6:.0f} MB, {args.ranks} ranks, "
                  f"{made['steps']} steps in {time.perf_counter() - t:.1f} s", flush=True)
            tail, m, found = _tail_and_full(logdir, full=not args.verdict_only)
            print(f"  {_say('--verdict', tail)} ({tail['read']}); {_verdict(tail['stdout'])}", flush=True)
            if m is not None:
                print(f"  {_say('full report', m)}; {_verdict(m['stdout'])}", flush=True)
                print(f"  the same verdict from the end as from the full read: {not found}")
                for line in found[:10]:
                    print(f"    {line}")
            if old_tree is not None and m is not None and lines == args.old_lines:
                o = _doctor(old_tree, logdir)
                print(f"  {_say(f'doctor of {args.ref}', o)}; {_verdict(o['stdout'])}", flush=True)
                old, new = json.loads(o["stdout"]), json.loads(m["stdout"])
                verdict = _differences(_verdict_of(old), _verdict_of(new))
                tables = _differences({k: old[k] for k in TABLES}, {k: new[k] for k in TABLES}, rel=SKETCH_ERROR)
                print(f"  the same verdict (exit, every attempt's status, culprits, problems and where each rank "
                      f"was): {not verdict}; the same tables within {SKETCH_ERROR:.1%}: {not tables}")
                for line in (verdict + tables)[:10]:
                    print(f"    {line}")
            shutil.rmtree(logdir)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def hangs(args: argparse.Namespace) -> int:
    """Hangs at the start, middle and end of a long log, and a deadline expired at its end:
    `--verdict` against the full report on each."""
    differing = 0
    root = Path(tempfile.mkdtemp(prefix="bench_doctor_hangs_"))
    try:
        for at in (*args.at, None):
            logdir = root / f"hang_{at}"
            made = generate(logdir, args.ranks, args.lines, hang_at=at)
            what = f"hang at {at:.0%} of the steps" if at is not None else "deadline expired at the end"
            print(f"{what}: {made['lines']:,} lines, {made['bytes'] / 1e6:.0f} MB, {args.ranks} ranks", flush=True)
            tail, m, found = _tail_and_full(logdir)
            assert m is not None
            print(f"  {_say('--verdict', tail)} ({tail['read']}); {_verdict(tail['stdout'])}")
            print(f"  {_say('full report', m)}; the same verdict: {not found}", flush=True)
            for line in found[:10]:
                print(f"    {line}")
            differing += bool(found)
            shutil.rmtree(logdir)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 1 if differing else 0


def tails(args: argparse.Namespace) -> int:
    """`--verdict` against the full report on each directory (the tests' logs, say)."""
    differing = 0
    for logdir in args.dirs:
        tail, _, found = _tail_and_full(logdir)
        differing += _said(logdir, found, f"{tail['read']}; {_verdict(tail['stdout'])}")
    return _tally(len(args.dirs), differing, "from the end as from the full read")


_WINDOW_CHILD = """
import json, sys, time
from commlib.observe.verdict_from_end import verdict, verdict_fields
start = time.process_time()
d = verdict(sys.argv[1], window=int(sys.argv[2]))
cpu = time.process_time() - start
print(json.dumps({"cpu_s": cpu, "read": d.read.bytes_read, "rounds": d.read.rounds,
                  "full": d.read.full_read_because, "verdict": [verdict_fields(a) for a in d.attempts]},
                 default=str))
"""


def windows(args: argparse.Namespace) -> int:
    """The verdict's CPU and bytes read on each directory, for each first window size."""
    differing = 0
    for logdir in args.dirs:
        seen = []
        for size in args.sizes:
            out = subprocess.run([sys.executable, "-c", _WINDOW_CHILD, str(logdir), str(size)], cwd=REPO,
                                 capture_output=True, text=True, check=True)
            r = json.loads(out.stdout)
            seen.append(r["verdict"])
            how = f"read in full ({r['full']})" if r["full"] else f"{r['rounds']} rounds"
            print(f"{logdir} window {size / 1024:g} kB: {r['cpu_s']:.2f} s CPU, {_mb(r['read'])} read, {how}")
        if any(v != seen[0] for v in seen):
            differing += 1
            print(f"DIFFERENT verdicts across window sizes: {logdir}")
    return _tally(len(args.dirs), differing, "at every window size")


def _said(logdir: Path, found: list[str], summary: str) -> int:
    """Whether `logdir`'s two verdicts differ (1) or not (0), printed with where they differ."""
    print(f"{'DIFFERENT' if found else 'same'}: {logdir} ({summary})")
    for line in found[:10]:
        print(f"    {line}")
    return int(bool(found))


def _tally(dirs: int, differing: int, how: str) -> int:
    print(f"{dirs - differing} of {dirs} directories: the same verdict {how}")
    return 1 if differing else 0


# ---------------------------------------------------------------------------------------
# The same verdicts
# ---------------------------------------------------------------------------------------
ADDED = ("job", "unreadable", "skipped_lines")  # Diagnosis fields this doctor added
TABLES = ("ops", "stragglers")  # statistics: from sketches past a thousand values (commlib.observe.sketch)
SKETCH_ERROR = 0.006  # half a bucket of the sketch (0.5 %), and float rounding


def _verdict_of(diagnosis: dict[str, Any]) -> dict[str, Any]:
    """What a diagnosis concludes, without its tables, and without when the logs begin: the
    doctor of an older revision takes each process's `log.open` line (which it does not know)
    for its first event."""
    return {"exit_code": diagnosis["exit_code"],
            "attempts": [{k: v for k, v in a.items() if k != "start_ns"} for a in diagnosis["attempts"]]}


def _differences(old: Any, new: Any, path: str = "", rel: float = 1e-9, added: tuple[str, ...] = ADDED) -> list[str]:
    """Where two diagnoses (`--json`) differ, but for the fields this doctor added (`added`, and
    any key the old diagnosis lacks) and float rounding (`rel`: the relative difference taken
    for rounding)."""
    if isinstance(old, dict) and isinstance(new, dict):
        if set(new) - set(old) and not added:
            return [f"{path}: keys {sorted(set(new) - set(old))} only in the second"]
        keys = sorted(set(old) - (set(added) if path == "" else set()))
        return [d for k in keys for d in (
            [f"{path}.{k}: missing in this one"] if k not in new
            else _differences(old[k], new[k], f"{path}.{k}", rel, added))]
    if isinstance(old, list) and isinstance(new, list):
        if len(old) != len(new):
            return [f"{path}: {len(old)} items vs {len(new)}"]
        return [d for i, (a, b) in enumerate(zip(old, new)) for d in _differences(a, b, f"{path}[{i}]", rel, added)]
    if isinstance(old, float) and isinstance(new, float):
        return [] if math.isclose(old, new, rel_tol=rel, abs_tol=1e-12) else [f"{path}: {old} vs {new}"]
    return [] if old == new else [f"{path}: {str(old)[:200]} vs {str(new)[:200]}"]


def verdicts(args: argparse.Namespace) -> int:
    """Both doctors on every directory: the JSON diagnoses equal, and the reports word for word."""
    differing = 0
    with tempfile.TemporaryDirectory() as tmp:
        old_tree = _checkout(args.ref, Path(tmp) / "old")
        for logdir in args.dirs:
            old, new = _doctor(old_tree, logdir), _doctor(REPO, logdir)
            found = [f"exit {old['exit']} vs {new['exit']}"] if old["exit"] != new["exit"] else []
            if not found and old["stdout"] and new["stdout"]:
                found += _differences(json.loads(old["stdout"]), json.loads(new["stdout"]))
            elif not found and old["stderr"] != new["stderr"]:  # refused (exit 2): the same refusal
                found.append(f"stderr: {old['stderr'][-300:]!r} vs {new['stderr'][-300:]!r}")
            texts = [subprocess.run([sys.executable, "-m", "commlib.doctor", str(logdir)], cwd=tree, text=True,
                                    env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True).stdout
                     for tree in (old_tree, REPO)]
            if texts[0] != texts[1]:
                found.append("the reports' text differs")
            differing += _said(logdir, found, _verdict(new["stdout"]))
    return _tally(len(args.dirs), differing, f"from {args.ref} and this one")


# ---------------------------------------------------------------------------------------
# Bytes per collective, and the cost of writing them
# ---------------------------------------------------------------------------------------
_BYTES_RUN = """
import json, os, sys, torch, commlib
from pathlib import Path
from commlib.testing import run

def job(comm, log_dir, n):
    path = Path(log_dir) / f"rank{comm.rank}.jsonl"
    before = path.stat().st_size
    t = torch.ones(1024)
    for step in range(n):
        with commlib.context(step=step, phase="forward"):
            comm.all_reduce(t)
    return (path.stat().st_size - before) / n

if __name__ == "__main__":
    print(json.dumps(run(job, 2, timeout=300, args=(sys.argv[1], int(sys.argv[2])), log_dir=sys.argv[1])))
"""


def _writer_cost(trees: dict[str, Path], rounds: int = 15, per_round: int = 2000) -> dict[str, float]:
    """CPU microseconds to write one collective's two events with each tree's own log writer,
    measured in one process, interleaved round by round (median of rounds)."""
    import importlib.util
    import resource

    import torch

    writers = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, tree in trees.items():
            writer = tree / "commlib" / "record" / "log.py"  # before the writer had a package: observe/log.py
            writer = writer if writer.exists() else tree / "commlib" / "observe" / "log.py"
            spec = importlib.util.spec_from_file_location(f"log_{name}", writer)
            module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
            sys.modules[spec.name] = module  # type: ignore[union-attr]  # dataclasses look their module up
            spec.loader.exec_module(module)  # type: ignore[union-attr]
            module.configure(0, 2, Path(tmp) / name)
            writers[name] = (module, module.event_writer(comm="world", backend="gloo", comm_rank=0, comm_size=2))
        shape = torch.ones(1024).shape
        samples: dict[str, list[float]] = {name: [] for name in trees}
        for _ in range(rounds):
            for name, (module, writer) in writers.items():
                with module.context(step=7, phase="forward"):
                    t = resource.getrusage(resource.RUSAGE_SELF)
                    for seq in range(per_round):
                        writer.info("collective.start", {
                            "op": "all_reduce", "seq": seq, "shapes": [shape], "dtype": "torch.float32",
                            "bytes": 4096, "root": None, "peer": None, "deadline_s": 300.0, "async_op": False,
                            "reduce_op": "sum"})
                        writer.info("collective.end", {"op": "all_reduce", "seq": seq, "bytes": 4096, "peer": None,
                                                       "duration_s": 0.000123, "status": "ok"})
                    u = resource.getrusage(resource.RUSAGE_SELF)
                samples[name].append((u.ru_utime + u.ru_stime - t.ru_utime - t.ru_stime) / per_round * 1e6)
        for module, _ in writers.values():
            module.configure(0, 2, None)
    return {name: sorted(v)[len(v) // 2] for name, v in samples.items()}


def bytes_per_collective(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        trees = {args.ref: _checkout(args.ref, Path(tmp) / "old"), "this checkout": REPO}
        script = Path(tmp) / "bytes_run.py"
        script.write_text(_BYTES_RUN)
        for name, tree in trees.items():
            logdir = Path(tmp) / f"logs_{len(name)}"
            done = subprocess.run([sys.executable, str(script), str(logdir), str(args.collectives)], cwd=tmp,
                                  env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True, text=True,
                                  check=True)
            per_rank = json.loads(done.stdout.strip().splitlines()[-1])
            print(f"{name}: {per_rank[0]:.0f} bytes of log per collective per rank "
                  f"(2 ranks, gloo, all_reduce of 4 KiB under commlib.context(step, phase); {args.collectives} "
                  f"collectives)")
        cost = _writer_cost(trees)
        for name, us in cost.items():
            print(f"{name}: {us:.2f} us of CPU to write a collective's two events (median of 15 interleaved rounds)")


def full(args: argparse.Namespace) -> int:
    """The full report of each `--refs` revision and of this tree on each directory, in rounds
    (each doctor in a fresh process, one after the other in each round), the best of each, its
    ratio to the first revision's, and whether every diagnosis is the first one's (but for
    fields a later doctor added, and the statistics within the sketch's error)."""
    differing = 0
    with tempfile.TemporaryDirectory() as tmp:
        trees = {ref: _checkout(ref, Path(tmp) / ref) for ref in args.refs}
        trees["this tree"] = REPO
        for logdir in args.dirs:
            runs: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
            for _ in range(args.rounds):
                for name, tree in trees.items():
                    runs[name].append(_doctor(tree, logdir))
                    print(f"  {logdir} {_say(name, runs[name][-1])}, load {os.getloadavg()[0]:.1f}", flush=True)
            best = {name: min(r, key=lambda m: m["wall_s"]) for name, r in runs.items()}
            for name, m in best.items():
                print(f"{logdir}: {_say(name, m)} (best of {args.rounds}); "
                      f"{m['wall_s'] / best[args.refs[0]]['wall_s']:.3f}x {args.refs[0]}'s wall time", flush=True)
            last, mine = json.loads(best[args.refs[-1]]["stdout"]), json.loads(best["this tree"]["stdout"])
            found = _differences(_verdict_of(last), _verdict_of(mine)) + _differences(
                {k: last[k] for k in TABLES}, {k: mine[k] for k in TABLES}, rel=SKETCH_ERROR)
            differing += bool(found)
            print(f"{logdir}: the same diagnosis from this tree as from {args.refs[-1]}: {not found}")
            for line in found[:10]:
                print(f"    {line}")
    return 1 if differing else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("scale", help="time and memory of the doctor on generated logs of a large job")
    s.add_argument("--ranks", type=int, default=1000)
    s.add_argument("--lines", type=int, nargs="+", default=[1_000_000, 10_000_000])
    s.add_argument("--old-lines", type=int, default=None, help="also run the doctor of --ref at this size")
    s.add_argument("--ref", default="00cc0ef")
    v = sub.add_parser("verdicts", help="the doctor of --ref and this one on each directory: the same verdict?")
    v.add_argument("dirs", type=Path, nargs="+")
    v.add_argument("--ref", default="00cc0ef")
    b = sub.add_parser("bytes", help="log bytes per collective, and the cost of writing them, --ref vs this one")
    b.add_argument("--ref", default="00cc0ef")
    b.add_argument("--collectives", type=int, default=2000)
    s.add_argument("--verdict-only", action="store_true", help="only --verdict (the full report takes minutes)")
    h = sub.add_parser("hangs", help="--verdict against the full report on hangs at the start, middle and end")
    h.add_argument("--ranks", type=int, default=1000)
    h.add_argument("--lines", type=int, default=1_000_000)
    h.add_argument("--at", type=float, nargs="+", default=[0.01, 0.5, 0.99])
    t = sub.add_parser("tails", help="--verdict against the full report on each directory")
    t.add_argument("dirs", type=Path, nargs="+")
    w = sub.add_parser("windows", help="the verdict's CPU and bytes read for each first window size")
    w.add_argument("dirs", type=Path, nargs="+")
    w.add_argument("--sizes", type=int, nargs="+", default=[4096, 6144, 8192, 12288])
    f = sub.add_parser("full", help="the full report of --refs and this tree on each directory, best of --rounds")
    f.add_argument("dirs", type=Path, nargs="+")
    f.add_argument("--refs", nargs="+", default=["af3dcc2"])
    f.add_argument("--rounds", type=int, default=1)
    g = sub.add_parser("generate", help="only write generated logs into DIR")
    g.add_argument("dir", type=Path)
    g.add_argument("--ranks", type=int, default=1000)
    g.add_argument("--lines", type=int, default=1_000_000)
    g.add_argument("--hang-at", type=float, default=None)
    args = parser.parse_args()
    if args.cmd == "scale":
        scale(args)
    elif args.cmd == "hangs":
        return hangs(args)
    elif args.cmd == "tails":
        return tails(args)
    elif args.cmd == "windows":
        return windows(args)
    elif args.cmd == "verdicts":
        return verdicts(args)
    elif args.cmd == "full":
        return full(args)
    elif args.cmd == "bytes":
        bytes_per_collective(args)
    else:
        print(generate(args.dir, args.ranks, args.lines, hang_at=args.hang_at))
    return 0


if __name__ == "__main__":
    sys.exit(main())
