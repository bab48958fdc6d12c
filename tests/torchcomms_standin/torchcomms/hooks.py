"""``torchcomms.hooks.FlightRecorderHook`` of the stand-in: an in-memory flight recorder.

TEST-ONLY: part of the torchcomms stand-in under tests/; it must never ship with commlib.

torch 2.13 imports ``FlightRecorderHook`` next to ``_BackendWrapper`` and registers one on
every communicator it creates when routed through torchcomms. As with torchcomms' hook
(``hooks/fr``), hooks share one process-wide recorder sized by ``TORCHCOMM_FR_BUFFER_SIZE``
(default 2000; ``max_entries`` is then ignored) unless ``isolated=True`` gives a hook its own
recorder of ``max_entries``; a size of 0 records nothing. A pre-hook records each op but
finalize, in the order issued; the post-hook retires it. ``dump_json()`` writes torch's
flight-recorder format, as torchcomms' does: ``version``, ``comm_lib_version``, ``pg_config``,
``pg_status`` and, when anything was recorded, ``entries`` whose ``profiling_name`` is
``"<backend>:<op>"`` and whose ``state`` is always ``"scheduled"`` (torchcomms records no
events for them either); ``size()`` counts what was recorded. Not emulated: stack frames,
``dump_file``, ``reset``, the abort hook that dumps, registering split children
automatically, and ``isolated`` resetting the op ids.
Importing this module must not import torch (torch probes it while it is imported itself).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import deque
from typing import Any

__all__ = ["FlightRecorderHook"]

_VERSION = "2.10"  # torch's flight-recorder format version, as torchcomms writes it
_DEFAULT_TIMEOUT_MS = 600000  # what torchcomms' hook records for every op


def _tensors(op: str, args: Any) -> tuple[list[Any], list[Any]]:
    """The op's (inputs, outputs), as torchcomms' hook reads them from the pre-hook args."""
    if op == "recv":
        return [], [args.tensor]
    if hasattr(args, "tensor"):
        return [args.tensor], [args.tensor]

    def listed(value: Any) -> list[Any]:
        return [] if value is None else list(value) if isinstance(value, list) else [value]

    return listed(getattr(args, "input", None)), listed(getattr(args, "output", None))


def _sizes_and_dtypes(tensors: list[Any]) -> tuple[list[list[int]], list[str]]:
    # c10's ScalarType names ("Float", "Long"), as torch's format has them.
    return ([list(t.shape) for t in tensors],
            [t.type().removeprefix("torch.").removesuffix("Tensor") for t in tensors])


class _Recorder:
    def __init__(self, max_entries: int) -> None:
        self.entries: deque[dict[str, Any]] = deque(maxlen=max(max_entries, 0))
        self.recorded = 0
        self.collective_seq = 0
        self.unretired: dict[int, dict[str, Any]] = {}  # by op id
        self.pg_config: dict[str, dict[str, str]] = {}
        self.lock = threading.Lock()

    def record(self, pg_id: int, comm: str, backend: str, op_id: int, op: str,
               args: Any) -> None:
        inputs, outputs = _tensors(op, args)
        input_sizes, input_dtypes = _sizes_and_dtypes(inputs)
        output_sizes, output_dtypes = _sizes_and_dtypes(outputs)
        thread = threading.current_thread()
        with self.lock:
            if self.entries.maxlen == 0:
                return
            entry = {
                "record_id": self.recorded,
                "pg_id": pg_id,
                "process_group": [comm, backend],
                "thread_name": thread.name,
                "thread_id": str(thread.ident),
                "collective_seq_id": self.collective_seq,
                "p2p_seq_id": 0,
                "op_id": op_id,
                "profiling_name": f"{backend}:{op}",
                "time_created_ns": time.time_ns(),
                "input_sizes": input_sizes,
                "input_dtypes": input_dtypes,
                "output_sizes": output_sizes,
                "output_dtypes": output_dtypes,
                "state": "scheduled",
                "time_discovered_started_ns": 0,
                "time_discovered_completed_ns": 0,
                "retired": False,
                "timeout_ms": _DEFAULT_TIMEOUT_MS,
                "is_p2p": False,
            }
            self.entries.append(entry)
            self.unretired[op_id] = entry
            self.recorded += 1
            self.collective_seq += 1

    def retire(self, op_id: int) -> None:
        with self.lock:
            entry = self.unretired.pop(op_id, None)
            if entry is not None:
                entry["retired"] = True

    def dump(self, include_completed: bool) -> dict[str, Any]:
        with self.lock:
            result: dict[str, Any] = {
                "version": _VERSION,
                "comm_lib_version": "",
                "pg_config": {name: dict(info) for name, info in self.pg_config.items()},
                "pg_status": {},
            }
            entries = [dict(e) for e in self.entries if include_completed or not e["retired"]]
        if entries:
            result["entries"] = entries
        return result


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
        self._registrations = 0

    def register_with_comm(self, comm: Any) -> None:
        name, backend = comm.get_name(), comm.get_backend()
        pg_id = self._registrations  # torchcomms numbers a hook's communicators in order
        ranks = ", ".join(str(r) for r in comm._global_ranks)
        with self._recorder.lock:
            self._recorder.pg_config[name] = {"name": name, "desc": backend, "ranks": f"[{ranks}]"}

        def pre(op: Any, op_id: int, args: Any) -> None:
            if op.name != "finalize":
                self._recorder.record(pg_id, name, backend, op_id, op.name, args)

        comm.register_pre_hook(pre)
        comm.register_post_hook(lambda op_id, args: self._recorder.retire(op_id))
        self._registrations += 1

    def size(self) -> int:
        """How many ops were recorded (more than are kept, maybe)."""
        with self._recorder.lock:
            return self._recorder.recorded

    def dump_json(self, include_completed: bool = True) -> str:
        """torch's flight-recorder JSON; ``include_completed=False`` leaves retired ops out."""
        return json.dumps(self._recorder.dump(include_completed))
