"""The proof can fail: `chaos.comparison.compare` on step records that differ from the
reference's by the least amount each check exists for, the lineage the final state descends
from, what the first difference is said to point to, and the reference cache key's coverage
of the code that computes the numbers.

The records are real: a small model trained in this process under the step probe
(`chaos.probe`), logged and read back (`read_steps`); the digests' own sensitivity to one ulp
is tests/chaos/test_probe.py's.
"""

import dataclasses
import math
import shutil
from pathlib import Path

import pytest
import torch

import chaos.verify as verify
from chaos.comparison import Steps, StepRecord, compare, final_lineage, read_steps
from chaos.harness import Job, JobOutcome
from chaos.probe import StepProbe
from chaos.verify import REFERENCE, ensure_reference, package_dirs, reference_key, sources_digest
from commlib.record import log

STEPS = 5
CHECKS = {"steps_exact", "losses_bitwise", "steps_bitwise", "state_bitwise"}
TOY = str(Path(__file__).with_name("toy_trainer.py"))


def _train(run_dir: Path) -> Steps:
    """Five Adam steps of a small model under the probe, logged to `run_dir`/logs, read back."""
    log.configure(0, 1, run_dir / "logs")
    probe = StepProbe().install()
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
        for step in range(1, STEPS + 1):
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
            torch.nn.functional.mse_loss(model(x), x[:, :3] * 3.0).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    finally:
        probe.remove()
        log.release()
    return read_steps(run_dir)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Steps:
    return _train(tmp_path_factory.mktemp("reference"))


def _with(steps: Steps, records: list[StepRecord]) -> Steps:
    return Steps({(0, 0): records}, steps.probes)


def _assert_only_failed(comparison, failed: set[str]) -> None:
    assert not comparison.equal, comparison
    assert set(comparison.checks) == CHECKS, comparison.checks
    assert {name for name, ok in comparison.checks.items() if not ok} == failed, comparison
    assert comparison.problems


def test_the_same_run_twice_is_equal(tmp_path, reference):
    """The control: two separate trainings of one config are bitwise the same run."""
    comparison = compare(_train(tmp_path), reference)
    assert comparison.equal, comparison.problems
    assert comparison.checks == dict.fromkeys(CHECKS, True) and comparison.problems == []
    [records] = reference.records.values()
    assert [r.step for r in records] == [1, 2, 3, 4, 5] and len({r.losses for r in records}) == STEPS
    assert all(r.params and r.optim and r.data and r.rng for r in records)


@pytest.mark.parametrize("direction", [float("inf"), float("-inf")], ids=["up", "down"])
def test_one_loss_one_ulp_off_is_not_equal(reference, direction):
    """Step 3's loss a ulp away, everything else the reference's: named, as a loss."""
    records = list(reference.records[(0, 0)])
    loss = float.fromhex(records[2].losses[0])
    records[2] = dataclasses.replace(records[2], losses=(math.nextafter(loss, direction).hex(),))
    comparison = compare(_with(reference, records), reference)
    _assert_only_failed(comparison, {"losses_bitwise", "steps_bitwise"})
    assert comparison.first_difference.startswith("step 3 on rank 0 differs from the reference's: its loss;")


def test_a_step_applied_twice_is_not_equal(reference):
    """Step 3's update applied twice: the optimizer counts one step more, and step 4 drew step 3's data."""
    ref = reference.records[(0, 0)]
    doubled = [*ref[:3], dataclasses.replace(ref[2], step=4), *(dataclasses.replace(r, step=r.step + 1)
                                                               for r in ref[3:])]
    comparison = compare(_with(reference, doubled), reference)
    _assert_only_failed(comparison, {"steps_exact", "losses_bitwise", "steps_bitwise", "state_bitwise"})
    assert "beyond the reference [6]" in comparison.problems[1]
    assert comparison.first_difference.startswith("step 4 on rank 0 differs from the reference's: its data,")


def test_a_skipped_step_is_not_equal(reference):
    ref = reference.records[(0, 0)]
    comparison = compare(_with(reference, [*ref[:2], *ref[3:]]), reference)
    _assert_only_failed(comparison, {"steps_exact"})
    assert "descending from steps [1-2, 4-5], missing [3]" in comparison.problems[0]


def test_a_final_state_one_digest_off_is_not_equal(reference):
    ref = reference.records[(0, 0)]
    last = dataclasses.replace(ref[-1], optim="0" * 32)
    comparison = compare(_with(reference, [*ref[:-1], last]), reference)
    _assert_only_failed(comparison, {"steps_bitwise", "state_bitwise"})
    assert "found step 5's optimizer state differing" in comparison.problems[-1]
    assert "the parameters are equal but the optimizer state differs" in comparison.first_difference


def test_the_lineage_takes_each_steps_execution_the_final_state_descends_from(reference):
    """Steps run again after a restart (attempt 1 from step 2) or a rollback replace the ones lost;
    an attempt resumed from an older checkpoint descends from the older attempt's steps."""
    ref = reference.records[(0, 0)]
    again = [dataclasses.replace(r, attempt=1, pid=2) for r in ref[2:]]
    run = [*ref[:4], *again]  # attempt 0 ran 1-4, attempt 1 resumed from 2 and ran 3-5
    assert final_lineage(run) == [*ref[:2], *again]
    assert compare(_with(reference, run), reference).equal
    broken = [*ref[:4], dataclasses.replace(again[0], losses=("0x1p+0",)), *again[1:]]
    comparison = compare(_with(reference, broken), reference)
    assert comparison.first_difference.startswith(
        "step 3 on rank 0 (the first step after attempt 1 resumed from step 2) differs from the reference's: its loss;")


@pytest.mark.parametrize("changed, words", [
    (dict(rng="f" * 32, data="e" * 32), "torch's RNG state at its start differs too"),
    (dict(data="e" * 32), "it drew other data from the same torch RNG state"),
    (dict(losses=("0x1p+0",)), "the same data gave another loss"),
    (dict(params="d" * 32), "the same data and loss gave other parameters"),
])
def test_the_first_difference_says_what_it_points_to(reference, changed, words):
    ref = reference.records[(0, 0)]
    comparison = compare(_with(reference, [*ref[:1], dataclasses.replace(ref[1], **changed), *ref[2:]]), reference)
    assert comparison.first_difference.startswith("step 2 on rank 0 differs") and words in comparison.first_difference


def test_without_the_optimizers_step_count_only_the_final_state_is_compared(reference):
    """Steps counted per process cannot be placed after a restart: the last state alone is compared."""
    ref = reference.records[(0, 0)]
    counted_again = [*ref[:3], *(dataclasses.replace(r, step=r.step - 2, pid=2) for r in ref[2:])]
    comparison = compare(_with(reference, counted_again), reference, placed=False)
    assert comparison.checks == {"state_bitwise": True} and comparison.equal


# -- the reference cache key ------------------------------------------------------------------

@pytest.fixture
def library_copy(tmp_path):
    """A copy of commlib, fsdp_overlap and chaos (their files only), and its package roots."""
    roots = []
    for src in package_dirs():
        dst = tmp_path / "copy" / src.name
        shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
        roots.append(dst)
    return roots


def test_the_key_covers_exactly_the_libraries_sources(library_copy):
    assert [p.name for p in package_dirs()] == ["commlib", "fsdp_overlap", "chaos"]
    job = Job(trainer=TOY)
    # The same code elsewhere gives the same key: the default key hashes exactly these files.
    assert reference_key(job, library_copy) == reference_key(job)
    for left_out in range(3):
        assert reference_key(job, library_copy[:left_out] + library_copy[left_out + 1:]) != reference_key(job)


@pytest.mark.parametrize("edit", ["commlib/communicator.py", "commlib/backends/c10d.py", "fsdp_overlap/shard.py",
                                  "chaos/verify.py", "chaos/workload/model.py"])
def test_an_edited_library_file_changes_the_key(library_copy, edit):
    job = Job(trainer=TOY)
    before = reference_key(job, library_copy)
    path = library_copy[0].parent / edit
    original = path.read_bytes()
    path.write_bytes(original + b"\n# one more line\n")
    assert reference_key(job, library_copy) != before
    path.write_bytes(original.replace(b"=", b" = ", 1))
    assert reference_key(job, library_copy) != before
    path.write_bytes(original)
    assert reference_key(job, library_copy) == before


def test_added_removed_and_renamed_files_change_the_digest(library_copy):
    before = sources_digest(library_copy)
    commlib_copy = library_copy[0]
    (commlib_copy / "extra.py").write_text("X = 1\n")
    assert sources_digest(library_copy) != before
    (commlib_copy / "extra.py").unlink()
    assert sources_digest(library_copy) == before
    (commlib_copy / "hooks.py").rename(commlib_copy / "hooks2.py")
    assert sources_digest(library_copy) != before
    (commlib_copy / "hooks2.py").rename(commlib_copy / "hooks.py")
    # Files that are not Python sources do not count.
    (commlib_copy / "notes.txt").write_text("not code\n")
    (commlib_copy / "__pycache__").mkdir(exist_ok=True)
    (commlib_copy / "__pycache__" / "hooks.cpython-311.py").write_text("stale\n")
    assert sources_digest(library_copy) == before


def test_ensure_reference_recomputes_after_a_library_edit(tmp_path, library_copy, monkeypatch):
    """A reference cached before a code change is not reused after it: the harness is asked
    for a new fault-free run (stood in for here by one that only notes it ran)."""
    runs = []

    def fake_run_job(job, plan, run_dir, **kwargs):
        runs.append(Path(run_dir))
        Path(run_dir).mkdir(parents=True, exist_ok=True)  # made empty for it (chaos.files.work_directory)
        (Path(run_dir) / "run.txt").write_text(f"run {len(runs)}\n")
        return JobOutcome(Path(run_dir), 0, 0, [0])

    monkeypatch.setattr(verify, "package_dirs", lambda: library_copy)
    monkeypatch.setattr(verify, "run_job", fake_run_job)
    monkeypatch.setattr(verify, "read_steps", lambda run_dir: Steps({(0, 0): [None]}))  # one step recorded
    monkeypatch.setattr(verify, "mark_reference", lambda run_dir, start_ns: (run_dir / REFERENCE).write_text("{}"))
    job, root = Job(trainer=TOY), tmp_path / "references"
    first = ensure_reference(job, root)
    assert len(runs) == 1 and ensure_reference(job, root) == first and len(runs) == 1  # cached
    path = library_copy[1] / "comms.py"
    path.write_text(path.read_text() + "\n# a change\n")
    second = ensure_reference(job, root)
    assert len(runs) == 2 and second != first and (second / "run.txt").read_text() == "run 2\n"
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == sorted([first.name, second.name])
    assert second.name == reference_key(job, library_copy)


def test_a_failed_second_fault_free_run_keeps_its_directory_for_its_error(tmp_path, monkeypatch):
    """The run a failure's message points to is still there after the next caller's retry; the
    retry that completes is the one published as `again` (the harness stood in for, as above)."""
    runs = []

    def fake_run_job(job, plan, run_dir, **kwargs):
        runs.append(Path(run_dir))
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        (Path(run_dir) / "torchrun0.log").write_text(f"run {len(runs)}\n")
        return JobOutcome(Path(run_dir), 0, 0, [1 if len(runs) == 1 else 0])

    monkeypatch.setattr(verify, "run_job", fake_run_job)
    monkeypatch.setattr(verify, "diagnose", lambda run_dir: ([], None))
    monkeypatch.setattr(verify, "read_steps", lambda run_dir: Steps({(0, 0): [None]}))
    monkeypatch.setattr(verify, "mark_reference", lambda run_dir, start_ns: (run_dir / REFERENCE).write_text("{}"))
    monkeypatch.setattr(verify, "compare", lambda theirs, ours: "compared")
    reference = tmp_path / "reference"
    reference.mkdir()
    failed = verify._reproducible(Job(trainer=TOY), reference, Steps({}), 60.0, None)
    assert not failed.equal and f"see {runs[0]}/torchrun0.log" in failed.problems[0], failed.problems
    assert verify._reproducible(Job(trainer=TOY), reference, Steps({}), 60.0, None) == "compared"
    assert (runs[0] / "torchrun0.log").read_text() == "run 1\n"  # the failed run, as its error said
    assert (reference / verify.AGAIN / "torchrun0.log").read_text() == "run 2\n"


def _fault(kind, **fields):
    from chaos.report import FaultResult
    base = dict(type=kind, index=0, firing=1, rank=1, step=6, attempt=0, pid=1, node=0, injected_at=1.0,
                injected_ts_ns=1)
    return FaultResult(**{**base, **fields})


@pytest.mark.parametrize("name, good, bad", [
    ("corrupt_checkpoint_not_loaded", {"checkpoint_step": 6, "resumed_from": 4}, {"checkpoint_step": 6, "resumed_from": 6}),
    ("preempted_cleanly", {"resumed_from": 6, "steps_reexecuted": 0}, {"resumed_from": 6, "steps_reexecuted": 1}),
    ("disk_full_rolled_back", {"resumed_from": 5}, {"resumed_from": None}),
    ("straggler_named", {"diagnosis": {"problems": [{"kind": "straggler", "ranks": [1]}]}},
     {"diagnosis": {"problems": [{"kind": "straggler", "ranks": [0]}]}}),
    # An attempt that recovered in-job from a raise on rank 0 first, then from a delay on rank 1.
    ("diagnosis_names_faulted_rank",
     {"diagnosis": {"culprits": [0], "problems": [{"kind": "error", "ranks": [0]}, {"kind": "timeout", "ranks": [1]}]}},
     {"diagnosis": {"culprits": [0], "problems": [{"kind": "error", "ranks": [0]}, {"kind": "timeout", "ranks": [0]}]}}),
    # Latency or loss that made a collective fail (or a rank recover) was not ridden out.
    ("net_fault_survived", {"released_after_s": 2.0},
     {"released_after_s": 2.0, "detected_after_s": 1.5, "detected_by": {"rank": 0, "event": "collective.timeout"}}),
    ("net_fault_survived", {"released_after_s": 2.0}, {"released_after_s": 2.0, "recovery": "restart"}),
    # A 3 s partition: survived; or failing after the link came back (TCP resumed too late) ...
    ("short_partition_survived", {"released_after_s": 3.0},
     {"released_after_s": 3.0, "detected_after_s": 7.5, "recovery": "in_job",
      "diagnosis": {"problems": [{"kind": "timeout", "ranks": [1], "details": {"deadline_s": 10.0}}]}}),
    # ... or failing while cut off, but before any deadline: it was no long partition.
    ("short_partition_survived", {"released_after_s": 3.0},
     {"released_after_s": 3.0, "detected_after_s": 2.0, "recovery": "in_job",
      "diagnosis": {"problems": [{"kind": "timeout", "ranks": [1], "details": {"deadline_s": 10.0}}]}}),
    # A 12 s partition detected at the 10 s deadline while cut off is the other kind; an undetected restart is not.
    ("short_partition_survived",
     {"released_after_s": 12.0, "detected_after_s": 10.0, "recovery": "in_job",
      "diagnosis": {"problems": [{"kind": "timeout", "ranks": [1], "details": {"deadline_s": 10.0}}]}},
     {"released_after_s": 12.0, "recovery": "restart"}),
    ("long_partition_named",
     {"released_after_s": 12.0, "detected_after_s": 10.0, "recovery": "in_job",
      "diagnosis": {"culprits": [1], "problems": [{"kind": "timeout", "ranks": [1]}]}},
     {"released_after_s": 12.0, "detected_after_s": 10.0, "recovery": "in_job",
      "diagnosis": {"culprits": [0], "problems": [{"kind": "timeout", "ranks": [0]}]}}),
    # Where the deadline is known (`expected`), it decides the kind: a short one that failed
    # even past the deadline was not survived, and a long one that nobody detected is a failure too.
    ("short_partition_survived", {"expected": "survived", "released_after_s": 3.0},
     {"expected": "survived", "released_after_s": 12.0, "detected_after_s": 10.0, "recovery": "in_job",
      "diagnosis": {"problems": [{"kind": "timeout", "ranks": [1], "details": {"deadline_s": 10.0}}]}}),
    ("long_partition_named",
     {"expected": "detected", "released_after_s": 12.0, "detected_after_s": 10.0, "recovery": "in_job",
      "diagnosis": {"culprits": [1], "problems": [{"kind": "timeout", "ranks": [1]}]}},
     {"expected": "detected", "released_after_s": 12.0, "recovery": "restart"}),
    # The gap this closes: a long partition nobody noticed looked like a survived short one.
    ("long_partition_named",
     {"expected": "detected", "released_after_s": 12.0, "detected_after_s": 10.0, "recovery": "in_job",
      "diagnosis": {"culprits": [1], "problems": [{"kind": "timeout", "ranks": [1]}]}},
     {"expected": "detected", "released_after_s": 12.0}),
])
def test_each_new_fault_check_fails_when_its_guarantee_does_not_hold(name, good, bad):
    from chaos.verify import _FAULT_CHECKS
    [check] = [c for c in _FAULT_CHECKS if c.name == name]
    kind = next(iter(check.kinds))
    assert check.holds(_fault(kind, **good))
    assert not check.holds(_fault(kind, **bad)), check.found(_fault(kind, **bad))


def test_recovery_only_flags_share_the_reference_trainers_reference_and_nothing_else():
    from chaos.harness import RECOVERY_ONLY_FLAGS

    args = ("--steps", "8")
    reference = Job(trainer_args=args)
    assert reference_key(Job(trainer_args=(*args, *RECOVERY_ONLY_FLAGS))) == reference_key(reference)
    assert reference_key(Job(trainer_args=(*args, "--timeout", "5"))) != reference_key(reference)
    # A user's trainer: its flags are its own, so every one of them keys its reference.
    assert reference_key(Job(trainer=TOY, trainer_args=RECOVERY_ONLY_FLAGS)) != reference_key(Job(trainer=TOY))
