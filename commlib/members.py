"""Who the ranks of a communicator are: its members' global ranks, how a rank or a set of ranks is
named, and how the communicators of a torchft quorum are named.

A communicator numbers its members 0..size-1 (its own ranks: the store keys, the progress
board, the engine all use those), while an operator knows a process by its global rank (what
torchrun, the logs and the doctor call it). A subgroup's error that said "rank 1" would send
the operator to the wrong process, so every error, log field and message names global ranks
(`global_of`), with the communicator's own rank beside it where the two differ (`name`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

_QUORUM_COMM = re.compile(r"^replicas\.q(\d+)(?:\.shard\d+)?$")


@dataclass(frozen=True)
class Members:
    comm: str
    global_ranks: tuple[int, ...]  # indexed by the communicator's own rank

    @classmethod
    def of(cls, comm: str, size: int, global_ranks: Sequence[int] | None = None) -> Members:
        """`global_ranks` None: the communicator's ranks are the global ones (a world)."""
        ranks = tuple(range(size)) if global_ranks is None else tuple(global_ranks)
        if len(ranks) != size:
            raise ValueError(
                f"communicator {comm!r}: expected the global ranks of its {size} members; found {list(ranks)}"
            )
        return cls(comm, ranks)

    @property
    def is_world(self) -> bool:
        return self.global_ranks == tuple(range(len(self.global_ranks)))

    def global_of(self, ranks: Iterable[int]) -> list[int]:
        return [self.global_ranks[r] for r in ranks]

    def own_of(self, global_ranks: Iterable[int]) -> list[int]:
        """The communicator's own ranks of members given by global rank."""
        return [self.global_ranks.index(g) for g in global_ranks]

    def name(self, rank: int) -> str:
        """'rank 3', or 'rank 3 (rank 1 of 'group1')' where the communicator's rank differs."""
        g = self.global_ranks[rank]
        return f"rank {g}" if g == rank else f"rank {g} (rank {rank} of {self.comm!r})"

    def names(self, ranks: Iterable[int]) -> str:
        """'rank 3' or 'ranks 0-736, 738-999': a set of ranks in a few characters however many,
        with the communicator's own ranks beside them where they differ."""
        mine = sorted(set(ranks))
        globals_ = self.global_of(mine)
        said = ranks_text(globals_)
        return said if globals_ == mine else f"{said} ({ranks_text(mine)} of {self.comm!r})"


def rank_ranges(ranks: Iterable[int]) -> str:
    """Ranks as ranges, in order: "0-736, 738-999" (a thousand ranks in a few characters)."""
    out: list[list[int]] = []
    for r in sorted(set(ranks)):
        if out and out[-1][1] == r - 1:
            out[-1][1] = r
        else:
            out.append([r, r])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in out)


def rank_list(ranks: Iterable[int]) -> str:
    """ "[2]", "[1, 3]", "[0-736, 738-999]": a list of ranks as an error message says it, in ranges."""
    return f"[{rank_ranges(ranks)}]"


def ranks_text(ranks: Iterable[int]) -> str:
    """ "rank 3", "ranks 0-736, 738-999", or "no rank": how a message names a set of ranks."""
    unique = set(ranks)
    if not unique:
        return "no rank"
    return f"rank {next(iter(unique))}" if len(unique) == 1 else f"ranks {rank_ranges(unique)}"


def quorum_comm(quorum_id: int, shard: int | None = None) -> str:
    """The name of a quorum's communicator, as `commlib.replicas` gives it and the logs carry it:
    ``replicas.q{id}``, or ``replicas.q{id}.shard{k}`` for the members that are each rank k of
    their replica group, where a group has more than one rank (each k has a communicator of its
    own: one name for all of them would be read as one communicator)."""
    return f"replicas.q{quorum_id}" if shard is None else f"replicas.q{quorum_id}.shard{shard}"


def quorum_of(comm: Any) -> int | None:
    """The quorum id of a quorum's communicator named `comm` (`quorum_comm`); None for any other."""
    found = _QUORUM_COMM.match(comm) if isinstance(comm, str) else None
    return int(found.group(1)) if found else None
