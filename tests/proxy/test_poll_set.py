"""The loop's poll set (app/phasewatch/core/event_loop.py): a paused socket out of uvloop's epoll
set at once.

libuv takes a socket whose reading stopped out of its epoll set only when an event next comes
for it, waking the loop for nothing else. The relay pauses the upstream's transport for every
stream it hands to the native leg, and the upstream then writes: `PollSet.forget` takes the
socket out as reading stops. These tests read the kernel's own view of the set
(/proc/self/fdinfo of the epoll descriptor) and check that libuv takes the socket back when
reading resumes, and that a socket with a write pending (still watched for writing) is left.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Iterator

import pytest

from phasewatch.core.event_loop import PollSet

uvloop = pytest.importorskip("uvloop")
pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/fdinfo"),
                                reason="reads the kernel's epoll set through Linux's /proc")


def _watched(epoll_fd: int) -> set[int]:
    """The descriptors in an epoll set, as the kernel lists them."""
    with open(f"/proc/self/fdinfo/{epoll_fd}") as info:
        return {int(line.split()[1]) for line in info if line.startswith("tfd:")}


class _Reader(asyncio.Protocol):
    def __init__(self) -> None:
        self.received = b""
        self.more = asyncio.Event()

    def data_received(self, data: bytes) -> None:
        self.received += data
        self.more.set()


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = uvloop.new_event_loop()
    yield loop
    loop.close()


class _Paused:
    """A transport on a socket pair, the loop's poll set, and the epoll set's descriptor."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.poll_set = PollSet(loop)
        self.backend: int = loop._get_backend_id()  # type: ignore[attr-defined]

    async def __aenter__(self) -> _Paused:
        ours, self.peer = socket.socketpair()
        self.fd = ours.fileno()
        transport, self.reader = await self.loop.create_connection(_Reader, sock=ours)
        self.transport: asyncio.Transport = transport
        await asyncio.sleep(0)  # a loop iteration: libuv adds the socket to its set
        assert self.fd in _watched(self.backend)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.transport.close()
        self.peer.close()
        self.poll_set.close()


def test_a_paused_socket_leaves_the_set_at_once_and_comes_back_on_resume(
        loop: asyncio.AbstractEventLoop) -> None:
    async def run() -> None:
        async with _Paused(loop) as it:
            it.transport.pause_reading()
            await asyncio.sleep(0)
            assert it.fd in _watched(it.backend)  # libuv leaves it there until an event comes
            it.poll_set.forget(it.transport, it.fd)
            assert it.fd not in _watched(it.backend)
            it.peer.sendall(b"while paused")
            it.transport.resume_reading()
            await asyncio.wait_for(it.reader.more.wait(), 10)  # libuv added it again
            assert it.reader.received == b"while paused" and it.fd in _watched(it.backend)

    loop.run_until_complete(run())


def test_a_socket_with_a_write_pending_stays_in_the_set(
        loop: asyncio.AbstractEventLoop) -> None:
    """libuv still watches it for writing, and would abort on a set that lost it."""
    async def run() -> None:
        async with _Paused(loop) as it:
            it.transport.write(b"x" * (8 << 20))  # more than the socket's buffers take
            assert it.transport.get_write_buffer_size()
            it.transport.pause_reading()
            it.poll_set.forget(it.transport, it.fd)
            assert it.fd in _watched(it.backend)
            it.peer.setblocking(False)
            while it.transport.get_write_buffer_size():  # the peer reads: libuv writes on
                await asyncio.sleep(0.001)
                try:
                    it.peer.recv(1 << 20)
                except BlockingIOError:
                    pass
            it.transport.resume_reading()
            it.peer.sendall(b"after")
            await asyncio.wait_for(it.reader.more.wait(), 10)
            assert it.reader.received == b"after"

    loop.run_until_complete(run())


def test_on_asyncios_own_loop_there_is_nothing_to_forget() -> None:
    loop = asyncio.new_event_loop()
    try:
        poll_set = PollSet(loop)
        assert poll_set._epoll is None
        poll_set.close()
    finally:
        loop.close()
