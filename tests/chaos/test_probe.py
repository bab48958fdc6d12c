"""The step probe (`chaos.probe`) in one process: what it counts as a step and how it numbers
it, what each record holds, and that its digests see one ulp of any part of the state."""

import copy
import math

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict

from chaos.comparison import read_steps
from chaos.probe import StepProbe, optim_digest, params_digest
from commlib.record import log
from commlib.observe.events import read_events


@pytest.fixture
def probed(tmp_path):
    """A probe installed in this process, logging to `tmp_path`/logs; removed after the test."""
    log.configure(0, 1, tmp_path / "logs")
    backward = torch.autograd.backward
    probe = StepProbe().install()
    yield probe
    probe.remove()
    log.release()
    assert torch.autograd.backward is backward  # the wrapper is gone with the probe


def _model_and_optimizer(kind=torch.optim.Adam):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    return model, kind(model.parameters(), lr=0.1)


def _step(model, optimizer, step, micro_batches=1):
    for micro in range(micro_batches):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(100 * step + micro))
        (model(x).square().mean() / micro_batches).backward()
    optimizer.step()
    optimizer.zero_grad()


def _events(tmp_path):
    return [e for e in read_events(tmp_path / "logs" / "rank0.jsonl") if e["event"].startswith(("chaos.", "train."))]


def test_a_resumed_optimizer_counts_on_from_its_own_step_count(probed, tmp_path):
    """Steps 1-2, then a new model and optimizer loaded from their state (as a resume does): its
    steps are 3 and 4, each announced at its first forward; DCP's zero-gradient step that makes
    an empty optimizer's state is no step."""
    model, optimizer = _model_and_optimizer()
    for step in (1, 2):
        _step(model, optimizer, step)
    saved = (model.state_dict(), optimizer.state_dict())
    model, optimizer = _model_and_optimizer()
    get_state_dict(model, optimizer)  # steps the empty optimizer once, with zero gradients
    model.load_state_dict(saved[0])
    optimizer.load_state_dict(saved[1])
    for step in (3, 4):
        _step(model, optimizer, step)
    events = [(e["event"], e.get("step")) for e in _events(tmp_path)]
    assert events == [("chaos.step", 1), ("train.probe", None), ("train.step", 1), ("chaos.step", 2),
                      ("train.step", 2), ("chaos.step", 3), ("train.step", 3), ("chaos.step", 4), ("train.step", 4)]
    steps = read_steps(tmp_path)
    assert steps.step_source == "optimizer" and steps.backend is None and steps.last_step == 4


def test_an_optimizer_without_a_step_count_is_counted_per_process(probed, tmp_path):
    model, optimizer = _model_and_optimizer(torch.optim.SGD)
    for step in (1, 2):
        _step(model, optimizer, step)
    steps = read_steps(tmp_path)
    assert steps.step_source == "count" and [r.step for r in steps.records[(0, 0)]] == [1, 2]


def test_a_step_of_several_backwards_holds_each_loss_and_all_its_data(probed, tmp_path):
    model, optimizer = _model_and_optimizer()
    _step(model, optimizer, 1, micro_batches=2)
    [record] = read_steps(tmp_path).records[(0, 0)]
    assert len(record.losses) == 2 and all(math.isfinite(float.fromhex(x)) for x in record.losses)
    assert (record.params, record.optim) == (params_digest(optimizer), optim_digest(optimizer))
    model, optimizer = _model_and_optimizer()
    model(torch.zeros(8, 4)).sum().backward()  # other data in the first micro-batch only
    _step(model, optimizer, 1)
    assert read_steps(tmp_path).records[(0, 0)][-1].data != record.data


@pytest.mark.parametrize("told", [True, False], ids=["told", "gradients-cleared"])
def test_a_failed_step_starts_over_with_nothing_of_its_failed_try(probed, tmp_path, told):
    """A failure in step 1, told (commlib's error, an injected fault: `restart_step`) or not (a
    peer's failure the trainer learned of: only its gradients cleared for the retry show it),
    then step 1 run again: announced again, and its record holds only the try that completed."""
    model, optimizer = _model_and_optimizer()
    model(torch.ones(8, 4)).sum().backward()
    if told:
        probed.restart_step()
    optimizer.zero_grad()
    _step(model, optimizer, 1)
    events = [(e["event"], e.get("step")) for e in _events(tmp_path) if e["event"] != "train.probe"]
    assert events == [("chaos.step", 1), ("chaos.step", 1), ("train.step", 1)]
    [record] = read_steps(tmp_path).records[(0, 0)]
    assert len(record.losses) == 1


def test_a_rollback_runs_its_steps_again_each_started_and_recorded_anew(probed, tmp_path):
    """Steps 1-2, then the state of step 1 put back in place (an in-job rollback after a failure
    the probe did not see: a save that failed after step 2): step 2 starts again, and its record
    is the first run's, bitwise."""
    model, optimizer = _model_and_optimizer()
    _step(model, optimizer, 1)
    saved = copy.deepcopy((model.state_dict(), optimizer.state_dict()))
    _step(model, optimizer, 2)
    model.load_state_dict(saved[0])
    optimizer.load_state_dict(saved[1])
    for step in (2, 3):
        _step(model, optimizer, step)
    events = [(e["event"], e.get("step")) for e in _events(tmp_path) if e["event"] != "train.probe"]
    assert events == [(name, step) for step in (1, 2, 2, 3) for name in ("chaos.step", "train.step")]
    records = read_steps(tmp_path).records[(0, 0)]
    assert [r.step for r in records] == [1, 2, 2, 3] and records[1] == records[2]


def test_a_forward_that_raised_inside_leaves_the_next_one_outermost(probed, tmp_path):
    """A forward that raised in a nested module (a collective timing out inside FSDP's hook), then
    the step run again: its data is the try that completed, as in a run where nothing raised."""
    model, optimizer = _model_and_optimizer()
    raising = model[1].register_forward_pre_hook(lambda module, args: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        model(torch.ones(8, 4))
    raising.remove()
    _step(model, optimizer, 1)
    clean_model, clean_optimizer = _model_and_optimizer()
    _step(clean_model, clean_optimizer, 1)
    records = read_steps(tmp_path).records
    assert records[(0, 0)][0].data == records[(0, 1)][0].data is not None


def _ulp(t: torch.Tensor) -> None:
    t.view(-1)[0] = torch.nextafter(t.view(-1)[0], torch.tensor(math.inf))


@pytest.mark.parametrize("change, digest", [
    (lambda m, o: _ulp(m[0].weight.data), params_digest),
    (lambda m, o: _ulp(o.state[m[2].bias]["exp_avg"]), optim_digest),
    (lambda m, o: _ulp(o.state[m[0].weight]["exp_avg_sq"]), optim_digest),
    (lambda m, o: o.state[m[0].bias]["step"].add_(1), optim_digest),
    (lambda m, o: o.param_groups[0].__setitem__("lr", math.nextafter(0.1, 1.0)), optim_digest),
], ids=["weight", "exp_avg", "exp_avg_sq", "step", "lr"])
def test_a_digest_sees_one_ulp_of_any_part_of_the_state(change, digest):
    model, optimizer = _model_and_optimizer()
    _step(model, optimizer, 1)
    before = (params_digest(optimizer), optim_digest(optimizer))
    assert before == (params_digest(optimizer), optim_digest(optimizer))
    with torch.no_grad():
        change(model, optimizer)
    after = (params_digest(optimizer), optim_digest(optimizer))
    changed = {name for name, a, b in zip(("params", "optim"), before, after) if a != b}
    assert changed == {"params" if digest is params_digest else "optim"}
