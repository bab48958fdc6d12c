"""A collective's start and end decoded typed (`commlib.observe.typed`): exactly the lines the
writer writes, read back as the dicts they are; every other line left to the general path."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from commlib.observe.builder import Context, Unplaceable
from commlib.observe.reading import _fold_collectives
from commlib.observe.records import FileReport
from commlib.observe.typed import CollectiveLine, decode_collective, decode_collectives
from commlib.record import log
from doctor_logs import Job


def _written(tmp_path: Path, **context: object) -> list[bytes]:
    """The lines commlib's own writer writes for a collective, an async one and a send."""
    log.configure(0, 2, str(tmp_path))
    try:
        writer = log.event_writer(comm="world", backend="gloo", comm_rank=0, comm_size=2)
        with log.context(**context):
            writer.info("collective.start", {"op": "all_reduce", "seq": 3, "shapes": [[4, 8]], "dtype": "torch.float32",
                                             "bytes": 128, "root": None, "peer": None, "deadline_s": 30,
                                             "async_op": True, "reduce_op": "sum"})
            writer.info("collective.end", {"op": "all_reduce", "seq": 3, "bytes": 128, "peer": None,
                                           "duration_s": 0.25, "status": "ok", "wait_s": 0.01,
                                           "done_before_wait": False})
            writer.info("collective.start", {"op": "send", "seq": 1, "shapes": [[2]], "dtype": "torch.float32",
                                             "bytes": 8, "root": None, "peer": 1, "deadline_s": 30.0,
                                             "async_op": False, "reduce_op": None})
    finally:
        log.configure(0, 2, None)
    return (tmp_path / "rank0.jsonl").read_bytes().splitlines(keepends=True)[1:]


def test_the_writers_lines_decode_typed_and_read_as_the_dicts_they_are(tmp_path: Path) -> None:
    start, end, send = _written(tmp_path, step=7, phase="forward", label="eager")
    for raw in (start, end):
        line = decode_collective(raw)
        assert type(line) is CollectiveLine
        as_dict = orjson.loads(raw)
        assert line.to_dict() == as_dict
        assert list(line.to_dict()) == list(as_dict)  # the writer's order is the struct's
        assert {k: line.get(k) for k in as_dict} == as_dict
        assert all(line[k] == v and k in line for k, v in as_dict.items())
    start_line = decode_collective(start)
    assert start_line is not None
    assert start_line.deadline_s == 30 and type(start_line.deadline_s) is int  # as JSON says: not made a float
    assert start_line.get("duration_s", "absent") == "absent" and "duration_s" not in start_line
    assert start_line.get("root", "absent") is None and "root" in start_line  # null is not absent
    with pytest.raises(KeyError):
        start_line["error"]
    assert decode_collective(send) is None  # a send's peer is a rank: the general path pairs it


@pytest.mark.parametrize(
    "line",
    [
        b'{"op":"all_reduce","seq":1,"my_field":2,"event":"collective.start","ts_ns":5,"comm":"w","rank":0,"pid":1,"attempt":0}\n',
        b'{"op":"all_reduce","seq":1,"event":"collective.timeout","ts_ns":5,"comm":"w","rank":0,"pid":1,"attempt":0}\n',
        b'{"op":"all_reduce","seq":1,"event":"collective.end","level":"error","ts_ns":5,"comm":"w","rank":0,"pid":1,"attempt":0}\n',
        b'{"op":"all_reduce","seq":"1","event":"collective.end","ts_ns":5,"comm":"w","rank":0,"pid":1,"attempt":0}\n',
        b'{"op":"all_reduce","seq":1,"event":"collective.end","ts_ns":5.0,"comm":"w","rank":0,"pid":1,"attempt":0}\n',
        b'{"op":"all_reduce","seq":1,"event":"collective.end","ts_ns":5,"comm":"w","pid":1,"attempt":0}\n',
        b'{"op":"all_reduce","seq":1,"event":"collective.end","ts_ns":5,"comm":"w","rank":0,"pid":1,"attempt":null}\n',
        b'{"event":"comm.init","comm":"w","backend":"gloo","ts_ns":5,"rank":0,"pid":1,"attempt":0}\n',
        b'{"op":"all_reduce","seq":1,"event":"collective.st',
        b"not json\n",
    ],
    ids=["a caller's own field", "another event", "a notice", "a seq not an integer", "a clock not an integer",
         "no rank", "no attempt", "not a collective's", "cut short", "garbled"],
)
def test_any_other_line_is_left_to_the_general_path(line: bytes) -> None:
    assert decode_collective(line) is None


def test_a_chunk_is_typed_only_where_each_of_its_lines_is_one_line_of_one_collective(tmp_path: Path) -> None:
    start, end, _ = _written(tmp_path)
    assert decode_collectives([start, end, start]) == [decode_collective(start), decode_collective(end),
                                                       decode_collective(start)]
    assert decode_collectives([start, b'{"event":"comm.init","ts_ns":1}\n']) is None
    # Two objects written on one line, or one written across two: not as many items as lines.
    # Only the count tells (each is valid JSON within the array); the chunk is then read line
    # by line, where neither line is one line of one collective.
    two_on_one = start.rstrip(b"\n") + b"," + end
    one_on_two = [start[: start.index(b',"event"')] + b"\n", start[start.index(b',"event"') + 1 :]]
    for lines in ([two_on_one], one_on_two, [start, two_on_one, end], [*one_on_two, end]):
        assert orjson.loads(b"[" + b",".join(lines) + b"]")
        assert decode_collectives(lines) is None
    assert decode_collective(two_on_one) is None
    assert decode_collective(one_on_two[0]) is None and decode_collective(one_on_two[1]) is None


def test_a_typed_line_the_fold_refuses_is_counted_as_not_read_and_the_run_goes_on(tmp_path: Path) -> None:
    start, end, _ = _written(tmp_path)
    lines = decode_collectives([start, end, start, end])
    assert lines is not None
    folded: list[object] = []

    def add_collective(line: CollectiveLine, context: Context) -> None:
        if len(folded) == 1 and line is lines[1]:
            folded.append("refused")
            raise Unplaceable("not of commlib's writing")
        folded.append(line)

    report = FileReport("rank0.jsonl", 0)
    report.events = 4
    _fold_collectives(add_collective, lines, Context(0), report)  # type: ignore[arg-type]
    assert folded == [lines[0], "refused", lines[2], lines[3]]
    assert (report.events, report.garbled) == (3, 1)


def test_where_msgspec_is_not_installed_the_doctor_says_the_same_reading_every_line_as_a_dict(tmp_path: Path) -> None:
    job = Job(tmp_path / "logs", size=3)
    for rank in range(3):
        job.start(rank, "node0", 100 + rank)
        job.comm(rank)
    for seq in range(1, 12):
        for rank in range(3):
            if not (seq == 11 and rank == 2):  # rank 2 never starts the last one
                job.collective(rank, seq, end=seq < 11, step=seq, phase="forward")
    doctor = ("import sys, runpy; sys.argv = ['commlib-doctor', *sys.argv[1:]]; "
              "runpy.run_module('commlib.doctor', run_name='__main__')")
    blocked = "import sys; sys.modules['msgspec'] = None; " + doctor  # `import msgspec` raises ImportError
    said = [subprocess.run([sys.executable, "-c", code, str(job.directory), "--json"], capture_output=True, text=True)
            for code in (doctor, blocked)]
    assert said[0].returncode == 1 and said[0].stdout and said[0].stderr == ""
    assert said[1].stdout == said[0].stdout and said[1].returncode == said[0].returncode
    [attempt] = json.loads(said[0].stdout)["attempts"]
    assert (attempt["culprits"], attempt["collectives"]) == ([2], 11)  # the hang, and every seq counted
