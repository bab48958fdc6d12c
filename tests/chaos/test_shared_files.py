"""Two writers of the same pid, each in a PID namespace of its own (as two nodes' harnesses in
containers), on one shared directory: neither ever takes or overwrites the other's temporary
file (`chaos.files`), so every write lands whole and none fails."""

import json
import subprocess
import sys
import time

WRITES = 300
WRITER = """
import json, os, sys, time
from pathlib import Path
from chaos.files import publish, write_json_atomic
shared, me, go = Path(sys.argv[1]), sys.argv[2], float(sys.argv[3])
assert os.getpid() == 1, os.getpid()  # the same pid as the other writer
while time.time() < go:
    time.sleep(0.001)
for i in range({writes}):
    write_json_atomic(shared / "state.json", {{"writer": me, "i": i}})
    publish(shared / f"job{{i}}.json", json.dumps({{"writer": me}}))
print("done", flush=True)
""".format(writes=WRITES)


def test_two_writers_of_one_pid_in_two_pid_namespaces_never_collide(tmp_path):
    """Same pid, one directory: all writes of both succeed, each file is whole, no temporary is left."""
    shared = tmp_path / "shared"
    shared.mkdir()
    go = time.time() + 3.0  # both start writing at once, after their interpreters are up
    writers = [subprocess.Popen(["unshare", "--pid", "--fork", sys.executable, "-c", WRITER, str(shared), name,
                                 str(go)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for name in ("a", "b")]
    outputs = [w.communicate(timeout=120) for w in writers]
    for w, (out, err) in zip(writers, outputs):
        assert w.returncode == 0 and out.strip() == "done", err[-3000:]
    assert json.loads((shared / "state.json").read_text())["i"] == WRITES - 1
    assert {json.loads((shared / f"job{i}.json").read_text())["writer"] for i in range(WRITES)} <= {"a", "b"}
    assert sorted(p.name for p in shared.iterdir() if p.name.startswith(".")) == []
