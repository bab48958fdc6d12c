"""``torchcomms.hooks.FlightRecorderHook`` of the stand-in: a minimal in-memory recorder.

TEST-ONLY: part of the torchcomms stand-in under tests/; it must never ship with commlib.

torch 2.13 imports ``FlightRecorderHook`` next to ``_BackendWrapper`` and registers one on
every communicator it creates when routed through torchcomms. As with torchcomms' hook
(``hooks/fr``), hooks share one process-wide recorder sized by ``TORCHCOMM_FR_BUFFER_SIZE``
(default 2000; ``max_entries`` is then ignored) unless ``isolated=True`` gives a hook its own
recorder of ``max_entries``; a size of 0 records nothing. It keeps the last entries (op id,
op name, communicator name) in the order ops were issued. Not emulated: completion states,
torch's flight-recorder JSON format (``dump_json`` gives ``{"entries": [...]}``), dumping to
files, and the abort hook that waits for a health check before aborting.
"""

from __future__ import annotations

import json
import os
import threading
from collections import deque
from typing import Any

__all__ = ["FlightRecorderHook"]


class _Recorder:
    def __init__(self, max_entries: int) -> None:
        self.entries: deque[dict[str, Any]] = deque(maxlen=max(max_entries, 0))
        self.lock = threading.Lock()

    def record(self, op_id: int, op: str, comm: str) -> None:
        with self.lock:
            self.entries.append({"op_id": op_id, "op": op, "comm": comm})


_shared: _Recorder | None = None
_shared_lock = threading.Lock()


def _shared_recorder() -> _Recorder:
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = _Recorder(int(os.environ.get("TORCHCOMM_FR_BUFFER_SIZE", "2000")))
        return _shared


class FlightRecorderHook:
    """Records the ops of the communicators it is registered with."""

    def __init__(self, max_entries: int = 2048, isolated: bool = False) -> None:
        self._recorder = _Recorder(max_entries) if isolated else _shared_recorder()
        self._registered = False

    def register_with_comm(self, comm: Any) -> None:
        name = comm.get_name()
        comm.register_pre_hook(lambda op, op_id, args: self._recorder.record(op_id, op.name, name))
        self._registered = True

    def is_enabled(self) -> bool:
        """True once registered with a communicator, as in torchcomms."""
        return self._registered

    def size(self) -> int:
        with self._recorder.lock:
            return len(self._recorder.entries)

    def __len__(self) -> int:
        return self.size()

    def reset(self) -> None:
        with self._recorder.lock:
            self._recorder.entries.clear()

    def dump_json(self) -> str:
        with self._recorder.lock:
            return json.dumps({"entries": list(self._recorder.entries)})
