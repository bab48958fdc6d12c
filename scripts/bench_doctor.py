"""The doctor at cluster scale, and what a log costs: the figures of docs/measurements.md, "The doctor and the logs".

    .venv/bin/python scripts/bench_doctor.py scale [--ranks 1000] [--lines 1000000 10000000] [--old-lines 1000000]
    .venv/bin/python scripts/bench_doctor.py verdicts --ref 00cc0ef DIR [DIR ...]
    .venv/bin/python scripts/bench_doctor.py bytes --ref 00cc0ef [--collectives 2000]

`scale`: logs of a 1,000-rank job are generated (`generate`, below) at each line count, then
`python -m commlib.doctor DIR --json` runs on them in a fresh process: its wall time and
peak resident memory (the process's own `ru_maxrss`) are reported, with the verdict it
printed. With `--old-lines`, the doctor of `--ref` (a git revision, extracted to a temporary
directory) runs on logs of that size too, in the same run.

`verdicts`: every directory given is diagnosed by the doctor of `--ref` and by this one
(`--json`, each in its own process); the two diagnoses must be equal but for the fields this
one added (`job`, `unreadable`, `skipped_lines`) and float rounding; every difference is
printed, and the exit status is 1 if there is any.

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

from commlib.observe import log  # noqa: E402

TP = 8
STRAGGLER, CULPRIT = 5, 637
STEP_NS = 200_000_000  # a step of four collectives, each in its own 50 ms
LATE_NS = 30_000_000  # the straggler's lag


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


def generate(directory: Path, ranks: int, lines: int, seed: int = 0) -> dict[str, Any]:
    """Logs of a `ranks`-rank job, about `lines` lines in all (module docstring); returns what was written."""
    directory.mkdir(parents=True, exist_ok=True)
    templates = _templates()
    steps = max(1, (lines // ranks - 4) // 8)
    t0 = 1_800_000_000_000_000_000
    plan = [("all_reduce", "world", 4096), ("all_gather_single", "tp", 2048), ("reduce_scatter_single", "tp", 16384),
            ("broadcast", "world", 512)]
    written = 0
    for rank in range(ranks):
        rng = random.Random(seed * 100_003 + rank)
        pid, host = 100_000 + rank, f"node{rank // TP:04d}"
        out = [_line({"event": "log.open", "format": log.LOG_FORMAT, "rank": rank, "size": ranks, "host": host,
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
                elif step == steps - 1 and k == 0 and rank == CULPRIT:
                    break
                duration = (LATE_NS if rank != STRAGGLER else 0) + rng.randrange(100_000, 400_000)
                if step == steps - 1 and k == 0:  # the last world all_reduce: rank 637 never comes
                    fields = dict(ts=start, mono=start - t0 + mono_base, seq=seqs[comm], step=step, phase="forward",
                                  comm_rank=rank, comm_size=ranks, rank=rank, pid=pid, bytes=nbytes, op=op,
                                  comm=names[comm], shapes=json.dumps([[nbytes // 4]]), duration=0.0)
                    out.append(templates["start"].format(**fields))
                    out.append(_line({"op": op, "seq": seqs[comm], "error": "all_reduce timed out",
                                      "error_type": "CollectiveTimeout", "deadline": 1.5, "missing_ranks": [CULPRIT],
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
            m = _doctor(REPO, logdir)
            print(f"  doctor: {m['wall_s']:.2f} s wall, {m['cpu_s']:.2f} s CPU, peak {m['peak_mb']:.0f} MB; "
                  f"{_verdict(m['stdout'])}", flush=True)
            if old_tree is not None and lines == args.old_lines:
                o = _doctor(old_tree, logdir)
                print(f"  doctor of {args.ref}: {o['wall_s']:.2f} s wall, {o['cpu_s']:.2f} s CPU, peak "
                      f"{o['peak_mb']:.0f} MB; {_verdict(o['stdout'])}", flush=True)
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


def _differences(old: Any, new: Any, path: str = "", rel: float = 1e-9) -> list[str]:
    """Where two diagnoses (`--json`) differ, but for the fields this doctor added and float
    rounding (`rel`: the relative difference taken for rounding)."""
    if isinstance(old, dict) and isinstance(new, dict):
        keys = sorted((set(old) | set(new)) - (set(ADDED) if path == "" else set()))
        return [d for k in keys for d in (
            [f"{path}.{k}: missing on one side"] if k not in old or k not in new
            else _differences(old[k], new[k], f"{path}.{k}", rel))]
    if isinstance(old, list) and isinstance(new, list):
        if len(old) != len(new):
            return [f"{path}: {len(old)} items vs {len(new)}"]
        return [d for i, (a, b) in enumerate(zip(old, new)) for d in _differences(a, b, f"{path}[{i}]", rel)]
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
            found += _differences(json.loads(old["stdout"]), json.loads(new["stdout"])) if found == [] else []
            texts = [subprocess.run([sys.executable, "-m", "commlib.doctor", str(logdir)], cwd=tree, text=True,
                                    env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True).stdout
                     for tree in (old_tree, REPO)]
            if texts[0] != texts[1]:
                found.append("the reports' text differs")
            differing += bool(found)
            print(f"{'DIFFERENT' if found else 'same'}: {logdir} ({_verdict(new['stdout'])})")
            for line in found[:10]:
                print(f"    {line}")
    print(f"{len(args.dirs) - differing} of {len(args.dirs)} directories: the same verdict from {args.ref} "
          f"and this one")
    return 1 if differing else 0


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
            spec = importlib.util.spec_from_file_location(f"log_{name}", tree / "commlib" / "observe" / "log.py")
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
    g = sub.add_parser("generate", help="only write generated logs into DIR")
    g.add_argument("dir", type=Path)
    g.add_argument("--ranks", type=int, default=1000)
    g.add_argument("--lines", type=int, default=1_000_000)
    args = parser.parse_args()
    if args.cmd == "scale":
        scale(args)
    elif args.cmd == "verdicts":
        return verdicts(args)
    elif args.cmd == "bytes":
        bytes_per_collective(args)
    else:
        print(generate(args.dir, args.ranks, args.lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
