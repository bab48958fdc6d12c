"""The step probe: a rank's training steps and what each computed, whatever the trainer.

`install()` (from `chaos.entry`, before the trainer's code runs) sets process-wide hooks only:

- torch's optimizer step post-hook (`torch.optim.optimizer.register_optimizer_step_post_hook`):
  a step is an optimizer's step that follows a backward (DCP's loading calls ``step()`` once
  with zero gradients to make an empty optimizer's state: that is no step). Its number is the
  optimizer's own count (``state[p]["step"]``, kept by Adam, AdamW and the like, and restored
  with the optimizer's state by a resume or a rollback: `step_source` "optimizer"); for an
  optimizer that keeps none (SGD), this process's count of its steps (`step_source` "count": a
  restarted process counts from 1 again).
- torch's module forward hooks (`register_module_forward_pre_hook` and
  `register_module_forward_hook`, counting depth): an outermost module call's inputs,
  positional and keyword, are the data the step drew (digested). At an outermost call whose
  step (the optimizer's count + 1) was not started yet the step starts: torch's RNG states
  (CPU, and CUDA once initialized) are digested and `chaos.inject.on_step_start` runs
  (``chaos.step`` in the log; the injector arms the step's faults). Before the first optimizer
  step of a process its optimizers are found among the live objects (`gc`), so a resumed
  process starts from its optimizer's count.
- a step starts over (its losses and data so far dropped) at the next outermost call after it
  failed (commlib raised a typed error: a process-wide failure hook; or the injector acted a
  fault that fails the step: `restart_step`), once the optimizer's count went back to or
  before the last step recorded, or when a backward ran in the step and its gradients are gone
  (a trainer that recovers in its process rolls back, clears them and runs the step again;
  a peer's failure it learned of from the trainer, not from commlib, shows only so).
- `torch.autograd.backward`, wrapped (``Tensor.backward`` calls it): each scalar a backward
  runs from is one of the step's losses (several under gradient accumulation). torch has no
  process-wide hook on backward itself; this wrapper only records and delegates.

After each optimizer step the rank logs ``train.step`` to its commlib log (one ``os.write`` per
line: a killed rank leaves whole lines): ``step``, ``opt`` (the optimizer's index in this
process), ``loss`` (the last scalar, a float) and ``losses`` (all, as ``float.hex``), ``data`` and
``rng`` digests, ``step_time_s`` (from its start, after any hold for a fault, to the end of the
optimizer's step), and, every
`DIGEST_EVERY_ENV`-th step, ``params`` and ``optim``: sha256 of the optimizer's parameters and
of its state and hyperparameters (local shards of DTensors: sharded and replicated alike, each
rank its own), and ``digest_s``, what taking them cost. The first step of a process is
preceded by ``train.probe``: the backend the trainer's default process group runs over, its
collective deadline where commlib has it, the step source.
Hooks skip their work while torch compiles (`torch.compiler.is_compiling`), so a compiled
model's inner modules are seen through its outermost call.
"""

from __future__ import annotations

import gc
import hashlib
import os
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils._pytree import tree_leaves

import commlib
from chaos import inject

DIGEST_EVERY_ENV = "CHAOS_DIGEST_EVERY"
STEP_EVENT = "train.step"  # a step's record
PROBE_EVENT = "train.probe"  # a process's description, before its first record
DIGEST_CHARS = 32  # of the sha256 hex: 128 bits
# How many times a process looks for its optimizers among the live objects before its first
# optimizer step (once per outermost forward that finds none: a warm-up before it has one).
MOST_SCANS = 5


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of `t`: a DTensor's local shard, or `t` itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of this rank's part of `t` (a DTensor's local shard), on the CPU."""
    return _local(t).detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data


def _update(h: Any, value: Any) -> None:
    """Feed `value` (a tensor, or plain data) into the hash `h`, with its type and shape."""
    if isinstance(value, torch.Tensor):
        h.update(f"T{value.dtype}{tuple(value.shape)}|".encode())
        h.update(tensor_bytes(value))
    elif isinstance(value, float):
        h.update(f"F{value.hex()}|".encode())
    elif value is None or isinstance(value, (bool, int, str)):
        h.update(f"V{value!r}|".encode())
    elif isinstance(value, (list, tuple)):
        h.update(f"L{len(value)}|".encode())
        for item in value:
            _update(h, item)
    elif isinstance(value, dict):
        h.update(f"D{len(value)}|".encode())
        for key in sorted(value, key=str):
            _update(h, str(key))
            _update(h, value[key])
    else:  # an object whose repr may hold an address: its type only
        h.update(f"O{type(value).__qualname__}|".encode())


def _hex(h: Any) -> str:
    return str(h.hexdigest()[:DIGEST_CHARS])


def params_digest(optimizer: torch.optim.Optimizer) -> str:
    """sha256 of the optimizer's parameters, in its groups' order."""
    h = hashlib.sha256()
    for group in optimizer.param_groups:
        for p in group["params"]:
            _update(h, p)
    return _hex(h)


def optim_digest(optimizer: torch.optim.Optimizer) -> str:
    """sha256 of the optimizer's state (per parameter, in its groups' order) and hyperparameters."""
    h = hashlib.sha256()
    for group in optimizer.param_groups:
        _update(h, {k: v for k, v in group.items() if k != "params"})
        for p in group["params"]:
            _update(h, dict(optimizer.state.get(p, {})))
    return _hex(h)


def rng_digest() -> str:
    """sha256 of torch's RNG states (CPU, and CUDA once initialized). Not Python's ``random`` nor
    NumPy's: each process seeds those from the OS unless the trainer does, so theirs would
    differ between any two runs, used or not."""
    h = hashlib.sha256()
    _update(h, torch.random.get_rng_state())
    if torch.cuda.is_initialized():
        _update(h, list(torch.cuda.get_rng_state_all()))
    return _hex(h)


def optimizer_step(optimizer: torch.optim.Optimizer) -> int | None:
    """The optimizer's own step count (``state[p]["step"]``), or None where it keeps none."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            step = optimizer.state.get(p, {}).get("step")
            if isinstance(step, torch.Tensor):
                return int(_local(step).item())
            if isinstance(step, (int, float)):
                return int(step)
    return None


@dataclass
class _Seen:
    """An optimizer the probe has seen, and its steps in this process."""

    ref: weakref.ref[torch.optim.Optimizer]
    steps: int = 0  # training steps it took in this process
    backwards: int | None = None  # the probe's backward count at its last training step


class StepProbe:
    """The hooks of one process (module docstring); `install` makes the one a rank has."""

    def __init__(self, digest_every: int = 1) -> None:
        self.digest_every = digest_every
        self._optimizers: list[_Seen] = []  # by index: a dead one's index goes to the next new one
        self._stepped = False  # any optimizer took a training step in this process
        self._scans = 0
        self._depth = 0
        self._in_backward = False
        self._backwards = 0  # backward calls so far
        self._backwards_at_start = 0  # `_backwards` when the step in progress started
        self._announced: int | None = None  # the step started last
        self._recorded = 0  # the last step recorded (that the state had reached)
        self._step_started = time.perf_counter()
        self._rng: str | None = None
        self._data = hashlib.sha256()
        self._data_seen = False
        self._losses: list[torch.Tensor] = []
        self._described = False
        self._handles: list[Any] = []
        self._backward: Callable[..., Any] | None = None

    # -- installing ----------------------------------------------------------------------
    def install(self) -> StepProbe:
        modules = torch.nn.modules.module
        self._handles = [
            register_optimizer_step_post_hook(self._after_step),
            modules.register_module_forward_pre_hook(self._before_forward),
            modules.register_module_forward_hook(self._after_forward, with_kwargs=True, always_call=True),
            commlib.register_failure_hook(lambda call, error: self.restart_step()),
        ]
        self._backward = torch.autograd.backward
        backward = self._backward

        def recorded_backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
            self._on_backward(tensors)
            self._in_backward = True
            try:
                return backward(tensors, *args, **kwargs)
            finally:
                self._in_backward = False

        torch.autograd.backward = recorded_backward
        return self

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        if self._backward is not None:
            torch.autograd.backward = self._backward

    # -- the hooks -----------------------------------------------------------------------
    def _before_forward(self, module: torch.nn.Module, args: Any) -> None:
        if self._in_backward or torch.compiler.is_compiling():
            return  # a recomputation inside backward (activation checkpointing), or a trace
        self._depth += 1
        if self._depth == 1:
            step = self._next_step()
            if step is not None and (step != self._announced or step <= self._recorded or self._tried_again()):
                self._start(step)

    def _after_forward(self, module: torch.nn.Module, args: Any, *rest: Any) -> None:
        # (kwargs, output) after a forward; (output,) alone after one that raised: torch calls an
        # always_call hook without the keyword arguments then.
        if self._in_backward or torch.compiler.is_compiling():
            return
        self._depth = max(self._depth - 1, 0)
        if self._depth == 0 and len(rest) == 2:
            self._data_seen = True
            _update(self._data, [leaf for leaf in tree_leaves((args, rest[0])) if isinstance(leaf, torch.Tensor)])

    def _on_backward(self, tensors: Any) -> None:
        self._backwards += 1
        self._depth = 0  # a forward that raised inside is over too
        for t in [tensors] if isinstance(tensors, torch.Tensor) else list(tensors):
            if isinstance(t, torch.Tensor) and t.numel() == 1:
                self._losses.append(t.detach())

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        index = self._index(optimizer)
        seen = self._optimizers[index]
        if not self._trained(optimizer, seen):
            return  # not a training step (DCP's state initialisation)
        seen.backwards, seen.steps, self._stepped = self._backwards, seen.steps + 1, True
        own = optimizer_step(optimizer)
        step = own if own is not None else seen.steps
        if not self._described:
            self._described = True
            self._describe(source="optimizer" if own is not None else "count")
        losses = [float(t.item()) for t in self._losses]
        record: dict[str, Any] = {
            "step": step,
            "opt": index,
            "loss": losses[-1] if losses else None,
            "losses": [x.hex() for x in losses],
            "data": _hex(self._data) if self._data_seen else None,
            "rng": self._rng,
            "step_time_s": time.perf_counter() - self._step_started,
        }
        if step % self.digest_every == 0:
            started = time.perf_counter()
            record["params"] = params_digest(optimizer)
            record["optim"] = optim_digest(optimizer)
            record["digest_s"] = time.perf_counter() - started
        commlib.get_logger().info(STEP_EVENT, **record)
        self._recorded = step

    def _trained(self, optimizer: torch.optim.Optimizer, seen: _Seen) -> bool:
        """Whether the step it just took applied gradients of a backward: one ran since its last
        step; before its first, it had a nonzero gradient (DCP gives an empty optimizer zeros)."""
        if seen.backwards is not None:
            return seen.backwards != self._backwards
        return any(
            p.grad is not None and bool(_local(p.grad).any())
            for group in optimizer.param_groups
            for p in group["params"]
        )

    # -- steps ---------------------------------------------------------------------------
    def restart_step(self) -> None:
        """The step in progress failed: it starts over at the next outermost module call."""
        self._announced = None

    def _tried_again(self) -> bool:
        """Whether the step in progress is being run again: a backward ran in it, and its optimizer
        holds no gradient now (a gradient accumulation's next micro-batch finds them there; a
        trainer that rolled back cleared them)."""
        if self._backwards == self._backwards_at_start:
            return False
        first = next(self._live(), None)
        return first is not None and all(p.grad is None for g in first.param_groups for p in g["params"])

    def _start(self, step: int) -> None:
        self._announced, self._recorded = step, min(self._recorded, step - 1)
        self._backwards_at_start = self._backwards
        self._rng = rng_digest()
        self._losses, self._data, self._data_seen = [], hashlib.sha256(), False
        inject.on_step_start(step)  # may hold the step for a fault of the harness's: not its time
        self._step_started = time.perf_counter()

    def _next_step(self) -> int | None:
        """The step the next optimizer step will be: its optimizer's count + 1 (None: none yet)."""
        first = next(self._live(), None)
        if first is None and not self._stepped and self._scans < MOST_SCANS:
            self._scans += 1
            # type(), not isinstance: the latter asks every object its __class__, and some
            # (torch.distributed.reduce_op) warn when asked anything.
            for found in (o for o in gc.get_objects() if issubclass(type(o), torch.optim.Optimizer)):
                self._index(found)
            first = next(self._live(), None)
        if first is None:
            return None
        own = optimizer_step(first)
        return (own if own is not None else self._optimizers[self._index(first)].steps) + 1

    def _live(self) -> Iterator[torch.optim.Optimizer]:
        return (o for o in (seen.ref() for seen in self._optimizers) if o is not None)

    def _index(self, optimizer: torch.optim.Optimizer) -> int:
        """The optimizer's index in this process; a new one takes the first index whose optimizer
        is gone (a trainer that makes its optimizer again keeps its records' index)."""
        for i, seen in enumerate(self._optimizers):
            if seen.ref() is optimizer:
                return i
        new = _Seen(weakref.ref(optimizer))
        for i, seen in enumerate(self._optimizers):
            if seen.ref() is None:
                self._optimizers[i] = new
                return i
        self._optimizers.append(new)
        return len(self._optimizers) - 1

    def _describe(self, source: str) -> None:
        """``train.probe``: how this process's steps are counted, and what it communicates over."""
        import torch.distributed as dist

        backend = engine = deadline_s = None
        if dist.is_available() and dist.is_initialized():
            backend = str(dist.get_backend())
            try:
                comm = commlib.current()
            except (RuntimeError, TypeError):  # not a commlib group
                pass
            else:
                engine, deadline_s = comm.backend, comm.timeout
        commlib.get_logger().info(
            PROBE_EVENT,
            step_source=source,
            backend=backend,
            engine=engine,
            deadline_s=deadline_s,
            digest_every=self.digest_every,
            world_size=dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1,
        )


def digest_every(environ: dict[str, str] | None = None) -> int:
    """Every how many steps the state digests are taken (`DIGEST_EVERY_ENV`, default 1)."""
    from commlib import settings

    return settings.env_integer(DIGEST_EVERY_ENV, 1, environ=os.environ if environ is None else environ, low=1)


def install() -> StepProbe:
    """The probe of this process, hooked in (`chaos.entry` calls it once, before the trainer)."""
    return StepProbe(digest_every()).install()
