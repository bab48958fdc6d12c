"""The torchcomms backend: a `torchcomms.TorchComm`, imported lazily.

Written against torchcomms' documented Python API (`torchcomms.new_comm`, `TorchComm`
methods that all take a required positional `async_op` and keyword `hints`/`timeout`,
`root=` for rooted ops, its own `ReduceOp` with AVG and PREMUL_SUM(factor)). torchcomms
cannot be installed on the machines this project is developed on, so this module is tested
against the strict stand-in in tests/torchcomms_standin; see docs/torchcomms.md for what that
does and does not prove.

Rank and size: torchcomms reads them from the environment only (TORCHCOMM_RANK /
TORCHCOMM_SIZE, then the launcher's), even when given a store, so `create` sets those two
variables from commlib's explicit arguments while `new_comm` runs and puts the environment
back afterwards. Every communicator gets commlib's store under a prefix of its own name, with
the `persistent_store` hint (so torchcomms uses it directly instead of starting its own store
server; it allows one communicator per store), so two commlib communicators, or a split,
never collide.

On CUDA the communicator is stream-ordered (`commlib.device`): a work's `order` is
`TorchWork.wait()`, which there only makes the current stream wait, and the deadline is commlib's
(`commlib.deadlines`); torchcomms' own per-op timeout is set far beyond it
(`commlib.device.engine_timeout_s`) and `abort_process_on_timeout_or_error` is False, so
torchcomms never acts first. An op's end is its work's status (`is_completed()`, an atomic read
without the GIL, which torchcomms updates within its 1 s status poll): an op in ERROR or
TIMEDOUT never reads as completed, so commlib's deadline fails it. An abort torchcomms decides on
anyway (its abort hook) is the engine's error. Ops of a communicator run on its one internal
stream. On CPU engines (gloo) a wait blocks the CPU under the deadline.

torchcomms' send and recv take no tag: a tagged send/recv is matched in each peer's order, as
c10d's NCCL matches it.

Where torchcomms' engines differ, this backend makes them mean one thing: a
`reduce_scatter_single` leaves its input as it was (gloo's overwrites it), and a split that
leaves ranks out keeps every rank's split counter in step (gloo's does not advance it for an
empty rank list).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from commlib.backends.base import Failure
from commlib.backends.c10d import classify_exception, wait_or_time_out
from commlib.device import CudaStreamEvents, StreamEvents, engine_timeout_s
from commlib.errors import CommError
from commlib.ops import Collective, OpName, PremulSum, ReduceOp, Reduction

INSTALL_HINT = (
    "install torchcomms (pip install torchcomms, with a torch build it supports; see "
    "https://github.com/meta-pytorch/torchcomms), or use backend='auto', 'gloo' or 'nccl'"
)


def available() -> str | None:
    """None when a real torchcomms can be imported; otherwise why it cannot."""
    try:
        import torchcomms
    except ImportError as exc:
        return f"torchcomms cannot be imported ({exc})"
    if not hasattr(torchcomms, "new_comm"):
        return "the installed torchcomms has no new_comm (the empty PyPI placeholder?)"
    return None


@contextlib.contextmanager
def _rank_and_size_in_environment(rank: int, size: int) -> Iterator[None]:
    """TORCHCOMM_RANK/TORCHCOMM_SIZE for the duration of a `new_comm`, then as they were."""
    keys = {"TORCHCOMM_RANK": str(rank), "TORCHCOMM_SIZE": str(size)}
    before = {key: os.environ.get(key) for key in keys}
    os.environ.update(keys)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                del os.environ[key]
            else:
                os.environ[key] = value


def _torchcomms() -> Any:
    why = available()
    if why is not None:
        raise CommError(f"commlib.init('torchcomms'): expected a usable torchcomms; found {why}. {INSTALL_HINT}")
    import torchcomms

    return torchcomms


_POLL_MARGIN_S = 0.05  # a wait this close to the op's own deadline just waits for torchcomms
_POLL_INTERVAL_S = 0.0005
_ABORTED_BY_TORCHCOMMS = "torchcomms communicator was aborted by torchcomms"


@dataclass
class TorchcommsWork:
    work: Any  # torchcomms.TorchWork
    deadline_mono: float  # torchcomms times the op out (its per-op timeout) no earlier than this
    backend: TorchcommsBackend

    def wait(self, timeout: timedelta) -> bool:
        # TorchWork is not thread-safe: everything here runs on the caller's thread.
        until = time.monotonic() + timeout.total_seconds()
        # TorchWork.wait() takes no timeout (on gloo it blocks up to the op's own one): a
        # caller's shorter wait is honoured by polling up to that point.
        if until < self.deadline_mono - _POLL_MARGIN_S:
            while not self.work.is_completed():
                if time.monotonic() >= until:
                    return False
                time.sleep(_POLL_INTERVAL_S)
        return wait_or_time_out(self.work.wait)

    def is_completed(self) -> bool:
        return bool(self.work.is_completed())

    @property
    def end(self) -> Any:
        return _Completed(self.work)

    def order(self) -> None:
        self.work.wait()  # on CUDA: the current stream waits for the op; the CPU does not


@dataclass(frozen=True, slots=True)
class _Completed:
    """A TorchWork's end for the deadline thread: `is_completed()`, COMPLETED alone (module docstring)."""

    work: Any

    def query(self) -> bool:
        return bool(self.work.is_completed())


class TorchcommsBackend:
    """A Communicator backend over one `torchcomms.TorchComm`."""

    def __init__(self, comm: Any, device: torch.device) -> None:
        self._tc = _torchcomms()
        self.comm = comm
        self.device = device
        self.rank = comm.get_rank()
        self.size = comm.get_size()
        self.name = f"torchcomms:{comm.get_backend()}"
        self.events: StreamEvents | None = CudaStreamEvents(device) if device.type == "cuda" else None
        # gloo overwrites reduce_scatter_single's input with the full reduction.
        self._copy_reduce_scatter_input = comm.get_backend() == "gloo"
        # A TorchWork's is_completed() stays False after its op failed, so only a blocking
        # wait() sees a dead peer at once: waiting in slices (to read a peer's abort
        # announcement) would make a killed peer wait out the whole deadline.
        self.resumable_wait = False
        # The one torchcomms hook used: an abort torchcomms decides on its own (the NCCL
        # family's watchdog aborting on an op nobody waits for) is invisible to commlib's path;
        # remember it so the next launch fails fast instead of blocking on a dead communicator.
        # gloo runs abort hooks only when a synchronous op fails, which commlib never issues;
        # a timed-out gloo communicator refuses its next op by itself ("pair closure").
        self.engine_aborted = False
        self._abort_hook = comm.register_abort_hook(self._on_engine_abort)

    @classmethod
    def create(
        cls,
        *,
        rank: int,
        size: int,
        store: dist.Store,
        name: str,
        device: torch.device,
        timeout: timedelta,
        engine: str | None = None,
    ) -> TorchcommsBackend:
        tc = _torchcomms()
        engine = engine or ("nccl" if device.type == "cuda" else "gloo")
        if device.type == "cuda":  # stream-ordered: commlib's deadline thread holds the deadline (module docstring)
            timeout = timedelta(seconds=engine_timeout_s(timeout.total_seconds()))
        with _rank_and_size_in_environment(rank, size):
            comm = tc.new_comm(
                engine,
                device,
                abort_process_on_timeout_or_error=False,
                timeout=timeout,
                store=dist.PrefixStore(f"torchcomms/{name}/", store),
                name=name,
                hints={"persistent_store": "true"},
            )
        return cls(comm, device)

    def _on_engine_abort(self, *_: Any) -> None:
        self.engine_aborted = True

    # -- launch -------------------------------------------------------------------------
    def launch(self, call: Collective, timeout: timedelta) -> TorchcommsWork:
        if self.engine_aborted:
            raise RuntimeError(_ABORTED_BY_TORCHCOMMS)
        c, op = self.comm, call.op
        kw = {"timeout": timeout}
        deadline_mono = time.monotonic() + timeout.total_seconds()  # taken before torchcomms' own
        if op is OpName.ALL_REDUCE:
            w = c.all_reduce(call.tensor, self._op(call.reduce_op), True, **kw)
        elif op is OpName.BROADCAST:
            w = c.broadcast(call.tensor, call.root, True, **kw)
        elif op is OpName.REDUCE:
            w = c.reduce(call.tensor, call.root, self._op(call.reduce_op), True, **kw)
        elif op is OpName.ALL_GATHER:
            w = c.all_gather(call.output_list, call.input, True, **kw)
        elif op is OpName.ALL_GATHER_SINGLE:
            w = c.all_gather_single(call.output, call.input, True, **kw)
        elif op is OpName.REDUCE_SCATTER:
            w = c.reduce_scatter(call.output, call.input_list, self._op(call.reduce_op), True, **kw)
        elif op is OpName.REDUCE_SCATTER_SINGLE:
            # reduce_scatter_single always has an input (Communicator's signature).
            source = call.input.clone() if self._copy_reduce_scatter_input else call.input  # type: ignore[union-attr]
            w = c.reduce_scatter_single(call.output, source, self._op(call.reduce_op), True, **kw)
        elif op is OpName.ALL_TO_ALL_SINGLE:
            w = c.all_to_all_single(call.output, call.input, True, **kw)
        elif op is OpName.GATHER:
            w = c.gather(call.output_list or [], call.input, call.root, True, **kw)
        elif op is OpName.SCATTER:
            w = c.scatter(call.output, call.input_list or [], call.root, True, **kw)
        elif op is OpName.SEND:
            w = c.send(call.tensor, call.peer, True, **kw)  # no tags: each peer's order (module docstring)
        elif op is OpName.RECV:
            w = c.recv(call.tensor, call.peer, True, **kw)
        elif op is OpName.BARRIER:
            w = c.barrier(True, **kw)
        else:  # pragma: no cover - OpName is closed
            raise NotImplementedError(op)
        return TorchcommsWork(w, deadline_mono, self)

    def engine_error(self) -> BaseException | None:
        """An abort torchcomms decided on by itself (its abort hook), as an error."""
        return RuntimeError(_ABORTED_BY_TORCHCOMMS) if self.engine_aborted else None

    def _op(self, op: Reduction | None) -> Any:
        ops = self._tc.ReduceOp
        if isinstance(op, PremulSum):
            return ops.PREMUL_SUM(op.factor)
        return getattr(ops, (op or ReduceOp.SUM).name)

    # -- the rest of the protocol ------------------------------------------------------
    def supports(self, device: torch.device, op: Reduction | None) -> str | None:
        if device.type != self.device.type:
            return f"backend {self.name} serves {self.device.type} tensors"
        return None

    def split(self, ranks: list[int], name: str, timeout: timedelta) -> TorchcommsBackend | None:
        if self.rank in ranks:
            return TorchcommsBackend(self.comm.split(ranks, name, timeout=timeout), self.device)
        # A non-member's split([]) returns before torchcomms' gloo advances its split counter,
        # and the members' next split would then wait for this rank under other store keys.
        # A split of this rank alone advances it like the members' (a list without the caller
        # raises); the 1-rank child is not needed.
        self.comm.split([self.rank], name, timeout=timeout).finalize()
        return None

    def classify(self, exc: BaseException) -> Failure:
        return classify_exception(exc)

    def abort(self) -> None:
        self._abort_hook.remove()
        if self.comm.is_abort_supported():
            self.comm.abort()
        # Otherwise (gloo) torchcomms cannot abort: the Communicator is marked dead anyway.

    def finalize(self) -> None:
        self._abort_hook.remove()
        self.comm.finalize()
