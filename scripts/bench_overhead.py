"""commlib's added cost per collective, against raw torch.distributed in the same run.

2 ranks, gloo on loopback, all_reduce of 4 B, 4 KiB and 4 MiB. Each configuration runs
in its own pair of processes and measures five paths interleaved (raw, commlib, backend,
raw async, commlib async, raw, ... in rounds), so machine noise hits them alike: raw is a
synchronous `dist.all_reduce` on a plain gloo group, commlib is `Communicator.all_reduce`,
backend is `dist.all_reduce` on the default group, which `commlib.init` made with
`backend="commlib"` (the path an unmodified trainer takes); raw async and commlib async
issue with `async_op=True` and then `wait()` (FSDP2's path). The figures are medians over
rounds of (path - raw) per call, async against raw async, in wall time and in CPU time of
the calling thread (stable where wall time is not; see `_interleaved`).

Configurations: commlib as shipped (flight recorder + progress board on, no log dir),
with JSON logs (a log dir), and with the consistency check, as a CPU engine runs it (digests
on the engine) and as a GPU one does (fingerprints through the store). Also measured: the flight
recorder + progress board bookkeeping alone (one process, no communication), the
diagnosis latency (deadline expiry to CollectiveTimeout raised, over 20 timeouts), and
commlib's own layers alone: Communicator and process group calls over an engine whose ops
complete at launch, which is commlib's CPU per call with no peer or engine thread beside it,
warm (tight loops) and cold (each call after the L2 cache was evicted, the model of a call
made between collectives; see `_own_layers_us`), with the Python bytecodes each path executes
per call (the same in every run). These hold from run to run far better than the figures
against raw, which move by more than the targets. The backend path's layer-by-layer split (1
rank, real gloo) also counts context switches per call: whether a layer blocks more than raw.

    .venv/bin/python scripts/bench_overhead.py [--rounds 30] [--iters 200] [--trials 20]
    .venv/bin/python scripts/bench_overhead.py --one-rank   # only the 1-rank figures (a quick rerun)
    .venv/bin/python scripts/bench_overhead.py --own-layers  # only commlib's own layers, warm and cold (1 min)

`--own-layers` measures whichever commlib is imported, so another checkout's can be measured
by the same script: `PYTHONPATH=OTHER_CHECKOUT .venv/bin/python scripts/bench_overhead.py --own-layers`.
The other parts run in ranks forked from a server that imports commlib from the current
directory first: to measure another checkout with them, run the script from a directory that
holds none (`cd /tmp && PYTHONPATH=OTHER_CHECKOUT CHECKOUT/.venv/bin/python CHECKOUT/scripts/...`).
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d_opts  # the option objects c10d methods take

import commlib
from commlib import testing
from commlib.communicator import ABORT_POLL_S, Communicator
from commlib.ops import Collective, OpName, ReduceOp
from commlib.process_group import CommlibProcessGroup
from commlib.record import log
from commlib.record.board import ProgressBoard
from commlib.record.flight import FlightRecorder

SIZES = {"4 B": 1, "4 KiB": 1024, "4 MiB": 1024 * 1024}


def _interleaved(comm: commlib.Communicator, rounds: int, iters: int,
                 check_through_store: bool = False) -> dict[str, dict[str, float]]:
    """Per size: median per-call wall time and calling-thread CPU time of the paths, and their differences.

    Each added CPU figure is (median, first quartile, third quartile) over rounds.
    `check_through_store`: the consistency check compares fingerprints through the store
    alone, as on a GPU (and as every check did before digests went through the engine).

    The wall-time difference is what a trainer feels, but on a 2-core machine two ranks'
    scheduling noise is hundreds of microseconds; the CPU time the calling thread spends
    per call (gloo waits on a condition variable, which costs none) is stable to a few
    microseconds, and commlib's whole added cost is CPU work on that thread.
    """
    if check_through_store:
        comm._consistency.via_engine = False
    out: dict[str, dict[str, float]] = {}
    plain = dist.new_group(backend="gloo")  # torch's own gloo group, beside commlib's default one
    for label, numel in SIZES.items():
        t = torch.ones(numel)
        n = max(20, iters // max(1, numel // 4096))  # fewer calls for the big message, enough to time
        paths = {"raw": lambda: dist.all_reduce(t, group=plain), "commlib": lambda: comm.all_reduce(t),
                 "backend": lambda: dist.all_reduce(t),
                 "raw async": lambda: dist.all_reduce(t, group=plain, async_op=True).wait(),
                 "async": lambda: comm.all_reduce(t, async_op=True).wait()}
        for run in paths.values():  # warm up every path
            for _ in range(3):
                run()
        wall: dict[str, list[float]] = {k: [] for k in paths}
        cpu: dict[str, list[float]] = {k: [] for k in paths}
        for _ in range(rounds):
            for name, run in paths.items():
                comm.barrier()
                start, start_cpu = time.perf_counter(), time.thread_time()
                for _ in range(n):
                    run()
                wall[name].append((time.perf_counter() - start) / n * 1e6)
                cpu[name].append((time.thread_time() - start_cpu) / n * 1e6)
        out[label] = {
            "raw_us": statistics.median(wall["raw"]),
            "commlib_us": statistics.median(wall["commlib"]),
            "added_us": statistics.median(b - a for a, b in zip(wall["raw"], wall["commlib"])),
            "raw_cpu_us": statistics.median(cpu["raw"]),
            "added_cpu_us": _spread(cpu["raw"], cpu["commlib"]),
            "backend_added_cpu_us": _spread(cpu["raw"], cpu["backend"]),
            "async_added_cpu_us": _spread(cpu["raw async"], cpu["async"]),
        }
    return out


def _spread(base: list[float], path: list[float]) -> tuple[float, float, float]:
    """Median, first and third quartile over rounds of (path - base)."""
    q1, median, q3 = statistics.quantiles([b - a for a, b in zip(base, path)], n=4)
    return median, q1, q3


def _cpu(figure: tuple[float, float, float]) -> str:
    return f"{figure[0]:+.1f} ({figure[1]:+.1f}..{figure[2]:+.1f})"


def _diagnosis_latency(comm: commlib.Communicator, trials: int, deadline: float) -> list[float]:
    lateness = []
    for i in range(trials):
        sub = comm.split([0, 1], f"trial{i}")
        if comm.rank == 0:
            start = time.monotonic()
            try:
                sub.all_reduce(torch.ones(1), timeout=deadline)
            except commlib.CollectiveTimeout:
                lateness.append(time.monotonic() - start - deadline)
        comm.barrier()  # rank 1 waits here: it never joins the sub-communicator's collective
    return lateness


def _switches() -> int:
    """Context switches of the calling thread so far, voluntary and not (Linux's /proc)."""
    with open("/proc/thread-self/status") as status:
        return sum(int(line.split(":")[1]) for line in status if "ctxt_switches:" in line)


def _fresh_options(async_op: bool = True) -> Any:
    """The option object torch's `dist.all_reduce` makes for each call (`async_op=False`: a
    synchronous call's; C++ callers leave it True). Never one object for every call: c10d
    hands back its reduction as the same Python object each time, so a lookup keyed by it
    would be found by identity, as no trainer's call is."""
    opts = c10d_opts.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    opts.asyncOp = async_op
    return opts


def _layers_in_context(comm: commlib.Communicator, rounds: int,
                       calls: int) -> dict[str, tuple[float, float]]:
    """Per layer of the backend path (1 rank, real gloo, 4 KiB all_reduce), outermost last,
    and raw, interleaved in rounds: median CPU us per call, and context switches per call.

    The switches say whether a layer makes its thread block and resume more often than raw:
    where they are equal, what a layer adds in context is CPU work on its own code and data.
    The process group's layer builds c10d's option object for each call, as torch's
    `dist.all_reduce` (the next layer) does (`_fresh_options`)."""
    plain = dist.new_group(backend="gloo")
    t = torch.ones(1024)
    engine_opts = c10d_opts.AllreduceOptions()
    engine_opts.timeout = timedelta(seconds=comm.timeout)
    first_slice = timedelta(seconds=ABORT_POLL_S)  # what the Communicator's sync wait starts with
    backend = comm._backend  # the bench reaches past the API on purpose: each layer alone
    engine, group = backend.engine, dist.distributed_c10d._get_default_group()
    call = Collective(OpName.ALL_REDUCE, comm.name, 0, 1, False, comm.timeout, tensor=t, reduce_op=ReduceOp.SUM)
    layers: dict[str, Callable[[], object]] = {
        "gloo engine alone (its allreduce + wait)": lambda: engine.allreduce([t], engine_opts).wait(first_slice),
        "+ commlib's engine backend (C10dBackend launch + wait)":
            lambda: backend.launch(call, engine_opts.timeout).wait(first_slice),
        "+ Communicator (Communicator.all_reduce)": lambda: comm.all_reduce(t),
        "+ process group method (CommlibProcessGroup.allreduce, fresh options)":
            lambda: group.allreduce([t], _fresh_options(async_op=False)),
        "+ torch's dist.all_reduce (the backend path)": lambda: dist.all_reduce(t),
        "raw: torch's dist.all_reduce on a gloo group": lambda: dist.all_reduce(t, group=plain),
    }
    cpu: dict[str, list[float]] = {name: [] for name in layers}
    switched: dict[str, int] = dict.fromkeys(layers, 0)
    for run in layers.values():
        for _ in range(50):
            run()
    for _ in range(rounds):
        for name, run in layers.items():
            switches, start = _switches(), time.thread_time()
            for _ in range(calls):
                run()
            cpu[name].append((time.thread_time() - start) / calls * 1e6)
            switched[name] += _switches() - switches
    return {name: (statistics.median(us), switched[name] / (rounds * calls)) for name, us in cpu.items()}


def _print_layers(rounds: int, calls: int) -> None:
    layers = testing.run(_layers_in_context, 1, timeout=600, args=(rounds, calls))[0]
    print("\nthe backend path layer by layer, 1 rank, 4 KiB all_reduce, CPU us per call (step from the layer above), "
          "context switches per call:")
    below = None
    for name, (us, switches) in layers.items():
        step = "" if below is None or name.startswith("raw") else f" ({us - below:+.1f})"
        print(f"  {name}: {us:.1f}{step}, {switches:.2f} switches")
        below = us


def _bookkeeping_us(calls: int = 20000) -> float:
    """Flight recorder + progress board work per collective, alone, in this process (CPU of
    this thread: the board's publishing thread runs beside it, as it does beside a trainer)."""
    store = dist.HashStore()
    recorder = FlightRecorder("bench", 0, 2000)
    board = ProgressBoard(store, 0, 2, 0)
    call = Collective(OpName.ALL_REDUCE, "bench", 0, 2, False, 10.0, tensor=torch.ones(1024))

    def one_pass() -> float:
        start = time.thread_time()
        for seq in range(calls):
            call.seq = seq
            entry = recorder.start(call)
            board.started(seq, "all_reduce", call.context)
            FlightRecorder.end(entry, "completed")
            board.finished(seq, "all_reduce")
        return time.thread_time() - start

    one_pass()  # the first fills the ring and warms the code: 2-3x a later pass
    spent = one_pass()
    board.close()
    return spent / calls * 1e6


class _DoneWork:
    """An engine's handle for an op that completed at launch."""

    def wait(self, timeout: timedelta) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class _InstantEngine:
    """A backend whose every op completes at launch (only what an issue and a wait touch):
    under it, a call's CPU is commlib's own layers and nothing else, with no peer and no
    engine thread to share the cores with, so the figure is the same from run to run."""

    name, rank, size, device, resumable_wait, events = "gloo", 0, 1, torch.device("cpu"), True, None
    _done = _DoneWork()

    def launch(self, call: Collective, timeout: timedelta) -> _DoneWork:
        return self._done

    def supports(self, device: torch.device, op: object) -> None:
        return None


def _own_layers_us(calls: int = 20000, cold_samples: int = 400) -> dict[str, dict[str, float]]:
    """CPU per 4 KiB all_reduce of commlib's layers alone, over `_InstantEngine`: warm (the
    best of 5 tight loops) and cold (each call alone, after the L2 cache was evicted); and
    the Python bytecodes each path executes per call (`_bytecodes`).

    Cold is the in-context model: a rank's calling thread resumes after each collective on
    caches the engine's threads, the peer and the message itself have filled, so what a call
    costs there follows from how much code and data it touches, not from how fast it runs in
    a tight loop. Before each timed call a 4 MiB buffer is written (as a 4 MiB message's data
    passes through the cache), and the call is timed alone (wall time; nothing else runs on
    this thread and no peer waits), median over `cold_samples` calls per path, the paths in
    random order each round, less the same measure of an empty call. torch's own
    `dist.all_reduce` over the process group is measured alongside: what its Python wrapper
    adds on top of the process group is what the raw baseline pays too.

    Run last in this process: turning logs on points this process's log at a temp dir
    (removed after; its lines are 2 per call, ~60 MB per path measured).
    """
    t = torch.ones(1024)
    evicting = torch.empty(4 << 20, dtype=torch.uint8)

    def hot(paths: dict[str, Callable[[], object]]) -> dict[str, float]:
        figures = {}
        for name, fn in paths.items():
            runs = []
            for _ in range(5):
                start = time.thread_time()
                for _ in range(calls):
                    fn()
                runs.append((time.thread_time() - start) / calls * 1e6)
            figures[name] = min(runs)
        return figures

    def cold(paths: dict[str, Callable[[], object]]) -> dict[str, float]:
        paths = {"(empty call)": lambda: None, **paths}
        samples: dict[str, list[int]] = {name: [] for name in paths}
        order = list(paths.items())
        for _ in range(cold_samples):
            random.shuffle(order)
            for name, fn in order:
                evicting.add_(1)
                start = time.perf_counter_ns()
                fn()
                samples[name].append(time.perf_counter_ns() - start)
        empty = statistics.median(samples.pop("(empty call)"))
        return {name: (statistics.median(ns) - empty) / 1e3 for name, ns in samples.items()}

    def paths(comm: commlib.Communicator) -> dict[str, Callable[[], object]]:
        group = CommlibProcessGroup({"cpu": comm}, 0, 1)
        return {"sync": lambda: comm.all_reduce(t),
                "async issue + wait": lambda: comm.all_reduce(t, async_op=True).wait(),
                "process group, sync": lambda: group.allreduce([t], _fresh_options(async_op=False)),
                "process group, async issue + wait":
                    lambda: group.allreduce([t], _fresh_options()).wait(),
                "torch's dist.all_reduce over the process group": lambda: dist.all_reduce(t, group=group)}

    def measure() -> dict[str, dict[str, float]]:
        run = paths(Communicator(_InstantEngine(), dist.HashStore(), "bench", 30.0))
        return {"warm": hot(run), "cold": cold(run), "bytecodes": {name: _bytecodes(fn) for name, fn in run.items()}}

    figures = measure()
    logs = tempfile.mkdtemp(prefix="commlib-bench-own-")
    log.configure(0, 1, logs)
    try:
        logged = measure()
    finally:
        shutil.rmtree(logs)
    return {kind: figures[kind] | {f"{name}, JSON logs on": us for name, us in logged[kind].items()}
            for kind in figures}


def _bytecodes(fn: Callable[[], object]) -> int:
    """Python bytecodes one call of `fn` executes, once warmed up, less those of an empty call.

    Unlike a time, the count is the same from run to run and machine to machine (for one
    Python version): what a change to the hot path costs, free of this machine's noise. A
    call into C (pybind, a builtin) counts as the one instruction that makes it.
    """
    def count(call: Callable[[], object]) -> int:
        executed = 0

        def trace(frame: Any, event: str, arg: Any) -> Any:
            nonlocal executed
            frame.f_trace_opcodes = True
            executed += event == "opcode"
            return trace

        for _ in range(3):
            call()
        sys.settrace(trace)
        try:
            call()
        finally:
            sys.settrace(None)
        return executed

    return count(fn) - count(lambda: None)


def _print_own_layers() -> None:
    for kind, figures in _own_layers_us().items():
        if kind == "bytecodes":
            print("commlib's own layers alone, Python bytecodes per 4 KiB all_reduce (the same every run): "
                  + ", ".join(f"{name} {count}" for name, count in figures.items()))
            continue
        how = ("best of 5 tight loops" if kind == "warm" else
               "each call alone after a 4 MiB write evicted L2: the in-context model")
        unit = "this thread's CPU" if kind == "warm" else "the call's wall time, nothing else running"
        print(f"commlib's own layers alone, {kind} ({how}), over an engine that completes at launch (us per "
              f"4 KiB all_reduce, {unit}): " + ", ".join(f"{name} {us:.2f}" for name, us in figures.items()))


def _print_one_rank(configs: dict[str, tuple[dict, bool]], args: argparse.Namespace) -> None:
    # One rank: no peer on the same 2 cores, so no scheduling noise; this resolves a few microseconds.
    solo = {name: testing.run(_interleaved, 1, timeout=600, args=(args.rounds, args.iters * 5, store), **kwargs)[0]
            for name, (kwargs, store) in configs.items()}
    print("\ncommlib's own CPU per 4 KiB all_reduce on 1 rank (no peer, no noise): "
          + ", ".join(f"{name} {_cpu(rows['4 KiB']['added_cpu_us'])} us (backend path "
                      f"{_cpu(rows['4 KiB']['backend_added_cpu_us'])} us, async issue + wait "
                      f"{_cpu(rows['4 KiB']['async_added_cpu_us'])} us)" for name, rows in solo.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--one-rank", action="store_true", help="only the 1-rank figures")
    parser.add_argument("--own-layers", action="store_true", help="only commlib's own layers, warm and cold")
    args = parser.parse_args()
    logs = tempfile.mkdtemp(prefix="commlib-bench-logs-")  # the JSON logs' runs and the diagnosis runs
    try:
        _report(args, logs)
    finally:
        shutil.rmtree(logs, ignore_errors=True)


def _report(args: argparse.Namespace, logs: str) -> None:
    configs = {  # name: (commlib.init's arguments, whether the consistency check goes through the store alone)
        "default (flight recorder + board)": ({}, False),
        "JSON logs on": ({"log_dir": logs}, False),
        "consistency check on": ({"check_consistency": True}, False),
        "consistency check through the store (a GPU's)": ({"check_consistency": True}, True),
    }
    if args.own_layers:
        _print_own_layers()
        return
    if args.one_rank:
        _print_one_rank(configs, args)
        _print_layers(args.rounds, args.iters * 5)
        _print_own_layers()
        return
    print(f"2 ranks, gloo, all_reduce; medians over {args.rounds} interleaved rounds, added CPU as median "
          f"(first..third quartile); torch {torch.__version__}\n")
    print("| configuration | size | raw wall (us) | commlib wall (us) | added wall (us) | raw CPU (us) "
          "| added CPU (us) | added CPU, backend path (us) | added CPU, async issue + wait (us) |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, (kwargs, store) in configs.items():
        r0 = testing.run(_interleaved, 2, timeout=600, args=(args.rounds, args.iters, store), **kwargs)[0]
        for label, row in r0.items():
            print(f"| {name} | {label} | {row['raw_us']:.1f} | {row['commlib_us']:.1f} | {row['added_us']:+.1f} "
                  f"| {row['raw_cpu_us']:.1f} | {_cpu(row['added_cpu_us'])} | {_cpu(row['backend_added_cpu_us'])} "
                  f"| {_cpu(row['async_added_cpu_us'])} |")
    _print_one_rank(configs, args)
    _print_layers(args.rounds, args.iters * 5)
    print(f"flight recorder + progress board bookkeeping alone: {_bookkeeping_us():.2f} us per collective")
    # With a log dir, the stacks the timed-out rank asks of its peer go there, not to stderr.
    lateness = testing.run(_diagnosis_latency, 2, timeout=300, args=(args.trials, 0.5), log_dir=logs)[0]
    lateness_ms = sorted(x * 1e3 for x in lateness)
    print(f"diagnosis latency (deadline expiry -> CollectiveTimeout raised, {len(lateness_ms)} timeouts, 0.5 s "
          f"deadline): p50 {statistics.median(lateness_ms):.1f} ms, max {max(lateness_ms):.1f} ms")
    _print_own_layers()


if __name__ == "__main__":
    main()
