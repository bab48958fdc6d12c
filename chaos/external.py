"""Faults applied from outside the ranks: when each of the plan's external faults fires, how
it acts, and when it is released.

- ``kill`` (SIGKILL), ``hang`` (SIGSTOP, then SIGKILL or SIGCONT) and ``sigterm`` (SIGTERM: a
  scheduler's preemption notice) go to the target rank's worker (`chaos.processes`);
- ``disk_full`` fills the small disk on the checkpoint directory (`chaos.disk`);
- ``partition``, ``net_delay`` and ``net_loss`` impair the link of the node running the rank
  (`chaos.net`); when one is lifted, the link's counters over its window are noted, and once
  the job is over, the target rank's steps inside the window against those outside every
  window (`ExternalFaults.note_step_times`);
- ``preempt``, ``time_limit`` and ``node_loss`` act on the Slurm job (`chaos.slurm.faults`),
  fired by the harness of the node running the target rank.

``step`` and ``p`` triggers are evaluated when the target rank's log shows it starting a step
(`on_event`), ``after_s`` once that much time has passed (`poll`); each firing is claimed in
the ledger and recorded in the harness's journal (``chaos.fault``, then ``chaos.release``),
naming the faulted process ``target_rank`` and ``target_pid`` (a journal line's own ``pid`` is
the harness's). A held fault (a hang, a full disk, a network fault) lasts its ``duration_s``,
or by default until a survivor logs a typed error (the failure was detected), the job ends,
or `HANG_MAX_HOLD_S` passes; then it is released.
"""

from __future__ import annotations

import signal
import socket
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import psutil

from chaos.disk import SmallDisk
from chaos.net import Impairment, Network
from chaos.plan import Fault, FaultType, Firing, Ledger, Plan, Release, TriggerKind
from chaos.processes import JobProcesses, Worker, send

HANG_MAX_HOLD_S = 300.0  # a hang with no duration is released at the latest after this
# A survivor's event that says the fault was noticed (`train.failed_in_step`: the trainer
# caught it in a step and is recovering in-job, e.g. a NonFiniteError, which is no CommError;
# `train.preempted`: every rank agreed to stop after a SIGTERM).
TYPED_ERRORS = frozenset(
    {
        "collective.timeout",
        "peer.failure",
        "collective.error",
        "collective.mismatch",
        "train.error",
        "train.failed_in_step",
        "train.preempted",
    }
)
_FAULT_SIGNALS = {FaultType.KILL: signal.SIGKILL, FaultType.HANG: signal.SIGSTOP, FaultType.SIGTERM: signal.SIGTERM}


@dataclass
class _Hold:
    """A fault acting until it is released: a stopped rank, a full disk, an impaired link."""

    fault: Fault
    index: int
    proc: psutil.Process
    rank: int
    since_ns: int
    node: int | None = None  # network faults: the node whose link is impaired
    link_before: dict[str, int] | None = None  # network faults: that link's counters when it was impaired


class ExternalFaults:
    """The plan's external faults over one run: their triggers, firings and holds."""

    def __init__(
        self,
        plan: Plan,
        ledger: Ledger,
        notes: Any,
        processes: JobProcesses,
        start_ns: int,
        disk: SmallDisk | None = None,
        network: Network | None = None,
    ) -> None:
        self.faults = [(i, f) for i, f in enumerate(plan.faults) if f.type.external]
        self.ledger = ledger
        self.notes = notes  # the harness's journal (`commlib.record.log.event_log`)
        self.processes = processes
        self.start_ns = start_ns
        self.disk = disk
        self.network = network
        self.tried: set[tuple[int, int, int]] = set()  # (fault index, pid, step) already evaluated
        self.holds: list[_Hold] = []
        self.ranks_with_step_events: set[int] = set()
        self.errors_after: list[tuple[int, int]] = []  # (ts_ns, pid) of typed errors seen
        # (start ns, rank, step, step_time_s) of completed steps, but a process's first (it warms up)
        self.step_times: list[tuple[int, int, int, float]] = []
        self._stepped: set[object] = set()  # pids that completed a step (as the logs give them)
        # pid -> the attempt its log lines carry: the one every rank agreed, which a worker's
        # environment only estimates (its node's restart count; `commlib.attempt`)
        self.attempts: dict[int, int] = {}
        self.windows: list[tuple[_Hold, int]] = []  # lifted network faults, and when they were lifted

    # -- what the ranks' logs say ------------------------------------------------------
    def on_event(self, event: dict[str, Any]) -> None:
        """A rank's log line: a step starting (its triggers), a step's time (network faults'
        notes), a typed error (what releases a hold)."""
        name, rank, pid = event.get("event"), event.get("rank"), event.get("pid")
        if isinstance(pid, int) and isinstance(event.get("attempt"), int):
            self.attempts[pid] = event["attempt"]
        if name == "train.step":
            took = event.get("step_time_s")
            if isinstance(rank, int) and isinstance(took, (int, float)) and pid in self._stepped:
                self.step_times.append((int(event["ts_ns"] - took * 1e9), rank, int(event["step"]), float(took)))
            self._stepped.add(pid)
        if name in TYPED_ERRORS and isinstance(pid, int):
            self.errors_after.append((int(event["ts_ns"]), pid))
        if not isinstance(rank, int) or not isinstance(pid, int):
            return
        # The step a rank is starting: the injector's chaos.step, or else the step after a train.step.
        if name == "chaos.step":
            self.ranks_with_step_events.add(rank)
            self._step_triggers(rank, pid, int(event["step"]), int(event.get("attempt", 0)))
        elif name == "train.step" and rank not in self.ranks_with_step_events:
            self._step_triggers(rank, pid, int(event["step"]) + 1, int(event.get("attempt", 0)))

    def poll(self) -> None:
        """The ``after_s`` faults now due, and the holds now over."""
        self._after_s_triggers()
        self.release_holds()

    # -- triggers ----------------------------------------------------------------------
    def _step_triggers(self, rank: int, pid: int, step: int, attempt: int) -> None:
        elapsed = (time.time_ns() - self.start_ns) / 1e9
        for i, f in self.faults:
            if f.rank != rank or f.trigger.kind is TriggerKind.AFTER_S or (i, pid, step) in self.tried:
                continue
            self.tried.add((i, pid, step))
            if f.trigger.matches_step(f.seed, i, attempt, step, elapsed) and self.ledger.fired(i) < f.count:
                worker = self.processes.worker(rank, pid)
                if worker is not None:
                    self._fire(i, f, worker, step, attempt)

    def _after_s_triggers(self) -> None:
        elapsed = (time.time_ns() - self.start_ns) / 1e9
        for i, f in self.faults:
            if f.trigger.kind is not TriggerKind.AFTER_S or elapsed < f.trigger.value:
                continue
            if self.ledger.fired(i) >= f.count or any(h.index == i for h in self.holds):
                continue
            worker = self.processes.worker(int(f.rank))
            if worker is not None and (i, worker.proc.pid, -1) not in self.tried:
                self.tried.add((i, worker.proc.pid, -1))
                self._fire(i, f, worker, None, self.attempts.get(worker.proc.pid, worker.attempt))

    # -- firing ------------------------------------------------------------------------
    def _fire(self, index: int, fault: Fault, worker: Worker, step: int | None, attempt: int) -> None:
        if fault.type is FaultType.DISK_FULL:
            self._fill_disk(index, fault, worker, step, attempt)
            return
        if fault.type.network:
            self._impair(index, fault, worker, step, attempt)
            return
        if fault.type.slurm:
            self._act_on_job(index, fault, worker, step, attempt)
            return
        firing = self.ledger.claim(fault, index, attempt, step, pid=worker.proc.pid, node=worker.node)
        if firing is None:
            return
        sig = _FAULT_SIGNALS[fault.type]
        error = send(worker.proc, sig)
        self._note_fired(fault, index, firing, worker, step, attempt, signal=sig.name, error=error)
        if fault.type is FaultType.HANG and error is None:
            self.holds.append(_Hold(fault, index, worker.proc, int(fault.rank), firing.ts_ns))

    def _fill_disk(self, index: int, fault: Fault, worker: Worker, step: int | None, attempt: int) -> None:
        # Filled before the claim, unlike the signals: the rank starts its step SIGNAL_GRACE_S
        # after the claim, and filling takes a while on a loaded machine.
        assert self.disk is not None  # mounted by run_job for a plan with a disk_full fault
        filled = self.disk.fill()
        firing = self.ledger.claim(fault, index, attempt, step, pid=worker.proc.pid, node=worker.node)
        if firing is None:
            self.disk.drain()
            return
        self._note_fired(
            fault, index, firing, worker, step, attempt, filled_bytes=filled, free_bytes=self.disk.free_bytes()
        )
        self.holds.append(_Hold(fault, index, worker.proc, int(fault.rank), firing.ts_ns))

    def _impair(self, index: int, fault: Fault, worker: Worker, step: int | None, attempt: int) -> None:
        assert self.network is not None  # opened by run_job for a plan with a network fault
        node = worker.node
        if any(h.fault.type is fault.type and h.node == node for h in self.holds):
            return  # that link has this impairment already: not fired at this step (nor claimed)
        # Applied before the claim, like the disk: the rank starts its step SIGNAL_GRACE_S after it.
        before = asdict(self.network.stats(node))
        link = _set_impairment(self.network, fault, node, on=True)
        firing = self.ledger.claim(fault, index, attempt, step, pid=worker.proc.pid, node=node)
        if firing is None:
            _set_impairment(self.network, fault, node, on=False)
            return
        self._note_fired(
            fault,
            index,
            firing,
            worker,
            step,
            attempt,
            netns=self.network.nodes[node].netns,
            address=self.network.address(node),
            link=asdict(link),
            duration_s=fault.duration_s,
        )
        self.holds.append(_Hold(fault, index, worker.proc, int(fault.rank), firing.ts_ns, node, before))

    def _act_on_job(self, index: int, fault: Fault, worker: Worker, step: int | None, attempt: int) -> None:
        """A Slurm fault (`chaos.slurm.faults`): noted before it acts, since a lost node takes this
        harness with it. What it asks of a time limit is worked out before the claim, which keeps
        it for the requeued run to give the limit back."""
        from chaos.slurm import faults as slurm

        where = {"pid": worker.proc.pid, "node": worker.node, "host": socket.gethostname()}
        try:
            limit = slurm.time_limit_change() if fault.type is FaultType.TIME_LIMIT else {}
        except slurm.SlurmFaultError as exc:
            self.notes.error("chaos.fault_failed", fault=fault.type.value, index=index, error=str(exc))
            return
        firing = self.ledger.claim(fault, index, attempt, step, **where, **limit)
        if firing is None:
            return
        self._note_fired(fault, index, firing, worker, step, attempt, host=where["host"], **limit)
        try:
            if fault.type is FaultType.PREEMPT:
                preemptor = slurm.preempt(fault.partition or slurm.PREEMPTOR_PARTITION)
                self.notes.info("chaos.preemptor", index=index, job_id=preemptor)
            elif fault.type is FaultType.TIME_LIMIT:
                slurm.apply_time_limit(limit["limit_min"])  # type: ignore[arg-type]  # time_limit_change sets it
            else:
                slurm.power_off()
        except slurm.SlurmFaultError as exc:
            self.notes.error("chaos.fault_failed", fault=fault.type.value, index=index, error=str(exc))

    def _note_fired(
        self, fault: Fault, index: int, firing: Firing, worker: Worker, step: int | None, attempt: int, **how: Any
    ) -> None:
        self.notes.info(
            "chaos.fault",
            fault=fault.type.value,
            index=index,
            firing=firing.n,
            target_rank=int(fault.rank),
            target_pid=worker.proc.pid,
            node=worker.node,
            fault_step=step,
            attempt=attempt,
            **how,
            fired_ts_ns=firing.ts_ns,
        )

    # -- holds -------------------------------------------------------------------------
    def release_holds(self, force: bool = False) -> None:
        now = time.time_ns()
        for hold in list(self.holds):
            held_s = (now - hold.since_ns) / 1e9
            if force:
                reason = "harness stopping"
            elif hold.fault.duration_s is not None:
                reason = "duration" if held_s >= hold.fault.duration_s else ""
            elif any(
                ts >= hold.since_ns and (pid != hold.proc.pid or hold.fault.type is FaultType.DISK_FULL)
                for ts, pid in self.errors_after
            ):
                reason = "a survivor reported the failure"
            elif not self.processes.running():
                reason = "the job ended"
            else:
                reason = "maximum hold" if held_s >= HANG_MAX_HOLD_S else ""
            if not reason:
                continue
            self.holds.remove(hold)
            if hold.fault.type.network:
                self._lift(hold, held_s, reason)
                continue
            if hold.fault.type is FaultType.DISK_FULL:  # space freed, as an operator would
                assert self.disk is not None
                self.disk.drain()
                self._note_released(hold, held_s, reason, free_bytes=self.disk.free_bytes())
                continue
            release = Release.KILL if force else hold.fault.release
            sig = signal.SIGKILL if release is Release.KILL else signal.SIGCONT
            error = send(hold.proc, sig)
            self._note_released(hold, held_s, reason, signal=sig.name, error=error)

    def _lift(self, hold: _Hold, held_s: float, reason: str) -> None:
        """A network fault's end: the link back, with what crossed it meanwhile."""
        assert self.network is not None and hold.node is not None and hold.link_before is not None
        _set_impairment(self.network, hold.fault, hold.node, on=False)
        counts = asdict(self.network.stats(hold.node))
        self.windows.append((hold, time.time_ns()))
        self._note_released(
            hold, held_s, reason, node=hold.node, link={k: counts[k] - hold.link_before[k] for k in counts}
        )

    def _note_released(self, hold: _Hold, held_s: float, reason: str, **how: Any) -> None:
        self.notes.info(
            "chaos.release",
            fault=hold.fault.type.value,
            index=hold.index,
            target_rank=hold.rank,
            target_pid=hold.proc.pid,
            held_s=held_s,
            reason=reason,
            **how,
        )

    def note_step_times(self) -> None:
        """Once the job is over: per lifted network fault, the target rank's steps that started
        while it was on, against that rank's steps that started outside every such window."""

        def inside(start: int) -> bool:
            return any(h.since_ns <= start < lifted for h, lifted in self.windows)

        for hold, lifted in self.windows:
            mine = [(start, step, took) for start, r, step, took in self.step_times if r == hold.rank]
            during = [(step, took) for start, step, took in mine if hold.since_ns <= start < lifted]
            outside = [took for start, _, took in mine if not inside(start)]
            self.notes.info(
                "chaos.net_steps",
                fault=hold.fault.type.value,
                index=hold.index,
                target_rank=hold.rank,
                steps=[s for s, _ in during],
                step_time_s_during=_median([t for _, t in during]),
                step_time_s_outside=_median(outside),
                steps_outside=len(outside),
            )


def _set_impairment(network: Network, fault: Fault, node: int, *, on: bool) -> Impairment:
    """Turn `fault`'s part of `node`'s link on or off (kinds compose: a delayed link can also be cut)."""
    if fault.type is FaultType.PARTITION:
        return network.impair(node, cut=on)
    if fault.type is FaultType.NET_DELAY:
        assert fault.ms is not None
        return network.impair(node, delay_s=fault.ms / 1000 if on else 0.0)
    assert fault.type is FaultType.NET_LOSS and fault.pct is not None
    return network.impair(node, loss=fault.pct / 100 if on else 0.0)


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None
