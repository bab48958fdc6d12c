"""The network of a local multi-node job: one network namespace per node, joined by a userspace link emulator.

`Network(nodes)` owns, for the length of a run, everything a network fault acts on:

- one network namespace per node, ``chaos-<pid>-<hex>-n<i>`` (the creating process's pid and
  a random tag: names never clash with an earlier run's), each with ``lo`` up and one TUN device
  named `DEVICE` holding the node's address ``10.<a>.<b>.<i+1>/24`` (the route to the
  subnet goes through it);
- the TUN devices' file descriptors: each device is created here, in the root namespace
  (``ioctl(TUNSETIFF)`` on ``/dev/net/tun``), then moved into its node's namespace, so the
  emulator reads every IP packet a node sends and writes the packets it receives;
- a forwarder thread, the "switch": it reads raw IPv4 packets from each node's device and
  writes them to the device of the node owning the destination address, applying each
  node's `Impairment` to the packets crossing that node's link, in either direction:
  ``delay_s`` (held that long, order kept per destination: a round trip gains 2 x delay),
  ``loss`` (dropped with that probability, drawn from a seeded RNG), ``cut`` (a partition:
  everything to or from the node dropped, with no ICMP: a blackhole, as a pulled cable or a
  dead switch port looks to TCP).

The nodes' processes run real kernel TCP in separate network stacks (`exec_prefix`: ``ip
netns exec``), and see real latency, loss and silence: retransmissions, exponential backoff,
connections that resume once the link is back. Only the wire is emulated.

Why in userspace: this machine's kernel has no ``sch_netem`` (``tc qdisc ... netem`` says
"Specified qdisc kind is unknown"), no tc classifiers but bpf, no gact, no iptables or nft.
On a kernel with netem the same faults are ``tc qdisc add dev <veth> root netem delay
<ms>ms`` / ``loss <pct>%`` on both ends of the node's veth pair, and a partition is the veth
set down (or ``netem loss 100%``).

Everything is root-only: `NetworkUnavailable` says so (and why) before anything starts.
`close` (also on failure) stops the thread, closes the devices'
descriptors (which removes the devices) and deletes the namespaces. A harness that dies
without `close` loses the devices with its descriptors; its namespaces stay until
`chaos.cleanup` stops the processes in them (`namespace_pids`) and deletes them
(`delete_namespace`): a namespace outlives its name while a process is still in it.
"""

from __future__ import annotations

import errno
import fcntl
import os
import random
import secrets
import select
import struct
import subprocess
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

DEVICE = "cnet0"  # the TUN device's name inside every node's namespace (GLOO_SOCKET_IFNAME)
MTU = 9000  # jumbo frames, as in a datacenter; fewer packets through the Python forwarder
NETNS_DIR = Path("/run/netns")
_TUNSETIFF = 0x400454CA
_IFF_TUN = 0x0001
_IFF_NO_PI = 0x1000
_MAX_PACKET = 65536
_IDLE_S = 0.1  # the forwarder's longest sleep (it is woken at once when an impairment changes)


class NetworkUnavailable(RuntimeError):
    """Network namespaces or TUN devices cannot be made here (not root, no /dev/net/tun, no `ip`)."""


@dataclass(frozen=True)
class Impairment:
    """What a node's link does to every packet crossing it (to or from the node)."""

    delay_s: float = 0.0
    loss: float = 0.0  # probability in [0, 1]
    cut: bool = False  # partitioned: every packet dropped


@dataclass
class LinkStats:
    """Packets that crossed a node's link (sent or received by the node), and what happened to them."""

    sent: int = 0  # packets the node sent (read from its device)
    received: int = 0  # packets delivered to the node (written to its device)
    bytes_sent: int = 0
    dropped_cut: int = 0  # to or from the node while it was cut off
    dropped_loss: int = 0
    delayed: int = 0
    unroutable: int = 0  # sent to no node's address, or not IPv4


@dataclass
class _Node:
    index: int
    netns: str
    address: str
    fd: int = -1
    impairment: Impairment = field(default_factory=Impairment)
    stats: LinkStats = field(default_factory=LinkStats)
    queue: deque[tuple[float, bytes]] = field(default_factory=deque)  # (due, packet) to deliver to it
    last_due: float = 0.0


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        done = subprocess.run(["ip", *args], capture_output=True, text=True)
    except FileNotFoundError as exc:
        raise NetworkUnavailable("chaos.net: expected the `ip` command (iproute2); found none on PATH") from exc
    if check and done.returncode != 0:
        raise NetworkUnavailable(
            f"chaos.net: `ip {' '.join(args)}` exited {done.returncode} (network namespaces and "
            f"TUN devices need root): {done.stderr.strip() or done.stdout.strip()}"
        )
    return done


def namespaces() -> list[str]:
    """The network namespaces named in /run/netns (where `ip netns add` puts them)."""
    try:
        return sorted(p.name for p in NETNS_DIR.iterdir())
    except FileNotFoundError:
        return []


def delete_namespace(name: str) -> bool:
    """Delete the network namespace `name`; whether it was there."""
    return _ip("netns", "del", name, check=False).returncode == 0


def namespace_pids(name: str) -> list[int]:
    """The processes in the network namespace `name` (none when it is gone)."""
    return [int(pid) for pid in _ip("netns", "pids", name, check=False).stdout.split()]


class Network:
    """`nodes` namespaces joined by the emulator; see the module docstring. Start with `open()`,
    end with `close()`."""

    def __init__(self, nodes: int, *, seed: int = 0) -> None:
        if not isinstance(nodes, int) or nodes < 1 or nodes > 250:
            raise ValueError(f"Network: expected 1 to 250 nodes; found {nodes!r}")
        tag = secrets.token_hex(3)
        self.tag = f"{os.getpid()}-{tag}"
        # The subnet only has to be unique inside the run (every namespace is its own stack);
        # drawn from the tag so two runs' addresses differ in logs.
        a, b = 16 + int(tag[:2], 16) % 224, int(tag[2:4], 16)
        self.prefix = bytes([10, a, b])
        self.nodes = [_Node(i, f"chaos-{self.tag}-n{i}", f"10.{a}.{b}.{i + 1}") for i in range(nodes)]
        self._rng = random.Random(seed)
        self._wake_r, self._wake_w = -1, -1
        self._thread: threading.Thread | None = None
        self._stop = False
        self._error: BaseException | None = None
        self._created: list[str] = []

    # -- life cycle --------------------------------------------------------------------
    def open(self) -> Network:
        """Create the namespaces and devices and start forwarding. Raises NetworkUnavailable."""
        if not os.path.exists("/dev/net/tun"):
            raise NetworkUnavailable("chaos.net: expected /dev/net/tun (the TUN driver); found none")
        try:
            for node in self.nodes:
                self._make_node(node)
            self._wake_r, self._wake_w = os.pipe()
            os.set_blocking(self._wake_r, False)
            self._thread = threading.Thread(target=self._forward, name=f"chaos-net-{self.tag}", daemon=True)
            self._thread.start()
        except BaseException:
            self.close()
            raise
        return self

    def _make_node(self, node: _Node) -> None:
        _ip("netns", "add", node.netns)
        self._created.append(node.netns)
        temp = f"cn{self.tag.split('-')[1]}n{node.index}"  # unique in the root namespace until moved
        try:
            fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            raise NetworkUnavailable(f"chaos.net: expected to open /dev/net/tun (needs root); {exc}") from exc
        node.fd = fd
        try:
            fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH22x", temp.encode(), _IFF_TUN | _IFF_NO_PI))
        except OSError as exc:
            raise NetworkUnavailable(
                f"chaos.net: expected TUNSETIFF to create {temp} (needs CAP_NET_ADMIN); {exc}"
            ) from exc
        ns = ["-n", node.netns]
        _ip("link", "set", temp, "netns", node.netns)
        _ip(*ns, "link", "set", temp, "name", DEVICE)
        # No IPv6 link-local address: nothing but the job's IPv4 traffic crosses the emulator.
        _ip(*ns, "link", "set", DEVICE, "addrgenmode", "none")
        _ip(*ns, "link", "set", DEVICE, "mtu", str(MTU))
        _ip(*ns, "addr", "add", f"{node.address}/24", "dev", DEVICE)
        _ip(*ns, "link", "set", DEVICE, "up")
        _ip(*ns, "link", "set", "lo", "up")

    def close(self) -> None:
        """Stop forwarding, remove the devices (by closing them) and delete the namespaces. Idempotent."""
        self._stop = True
        if self._thread is not None:
            self._wake()
            self._thread.join(timeout=5)
            self._thread = None
        for node in self.nodes:
            if node.fd >= 0:
                os.close(node.fd)
                node.fd = -1
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                os.close(fd)
        self._wake_r = self._wake_w = -1
        for name in self._created:
            delete_namespace(name)
        self._created = []

    # -- what the harness uses ---------------------------------------------------------
    def exec_prefix(self, node: int) -> list[str]:
        """The command prefix that runs a program in `node`'s namespace."""
        return ["ip", "netns", "exec", self.nodes[node].netns]

    def address(self, node: int) -> str:
        return self.nodes[node].address

    def impair(
        self, node: int, *, delay_s: float | None = None, loss: float | None = None, cut: bool | None = None
    ) -> Impairment:
        """Change `node`'s link (unset arguments keep their value); returns the new impairment."""
        n = self.nodes[node]
        changes: dict[str, Any] = {
            k: v for k, v in (("delay_s", delay_s), ("loss", loss), ("cut", cut)) if v is not None
        }
        if "loss" in changes and not 0.0 <= changes["loss"] <= 1.0:
            raise ValueError(f"Network.impair: expected a loss probability in [0, 1]; found {loss}")
        if "delay_s" in changes and not changes["delay_s"] >= 0.0:
            raise ValueError(f"Network.impair: expected a delay >= 0 s; found {delay_s}")
        n.impairment = replace(n.impairment, **changes)  # one assignment: the forwarder reads it whole
        self._wake()
        return n.impairment

    def clear(self, node: int) -> None:
        """`node`'s link back to normal."""
        self.nodes[node].impairment = Impairment()
        self._wake()

    def stats(self, node: int) -> LinkStats:
        return replace(self.nodes[node].stats)

    def check(self) -> None:
        """Raise what stopped the forwarder, if it stopped."""
        if self._error is not None:
            raise RuntimeError(f"chaos.net: the forwarder stopped: {self._error!r}") from self._error

    # -- the forwarder -----------------------------------------------------------------
    def _wake(self) -> None:
        if self._wake_w >= 0:
            try:
                os.write(self._wake_w, b"x")
            except BlockingIOError:
                pass

    def _forward(self) -> None:
        by_fd = {n.fd: n for n in self.nodes}
        watched = [*by_fd, self._wake_r]
        try:
            while not self._stop:
                due = [n.queue[0][0] for n in self.nodes if n.queue]
                wait = _IDLE_S if not due else max(0.0, min(min(due) - time.monotonic(), _IDLE_S))
                ready, _, _ = select.select(watched, [], [], wait)
                for fd in ready:
                    if fd == self._wake_r:
                        _drain(fd)
                        continue
                    source = by_fd[fd]
                    while (packet := _read(fd)) is not None:
                        self._route(source, packet, time.monotonic())
                now = time.monotonic()
                for node in self.nodes:
                    while node.queue and node.queue[0][0] <= now:
                        self._deliver(node, node.queue.popleft()[1])
        except BaseException as exc:  # the harness reads it through check(); the job sees a dead network
            self._error = exc

    def _route(self, source: _Node, packet: bytes, now: float) -> None:
        source.stats.sent += 1
        source.stats.bytes_sent += len(packet)
        dest = self._destination(packet)
        if dest is None:
            source.stats.unroutable += 1
            return
        for link in (source.impairment, dest.impairment):  # the packet leaves one link, enters the other
            if link.cut:
                source.stats.dropped_cut += 1
                dest.stats.dropped_cut += 1
                return
            if link.loss and self._rng.random() < link.loss:
                source.stats.dropped_loss += 1
                dest.stats.dropped_loss += 1
                return
        delay = source.impairment.delay_s + dest.impairment.delay_s
        if delay == 0.0 and not dest.queue:
            self._deliver(dest, packet)
            return
        source.stats.delayed += 1
        dest.last_due = max(now + delay, dest.last_due)  # never before a packet queued earlier
        dest.queue.append((dest.last_due, packet))

    def _destination(self, packet: bytes) -> _Node | None:
        if len(packet) < 20 or packet[0] >> 4 != 4 or packet[16:19] != self.prefix:
            return None
        host = packet[19] - 1
        return self.nodes[host] if 0 <= host < len(self.nodes) else None

    def _deliver(self, dest: _Node, packet: bytes) -> None:
        try:
            os.write(dest.fd, packet)
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EIO):  # EIO: the device is down for a moment
                raise
            return
        dest.stats.received += 1


def _read(fd: int) -> bytes | None:
    try:
        return os.read(fd, _MAX_PACKET)
    except BlockingIOError:
        return None


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass
