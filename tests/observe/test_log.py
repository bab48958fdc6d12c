"""commlib's log is its own: the host application's structlog configuration survives
`commlib.init` and every `log.configure`, and re-pointing the log leaks no file descriptor.
Each test runs in a process of its own (the log's state is process-wide)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import structlog
import torch
import torch.distributed as dist

import commlib
from commlib import testing
from commlib.observe.events import read_events
from commlib.record import log

RECONFIGURES = 50


def _host_app(host_log: str, log_dir: str, other_dir: str) -> dict[str, Any]:
    host_file = open(host_log, "a", buffering=1)
    structlog.configure(
        processors=[structlog.processors.add_log_level, structlog.processors.JSONRenderer()],
        logger_factory=structlog.WriteLoggerFactory(file=host_file),
        cache_logger_on_first_use=False,
    )
    config = structlog.get_config()
    early = structlog.get_logger("host")  # bound before commlib exists
    early.info("host.before_init")
    store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), 1, is_master=False)
    comm = commlib.init("gloo", rank=0, world_size=1, store=store, log_dir=log_dir)
    comm.all_reduce(torch.ones(2))
    early.info("host.after_init")
    structlog.get_logger().info("host.new_logger", n=1)
    log.configure(0, 1, other_dir)  # re-pointing commlib's log leaves the host's alone too
    structlog.get_logger().info("host.after_reconfigure")
    comm.all_reduce(torch.ones(2))  # the communicator keeps its log (the dir of its creation)
    commlib.get_logger().info("app.via_commlib")  # commlib's logger, now in other_dir
    host_file.flush()
    return {"same_config": structlog.get_config() == config}


def test_host_structlog_configuration_survives_commlib(tmp_path: Path) -> None:
    host_log, logs, other = tmp_path / "host.log", tmp_path / "logs", tmp_path / "other"
    [out] = testing.run(_host_app, 1, backend=None, args=(str(host_log), str(logs), str(other)), timeout=120)
    host_events = [json.loads(line) for line in host_log.read_text().splitlines()]
    assert [e["event"] for e in host_events] == ["host.before_init", "host.after_init", "host.new_logger",
                                                 "host.after_reconfigure"], (
        "expected every host event in the host's own file, in the host's format; found "
        f"{[e['event'] for e in host_events]}")
    # The host's processors only: none of commlib's fields crept into its pipeline.
    assert all(set(e) <= {"event", "level", "n"} for e in host_events), host_events
    assert out["same_config"], "expected structlog's global configuration untouched by commlib"

    events = [e["event"] for e in read_events(logs / "rank0.jsonl")]
    assert "comm.init" in events and events.count("collective.end") == 2
    assert not [e for e in events if e.startswith("host.")], f"host events leaked into commlib's log: {events}"
    assert [e["event"] for e in read_events(other / "rank0.jsonl")] == ["app.via_commlib"]


def _reconfigure_many(root: str) -> dict[str, Any]:
    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    log.configure(0, 1, Path(root) / "d0")
    bound = log.get_logger(who="early")  # bound to d0's file before the log moves on
    bound.info("app.first")
    before = open_fds()
    for i in range(1, RECONFIGURES + 1):
        log.configure(0, 1, Path(root) / f"d{i}")
        log.get_logger().info("app.step", i=i)
    after = open_fds()
    bound.info("app.late")  # its descriptor is still its own: not closed, not reused
    log.configure(0, 1, None)  # stderr: every file written so far may now close
    del bound
    return {"before": before, "after": after, "at_end": open_fds()}


def test_reconfiguring_the_log_leaks_no_descriptor(tmp_path: Path) -> None:
    [out] = testing.run(_reconfigure_many, 1, backend=None, args=(str(tmp_path),), timeout=60)
    # d0's descriptor stays open for `bound`; at most the current file's is added.
    assert out["after"] <= out["before"] + 1, (
        f"expected at most one more open descriptor after {RECONFIGURES} log.configure calls; found "
        f"{out['after'] - out['before']} more")
    assert out["at_end"] <= out["before"] - 1, f"expected every log file closed once unused; found {out}"
    assert [(e["event"], e.get("who")) for e in read_events(tmp_path / "d0" / "rank0.jsonl")] == [
        ("app.first", "early"), ("app.late", "early")]
    for i in (1, 25, RECONFIGURES):
        assert [(e["event"], e["i"]) for e in read_events(tmp_path / f"d{i}" / "rank0.jsonl")] == [("app.step", i)]


def _both_paths(root: str) -> dict[str, Any]:
    log.configure(0, 2, Path(root))
    bound = {"comm": "world", "backend": "gloo", "comm_rank": 0, "comm_size": 2}
    fields = {"op": "all_reduce", "seq": 7, "shapes": [torch.Size([4, 2])], "dtype": "float32", "peer": None,
              "status": "ok"}
    # The caller's context, with keys the line owns (the process's rank, a bound field, the
    # level and a clock): the line's own values must win on both paths.
    with log.context(step=3, phase="backward", rank=99, comm="other", level="debug", ts_ns=0):
        log.get_logger(**bound).info("collective.end", **fields)
        log.event_writer(**bound).info("collective.end", dict(fields))
    log.configure(0, 2, None)  # stderr, INFO filtered out: the direct path must write nothing either
    log.event_writer(**bound).info("collective.end", dict(fields))
    return {"lines": (Path(root) / "rank0.jsonl").read_text().splitlines()}


def test_a_collectives_direct_event_path_writes_the_line_structlog_writes(tmp_path: Path) -> None:
    [out] = testing.run(_both_paths, 1, backend=None, args=(str(tmp_path),), timeout=60)
    header, via_structlog, direct = (json.loads(line) for line in out["lines"])  # and no fourth
    assert (header["event"], header["rank"], header["size"], header["pid"]) == ("log.open", 0, 2, direct["pid"])
    for event in (via_structlog, direct):
        assert event.pop("ts_ns") > 0 and event.pop("mono_ns") > 0
    # The direct path leaves out the field the communicator's other events carry (its backend);
    # its size stays, so that a log's last lines say who the members are (commlib.observe.verdict_from_end).
    assert via_structlog.pop("backend") == "gloo" and direct["comm_size"] == 2
    assert direct == via_structlog
    # Shorter lines: the process's fixed fields only in its log.open line, no level for info.
    assert not {"host", "size", "level", "backend"} & direct.keys(), direct
    assert (direct["rank"], direct["comm"], direct["step"], direct["shapes"]) == (0, "world", 3, [[4, 2]])
    # The reader puts them back.
    [_, read] = read_events(tmp_path / "rank0.jsonl")
    assert (read["level"], read["size"], read["host"], read.get("peer"), read["backend"], read["comm_size"]) == (
        "info", 2, header["host"], None, "gloo", 2)
