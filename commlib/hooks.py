"""Hook registry: callables run by `Communicator` around every collective.

Three kinds:
- pre-hooks `fn(call: Collective)` run after validation and sequence numbering, before the
  backend launch. They may inspect or modify the input tensors, sleep, or raise (the chaos
  injector uses exactly this).
- post-hooks `fn(call: Collective, duration_s: float)` run after a successful completion,
  on the caller's thread. On a stream-ordered communicator (a GPU engine) that is once the
  op is enqueued and the caller's stream ordered behind it: the device completes it later.
- timeout/failure hooks `fn(call: Collective, error: CommError)` run before a typed error
  is raised, on the thread it is raised on (for a failure found off the caller's thread on a
  stream-ordered communicator: the caller's, at its next call, `Work.wait()` or
  `commlib.check()`).

A hook registered on `HookRegistry.process()` applies to every communicator of the process,
including ones created later (splits); a hook registered on a communicator applies to it
alone. Registration returns a handle whose `remove()` unregisters it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

PreHook = Callable[..., None]
PostHook = Callable[..., None]
FailureHook = Callable[..., None]

_ids = itertools.count()


@dataclass
class RemovableHandle:
    """Returned by every `register_*`; `remove()` is idempotent."""

    _table: dict[int, Callable[..., Any]]
    _id: int

    def remove(self) -> None:
        self._table.pop(self._id, None)


@dataclass
class HookRegistry:
    pre: dict[int, PreHook] = field(default_factory=dict)
    post: dict[int, PostHook] = field(default_factory=dict)
    failure: dict[int, FailureHook] = field(default_factory=dict)

    def register_pre_hook(self, fn: PreHook) -> RemovableHandle:
        return self._add(self.pre, fn)

    def register_post_hook(self, fn: PostHook) -> RemovableHandle:
        return self._add(self.post, fn)

    def register_failure_hook(self, fn: FailureHook) -> RemovableHandle:
        return self._add(self.failure, fn)

    @staticmethod
    def _add(table: dict[int, Callable[..., Any]], fn: Callable[..., Any]) -> RemovableHandle:
        if not callable(fn):
            raise TypeError(f"a hook must be callable; found {type(fn).__name__}")
        hook_id = next(_ids)
        table[hook_id] = fn
        return RemovableHandle(table, hook_id)

    @staticmethod
    def process() -> HookRegistry:
        """The process-wide registry."""
        return _PROCESS_HOOKS


# The one piece of global state this module owns.
_PROCESS_HOOKS = HookRegistry()


def run_hooks(local: HookRegistry, kind: str, *args: Any) -> None:
    """Run the process-wide hooks of `kind`, then the communicator's own, in registration order."""
    for registry in (HookRegistry.process(), local):
        table: dict[int, Callable[..., Any]] = getattr(registry, kind)
        if table:
            for fn in list(table.values()):
                fn(*args)


def register_pre_hook(fn: PreHook) -> RemovableHandle:
    """Run `fn(call)` before every collective of every communicator in this process."""
    return HookRegistry.process().register_pre_hook(fn)


def register_post_hook(fn: PostHook) -> RemovableHandle:
    """Run `fn(call, duration_s)` after every completed collective in this process."""
    return HookRegistry.process().register_post_hook(fn)


def register_failure_hook(fn: FailureHook) -> RemovableHandle:
    """Run `fn(call, error)` before any communicator in this process raises a CommError."""
    return HookRegistry.process().register_failure_hook(fn)
