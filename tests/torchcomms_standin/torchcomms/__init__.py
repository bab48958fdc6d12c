"""A strict, test-only stand-in for ``torchcomms`` (meta-pytorch/torchcomms), gloo on CPU only.

TEST-ONLY. This package lives under ``tests/torchcomms_standin`` and must NEVER ship with
commlib or be installed: tests put ``tests/torchcomms_standin`` on ``sys.path`` so that
``import torchcomms`` finds it where the real torchcomms cannot be installed. It mirrors the
Python surface of torchcomms' bindings that commlib, torch's torchcomms routing and the tests
use, and the observed behaviour of its gloo backend, over ``torch.distributed.ProcessGroupGloo``
without touching c10d's global state. See ``tests/torchcomms_standin/README.md``.
"""

from typing import Any

#: Marks this module as the test stand-in (tests may assert it; commlib must not use it).
_IS_TEST_STANDIN = True


def is_backend_built(backend: str) -> bool:
    """Whether this build has ``backend`` (torch 2.14+ imports this): the stand-in has gloo."""
    return backend == "gloo"


def __getattr__(name: str) -> Any:
    # torch.distributed probes this package while torch itself is being imported, so importing
    # it must not import torch: the binding's names (``_comm.__all__``) load on first use.
    if not name.startswith("_"):
        from . import _comm

        if name in _comm.__all__:
            value = globals()[name] = getattr(_comm, name)
            return value
    raise AttributeError(f"module 'torchcomms' (test stand-in) has no attribute {name!r}")
