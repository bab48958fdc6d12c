"""The backend fixture: every Communicator test runs once per backend.

"torchcomms" runs over the strict stand-in in tests/torchcomms_standin (torchcomms cannot
be installed on these machines); the spawned ranks find it through PYTHONPATH.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

STANDIN = Path(__file__).resolve().parents[1] / "torchcomms_standin"
BACKENDS = ["gloo"]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "torchcomms":
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(STANDIN), os.environ.get("PYTHONPATH")])))
    return request.param
