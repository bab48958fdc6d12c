"""Which attempt of the job this process belongs to: one number every rank of every node agrees on.

An attempt is one rendezvous round of the job's launcher: torchrun starts every rank of the
job again for each round (a worker failed on some node, a node joined), and the ranks of a
round must share what they key in the job's store (`commlib.init` puts everything under
``attempt{N}/``), and what the logs, the flight recorder, the doctor and chaos's ledger call
the attempt. torchrun's own counter cannot be that number: ``TORCHELASTIC_RESTART_COUNT``
counts the restarts of one node's agent, which advances only where a worker failed, so after
a rank of one node dies the nodes disagree (and their ranks wait forever for each other's
keys). torch 2.13's ``env://`` rendezvous adds no prefix at all (its worker store is the
agents' shared store, kept across rounds), so a new round also sees every key of the old one.

`agree` settles the round through the job's store, at init, before anything else is keyed
in it. The store outlives the round, so every value in it may be an earlier round's: each
rank therefore asks with a value of its own (a nonce no earlier process had), and only rank
0 answers:

- rank 0 takes the next generation of the store (``add``: a number no earlier round took) and
  answers every rank's latest question with it, until every rank has confirmed it under that
  generation's own key (a question an earlier, dead process left is answered too, harmlessly);
- every other rank posts its nonce as its question and waits for the answer under the nonce.

The rounds of a launch never overlap (torchrun stops every worker of a round, on every node,
before the next round's rendezvous completes), so the rank 0 answering is the one of the
asker's round. A round whose rank 0 never gets this far loses its generation: the numbers
stay unique and ordered, with a gap.

The attempt number is ``launch * per_launch + round``: the round is the generation less one;
the launch is the Slurm requeue count (``SLURM_RESTART_COUNT``: a requeued job runs a new
torchrun, whose store starts over), and ``per_launch`` is the most rounds one launch can have,
``GROUP_WORLD_SIZE * TORCHELASTIC_MAX_RESTARTS + 1`` (each round after the first spends a
restart of at least one node's agent). Before `agree` (a process that is not a rank, or one
that made its store itself), `attempt_number` estimates it from the environment with the
node's restart count in place of the round, which is exact on one node.

Torch-free at import: the doctor reads logs where torch is not installed.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from commlib.errors import CommError
from commlib.members import rank_list
from commlib.settings import env, env_integer
from commlib.store_reads import absent

RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"
MAX_RESTARTS_ENV = "TORCHELASTIC_MAX_RESTARTS"
NODES_ENV = "GROUP_WORLD_SIZE"  # torchrun's number of agents (nodes) in the round
REQUEUE_ENV = "SLURM_RESTART_COUNT"
AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"  # "True": the store outlives the round
KEY = "commlib/attempt"
_POLL_S = 0.005  # rank 0's first look again for new questions; doubled up to _POLL_MAX_S
_POLL_MAX_S = 0.05

# The one registry of this module: this process's agreed attempt, and the prefix `scoped`
# puts on the stores of its process groups where commlib.init did not put it there first.
_agreed: int | None = None
_scope: str | None = None


def _counts(environ: Mapping[str, str]) -> tuple[int, int, int, int]:
    return (
        env_integer(RESTART_ENV, 0, environ=environ),
        env_integer(MAX_RESTARTS_ENV, 0, environ=environ),
        env_integer(REQUEUE_ENV, 0, environ=environ),
        env_integer(NODES_ENV, 1, environ=environ),
    )


def launch_base(environ: Mapping[str, str]) -> int:
    """The attempt number of the first round of this launch (module docstring)."""
    _, max_restarts, requeue, nodes = _counts(environ)
    return requeue * (nodes * max_restarts + 1)


def attempt_number(environ: Mapping[str, str] | None = None) -> int:
    """This process's attempt, as agreed by `agree`; with `environ` (or before any agreement),
    the estimate from the environment: the launch's base plus the node's restart count."""
    if environ is None and _agreed is not None:
        return _agreed
    environ = os.environ if environ is None else environ
    return launch_base(environ) + _counts(environ)[0]


def agree(store: Any, rank: int, size: int, timeout_s: float) -> int:
    """Settle this round's attempt with every rank through `store` (module docstring); it is
    this process's `attempt_number` from then on. Waits up to `timeout_s` (the job's own
    deadline for joining, as the engine's connect has) for the other ranks; raises CommError
    naming who did not come."""
    global _agreed
    generation = _lead(store, size, timeout_s) if rank == 0 else _follow(store, rank, timeout_s)
    _agreed = launch_base(os.environ) + generation - 1
    return _agreed


def scoped(store: Any, rank: int, size: int, is_default: bool, timeout_s: float) -> Any:
    """The store a process group made by ``init_process_group(backend="commlib")`` keys its
    communicators in: under its attempt's prefix when the process runs under torchrun's shared
    store and no attempt was agreed yet (its default group agrees it); `store` itself where
    commlib.init agreed it and prefixed the store it gave torch."""
    global _scope
    if is_default and _agreed is None and env(AGENT_STORE_ENV) == "True":
        _scope = f"attempt{agree(store, rank, size, timeout_s)}/"
    if _scope is None:
        return store
    import torch.distributed as dist

    return dist.PrefixStore(_scope, store)


def _lead(store: Any, size: int, timeout_s: float) -> int:
    """Rank 0: the round's generation, once every other rank confirmed it."""
    generation = int(store.add(f"{KEY}/generation", 1))
    questions = [f"{KEY}/question/{r}" for r in range(1, size)]
    confirmed = [f"{KEY}/{generation}/confirmed/{r}" for r in range(1, size)]
    unasked = list(questions)  # no question yet, from any round: read only once there (a read waits for it)
    answered: set[bytes] = set()
    deadline, poll_s = time.monotonic() + timeout_s, _POLL_S
    while questions and not store.check(confirmed):
        unasked = [unasked[i] for i in absent(store, unasked)]
        asked = [q for q in questions if q not in unasked]
        for nonce in set(store.multi_get(asked) if asked else []) - answered:
            store.set(f"{KEY}/answer/{nonce.decode()}", str(generation))
            answered.add(nonce)
        if time.monotonic() > deadline:
            missing = [i + 1 for i in absent(store, confirmed)]
            raise CommError(
                f"commlib.init: rank 0: expected every rank to settle this attempt within {timeout_s:g} s; "
                f"found ranks {rank_list(missing)} did not",
                rank=0,
            )
        time.sleep(poll_s)
        poll_s = min(2 * poll_s, _POLL_MAX_S)
    return generation


def _follow(store: Any, rank: int, timeout_s: float) -> int:
    """Any other rank: ask rank 0, and confirm its answer."""
    nonce = uuid.uuid4().hex
    store.set(f"{KEY}/question/{rank}", nonce)
    answer = f"{KEY}/answer/{nonce}"
    try:
        store.wait([answer], timedelta(seconds=timeout_s))
    except RuntimeError:  # torch's DistStoreError: no answer in time
        raise CommError(
            f"commlib.init: rank {rank}: expected rank 0 to settle this attempt within {timeout_s:g} s; "
            f"found no answer",
            rank=rank,
        ) from None
    generation = int(store.get(answer))
    store.set(f"{KEY}/{generation}/confirmed/{rank}", "1")
    return generation
