"""The c10d engine backend: one gloo or nccl `torch.distributed` engine, called directly.

The engine is either one commlib built itself (`C10dBackend.create`: a bare
`ProcessGroupGloo` / `ProcessGroupNCCL` on a store of its own, registered nowhere in
torch.distributed: the commlib process group of `commlib.process_group` carries it) or a
process group the caller already has (`commlib.init` over a default group made with
another backend; its ops go to the group's backend for the device). Either way ops are
launched through the engine's own methods (`allreduce`, `broadcast`, `_allgather_base`, ...)
with c10d's option objects, so every op carries its own deadline (`opts.timeout`), longer
or shorter than the engine's default; an option object is built once per distinct op,
timeout, reduction and root, and reused (`C10dBackend._options`). The three methods torch
2.13 renamed on ProcessGroup objects are looked up once through `compat.method`.

Reductions gloo lacks (AVG, PREMUL_SUM) are emulated here, because what a reduction means
is part of the op, and every backend must give the same numbers.

nccl is stream-ordered (`commlib.device`): the backend names its `StreamEvents`; a synchronous
op takes c10d's synchronous path (`asyncOp=False`: run on the caller's current stream, no side
stream to order, no tensor stash, no work handed back); an asynchronous one's `order` is c10d's
`Work.block_current_stream()`, the stream-only wait that neither blocks the CPU nor takes the
engine's lock, and its end is c10d's own verdict. `engine_error` is the engine's error, which
c10d's watchdog sets from its works' failures, synchronous ones included
(`commlib.backends.nccl`, which also says how commlib builds the engine so that commlib, not
c10d, decides what a timeout does to the process).

Tags: gloo matches a send with the recv of its tag; nccl ignores the tag and keeps each peer's
order (as c10d's NCCL does), so the tag is passed to both.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d_opts  # the option objects c10d methods take

from commlib import compat
from commlib.backends import nccl
from commlib.backends.gloo_p2p import OnePieceWait, PeerLanes
from commlib.device import CudaStreamEvents, StreamEvents
from commlib.failures import NETWORK_ERROR, STORE_ERROR, Failure, classify
from commlib.ops import Collective, OpName, PremulSum, ReduceOp, Reduction, reduction_kind

ENGINES = ("gloo", "nccl")
_MAX_OPTIONS = 256  # option objects kept per backend (`C10dBackend._options`)

_DIST_OPS = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.BAND: dist.ReduceOp.BAND,
    ReduceOp.BOR: dist.ReduceOp.BOR,
    ReduceOp.BXOR: dist.ReduceOp.BXOR,
    ReduceOp.AVG: dist.ReduceOp.AVG,
}
_SUM = ReduceOp.SUM  # most calls' reduction, tested per call: a module global reads faster than the enum member


def classify_exception(exc: BaseException) -> Failure:
    """What a raw torch.distributed failure means (`commlib.failures.classify`)."""
    if isinstance(exc, dist.DistNetworkError):
        return classify(NETWORK_ERROR, str(exc))
    if isinstance(exc, dist.DistStoreError):
        return classify(STORE_ERROR, str(exc))
    return classify(None, str(exc))


def wait_or_time_out(wait: Callable[..., Any], *args: Any) -> bool:
    """Run an engine's blocking `wait(*args)`: True when the op completed, False when the
    engine says it timed out; any other failure is raised. The one reading of an engine's
    wait, for both backends (torchcomms' works fail with the same torch errors)."""
    try:
        wait(*args)
    except RuntimeError as exc:
        if classify_exception(exc) is Failure.TIMEOUT:
            return False
        raise
    return True


_NEW_GROUP_SORTS = "sort_ranks" in inspect.signature(dist.new_group).parameters  # torch >= 2.12


def _routed_through_torchcomms(group: Any, device: torch.device) -> bool:
    """Whether torch built `group` over torchcomms (TORCH_DISTRIBUTED_USE_TORCHCOMMS=1)."""
    c10d = dist.distributed_c10d
    if not isinstance(group, dist.ProcessGroup) or not getattr(c10d, "_use_torchcomms_enabled", lambda: False)():
        return False
    wrapper = getattr(c10d, "_BackendWrapper", None)
    return wrapper is not None and isinstance(group._get_backend(device), wrapper)


@dataclass(slots=True)
class C10dWork:
    work: Any  # torch.distributed.Work; None for a stream-ordered engine's synchronous op (c10d hands none back)
    finish: Callable[[], None] | None = None  # emulation step run after completion
    timed_wait: bool = True  # False when Work.wait rejects a finite timeout (torchcomms-routed groups)
    one_piece: OnePieceWait | None = None  # a gloo send/recv, waited for on its peer's lane (`gloo_p2p`)
    end: nccl.VerdictEnd | None = None  # a stream-ordered engine's asynchronous op: c10d's verdict

    def order(self) -> None:
        # The current stream waits for the op's end, and nothing else (c10d's
        # block_current_stream); a torchcomms-routed group's works have only wait(), stream-only there.
        if self.work is not None:
            (self.work.block_current_stream if self.timed_wait else self.work.wait)()

    def wait(self, timeout: timedelta) -> bool:
        one_piece = self.one_piece
        if one_piece is not None:
            if not one_piece.done.wait(timeout.total_seconds()):
                return False  # the op goes on: only its lane's thread waits in the engine
            error = one_piece.error
            if error is not None:
                if classify_exception(error) is Failure.TIMEOUT:
                    return False
                raise error
        elif self.timed_wait:
            if not wait_or_time_out(self.work.wait, timeout):
                return False
        # torchcomms' WorkWrapper raises "wait timeout not supported" for a finite timeout,
        # and its is_completed() only turns True inside wait(): the op's deadline is the
        # timeout launch put in its c10d options, so an untimed wait() ends then.
        elif not wait_or_time_out(self.work.wait):
            return False
        if self.finish is not None:
            self.finish()
            self.finish = None
        return True

    def is_completed(self) -> bool:
        if self.one_piece is not None:
            return self.one_piece.done.is_set()
        return bool(self.work.is_completed())


class C10dBackend:
    """A Communicator backend over one c10d engine (see the module docstring).

    `store` is where splits rendezvous; `owned` says whether commlib built the engine (and
    so shuts it down on finalize) or wraps a caller's process group (which it leaves alone:
    its ops go to the group's backend for `device`, since a ProcessGroup's own methods look
    one up per call and a Python-made group may register none).
    """

    def __init__(
        self, engine: Any, device: torch.device, store: dist.Store, *, owned: bool, name: str | None = None
    ) -> None:
        self.group = engine  # what splits and aborts act on
        self.engine = engine if owned else engine._get_backend(device)
        self.device = device
        self.rank = engine.rank()
        self.size = engine.size()
        self.name = name or engine.name()
        self._store = store
        self._owned = owned
        self._splits = 0
        self._native_avg = self.name == "nccl"
        self._routed = _routed_through_torchcomms(engine, device)
        # gloo's Work.wait(timeout) only stops waiting; NCCL's aborts the communicator, and a
        # torchcomms-routed group's takes no finite timeout at all.
        self.resumable_wait = self.name == "gloo" and not self._routed
        # gloo's send/recv waits are made resumable by waiting for them in one piece on a
        # thread per peer (`gloo_p2p`): its own timed waits close the context's connections.
        self._peer_lanes = PeerLanes(self.name) if self.resumable_wait else None
        self.events: StreamEvents | None = (
            CudaStreamEvents(device) if device.type == "cuda" and self.name != "gloo" else None
        )
        if self.events is not None and not owned and not self._routed:
            nccl.warn_wrapped(self.name, device)
        # ProcessGroup objects (torchcomms' wrapper among them) answer to torch 2.13's new
        # method names, Backend objects to the old ones: look each up once.
        self._all_gather_single = compat.method(self.engine, "all_gather_single")
        self._reduce_scatter_single = compat.method(self.engine, "reduce_scatter_single")
        self._all_to_all_single = compat.method(self.engine, "all_to_all_single")
        self._option_cache: dict[tuple[Any, ...], Any] = {}

    @classmethod
    def create(
        cls, engine: str, *, store: dist.Store, rank: int, size: int, device: torch.device, timeout: timedelta
    ) -> C10dBackend:
        """A new engine of kind `engine` ("gloo" or "nccl") among `size` ranks meeting in `store`."""
        engine_store = dist.PrefixStore("engine/", store)
        if engine == "gloo":
            impl = dist.ProcessGroupGloo(engine_store, rank, size, timeout)
        elif engine == "nccl":
            impl = nccl.build_engine(engine_store, rank, size, device, timeout)
        else:
            raise ValueError(f"commlib: expected an engine in {ENGINES}; found {engine!r}")
        return cls(impl, device, store, owned=True, name=engine)

    # -- launch -------------------------------------------------------------------------
    def launch(self, call: Collective, timeout: timedelta) -> C10dWork:
        reduce_op = call.reduce_op
        finish = None if reduce_op is None or reduce_op is _SUM else self._emulate(call)
        key = (call.op, timeout, reduce_op, call.root, call.async_op)
        opts = self._option_cache.get(key)
        if opts is None and call.peer is None:  # send and recv take no option object
            opts = self._options(key)
        work = C10dWork(_LAUNCH[call.op](self, call, opts), finish, not self._routed)
        if call.peer is not None and self._peer_lanes is not None:
            work.one_piece = self._peer_lanes.wait_for((call.peer, call.tag), work.work, timeout)
        elif self.events is not None and work.work is not None and not self._routed:
            work.end = nccl.VerdictEnd(work.work)
        return work

    def engine_error(self) -> BaseException | None:
        """A stream-ordered engine's own error (`commlib.backends.nccl.engine_error`)."""
        return nccl.engine_error(self.engine) if self.events is not None and not self._routed else None

    # One function per op, looked up by op (`_LAUNCH`, below the class): an if-chain over
    # OpName members would read up to a dozen of them per call, and reading an enum member
    # through its class goes through EnumType.__getattr__ (about 100 ns each on Python 3.11).
    # Each takes the option object `_options` made for the call (None for send and recv).
    def _launch_all_reduce(self, call: Collective, opts: Any) -> Any:
        return self.engine.allreduce([call.tensor], opts)

    def _launch_broadcast(self, call: Collective, opts: Any) -> Any:
        return self.engine.broadcast([call.tensor], opts)

    def _launch_reduce(self, call: Collective, opts: Any) -> Any:
        return self.engine.reduce([call.tensor], opts)

    def _launch_all_gather(self, call: Collective, opts: Any) -> Any:
        return self.engine.allgather([call.output_list], [call.input], opts)

    def _launch_all_gather_single(self, call: Collective, opts: Any) -> Any:
        return self._all_gather_single(call.output, call.input, opts)

    def _launch_reduce_scatter(self, call: Collective, opts: Any) -> Any:
        return self.engine.reduce_scatter([call.output], [call.input_list], opts)

    def _launch_reduce_scatter_single(self, call: Collective, opts: Any) -> Any:
        # torchcomms' gloo (under torch's routing) overwrites the input with the full reduction.
        # reduce_scatter_single always has an input (Communicator's signature).
        source = call.input.clone() if self._routed and self.name == "gloo" else call.input  # type: ignore[union-attr]
        return self._reduce_scatter_single(call.output, source, opts)

    def _launch_all_to_all_single(self, call: Collective, opts: Any) -> Any:
        return self._all_to_all_single(call.output, call.input, [], [], opts)

    def _launch_gather(self, call: Collective, opts: Any) -> Any:
        # torchcomms' wrapper wants one (empty) output list off the root too.
        outputs = [call.output_list] if call.rank == call.root else ([[]] if self._routed else [])
        return self.engine.gather(outputs, [call.input], opts)

    def _launch_scatter(self, call: Collective, opts: Any) -> Any:
        inputs = [call.input_list] if call.rank == call.root else []
        return self.engine.scatter([call.output], inputs, opts)

    def _launch_send(self, call: Collective, opts: Any) -> Any:
        return self.engine.send([call.tensor], call.peer, call.tag)

    def _launch_recv(self, call: Collective, opts: Any) -> Any:
        return self.engine.recv([call.tensor], call.peer, call.tag)

    def _launch_barrier(self, call: Collective, opts: Any) -> Any:
        return self.engine.barrier(opts)

    def _options(self, key: tuple[Any, ...]) -> Any:
        """c10d's option object for the collectives of `key` (op, timeout, reduction, root,
        async_op): their timeout, and their reduction and root where the op has them.

        Engines copy what they read of it during the launch, so one object per distinct key is
        built (here) and reused (`launch`): building one costs more than the rest of a launch,
        and so does turning a commlib reduction into a c10d one (`_c10d_reduction`), which is
        done only then.
        """
        op, timeout, reduce_op, root, async_op = key
        opts = _OPTION_KINDS[op]()
        opts.timeout = timeout
        # A stream-ordered engine's synchronous op takes c10d's synchronous path (module docstring).
        if self.events is not None and not async_op:
            opts.asyncOp = False
        if reduce_op is not None:
            opts.reduceOp = self._c10d_reduction(reduce_op)
        if root is not None:
            opts.rootRank = root
        if len(self._option_cache) < _MAX_OPTIONS:
            self._option_cache[key] = opts
        return opts

    def _c10d_reduction(self, op: Reduction) -> Any:
        """The dist.ReduceOp to launch `op` with (gloo runs AVG and PREMUL_SUM as a SUM: `_emulate`)."""
        kind = reduction_kind(op)
        if kind is ReduceOp.PREMUL_SUM:
            assert isinstance(op, PremulSum)
            return dist._make_nccl_premul_sum(op.factor) if self._native_avg else dist.ReduceOp.SUM
        if kind is ReduceOp.AVG and not self._native_avg:
            return dist.ReduceOp.SUM
        return _DIST_OPS[kind]

    def _emulate(self, call: Collective) -> Callable[[], None] | None:
        """What a reduction the engine lacks takes besides its SUM: PREMUL_SUM scales the
        input now; AVG divides the result on completion (the step returned)."""
        if self._native_avg:
            return None
        # Only reductions come here (a reduce_op is set), and PREMUL_SUM is the kind of a PremulSum.
        kind = reduction_kind(call.reduce_op)  # type: ignore[arg-type]
        if kind is ReduceOp.PREMUL_SUM:
            self._prescale(call, call.reduce_op.factor)  # type: ignore[union-attr]
        elif kind is ReduceOp.AVG:
            outputs = call.outputs()
            size = self.size
            is_root = call.op is not OpName.REDUCE or call.rank == call.root

            def divide() -> None:
                if is_root:
                    for t in outputs:
                        t.div_(size)

            return divide
        return None

    @staticmethod
    def _prescale(call: Collective, factor: float) -> None:
        # In-place ops (all_reduce, reduce) scale their one tensor; others scale a copy so
        # the caller's input is left as it was.
        if call.tensor is not None:
            call.tensor.mul_(factor)
        elif call.input is not None:
            call.input = call.input * factor
        elif call.input_list is not None:
            call.input_list = [t * factor for t in call.input_list]

    # -- the rest of the protocol ------------------------------------------------------
    def supports(self, device: torch.device, op: Reduction | None) -> str | None:
        if device.type != self.device.type:
            return f"backend {self.name} serves {self.device.type} tensors"
        if self.device.index is not None and device.index != self.device.index:
            return f"backend {self.name} serves tensors on {self.device}, the device it runs on"
        return None

    def split(self, ranks: list[int], name: str, timeout: timedelta) -> C10dBackend | None:
        self._splits += 1
        if not self._owned:
            return self._split_through_torch(ranks, name, timeout)
        # Only members build the new engine; the counter advances on every rank (split is
        # collective over this one), so members agree on the store prefix without talking.
        if self.rank not in ranks:
            return None
        engine = self.name if self.name in ENGINES else ("nccl" if self.device.type == "cuda" else "gloo")
        store = dist.PrefixStore(f"split{self._splits}.{name}/", self._store)
        return C10dBackend.create(
            engine, store=store, rank=ranks.index(self.rank), size=len(ranks), device=self.device, timeout=timeout
        )

    def _split_through_torch(self, ranks: list[int], name: str, timeout: timedelta) -> C10dBackend | None:
        """A split of a caller's process group: torch's `new_group`, so it is built the way
        the caller's group was (torchcomms-routed groups split through `TorchComm.split`)."""
        parent_ranks = dist.get_process_group_ranks(self.group)
        global_ranks = [parent_ranks[r] for r in ranks]
        # Every member of the parent calls new_group, non-members included when the parent is
        # the world group, because c10d numbers groups by call order. sort_ranks=False: new
        # ranks follow the order of `ranks`, as torchcomms' split does; routed through
        # torchcomms, new_group refuses sort_ranks=False even for sorted ranks.
        in_order = global_ranks == sorted(global_ranks)
        order: dict[str, bool] = {}
        if _NEW_GROUP_SORTS:
            order["sort_ranks"] = in_order
        elif not in_order:
            # Before torch 2.12 new_group always sorts: the ranks would silently come back in
            # another order than the one asked for.
            raise ValueError(
                f"commlib: split({ranks}, {name!r}) on torch {torch.__version__}: expected the ranks in "
                f"ascending order (this torch's new_group cannot keep another order); found {ranks}"
            )
        group = dist.new_group(
            global_ranks,
            timeout=timeout,
            group_desc=name,
            use_local_synchronization=self.size != dist.get_world_size(),
            **order,
        )
        if self.rank not in ranks:
            return None
        return C10dBackend(group, self.device, self._store, owned=False)

    def classify(self, exc: BaseException) -> Failure:
        return classify_exception(exc)

    def abort(self) -> None:
        try:
            self.group.abort()
        except RuntimeError:
            pass  # engines without abort support: the Communicator is marked dead anyway

    def finalize(self) -> None:
        if self._owned:
            self.engine.shutdown()


# The option object each collective's engine method takes (send and recv take none).
_OPTION_KINDS: dict[OpName, Callable[[], Any]] = {
    OpName.ALL_REDUCE: c10d_opts.AllreduceOptions,
    OpName.BROADCAST: c10d_opts.BroadcastOptions,
    OpName.REDUCE: c10d_opts.ReduceOptions,
    OpName.ALL_GATHER: c10d_opts.AllgatherOptions,
    OpName.ALL_GATHER_SINGLE: c10d_opts.AllgatherOptions,
    OpName.REDUCE_SCATTER: c10d_opts.ReduceScatterOptions,
    OpName.REDUCE_SCATTER_SINGLE: c10d_opts.ReduceScatterOptions,
    OpName.ALL_TO_ALL_SINGLE: c10d_opts.AllToAllOptions,
    OpName.GATHER: c10d_opts.GatherOptions,
    OpName.SCATTER: c10d_opts.ScatterOptions,
    OpName.BARRIER: c10d_opts.BarrierOptions,
}
_LAUNCH: dict[OpName, Callable[[C10dBackend, Collective, Any], Any]] = {
    OpName.ALL_REDUCE: C10dBackend._launch_all_reduce,
    OpName.BROADCAST: C10dBackend._launch_broadcast,
    OpName.REDUCE: C10dBackend._launch_reduce,
    OpName.ALL_GATHER: C10dBackend._launch_all_gather,
    OpName.ALL_GATHER_SINGLE: C10dBackend._launch_all_gather_single,
    OpName.REDUCE_SCATTER: C10dBackend._launch_reduce_scatter,
    OpName.REDUCE_SCATTER_SINGLE: C10dBackend._launch_reduce_scatter_single,
    OpName.ALL_TO_ALL_SINGLE: C10dBackend._launch_all_to_all_single,
    OpName.GATHER: C10dBackend._launch_gather,
    OpName.SCATTER: C10dBackend._launch_scatter,
    OpName.SEND: C10dBackend._launch_send,
    OpName.RECV: C10dBackend._launch_recv,
    OpName.BARRIER: C10dBackend._launch_barrier,
}
