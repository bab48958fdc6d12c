"""The engine fixtures: every Communicator test runs once per engine.

"torchcomms" runs over the strict stand-in in tests/torchcomms_standin (torchcomms cannot
be installed on these machines). Spawned ranks copy the parent's sys.path, so the stand-in
goes there (and on PYTHONPATH, for subprocesses such as torchrun's workers).

`ranks` runs a contract test's ranks: gloo's as threads of this process
(`commlib.testing.run_threads`), in the fast lane (marked `contract`); the stand-in's as
processes (`commlib.testing.run`), because torchcomms takes a rank from its process's
environment, which threads share.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from commlib import testing

STANDIN = Path(__file__).resolve().parents[1] / "torchcomms_standin"
BACKENDS = ["gloo", "torchcomms"]


def _use_standin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(STANDIN))
    path = os.pathsep.join(filter(None, [str(STANDIN), os.environ.get("PYTHONPATH")]))
    monkeypatch.setenv("PYTHONPATH", path)


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "torchcomms":
        _use_standin(monkeypatch)
    return request.param


@pytest.fixture(params=[pytest.param("gloo", marks=pytest.mark.contract), "torchcomms"])
def ranks(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Callable[..., list[Any]]:
    """`ranks(fn, world_size, timeout=, args=, log_dir=, check_consistency=)`: each rank's
    `fn(comm, *args)`, in rank order, over gloo as threads or over torchcomms as processes."""
    if request.param == "gloo":
        return testing.run_threads
    _use_standin(monkeypatch)
    return functools.partial(testing.run, backend="torchcomms")
