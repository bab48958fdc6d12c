"""A small torchrun trainer with a real model, optimizer, checkpoints and results file, whose
resume can be made wrong on purpose: the verifier must catch a run that recovered badly.

Every rank holds the whole model (a linear layer trained with Adam, whose moments make the
optimizer state matter); gradients and the loss are averaged with commlib all_reduces, so
the ranks stay bitwise equal. Rank 0 checkpoints every ``--ckpt-every`` steps (one
``torch.save`` file, written to a temporary name and renamed: a kill never leaves half a
checkpoint); every attempt resumes from the newest one and logs ``ckpt.resume``. At the
end every rank calls `chaos.results.write_results` (model and optimizer digests, the
losses and the history of steps applied).

``--resume-bug`` (default: ``$BAD_RESUME_BUG``, else ``none``) breaks the resume, and only
the resume (a run that never restarts is the same in every mode, so each mode's fault-free
reference is the correct run; chosen through the environment, the modes share one
reference, which is keyed on the trainer's arguments):

- ``none``: restore everything (the correct trainer);
- ``optimizer``: restore the model, the step and the losses, but not the optimizer state;
- ``skip``: resume one step after the checkpoint, so the step after it is never trained.
"""

import argparse
import os
from pathlib import Path

import torch

import commlib
from chaos.inject import install_from_env
from chaos.results import write_results

DIM_IN, DIM_OUT, BATCH = 8, 4, 16


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(BATCH, DIM_IN, generator=g)
    return x, x[:, :DIM_OUT] * 2.0 - 1.0 + 0.1 * torch.randn(BATCH, DIM_OUT, generator=g)


def newest_checkpoint(ckpt_dir: Path) -> Path | None:
    found = sorted(ckpt_dir.glob("step*.pt"), key=lambda p: int(p.stem.removeprefix("step")))
    return found[-1] if found else None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--ckpt-every", type=int, default=2)
    p.add_argument("--timeout", type=float, default=10.0)
    # Default: the run directory the harness gives every process (chaos.harness.RUN_DIR_ENV).
    p.add_argument("--run-dir", type=Path, default=os.environ.get("CHAOS_RUN_DIR"),
                   help="where checkpoints and results.json go")
    p.add_argument("--resume-bug", choices=("none", "optimizer", "skip"),
                   default=os.environ.get("BAD_RESUME_BUG", "none"))
    args = p.parse_args()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    comm = commlib.init("gloo", timeout=args.timeout)
    injector = install_from_env(comm)
    log = commlib.get_logger()
    ckpt_dir = args.run_dir / "ckpt"

    torch.manual_seed(0)
    model = torch.nn.Linear(DIM_IN, DIM_OUT)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    done, losses, history = 0, [], []
    newest = newest_checkpoint(ckpt_dir)
    if newest is not None:
        saved = torch.load(newest, weights_only=True)
        model.load_state_dict(saved["model"])
        if args.resume_bug != "optimizer":
            optimizer.load_state_dict(saved["optim"])
        done, losses, history = int(saved["step"]), list(saved["losses"]), list(saved["history"])
        log.info("ckpt.resume", step=done, path=str(newest))
    first = done + (2 if newest is not None and args.resume_bug == "skip" else 1)

    try:
        for step in range(first, args.steps + 1):
            with commlib.context(step=step):
                if injector is not None:
                    injector.on_step_start(step)
                x, y = batch(step, comm.rank)
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
                for param in model.parameters():
                    comm.all_reduce(param.grad)
                    param.grad /= comm.size
                mean = loss.detach().reshape(1).clone()
                comm.all_reduce(mean)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                losses.append(float(mean[0]) / comm.size)
                history.append({"step": step, "attempt": attempt})
                log.info("train.step", step=step, loss=losses[-1])
                if step % args.ckpt_every == 0:
                    if comm.rank == 0:
                        ckpt_dir.mkdir(parents=True, exist_ok=True)
                        tmp = ckpt_dir / f".step{step}.pt.tmp"
                        torch.save({"step": step, "model": model.state_dict(), "optim": optimizer.state_dict(),
                                    "losses": losses, "history": history}, tmp)
                        os.replace(tmp, ckpt_dir / f"step{step}.pt")
                    comm.barrier()
        # The trainer reports what it did: a skipping one has fewer losses than --steps.
        write_results(args.run_dir / "results.json", losses=losses, model=model, optimizer=optimizer,
                      steps=len(losses), extra={"history": history})
    except commlib.CommError as exc:
        log.error("train.error", error=str(exc), error_type=type(exc).__name__)
        os._exit(3)
    comm.finalize()


if __name__ == "__main__":
    main()
