"""commlib as torchft's process group (`commlib.replicas`): two replica groups of one process
each under torchft's real Manager and lighthouse, over real gloo on loopback; one dies."""

import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

from commlib import testing
from commlib.members import quorum_of
from commlib.replicas import Quorum, replica_group

STEPS, DIES_AT = 8, 4


def _replica(lighthouse: str, log_root: str) -> dict:
    import time

    import torch
    import torch.distributed as dist
    from torchft import Manager

    from commlib.record import log

    replica = int(os.environ["RANK"])
    log.configure(0, 1, f"{log_root}/replica{replica}")
    pg = replica_group(10.0)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    weights = torch.zeros(4)
    manager = Manager(pg=pg, load_state_dict=lambda s: weights.copy_(s), state_dict=lambda: weights.clone(),
                      min_replica_size=1, use_async_quorum=False, rank=0, world_size=1, store_addr="127.0.0.1",
                      store_port=store.port, lighthouse_addr=lighthouse, replica_id=f"replica{replica}",
                      init_sync=False, timeout=timedelta(seconds=20), quorum_timeout=timedelta(seconds=30),
                      connect_timeout=timedelta(seconds=20))
    # Both groups ask for their first quorum together. Under load one process can start a
    # second or more before the other, and a lighthouse that has seen only it heartbeat gives
    # it quorums alone: the group that dies at step 4 then ran every step before it alone.
    Path(log_root, f"ready{replica}").touch()
    give_up = time.monotonic() + 60
    while not all(Path(log_root, f"ready{r}").exists() for r in (0, 1)):
        assert time.monotonic() < give_up, "the other replica group never started"
        time.sleep(0.01)
    errors = []
    while manager.current_step() < STEPS:
        manager.start_quorum()
        if replica == 1 and manager.current_step() + 1 == DIES_AT:
            os._exit(0)  # dead between its quorum and the exchange: its peer is left waiting in the collective
        grad = torch.full((4,), float(replica + 1))
        manager.allreduce(grad).wait()
        if manager.errored() is not None:
            errors.append(manager.errored().original_exception)
        if manager.should_commit():
            weights -= grad
        time.sleep(0.2)  # steps long enough that both groups train together before one dies
    return {"step": manager.current_step(), "backend": pg.getBackendName(),
            "errors": [(type(e).__module__, type(e).__name__, getattr(e, "failed_ranks", None), str(e)) for e in errors]}


def _events(log_root: Path, replica: int, name: str) -> list[dict]:
    lines = (log_root / f"replica{replica}" / "rank0.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == name]


def test_the_manager_sees_commlibs_typed_error_naming_the_dead_replica_and_the_logs_say_each_quorum(tmp_path):
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=2000, quorum_tick_ms=50,
                                  heartbeat_timeout_ms=300)
    try:
        address = f"http://127.0.0.1:{lighthouse.address().rsplit(':', 1)[1]}"
        survivor, dead = testing.run(_replica, world_size=2, backend=None, timeout=120, allow_dead_ranks=True,
                                     args=(address, str(tmp_path)))
    finally:
        lighthouse.shutdown()
    assert dead is None  # it died, as planned
    assert survivor["backend"] == "torchft-commlib"
    assert survivor["step"] == STEPS  # it went on without the dead group
    module, kind, failed_ranks, message = survivor["errors"][0]
    assert (module, kind, failed_ranks) == ("commlib.errors", "PeerFailure", [1]), survivor["errors"]
    assert "replicas.q" in message and "rank 1 gone" in message, message

    quorums = _events(tmp_path, 0, "replicas.quorum")
    # Both groups, then the survivor alone (a group that starts first may have a quorum alone before).
    assert [q["replicas"] for q in quorums][-2:] == [[0, 1], [0]], quorums
    assert all(q["comm_name"] == f"replicas.q{q['quorum_id']}" for q in quorums)
    # Every collective of a quorum ran on that quorum's communicator.
    collectives = [json.loads(line) for line in (tmp_path / "replica0/rank0.jsonl").read_text().splitlines()
                   if '"collective.' in line]
    assert collectives and {c["comm"] for c in collectives} <= {q["comm_name"] for q in quorums}
    failure, = _events(tmp_path, 0, "replicas.failure")
    assert (failure["error_type"], failure["failed_replicas"], failure["quorum_id"]) == \
        ("PeerFailure", [1], quorums[-2]["quorum_id"]), failure


def test_each_rank_of_a_replica_group_has_a_quorum_communicator_of_its_own_name():
    # Two groups of two ranks: ranks 0 and 2 (each rank 0 of its group) share one communicator,
    # ranks 1 and 3 another. One name for both made the doctor read them as one communicator.
    first, second = Quorum(3, 0, 2, (0, 2), 2), Quorum(3, 0, 2, (1, 3), 2)
    assert (first.comm_name, second.comm_name) == ("replicas.q3.shard0", "replicas.q3.shard1")
    # One rank per group, or members unknown: one communicator per quorum, named by it alone.
    assert Quorum(3, 1, 2, (0, 1), 1).comm_name == Quorum(3, 1, 2, None, 2).comm_name == "replicas.q3"
    # The doctor reads the quorum back from either form, and from nothing else.
    assert [quorum_of(n) for n in ("replicas.q3.shard1", "replicas.q12", "replicas.q3x", "world", None)] == \
        [3, 12, None, None, None]


@pytest.mark.parametrize("timeout_s, error", [(0, ValueError), (float("nan"), ValueError), (None, TypeError),
                                              (1e9, ValueError)])
def test_a_bad_deadline_is_refused_before_any_group_is_made(timeout_s, error):
    with pytest.raises(error, match="replica_group timeout_s"):
        replica_group(timeout_s)


def test_without_torchft_asking_for_a_group_says_how_to_install_it():
    code = ("import sys; sys.modules['torchft'] = None\n"
            "import commlib.replicas as r\n"
            "try:\n    r.replica_group(5.0)\nexcept r.TorchftMissing as e:\n    print(e)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "expected torchft to be importable" in done.stdout and "pip install -e '.[replicas]'" in done.stdout
