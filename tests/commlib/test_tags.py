"""Tagged send/recv, as c10d takes them: gloo matches a send with the recv of its tag; each tag's
messages with a peer are numbered apart; torchft's `PGTransport`, which tags a checkpoint's
metadata and tensors 1, 2, 3, ..., heals over a commlib process group."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

import commlib
from commlib import testing


def _out_of_order(comm: commlib.Communicator) -> dict[str, object]:
    if comm.rank == 0:
        late = comm.send(torch.full((2,), 2.0), 1, tag=2, async_op=True)
        comm.send(torch.full((2,), 1.0), 1, tag=1)
        late.wait()
        return {"seqs": [comm.p2p_seq(1, 1), comm.p2p_seq(1, 2), comm.p2p_seq(1)]}
    first, second = torch.zeros(2), torch.zeros(2)
    comm.recv(first, 0, tag=1)  # posted first, matched with the send of its tag, sent second
    comm.recv(second, 0, tag=2)
    return {"values": [first.tolist(), second.tolist()], "seqs": [comm.p2p_seq(0, 1), comm.p2p_seq(0, 2)]}


def test_gloo_matches_a_recv_with_the_send_of_its_tag_whatever_the_order() -> None:
    """Each tag's messages with a peer are numbered apart: one each here, none untagged."""
    r0, r1 = testing.run(_out_of_order, 2, timeout=60)
    assert r1["values"] == [[1.0, 1.0], [2.0, 2.0]], r1
    assert r0["seqs"] == [1, 1, 0] and r1["seqs"] == [1, 1], (r0, r1)


def _heal_over_commlib() -> dict[str, object]:
    from torchft.checkpointing.pg_transport import PGTransport

    from commlib.process_group import group_over_store

    rank = int(os.environ["RANK"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), 2, is_master=False)
    group = group_over_store(dist.PrefixStore("heal/", store), rank, 2, 30.0, "replicas.heal")
    transport: PGTransport = PGTransport(group, timedelta(seconds=30), torch.device("cpu"))
    state = {"step": 7, "w": torch.arange(1000, dtype=torch.float32), "opt": {"m": torch.ones(3, 4)}}
    if rank == 0:
        transport.send_checkpoint([1], 7, state)
        return {}
    got = transport.recv_checkpoint(0, transport.metadata(), 7)
    same = torch.equal(got["w"], state["w"]) and torch.equal(got["opt"]["m"], state["opt"]["m"])
    return {"same": same and got["step"] == 7}


def test_torchfts_pg_transport_heals_over_a_commlib_group() -> None:
    """A checkpoint sent with tags 1, 2, 3, ... arrives whole (the group once refused tag 1)."""
    _, r1 = testing.run(_heal_over_commlib, 2, backend=None, timeout=90)
    assert r1["same"], r1
