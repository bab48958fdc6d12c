"""``python -m chaos.entry (-m MODULE | SCRIPT) [ARGS...]``: how every rank of a chaos run starts.

The harness launches each torchrun worker through it (`chaos.job.Job.worker_argv`). Before
the trainer's code runs it
- points the rank's commlib log at the run's (``COMMLIB_LOG_DIR``), so that a trainer not on
  commlib has one;
- installs the in-rank injector (`chaos.inject.install_from_env`: only when the harness passed
  a plan) and the step probe (`chaos.probe`), and tells the injector's step failures to it;
- asks torch for deterministic algorithms (warnings only where an op has none), as the
  harness's environment asks MKL and cuBLAS (`chaos.harness.REPRODUCIBLE_ENV`);
- imports all this with the garbage collector off, then freezes what the imports made, and turns
  the collector back on (`main`, which says why).

Then it runs the trainer as ``python -m MODULE ARGS`` or ``python SCRIPT ARGS`` would
(`runpy`): ``__main__``, ``sys.argv``, ``sys.path[0]`` (the script's directory; for a module,
the directory ``chaos run`` was started in, `LAUNCH_DIR_ENV`, since the rank itself runs in the
run's working directory), its exit status and its signals are the trainer's. An exception the
trainer lets out is logged as ``train.error`` (with commlib's fields where it is commlib's)
before it leaves the process as it would have: the harness's detection of a failure in a
trainer that logs none.
"""

from __future__ import annotations

import gc
import os
import runpy
import sys

LAUNCH_DIR_ENV = "CHAOS_LAUNCH_DIR"


def _log_to_run() -> None:
    """The rank's commlib log, in the directory the harness gave (`COMMLIB_LOG_DIR`)."""
    from commlib import settings
    from commlib.record.log import LOG_DIR_ENV, configure

    if settings.env(LOG_DIR_ENV) is not None:
        rank = settings.env_integer("RANK", 0, low=0)
        configure(rank, settings.env_integer("WORLD_SIZE", 1, low=1))


def _install() -> None:
    import torch

    from chaos import inject, probe

    torch.use_deterministic_algorithms(True, warn_only=True)
    _log_to_run()
    injector = inject.install_from_env()
    step_probe = probe.install()
    if injector is not None:
        injector.on_step_failed = step_probe.restart_step


def _log_error(exc: BaseException) -> None:
    import commlib

    fields: dict[str, object] = {}
    error: BaseException = exc
    comm_error = commlib.find_comm_error(exc)
    if comm_error is not None:
        error, fields = comm_error, comm_error.fields()
        fields["comm_rank"] = fields.pop("rank")  # every event's `rank` is the global rank
    commlib.get_logger().error("train.error", error=str(error)[:2000], error_type=type(error).__name__, **fields)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    module = argv[:1] == ["-m"]
    if len(argv) < (2 if module else 1):
        sys.exit("usage: python -m chaos.entry (-m MODULE | SCRIPT) [ARGS...]")
    target, args = (argv[1], argv[2:]) if module else (argv[0], argv[1:])
    # The collector off while torch and commlib import (about 2,000 modules: its full passes would
    # walk their objects again and again), then what they made frozen, out of every later pass
    # (the trainer's imports, inductor's compile, the steps): 0.36-0.53 s less CPU per rank start
    # (scripts/bench_rank_gc.py), paid at every restart. Nothing the trainer makes is frozen.
    gc.disable()
    try:
        _install()
    finally:
        gc.freeze()
        gc.enable()
    sys.argv = [target, *args]
    try:
        if module:
            sys.path[0] = os.environ.get(LAUNCH_DIR_ENV) or os.getcwd()
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = os.path.dirname(os.path.abspath(target))
            runpy.run_path(target, run_name="__main__")
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as exc:
        _log_error(exc)
        raise


if __name__ == "__main__":
    main()
