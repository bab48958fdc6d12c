"""Shared by the observe tests (imported from their directory): a run's logs as they were while
it still hung, and waiting for what another thread or process does."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from commlib.observe.log import read_events


def live_copy(src: Path, dest: Path) -> Path:
    """The logs of `src` as they were before its first deadline expired: every event from
    the first `collective.timeout` on is left out (the timeout, the aborts, the SIGUSR1s the
    timed-out rank sent its peers), and so is every flight dump taken from then on."""
    dest.mkdir()
    files = sorted(src.glob("rank*.jsonl"))
    expired = min((e["ts_ns"] for f in files for e in read_events(f) if e["event"] == "collective.timeout"),
                  default=None)
    for log_file in files:
        lines = log_file.read_text().splitlines(keepends=True)
        (dest / log_file.name).write_text("".join(
            ln for ln in lines if expired is None or json.loads(ln).get("ts_ns", 0) < expired))
    for dump in src.glob("flight_*_sigusr1.json"):
        if expired is None or json.loads(dump.read_text())["dumped_ns"] < expired:
            shutil.copy(dump, dest)
    return dest



def wait_for(predicate: Callable[[], object], timeout: float = 10.0) -> bool:
    """Whether `predicate()` came true within `timeout` seconds (polled every 5 ms)."""
    give_up = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > give_up:
            return False
        time.sleep(0.005)
    return True
