"""Posting a job and reading its streamed answer over plain HTTP/1.1 keep-alive connections (the standard
library's ``http.client``), without a general-purpose client's layers.

Why a module of its own: a remote trace is one POST and one streamed answer, and on a fast server the
client's own HTTP machinery is a visible part of its round trip (httpx's request building, cookie jar,
transport and h11 layers cost about half a millisecond a request more than ``http.client`` on this
machine, ``benchmarks/remote_roundtrip.py``). :class:`JobPoster` takes that path only where it gives the
same behaviour as httpx's defaults: a plain ``http://`` URL, no proxy from the environment for its host,
and no httpx options given to ``ai.remote`` (anything else, TLS included, goes through httpx). Each thread
keeps its own connection (``http.client`` connections are not shared between threads); a connection the
server closed while it sat idle is noticed before it is reused, and a request it took with it is sent
once more on a fresh one (the server never read it).
"""

from __future__ import annotations

import http.client
import select
import socket
import threading
import urllib.parse
import urllib.request

__all__ = ["JobPoster", "LeanResponse", "usable"]

CONNECT_TIMEOUT = 10.0
DRAIN_TIMEOUT = 1.0          # seconds the end of a left answer may still take
READ_SIZE = 1 << 20


def usable(url: str, httpx_kwargs: dict) -> bool:
    """Whether jobs to ``url`` may take the lean path: plain HTTP, no proxy for its host, no httpx options."""
    if httpx_kwargs:
        return False
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        return False
    proxies = urllib.request.getproxies()
    if (proxies.get("http") or proxies.get("all")) and not urllib.request.proxy_bypass(parts.hostname):
        return False
    return True


class JobPoster:
    """Per-thread keep-alive connections to one server; :meth:`post` sends a body, returns the response."""

    def __init__(self, url: str, read_timeout: float):
        parts = urllib.parse.urlsplit(url)
        self.host = parts.hostname
        self.port = parts.port or 80
        self.prefix = parts.path.rstrip("/")
        self.read_timeout = read_timeout
        self.local = threading.local()
        self.open = set()
        self.lock = threading.Lock()
        self.closed = False

    def post(self, path: str, body: bytes, headers: dict) -> "LeanResponse":
        """POST ``body`` to ``path``; the response once its status line and headers are in (``OSError`` or
        ``http.client.HTTPException`` if the server cannot be reached or answers no HTTP)."""
        headers = {**headers, "content-length": str(len(body))}
        while True:     # at most twice: after a dropped connection, the next one is fresh
            conn, reused = self._connection()
            try:
                # head and body in one write (OneSegmentConnection)
                conn.request("POST", self.prefix + path, body=body, headers=headers)
                return LeanResponse(self, conn, conn.getresponse())
            except (ConnectionError, http.client.RemoteDisconnected, http.client.BadStatusLine):
                self.drop(conn)
                if not reused:
                    raise
                # the idle connection was closed under us: the server never read the request, send it again
            except BaseException:
                self.drop(conn)
                raise

    def close(self) -> None:
        with self.lock:
            self.closed = True
            conns, self.open = list(self.open), set()
        for conn in conns:
            conn.close()

    def _connection(self):
        conn = getattr(self.local, "conn", None)
        left = getattr(self.local, "left", None)
        if left is not None:            # the end of the previous answer, read now (see LeanResponse.leave)
            self.local.left = None
            if not left.drain():
                conn = None
        if conn is not None and conn.sock is not None and _idle_and_open(conn.sock):
            return conn, True
        if conn is not None:
            self.drop(conn)
        conn = OneSegmentConnection(self.host, self.port, timeout=CONNECT_TIMEOUT)
        conn.connect()
        conn.sock.settimeout(self.read_timeout)
        with self.lock:
            if self.closed:
                conn.close()
                raise ConnectionError("this remote model was closed")
            self.open.add(conn)
        self.local.conn = conn
        return conn, False

    def drop(self, conn) -> None:
        """Close ``conn`` and forget it (its thread opens a new one next time)."""
        conn.close()
        with self.lock:
            self.open.discard(conn)
        if getattr(self.local, "conn", None) is conn:
            self.local.conn = None


class OneSegmentConnection(http.client.HTTPConnection):
    """An ``HTTPConnection`` that writes a request's head and its body (bytes) with one ``send``.

    ``http.client`` writes them apart: the server would see the head, start the request and wait for the body,
    and each write is a system call of its own. The head is a few hundred bytes, a job's body a few kilobytes:
    joining them costs less than a second write (or than corking the socket around two).
    """

    _body_after_head = None

    def endheaders(self, message_body=None, *, encode_chunked=False):
        if isinstance(message_body, bytes) and not encode_chunked:
            self._body_after_head = message_body
            try:
                super().endheaders()      # writes the head, through send() below
            finally:
                self._body_after_head = None
        else:
            super().endheaders(message_body, encode_chunked=encode_chunked)

    def send(self, data):
        body = self._body_after_head
        if body is not None:
            self._body_after_head = None
            data = data + body
        super().send(data)


def _idle_and_open(sock) -> bool:
    """An idle keep-alive connection has nothing to read: readable means the server closed it (or broke)."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return False
    return not readable


class LeanResponse:
    """The answer to :meth:`JobPoster.post`, read as httpx's streamed responses are (``status_code``,
    ``read``, ``iter_bytes``, ``close``); ``close`` from another thread ends a read that waits."""

    def __init__(self, poster: JobPoster, conn, response):
        self.poster = poster
        self.conn = conn
        self.response = response
        self.status_code = response.status
        self.finished = False

    def read(self) -> bytes:
        data = self.response.read()
        self._done()
        return data

    def iter_bytes(self):
        while True:
            chunk = self.response.read1(READ_SIZE)
            if not chunk:
                break
            yield chunk
        self._done()

    def leave(self) -> None:
        """The caller has what it needs (the stream's last event): the end of the body (a few bytes, which may
        still be on their way) is read when this thread next posts, not now."""
        if not self.finished:
            self.finished = True
            self.poster.local.left = self

    def drain(self) -> bool:
        """Read what is left of this answer; whether its connection can serve the next request (``False``: it
        was closed). Nothing but the end of the body may be left, and it must come within a second."""
        try:
            self.conn.sock.settimeout(DRAIN_TIMEOUT)
            extra = self.response.read1(READ_SIZE)
            self.conn.sock.settimeout(self.poster.read_timeout)
        except (OSError, http.client.HTTPException, AttributeError):
            extra = b"?"
        if extra or not self.response.isclosed() or self.response.will_close:
            self.poster.drop(self.conn)
            return False
        return True

    def close(self) -> None:
        """End the exchange: a response not read to its end takes its connection with it."""
        if self.finished:
            return
        self.finished = True
        sock = self.conn.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)    # wakes a read waiting in another thread
            except OSError:
                pass
        self.poster.drop(self.conn)

    def _done(self) -> None:
        if self.response.isclosed() and not self.response.will_close:
            self.finished = True        # read to its end: the connection serves the next request
        else:
            self.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if not self.finished:
            self.close()
