"""The ledger of firings: every firing of a plan's faults, persisted in the run directory.

One file per firing, created with O_EXCL *before* the fault acts, so that a restarted rank,
or the harness, never fires a fault more often than its count, and the report knows exactly
what was done and when.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from chaos.fault import Fault


@dataclass(frozen=True)
class Firing:
    """One firing of one fault, as the ledger holds it."""

    index: int  # the fault's position in the plan
    n: int  # 1-based: the n-th firing of that fault
    type: str
    rank: int
    attempt: int
    ts_ns: int  # wall clock when the fault acted (just before)
    step: int | None = None
    detail: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Firing:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


class Ledger:
    """Firings of a plan's faults, one small JSON file per firing under `directory`.

    The harness and every rank share it (through the run directory), so a fault with
    count N fires N times in all, however many times torchrun restarts the job.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)

    def fired(self, index: int) -> int:
        return len(list(self.directory.glob(f"fault{index}.*.json")))

    def total(self) -> int:
        return len(list(self.directory.glob("fault*.json")))

    def claim(self, fault: Fault, index: int, attempt: int, step: int | None = None, **detail: Any) -> Firing | None:
        """Record the next firing of `fault` before it acts; None when its count is spent."""
        for n in range(self.fired(index) + 1, fault.count + 1):
            firing = Firing(index, n, fault.type.value, int(fault.rank), attempt, time.time_ns(), step, detail)
            try:
                fd = os.open(self.directory / f"fault{index}.{n}.json", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                continue  # someone else took number n: try the next one
            with os.fdopen(fd, "w") as f:
                json.dump(firing.__dict__, f)
            return firing
        return None

    def firings(self) -> list[Firing]:
        """Every firing so far, in the order they happened."""
        out = []
        for path in self.directory.glob("fault*.json"):
            try:
                out.append(Firing.from_dict(json.loads(path.read_text())))
            except (ValueError, TypeError):
                continue  # a firing being written right now: it is read on the next call
        return sorted(out, key=lambda f: (f.ts_ns, f.index, f.n))
