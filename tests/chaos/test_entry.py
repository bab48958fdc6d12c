"""`python -m chaos.entry` runs a trainer as `python SCRIPT` or `python -m MODULE` would: its
argv, `__main__`, `sys.path[0]` and exit status, with the garbage collector on and nothing of its
own frozen; an exception it lets out is logged as `train.error` in the rank's log and leaves the
process as it would have."""

import json
import os
import subprocess
import sys

from commlib.observe.events import read_events

SCRIPT = """
import gc
import sys
print(__name__, sys.argv[1:], sys.path[0])
mine = []
print(gc.isenabled(), gc.get_freeze_count() > 10_000, any(o is mine for o in gc.get_objects(generation=0)))
sys.exit(7)
"""
MODULE = """
import sys
if __name__ == "__main__":
    print(__name__, sys.argv[1:])
    raise ValueError("the trainer's own error")
"""


def _entry(*args, cwd, env=None):
    return subprocess.run([sys.executable, "-m", "chaos.entry", *args], cwd=cwd, capture_output=True, text=True,
                          env=env, timeout=120)


def test_a_script_runs_with_its_argv_main_path_and_exit_status(tmp_path):
    script = tmp_path / "trainer" / "train.py"
    script.parent.mkdir()
    script.write_text(SCRIPT)
    done = _entry(str(script), "--steps", "3", cwd=tmp_path)
    assert done.returncode == 7, done.stderr
    assert done.stdout.split("\n")[:2] == [f"__main__ ['--steps', '3'] {script.parent}", "True True True"]


def test_a_modules_uncaught_error_is_logged_and_leaves_as_it_would(tmp_path):
    """The module is found where `chaos run` started (the rank runs in its run's working directory)."""
    (tmp_path / "my_trainer.py").write_text(MODULE)
    logs, work = tmp_path / "logs", tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "COMMLIB_LOG_DIR": str(logs), "RANK": "0", "WORLD_SIZE": "1",
           "CHAOS_LAUNCH_DIR": str(tmp_path)}
    done = _entry("-m", "my_trainer", "a", cwd=work, env=env)
    assert done.returncode == 1 and done.stdout.startswith("__main__ ['a']"), done
    assert "ValueError: the trainer's own error" in done.stderr.splitlines()[-1]
    [error] = [e for e in read_events(logs / "rank0.jsonl") if e["event"] == "train.error"]
    assert (error["error_type"], error["error"]) == ("ValueError", "the trainer's own error"), json.dumps(error)
