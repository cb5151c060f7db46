"""The link between the server and a worker process: msgpack messages over a pipe, and a heartbeat.

Why a module of its own: hostile submitted code runs in the worker, so
nothing the worker sends may be unpickled or otherwise executed by the
server. Every message, both ways, is one msgpack map in the wire format of
:mod:`.wire` (tensors as dtype/shape/bytes, no pickle); the server decodes
the worker's messages with limits bounded by their size and refuses
messages over :data:`MAX_MESSAGE` bytes (it then treats the worker as
broken). ``multiprocessing`` connections are used only through
``send_bytes``/``recv_bytes``, never ``send``/``recv`` (which pickle).

What the server sends a worker goes through an :class:`Outbox`: written at
once by the thread that sends it when the pipe takes it without waiting
(the usual case: no thread hop between the server's event loop and the
worker), else queued for a sender thread, the only writer that may block
(a worker that stopped reading fills its pipe; nothing else then waits).

The heartbeat is an 8-byte counter in shared memory (a ``memfd`` mapped
by both processes; its descriptor travels with the worker's start, see
:mod:`.worker_start`) that a thread of the worker bumps every few
milliseconds. A C-level loop that never releases the GIL stops every
Python thread of the worker, that one included: the counter stands still,
and the server, which reads it from its own process, sees it.
"""

from __future__ import annotations

import collections
import mmap
import os
import socket
import stat
import struct
import tempfile
import threading
import time

from ...client import wire

MAX_MESSAGE = 512 << 20      # the largest message either side accepts (a result may hold 256 MiB tensors)
PIPE_BUFFER = 4 << 20       # what a worker's pipe holds in flight where the system allows it (see widen)
DIRECT_MAX = 64 << 10        # an Outbox writes a message up to this size from the sending thread when it can

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
        self.sock = None        # the pipe as a socket, for writes that must not wait (try_send)

    def send(self, msg: dict) -> None:
        self.send_bytes(wire.packb(msg))

    def send_bytes(self, data: bytes) -> None:
        with self.lock:
            self.conn.send_bytes(data)

    def send_parts(self, parts, then: bytes | None = None) -> None:
        """One message made of ``parts`` (bytes-like, one after the other), written as they are: not joined
        into one buffer first (a large answer is copied once, by the kernel). ``then``: a second message,
        written in the same call (the reader gets both with one wake-up)."""
        size = sum(len(part) for part in parts)
        if size > MAX_MESSAGE:
            raise ValueError(f"a message of {size} bytes is over the limit of {MAX_MESSAGE}")
        buffers = [struct.pack("!i", size), *parts]
        if then is not None:
            buffers += [struct.pack("!i", len(then)), then]
        with self.lock:
            _write_all(self.conn.fileno(), buffers)

    def recv(self, trusted: bool = False) -> dict:
        data = self._recv_frame()
        msg = wire.unpackb(data, TRUSTED_LIMITS if trusted else wire.answer_limits(len(data)))
        if not isinstance(msg, dict):
            raise wire.WireError(f"a message must be a map, got {type(msg).__name__}")
        return msg

    def _recv_frame(self) -> bytearray:
        """The next message's bytes, read into one buffer of its size (as ``Connection.recv_bytes`` frames them,
        without its intermediate copies); ``EOFError`` at the end of the pipe, ``OSError`` for a message over
        :data:`MAX_MESSAGE` or cut short."""
        fd = self.conn.fileno()
        head = _read_exactly(fd, 4, at_start=True)
        size, = struct.unpack("!i", head)
        if size == -1:                     # (how send_bytes frames a message of 2 GiB or more)
            size, = struct.unpack("!Q", _read_exactly(fd, 8))
        if size < 0 or size > MAX_MESSAGE:
            raise OSError(f"bad message length ({size} bytes; the limit is {MAX_MESSAGE})")
        return _read_exactly(fd, size)

    def try_send(self, frame: bytes) -> int:
        """Write what the pipe takes of ``frame`` without waiting; the bytes written (0: none, or no socket).

        ``frame`` is raw bytes on the pipe (:func:`frame` a message first); the caller makes sure no other
        write is under way (:class:`Outbox`)."""
        if self.sock is None:
            fd = self.conn.fileno()
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):   # a one-way os.pipe: every write may block
                return 0
            self.sock = socket.socket(fileno=os.dup(fd))
            self.sock.setblocking(True)   # the descriptor's mode is shared with conn, which blocks
        try:
            return self.sock.send(frame, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return 0

    def send_raw(self, data: bytes) -> None:
        """Write ``data`` as it is, waiting as long as it takes (the rest of a frame :meth:`try_send` began)."""
        with self.lock:
            self.sock.sendall(data)

    def fileno(self) -> int:
        return self.conn.fileno()

    def close(self) -> None:
        self.conn.close()
        if self.sock is not None:
            self.sock.close()


def widen(conn, size: int = PIPE_BUFFER) -> None:
    """Let the socket under ``conn`` (one end of a duplex ``multiprocessing`` pipe) hold ``size`` bytes in flight,
    as far as the system allows (``net.core.wmem_max``): an answer of that size is then written in one call
    that does not wait for the reader, instead of in pieces, each one a wake-up of the reading process."""
    try:
        sock = socket.socket(fileno=os.dup(conn.fileno()))
    except OSError:     # not a socket (a one-way os.pipe)
        return
    with sock:
        if sock.family != socket.AF_UNIX:
            return
        for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            try:
                if sock.getsockopt(socket.SOL_SOCKET, option) < size:
                    sock.setsockopt(socket.SOL_SOCKET, option, size)
            except OSError:
                pass


def _read_exactly(fd: int, n: int, at_start: bool = False) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = os.readv(fd, [view[got:]])
        if k == 0:
            if at_start and got == 0:
                raise EOFError
            raise OSError("got end of file during message")
        got += k
    return buf


def _write_all(fd: int, buffers) -> None:
    views = [memoryview(b).cast("B") for b in buffers if len(b)]
    while views:
        n = os.writev(fd, views)
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if n:
            views[0] = views[0][n:]


def frame(data: bytes) -> bytes:
    """``data`` as ``Connection.send_bytes`` puts it on the pipe (its length first), for ``recv_bytes``."""
    return struct.pack("!i", len(data)) + data


class Outbox:
    """What the server sends one worker, in order, without ever waiting on the worker.

    :meth:`put` writes a message at once, from the calling thread, when
    nothing is queued or being written before it and the pipe takes it
    whole without waiting; otherwise the message (or what a partial write
    left of it) is queued for the sender thread (:meth:`run`), which waits
    on the pipe as long as it takes. ``put(None)``: close (what is queued
    is still written, then :meth:`run` returns).
    """

    def __init__(self, channel: Channel):
        self.channel = channel
        self.cond = threading.Condition()
        self.queue = collections.deque()   # (raw, data): the rest of a started frame, or a whole message
        self.writing = False               # the sender thread is writing
        self.closed = False

    def put(self, data: bytes | None) -> None:
        with self.cond:
            if self.closed:
                return
            if data is None:
                self.closed = True
            elif self.queue or self.writing or len(data) > DIRECT_MAX:
                self.queue.append((False, data))
            else:
                whole = frame(data)
                try:
                    n = self.channel.try_send(whole)
                except OSError:      # a broken pipe: the sender thread meets the error again and reports it
                    n = 0
                if n == len(whole):
                    return
                self.queue.append((True, whole[n:]) if n else (False, data))
            self.cond.notify()

    def run(self) -> None:
        """The sender thread: write what is queued until closed; ``OSError``/``ValueError``: the pipe failed."""
        while True:
            with self.cond:
                while not self.queue and not self.closed:
                    self.cond.wait()
                if not self.queue:
                    return
                raw, data = self.queue.popleft()
                self.writing = True
            try:
                if raw:
                    self.channel.send_raw(data)
                else:
                    self.channel.send_bytes(data)
            finally:
                with self.cond:
                    self.writing = False


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
