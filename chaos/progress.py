"""How far a run has got, and its progress line: steps done (of the trainer's ``--steps``
where known), faults injected (the ledger's count, in-rank firings included), restarts, and
the time since the launch. The line goes to the caller's callback whenever it changes.

Restarts are the highest torchrun attempt seen in the ranks' logs or among the agents'
workers, which are listed every `SCAN_S`: an attempt that dies before logging anything (say,
in the backend's connect) is a restart all the same.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from chaos.plan import Ledger, Plan
from chaos.processes import JobProcesses

SCAN_S = 0.5  # how often the worker processes are listed (to count restarts)


class Progress:
    def __init__(
        self,
        plan: Plan,
        ledger: Ledger,
        processes: JobProcesses,
        start_ns: int,
        total_steps: int | None,
        show: Callable[[str], None] | None,
    ) -> None:
        self.plan = plan
        self.ledger = ledger
        self.processes = processes
        self.start_ns = start_ns
        self.total_steps = total_steps
        self.show_line = show
        self.steps_done = 0
        self.restarts = 0  # the highest torchrun restart count seen
        self.first_step_ns: int | None = None  # wall clock of the first train.step of any rank
        self._last_line = ""
        self._next_scan = 0.0

    def on_event(self, event: dict[str, Any]) -> None:
        self.restarts = max(self.restarts, int(event.get("attempt", 0)))
        if event.get("event") == "train.step":
            self.steps_done = max(self.steps_done, int(event.get("step", 0)))
            if self.first_step_ns is None:
                self.first_step_ns = int(event["ts_ns"])

    def scan(self) -> None:
        """The workers' attempts, when the last look is `SCAN_S` old."""
        if time.monotonic() >= self._next_scan:
            self._next_scan = time.monotonic() + SCAN_S
            self.restarts = max([self.restarts, *(w.attempt for w in self.processes.workers())])

    def show(self) -> None:
        if self.show_line is None:
            return
        total = f"/{self.total_steps}" if self.total_steps else ""
        faults = self.ledger.total() if self.plan.faults else 0
        state = (
            f"step {self.steps_done}{total} | faults injected {faults}/"
            f"{sum(f.count for f in self.plan.faults)} | restarts {self.restarts}"
        )
        if state != self._last_line:
            self._last_line = state
            self.show_line(f"{state} | {(time.time_ns() - self.start_ns) / 1e9:.1f} s")
