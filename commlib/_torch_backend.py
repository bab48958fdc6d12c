"""The entry point torch calls at `import torch` (group `torch.backends`): registers `backend="commlib"`.

Kept tiny: it registers a creator that imports `commlib.process_group` only when a commlib
group is actually made, so importing torch costs no more than it did. torch skips it with
`TORCH_DEVICE_BACKEND_AUTOLOAD=0`; `import commlib` then `commlib.init()` registers it too.
"""

from __future__ import annotations

from typing import Any


def register() -> None:
    import torch.distributed as dist

    if not dist.is_available() or "commlib" in dist.Backend.backend_list:
        return
    dist.Backend.register_backend("commlib", _create, extended_api=True, devices=["cpu", "cuda"])


def _create(opts: Any, engine_options: Any) -> Any:
    from commlib.process_group import create

    return create(opts, engine_options)
