"""A TCP relay in front of a store server whose `stop()` makes it stop passing bytes.

What a rank sees when the job's store stops answering (its host frozen, a partition, a host gone
without a reset): connections stay open and calls get no answer. The store's own server cannot
be frozen alone where it runs in the test's process; its clients connect to the relay instead.
"""

from __future__ import annotations

import socket
import threading
import time

QUIET_S = 0.2  # `close` waits for the relay to pass no byte for this long (at most `DRAIN_S`)
DRAIN_S = 5.0


class StoreRelay:
    """Relays every connection to `127.0.0.1:target_port` while passing (until `stop`)."""

    def __init__(self, target_port: int) -> None:
        self._target = target_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._passing = threading.Event()
        self._passing.set()
        self._sockets: list[socket.socket] = []
        self._last_byte = time.monotonic()
        threading.Thread(target=self._accept, name="store-relay", daemon=True).start()

    def stop(self) -> None:
        """Hold every byte from now on, both ways, on connections open or new."""
        self._passing.clear()

    def resume(self) -> None:
        self._passing.set()

    def close(self) -> None:
        """Pass bytes again until the calls held meanwhile are answered, then close every
        connection: a client whose call is cut off logs the store's C++ stack."""
        self._passing.set()
        until = time.monotonic() + DRAIN_S
        while time.monotonic() - self._last_byte < QUIET_S and time.monotonic() < until:
            time.sleep(QUIET_S / 4)
        for s in [self._listener, *self._sockets]:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # closed
                return
            server = socket.create_connection(("127.0.0.1", self._target))
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sockets += [client, server]
            for src, dst in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(src, dst), name="store-relay-pipe", daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                self._passing.wait()
                dst.sendall(data)
                self._last_byte = time.monotonic()
        except OSError:  # closed
            pass
