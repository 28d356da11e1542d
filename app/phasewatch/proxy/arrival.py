"""When a request arrived: for a connection's first request, the kernel's receive time of its
first byte.

A request's arrival is where its TTFT starts (timing.py). The server protocol stamps it as its
bytes come off the socket (client_leg.py), but a new connection first waits in the listening
socket's accept queue, and in a burst of new connections that wait is tens of milliseconds of
TTFT its client sees and a stamp at the first read does not. So when a connection is accepted,
before anything reads it, the kernel is asked when the first byte of what waits on it was
received (`SO_TIMESTAMPNS`, read with `MSG_PEEK`: nothing is taken from the socket), and that
time, moved onto `perf_counter_ns()`'s clock, is the first request's arrival when it is the
earlier. Requests on a kept connection are stamped at their read as before: their wait is the
event loop's alone.

The kernel stamps received packets only while some socket asks for it: `KernelArrivals` keeps
one that does for as long as the app serves. Linux only; elsewhere every request is stamped at
its read.
"""

from __future__ import annotations

import os
import socket
import struct
import sys
import time
from time import perf_counter_ns

# Linux's SO_TIMESTAMPNS (35), which Python's socket module names only from 3.12 on.
_SO_TIMESTAMPNS: int | None = getattr(socket, "SO_TIMESTAMPNS",
                                      35 if sys.platform == "linux" else None)
_CMSG_SPACE = socket.CMSG_SPACE(16) if hasattr(socket, "CMSG_SPACE") else 0
# A kernel stamp further back than this is not one to trust (a clock stepped meanwhile).
_LONGEST_WAIT_NS = 60 * 1_000_000_000


class KernelArrivals:
    """While open: the kernel stamps every packet it receives (one socket asking for it), and
    `first_byte_ns` can read those stamps."""

    def __init__(self) -> None:
        self._keeper: socket.socket | None = None
        if _SO_TIMESTAMPNS is None or not _CMSG_SPACE:
            return
        keeper = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            keeper.setsockopt(socket.SOL_SOCKET, _SO_TIMESTAMPNS, 1)
        except OSError:
            keeper.close()
            return
        self._keeper = keeper

    @property
    def enabled(self) -> bool:
        return self._keeper is not None

    def first_byte_ns(self, fd: int) -> int | None:
        """When the kernel received the first byte waiting on socket `fd`, on the clock of
        `perf_counter_ns()`; None when nothing waits, or it cannot tell."""
        option = _SO_TIMESTAMPNS
        if self._keeper is None or option is None:
            return None
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            return None
        try:
            sock.setsockopt(socket.SOL_SOCKET, option, 1)
            _, ancillary, _, _ = sock.recvmsg(1, _CMSG_SPACE,
                                              socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except OSError:  # nothing waits yet (EAGAIN), or the peer is gone
            return None
        finally:
            sock.close()  # the duplicate alone: the connection stays open
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == option and len(data) >= 16:
                seconds, nanoseconds = struct.unpack("qq", data[:16])
                waited_ns: int = time.time_ns() - (seconds * 1_000_000_000 + nanoseconds)
                if 0 <= waited_ns < _LONGEST_WAIT_NS:
                    return perf_counter_ns() - waited_ns
        return None

    def close(self) -> None:
        if self._keeper is not None:
            self._keeper.close()
            self._keeper = None
