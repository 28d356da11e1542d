"""A stream held by the native relay's thread (app/phasewatch/proxy/csrc/relay.c) between two socket
pairs a test drives: the upstream's side to write, the client's side to read."""

from __future__ import annotations

import select
import socket
from collections.abc import Callable
from typing import Any


class NativePair:
    def __init__(self, relay: Any, strip: bool, hold: bool, pending: bool = False) -> None:
        self.relay = relay
        self.up, self.upstream = socket.socketpair()
        self.client, self.remote = socket.socketpair()
        self.stream = relay.start(self.up.fileno(), self.client.fileno(), strip, hold, pending)
        self.received = b""

    def send(self, *parts: bytes) -> None:
        """One upstream write of these bytes."""
        self.upstream.sendall(b"".join(parts))

    def wait_for(self, done: Callable[[bytes], bool]) -> None:
        """Read what the thread writes to the client until `done(all of it)`."""
        while not done(self.received):
            ready, _, _ = select.select([self.remote], [], [], 10)
            assert ready, "the thread relayed nothing more"
            self.received += self.remote.recv(65536)

    def back(self) -> Any:
        """Wait for the stream to come back; then what the client got from the thread."""
        ready, _, _ = select.select([self.relay.fileno()], [], [], 10)
        assert ready, "the stream did not come back"
        assert self.relay.finished() == [self.stream]
        self.remote.setblocking(False)
        while True:
            try:
                data = self.remote.recv(65536)
            except BlockingIOError:
                break
            if not data:
                break
            self.received += data
        return self.stream

    def close(self) -> None:
        for sock in (self.up, self.upstream, self.client, self.remote):
            sock.close()
