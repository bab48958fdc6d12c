"""The backend fixture: every Communicator test runs once per backend.

"torchcomms" runs over the strict stand-in in tests/torchcomms_standin (torchcomms cannot
be installed on these machines). Spawned ranks copy the parent's sys.path, so the stand-in
goes there (and on PYTHONPATH, for subprocesses such as torchrun's workers).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

STANDIN = Path(__file__).resolve().parents[1] / "torchcomms_standin"
BACKENDS = ["gloo", "torchcomms"]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "torchcomms":
        monkeypatch.syspath_prepend(str(STANDIN))
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(STANDIN), os.environ.get("PYTHONPATH")])))
    return request.param
