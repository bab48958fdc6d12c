"""commlib as a torch.distributed backend: `init_process_group(backend="commlib")`.

    torch.distributed.init_process_group(backend="commlib", timeout=timedelta(seconds=60))

makes the default group, and every group made from it (`new_group`, DeviceMesh dimensions,
FSDP2's and DCP's groups), a `CommlibProcessGroup`: a c10d `ProcessGroup` implemented in
Python whose every collective is a call of the `Communicator` underneath it. So the
collectives of an unmodified trainer (FSDP2, DCP, DeviceMesh, DDP, DTensor's functional
collectives, `all_gather_object`, `barrier`) take commlib's one path: validation, sequence
number, hooks, flight recorder, progress board, structured log, and a deadline that raises
a typed error naming the ranks that did not arrive. This module only translates c10d's
calling convention (tensor lists, option objects, old and new method names) into
`Communicator` calls (`CommlibProcessGroup._translated` reads an op's c10d options); it
repeats none of the Communicator's work. That translation runs on every collective, so it
reads each option once and remembers what does not change: the group's one communicator,
and the commlib reduction of each torch reduction kind.

The engine communicators under each group, and how they are built, are `commlib.engines`'s
(`EngineOptions`, `Recipe`); c10d's calling convention (option objects, tensor lists, the
c10d `Work` handed back) is translated by `commlib.group_calls`.

Deadlines: `init_process_group(timeout=)` is every collective's default deadline, and every
group made later without a `timeout=` of its own (`new_group`, DeviceMesh dimensions, groups
made from those) takes the default group's deadline of that moment. c10d hands such a group
its own stand-in, `default_pg_timeout` (30 min), so that value reads as "not given". torch's
ways of changing a group's timeout later reach commlib too: `ProcessGroup.set_timeout` (what
2.14's `dist.set_timeout` calls) is this class's, and an engine's `_set_default_timeout`
(what 2.13's `_set_pg_timeout` and callers of `group._get_backend(device)` call) also sets the
deadline of the commlib communicator over that engine (`commlib.engine_calls`).

Tensors that are not contiguous, which gloo takes (`all_reduce(t.t())`, `broadcast(t[::2])`,
strided outputs), go through a contiguous copy, copied back into the caller's tensors when
the op completes (`commlib.group_calls.restaged`); the Communicator's own API keeps refusing them.

The group object stays while the communicators under it can be replaced
(`CommlibProcessGroup.replace_communicators`), which is what in-job recovery needs: FSDP2
and DCP hold the group, not the engine.

Limits (see docs/torch-backend.md):
- C++ callers reach only the methods torch's Python-group trampoline forwards (all the
  collectives FSDP2, DDP and the functional collectives use); `reduce`, `gather`, `scatter`
  and list `alltoall` called from C++ would reach the engine registered for the device
  directly, bypassing commlib. torch.distributed's Python functions always come here.
- DDP: a bucket's all-reduce completes inside `get_future()`, on the autograd thread that
  asked for it, so it no longer overlaps the rest of backward.
- `all_to_all_single` with uneven splits and `recv_anysource` are refused with a clear error:
  commlib's API has no equivalent. torch refuses `monitored_barrier` for every backend but
  gloo; `dist.barrier` over commlib already names the ranks that did not arrive.
"""

from __future__ import annotations

import atexit
import dataclasses
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d_opts  # the option objects c10d methods take
from torch.distributed.constants import default_pg_timeout

from commlib import attempt, compat
from commlib.communicator import Communicator
from commlib.engine_calls import engine_timeout, follow_engine_calls, set_engine_timeout
from commlib.engines import EngineOptions, Recipe, check_consistency, devices_for
from commlib.group_calls import (
    CommlibWork,
    handed_back,
    one_tensor,
    reduction_of,
    restaged,
    strided,
)
from commlib.record import flight
from commlib.record import log as _log
from commlib.validation import seconds

BACKEND_NAME = "commlib"
_UNSET = timedelta(0)  # c10d's options say "no timeout of the op's own" with a negative one
# The two registries this module owns. Options for groups that torch creates without any
# (new_group, DeviceMesh), taken from the default group's:
_DEFAULTS: list[EngineOptions] = []
# and every engine registered into a c10d ProcessGroup (`_register_engines`), released from Python
# at interpreter exit, while the interpreter can still hand the GIL to the engines' workers. One
# per group made (rebuilt engines are not registered): a process that makes groups by the
# thousand keeps their first engines, threads and connections until it exits.
_REGISTERED_ENGINES: list[Any] = []


@atexit.register
def _release_registered_engines() -> None:
    while _REGISTERED_ENGINES:
        _REGISTERED_ENGINES.pop()  # the last reference, for a group already gone: joins without the GIL


def current(group: dist.ProcessGroup | None = None, device: torch.device | str | None = None) -> Communicator:
    """The Communicator behind a torch.distributed group (default: the default group).

    With `device`, the one serving that device type (a group over CUDA also has a gloo
    communicator for CPU tensors).
    """
    if group is None:
        if not dist.is_initialized():
            raise RuntimeError(
                "commlib.current: expected torch.distributed's default group (commlib.init or "
                "init_process_group(backend='commlib')); found none"
            )
        group = dist.group.WORLD
    if not isinstance(group, CommlibProcessGroup):
        raise TypeError(
            f"commlib.current: expected a group made by the commlib backend; found "
            f"{type(group).__name__} of backend {dist.get_backend(group)!r}"
        )
    return group.communicator(device)


def create(opts: Any, engine_options: EngineOptions | None) -> CommlibProcessGroup:
    """c10d's creator for `backend="commlib"` (extended API: `_DistributedBackendOptions`)."""
    if engine_options is not None and not isinstance(engine_options, EngineOptions):
        raise TypeError(
            f"commlib process group: expected pg_options to be commlib.EngineOptions; found "
            f"{type(engine_options).__name__}"
        )
    is_default = len(opts.global_ranks_in_group) == 0
    options = engine_options or (_DEFAULTS[0] if _DEFAULTS else EngineOptions())
    # Under torchrun's shared store, keyed under the attempt every rank agreed (not stale keys).
    store = attempt.scoped(opts.store, opts.group_rank, opts.group_size, is_default, opts.timeout.total_seconds())
    if is_default:
        _DEFAULTS[:] = [options]
        if options.configure_process:
            _log.configure(opts.group_rank, opts.group_size, store=store)
            flight.install_sigusr1(_log.log_dir)
        if compat.BACKFILLED:
            _log.get_logger().info("compat.backfilled", names=list(compat.BACKFILLED))
    name = options.name if is_default and options.name else ("world" if is_default else f"group{opts.group_id}")
    # The members' global ranks, by group rank (torch lists them for every group but the default one).
    global_ranks = tuple(range(opts.group_size)) if is_default else tuple(opts.global_ranks_in_group)
    options = dataclasses.replace(options, check_consistency=check_consistency(options.check_consistency, name))
    recipe = Recipe(
        options,
        tuple(devices_for(options, name)),
        store,
        opts.group_rank,
        opts.group_size,
        _deadline_of_new_group(opts.timeout, is_default),
        global_ranks,
    )
    follow_engine_calls(_communicators_over)
    group = CommlibProcessGroup(recipe.build(store), opts.group_rank, opts.group_size)
    group._recipe = recipe
    return group


def group_over_store(
    store: dist.Store,
    rank: int,
    size: int,
    timeout_s: float,
    name: str,
    options: EngineOptions | None = None,
    global_ranks: Sequence[int] | None = None,
) -> CommlibProcessGroup:
    """A commlib process group over `store` that no `init_process_group` makes, for a library
    that makes and replaces its groups itself (torchft at each quorum: `commlib.replicas`).
    `global_ranks`: each member's global rank, by group rank, which errors and logs name (None:
    the group's own ranks).

    torch.distributed's registry does not hold it; it logs into this process's log as it is
    configured, and in-job recovery can rebuild it like any other (it keeps its recipe).
    """
    options = options or EngineOptions()
    options = dataclasses.replace(options, check_consistency=check_consistency(options.check_consistency, name))
    members = tuple(range(size)) if global_ranks is None else tuple(global_ranks)
    recipe = Recipe(options, tuple(devices_for(options, name)), store, rank, size, timeout_s, members)
    group = CommlibProcessGroup(recipe.build(store), rank, size)
    group._recipe = recipe
    return group


def _deadline_of_new_group(timeout: timedelta, is_default: bool) -> float:
    """A new group's default deadline: its own `timeout=`, else the default group's now.

    c10d passes `default_pg_timeout` for a group made without `timeout=` (module docstring).
    """
    world = None if is_default else dist.group.WORLD
    if timeout == default_pg_timeout and isinstance(world, CommlibProcessGroup):
        return world.communicator().timeout
    timeout_s = seconds(timeout)
    assert timeout_s is not None
    return timeout_s


def _communicators_over(engine: Any) -> list[Communicator]:
    """The communicators over `engine`, in every commlib group of the process (`follow_engine_calls`)."""
    return [comm for group in commlib_groups() for comm in group._communicators_over(engine)]


def commlib_groups() -> list[CommlibProcessGroup]:
    """Every commlib process group of this process that torch.distributed knows, default group first.

    Read from torch.distributed's own group registry (in creation order, which every rank
    shares because group creation is collective); commlib keeps no list of its own.
    """
    registry = getattr(dist.distributed_c10d, "_world", None)
    groups = list(registry.pg_map) if registry is not None else []
    return [g for g in groups if isinstance(g, CommlibProcessGroup)]


class CommlibProcessGroup(dist.ProcessGroup):
    """A torch.distributed group whose collectives are calls of commlib Communicators."""

    def __init__(self, comms: dict[str, Communicator], rank: int, size: int) -> None:
        super().__init__(rank, size)
        self._group_name = self._group_desc = ""
        self._set_communicators(comms)

    # -- the communicators -------------------------------------------------------------
    def communicator(self, device: torch.device | str | None = None) -> Communicator:
        if device is None:
            return next(iter(self._comms.values()))
        kind = torch.device(device).type
        comm = self._comms.get(kind)
        if comm is None:
            raise ValueError(
                f"commlib process group rank {self.rank()}: expected a tensor on "
                f"{' or '.join(self._comms)}; found one on {kind}"
            )
        return comm

    def replace_communicators(self, comms: dict[str, Communicator]) -> None:
        """Put new communicators under this group (in-job recovery); the group object stays."""
        if comms.keys() != self._comms.keys():
            raise ValueError(
                f"commlib process group: expected communicators for {list(self._comms)}; found {list(comms)}"
            )
        self._set_communicators(dict(comms))

    def rebuild_communicators(self, epoch: int) -> None:
        """New engine communicators under this group for recovery epoch `epoch` (collective over the group).

        They rendezvous under `epoch{N}/` of the group's store, so no key of an earlier
        incarnation is read; the old communicators are aborted first (idempotent). Each new
        one keeps its predecessor's deadline (a trainer may have set it after creation).
        """
        recipe: Recipe | None = getattr(self, "_recipe", None)
        if recipe is None:
            raise RuntimeError(
                f"commlib process group rank {self.rank()}: expected a group made by the commlib "
                f"backend's creator (it keeps how to rebuild it); found none to rebuild from"
            )
        if not isinstance(epoch, int) or epoch < 1:
            raise ValueError(f"commlib process group rank {self.rank()}: expected epoch >= 1; found {epoch!r}")
        self.abort_quietly()
        deadlines = {kind: comm.timeout for kind, comm in self._comms.items()}
        self.replace_communicators(recipe.build(dist.PrefixStore(f"epoch{epoch}/", recipe.store), deadlines))

    def abort_quietly(self, reason: str = "aborted") -> None:
        """Abort every communicator under this group; one that fails to abort does not stop the others."""
        for comm in self._comms.values():
            try:
                comm.abort(reason)
            except Exception as exc:  # an engine already torn down: it is unusable either way
                _log.get_logger().warning("comm.abort_failed", comm=comm.name, error=f"{type(exc).__name__}: {exc}")

    def set_timeout(self, timeout: timedelta) -> None:
        """torch's `ProcessGroup.set_timeout`: every communicator's deadline, and each engine's own
        timeout for it (c10d forwards the raw value to every registered engine first: a
        stream-ordered engine's is put back to what commlib gives it, `engine_timeout`)."""
        super().set_timeout(timeout)
        for comm in self._comms.values():
            comm.set_timeout(timeout)
            engine = comm.engine
            if engine is not None and comm.stream_ordered:
                set_engine_timeout(engine, engine_timeout(comm, timeout))

    def _communicators_over(self, engine: Any) -> list[Communicator]:
        """The communicators that `engine` stands for: of the device it was registered for."""
        return [self._comms[kind] for registered, kind in self._engines if registered is engine]

    def _set_communicators(self, comms: dict[str, Communicator]) -> None:
        first = not hasattr(self, "_comms")
        self._comms = comms
        # What a group with a single communicator hands every op, without a device lookup.
        self._only = next(iter(comms.values())) if len(comms) == 1 else None
        if first:
            self._engines: list[tuple[Any, str]] = []  # every engine the group ever had, with its device
        for kind, comm in comms.items():
            if comm.engine is not None:
                self._engines.append((comm.engine, kind))
        if first:
            self._register_engines()

    def _register_engines(self) -> None:
        """Register each communicator's engine for its device, with c10d's own backend type.

        c10d keeps the first backend of a type for good (ProcessGroup::setBackend ignores a new
        one) and has no way to remove one, so only the first engines are registered: torch's
        Python callers of `group._get_backend(device)` (`_set_pg_timeout`, device capability
        checks, `init_process_group`'s eager connect) get the live engine from this class's
        `_get_backend`, through every rebuild; C++ callers, which read only the group's name and
        backend type through it, keep the first. The main device's type is the group's default
        backend: torch 2.15 reads the group's name through it.

        A registered engine is also kept until the interpreter exits (`_REGISTERED_ENGINES`): its
        destructor joins the engine's worker threads, and a worker that is dropping a finished
        op's tensors needs the GIL. Dropped from Python (pybind's no-GIL destructor, c10d's fix
        for pytorch#56297) the join is safe; dropped from C++ it is not: when DDP's Reducer is
        freed with the GIL held (a trainer's model going out of scope after
        `destroy_process_group`), it releases this group, c10d's ProcessGroup releases the
        engine it registered, and the join waits for a worker that waits for the GIL (a DDP
        trainer over commlib hung so at exit; py-spy showed both threads).
        """
        for kind, comm in self._comms.items():
            engine = comm.engine
            if engine is None:
                continue
            backend_type = dist.ProcessGroup.BackendType.NCCL if kind == "cuda" else dist.ProcessGroup.BackendType.GLOO
            self._register_backend(torch.device(kind), backend_type, engine)
            _REGISTERED_ENGINES.append(engine)
            if kind == next(iter(self._comms)):
                self._set_default_backend(backend_type)

    def _get_backend(self, device: Any) -> Any:
        """The engine of the live communicator for `device`'s type (`_register_engines`)."""
        comm = self._comms.get(torch.device(device).type)
        engine = None if comm is None else comm.engine
        return engine if engine is not None else super()._get_backend(device)

    # c10d keeps a group's name and description in its registered backends, and a group
    # over torchcomms has none registered: keep them here as well, for Python readers
    # (DeviceMesh reads `group_name` of every dimension's group).
    def _set_group_name(self, name: str) -> None:
        self._group_name = name
        super()._set_group_name(name)

    @property
    def group_name(self) -> str:
        return self._group_name

    def _set_group_desc(self, desc: str) -> None:
        self._group_desc = desc
        super()._set_group_desc(desc)

    @property
    def group_desc(self) -> str:
        return self._group_desc

    def getBackendName(self) -> str:  # noqa: N802 - c10d's name
        return BACKEND_NAME

    def name(self) -> str:
        return BACKEND_NAME

    # -- collectives: c10d's calling convention in, Communicator calls out ---------------
    def _translated(
        self,
        opts: Any,
        on: torch.Tensor | None,
    ) -> tuple[Communicator, bool, float | None]:
        """c10d's options of one op, read once: the communicator of `on`'s device (None: the
        group's main one), whether the caller asked for a Work (`opts.asyncOp`: `handed_back`),
        and the op's own deadline (None where unset: the communicator's)."""
        timeout = opts.timeout
        comm = self._only or self.communicator(None if on is None else on.device)
        return comm, opts.asyncOp, timeout.total_seconds() if timeout > _UNSET else None

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> CommlibWork | None:
        opts = opts or c10d_opts.AllreduceOptions()
        t = one_tensor(tensors, "allreduce")
        if not t.is_contiguous():
            return restaged(self.allreduce, (tensors, opts), writes=(0,))
        comm, async_op, timeout = self._translated(opts, t)
        work = comm.all_reduce(t, reduction_of(opts), async_op=async_op, timeout=timeout)
        return handed_back(async_op, [work], tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> CommlibWork | None:
        opts = opts or c10d_opts.AllreduceCoalescedOptions()
        if strided(tensors):
            return restaged(self.allreduce_coalesced, (tensors, opts), writes=(0,))
        op, async_op, works = reduction_of(opts), opts.asyncOp, []
        for t in tensors:
            comm, _, timeout = self._translated(opts, t)
            works.append(comm.all_reduce(t, op, async_op=async_op, timeout=timeout))
        return handed_back(async_op, works, tensors)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> CommlibWork | None:
        opts = opts or c10d_opts.BroadcastOptions()
        t = one_tensor(tensors, "broadcast")
        if not t.is_contiguous():
            return restaged(self.broadcast, (tensors, opts), writes=(0,))
        comm, async_op, timeout = self._translated(opts, t)
        work = comm.broadcast(t, opts.rootRank, async_op=async_op, timeout=timeout)
        return handed_back(async_op, [work], tensors)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> CommlibWork | None:
        opts = opts or c10d_opts.ReduceOptions()
        t = one_tensor(tensors, "reduce")
        if not t.is_contiguous():
            return restaged(self.reduce, (tensors, opts), writes=(0,))
        comm, async_op, timeout = self._translated(opts, t)
        work = comm.reduce(t, opts.rootRank, reduction_of(opts), async_op=async_op, timeout=timeout)
        return handed_back(async_op, [work], tensors)

    def allgather(
        self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> CommlibWork | None:
        opts = opts or c10d_opts.AllgatherOptions()
        t, outputs = one_tensor(inputs, "allgather"), one_tensor(output_lists, "allgather")
        if strided([t, *outputs]):
            return restaged(self.allgather, (output_lists, inputs, opts), writes=(0,))
        comm, async_op, timeout = self._translated(opts, t)
        work = comm.all_gather(outputs, t, async_op=async_op, timeout=timeout)
        return handed_back(async_op, [work], outputs)

    def allgather_coalesced(
        self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> CommlibWork | None:
        opts = opts or c10d_opts.AllgatherOptions()
        if strided([*inputs, *(o for outs in output_lists for o in outs)]):
            return restaged(self.allgather_coalesced, (output_lists, inputs, opts), writes=(0,))
        async_op, works = opts.asyncOp, []
        for outs, t in zip(output_lists, inputs, strict=True):
            comm, _, timeout = self._translated(opts, t)
            works.append(comm.all_gather(outs, t, async_op=async_op, timeout=timeout))
        return handed_back(async_op, works, [o for outs in output_lists for o in outs])

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> CommlibWork | None:
        opts = opts or c10d_opts.AllgatherOptions()
        if not (output.is_contiguous() and input.is_contiguous()):
            return restaged(self.all_gather_single, (output, input, opts), writes=(0,))
        comm, async_op, timeout = self._translated(opts, input)
        work = comm.all_gather_single(output, input, async_op=async_op, timeout=timeout)
        return handed_back(async_op, [work], [output])

    def all_gather_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> CommlibWork | None:
        opts = opts or c10d_opts.AllgatherOptions()
        if strided([*outputs, *inputs]):
            return restaged(self.all_gather_single_coalesced, (outputs, inputs, opts), writes=(0,))
        async_op, works = opts.asyncOp, []
        for o, i in zip(outputs, inputs, strict=True):
            comm, _, timeout = self._translated(opts, i)
            works.append(comm.all_gather_single(o, i, async_op=async_op, timeout=timeout))
        return handed_back(async_op, works, outputs)

    def reduce_scatter(
        self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts: Any = None
    ) -> CommlibWork | None:
        opts = opts or c10d_opts.ReduceScatterOptions()
        t, inputs = one_tensor(outputs, "reduce_scatter"), one_tensor(input_lists, "reduce_scatter")
        if strided([t, *inputs]):
            return restaged(self.reduce_scatter, (outputs, input_lists, opts), writes=(0,))
        comm, async_op, timeout = self._translated(opts, t)
        op = reduction_of(opts)
        work = comm.reduce_scatter(t, inputs, op, async_op=async_op, timeout=timeout)
        return handed_back(async_op, [work], outputs)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> CommlibWork | None:
        opts = opts or c10d_opts.ReduceScatterOptions()
        if not (output.is_contiguous() and input.is_contiguous()):
            return restaged(self.reduce_scatter_single, (output, input, opts), writes=(0,))
        comm, async_op, timeout = self._translated(opts, input)
        op = reduction_of(opts)
        work = comm.reduce_scatter_single(output, input, op, async_op=async_op, timeout=timeout)
        return handed_back(async_op, [work], [output])

    def reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> CommlibWork | None:
        opts = opts or c10d_opts.ReduceScatterOptions()
        if strided([*outputs, *inputs]):
            return restaged(self.reduce_scatter_single_coalesced, (outputs, inputs, opts), writes=(0,))
        op, async_op, works = reduction_of(opts), opts.asyncOp, []
        for o, i in zip(outputs, inputs, strict=True):
            comm, _, timeout = self._translated(opts, i)
            works.append(comm.reduce_scatter_single(o, i, op, async_op=async_op, timeout=timeout))
        return handed_back(async_op, works, outputs)

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> CommlibWork | None:
        opts = opts or c10d_opts.AllToAllOptions()
        n = self.size()
        for role, splits, t in (("output", output_split_sizes, output), ("input", input_split_sizes, input)):
            even = t.shape[0] // n if t.dim() else 0
            if splits and list(splits) != [even] * n:
                raise NotImplementedError(
                    f"commlib process group all_to_all_single on rank {self.rank()}: expected even "
                    f"{role} splits {[even] * n}; found {list(splits)} (commlib's all_to_all_single has no splits)"
                )
        if not (output.is_contiguous() and input.is_contiguous()):
            return restaged(
                self.all_to_all_single, (output, input, output_split_sizes, input_split_sizes, opts), writes=(0,)
            )
        comm, async_op, timeout = self._translated(opts, input)
        work = comm.all_to_all_single(output, input, async_op=async_op, timeout=timeout)
        return handed_back(async_op, [work], [output])

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> CommlibWork | None:
        opts = opts or c10d_opts.AllToAllOptions()
        shapes = {tuple(t.shape) for t in [*outputs, *inputs]}
        if len(shapes) > 1:
            raise NotImplementedError(
                f"commlib process group alltoall on rank {self.rank()}: expected tensors of one shape; found "
                f"{sorted(shapes)} (it runs as one all_to_all_single)"
            )
        # One staged all_to_all_single: the op takes commlib's path once, not once per peer.
        staged_in = torch.stack(inputs)
        staged_out = torch.empty_like(staged_in)
        comm, async_op, timeout = self._translated(opts, staged_in)
        work = comm.all_to_all_single(staged_out, staged_in, async_op=async_op, timeout=timeout)

        def copy_out() -> None:
            for out, piece in zip(outputs, staged_out.unbind(0), strict=True):
                out.copy_(piece)

        return handed_back(async_op, [work], outputs, copy_out)

    def gather(
        self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> CommlibWork | None:
        opts = opts or c10d_opts.GatherOptions()
        t = one_tensor(inputs, "gather")
        outputs = one_tensor(output_lists, "gather") if output_lists else None
        if strided([t, *(outputs or [])]):
            return restaged(self.gather, (output_lists, inputs, opts), writes=(0,))
        comm, async_op, timeout = self._translated(opts, t)
        work = comm.gather(outputs, t, opts.rootRank, async_op=async_op, timeout=timeout)
        return handed_back(async_op, [work], outputs or [])

    def scatter(
        self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts: Any = None
    ) -> CommlibWork | None:
        opts = opts or c10d_opts.ScatterOptions()
        t = one_tensor(outputs, "scatter")
        inputs = one_tensor(input_lists, "scatter") if input_lists else None
        if strided([t, *(inputs or [])]):
            return restaged(self.scatter, (outputs, input_lists, opts), writes=(0,))
        comm, async_op, timeout = self._translated(opts, t)
        work = comm.scatter(t, inputs, opts.rootRank, async_op=async_op, timeout=timeout)
        return handed_back(async_op, [work], outputs)

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> CommlibWork:
        t = one_tensor(tensors, "send")
        if not t.is_contiguous():
            return restaged(self.send, (tensors, dst, tag), writes=())  # type: ignore[return-value]
        comm = self._only or self.communicator(t.device)
        work = comm.send(t, dst, tag=tag, async_op=True)
        return CommlibWork([work], tensors)  # type: ignore[list-item]

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> CommlibWork:
        t = one_tensor(tensors, "recv")
        if not t.is_contiguous():
            return restaged(self.recv, (tensors, src, tag), writes=(0,))  # type: ignore[return-value]
        comm = self._only or self.communicator(t.device)
        work = comm.recv(t, src, tag=tag, async_op=True)
        return CommlibWork([work], tensors)  # type: ignore[list-item]

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> CommlibWork:
        raise NotImplementedError(
            f"commlib process group rank {self.rank()}: expected recv from a named source; "
            f"found recv_anysource (commlib numbers each peer's messages)"
        )

    def barrier(self, opts: Any = None) -> CommlibWork | None:
        comm, async_op, timeout = self._translated(opts or c10d_opts.BarrierOptions(), None)
        return handed_back(async_op, [comm.barrier(async_op=async_op, timeout=timeout)], [])

    # -- lifecycle ---------------------------------------------------------------------
    def abort(self) -> None:
        for comm in self._comms.values():
            comm.abort()

    def shutdown(self) -> None:
        for comm in self._comms.values():
            comm.finalize()


def _alias_old_method_names() -> None:
    """The c10d method names that torch renamed, from commlib's compat table (one list of renames)."""
    for row in compat.METHOD_RENAMES.values():
        for old in row.old_names:
            setattr(CommlibProcessGroup, old, getattr(CommlibProcessGroup, row.canonical))


_alias_old_method_names()
