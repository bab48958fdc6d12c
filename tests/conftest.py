"""Shared test setup: every test runs real gloo on loopback, its ranks processes or (the fast lane,
marked `contract`) threads of the test's process."""

import fcntl
import json
import os
import pickle
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

# Ranks spawned by tests inherit this: they must never wait on a real job's default timeout.
os.environ.setdefault("TORCHCOMM_TIMEOUT_SECONDS", "60")



# The tests that hold a worker longest (chaos runs with restarts, the Slurm job, FSDP and
# trainer launches), heaviest first, by their time in a full run (`./scripts/test.sh
# --durations=0`, cores + 2 workers: docs/testing.md). The test command hands tests out one at a
# time (`--maxschedchunk 1`) in collection order, so collecting these first starts the longest
# at once on every worker and leaves the short ones to fill in at the end, instead of one
# worker still running a long test when the others are done (the wall time is the latest
# worker's). A module's tests then land on several workers: what they share is made once for
# the session (`once`), not once per worker (pytest-xdist's `loadgroup`, which would keep a
# module's tests together, does not group under pytest 9.2: it renames `item._nodeid`, which
# pytest no longer reads).
HEAVY_FIRST = (
    "tests/chaos/test_slurm.py::test_a_requeued_job_preempted_out_of_time_and_losing_a_node_with_restarts_in_between",
    "tests/chaos/test_soak.py::test_two_drawn_faults_in_one_run_recover_bitwise",
    "tests/chaos/test_own_trainers.py::test_a_users_trainer_recovers_bitwise_from_a_kill_a_hang_a_delay_and_a_preemption",
    "tests/chaos/test_chaos_faults.py::test_timeouts_name_the_faulted_rank_and_recover_bitwise",
    "tests/chaos/test_multinode.py::test_two_harnesses_recover_from_restarts_begun_on_either_node",
    "tests/chaos/test_chaos_faults.py::test_process_deaths_recover_bitwise",
    "tests/chaos/test_chaos_faults.py::test_in_rank_errors_recover_bitwise",
    "tests/chaos/test_chaos_cluster_faults.py::test_straggler_corrupted_checkpoint_and_preemption",
    "tests/chaos/test_replica_faults.py::test_a_lost_hsdp_group_restarts_alone_heals_and_the_run_is_its_replay_bitwise",
    "tests/chaos/test_replica_faults.py::test_losing_every_up_to_date_group_rolls_back_to_the_newest_checkpoint_and_the_run_goes_on",
    "tests/commlib/test_process_group.py::test_unmodified_trainer_over_commlib_matches_plain_gloo",
    "tests/workload/test_model.py::test_ranks_of_one_host_compile_a_cold_kernel_once",
    "tests/fsdp/test_shard.py::test_modes_bitwise_equal_4_ranks",
    "tests/chaos/test_own_trainers.py::test_a_wrong_resume_fails_naming_the_first_step_that_differs",
    "tests/chaos/test_multinode.py::test_plain_torchrun_restarts_begun_on_one_node_with_commlib_init_and_the_commlib_backend",
    "tests/chaos/test_chaos_net_faults.py::test_a_long_partition_is_detected_and_recovered_and_a_short_one_survived",
    "tests/chaos/test_chaos_net_faults.py::test_latency_and_loss_are_ridden_out_bitwise",
    "tests/workload/test_model.py::test_same_seed_is_bitwise_deterministic_in_process_and_across_processes",
    "tests/fsdp/test_shard.py::test_two_ranks",
    "tests/workload/test_checkpoint.py::test_torchrun_resume_skips_torn_and_corrupt_checkpoints",
    "tests/chaos/test_in_job_recovery.py::test_in_job_for_live_ranks_restart_for_a_dead_one_all_bitwise",
    "tests/chaos/test_replica_faults.py::test_the_proof_fails_a_group_that_healed_stale_or_skipped_a_step",
    "tests/chaos/test_chaos_cluster_faults.py::test_a_rank_stuck_holding_the_gil_is_named_with_its_stack",
    "tests/workload/test_train.py::test_torchcomms_engine_trains_fsdp2_and_dcp_like_gloo",
    "tests/commlib/test_process_group.py::test_rank_stopped_before_dcp_save_is_named_by_a_collective_timeout",
    "tests/chaos/test_harness_cleanup.py::test_a_second_signal_never_cuts_short_the_stop_of_a_network_fault_run",
    "tests/chaos/test_chaos_cluster_faults.py::test_a_full_disk_fails_the_save_cleanly_and_the_job_goes_on",
)


# The machine's stalls (docs/testing.md, "Flaky tests"): with COMMLIB_TEST_STALL_LOG set (the full
# suite's `scripts/test.sh` sets it), every pytest process appends to that file each time a
# thread of its own that sleeps 50 ms wakes more than STALL_S late, and each test that failed,
# with when it ran. `scripts/stalled_failures.py` reads it to tell whether every failure ran
# through such a stall.
STALL_LOG_ENV = "COMMLIB_TEST_STALL_LOG"
STALL_S = 2.0


def _append(path: str, record: dict[str, Any]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(record) + "\n").encode())  # one write: whole among the writers
    finally:
        os.close(fd)


def _watch_stalls(path: str) -> None:
    tick = 0.05
    while True:
        before = time.time()
        time.sleep(tick)
        late = time.time() - before - tick
        if late > STALL_S:
            _append(path, {"stall_from": before + tick, "stall_to": before + tick + late, "pid": os.getpid()})


def pytest_configure(config):
    path = os.environ.get(STALL_LOG_ENV)
    if path:
        threading.Thread(target=_watch_stalls, args=(path,), name="stall-watch", daemon=True).start()


def pytest_runtest_logreport(report):
    path = os.environ.get(STALL_LOG_ENV)
    if path and report.failed:
        _append(path, {"failed": report.nodeid, "from": report.start, "to": report.stop})


def pytest_collection_modifyitems(items):
    def heaviness(item):
        test = item.nodeid.split("[", 1)[0]  # a parametrized test's cases share its place
        return HEAVY_FIRST.index(test) if test in HEAVY_FIRST else len(HEAVY_FIRST)

    items.sort(key=heaviness)  # stable: the rest keep pytest's order


@pytest.fixture(scope="session")
def session_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's base temporary directory: the same for every pytest-xdist worker."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if base.name.startswith("popen-gw") else base


@pytest.fixture(scope="session")
def once(session_dir: Path) -> Callable[[str, Callable[[Path], Any]], tuple[Path, Any]]:
    """once(name, make) -> (directory, value): `make(directory)` run once in the whole session,
    by whichever pytest-xdist worker asks first, the others waiting on a file lock and reading
    what it left: its directory and its value (pickled). For what a module's tests only read
    (a job's logs, its results): each worker that runs one of its tests used to launch the job
    again. A `make` that raises leaves nothing, and the next caller tries again."""
    root = session_dir / "once"
    root.mkdir(exist_ok=True)

    def get(name: str, make: Callable[[Path], Any]) -> tuple[Path, Any]:
        directory, value = root / name, root / f"{name}.pickle"
        with open(root / f"{name}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            if not value.exists():
                shutil.rmtree(directory, ignore_errors=True)  # what a make that raised left
                directory.mkdir()
                made = pickle.dumps(make(directory))
                value.with_suffix(".tmp").write_bytes(made)
                os.replace(value.with_suffix(".tmp"), value)
        return directory, pickle.loads(value.read_bytes())

    return get
