"""The proof can fail: `chaos.verify.compare` on results files that differ from the reference
by the least amount each check exists for, and the reference cache key's coverage of the
code that computes the numbers.

Each results file is a real one: a small model trained with Adam, digested and written by
`chaos.results.write_results`, read back by `read_results`, so a one-ulp difference has to
survive the file format as well as the comparison.
"""

import copy
import math
import shutil
from pathlib import Path

import pytest
import torch

import chaos.verify as verify
from chaos.harness import Job, JobOutcome
from chaos.results import read_results, write_results
from chaos.verify import RESULTS, compare, ensure_reference, package_dirs, reference_key, sources_digest

STEPS = 5
CHECKS = {"losses_bitwise", "history_exact", "state_bitwise"}
TOY = str(Path(__file__).with_name("toy_trainer.py"))


def _train() -> tuple[torch.nn.Module, torch.optim.Optimizer, list[float]]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    losses = []
    for step in range(1, STEPS + 1):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(8, 4, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), x[:, :3] * 3.0)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return model, optimizer, losses


def _history(steps):
    return [{"step": s, "attempt": 0 if s <= 2 else 1} for s in steps]


def _results(path: Path, *, losses=None, history=None, tweak=None) -> dict:
    """The results file of a training run, as the verifier reads it; `tweak(model, optimizer)`
    changes the final state before it is digested."""
    model, optimizer, trained = _train()
    if tweak is not None:
        with torch.no_grad():
            tweak(model, optimizer)
    losses = trained if losses is None else losses
    history = _history(range(1, STEPS + 1)) if history is None else history
    write_results(path, losses=losses, model=model, optimizer=optimizer, steps=len(losses),
                  extra={"history": history})
    return read_results(path)


@pytest.fixture
def reference(tmp_path):
    return _results(tmp_path / "reference.json")


def _one_ulp_up(t: torch.Tensor) -> None:
    """The first element of `t` moved to the next representable value."""
    flat = t.view(-1)
    flat[0] = torch.nextafter(flat[0], torch.tensor(math.inf, dtype=t.dtype))


def _assert_only_failed(comparison, failed: set[str]) -> None:
    assert not comparison.equal, comparison
    assert set(comparison.checks) == CHECKS, comparison.checks
    assert {name for name, ok in comparison.checks.items() if not ok} == failed, comparison
    assert comparison.problems


def test_the_same_run_twice_is_equal(tmp_path, reference):
    # The control: two separate trainings of one config are bitwise the same run.
    again = _results(tmp_path / "again.json")
    comparison = compare(again, reference)
    assert comparison.equal, comparison.problems
    assert comparison.checks == dict.fromkeys(CHECKS, True) and comparison.problems == []
    assert len(set(reference["losses"])) == STEPS  # a run that learns: no two steps alike


@pytest.mark.parametrize("direction", [math.inf, -math.inf], ids=["up", "down"])
def test_one_loss_one_ulp_off_is_not_equal(tmp_path, reference, direction):
    losses = list(reference["losses"])
    losses[2] = math.nextafter(losses[2], direction)
    faulted = _results(tmp_path / "faulted.json", losses=losses)
    assert faulted["losses"][2] == losses[2] != reference["losses"][2]  # the file kept the ulp
    assert abs(faulted["losses"][2] - reference["losses"][2]) == math.ulp(reference["losses"][2])
    comparison = compare(faulted, reference)
    _assert_only_failed(comparison, {"losses_bitwise"})
    assert "1 step(s) differ" in comparison.problems[0] and "index 2" in comparison.problems[0]


def test_a_doubled_step_is_not_equal(tmp_path, reference):
    # Step 3 applied twice (e.g. re-run after a restart without rolling back): its loss and
    # its history entry appear twice.
    losses = reference["losses"][:3] + reference["losses"][2:]
    steps = [1, 2, 3, 3, 4, 5]
    faulted = _results(tmp_path / "faulted.json", losses=losses, history=_history(steps))
    comparison = compare(faulted, reference)
    _assert_only_failed(comparison, {"losses_bitwise", "history_exact"})
    assert f"expected {STEPS} steps" in comparison.problems[0] and "found 6" in comparison.problems[0]
    assert "doubled [3], missing []" in comparison.problems[-1]


def test_a_missing_step_is_not_equal(tmp_path, reference):
    losses = reference["losses"][:2] + reference["losses"][3:]
    faulted = _results(tmp_path / "faulted.json", losses=losses, history=_history([1, 2, 4, 5]))
    comparison = compare(faulted, reference)
    _assert_only_failed(comparison, {"losses_bitwise", "history_exact"})
    assert "doubled [], missing [3]" in comparison.problems[-1]


@pytest.mark.parametrize("steps", [[1, 2, 3, 3, 5], [1, 2, 4, 3, 5]], ids=["doubled-for-missing", "reordered"])
def test_a_wrong_history_alone_is_not_equal(tmp_path, reference, steps):
    # Every loss and the final state as in the reference: the history check must catch it on its own.
    faulted = _results(tmp_path / "faulted.json", history=_history(steps))
    comparison = compare(faulted, reference)
    _assert_only_failed(comparison, {"history_exact"})


def test_a_missing_history_is_not_equal(tmp_path, reference):
    faulted = dict(reference)
    del faulted["history"]
    comparison = compare(faulted, reference)
    _assert_only_failed(comparison, {"history_exact"})


def test_one_model_tensor_one_ulp_off_is_not_equal(tmp_path, reference):
    faulted = _results(tmp_path / "faulted.json", tweak=lambda model, optimizer: _one_ulp_up(model.weight))
    comparison = compare(faulted, reference)
    _assert_only_failed(comparison, {"state_bitwise"})
    assert "1 tensor(s) differ: ['model.weight']" in comparison.problems[0]


def _adam_state(name):
    def tweak(model, optimizer):
        param = dict(model.named_parameters())[name.split(".")[0]]
        state = optimizer.state[param]
        key = name.split(".")[1]
        if key == "step":
            state["step"] += 1  # one update more
        else:
            _one_ulp_up(state[key])
    return tweak


def _learning_rate(model, optimizer):
    optimizer.param_groups[0]["lr"] = math.nextafter(optimizer.param_groups[0]["lr"], math.inf)


@pytest.mark.parametrize("tweak, differing", [
    (_adam_state("weight.exp_avg"), "optim.state.weight.exp_avg"),
    (_adam_state("bias.exp_avg_sq"), "optim.state.bias.exp_avg_sq"),
    (_adam_state("bias.step"), "optim.state.bias.step"),
    (_learning_rate, "optim.param_groups"),
], ids=["exp_avg", "exp_avg_sq", "step", "lr"])
def test_optimizer_state_differing_is_not_equal(tmp_path, reference, tweak, differing):
    # The model itself is the reference's: only the optimizer state would make the next step differ.
    faulted = _results(tmp_path / "faulted.json", tweak=tweak)
    comparison = compare(faulted, reference)
    _assert_only_failed(comparison, {"state_bitwise"})
    assert f"1 tensor(s) differ: [{differing!r}]" in comparison.problems[0]
    assert {k: v for k, v in faulted["state_digest"]["tensors"].items() if k.startswith("model.")} == \
        {k: v for k, v in reference["state_digest"]["tensors"].items() if k.startswith("model.")}


def test_a_state_digest_without_a_tensor_is_not_equal(reference):
    faulted = copy.deepcopy(reference)
    del faulted["state_digest"]["tensors"]["optim.state.weight.exp_avg"]
    faulted["state_digest"]["total"] = "0" * 64
    comparison = compare(faulted, reference)
    _assert_only_failed(comparison, {"state_bitwise"})
    assert "optim.state.weight.exp_avg" in comparison.problems[0]


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
    for a new fault-free run (stood in for here by writing its results file)."""
    runs = []

    def fake_run_job(job, plan, run_dir, **kwargs):
        runs.append(Path(run_dir))
        Path(run_dir).mkdir(parents=True, exist_ok=True)  # made empty for it (chaos.files.work_directory)
        (Path(run_dir) / RESULTS).write_text(f"run {len(runs)}\n")
        return JobOutcome(Path(run_dir), 0, 0, [0])

    monkeypatch.setattr(verify, "package_dirs", lambda: library_copy)
    monkeypatch.setattr(verify, "run_job", fake_run_job)
    job, root = Job(trainer=TOY), tmp_path / "references"
    first = ensure_reference(job, root)
    assert len(runs) == 1 and ensure_reference(job, root) == first and len(runs) == 1  # cached
    path = library_copy[1] / "comms.py"
    path.write_text(path.read_text() + "\n# a change\n")
    second = ensure_reference(job, root)
    assert len(runs) == 2 and second != first and (second / RESULTS).read_text() == "run 2\n"
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == sorted([first.name, second.name])
    assert second.name == reference_key(job, library_copy)


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
