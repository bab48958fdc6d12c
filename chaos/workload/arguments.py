"""The reference trainer's command line (`chaos.workload.train`): its options, each checked by
the rule for its kind (`commlib.settings`), the rules between them, and the model and data
configurations they make.

`parse_args` is the trainer's own reading (a bad command line exits 2, argparse's way);
`check_args` is the same reading for a launcher, which gets `ArgumentsRefused` instead, and
`check_devices` whether this machine holds a node's ranks: a job is checked before it starts.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from functools import partial
from typing import NoReturn

import torch

import fsdp_overlap
from chaos.options import LARGEST_INDEX, LONGEST_S, MOST_FIRINGS, option
from chaos.workload.data import DataConfig
from chaos.workload.model import MASKS, ModelConfig
from commlib import settings
from commlib.initialize import BACKENDS

DEVICES = ("cpu", "cuda")
# Sizes of the model and its batches: far past this test model's, short of a tensor no machine holds.
MOST_ELEMENTS = 1 << 24
MOST_PREFETCH = 64
LARGEST_LR = 1e3

# --help's description: the first line of the trainer's own docstring (`chaos.workload.train`).
DESCRIPTION = "The reference trainer: every chaos test and benchmark runs this under torchrun."


class ArgumentsRefused(ValueError):
    """What the trainer's parser refuses, raised instead of exiting (`check_args`)."""


class RefusingParser(argparse.ArgumentParser):
    """A parser that raises `ArgumentsRefused` where argparse would exit."""

    def error(self, message: str) -> NoReturn:
        raise ArgumentsRefused(message)


def _parser(kind: type[argparse.ArgumentParser] = argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The trainer's arguments, each checked by the rule for its kind (`commlib.settings`)."""
    model, data = ModelConfig(), DataConfig()
    count = partial(option, settings.integer)
    seconds = partial(option, settings.number, above=0.0, high=LONGEST_S, unit="seconds")
    size = partial(count, low=1, high=MOST_ELEMENTS)
    p = kind(prog="python -m chaos.workload.train", description=DESCRIPTION)
    p.add_argument(
        "--steps", type=count("--steps", low=0, high=LARGEST_INDEX), default=20, help="train until this step (1-based)"
    )
    p.add_argument(
        "--ckpt-every",
        type=count("--ckpt-every", low=0, high=LARGEST_INDEX),
        default=5,
        help="checkpoint every N steps; 0: never",
    )
    p.add_argument("--ckpt-dir", default=None, help="checkpoint directory (shared by all ranks); none: no checkpoints")
    p.add_argument(
        "--seed",
        type=count("--seed", low=0, high=LARGEST_INDEX),
        default=0,
        help="seeds the weights, the data and the RNG",
    )
    p.add_argument(
        "--lr",
        type=option(settings.number, "--lr", above=0.0, high=LARGEST_LR),
        default=1e-3,
        help="AdamW learning rate",
    )
    p.add_argument("--mask", type=option(settings.choice, "--mask", choices=MASKS), default=model.mask)
    p.add_argument(
        "--window",
        type=size("--window"),
        default=None,
        help=f"sliding-window size; default min({model.window}, --seq-len)",
    )
    p.add_argument("--dim", type=size("--dim"), default=model.dim)
    p.add_argument("--layers", type=size("--layers"), default=model.n_layers)
    p.add_argument("--heads", type=size("--heads"), default=model.n_heads)
    p.add_argument("--mlp-hidden", type=size("--mlp-hidden"), default=None, help="default 4 * --dim")
    p.add_argument("--seq-len", type=size("--seq-len"), default=model.seq_len)
    p.add_argument("--vocab", type=size("--vocab"), default=model.vocab)
    p.add_argument(
        "--batch-size", type=size("--batch-size"), default=data.batch_size, help="sequences per rank per step"
    )
    p.add_argument("--log-dir", default=None, help="per-rank commlib logs; default $COMMLIB_LOG_DIR")
    p.add_argument("--timeout", type=seconds("--timeout"), default=300.0, help="collective deadline, seconds")
    p.add_argument(
        "--startup-timeout",
        type=seconds("--startup-timeout"),
        default=900.0,
        help="deadline of the one barrier after every rank has compiled its kernels, seconds",
    )
    p.add_argument("--backend", type=option(settings.choice, "--backend", choices=BACKENDS), default="auto")
    p.add_argument(
        "--device",
        type=option(settings.choice, "--device", choices=DEVICES),
        default="cpu",
        help="cuda: one rank per GPU, GPU LOCAL_RANK",
    )
    modes = [m.value for m in fsdp_overlap.Mode]
    p.add_argument(
        "--fsdp-mode",
        type=option(settings.choice, "--fsdp-mode", choices=modes),
        default=fsdp_overlap.Mode.PLAIN.value,
        help="plain: fully_shard as is, its collectives on the commlib process group (default)",
    )
    p.add_argument(
        "--prefetch", type=count("--prefetch", low=0, high=MOST_PREFETCH), default=1, help="blocks all-gathered ahead"
    )
    p.add_argument(
        "--no-in-job-recovery",
        dest="in_job_recovery",
        action="store_false",
        help="on any failure exit and let torchrun restart the job (no in-job recovery)",
    )
    p.add_argument(
        "--max-in-job-recoveries",
        type=count("--max-in-job-recoveries", low=0, high=MOST_FIRINGS),
        default=3,
        help="in-job recoveries per process before falling back to a restart",
    )
    p.add_argument(
        "--recovery-join-timeout",
        type=seconds("--recovery-join-timeout"),
        default=None,
        help="seconds every rank has to join a new epoch; default 2 x --timeout + 5",
    )
    p.add_argument(
        "--snapshot-every",
        type=count("--snapshot-every", low=1, high=LARGEST_INDEX),
        default=1,
        help="in-memory snapshot for in-job recovery every N steps (and at every checkpoint)",
    )
    return p


def _parsed(p: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """`argv` by parser `p`, with the rules between arguments; `p.error` for what breaks one."""
    args = p.parse_args(argv)
    if args.backend == "nccl" and args.device != "cuda":
        p.error(
            f"expected --device cuda with --backend nccl (NCCL moves GPU memory only); found --device {args.device}"
        )
    try:
        configs(args)
    except ValueError as exc:  # the model's and the data's own rules between their sizes
        p.error(str(exc))
    return args


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The trainer's command line; a bad one exits 2 naming the argument (argparse's way)."""
    return _parsed(_parser(), argv)


def check_args(argv: Sequence[str]) -> argparse.Namespace:
    """The trainer's reading of `argv`, or `ArgumentsRefused` saying what it refuses: the same
    parser and rules as `parse_args`, for a launcher to check a job before it starts one."""
    return _parsed(_parser(RefusingParser), list(argv))


def check_devices(args: argparse.Namespace, ranks_per_node: int) -> None:
    """ValueError where this machine cannot hold the ranks of one node: one GPU for each rank
    with ``--device cuda`` (the trainer gives rank LOCAL_RANK its GPU)."""
    if args.device != "cuda":
        return
    gpus = torch.cuda.device_count()
    if gpus < ranks_per_node:
        via = "--backend nccl" if args.backend == "nccl" else "--device cuda"
        raise ValueError(
            f"{via}: expected a GPU for each of the {ranks_per_node} ranks of a node; found {gpus} on this machine"
        )


def configs(args: argparse.Namespace) -> tuple[ModelConfig, DataConfig]:
    model = ModelConfig(
        vocab=args.vocab,
        dim=args.dim,
        n_layers=args.layers,
        n_heads=args.heads,
        seq_len=args.seq_len,
        mlp_hidden=args.mlp_hidden or 4 * args.dim,
        mask=args.mask,
        window=args.window or min(ModelConfig.window, args.seq_len),
    )
    data = DataConfig(seed=args.seed, vocab=args.vocab, seq_len=args.seq_len, batch_size=args.batch_size)
    return model, data
