"""The link between the server and a worker process: msgpack messages over a pipe, and a heartbeat.

Why a module of its own: hostile submitted code runs in the worker, so
nothing the worker sends may be unpickled or otherwise executed by the
server. Every message, both ways, is one msgpack map in the wire format of
:mod:`.wire` (tensors as dtype/shape/bytes, no pickle); the server decodes
the worker's messages with limits bounded by their size and refuses
messages over :data:`MAX_MESSAGE` bytes (it then treats the worker as
broken). ``multiprocessing`` connections are used only through
``send_bytes``/``recv_bytes``, never ``send``/``recv`` (which pickle).

The heartbeat is an 8-byte counter in shared memory (a ``memfd`` mapped
by both processes; its descriptor travels with the worker's start, see
:mod:`.worker_start`) that a thread of the worker bumps every few
milliseconds. A C-level loop that never releases the GIL stops every
Python thread of the worker, that one included: the counter stands still,
and the server, which reads it from its own process, sees it.
"""

from __future__ import annotations

import mmap
import os
import struct
import tempfile
import threading
import time

from ...client import wire

MAX_MESSAGE = 512 << 20      # the largest message either side accepts (a result may hold 256 MiB tensors)

# the server trusts itself: what it sends the worker is decoded with generous limits
TRUSTED_LIMITS = wire.answer_limits(MAX_MESSAGE)


class Channel:
    """One end of a worker's pipe: :meth:`send` a dict, :meth:`recv` the next dict.

    ``send`` may be called from several threads (a lock keeps messages whole);
    ``recv`` from one thread at a time. ``recv`` raises ``EOFError`` when the
    other end is closed, ``OSError`` for a message over :data:`MAX_MESSAGE`
    and :class:`~.wire.WireError` for anything that is not a valid msgpack map.
    """

    def __init__(self, conn):
        self.conn = conn
        self.lock = threading.Lock()

    def send(self, msg: dict) -> None:
        self.send_bytes(wire.packb(msg))

    def send_bytes(self, data: bytes) -> None:
        with self.lock:
            self.conn.send_bytes(data)

    def recv(self, trusted: bool = False) -> dict:
        data = self.conn.recv_bytes(MAX_MESSAGE)
        msg = wire.unpackb(data, TRUSTED_LIMITS if trusted else wire.answer_limits(len(data)))
        if not isinstance(msg, dict):
            raise wire.WireError(f"a message must be a map, got {type(msg).__name__}")
        return msg

    def fileno(self) -> int:
        return self.conn.fileno()

    def close(self) -> None:
        self.conn.close()


class Heartbeat:
    """A counter in memory shared with a worker: the worker :meth:`beat`\\ s, the server :meth:`read`\\ s.

    Pickled (as a worker process's argument), it sends its memory's descriptor along; the worker maps the
    same page (:func:`_attach`).
    """

    def __init__(self, fd: int | None = None):
        if fd is None:
            fd = _shared_file()
        self.fd = fd
        self.map = mmap.mmap(fd, 8)   # MAP_SHARED: the same page in the server and the worker
        self.count = 0

    def __reduce__(self):
        from multiprocessing.reduction import DupFd
        return _attach, (DupFd(self.fd),)

    def beat(self) -> None:
        self.count += 1
        struct.pack_into("<Q", self.map, 0, self.count)

    def read(self) -> int:
        return struct.unpack_from("<Q", self.map, 0)[0]

    def beat_forever(self, interval: float) -> None:
        """Bump the counter every ``interval`` seconds (run in a daemon thread of the worker)."""
        while True:
            self.beat()
            time.sleep(interval)

    def close(self) -> None:
        try:
            self.map.close()
        except (BufferError, ValueError):
            pass
        try:
            os.close(self.fd)
        except OSError:
            pass


def _shared_file() -> int:
    """A descriptor of 8 zero bytes of shared memory (a memfd; an unlinked temporary file where there is none)."""
    try:
        fd = os.memfd_create("asyncinterp-heartbeat", getattr(os, "MFD_CLOEXEC", 1))
    except (AttributeError, OSError):
        fd, path = tempfile.mkstemp(prefix="asyncinterp-heartbeat-")
        os.unlink(path)
    os.ftruncate(fd, 8)
    return fd


def _attach(dup) -> Heartbeat:
    """In the worker: the server's heartbeat, from the descriptor that came with the start."""
    return Heartbeat(dup.detach())
