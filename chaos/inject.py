"""The in-rank injector: the faults a rank does to itself, through commlib's public hooks.

A trainer installs it at start with ``install_from_env(comm)``; that returns None unless
the harness set ``CHAOS_PLAN`` (so it costs nothing outside chaos runs). The trainer then
calls ``on_step_start(step)`` at the start of every step,
``on_checkpoint_staged(step)`` once this rank's checkpoint shard is written but before the
checkpoint is committed, and ``on_checkpoint_committed(step, directory)`` once it is.
Everything else happens in a process-wide commlib pre-hook, so it covers every communicator
of the rank, including ones split later.

Faults acted here (the harness does ``kill`` and ``hang`` from outside, with signals):

``delay``     the pre-hook sleeps past the collective's deadline (deadline + margin), so
              the peers' collective times out and names this rank as the one missing;
``raise``     the pre-hook raises `InjectedFault` out of the collective;
``corrupt``   the pre-hook writes NaN into the collective's floating input (the trainer's
              finite check must catch it before an optimizer step or checkpoint uses it);
``exit``      the pre-hook calls ``os._exit(code)``;
``segfault``  the pre-hook dereferences a null pointer (a real SIGSEGV);
``kill_during_checkpoint``  SIGKILL to this very process from `on_checkpoint_staged`: the
              shard is on disk, the checkpoint not committed -- exactly the torn moment.
              Acting from inside the rank is what makes that deterministic: a signal
              from the harness would have to hit a window of a few milliseconds.
``gil``       the pre-hook sleeps in C *holding the GIL* (libc ``sleep`` through
              ``ctypes.PyDLL``, which keeps the GIL) past the deadline: no Python thread of
              the rank runs, so its heartbeat stops and only faulthandler (C-level, on the
              SIGUSR2 a timed-out peer sends) can say where it is;
``straggler`` the pre-hook sleeps ``ms`` before every collective of the rank, from its
              trigger on and in every later attempt (a slow node stays slow);
``corrupt_checkpoint``  from `on_checkpoint_committed`: flips bytes in the largest file of
              the checkpoint just committed, then SIGKILL to this process, so the restarted
              job must refuse it (its hash) and load the one before.

Step-level triggers (step, after_s, p) arm a fault at the start of a step; the fault then
acts at the first collective from there on that passes its op/comm/phase filters (so ``exit``
and friends happen mid-step), or at the next staged checkpoint for
``kill_during_checkpoint``. A ``seq`` trigger acts at that collective. Before acting, the
firing is claimed in the run's `Ledger` (so counts hold across restarts) and a
``chaos.fault`` event goes to the rank's log. Every step start is logged as ``chaos.step``
(`on_step_start`, with or without an injector): the harness fires its step-triggered
external faults when it reads that line, and the rank waits there for them (see
`Injector._await_external`), so they land at the step's start; for a ``preempt`` or
``time_limit`` every rank waits there for the SIGTERM that stops the job
(`Injector._await_stop`), so the job stops after that very step.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import commlib
from chaos.fault import DELAY_MARGIN_S, Fault, FaultType, TriggerKind
from chaos.ledger import Ledger
from chaos.plan import Plan
from commlib import settings
from commlib.attempt import attempt_number
from commlib.ops import Collective

# How long a rank waits at a step start for the harness to fire a kill or hang planned there
# (at most half the collective deadline: peers wait for it in the step's first collective).
EXTERNAL_WAIT_S = 5.0
SIGNAL_GRACE_S = 0.5  # from the harness's claim of a firing to its signal arriving
# How long every rank holds a step start for a preemption's or time limit's SIGTERM: Slurm
# checks time limits every 30 s, and the notice then crosses the batch step and the harnesses.
NOTICE_WAIT_S = 75.0
CORRUPT_BYTES = 16  # flipped by corrupt_checkpoint
LONGEST_NAP_S = 3600.0  # one sleep call of a held fault (`_sleep`)
PLAN_ENV = "CHAOS_PLAN"  # path of the resolved plan (JSON), written by the harness
STATE_ENV = "CHAOS_STATE_DIR"  # the ledger's directory
START_ENV = "CHAOS_START_NS"  # wall clock (ns) when the harness launched the job


class InjectedFault(RuntimeError):
    """The exception a ``raise`` fault throws out of a collective."""


# The one registry this module owns: the injector of this process (`install_from_env`).
_INSTALLED: list[Injector] = []


def installed() -> Injector | None:
    """The injector `install_from_env` installed in this process, if any."""
    return _INSTALLED[-1] if _INSTALLED else None


def on_step_start(step: int) -> None:
    """A step starts in this rank: ``chaos.step`` in its log, and the injector's faults of the
    step armed."""
    injector = installed()
    if injector is not None:
        injector.on_step_start(step)
    else:
        _log_step(step)


def _log_step(step: int) -> None:
    # The harness triggers its external faults (kill, hang at step S) on this line.
    commlib.get_logger().info("chaos.step", step=step)


class Injector:
    """The faults of one plan that target this rank."""

    def __init__(
        self,
        plan: Plan,
        rank: int,
        ledger: Ledger,
        start_ns: int,
        attempt: int | None = None,
        *,
        external_wait_s: float = EXTERNAL_WAIT_S,
    ) -> None:
        self.rank = rank
        self._attempt = attempt
        self._ledger = ledger
        self._start_ns = start_ns
        self._faults = [(i, f) for i, f in enumerate(plan.faults) if f.rank == rank and not f.type.external]
        # Whoever's step triggers them, they stop every rank (the whole job): `_await_stop`.
        stops = (FaultType.PREEMPT, FaultType.TIME_LIMIT)
        self._job_stops = [
            (i, f) for i, f in enumerate(plan.faults) if f.type in stops and f.trigger.kind is not TriggerKind.AFTER_S
        ]
        self._external = [
            (i, f)
            for i, f in enumerate(plan.faults)
            if f.rank == rank and f.type.external and f.type not in stops and f.trigger.kind is not TriggerKind.AFTER_S
        ]
        self.external_wait_s = external_wait_s
        self._armed: set[int] = set()
        # Stragglers slow from an earlier attempt on stay slow in this one.
        self._slow = {i for i, f in self._faults if f.type is FaultType.STRAGGLER and ledger.fired(i)}
        self.step: int | None = None
        self.on_step_failed: Callable[[], None] | None = None
        self._handle = commlib.register_pre_hook(self._pre_hook)

    @property
    def attempt(self) -> int:
        """This rank's attempt: as given, or else commlib's (`attempt_number`), read at each use,
        since the ranks agree on it in the trainer's first communicator, after this is made."""
        return self._attempt if self._attempt is not None else attempt_number()

    def close(self) -> None:
        self._handle.remove()
        if self in _INSTALLED:
            _INSTALLED.remove(self)

    # -- the trainer's calls -----------------------------------------------------------
    def on_step_start(self, step: int) -> None:
        self.step = step
        _log_step(step)
        elapsed = (time.time_ns() - self._start_ns) / 1e9
        for i, f in self._faults:
            if f.trigger.kind is TriggerKind.SEQ or i in self._armed:
                continue
            if f.trigger.matches_step(f.seed, i, self.attempt, step, elapsed) and self._ledger.fired(i) < f.count:
                self._armed.add(i)
        self._await_external(step, elapsed)
        self._await_stop(step, elapsed)

    def _await_external(self, step: int, elapsed: float) -> None:
        """Hold the start of `step` while the harness applies this rank's kill or hang planned for it.

        The harness signals when it reads the ``chaos.step`` line; on a loaded machine it
        reacts tens to hundreds of milliseconds later, by when a tiny step (and the
        checkpoint after it, whose collectives commlib does not issue) may have run. So the
        rank waits, at most `external_wait_s`, for the harness to claim the firing, then
        `SIGNAL_GRACE_S` for the signal that follows the claim: the fault lands at the start
        of its step, before the step's first collective.
        """
        due = {
            i: self._ledger.fired(i)
            for i, f in self._external
            if f.trigger.matches_step(f.seed, i, self.attempt, step, elapsed) and self._ledger.fired(i) < f.count
        }
        if not due:
            return
        give_up = time.monotonic() + self.external_wait_s
        while all(self._ledger.fired(i) == n for i, n in due.items()):
            if time.monotonic() > give_up:
                return  # the harness did not act (it may be gone): train on
            time.sleep(0.005)
        time.sleep(SIGNAL_GRACE_S)

    def _await_stop(self, step: int, elapsed: float) -> None:
        """Hold the start of `step` on every rank while a ``preempt`` or ``time_limit`` planned for
        it takes effect, until SIGTERM reaches this rank (at most `NOTICE_WAIT_S`).

        The harness of the target rank's node claims the firing and acts on the Slurm job; the
        notice comes back as SIGTERM to every process of the job's step, after Slurm's own
        delay (a time-limit notice waits for its next check). Waiting here instead of training
        on makes that delay cost no step: the trainer's own handler, which runs too, has the
        request noted before this step begins, and every rank stops after this very step."""
        due = {
            i
            for i, f in self._job_stops
            if f.trigger.matches_step(f.seed, i, self.attempt, step, elapsed)
            and (self._ledger.fired(i) < f.count or self._claimed(i, step))
        }
        if not due:
            return
        noticed: list[int] = []
        previous = signal.getsignal(signal.SIGTERM)

        def note(signum: int, frame: Any) -> None:
            noticed.append(signum)
            if callable(previous):
                previous(signum, frame)

        # Noted from now on: the notice may come before this rank sees the claim.
        signal.signal(signal.SIGTERM, note)
        try:
            give_up = time.monotonic() + self.external_wait_s
            while not noticed and not any(self._claimed(i, step) for i in due):
                if time.monotonic() > give_up:
                    return  # the target rank's harness did not act: train on
                time.sleep(0.005)
            give_up = time.monotonic() + NOTICE_WAIT_S
            while not noticed and time.monotonic() < give_up:
                time.sleep(0.02)
        finally:
            signal.signal(signal.SIGTERM, previous)
        commlib.get_logger().info("chaos.stop_awaited", step=step, noticed=bool(noticed))

    def _claimed(self, index: int, step: int) -> bool:
        """Whether fault `index` fired at `step` of this attempt (by any rank's harness or injector)."""
        return any(f.index == index and f.attempt == self.attempt and f.step == step for f in self._ledger.firings())

    def on_checkpoint_staged(self, step: int) -> None:
        for i, f in self._faults:
            if f.type is FaultType.KILL_DURING_CHECKPOINT and i in self._armed:
                if self._fire(i, f, step, checkpoint_step=step):
                    os.kill(os.getpid(), signal.SIGKILL)

    def on_checkpoint_committed(self, step: int, directory: str | os.PathLike[str]) -> None:
        for i, f in self._faults:
            if f.type is FaultType.CORRUPT_CHECKPOINT and i in self._armed:
                victim = max(
                    (p for p in Path(directory).rglob("*") if p.is_file() and p.name != "COMPLETE.json"),
                    key=lambda p: p.stat().st_size,
                )
                offset = victim.stat().st_size // 2
                if self._fire(i, f, step, checkpoint_step=step, file=str(victim), offset=offset):
                    _flip_bytes(victim, offset, CORRUPT_BYTES)
                    os.kill(os.getpid(), signal.SIGKILL)

    # -- the hook ----------------------------------------------------------------------
    def _pre_hook(self, call: Collective) -> None:
        # Peers wait for a step-triggered kill or hang at most half the deadline: learned here
        # where the trainer's communicators were made after the injector.
        self.external_wait_s = min(self.external_wait_s, call.deadline_s / 2)
        for i, f in self._faults:
            if not f.type.in_collective:
                continue
            if f.trigger.kind is not TriggerKind.SEQ and i not in self._armed and i not in self._slow:
                continue
            if not f.trigger.matches_call(call.op.value, call.seq, call.comm, call.context.get("phase")):
                continue
            if i in self._slow:
                _act(f, call, self.rank, self.step)
                continue
            if f.type is FaultType.CORRUPT and _floating_input(call) is None:
                continue  # nothing to corrupt in this one; the next floating collective gets it
            step = self.step if self.step is not None else call.context.get("step")
            if self._fire(i, f, step, op=call.op.value, seq=call.seq, comm=call.comm, phase=call.context.get("phase")):
                if f.type is FaultType.STRAGGLER:
                    self._slow.add(i)
                if f.type in (FaultType.RAISE, FaultType.CORRUPT) and self.on_step_failed is not None:
                    self.on_step_failed()
                _act(f, call, self.rank, step)

    def _fire(self, index: int, fault: Fault, step: Any, **where: Any) -> bool:
        """Claim the firing in the ledger and log it; False when the count is already spent."""
        self._armed.discard(index)
        firing = self._ledger.claim(
            fault, index, self.attempt, step if isinstance(step, int) else None, pid=os.getpid(), **where
        )
        if firing is None:
            return False
        commlib.get_logger().warning(
            "chaos.fault",
            fault=fault.type.value,
            index=index,
            firing=firing.n,
            target_rank=self.rank,
            fault_step=step,
            **where,
        )
        return True


def _floating_input(call: Collective) -> torch.Tensor | None:
    return next((t for t in call.inputs() if t.is_floating_point() and t.numel() > 0), None)


def _act(fault: Fault, call: Collective, rank: int, step: Any) -> None:
    what = f"{call.op} #{call.seq} on {call.comm!r}, rank {rank}, step {step}"
    if fault.type is FaultType.DELAY:
        _sleep(fault.duration_s if fault.duration_s is not None else call.deadline_s + DELAY_MARGIN_S)
    elif fault.type is FaultType.GIL:
        _hold_gil(fault.duration_s if fault.duration_s is not None else call.deadline_s + DELAY_MARGIN_S)
    elif fault.type is FaultType.RAISE:
        raise InjectedFault(f"chaos: injected fault 'raise' in {what}")
    elif fault.type is FaultType.CORRUPT:
        tensor = _floating_input(call)
        assert tensor is not None
        with torch.no_grad():
            tensor.fill_(float("nan"))
    elif fault.type is FaultType.EXIT:
        os._exit(fault.code)
    elif fault.type is FaultType.SEGFAULT:
        ctypes.string_at(0)  # reads address 0: the kernel sends SIGSEGV
    elif fault.type is FaultType.STRAGGLER:
        assert fault.ms is not None
        _sleep(fault.ms / 1000)


def _sleep(seconds: float) -> None:
    """Sleep `seconds`, however long: in naps of at most `LONGEST_NAP_S`, since `time.sleep`
    raises OverflowError past the platform's time_t (about 1e10 s here), which would turn a
    hold into a raise. The plan bounds every duration; this keeps a value that got past it
    the fault it was meant to be."""
    until = time.monotonic() + seconds
    while (left := until - time.monotonic()) > 0:
        time.sleep(min(left, LONGEST_NAP_S))


def _hold_gil(seconds: float) -> None:
    """Sleep in C without releasing the GIL (PyDLL calls keep it, CDLL calls drop it).

    libc's sleep(3) takes whole seconds and returns early when a signal arrives (SIGUSR2
    from a peer asking for stacks): it is called again for the rest, each call holding the GIL.
    Each call is bounded by `LONGEST_NAP_S`, as `_sleep`'s: a C unsigned int would wrap a
    larger count (to 0 for 1e308 s: a busy loop instead of a sleep).
    """
    libc = ctypes.PyDLL(None)
    until = time.monotonic() + seconds
    while (left := until - time.monotonic()) > 0:
        libc.sleep(ctypes.c_uint(max(1, math.ceil(min(left, LONGEST_NAP_S)))))


def _flip_bytes(path: Path, offset: int, n: int) -> None:
    """Invert `n` bytes of `path` at `offset`, in place and durably (what bit rot or a bad disk does)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        data = f.read(n)
        f.seek(offset)
        f.write(bytes(b ^ 0xFF for b in data))
        f.flush()
        os.fsync(f.fileno())


def install_from_env(comm: commlib.Communicator | None = None, rank: int | None = None) -> Injector | None:
    """The injector for this rank when the harness set ``CHAOS_PLAN`` (`installed` from then on),
    else None.

    The plan's rank of this process: `rank` where given (a replica group's rank in the whole
    job, `chaos.workload.replica`), else `comm`'s world rank, else ``RANK`` from the environment.
    """
    path = os.environ.get(PLAN_ENV)
    if not path:
        return None
    plan = Plan.from_dict(json.loads(open(path).read()))
    if rank is None:
        rank = comm.world_rank if comm is not None else settings.integer(os.environ.get("RANK", ""), "RANK", low=0)
    state = os.environ.get(STATE_ENV) or os.path.join(os.path.dirname(os.path.abspath(path)), "chaos_state")
    start_ns = settings.env_integer(START_ENV, time.time_ns(), low=0)
    wait_s = EXTERNAL_WAIT_S if comm is None else min(EXTERNAL_WAIT_S, comm.timeout / 2)
    if comm is not None:
        for i, f in enumerate(plan.faults):
            if f.type is FaultType.STRAGGLER and f.rank == rank and f.ms is not None and f.ms / 1000 >= comm.timeout:
                raise ValueError(
                    f"chaos plan faults[{i}] on rank {rank}: expected a straggler's ms under the "
                    f"collective deadline ({comm.timeout * 1000:g} ms), so that it slows the job "
                    f"without failing it; found ms={f.ms:g} (use delay to go past the deadline)"
                )
    injector = Injector(plan, rank, Ledger(state), start_ns, external_wait_s=wait_s)
    _INSTALLED.append(injector)
    return injector
