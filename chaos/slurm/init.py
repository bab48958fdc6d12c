"""Process 1 of a machine of the local Slurm cluster (`chaos.slurm.cluster`): the controller's
namespaces, or one node's.

    python -m chaos.slurm.init --hostname node0 --hosts DIR/hosts -- slurmd -D -N node0 -f DIR/slurm.conf

`chaos.slurm.cluster` starts it as the first process of fresh UTS, mount and PID namespaces
(``unshare --fork --kill-child``), already inside the machine's network namespace. It names
the machine (`--hostname`), bind-mounts the cluster's hosts file over /etc/hosts (the mount
namespace is private, so nothing shows outside it), starts the daemon, reaps every orphan the
PID namespace hands it (slurmstepd detaches from slurmd), and exits with the daemon's status
when the daemon ends: the kernel then kills whatever is left in the namespace.

SIGPWR is a power failure (`POWER_SIGNAL`; the ``node_loss`` fault sends it from inside the
node): every link of the node goes down first, so that peers see the silence of a dead
machine rather than closed connections, then every process of the namespace is SIGKILLed at
once (slurmd, slurmstepd, the job's harness, agent and ranks) and the machine is gone.
SIGTERM stops the machine the same way, links left up.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
from typing import Any

POWER_SIGNAL = signal.SIGPWR


def _power_off(cut_links: bool) -> None:
    if cut_links:
        for name in os.listdir("/sys/class/net"):
            if name != "lo":
                subprocess.run(["ip", "link", "set", name, "down"], capture_output=True)
    os.kill(-1, signal.SIGKILL)  # in a PID namespace: every process of it but this one
    os._exit(128 + signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m chaos.slurm.init", description=__doc__.split("\n\n")[0])
    p.add_argument("--hostname", required=True)
    p.add_argument("--hosts", required=True, help="the cluster's hosts file, bind-mounted over /etc/hosts")
    p.add_argument("daemon", nargs=argparse.REMAINDER, help="-- then the daemon's command line")
    args = p.parse_args(argv)
    daemon = args.daemon[1:] if args.daemon[:1] == ["--"] else args.daemon
    if os.getpid() != 1 or not daemon:
        print(
            f"chaos.slurm.init: expected to run as process 1 of a PID namespace with a daemon to start; found "
            f"pid {os.getpid()} and daemon {daemon}",
            file=sys.stderr,
        )
        return 2
    socket.sethostname(args.hostname)
    subprocess.run(["mount", "--bind", args.hosts, "/etc/hosts"], check=True)

    def on_signal(signum: int, frame: Any) -> None:
        _power_off(cut_links=signum == POWER_SIGNAL)

    signal.signal(POWER_SIGNAL, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    child = subprocess.Popen(daemon)
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            return 0
        except InterruptedError:
            continue
        if pid == child.pid:
            return os.waitstatus_to_exitcode(status) & 0xFF


if __name__ == "__main__":
    sys.exit(main())
