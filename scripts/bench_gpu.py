"""commlib on one GPU (nccl, 1 rank), against raw NCCL in the same process: what it costs, and
what a GPU alone can show of its promises.

    python scripts/bench_gpu.py [--rounds N]          # figures and checks (scripts/gpu_check.sh)
    python scripts/bench_gpu.py trap NAME              # one settings trap, in a process of its own

One rank, because NCCL refuses two ranks on one GPU ("Duplicate GPU detected"): no peer can die or
be late here, so a "hang" is a kernel a pre-hook puts on the stream before the op, and every
value check uses an op that changes its tensor on one rank (`premul_sum(2.0)` doubles it), so a
check passes only if NCCL really ran. FSDP2 skips its collectives at world size 1, so its
pattern is written out. Every figure is against raw NCCL in the same run, the variants
interleaved round by round (medians).

Figures (targets in `TARGETS`): the CPU to issue 100 4 KiB all_reduces behind a 50 ms kernel;
an FSDP2-shaped step at three sizes; the calling thread's CPU per sync 4 KiB all_reduce.
Checks: an op queued behind GPU work within its deadline; an op whose deadline (counted from its
issue) passes, sync and async, while the host runs on and while it waits in `synchronize()` and
`.item()`; in-job recovery after each; a barrier held to its deadline; a deadline set later
that never reaches NCCL raw (an async op, whose engine verdict is read); ops captured in a CUDA
graph; ten hangs in a row; a failure whose log line stalls. Traps (each in a process of its
own, under `timeout`): `NCCL_BLOCKING_WAIT=1`, `init_process_group(device_id=...)` counting
NCCL's inits, hooks that call commlib back, a device-side assert while an op is in flight.

Exit status: 0 every target met and every check passed; 1 otherwise; 2 no CUDA device.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import commlib

KIB4 = 1024  # fp32 elements in 4 KiB
FSDP_SIZES = ((512, 512, 32), (1024, 2048, 24), (2048, 4096, 16))  # (d, tokens, layers)
TARGETS = {"issue x raw": 1.2, "step x raw": 1.02, "cpu us over raw": 5.0, "rebuild s": 1.0}
DOUBLE = commlib.premul_sum(2.0)
TRAP_TIMEOUT_S = 60


class Gpu:
    """The device, its clock for `torch.cuda._sleep`, and the ways to reach NCCL."""

    def __init__(self, **init: Any) -> None:
        self.device = torch.device("cuda", 0)
        torch.cuda.set_device(self.device)
        store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
        self.comm = commlib.init("nccl", rank=0, world_size=1, store=store, timeout=60.0, device=self.device, **init)
        self.raw = dist.new_group([0], backend="nccl")  # a plain ProcessGroupNCCL beside commlib's default group
        self.cycles_per_s = self._calibrate()

    def _calibrate(self) -> float:
        cycles = 50_000_000
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(cycles // 10)  # warm
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        return cycles / (start.elapsed_time(end) / 1e3)

    def busy(self, seconds: float) -> None:
        """A kernel that spins `seconds` on the current stream."""
        torch.cuda._sleep(int(seconds * self.cycles_per_s))

    def ones(self) -> torch.Tensor:
        return torch.ones(KIB4, device=self.device)


def median_of_rounds(variants: dict[str, Callable[[], float]], rounds: int) -> dict[str, float]:
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, measure in variants.items():
            samples[name].append(measure())
    return {name: statistics.median(values) for name, values in samples.items()}


# -- figures ---------------------------------------------------------------------------------
def issue_behind_busy(gpu: Gpu, rounds: int) -> dict[str, float]:
    x = gpu.ones()

    def issuing(call: Callable[[], object]) -> Callable[[], float]:
        def measure() -> float:
            torch.cuda.synchronize()
            gpu.busy(0.05)
            start = time.perf_counter()
            for _ in range(100):
                call()
            elapsed = time.perf_counter() - start
            torch.cuda.synchronize()
            commlib.check()
            return elapsed

        return measure

    return median_of_rounds({
        "raw": issuing(lambda: dist.all_reduce(x, group=gpu.raw)),
        "comm sync": issuing(lambda: gpu.comm.all_reduce(x)),
        "comm async+wait": issuing(lambda: gpu.comm.all_reduce(x, async_op=True).wait()),
        "backend path": issuing(lambda: dist.all_reduce(x)),
    }, rounds)


def fsdp_shaped_step(gpu: Gpu, d: int, tokens: int, layers: int, rounds: int) -> dict[str, float]:
    dev, bf16 = gpu.device, torch.bfloat16
    shards = [torch.randn(d * d, device=dev, dtype=bf16) / d for _ in range(layers)]
    full = [torch.empty(d * d, device=dev, dtype=bf16) for _ in range(layers)]
    grads = [torch.empty(d * d, device=dev, dtype=bf16) for _ in range(layers)]
    x = torch.randn(tokens, d, device=dev, dtype=bf16)
    ag_stream, rs_stream = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    comm = gpu.comm

    ways: dict[str, tuple[Callable[..., object], Callable[..., object]]] = {
        "raw": (lambda o, i: dist.all_gather_into_tensor(o, i, group=gpu.raw, async_op=True),
                lambda o, i: dist.reduce_scatter_tensor(o, i, group=gpu.raw)),
        "comm": (lambda o, i: comm.all_gather_single(o, i, async_op=True),
                 lambda o, i: comm.reduce_scatter_single(o, i)),
        "backend path": (lambda o, i: dist.all_gather_into_tensor(o, i, async_op=True),
                         lambda o, i: dist.reduce_scatter_tensor(o, i)),
    }

    def step(all_gather: Callable[..., object], reduce_scatter: Callable[..., object]) -> None:
        main = torch.cuda.current_stream(dev)

        def gather(i: int) -> object:
            ag_stream.wait_stream(main)
            with torch.cuda.stream(ag_stream):
                return all_gather(full[i], shards[i])

        work = gather(0)
        h, saved = x, []
        for i in range(layers):
            following = gather(i + 1) if i + 1 < layers else None
            work.wait()
            w = full[i].view(d, d)
            saved.append(h)
            h = (h @ w) @ w.t()
            work = following
        g = torch.ones_like(h)
        for i in reversed(range(layers)):
            weight_grad = (g.t() @ saved[i]).reshape(-1)
            rs_stream.wait_stream(main)
            with torch.cuda.stream(rs_stream):
                reduce_scatter(grads[i], weight_grad)
            g = g @ full[i].view(d, d)
        main.wait_stream(rs_stream)

    def timing(way: tuple[Callable[..., object], Callable[..., object]]) -> Callable[[], float]:
        def measure() -> float:
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(5):
                step(*way)
            torch.cuda.synchronize()
            elapsed = (time.perf_counter() - start) / 5
            commlib.check()  # outside the timed region: the raw loop has nothing like it
            return elapsed

        return measure

    for way in ways.values():  # warm: cuBLAS handles, NCCL channels, allocator
        step(*way)
    return median_of_rounds({name: timing(way) for name, way in ways.items()}, rounds)


def cpu_per_call(gpu: Gpu, rounds: int) -> dict[str, float]:
    x = gpu.ones()

    def cpu_us(call: Callable[[], object]) -> Callable[[], float]:
        def measure() -> float:
            total = 0.0
            for _ in range(5):
                torch.cuda.synchronize()  # outside the measure: the launch queue never fills
                start = time.thread_time()
                for _ in range(200):
                    call()
                total += time.thread_time() - start
            torch.cuda.synchronize()
            commlib.check()
            return total / 1000 * 1e6

        return measure

    return median_of_rounds({
        "raw": cpu_us(lambda: dist.all_reduce(x, group=gpu.raw)),
        "comm": cpu_us(lambda: gpu.comm.all_reduce(x)),
        "backend path": cpu_us(lambda: dist.all_reduce(x)),
    }, rounds)


# -- checks: each returns (passed, what it saw) -----------------------------------------------
def _error_of(call: Callable[[], object]) -> BaseException | None:
    try:
        call()
    except commlib.CommError as exc:
        return exc
    return None


def _first_error(within_s: float) -> tuple[BaseException | None, float]:
    start, error = time.perf_counter(), None
    while error is None and time.perf_counter() - start < within_s:
        error = _error_of(commlib.check)
        time.sleep(0.005)
    return error, time.perf_counter() - start


def _hang_next_op(gpu: Gpu, seconds: float) -> Any:
    """A pre-hook that puts a `seconds` kernel on the stream right before the next op: the op
    does not end in time, as a collective stuck on its peers does."""
    target = gpu.comm.seq + 1
    return commlib.register_pre_hook(lambda call: gpu.busy(seconds) if call.seq == target else None)


def recover(gpu: Gpu, error: BaseException | None) -> tuple[bool, str]:
    done = commlib.Recovery(commlib.RecoveryPolicy(join_timeout_s=30)).recover(error)
    gpu.comm = commlib.current()
    x = torch.full((KIB4,), 5.0, device=gpu.device)
    gpu.comm.all_reduce(x, DOUBLE)
    dist.all_reduce(x, op=dist.ReduceOp.SUM)
    commlib.check(wait=True)
    ok = torch.equal(x, torch.full_like(x, 10.0)) and done.rebuild_s <= TARGETS["rebuild s"]
    return ok, (f"epoch {done.epoch}: abort {done.abort_s:.2f} s, rebuild {done.rebuild_s:.2f} s (target <= "
                f"{TARGETS['rebuild s']:g}); after it, 5 doubled: {x[0].item()}")


def queued_within_its_deadline(gpu: Gpu) -> tuple[bool, str]:
    x, y = gpu.ones(), gpu.ones()
    torch.cuda.synchronize()
    gpu.busy(2.0)
    start = time.perf_counter()
    gpu.comm.all_reduce(x, DOUBLE, timeout=10.0)
    work = gpu.comm.all_reduce(y, DOUBLE, async_op=True, timeout=10.0)
    returned_s = time.perf_counter() - start
    work.wait()
    error = _error_of(lambda: commlib.check(wait=True))
    done_s = time.perf_counter() - start
    ok = error is None and returned_s < 0.1 and done_s >= 1.8 and x[0].item() == y[0].item() == 2.0
    return ok, (f"CPU returned after {returned_s * 1e3:.2f} ms, ops done after {done_s:.2f} s, values "
                f"{x[0].item()} {y[0].item()} (2.0), {'no timeout' if error is None else type(error).__name__}")


def deadline_passes(gpu: Gpu, async_op: bool) -> tuple[bool, str, BaseException | None]:
    torch.cuda.synchronize()
    hook = _hang_next_op(gpu, 3.0)
    start = time.perf_counter()
    try:
        work = gpu.comm.all_reduce(gpu.ones(), DOUBLE, async_op=async_op, timeout=1.0)
    finally:
        hook.remove()
    if work is not None:
        work.wait()  # stream-only: the CPU goes on
    returned_s = time.perf_counter() - start
    error, detected_s = _first_error(10.0)
    next_call = _error_of(lambda: gpu.comm.all_reduce(gpu.ones()))
    ok = (isinstance(error, commlib.CollectiveTimeout) and returned_s < 0.1 and 1.0 <= detected_s <= 1.5
          and isinstance(next_call, commlib.CommAborted))
    return ok, (f"{type(error).__name__ if error else 'nothing'} after {detected_s:.2f} s (the CPU went on after "
                f"{returned_s * 1e3:.1f} ms); the next call raised {type(next_call).__name__}"), error


def deadline_passes_while_the_host_waits(gpu: Gpu, where: str) -> tuple[bool, str, BaseException | None]:
    torch.cuda.synchronize()
    x = gpu.ones()
    hook = _hang_next_op(gpu, 3.0)
    try:
        gpu.comm.all_reduce(x, timeout=1.0)
    finally:
        hook.remove()
    seen: dict[str, float] = {}
    comm, start = gpu.comm, time.perf_counter()

    def watch() -> None:
        while not comm.broken and time.perf_counter() - start < 15:
            time.sleep(0.005)
        seen["broken_s"] = time.perf_counter() - start

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    if where == ".item()":
        x.sum().item()
    else:
        torch.cuda.synchronize()
    watcher.join()
    error = _error_of(commlib.check)
    ok = isinstance(error, commlib.CollectiveTimeout) and seen["broken_s"] <= 1.5
    return ok, f"main thread in {where}: the communicator broken after {seen['broken_s']:.2f} s", error


def barrier_held_to_its_deadline(gpu: Gpu) -> tuple[bool, str]:
    said, ok = [], True
    for async_op in (False, True):
        torch.cuda.synchronize()
        hook = _hang_next_op(gpu, 3.0)
        start = time.perf_counter()
        try:
            if async_op:
                error = _error_of(lambda: gpu.comm.barrier(timeout=1.0, async_op=True).wait())
            else:
                error = _error_of(lambda: gpu.comm.barrier(timeout=1.0))
        finally:
            hook.remove()
        held_s = time.perf_counter() - start
        ok &= isinstance(error, commlib.CollectiveTimeout) and held_s <= 1.5
        said.append(f"{'async' if async_op else 'sync'}: CPU held {held_s:.2f} s, "
                    f"{type(error).__name__ if error else 'nothing raised'}")
        passed, _ = recover(gpu, error)
        ok &= passed
    return ok, "; ".join(said)


def deadline_set_later_never_reaches_nccl(gpu: Gpu) -> tuple[bool, str]:
    """The group's timeout set to 1 s, then an async op with a 10 s deadline behind 2.5 s of GPU
    work: c10d's verdict on it (which commlib reads) is TIMEOUT if NCCL was given the raw 1 s."""
    group, said, ok = dist.group.WORLD, [], True
    for how in ("group.set_timeout", "_set_pg_timeout"):
        if how == "group.set_timeout":
            group.set_timeout(timedelta(seconds=1))
        else:
            dist.distributed_c10d._set_pg_timeout(timedelta(seconds=1), group)
        engine_s = group._get_backend(gpu.device).options._timeout.total_seconds()
        x = gpu.ones()
        torch.cuda.synchronize()
        gpu.busy(2.5)
        gpu.comm.all_reduce(x, DOUBLE, async_op=True, timeout=10.0).wait()
        error = _error_of(lambda: commlib.check(wait=True))
        ok &= error is None and engine_s >= 3600 and gpu.comm.timeout == 1.0 and x[0].item() == 2.0
        said.append(f"{how}: deadline {gpu.comm.timeout:g} s, NCCL's own {engine_s:g} s, value {x[0].item()} (2.0), "
                    f"{'no timeout' if error is None else type(error).__name__}")
    group.set_timeout(timedelta(seconds=60))
    return ok, "; ".join(said)


def captured(gpu: Gpu) -> tuple[bool, str]:
    x = torch.full((KIB4,), 1.0, device=gpu.device)
    torch.cuda.synchronize()
    gpu.busy(1.0)
    queued = gpu.comm.all_reduce(gpu.ones())  # its end event is read by the deadline thread during the capture
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream(gpu.device)
    side.wait_stream(torch.cuda.current_stream(gpu.device))
    with torch.cuda.stream(side):  # warm outside the capture, as torch.cuda.graph asks
        gpu.comm.all_reduce(x, DOUBLE)
    torch.cuda.current_stream(gpu.device).wait_stream(side)
    torch.cuda.synchronize()
    problem = None
    try:
        with torch.cuda.graph(graph):
            gpu.comm.all_reduce(x, DOUBLE)
            gpu.comm.all_reduce(x, DOUBLE, async_op=True).wait()
            time.sleep(0.3)  # the deadline thread's passes, during the capture
        graph.replay()
        graph.replay()
        torch.cuda.synchronize()
    except RuntimeError as exc:
        problem = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    del queued
    error = _error_of(lambda: commlib.check(wait=True))
    # 1, doubled by the warm-up (2), then twice per replay (x4, x4): 32.
    ok = problem is None and error is None and x[0].item() == 32.0
    return ok, ((problem or f"capture valid, replays ran, value {x[0].item()} (32.0)")
                + (f"; {type(error).__name__}" if error else "; no timeout"))


def hangs_in_a_row(gpu: Gpu, times: int) -> tuple[bool, str]:
    detections, ok = [], True
    for _ in range(times):
        passed, _, error = deadline_passes(gpu, async_op=False)
        ok &= passed
        detections.append(getattr(error, "elapsed", float("nan")))
        passed, _ = recover(gpu, error)
        ok &= passed
    return ok, (f"{times} hangs: each CollectiveTimeout at {min(detections):.2f}-{max(detections):.2f} s "
                f"after its issue, each recovered")


def stalled_failure_line(gpu: Gpu) -> tuple[bool, str]:
    """A hang whose failure line never comes (a log on a filesystem that stopped answering): the
    error reaches the caller after `LINE_BEFORE_NEWS_S`, not when the line is written."""
    from commlib import communicator

    fields = communicator._error_fields

    def stalled(error: commlib.CommError) -> dict[str, Any]:
        time.sleep(30.0)
        return fields(error)

    communicator._error_fields = stalled
    try:
        torch.cuda.synchronize()
        hook = _hang_next_op(gpu, 8.0)
        start = time.perf_counter()
        try:
            gpu.comm.all_reduce(gpu.ones(), timeout=1.0)
        finally:
            hook.remove()
        error, detected_s = _first_error(15.0)
        detected_s = time.perf_counter() - start
    finally:
        communicator._error_fields = fields
    recovered, what = recover(gpu, error)
    bound_s = 1.0 + communicator.LINE_BEFORE_NEWS_S + 1.5
    ok = isinstance(error, commlib.CollectiveTimeout) and detected_s <= bound_s and recovered
    return ok, (f"{type(error).__name__ if error else 'nothing'} after {detected_s:.2f} s (<= {bound_s:g}), the line "
                f"still unwritten; then {what}")


# -- traps: each in a process of its own ------------------------------------------------------
def trap_blocking_wait() -> str:
    """`NCCL_BLOCKING_WAIT=1` (an old recipe): c10d would start no watchdog, and no verdict would
    ever come for an async op."""
    os.environ["NCCL_BLOCKING_WAIT"] = "1"
    gpu = Gpu()
    xs = [gpu.ones() for _ in range(5)]
    for x in xs:
        gpu.comm.all_reduce(x, DOUBLE, async_op=True, timeout=2.0).wait()
    error = _error_of(lambda: commlib.check(wait=True, timeout=10.0))
    time.sleep(2.5)  # past the deadlines: an op with no verdict would fail now
    error = error or _error_of(commlib.check)
    values = sorted({x[0].item() for x in xs})
    ok = error is None and values == [2.0]
    said = "no timeout" if error is None else type(error).__name__
    return f"{'ok' if ok else 'FAIL'}: async ops {said}, values {values} ([2.0])"


def trap_device_id() -> str:
    """`init_process_group("commlib", device_id=...)`: c10d connects the engine it finds again;
    NCCL_DEBUG=INFO says how many communicators were initialised (one expected)."""
    from commlib._torch_backend import register

    register()  # the package's entry point does it where commlib is installed; here it is on PYTHONPATH
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("commlib", store=store, rank=0, world_size=1, device_id=device)
    x = torch.ones(KIB4, device=device)
    dist.all_reduce(x)
    torch.cuda.synchronize()
    dist.destroy_process_group()
    return "ran"


def trap_hooks() -> str:
    """Hooks that call commlib back: a post-hook calling `check()` and a barrier, a failure hook
    calling `check()` and `abort()`."""
    gpu = Gpu()
    seen: list[str] = []
    in_barrier = threading.local()

    def post(call: Any, duration_s: float) -> None:
        commlib.check()
        if call.op.value == "all_reduce" and not getattr(in_barrier, "on", False):
            in_barrier.on = True
            try:
                gpu.comm.barrier()
            finally:
                in_barrier.on = False
        seen.append("post")

    def failure(call: Any, error: BaseException) -> None:
        commlib.check()
        gpu.comm.abort("a failure hook aborts")
        seen.append("failure")

    commlib.register_post_hook(post)
    commlib.register_failure_hook(failure)
    gpu.comm.all_reduce(gpu.ones())
    hook = _hang_next_op(gpu, 3.0)
    gpu.comm.all_reduce(gpu.ones(), timeout=1.0)
    hook.remove()
    error, _ = _first_error(10.0)
    ok = isinstance(error, commlib.CollectiveTimeout) and "failure" in seen and "post" in seen
    return f"{'ok' if ok else 'FAIL'}: {type(error).__name__ if error else 'nothing'}, hooks ran {seen}"


def trap_device_assert() -> str:
    """A device-side assert while an op is in flight: the context is poisoned; the deadline
    thread must not die with it, and the caller must hear of it."""
    gpu = Gpu()
    gpu.comm.all_reduce(gpu.ones())
    gpu.busy(0.5)
    gpu.comm.all_reduce(gpu.ones(), timeout=5.0)
    bad = torch.ones(4, device=gpu.device)[torch.tensor([10], device=gpu.device)]  # out of range: an assert
    del bad
    error, s = _first_error(15.0)
    ok = isinstance(error, commlib.CommError)
    said = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}" if error else "nothing raised"
    return f"{'ok' if ok else 'FAIL'}: after {s:.2f} s, {said}"


TRAPS: dict[str, Callable[[], str]] = {
    "blocking_wait": trap_blocking_wait,
    "device_id": trap_device_id,
    "hooks": trap_hooks,
    "device_assert": trap_device_assert,
}


def run_trap(name: str) -> tuple[bool, str]:
    env = dict(os.environ, NCCL_DEBUG="INFO") if name == "device_id" else dict(os.environ)
    try:
        done = subprocess.run([sys.executable, __file__, "trap", name], capture_output=True, text=True,
                              timeout=TRAP_TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired:
        return False, f"still running after {TRAP_TIMEOUT_S} s: killed"
    out = done.stdout + done.stderr
    if name == "device_id":
        inits = len(re.findall(r"Init COMPLETE", out))
        ok = done.returncode == 0 and inits == 1
        return ok, f"exit {done.returncode}, NCCL initialised {inits} communicator(s) (1 expected)"
    said = [line for line in done.stdout.splitlines() if line.startswith(("ok:", "FAIL:"))]
    if name == "device_assert":  # the process may end with CUDA's own error once the check has spoken
        ok = bool(said) and said[-1].startswith("ok:")
    else:
        ok = done.returncode == 0 and bool(said) and said[-1].startswith("ok:")
    return ok, said[-1] if said else f"exit {done.returncode}; {out.strip().splitlines()[-1:]}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("trap", nargs="*", help="trap NAME: one settings trap (run by the checks)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(f"bench_gpu: no CUDA device (torch {torch.__version__}); nothing measured", file=sys.stderr)
        return 2
    if args.trap:
        print(TRAPS[args.trap[1]](), flush=True)
        return 0
    gpu = Gpu()
    print(f"torch {torch.__version__}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, "
          f"{torch.cuda.get_device_name(gpu.device)}; {args.rounds} interleaved rounds, medians")
    ok = True

    issue = issue_behind_busy(gpu, args.rounds)
    print("\n| CPU to issue 100 4 KiB all_reduces behind a 50 ms kernel | ms | x raw |\n| --- | ---: | ---: |")
    for name, s in issue.items():
        ratio = s / issue["raw"]
        ok &= name == "raw" or ratio <= TARGETS["issue x raw"]
        print(f"| {name} | {s * 1e3:.2f} | {ratio:.2f} |")

    print("\n| FSDP2-shaped step (d, tokens, layers) | raw ms | comm ms (x raw) | backend path ms (x raw) |"
          "\n| --- | ---: | ---: | ---: |")
    for d, tokens, layers in FSDP_SIZES:
        step = fsdp_shaped_step(gpu, d, tokens, layers, args.rounds)
        ratios = {name: s / step["raw"] for name, s in step.items()}
        ok &= ratios["comm"] <= TARGETS["step x raw"] and ratios["backend path"] <= TARGETS["step x raw"]
        print(f"| {d}, {tokens}, {layers} | {step['raw'] * 1e3:.2f} | {step['comm'] * 1e3:.2f} "
              f"({ratios['comm']:.3f}) | {step['backend path'] * 1e3:.2f} ({ratios['backend path']:.3f}) |")

    cpu = cpu_per_call(gpu, args.rounds)
    print("\n| calling-thread CPU per sync 4 KiB all_reduce | us | over raw |\n| --- | ---: | ---: |")
    for name, us in cpu.items():
        print(f"| {name} | {us:.1f} | {us - cpu['raw']:+.1f} |")
    ok &= cpu["backend path"] - cpu["raw"] <= TARGETS["cpu us over raw"]

    print("\nchecks:")

    def report(name: str, passed: bool, what: str) -> None:
        nonlocal ok
        ok &= passed
        print(f"  {name}: {what}  {'ok' if passed else 'FAIL'}", flush=True)

    report("queued behind 2 s of GPU work, 10 s deadline", *queued_within_its_deadline(gpu))
    for async_op in (False, True):
        passed, what, error = deadline_passes(gpu, async_op)
        report(f"{'async' if async_op else 'sync'} op behind a 3 s kernel, 1 s deadline", passed, what)
        report("  in-job recovery", *recover(gpu, error))
    for where in ("torch.cuda.synchronize()", ".item()"):
        passed, what, error = deadline_passes_while_the_host_waits(gpu, where)
        report("deadline passes while the host waits", passed, what)
        report("  in-job recovery", *recover(gpu, error))
    checks: tuple[tuple[str, Callable[[Gpu], tuple[bool, str]]], ...] = (
        ("barrier behind a hang, 1 s deadline", barrier_held_to_its_deadline),
        ("group timeout set to 1 s, async op behind 2.5 s of GPU work", deadline_set_later_never_reaches_nccl),
        ("ops captured in a CUDA graph", captured),
        ("a hang, 1 s deadline, 10 times", lambda g: hangs_in_a_row(g, 10)),
        ("a hang whose failure line stalls 30 s", stalled_failure_line),
    )
    for name, check in checks:
        try:
            passed, what = check(gpu)
        except Exception as exc:  # a check that breaks is a failed check, and the others still run
            passed, what = False, f"raised {type(exc).__name__}: {exc}"
        report(name, passed, what)
    dist.destroy_process_group()
    print("\ntraps (a process each):")
    for name in TRAPS:
        report(name, *run_trap(name))
    print("\nALL TARGETS MET, ALL CHECKS PASSED" if ok else "\nA TARGET WAS MISSED OR A CHECK FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
