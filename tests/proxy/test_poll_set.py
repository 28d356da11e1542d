"""The loop's poll set (app/core/event_loop.py): a paused socket out of uvloop's epoll set at once.

libuv takes a socket whose reading stopped out of its epoll set only when an event next comes
for it, waking the loop for nothing else. The relay pauses the upstream's transport for every
stream it hands to the native leg, and the upstream then writes: `PollSet.forget` takes the
socket out as reading stops. These tests read the kernel's own view of the set
(/proc/self/fdinfo of the epoll descriptor) and check that libuv takes the socket back when
reading resumes, and that a socket with a write pending (still watched for writing) is left.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator

import pytest

from phasewatch.core.event_loop import PollSet

uvloop = pytest.importorskip("uvloop")


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


async def _connected(loop: asyncio.AbstractEventLoop,
                     ) -> tuple[asyncio.Transport, _Reader, socket.socket, int]:
    ours, peer = socket.socketpair()
    transport, reader = await loop.create_connection(_Reader, sock=ours)
    await asyncio.sleep(0)  # a loop iteration: libuv adds the socket to its set
    return transport, reader, peer, ours.fileno()


def test_a_paused_socket_leaves_the_set_at_once_and_comes_back_on_resume(
        loop: asyncio.AbstractEventLoop) -> None:
    async def run() -> None:
        poll_set = PollSet(loop)
        backend = loop._get_backend_id()  # type: ignore[attr-defined]
        transport, reader, peer, fd = await _connected(loop)
        try:
            assert fd in _watched(backend)
            transport.pause_reading()
            await asyncio.sleep(0)
            assert fd in _watched(backend)  # libuv leaves it there until an event comes
            poll_set.forget(transport, fd)
            assert fd not in _watched(backend)
            peer.sendall(b"while paused")
            transport.resume_reading()
            await asyncio.wait_for(reader.more.wait(), 10)  # libuv added it again
            assert reader.received == b"while paused" and fd in _watched(backend)
        finally:
            transport.close()
            peer.close()
            poll_set.close()

    loop.run_until_complete(run())


def test_a_socket_with_a_write_pending_stays_in_the_set(
        loop: asyncio.AbstractEventLoop) -> None:
    """libuv still watches it for writing, and would abort on a set that lost it."""
    async def run() -> None:
        poll_set = PollSet(loop)
        backend = loop._get_backend_id()  # type: ignore[attr-defined]
        transport, reader, peer, fd = await _connected(loop)
        try:
            transport.write(b"x" * (8 << 20))  # more than the socket's buffers take
            assert transport.get_write_buffer_size()
            transport.pause_reading()
            poll_set.forget(transport, fd)
            assert fd in _watched(backend)
            peer.setblocking(False)
            drained = 0
            while transport.get_write_buffer_size():  # the peer reads: libuv writes on
                await asyncio.sleep(0.001)
                try:
                    drained += len(peer.recv(1 << 20))
                except BlockingIOError:
                    pass
            transport.resume_reading()
            peer.sendall(b"after")
            await asyncio.wait_for(reader.more.wait(), 10)
            assert reader.received == b"after"
        finally:
            transport.close()
            peer.close()
            poll_set.close()

    loop.run_until_complete(run())


def test_on_asyncios_own_loop_there_is_nothing_to_forget() -> None:
    loop = asyncio.new_event_loop()
    try:
        poll_set = PollSet(loop)
        assert poll_set._epoll is None
        poll_set.close()
    finally:
        loop.close()
