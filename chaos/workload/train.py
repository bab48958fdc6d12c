"""The reference trainer: every chaos test and benchmark runs this under torchrun.

    torchrun --nproc-per-node 2 -m chaos.entry -m chaos.workload.train --steps 20 --ckpt-every 5 \\
        --ckpt-dir runs/ckpt --log-dir runs/logs

Its command line is `chaos.workload.arguments`'s. It builds the transformer of
`chaos.workload.model` from `--seed`, shards it with
`fsdp_overlap.shard`, trains it with AdamW on the synthetic batches of
`chaos.workload.data`, checkpoints every `--ckpt-every` steps through
`chaos.workload.checkpoint`, and resumes from the latest complete checkpoint on start. Every
step logs `train.metrics` (the loss averaged over ranks, tokens, step time, recovery epoch)
into the rank's commlib log; every collective runs inside `commlib.context(step, phase)`.

It knows nothing of how chaos counts and verifies its steps: under chaos it runs through
`chaos.entry` like any trainer, whose step probe records each optimizer step (`chaos.probe`).
It only tells an installed injector (`chaos.inject.installed`) when its checkpoints are staged
and committed, for the faults that aim at those moments.

On CPU, training is bitwise deterministic: the same config gives bitwise-equal losses and
final state, and so does a run resumed from any of its checkpoints. That is the property
the chaos harness verifies.

In-job recovery (default; `--no-in-job-recovery` turns it off): when a step or a
checkpoint raises (a commlib `CommError`, `NonFiniteError`, an exception in the step) and
every process is still alive, the trainer calls `commlib.Recovery.recover` (abort the
engine communicators of every commlib group, join a new epoch through the job's store,
rebuild the engines under the same group objects), resets FSDP2's per-iteration state,
restores the in-memory `Snapshot` of the last good state (model, optimizer, RNG, step:
taken after every `--snapshot-every` steps and after every checkpoint) and goes on in the
same process. Where recovery fails (a rank gone or not joining within
`--recovery-join-timeout`, more than `--max-in-job-recoveries`), it logs
`train.recovery_fallback` and exits with the original error's code below, and torchrun
restarts the job (DCP resume). Each step's `train.metrics` event carries the recovery `epoch`.

Preemption: SIGTERM (what a scheduler sends before it takes the node back) is noted by a
handler and acted on at the end of the step in progress, by every rank together: the
step's finite check (one all_gather) also carries each rank's "stop" flag, so no extra
collective runs and every rank stops after the same step. They checkpoint that step (unless
it was just checkpointed), log `train.preempted` and exit with code 5; torchrun restarts
the job, which resumes from that very step: no step lost, none run twice.

Exit codes (torchrun restarts the job on any non-zero one):
    0  finished
    1  any other exception (including `CheckpointMismatch`)
    2  bad command line (argparse)
    3  a commlib `CommError`: timeout, peer failure, mismatch, aborted communicator (also
       when DCP re-raised it inside its `CheckpointException`)
    4  `NonFiniteError`: a non-finite loss or gradient, caught before the optimizer step
    5  preempted (SIGTERM): stopped cleanly after a checkpoint of the last step
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import signal
import sys
import time
import traceback
from collections.abc import Iterator

import torch
from torch.distributed.checkpoint.api import CheckpointException

import commlib
import fsdp_overlap
from chaos import inject

# check_args, check_devices and ArgumentsRefused are public here too: a launcher checks a job by the trainer it runs.
from chaos.workload.arguments import ArgumentsRefused as ArgumentsRefused
from chaos.workload.arguments import check_args as check_args
from chaos.workload.arguments import check_devices as check_devices
from chaos.workload.arguments import configs, parse_args
from chaos.workload.checkpoint import Checkpointer, CheckpointMismatch, Snapshot, TrainState
from chaos.workload.data import DataConfig, batch_for
from chaos.workload.model import (
    ModelConfig,
    Transformer,
    build_block_mask,
    require_supported_torch,
    set_deterministic,
    warm_up_attention,
)
from commlib.attempt import attempt_number

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_COMM_ERROR = 3
EXIT_NON_FINITE = 4
EXIT_PREEMPTED = 5


class Preemption:
    """SIGTERM noted by its handler; acted on at the next step boundary (module docstring).

    Only a healthy job defers it. While the trainer recovers from a failure (`undeferred`)
    SIGTERM has its default action and ends the process at once, and a failure after a
    SIGTERM is not recovered in-job: that is also how torchrun stops the workers left alive
    when one of them died, and a Python handler would run only once the main thread leaves
    the C++ call it blocks in (an epoch join waits up to its whole deadline).
    """

    def __init__(self) -> None:
        self.requested_ns: int | None = None
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: object) -> None:
        if self.requested_ns is None:
            self.requested_ns = time.time_ns()
            commlib.get_logger().warning("train.sigterm", action="stop after this step, with a checkpoint")

    @property
    def requested(self) -> bool:
        return self.requested_ns is not None

    @contextlib.contextmanager
    def undeferred(self) -> Iterator[None]:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, self._on_sigterm)


@dataclasses.dataclass
class StepResult:
    loss: float  # averaged over ranks
    stopping_ranks: list[int]  # ranks that asked the job to stop (SIGTERM) before this step ended


class NonFiniteError(RuntimeError):
    """A rank saw a non-finite loss or gradient; raised on every rank, before the optimizer step."""

    def __init__(self, message: str, *, step: int, ranks: list[int]) -> None:
        super().__init__(message)
        self.step = step
        self.ranks = ranks


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    require_supported_torch()
    device = _device(args.device)
    comm = commlib.init(backend=args.backend, timeout=args.timeout, log_dir=args.log_dir, device=device)
    try:
        comm, preempted = train(args, comm, device)
    except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
        comm_error = commlib.find_comm_error(exc)
        code = _exit_code(exc, comm_error)
        traceback.print_exc()
        error: BaseException = exc
        fields: dict[str, object] = {}
        if comm_error is not None:
            error, fields = comm_error, comm_error.fields()
            # Every event's `rank` is the global rank; the error's is its communicator's.
            fields["comm_rank"] = fields.pop("rank")
            if comm_error is not exc:
                fields["raised_as"] = type(exc).__name__  # e.g. DCP's CheckpointException
        elif isinstance(exc, NonFiniteError):
            fields = {"step": exc.step, "ranks": exc.ranks}
        commlib.get_logger().error(
            "train.error", error=str(error), error_type=type(error).__name__, exit_code=code, **fields
        )
        return code
    comm.finalize()
    return EXIT_PREEMPTED if preempted else EXIT_OK


def train(
    args: argparse.Namespace, comm: commlib.Communicator, device: torch.device
) -> tuple[commlib.Communicator, bool]:
    """Train to `--steps`, or until preempted; returns the world communicator in use at the end
    (a new one after a recovery) and whether the run stopped on a SIGTERM."""
    log = commlib.get_logger()
    preemption = Preemption()
    attempt = attempt_number()
    model_cfg, data_cfg = configs(args)
    config = {
        "model": dataclasses.asdict(model_cfg),
        "data": dataclasses.asdict(data_cfg),
        "lr": args.lr,
        "world_size": comm.size,
    }

    injector = inject.installed()  # chaos.entry's, under chaos

    set_deterministic()
    # Ranks compile FlexAttention at different speeds (a cold inductor cache takes minutes
    # on a loaded CPU); doing it before the first collective and meeting at one barrier
    # with a startup deadline lets every collective after it keep the short `--timeout`.
    with commlib.context(phase="startup"):
        first = batch_for(data_cfg, 1, comm.rank)
        warm_up_attention(model_cfg, build_block_mask(model_cfg, first.doc_ids, device), args.batch_size, device)
        comm.barrier(timeout=max(args.timeout, args.startup_timeout))
    torch.manual_seed(args.seed)  # nothing here draws from it, but checkpoints carry it for code that will
    model = Transformer(model_cfg, seed=args.seed, device=device)
    fsdp_overlap.shard(model, comm, blocks=model.layers, mode=args.fsdp_mode, prefetch=args.prefetch)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    checkpointer = None
    state = TrainState()
    if args.ckpt_dir is not None:
        checkpointer = Checkpointer(
            args.ckpt_dir,
            comm,
            attempt=attempt,
            lineage=config,
            on_staged=injector.on_checkpoint_staged if injector else None,
            on_committed=injector.on_checkpoint_committed if injector else None,
        )
        with commlib.context(phase="checkpoint"):
            state = checkpointer.resume(model, optimizer)
    if state.step > args.steps:
        raise ValueError(
            f"rank {comm.rank}: expected --steps >= the resumed checkpoint's step; "
            f"found --steps {args.steps}, checkpoint at step {state.step}"
        )

    tokens = args.batch_size * args.seq_len * comm.size
    recovery = _recovery(args, model)
    snapshot = Snapshot.take(model, optimizer, state) if recovery is not None else None
    while state.step < args.steps:
        step = state.step + 1
        try:
            with commlib.context(step=step):
                start = time.perf_counter()
                result = train_step(model, optimizer, comm, model_cfg, data_cfg, step, device, preemption)
                state.step = step
                log.info(
                    "train.metrics",
                    step=step,
                    loss=result.loss,
                    tokens=tokens,
                    step_time_s=time.perf_counter() - start,
                    epoch=recovery.epoch if recovery is not None else 0,
                )
                saved = checkpointer is not None and args.ckpt_every and step % args.ckpt_every == 0
                if saved:
                    with commlib.context(phase="checkpoint"):
                        # `saved` holds only with a checkpointer.
                        checkpointer.save(model, optimizer, state)  # type: ignore[union-attr]
                if result.stopping_ranks:
                    if checkpointer is not None and not saved:
                        with commlib.context(phase="checkpoint"):
                            checkpointer.save(model, optimizer, state)
                    since = preemption.requested_ns
                    log.warning(
                        "train.preempted",
                        step=step,
                        ranks=result.stopping_ranks,
                        checkpointed=checkpointer is not None,
                        since_sigterm_s=(time.time_ns() - since) / 1e9 if since else None,
                    )
                    return comm, True
                if recovery is not None and (saved or step % args.snapshot_every == 0):
                    snapshot = Snapshot.take(model, optimizer, state)
        except (Exception, CheckpointException) as exc:
            if recovery is None or snapshot is None or isinstance(exc, CheckpointMismatch) or preemption.requested:
                raise
            with preemption.undeferred():
                comm, state = _recover_in_job(exc, recovery, model, optimizer, snapshot, checkpointer, step)

    log.info("train.done", steps=args.steps)
    return comm, False


def _recovery(args: argparse.Namespace, model: torch.nn.Module) -> commlib.Recovery | None:
    """The in-job recovery of this run, or None (logged as `recovery.disabled` with why)."""
    why = None
    if not args.in_job_recovery:
        why = "--no-in-job-recovery"
    elif args.fsdp_mode != fsdp_overlap.Mode.PLAIN.value:
        # Those modes hold communicators outside any process group (splits, custom comms).
        why = f"--fsdp-mode {args.fsdp_mode}: only 'plain' keeps every collective on a process group"
    elif not hasattr(model, "reset_iter_state"):
        why = f"torch {torch.__version__} has no FSDPModule.reset_iter_state"
    if why is not None:
        commlib.get_logger().info("recovery.disabled", reason=why)
        return None
    join = args.recovery_join_timeout if args.recovery_join_timeout is not None else 2 * args.timeout + 5
    return commlib.Recovery(commlib.RecoveryPolicy(join_timeout_s=join, max_recoveries=args.max_in_job_recoveries))


def _recover_in_job(
    exc: BaseException,
    recovery: commlib.Recovery,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    snapshot: Snapshot,
    checkpointer: Checkpointer | None,
    step: int,
) -> tuple[commlib.Communicator, TrainState]:
    """Every rank: new communicators under the same groups, the snapshot back in place; or the fallback."""
    log = commlib.get_logger()
    start = time.perf_counter()
    log.warning(
        "train.failed_in_step",
        step=step,
        error=f"{type(exc).__name__}: {str(exc)[:300]}",
        error_type=type(commlib.find_comm_error(exc) or exc).__name__,
    )
    failed: commlib.RecoveryFailed | None = None
    try:
        done = recovery.recover(exc)
    except commlib.RecoveryFailed as error:
        failed = error
    if failed is not None:
        log.error(
            "train.recovery_fallback",
            reason=failed.reason,
            missing_ranks=failed.missing_ranks,
            epoch=failed.epoch,
            why=str(failed),
            action="exit with the original error's code; torchrun restarts the job (DCP resume)",
        )
        raise exc  # outside the handler: the exit code stays the original error's
    comm = commlib.current()
    reset_fsdp(model)
    optimizer.zero_grad(set_to_none=True)
    state = snapshot.restore(model, optimizer)
    if checkpointer is not None:
        checkpointer.comm = comm
        with commlib.context(phase="recovery"):
            checkpointer.discard_staging()
    log.warning(
        "train.rolled_back",
        epoch=done.epoch,
        failed_step=step,
        restored_step=state.step,
        recovery_s=done.total_s,
        rollback_s=time.perf_counter() - start - done.total_s,
        total_s=time.perf_counter() - start,
    )
    return comm, state


def reset_fsdp(model: torch.nn.Module) -> None:
    """FSDP2's per-iteration state after a step that raised: resharded, trackers cleared.

    An all-gather left in flight belongs to an aborted communicator: its result is dropped
    before `reset_iter_state`, which would otherwise wait on it.
    """
    for module in model.modules():
        state = module._get_fsdp_state() if hasattr(module, "_get_fsdp_state") else None
        for group in getattr(state, "_fsdp_param_groups", None) or []:
            group._all_gather_result = None
    model.reset_iter_state()


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    comm: commlib.Communicator,
    model_cfg: ModelConfig,
    data_cfg: DataConfig,
    step: int,
    device: torch.device,
    preemption: Preemption | None = None,
) -> StepResult:
    """One step on this rank's batch. A SIGTERM `preemption` noted by the end of its backward
    (it may come at the step's start, where chaos holds a rank for it) asks the job to stop
    after it."""
    batch = batch_for(data_cfg, step, comm.rank).to(device)
    block_mask = build_block_mask(model_cfg, batch.doc_ids, device)
    with commlib.context(phase="forward"):
        loss = model(batch.tokens, batch.targets, block_mask)
    with commlib.context(phase="backward"):
        loss.backward()
    with commlib.context(phase="optimizer"):
        stop = preemption is not None and preemption.requested
        result = check_finite_and_average(comm, step, loss, model, stop)
        # On a GPU engine a collective of this step that failed on the device raises only
        # here (its outputs are garbage): before they reach the weights, so the step rolls back.
        commlib.check()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return result


def check_finite_and_average(
    comm: commlib.Communicator, step: int, loss: torch.Tensor, model: torch.nn.Module, stop: bool = False
) -> StepResult:
    """The mean loss over ranks, and the ranks asking to stop; raises NonFiniteError on every
    rank if any rank's loss or grads are not finite.

    One all_gather of (loss, grads finite, stop) per rank: every rank learns the same mean
    (summed in rank order, so it is bitwise the same everywhere), which ranks are bad and
    which want the job to stop. A NaN written into this very collective shows up as a
    non-finite row, so it is caught as well.
    """
    grads = [_local(p.grad) for p in model.parameters() if p.grad is not None]
    grads_finite = all(bool(torch.isfinite(g).all()) for g in grads)
    mine = torch.tensor(
        [loss.detach().item(), 0.0 if grads_finite else 1.0, 1.0 if stop else 0.0],
        dtype=torch.float32,
        device=loss.device,
    )
    gathered = torch.empty(comm.size * 3, dtype=torch.float32, device=loss.device)
    comm.all_gather_single(gathered, mine)
    rows = gathered.view(comm.size, 3).cpu()
    bad = [r for r in range(comm.size) if not (torch.isfinite(rows[r]).all() and rows[r, 1] == 0)]
    if bad:
        raise NonFiniteError(
            f"step {step}, rank {comm.rank}: expected a finite loss and finite gradients on every rank; found "
            f"non-finite values on ranks {bad} (loss per rank: {rows[:, 0].tolist()}, "
            f"non-finite-gradient flags: {rows[:, 1].tolist()})",
            step=step,
            ranks=bad,
        )
    return StepResult(
        loss=float(sum(rows[r, 0].item() for r in range(comm.size)) / comm.size),
        stopping_ranks=[r for r in range(comm.size) if rows[r, 2] != 0],
    )


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP2 parameters and gradients), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _device(kind: str) -> torch.device:
    if kind == "cpu":
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    return device


def _exit_code(exc: BaseException, comm_error: commlib.CommError | None) -> int:
    if comm_error is not None:
        return EXIT_COMM_ERROR
    if isinstance(exc, NonFiniteError):
        return EXIT_NON_FINITE
    return EXIT_ERROR


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Leave without interpreter teardown, whatever the outcome. After a failure a process
    # group may still hold connections to dead peers, and teardown can block on them. After
    # a success, teardown used to abort the process now and then ("terminate called without
    # an active exception", SIGABRT, after results, checkpoint and `comm.finalize` were done):
    # the progress board's thread returning from a store call into the finalizing
    # interpreter, now stopped at exit (commlib/record/board.py); other threads of torch's
    # may do the same. Everything this process owes is on disk by now: logs are written line
    # by line with os.write, checkpoints atomically.
    os._exit(code)
