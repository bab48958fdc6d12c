"""faulthandler's SIGUSR2 stacks, read back: the last of several dumps, and its main thread."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from commlib.observe.stacks import last_dump, main_thread, read_main_stacks
from commlib.record.files import stacks_file_name

# Two SIGUSR2s from two places, with a second thread alive: the reader must return the
# second dump's main thread, innermost frame first.
_PROBE = """
import faulthandler, os, signal, sys, threading, time
out = open(sys.argv[1], "a")
faulthandler.register(signal.SIGUSR2, file=out, all_threads=True)
threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
def first_place():
    os.kill(os.getpid(), signal.SIGUSR2)
def second_place():
    os.kill(os.getpid(), signal.SIGUSR2)
first_place()
second_place()
print(os.getpid())
"""


def test_the_last_dump_and_its_main_thread_are_read_back(tmp_path: Path) -> None:
    target = tmp_path / "probe_stacks.txt"
    done = subprocess.run([sys.executable, "-c", _PROBE, str(target)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    text = target.read_text()
    assert text.count("most recent call first") == 4  # two dumps of two threads
    dump = last_dump(text)
    assert len(dump) == 2
    frames = main_thread(dump)
    assert frames is not None and frames[0].func == "second_place", frames
    pid = int(done.stdout.strip())
    target.rename(tmp_path / stacks_file_name("node-1.cluster", pid))  # named by host and pid, as the recorder names it
    [(process, read_frames)] = read_main_stacks(tmp_path).items()
    assert process == ("node-1.cluster", pid) and read_frames == frames
    assert read_frames[0].traceback_line().startswith('  File "<string>", line ')
