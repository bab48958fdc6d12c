"""The environment variables of commlib's observability, each read with `commlib.settings`' one
rule per kind: empty is unset, a number is finite and bounded, and a refusal names the variable.
(The SIGUSR1 thread that no failure makes spin is tested in test_flight.py, on a real rank.)"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from commlib import _torch_backend
from commlib.record import flight, log

# (variable, value, what the refusal says): every one names the variable and quotes the value.
REFUSED = [
    (log.MAX_MB_ENV, "inf", "COMMLIB_LOG_MAX_MB to be a finite number of MB in [0.01, 1e+06]; found 'inf'"),
    (log.MAX_MB_ENV, "1e400", "found '1e400'"),
    (log.MAX_MB_ENV, "1e-9", "found '1e-9'"),  # one file per line
    (log.MAX_MB_ENV, "nan", "found 'nan'"),
    (log.MAX_MB_ENV, "-1", "found '-1'"),
    (log.KEEP_ENV, "-1", "COMMLIB_LOG_KEEP to be an integer in [0, 10000]; found '-1'"),
    (log.KEEP_ENV, "2.5", "found '2.5'"),
    (log.KEEP_ENV, "9" * 400, "COMMLIB_LOG_KEEP to be an integer"),
    (flight.SIZE_ENV, "abc", "COMMLIB_FLIGHT_RECORDER_SIZE to be an integer in [1, 100000]; found 'abc'"),
    (flight.SIZE_ENV, "0", "found '0'"),
    (flight.DUMPS_ENV, "0", "COMMLIB_FLIGHT_DUMPS to be an integer in [1, 10000]; found '0'"),
    (flight.INTERVAL_ENV, "inf", "COMMLIB_FLIGHT_DUMP_INTERVAL_S to be a finite number of seconds in [0, 3600]; "
                                 "found 'inf'"),
    (flight.INTERVAL_ENV, "1e300", "found '1e300'"),
    (flight.INTERVAL_ENV, "-0.5", "found '-0.5'"),
    (flight.STACKS_ENV, "maybe", "COMMLIB_FLIGHT_RECORDER_STACKS to be 1 or 0; found 'maybe'"),
    (_torch_backend.BACKFILL_ENV, "2", "COMMLIB_BACKFILL to be 1 or 0; found '2'"),
]


def _read_all() -> None:
    log.budget()
    flight.FlightRecorder("probe", 0).close()
    flight.dump_budget()
    _torch_backend.backfill_asked()


@pytest.mark.parametrize(("name", "value", "says"), REFUSED)
def test_a_bad_value_is_refused_naming_its_variable(monkeypatch: pytest.MonkeyPatch, name: str, value: str,
                                                    says: str) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match="expected .*" + re.escape(says)):
        _read_all()


def test_an_empty_variable_is_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (log.MAX_MB_ENV, log.KEEP_ENV, flight.SIZE_ENV, flight.DUMPS_ENV, flight.INTERVAL_ENV,
                 flight.STACKS_ENV, _torch_backend.BACKFILL_ENV, log.LOG_DIR_ENV):
        monkeypatch.setenv(name, "")
    _read_all()
    assert log.budget() == (int(log.DEFAULT_MAX_MB * 1e6), log.DEFAULT_KEEP)
    recorder = flight.FlightRecorder("probe", 0)
    assert (recorder.capacity, recorder.with_stacks) == (flight.DEFAULT_SIZE, False)
    recorder.close()
    assert flight.dump_budget() == (flight.DEFAULT_DUMPS, flight.DEFAULT_INTERVAL_S)
    assert not _torch_backend.backfill_asked()
    assert log.configure(0, 1) is None  # no log dir: stderr


def test_a_log_dir_that_cannot_hold_logs_is_refused_naming_where_it_came_from(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    monkeypatch.setenv(log.LOG_DIR_ENV, str(a_file))
    with pytest.raises(ValueError, match=f"expected COMMLIB_LOG_DIR to be a directory where rank 0 can write its "
                                         f"log; found {a_file}"):
        log.configure(0, 1)
    os.mkfifo(tmp_path / "rank0.jsonl")  # opened to append, a FIFO would wait for a reader
    with pytest.raises(ValueError, match="expected log_dir to be a directory where rank 0 can write its log; "
                                         ".*rank0.jsonl: expected a regular file; found a FIFO"):
        log.configure(0, 1, tmp_path)
    with pytest.raises(ValueError, match="expected log_dir to be a directory; found ''"):
        log.configure(0, 1, "")
