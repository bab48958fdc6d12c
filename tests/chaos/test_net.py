"""The link emulator of `chaos.net` on its own: two real network namespaces, real kernel TCP
and UDP between processes in them, through the emulator's TUN devices.

Measured, not assumed: the round trip with and without `net_delay`'s latency, a partition
that blocks a TCP connection and the connection resuming once it is lifted (within TCP's
retransmission backoff), loss dropping the fraction asked (seeded: the same seed drops the
same packets), and nothing left behind (namespaces, devices) after `close`.

These need root (network namespaces, /dev/net/tun). Where they cannot be made the tests
fail, saying so: they never skip.
"""

import select
import statistics
import subprocess
import sys
import time

import pytest

from chaos.net import DEVICE, Network, NetworkUnavailable, namespaces

TCP_PORT, UDP_PORT = 7000, 7001
# The most a round trip over the idle emulator may take: a forwarder in Python adds well under
# a millisecond on an idle machine, several on a loaded one (7 ms seen with the suite running).
BASE_RTT_MS = 15.0
# In node 1: a TCP echo (one byte back per byte; b"c" answers with the UDP datagrams counted so
# far, as 8 bytes) and a UDP sink.
PEER = r"""
import socket, sys, threading
udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
udp.bind((sys.argv[1], %d))
count = 0
def sink():
    global count
    while udp.recv(2048):
        count += 1
threading.Thread(target=sink, daemon=True).start()
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind((sys.argv[1], %d))
srv.listen()
print("ready", flush=True)
conn, _ = srv.accept()
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while (data := conn.recv(1)):
    conn.sendall(count.to_bytes(8, "little") if data == b"c" else data)
""" % (UDP_PORT, TCP_PORT)
# In node 0, driven line by line on stdin: "rtt N" prints the median round trip of N one-byte
# exchanges (ms); "udp N" sends N datagrams, then prints how many the peer counted.
PROBE = r"""
import socket, statistics, sys, time
conn = socket.create_connection((sys.argv[1], %d), timeout=60)
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
def exactly(n):
    data = b""
    while len(data) < n:
        data += conn.recv(n - len(data))
    return data
print("ready", flush=True)
for line in sys.stdin:
    what, n = line.split()
    if what == "rtt":
        rtts = []
        for _ in range(int(n)):
            t = time.perf_counter()
            conn.sendall(b"x")
            exactly(1)
            rtts.append(time.perf_counter() - t)
        print(statistics.median(rtts) * 1000, flush=True)
    else:
        for i in range(int(n)):
            udp.sendto(i.to_bytes(4, "little") * 64, (sys.argv[1], %d))
            time.sleep(0.0002)
        time.sleep(0.3)
        conn.sendall(b"c")
        print(int.from_bytes(exactly(8), "little"), flush=True)
""" % (TCP_PORT, UDP_PORT)


class Pair:
    """A peer in node 1 and a probe in node 0, connected over the emulator."""

    def __init__(self, net: Network) -> None:
        self.peer = subprocess.Popen(net.exec_prefix(1) + [sys.executable, "-c", PEER, net.address(1)],
                                     stdout=subprocess.PIPE, text=True)
        assert self._line(self.peer, 30) == "ready"
        self.probe = subprocess.Popen(net.exec_prefix(0) + [sys.executable, "-c", PROBE, net.address(1)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self._line(self.probe, 30) == "ready"

    @staticmethod
    def _line(proc: subprocess.Popen, timeout: float) -> str | None:
        ready, _, _ = select.select([proc.stdout], [], [], timeout)
        return proc.stdout.readline().strip() if ready else None

    def send(self, command: str) -> None:
        self.probe.stdin.write(command + "\n")
        self.probe.stdin.flush()

    def answer(self, timeout: float = 30) -> float | None:
        line = self._line(self.probe, timeout)
        return None if line is None else float(line)

    def ask(self, command: str, timeout: float = 30) -> float:
        self.send(command)
        value = self.answer(timeout)
        assert value is not None, f"no answer to {command!r} within {timeout} s"
        return value

    def close(self) -> None:
        for proc in (self.probe, self.peer):
            proc.kill()
            proc.wait()


@pytest.fixture
def net():
    """Two nodes; a failure to make them fails the test with why (never a skip)."""
    try:
        network = Network(2, seed=7).open()
    except NetworkUnavailable as exc:
        pytest.fail(f"network namespaces cannot be created here (root is needed, and CI runs as root): {exc}")
    try:
        yield network
    finally:
        network.close()


@pytest.fixture
def pair(net):
    p = Pair(net)
    try:
        yield p
    finally:
        p.close()


def _in_ns(net: Network, node: int, *cmd: str) -> str:
    return subprocess.run(net.exec_prefix(node) + list(cmd), capture_output=True, text=True, check=True).stdout


def test_each_node_has_its_own_stack_and_nothing_is_left_after_close():
    try:
        net = Network(2).open()
    except NetworkUnavailable as exc:
        pytest.fail(f"network namespaces cannot be created here (root is needed, and CI runs as root): {exc}")
    try:
        names = [n.netns for n in net.nodes]
        assert set(names) <= set(namespaces()) and len(set(names)) == 2
        for node in (0, 1):
            shown = _in_ns(net, node, "ip", "-o", "-4", "addr", "show")
            assert f"{DEVICE}    inet {net.address(node)}/24" in shown and "lo    inet 127.0.0.1/8" in shown, shown
            assert net.address(1 - node) not in shown  # the other node's address lives in the other stack
        assert DEVICE not in subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    finally:
        net.close()
    assert not set(names) & set(namespaces())
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert f"cn{net.tag.split('-')[1]}" not in links


def test_tcp_crosses_the_emulator_and_net_delay_adds_twice_its_latency_to_a_round_trip(net, pair):
    base = statistics.median(pair.ask("rtt 100") for _ in range(3))
    assert base < BASE_RTT_MS, base
    sent = net.stats(0).sent
    assert sent > 300 and net.stats(1).received > 300  # the probe's traffic went through the devices

    net.impair(1, delay_s=0.020)
    delayed = pair.ask("rtt 20")
    assert 40.0 <= delayed < 40.0 + base + 15.0, (base, delayed)  # 20 ms each way
    assert net.stats(0).delayed > 0

    net.clear(1)
    assert pair.ask("rtt 100") < base + BASE_RTT_MS


def test_a_partition_blocks_a_connection_and_tcp_resumes_after_it_is_lifted(net, pair):
    base = pair.ask("rtt 10")
    assert base < BASE_RTT_MS, base
    cut_s = 2.0
    net.impair(1, cut=True)
    cut_at = time.monotonic()
    pair.send("rtt 1")
    assert pair.answer(timeout=cut_s) is None  # nothing gets through while cut off
    dropped = net.stats(1).dropped_cut
    assert dropped >= 3, dropped  # the byte and its retransmissions (backoff from 200 ms)
    net.clear(1)
    lifted_at = time.monotonic()
    assert pair.answer(timeout=cut_s + 5) is not None
    resumed_s = time.monotonic() - lifted_at
    # At the next retransmission: the backoff doubles, so at most about as long again as the cut.
    assert resumed_s <= (lifted_at - cut_at) + 0.5, resumed_s
    assert pair.ask("rtt 10") < base + BASE_RTT_MS  # nothing of the cut lingers


def test_loss_drops_the_fraction_asked_the_same_way_for_the_same_seed():
    counts = []
    for _ in range(2):
        try:
            network = Network(2, seed=11).open()
        except NetworkUnavailable as exc:
            pytest.fail(f"network namespaces cannot be created here (root is needed, and CI runs as root): {exc}")
        try:
            pair = Pair(network)
            try:
                network.impair(1, loss=0.25)
                received = int(pair.ask("udp 2000", timeout=60))
                stats = network.stats(1)
            finally:
                pair.close()
        finally:
            network.close()
        assert 0.70 * 2000 <= received <= 0.80 * 2000, received
        assert stats.dropped_loss >= 2000 - received  # every missing datagram was dropped here
        counts.append(received)
    assert counts[0] == counts[1], counts
