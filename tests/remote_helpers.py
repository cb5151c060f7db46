"""A uvicorn server in a thread of the test process, on a free loopback port (the remote tests' live server)."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Live:
    """Serve ``app`` (default: the server's own, ``server.asgi``, as its CLI does; or any ASGI app) with uvicorn in a
    daemon thread; ``close()`` stops it."""

    def __init__(self, server, app=None, lifespan="on"):
        self.server = server
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app or server.asgi, host="127.0.0.1", port=self.port, log_level="warning",
                                access_log=False, lifespan=lifespan)
        self.uv = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.uv.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.uv.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)

    def close(self):
        self.uv.should_exit = True
        self.thread.join(15)
        if self.server is not None:
            self.server.batcher.close()
        assert not self.thread.is_alive()
