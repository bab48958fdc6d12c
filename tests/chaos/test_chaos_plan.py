"""Fault plans: parsing, validation errors that name the field, random ranks, the ledger."""

import json

import pytest

from chaos.__main__ import main as cli
from chaos.harness import Job, run_job
from chaos.plan import (RESTART_MARGIN, FaultType, Ledger, PartitionOutcome, Plan, PlanError, Release, TriggerKind,
                        check_network, check_run, load_plan, parse_shorthand, partition_outcome)


def test_shorthand_yaml_and_json_give_the_same_plan(tmp_path):
    short = Plan((parse_shorthand("kill:rank=1,step=5"),
                  parse_shorthand("delay:rank=0,seq=12,op=all_reduce,comm=world,duration_s=2.5"),
                  parse_shorthand("hang:rank=1,p=0.25,seed=7,count=2,release=cont")))
    (tmp_path / "plan.yaml").write_text(
        "faults:\n"
        "  - {type: kill, rank: 1, step: 5}\n"
        "  - {type: delay, rank: 0, seq: 12, op: all_reduce, comm: world, duration_s: 2.5}\n"
        "  - {type: hang, rank: 1, p: 0.25, seed: 7, count: 2, release: cont}\n")
    short.save(tmp_path / "plan.json")
    assert load_plan(tmp_path / "plan.yaml") == short
    assert load_plan(tmp_path / "plan.json") == short
    kill, delay, hang = short.faults
    assert (kill.type, kill.rank, kill.trigger.kind, kill.trigger.value) == (FaultType.KILL, 1, TriggerKind.STEP, 5)
    assert (delay.trigger.kind, delay.trigger.op, delay.trigger.comm, delay.duration_s) == \
        (TriggerKind.SEQ, "all_reduce", "world", 2.5)
    assert (hang.count, hang.seed, hang.release) == (2, 7, Release.CONT)
    assert short.restarts == 1 + 1 + 2 + RESTART_MARGIN  # one per possible firing, plus spares


def test_a_phase_filter_alone_acts_from_the_first_step_on():
    fault = parse_shorthand("delay:rank=1,phase=checkpoint")
    t = fault.trigger
    assert (t.kind, t.value, t.phase) == (TriggerKind.AFTER_S, 0.0, "checkpoint")
    assert fault.describe() == "delay rank 1 at after_s=0.0 phase=checkpoint (x1)"
    assert Plan.from_dict(Plan((fault,)).to_dict()).faults == (fault,)
    assert t.matches_call("all_gather", 7, "world", "checkpoint")
    assert not t.matches_call("all_gather", 7, "world", "forward")
    assert not t.matches_call("all_gather", 7, "world", None)  # outside any commlib.context


def test_the_cli_forms_of_the_new_kinds_parse_as_written():
    slow = parse_shorthand("straggler:rank=1,ms=300")
    assert (slow.rank, slow.ms, slow.trigger.kind, slow.trigger.value) == (1, 300.0, TriggerKind.AFTER_S, 0.0)
    later = parse_shorthand("straggler:rank=1,ms=300,step=4")
    assert (later.trigger.kind, later.trigger.value) == (TriggerKind.STEP, 4.0)
    corrupt = parse_shorthand("corrupt_checkpoint:step=10")
    assert (corrupt.type, corrupt.rank, corrupt.trigger.value) == (FaultType.CORRUPT_CHECKPOINT, 0, 10.0)
    assert Plan.from_dict(Plan((slow, later, corrupt)).to_dict()).faults == (slow, later, corrupt)


@pytest.mark.parametrize("text, field, words", [
    ("boom:rank=1,step=1", ".type", "expected type to be one of ['kill', "),
    ("kill:rank=1,step=-1", ".step", "expected step to be an integer in [0, 1e+15]; found -1"),
    ("kill:step=3", ".rank", "missing"),
    ("kill:rank=1", ".trigger", "found none"),
    ("kill:rank=1,step=2,after_s=3", ".trigger", "found ['step', 'after_s']"),
    ("kill:rank=1,seq=3", ".seq", "cannot be triggered by a collective sequence number"),
    ("kill:rank=1,step=1,op=all_reduce", ".op", "unknown field for a kill fault"),
    ("delay:rank=0,step=1,op=allreduce", ".op", "expected op to be one of ['all_reduce', "),
    ("kill:rank=1,phase=checkpoint", ".phase", "unknown field for a kill fault"),
    ("raise:rank=1,step=2,phase=3", ".phase",
     "expected phase to be a non-empty line of at most 1024 printable characters without spaces; found int 3"),
    ("hang:rank=0,p=1.5", ".p", "expected p to be a finite number <= 1 and > 0; found 1.5"),
    ("hang:rank=0,step=2,release=later", ".release", "expected release to be one of ['kill', 'cont']"),
    ("exit:rank=0,step=1,code=300", ".code", "[0, 255]"),
    ("raise:rank=0,step=1,count=0", ".count", "expected count to be an integer in [1, 1e+06]"),
    ("corrupt:rank=0,seq=0", ".seq", "expected seq to be an integer in [1, 1e+15]"),
    ("kill:rank=one,step=1", ".rank", "expected rank to be an integer in [0, 1e+15]; found 'one'"),
    ("kill:rank=1,step", "", "expected key=value pairs"),
    ("straggler:rank=1", ".ms", "missing; expected the milliseconds"),
    ("straggler:rank=1,ms=-5", ".ms", "expected ms to be a finite number of milliseconds <= 6.048e+08 and > 0"),
    ("straggler:rank=1,ms=50,count=2", ".count", "stays slow once it starts"),
    ("corrupt_checkpoint:step=4,ms=3", ".ms", "unknown field for a corrupt_checkpoint fault"),
    ("partition:rank=1,step=5", ".duration_s", "missing; expected how long the partition lasts"),
    ("partition:step=5,duration_s=3", ".rank", "missing"),
    ("partition:rank=1,seq=5,duration_s=3", ".seq", "cannot be triggered by a collective sequence number"),
    ("partition:rank=1,step=5,duration_s=0", ".duration_s",
     "expected duration_s to be a finite number of seconds <= 604800 and > 0"),
    ("partition:rank=1,step=5,duration_s=3,ms=4", ".ms", "unknown field for a partition fault"),
    ("net_delay:rank=1,step=5,duration_s=3", ".ms", "missing; expected the milliseconds added to each packet"),
    ("net_delay:rank=1,step=5,ms=20", ".duration_s", "missing"),
    ("net_delay:rank=1,step=5,ms=20,duration_s=3,pct=2", ".pct", "unknown field for a net_delay fault"),
    ("net_loss:rank=1,step=5,duration_s=3", ".pct", "missing; expected the percentage"),
    ("net_loss:rank=1,step=5,pct=0,duration_s=3", ".pct",
     "expected pct to be a finite number of percent <= 10 and > 0"),
    ("net_loss:rank=1,step=5,pct=30,duration_s=3", ".pct",
     "found 30 (more loss than TCP retransmits through within a deadline"),
])
def test_bad_faults_are_rejected_naming_the_field(text, field, words):
    with pytest.raises(PlanError) as info:
        parse_shorthand(text)
    assert info.value.field.startswith(f"--fault {text}")
    assert info.value.field.endswith(field)
    assert words in str(info.value)


def test_the_network_faults_parse_as_written_and_round_trip():
    cut = parse_shorthand("partition:rank=1,step=5,duration_s=3")
    assert (cut.type, cut.rank, cut.trigger.kind, cut.trigger.value, cut.duration_s) == \
        (FaultType.PARTITION, 1, TriggerKind.STEP, 5.0, 3.0)
    slow = parse_shorthand("net_delay:rank=0,step=2,ms=25,duration_s=2")
    lossy = parse_shorthand("net_loss:rank=1,after_s=4,pct=2.5,duration_s=2")
    assert (slow.ms, slow.pct, lossy.pct, lossy.ms) == (25.0, None, 2.5, None)
    assert all(f.type.external and f.type.network and not f.type.in_collective for f in (cut, slow, lossy))
    plan = Plan((cut, slow, lossy))
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan


def test_a_partition_is_either_survived_or_detected_never_in_between():
    # deadline 10 s: TCP may resume up to D + 0.2 s after the link is back, plus 1 s of slack
    assert partition_outcome(3, 10) is PartitionOutcome.SURVIVED
    assert partition_outcome(4.4, 10) is PartitionOutcome.SURVIVED
    assert partition_outcome(4.5, 10) is None
    assert partition_outcome(10.5, 10) is None
    assert partition_outcome(11, 10) is PartitionOutcome.DETECTED


@pytest.mark.parametrize("fault, topology, field, words", [
    ("partition:rank=1,step=5,duration_s=3", {"nnodes": 1}, ".type", "expected a job of --nnodes >= 2; found 1"),
    ("net_loss:rank=1,step=5,pct=2,duration_s=3", {"local": False}, ".type", "found one node of a multi-node job"),
    ("net_delay:rank=1,step=5,ms=5,duration_s=3", {"backend": "nccl"}, ".type", "needs the gloo backend"),
    ("partition:rank=1,step=5,duration_s=6", {}, ".duration_s",
     "survived (at most 4.4 s: TCP may resume only 6 + 0.2 s after the link is back) or detected (at least 11 s) "
     "with the collective deadline of 10 s; found 6 s"),
    ("net_delay:rank=1,step=5,ms=600,duration_s=3", {}, ".ms", "so at most 500 ms; found 600"),
])
def test_network_faults_are_checked_against_the_job(fault, topology, field, words):
    plan = Plan((parse_shorthand("kill:rank=0,step=1"), parse_shorthand(fault)))
    job = {"nnodes": 2, "local": True, "backend": "gloo", "deadline_s": 10.0, **topology}
    with pytest.raises(PlanError) as info:
        check_network(plan, **job)
    assert info.value.field == f"faults[1]{field}"
    assert words in str(info.value)
    if not topology:  # a length the deadline refuses: without a known deadline only the topology is checked
        check_network(plan, **{**job, "deadline_s": None})


def test_run_job_refuses_a_network_fault_before_starting_anything(tmp_path):
    plan = Plan((parse_shorthand("partition:rank=1,step=5,duration_s=3"),)).resolve(2)
    run_dir = tmp_path / "run"
    with pytest.raises(PlanError, match=r"faults\[0\]\.type: .*expected a job of --nnodes >= 2; found 1"):
        run_job(Job(trainer_args=("--steps", "8", "--timeout", "10")), plan, run_dir)
    with pytest.raises(PlanError, match=r"faults\[0\]\.duration_s: .*deadline of 10 s; found 6 s"):
        run_job(Job(nproc_per_node=1, nnodes=2, trainer_args=("--steps", "8", "--timeout", "10")),
                Plan((parse_shorthand("partition:rank=1,step=5,duration_s=6"),)), run_dir)
    assert not run_dir.exists()


def test_rank_is_checked_against_the_world_size_and_random_is_drawn_once():
    plan = Plan((parse_shorthand("kill:rank=2,step=3"),))
    assert plan.resolve(4).faults[0].rank == 2
    with pytest.raises(PlanError, match=r"faults\[0\]\.rank: expected an int in \[0, 2\).*found 2"):
        plan.resolve(2)
    randoms = Plan((parse_shorthand("kill:rank=random,seed=3,step=3"), parse_shorthand("hang:rank=random,step=5")))
    first, second = randoms.resolve(4), randoms.resolve(4)
    assert first == second and all(0 <= f.rank < 4 for f in first.faults)


def test_bad_plan_documents_name_the_field(tmp_path):
    with pytest.raises(PlanError, match="faults: missing"):
        Plan.from_dict({})
    with pytest.raises(PlanError, match=r"faults\[1\]\.type: missing"):
        Plan.from_dict({"faults": [{"type": "kill", "rank": 0, "step": 1}, {"rank": 0}]})
    with pytest.raises(PlanError, match="unknown plan field"):
        Plan.from_dict({"faults": [], "restarts": 3})
    (tmp_path / "bad.yaml").write_text("faults: [unclosed\n")
    with pytest.raises(PlanError, match="could not parse"):
        load_plan(tmp_path / "bad.yaml")


def test_cli_rejects_a_bad_plan_before_starting_anything(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert cli(["run", "--run-dir", str(run_dir), "--fault", "kill:rank=2,step=1"]) == 2
    assert "faults[0].rank" in capsys.readouterr().err
    assert cli(["run", "--run-dir", str(run_dir), "--trainer", "no_such.trainer"]) == 2
    assert "expected a script file or an importable module" in capsys.readouterr().err
    assert not run_dir.exists()


@pytest.mark.parametrize("args, field, words", [
    # The default run: 30 steps, collective deadline 10 s, job timeout 900 s.
    (["--fault", "straggler:rank=1,ms=999999"], "faults[0].ms", "under the collective deadline of 10 s"),
    (["--job-timeout", "60", "--fault", "straggler:rank=1,ms=5000,step=11"], "faults[0].ms",
     "5000 ms before each collective of 20 step(s) adds 100 s at least; found that past the job's timeout of 60 s"),
    (["--fault", "kill:rank=1,rank=0,step=5"], "--fault kill:rank=1,rank=0,step=5.rank", "given twice (1, then 0)"),
    (["--fault", "kill:rank=1,after_s=inf"], "--fault kill:rank=1,after_s=inf.after_s",
     "expected after_s to be a finite number"),
    (["--fault", "kill:rank=1,after_s=nan"], "--fault kill:rank=1,after_s=nan.after_s",
     "expected after_s to be a finite number"),
    (["--fault", "kill:rank=1,after_s=-2"], "--fault kill:rank=1,after_s=-2.after_s",
     "expected after_s to be a finite number of seconds in [0, 604800]; found -2"),
    (["--fault", "hang:rank=1,after_s=900"], "faults[0].after_s", "before the job's timeout of 900 s"),
    (["--fault", "kill:rank=1,step=31"], "faults[0].step", "at most 30, its last step); found 31"),
    (["--fault", "kill:rank=1,step=0"], "faults[0].step", "(from 1, at most 30, its last step); found 0"),
    (["--fault", "kill:rank=1,step=5", "--", "--steps", "4"], "faults[0].step", "at most 4"),
])
def test_cli_refuses_a_fault_that_never_fires_or_never_finishes(tmp_path, capsys, args, field, words):
    run_dir = tmp_path / "run"
    assert cli(["run", "--run-dir", str(run_dir), *args]) == 2
    err = capsys.readouterr().err
    assert f"{field}: " in err and words in err, err
    assert not run_dir.exists()


def test_cli_refuses_a_run_dir_or_timeout_it_cannot_use(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    assert cli(["run", "--run-dir", str(afile)]) == 2
    assert f"--run-dir {afile}: expected a new or empty directory; found a file" in capsys.readouterr().err
    assert cli(["run", "--run-dir", str(afile / "run")]) == 2
    assert f"expected a directory to create it in; found {afile}, a file" in capsys.readouterr().err
    assert afile.read_text() == "not a directory"
    for bad in ("inf", "nan", "-5", "0"):
        with pytest.raises(SystemExit) as exited:
            cli(["run", "--run-dir", str(tmp_path / "run"), "--job-timeout", bad])
        assert exited.value.code == 2
        assert "argument --job-timeout: expected --job-timeout to be a finite number of seconds <= 604800 and > 0" \
            in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_the_same_field_twice_in_a_plan_file_is_refused(tmp_path):
    (tmp_path / "plan.yaml").write_text("faults:\n  - {type: kill, rank: 1, step: 5}\n"
                                        "  - {type: kill, rank: 1, rank: 0, step: 5}\n")
    with pytest.raises(PlanError, match=r"plan\.yaml:3\.rank: given twice \(1, then 0\)"):
        load_plan(tmp_path / "plan.yaml")
    (tmp_path / "plan.json").write_text('{"faults": [{"type": "kill", "rank": 1, "step": 5, "step": 6}]}')
    with pytest.raises(PlanError, match=r"plan\.json\.step: given twice \(5, then 6\)"):
        load_plan(tmp_path / "plan.json")


def test_run_job_refuses_a_step_past_the_run_before_starting_anything(tmp_path):
    run_dir = tmp_path / "run"
    with pytest.raises(PlanError, match=r"faults\[0\]\.step: expected a step the run reaches \(from 1, at most 8"):
        run_job(Job(trainer_args=("--steps", "8")), Plan((parse_shorthand("kill:rank=1,step=9"),)).resolve(2),
                run_dir)
    assert not run_dir.exists()


def test_cli_rejects_a_network_fault_the_job_cannot_have(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert cli(["run", "--run-dir", str(run_dir), "--fault", "partition:rank=1,step=2,duration_s=3"]) == 2
    assert "faults[0].type" in (err := capsys.readouterr().err) and "--nnodes >= 2" in err, err
    # Checked against the deadline of the run it would start (the default trainer arguments': 10 s),
    # where 7 s may be survived or detected.
    assert cli(["run", "--run-dir", str(run_dir), "--nnodes", "2", "--nproc-per-node", "1",
                "--fault", "partition:rank=1,step=2,duration_s=7"]) == 2
    assert "faults[0].duration_s" in (err := capsys.readouterr().err) and "deadline of 10 s" in err, err
    assert not run_dir.exists()


def test_probability_trigger_is_reproducible():
    trigger = parse_shorthand("kill:rank=0,p=0.3").trigger
    draws = [trigger.draw(seed=1, index=0, attempt=0, step=s) for s in range(400)]
    assert draws == [trigger.draw(seed=1, index=0, attempt=0, step=s) for s in range(400)]
    assert 80 < sum(draws) < 160
    assert draws != [trigger.draw(seed=2, index=0, attempt=0, step=s) for s in range(400)]


def test_ledger_counts_firings_across_restarts(tmp_path):
    fault = parse_shorthand("exit:rank=1,step=3,count=2")
    # Each Ledger stands for a new process after a restart: the count holds across them.
    first = Ledger(tmp_path).claim(fault, 0, attempt=0, step=3, pid=11)
    second = Ledger(tmp_path).claim(fault, 0, attempt=1, step=3, pid=12)
    assert (first.n, second.n) == (1, 2)
    assert Ledger(tmp_path).claim(fault, 0, attempt=2, step=3) is None
    fired = Ledger(tmp_path).firings()
    assert [(f.n, f.attempt, f.detail["pid"]) for f in fired] == [(1, 0, 11), (2, 1, 12)]
    assert json.loads((tmp_path / "fault0.1.json").read_text())["type"] == "exit"


BIG = "1" + "0" * 400  # past any bound, and past a float: float() of it overflows
# The fault each field is tried on, and what its refusal says.
_NUMERIC_FIELDS = {
    "step": ("kill:rank=1", "expected step to be an integer in [0, 1e+15]"),
    "seq": ("delay:rank=1", "expected seq to be an integer in [1, 1e+15]"),
    "after_s": ("kill:rank=1", "expected after_s to be a finite number of seconds in [0, 604800]"),
    "p": ("kill:rank=1", "expected p to be a finite number <= 1 and > 0"),
    "duration_s": ("delay:rank=1,step=3", "expected duration_s to be a finite number of seconds <= 604800 and > 0"),
    "ms": ("straggler:rank=1", "expected ms to be a finite number of milliseconds <= 6.048e+08 and > 0"),
    "pct": ("net_loss:rank=1,step=3,duration_s=2", "expected pct to be a finite number of percent <= 10 and > 0"),
    "count": ("kill:rank=1,step=3", "expected count to be an integer in [1, 1e+06]"),
    "seed": ("kill:rank=1,step=3", "expected seed to be an integer in [0, 1e+15]"),
    "rank": ("kill:step=3", "expected rank to be an integer in [0, 1e+15]"),
    "code": ("exit:rank=1,step=3", "expected code to be an integer in [0, 255]"),
}


def _plan_files(tmp_path, shorthand):
    """The fault of `shorthand` as a JSON and as a YAML plan file, numbers written as numbers."""
    kind, _, rest = shorthand.partition(":")
    pairs = [("type", kind)] + [tuple(p.split("=", 1)) for p in rest.split(",")]
    (tmp_path / "plan.json").write_text('{"faults": [{' + ", ".join(
        f'"{k}": {v}' if k != "type" and not v.isalpha() else f'"{k}": "{v}"' for k, v in pairs) + "}]}")
    (tmp_path / "plan.yaml").write_text("faults:\n  - {" + ", ".join(f"{k}: {v}" for k, v in pairs) + "}\n")
    return tmp_path / "plan.json", tmp_path / "plan.yaml"


@pytest.mark.parametrize("value", [BIG, "1e308", "-" + BIG])
@pytest.mark.parametrize("field", sorted(_NUMERIC_FIELDS))
def test_a_number_past_its_bounds_is_refused_naming_the_field_on_the_cli_and_in_files(tmp_path, field, value):
    base, words = _NUMERIC_FIELDS[field]
    shorthand = f"{base},{field}={value}"
    with pytest.raises(PlanError) as info:
        parse_shorthand(shorthand)
    assert info.value.field == f"--fault {shorthand}.{field}" and words in str(info.value), info.value
    for path in _plan_files(tmp_path, shorthand):
        with pytest.raises(PlanError) as info:
            load_plan(path)
        assert info.value.field == f"faults[0].{field}" and words in str(info.value), (path, info.value)


def test_max_restarts_and_the_firings_in_all_are_bounded_wherever_a_plan_gets_them():
    with pytest.raises(PlanError, match=r"max_restarts: expected max_restarts to be an integer in \[0, 1e\+06\]"):
        Plan.from_dict({"faults": [], "max_restarts": 10**30})
    with pytest.raises(PlanError, match=r"max_restarts: expected max_restarts to be an integer"):
        Plan((), 10**30)
    many = parse_shorthand("kill:rank=1,p=0.5,count=600000")
    with pytest.raises(PlanError, match=r"faults: expected at most 1000000 firings in all .*; found 1200000"):
        Plan((many, many))
    with pytest.raises(PlanError, match=r"1: unknown plan field"):  # unknown keys of two types
        Plan.from_dict({"faults": [], 1: 2, "x": 3})


@pytest.mark.parametrize("fault", ["delay:rank=1,step=3,duration_s=100", "gil:rank=1,step=3,duration_s=61",
                                   "hang:rank=1,step=3,duration_s=60,release=cont",
                                   "disk_full:step=3,duration_s=90", "partition:rank=1,step=3,duration_s=70"])
def test_a_fault_that_lasts_past_the_job_timeout_is_refused(fault):
    plan = Plan((parse_shorthand(fault),))
    with pytest.raises(PlanError, match=r"faults\[0\]\.duration_s: expected a duration the job can hold: under "
                                        r"the job's timeout of 60 s \(--job-timeout\)"):
        check_run(plan, steps=None, deadline_s=None, timeout_s=60.0)
    check_run(plan, steps=None, deadline_s=None, timeout_s=600.0)


def test_a_plan_nested_too_deep_or_too_large_is_refused_at_once(tmp_path):
    (tmp_path / "deep.yaml").write_text("faults: " + "[" * 5000 + "]" * 5000 + "\n")
    (tmp_path / "deep.json").write_text('{"faults": ' + "[" * 5000 + "]" * 5000 + "}")
    (tmp_path / "shallow.json").write_text('{"faults": ' + "[" * 20 + "]" * 20 + "}")
    # Nested through aliases, each one level deeper than the last (the composer goes 5 deep), in a
    # rank, which the refusal of a rank quotes.
    (tmp_path / "aliased.yaml").write_text("faults:\n  - {type: kill, step: 1, rank: [&l0 [1], " + ", ".join(
        f"&l{i} [*l{i - 1}]" for i in range(1, 1500)) + "]}\n")
    for name in ("deep.yaml", "deep.json", "shallow.json", "aliased.yaml"):
        with pytest.raises(PlanError, match="expected a plan nested at most 16 deep"):
            load_plan(tmp_path / name)
    # One line of aliases to aliases: 9^9 values in a rank, which its refusal would spell out.
    (tmp_path / "laughs.yaml").write_text("faults:\n  - {type: kill, step: 1, rank: [&a [1, 1, 1, 1, 1, 1, 1, 1, 1], "
                                          + ", ".join(f"&{b} [{', '.join(['*' + a] * 9)}]"
                                                      for a, b in zip("abcdefgh", "bcdefghi")) + "]}\n")
    with pytest.raises(PlanError, match="expected a plan of at most 10000 values; found more"):
        load_plan(tmp_path / "laughs.yaml")


def test_a_yaml_merge_key_may_be_overridden_and_a_key_given_twice_still_may_not(tmp_path):
    (tmp_path / "plan.yaml").write_text("faults:\n"
                                        "  - &first {type: kill, rank: 1, step: 5}\n"
                                        "  - <<: *first\n"
                                        "    step: 7\n")
    first, second = load_plan(tmp_path / "plan.yaml").faults
    assert (second.type, second.rank, second.trigger.value, first.trigger.value) == (FaultType.KILL, 1, 7.0, 5.0)
    (tmp_path / "plan.yaml").write_text("faults:\n"
                                        "  - &first {type: kill, rank: 1, step: 5}\n"
                                        "  - <<: *first\n"
                                        "    step: 7\n"
                                        "    step: 8\n")
    with pytest.raises(PlanError, match=r"plan\.yaml:3\.step: given twice \(7, then 8\)"):
        load_plan(tmp_path / "plan.yaml")


def test_a_plan_path_that_is_not_a_file_says_what_it_is(tmp_path):
    with pytest.raises(PlanError, match="expected a YAML or JSON plan file; found a directory"):
        load_plan(tmp_path)
    with pytest.raises(PlanError, match="expected a YAML or JSON plan file; found no such file"):
        load_plan(tmp_path / "missing.yaml")
