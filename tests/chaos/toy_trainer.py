"""A tiny torchrun trainer for the harness's own tests: one all_reduce per step, no model.

It uses the same hooks as the reference trainer (commlib logs, the chaos injector,
``train.step`` events) but writes no results file: the harness must say it could not
verify it bitwise. ``--step-time`` makes a step that long, so a test can stop the harness
while the job is busy.
"""

import argparse
import os
import time

import torch

import commlib
from chaos.inject import install_from_env


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--step-time", type=float, default=0.05)
    p.add_argument("--timeout", type=float, default=5.0)
    p.add_argument("--fail-rank", type=int, default=None, help="this rank exits 1 at step 2, in every attempt")
    args = p.parse_args()
    comm = commlib.init("gloo", timeout=args.timeout)
    injector = install_from_env(comm)
    log = commlib.get_logger()
    try:
        for step in range(1, args.steps + 1):
            with commlib.context(step=step):
                if injector is not None:
                    injector.on_step_start(step)
                if comm.rank == args.fail_rank and step == 2:
                    os._exit(1)
                time.sleep(args.step_time)
                t = torch.full((4,), float(step))
                comm.all_reduce(t)
                log.info("train.step", step=step, loss=float(t[0]))
    except commlib.CommError as exc:
        log.error("train.error", error=str(exc), error_type=type(exc).__name__)
        os._exit(3)
    comm.finalize()


if __name__ == "__main__":
    main()
