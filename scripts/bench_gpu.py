"""commlib on one GPU (nccl, 1 rank), against raw NCCL in the same process: the CPU it costs and the
deadlines it keeps, where ops run in stream order (issues #24 and #31).

    python scripts/bench_gpu.py [--rounds N]          # scripts/gpu_check.sh runs it

One rank, because NCCL refuses two ranks on one GPU ("Duplicate GPU detected"); the collective
pattern of FSDP2 is written out, since FSDP2 skips its collectives at world size 1. Every
figure is a ratio to raw NCCL measured in the same run, the variants interleaved round by
round (medians), never an absolute time. It prints:

1. the CPU time to issue 100 4 KiB all_reduces queued behind a 50 ms GPU kernel: raw
   `dist.all_reduce` on a plain NCCL group, the Communicator (sync; async + wait) and
   torch.distributed over backend="commlib" (target <= 1.2x raw);
2. the step time of an FSDP2-shaped loop (per layer: the next layer's all-gather issued async
   on a side stream, `wait()`, two bf16 matmuls; backward: the weight gradient, then a
   synchronous reduce-scatter on a side stream) at three sizes (target <= 1.03x raw for the
   Communicator and for the backend path);
3. the process's CPU (every thread: the watchdog's too) per synchronous 4 KiB all_reduce, the raw
   baseline keeping its tensors alive as c10d's stash would (target: the backend path within
   10 us of raw);
4. an op queued behind 5 s of GPU work with a 1 s deadline: the CPU returns at once, the op
   completes, nothing times out;
5. an op that starts and never completes (a kernel of 3 s on the stream after its start
   event, from a pre-hook, as a device hang does), 1 s deadline: `CollectiveTimeout` within
   1.5 s, the process alive, the next call raising;
6. `commlib.Recovery.recover` after it: a collective on the rebuilt engine gives the right value,
   the rebuild within 1 s;
7. a barrier, sync and async, behind such a hang: the CPU is held no longer than the deadline
   + 0.5 s (c10d's own barrier would block it in a stream synchronize with no deadline);
8. `group.set_timeout(1 s)` and `_set_pg_timeout(1 s)`, then an op queued behind 3 s of GPU
   work: no false timeout, the engine's own timeout left at commlib's;
9. ops inside `torch.cuda.graph` while the watchdog reads another op's events: the capture stays
   valid, replays give the right values, nothing times out;
10. the hang of 5. twenty times, recovering after each: every one named within deadline + 0.5 s;
11. the same hang while the main thread sits in `torch.cuda.synchronize()`, and in `.item()`:
    the watchdog's thread names it within deadline + 0.5 s all the same.

Exit status: 0 every target met and every check passed; 1 otherwise; 2 no CUDA device.
"""

from __future__ import annotations

import argparse
import statistics
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
TARGET_ISSUE = 1.2
TARGET_STEP = 1.03
TARGET_CPU_US = 10.0
TARGET_REBUILD_S = 1.0


class Gpu:
    """The device, its clock for `torch.cuda._sleep`, and the three ways to reach NCCL."""

    def __init__(self) -> None:
        self.device = torch.device("cuda", 0)
        torch.cuda.set_device(self.device)
        store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
        self.comm = commlib.init("nccl", rank=0, world_size=1, store=store, timeout=60.0, device=self.device)
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


def median_of_rounds(variants: dict[str, Callable[[], float]], rounds: int) -> dict[str, float]:
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, measure in variants.items():
            samples[name].append(measure())
    return {name: statistics.median(values) for name, values in samples.items()}


def issue_behind_busy(gpu: Gpu, rounds: int) -> dict[str, float]:
    x = torch.ones(KIB4, device=gpu.device)

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
    x = torch.ones(KIB4, device=gpu.device)
    stash: list[torch.Tensor] = []  # the raw baseline holds its tensors as c10d's stash would

    def cpu_us(call: Callable[[], object]) -> Callable[[], float]:
        def measure() -> float:
            total = 0.0
            for _ in range(5):
                torch.cuda.synchronize()  # outside the measure: the launch queue never fills
                start = time.process_time()  # every thread of the process: the watchdog's too
                for _ in range(200):
                    call()
                total += time.process_time() - start
                stash.clear()
            torch.cuda.synchronize()
            commlib.check()
            return total / 1000 * 1e6

        return measure

    return median_of_rounds({
        "raw": cpu_us(lambda: (dist.all_reduce(x, group=gpu.raw), stash.append(x))),
        "comm": cpu_us(lambda: gpu.comm.all_reduce(x)),
        "backend path": cpu_us(lambda: dist.all_reduce(x)),
    }, rounds)


def queued_behind_five_seconds(gpu: Gpu) -> tuple[bool, str]:
    x = torch.full((KIB4,), 2.0, device=gpu.device)
    torch.cuda.synchronize()
    gpu.busy(5.0)
    start = time.perf_counter()
    gpu.comm.all_reduce(x, timeout=1.0)
    returned_s = time.perf_counter() - start
    try:
        commlib.check(wait=True)
        error = None
    except commlib.CommError as exc:
        error = exc
    done_s = time.perf_counter() - start
    ok = error is None and returned_s < 0.1 and done_s >= 4.5 and x[0].item() == 2.0
    return ok, (f"CPU returned after {returned_s * 1e3:.2f} ms, op done after {done_s:.2f} s, "
                f"{'no timeout' if error is None else f'{type(error).__name__}: {error}'}")


def hang_after_start(gpu: Gpu) -> tuple[bool, str, BaseException | None]:
    x = torch.ones(KIB4, device=gpu.device)
    torch.cuda.synchronize()
    target = gpu.comm.seq + 1
    hook = commlib.register_pre_hook(lambda call: gpu.busy(3.0) if call.seq == target else None)
    start = time.perf_counter()
    try:
        gpu.comm.all_reduce(x, timeout=1.0)
    finally:
        hook.remove()
    error: BaseException | None = None
    while error is None and time.perf_counter() - start < 10:
        try:
            commlib.check()
        except commlib.CommError as exc:
            error = exc
        time.sleep(0.005)
    detected_s = time.perf_counter() - start
    try:
        gpu.comm.all_reduce(x)
        next_call = "did not raise"
    except commlib.CommError as exc:
        next_call = type(exc).__name__
    ok = isinstance(error, commlib.CollectiveTimeout) and detected_s <= 1.5 and next_call == "CommAborted"
    return ok, (f"{type(error).__name__ if error else 'nothing'} after {detected_s:.2f} s; the next call raised "
                f"{next_call}; the process is alive"), error


def recover(gpu: Gpu, error: BaseException | None) -> tuple[bool, str]:
    done = commlib.Recovery(commlib.RecoveryPolicy(join_timeout_s=30)).recover(error)
    gpu.comm = commlib.current()
    x = torch.full((KIB4,), 5.0, device=gpu.device)
    gpu.comm.all_reduce(x)
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    commlib.check(wait=True)
    ok = torch.equal(x, torch.full_like(x, 5.0)) and done.rebuild_s <= TARGET_REBUILD_S
    return ok, (f"epoch {done.epoch}: abort {done.abort_s:.2f} s, rebuild {done.rebuild_s:.2f} s (target <= "
                f"{TARGET_REBUILD_S:g}), {done.total_s:.2f} s in all; all_reduce after it: {x[0].item()} (expected 5.0)")


def _hang_next_op(gpu: Gpu, seconds: float) -> Any:
    """A pre-hook that puts a `seconds` kernel on the stream right after the next op's start
    event: that op starts on the device and does not end in time, as a hung collective does."""
    target = gpu.comm.seq + 1
    return commlib.register_pre_hook(lambda call: gpu.busy(seconds) if call.seq == target else None)


def _watch_broken(gpu: Gpu) -> tuple[threading.Thread, dict[str, float]]:
    """A thread noting when the communicator is broken (the watchdog's verdict), whatever the main
    thread is doing meanwhile."""
    seen: dict[str, float] = {}
    comm, start = gpu.comm, time.perf_counter()

    def watch() -> None:
        while not comm.broken and time.perf_counter() - start < 15:
            time.sleep(0.005)
        seen["broken_s"] = time.perf_counter() - start

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread, seen


def _error_of(call: Callable[[], object]) -> BaseException | None:
    try:
        call()
    except commlib.CommError as exc:
        return exc
    return None


def barrier_bounded(gpu: Gpu) -> tuple[bool, str]:
    said = []
    ok = True
    for async_op in (False, True):
        torch.cuda.synchronize()
        hook = _hang_next_op(gpu, 3.0)
        start = time.perf_counter()
        try:
            error = _error_of(lambda: (gpu.comm.barrier(timeout=1.0, async_op=True).wait() if async_op
                                       else gpu.comm.barrier(timeout=1.0)))
        finally:
            hook.remove()
        held_s = time.perf_counter() - start
        ok &= isinstance(error, commlib.CollectiveTimeout) and held_s <= 1.5
        said.append(f"{'async' if async_op else 'sync'}: CPU held {held_s:.2f} s, "
                    f"{type(error).__name__ if error else 'nothing raised'}")
        passed, _ = recover(gpu, error)
        ok &= passed
    return ok, "; ".join(said)


def timeout_set_later(gpu: Gpu) -> tuple[bool, str]:
    group, said, ok = dist.group.WORLD, [], True
    for how in ("group.set_timeout", "_set_pg_timeout"):
        if how == "group.set_timeout":
            group.set_timeout(timedelta(seconds=1))
        else:
            dist.distributed_c10d._set_pg_timeout(timedelta(seconds=1), group)
        engine_s = group._get_backend(gpu.device).options._timeout.total_seconds()
        x = torch.full((KIB4,), 3.0, device=gpu.device)
        torch.cuda.synchronize()
        gpu.busy(3.0)
        gpu.comm.all_reduce(x)
        error = _error_of(lambda: commlib.check(wait=True))
        ok &= error is None and engine_s >= 3600 and gpu.comm.timeout == 1.0 and x[0].item() == 3.0
        said.append(f"{how}: deadline {gpu.comm.timeout:g} s, engine's own {engine_s:g} s, "
                    f"{'no timeout' if error is None else type(error).__name__}")
    group.set_timeout(timedelta(seconds=60))
    return ok, "; ".join(said)


def captured(gpu: Gpu) -> tuple[bool, str]:
    x = torch.full((KIB4,), 2.0, device=gpu.device)
    y = torch.ones(KIB4, device=gpu.device)
    torch.cuda.synchronize()
    gpu.busy(1.0)
    queued = gpu.comm.all_reduce(y, async_op=True)  # watched, its events read during the capture
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream(gpu.device)
    side.wait_stream(torch.cuda.current_stream(gpu.device))
    with torch.cuda.stream(side):  # warm outside the capture, as torch.cuda.graph asks
        gpu.comm.all_reduce(x)
    torch.cuda.current_stream(gpu.device).wait_stream(side)
    problem = None
    try:
        with torch.cuda.graph(graph):
            gpu.comm.all_reduce(x)
            gpu.comm.all_reduce(x, async_op=True).wait()
            time.sleep(0.2)  # the watchdog's passes, during the capture
        graph.replay()
        graph.replay()
        torch.cuda.synchronize()
    except RuntimeError as exc:
        problem = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    queued.wait()
    error = _error_of(lambda: commlib.check(wait=True))
    ok = problem is None and error is None and x[0].item() == 2.0
    return ok, (problem or "capture valid, replays ran") + (f"; {type(error).__name__}" if error else "; no timeout")


def hangs_in_a_row(gpu: Gpu, times: int) -> tuple[bool, str]:
    detections = []
    ok = True
    for _ in range(times):
        torch.cuda.synchronize()
        hook = _hang_next_op(gpu, 1.6)
        start = time.perf_counter()
        try:
            gpu.comm.all_reduce(torch.ones(KIB4, device=gpu.device), timeout=1.0)
        finally:
            hook.remove()
        error = None
        while error is None and time.perf_counter() - start < 10:
            error = _error_of(commlib.check)
            time.sleep(0.005)
        detections.append(time.perf_counter() - start)
        ok &= isinstance(error, commlib.CollectiveTimeout)
        passed, _ = recover(gpu, error)
        ok &= passed
    ok &= max(detections) <= 1.5
    return ok, (f"{times} hangs: detected after {min(detections):.2f}-{max(detections):.2f} s "
                f"(median {statistics.median(detections):.2f}), each recovered")


def hang_while_the_host_waits(gpu: Gpu) -> tuple[bool, str]:
    said, ok = [], True
    for where in ("torch.cuda.synchronize()", ".item()"):
        torch.cuda.synchronize()
        x = torch.ones(KIB4, device=gpu.device)
        hook = _hang_next_op(gpu, 3.0)
        try:
            gpu.comm.all_reduce(x, timeout=1.0)
        finally:
            hook.remove()
        watcher, seen = _watch_broken(gpu)
        if where == ".item()":
            x.sum().item()
        else:
            torch.cuda.synchronize()
        watcher.join()
        error = _error_of(commlib.check)
        ok &= isinstance(error, commlib.CollectiveTimeout) and seen["broken_s"] <= 1.5
        said.append(f"main thread in {where}: named after {seen['broken_s']:.2f} s")
        passed, _ = recover(gpu, error)
        ok &= passed
    return ok, "; ".join(said)


def stalled_failure_line(gpu: Gpu) -> tuple[bool, str]:
    """A hang whose failure line never comes (a log on a filesystem that stopped answering):
    the watchdog's thread goes on to announce and abort the engine after `LINE_BEFORE_NEWS_S`,
    not when the line is written (`commlib.lifecycle.Lifecycle._line_then_news`), and the
    caller's `commlib.check()`, which waits for that thread's verdict, has its error by then;
    then in-job recovery."""
    from commlib import lifecycle

    x = torch.ones(KIB4, device=gpu.device)
    torch.cuda.synchronize()
    fields = lifecycle._error_fields

    def stalled(error: commlib.CommError) -> dict[str, Any]:
        time.sleep(30.0)
        return fields(error)

    lifecycle._error_fields = stalled
    ends, hook = gpu.comm._lifecycle, _hang_next_op(gpu, 8.0)
    start = time.perf_counter()
    try:
        gpu.comm.all_reduce(x, timeout=1.0)
        error: BaseException | None = None
        while error is None and time.perf_counter() - start < 10:
            error = _error_of(commlib.check)
            time.sleep(0.005)
        detected_s = time.perf_counter() - start
        while not ends._engine_aborting and time.perf_counter() - start < 20:
            time.sleep(0.005)
        aborted_s = time.perf_counter() - start
    finally:
        hook.remove()
        lifecycle._error_fields = fields
    recovered, what = recover(gpu, error)
    bound_s = 1.0 + lifecycle.LINE_BEFORE_NEWS_S + 1.5
    ok = isinstance(error, commlib.CollectiveTimeout) and max(detected_s, aborted_s) <= bound_s and recovered
    return ok, (f"{type(error).__name__ if error else 'nothing'} after {detected_s:.2f} s, the engine's abort "
                f"begun after {aborted_s:.2f} s (both <= {bound_s:g}), the line still unwritten; then {what}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(f"bench_gpu: no CUDA device (torch {torch.__version__}); nothing measured", file=sys.stderr)
        return 2
    gpu = Gpu()
    print(f"torch {torch.__version__}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, "
          f"{torch.cuda.get_device_name(gpu.device)}; {args.rounds} interleaved rounds, medians")
    ok = True

    issue = issue_behind_busy(gpu, args.rounds)
    print("\n| CPU to issue 100 4 KiB all_reduces behind a 50 ms kernel | ms | x raw |\n| --- | ---: | ---: |")
    for name, s in issue.items():
        ratio = s / issue["raw"]
        ok &= name == "raw" or ratio <= TARGET_ISSUE
        print(f"| {name} | {s * 1e3:.2f} | {ratio:.2f} |")

    print("\n| FSDP2-shaped step (d, tokens, layers) | raw ms | comm ms (x raw) | backend path ms (x raw) |"
          "\n| --- | ---: | ---: | ---: |")
    for d, tokens, layers in FSDP_SIZES:
        step = fsdp_shaped_step(gpu, d, tokens, layers, args.rounds)
        ratios = {name: s / step["raw"] for name, s in step.items()}
        ok &= ratios["comm"] <= TARGET_STEP and ratios["backend path"] <= TARGET_STEP
        print(f"| {d}, {tokens}, {layers} | {step['raw'] * 1e3:.2f} | {step['comm'] * 1e3:.2f} "
              f"({ratios['comm']:.3f}) | {step['backend path'] * 1e3:.2f} ({ratios['backend path']:.3f}) |")

    cpu = cpu_per_call(gpu, args.rounds)
    print("\n| calling-thread CPU per sync 4 KiB all_reduce | us | over raw |\n| --- | ---: | ---: |")
    for name, us in cpu.items():
        print(f"| {name} | {us:.1f} | {us - cpu['raw']:+.1f} |")
    ok &= cpu["backend path"] - cpu["raw"] <= TARGET_CPU_US

    print("\nchecks:")
    passed, what = queued_behind_five_seconds(gpu)
    ok &= passed
    print(f"  queued behind 5 s of GPU work, 1 s deadline: {what}  {'ok' if passed else 'FAIL'}")
    passed, what, error = hang_after_start(gpu)
    ok &= passed
    print(f"  started, never completes, 1 s deadline: {what}  {'ok' if passed else 'FAIL'}")
    passed, what = recover(gpu, error)
    ok &= passed
    print(f"  in-job recovery: {what}  {'ok' if passed else 'FAIL'}")
    for name, check in (("barrier behind a hang, 1 s deadline", barrier_bounded),
                        ("deadline set later to 1 s, op behind 3 s of GPU work", timeout_set_later),
                        ("ops captured in a CUDA graph", captured),
                        ("hang, 1 s deadline, 20 times", lambda g: hangs_in_a_row(g, 20)),
                        ("hang while the host waits", hang_while_the_host_waits),
                        ("hang whose failure line stalls 30 s", stalled_failure_line)):
        try:
            passed, what = check(gpu)
        except Exception as exc:  # a check that breaks is a failed check, and the others still run
            passed, what = False, f"raised {type(exc).__name__}: {exc}"
        ok &= passed
        print(f"  {name}: {what}  {'ok' if passed else 'FAIL'}")
    print("\nALL TARGETS MET, ALL CHECKS PASSED" if ok else "\nA TARGET WAS MISSED OR A CHECK FAILED")
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
