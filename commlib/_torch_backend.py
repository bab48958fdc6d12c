"""The entry point torch calls at `import torch` (group `torch.backends`): registers `backend="commlib"`.

Kept tiny: it registers a creator that imports `commlib.process_group` only when a commlib
group is actually made, so importing torch costs no more than it did. torch skips it with
`TORCH_DEVICE_BACKEND_AUTOLOAD=0`; `import commlib` then `commlib.init()` registers it too.
With `COMMLIB_BACKFILL=1` it also adds to torch.distributed the newer names this torch lacks
(`commlib.compat.backfill`), before the trainer's code can look them up.
"""

from __future__ import annotations

from typing import Any

from commlib.settings import env_flag

BACKFILL_ENV = "COMMLIB_BACKFILL"


def register() -> None:
    import torch.distributed as dist

    if not dist.is_available():
        return
    if backfill_asked():
        from commlib.compat import backfill

        backfill()
    if "commlib" in dist.Backend.backend_list:
        return
    dist.Backend.register_backend("commlib", _create, extended_api=True, devices=["cpu", "cuda"])


def backfill_asked() -> bool:
    """Whether `COMMLIB_BACKFILL` asks for the newer torch.distributed names (`commlib.settings.flag`)."""
    return env_flag(BACKFILL_ENV)


def _create(opts: Any, engine_options: Any) -> Any:
    from commlib.process_group import create

    return create(opts, engine_options)
