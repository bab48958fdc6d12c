"""The in-rank injector on two real gloo ranks, without a trainer: corrupt and delay through commlib's hooks."""

import signal
import threading
import time

import pytest
import torch

import commlib
import commlib.testing
from chaos.fault import Fault, FaultType, Trigger, TriggerKind
from chaos.inject import SIGNAL_GRACE_S, Injector, _act
from chaos.plan import Ledger, Plan, parse_shorthand
from commlib.observe.events import read_events
from commlib.ops import Collective, OpName


def _ranks(comm, state_dir):
    plan = Plan((parse_shorthand("corrupt:rank=0,seq=1"),
                 parse_shorthand("delay:rank=1,seq=2,op=all_reduce,duration_s=2.5"))).resolve(comm.size)
    Injector(plan, comm.rank, Ledger(state_dir), time.time_ns(), attempt=0)
    t = torch.ones(4)
    comm.all_reduce(t)  # seq 1: rank 0's input becomes NaN, so the sum is NaN everywhere
    corrupted = bool(torch.isnan(t).all())
    try:
        comm.all_reduce(torch.ones(1), timeout=1.0)  # seq 2: rank 1 holds it past the deadline
        error = None
    except commlib.CollectiveTimeout as exc:
        error = ("CollectiveTimeout", exc.missing_ranks)
    except commlib.CommError as exc:
        error = (type(exc).__name__, None)
    return corrupted, error


def test_corrupt_and_delay_act_through_commlib_hooks(tmp_path):
    logs = tmp_path / "logs"
    results = commlib.testing.run(_ranks, world_size=2, timeout=60, args=(str(tmp_path / "state"),),
                                  log_dir=str(logs))
    assert [corrupted for corrupted, _ in results] == [True, True]
    # The peer of the delayed rank times out, and the progress board names the delayed rank.
    assert results[0][1] == ("CollectiveTimeout", [1])
    assert results[1][1] is not None  # the delayed rank finds its peer gone when it finally issues
    faults = {e["fault"]: e for r in (0, 1) for e in read_events(logs / f"rank{r}.jsonl")
              if e["event"] == "chaos.fault"}
    assert (faults["corrupt"]["rank"], faults["corrupt"]["seq"]) == (0, 1)
    assert (faults["delay"]["rank"], faults["delay"]["seq"], faults["delay"]["op"]) == (1, 2, "all_reduce")
    assert sorted((f.type, f.rank) for f in Ledger(tmp_path / "state").firings()) == [("corrupt", 0), ("delay", 1)]


def test_step_start_waits_for_the_harness_to_fire_an_external_fault(tmp_path):
    plan = Plan((parse_shorthand("hang:rank=0,step=2"),)).resolve(2)
    ledger = Ledger(tmp_path / "state")
    injector = Injector(plan, 0, ledger, time.time_ns(), attempt=0, external_wait_s=0.6)
    try:
        start = time.monotonic()
        injector.on_step_start(1)  # nothing planned at step 1: no wait
        assert time.monotonic() - start < 0.1

        start = time.monotonic()
        injector.on_step_start(2)  # nobody fires it: the rank gives up after external_wait_s
        assert 0.6 <= time.monotonic() - start < 1.5

        # The harness claims the firing 0.3 s in; the rank then waits out the signal grace.
        # (`start` first: the timer counts from its own start, which a loaded machine can delay.)
        start = time.monotonic()
        threading.Timer(0.3, lambda: ledger.claim(plan.faults[0], 0, attempt=0, step=2)).start()
        injector.on_step_start(2)
        assert 0.3 + SIGNAL_GRACE_S <= time.monotonic() - start < 0.6 + SIGNAL_GRACE_S + 0.5

        start = time.monotonic()
        injector.on_step_start(2)  # its count is spent: no wait
        assert time.monotonic() - start < 0.1
    finally:
        injector.close()


class _Alarm(Exception):
    pass


def _cpu_until_alarm(seconds, act):
    """Run `act()` until SIGALRM interrupts it after `seconds`; the CPU seconds this process
    used meanwhile. An `act` that returns or raises on its own fails the test."""
    def ring(signum, frame):
        raise _Alarm

    previous = signal.signal(signal.SIGALRM, ring)
    start = time.process_time()
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        act()
    except _Alarm:
        return time.process_time() - start
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    raise AssertionError(f"{act} returned before the alarm")


@pytest.mark.parametrize("fault", [
    Fault(FaultType.DELAY, 1, Trigger(TriggerKind.STEP, 3.0), duration_s=1e308),
    Fault(FaultType.DELAY, 1, Trigger(TriggerKind.STEP, 3.0)),  # held past a deadline of 1e308 s
    Fault(FaultType.STRAGGLER, 1, Trigger(TriggerKind.STEP, 3.0), ms=1e308),
    Fault(FaultType.GIL, 1, Trigger(TriggerKind.STEP, 3.0), duration_s=1e308),
])
def test_a_hold_too_long_for_the_clock_still_holds_and_sleeps(fault):
    """The plan refuses such values; should one reach a rank anyway, the injector holds the
    collective (asleep: no CPU) instead of raising out of it, which would be another fault."""
    call = Collective(OpName.ALL_REDUCE, "world", 1, 2, False, 1e308)
    assert _cpu_until_alarm(0.5, lambda: _act(fault, call, 1, 3)) < 0.02
