"""Shared test setup: every test runs real processes over gloo on loopback."""

import os

# Ranks spawned by tests inherit this: they must never wait on a real job's default timeout.
os.environ.setdefault("TORCHCOMM_TIMEOUT_SECONDS", "60")


# The modules whose tests hold a worker for a minute or more (chaos runs with restarts, the
# Slurm job, FSDP and trainer launches), heaviest first, by their test time in a full run
# (`./scripts/test.sh --durations=0`: docs/testing.md). pytest-xdist hands the first quarter
# of the collected tests out round-robin and the rest as workers free up, so collecting these
# first spreads them over the workers instead of leaving one worker the longest at the end.
HEAVY_FIRST = (
    "tests/chaos/test_slurm.py",
    "tests/chaos/test_chaos_faults.py",
    "tests/chaos/test_multinode.py",
    "tests/chaos/test_chaos_cluster_faults.py",
    "tests/chaos/test_replica_faults.py",
    "tests/workload/test_model.py",
    "tests/fsdp/test_shard.py",
    "tests/chaos/test_chaos_resume_proof.py",
    "tests/chaos/test_soak.py",
    "tests/chaos/test_chaos_net_faults.py",
    "tests/chaos/test_harness_cleanup.py",
    "tests/chaos/test_in_job_recovery.py",
    "tests/workload/test_checkpoint.py",
)


def pytest_collection_modifyitems(items):
    def heaviness(item):
        path = item.nodeid.split("::", 1)[0]
        return HEAVY_FIRST.index(path) if path in HEAVY_FIRST else len(HEAVY_FIRST)

    items.sort(key=heaviness)  # stable: each module's tests keep their order
