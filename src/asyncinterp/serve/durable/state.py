"""A server's durable state: its state directory, the files, batches and runtime edits kept there.

Why this module exists: the server holds one :class:`Durable` (``server.durable``).
It makes the stores on first use (a server that never sees a file, batch or
runtime edit writes nothing), starts the batch runner inside the server's
event loop, and stops it at shutdown. Without a ``state_dir`` the state
lives in a temporary directory for the life of the process: nothing of it
survives a restart, and the server says so in its log.
"""

from __future__ import annotations

import logging
import shutil
import tempfile

from .batch_runner import BatchRunner
from .batches import Batches
from .files import Files
from .records import Records

log = logging.getLogger("asyncinterp.serve")

__all__ = ["Durable"]


class Durable:
    """The state directory of ``server`` (``state_dir``: a path; ``None``: a temporary one)."""

    def __init__(self, server, state_dir: str | None = None):
        self.server = server
        self.state_dir = state_dir
        self.temporary = state_dir is None
        self._files = self._batches = self._edits = None
        self.started = False

    @property
    def root(self) -> str:
        if self.state_dir is None:
            self.state_dir = tempfile.mkdtemp(prefix="asyncinterp-state-")
            log.warning("no --state-dir: files, batches and runtime edits are kept in %s and do not survive a "
                        "restart", self.state_dir, extra={"fields": {"event": "startup"}})
        return self.state_dir

    @property
    def files(self) -> Files:
        if self._files is None:
            self._files = Files(Records(self.root, "files"))
        return self._files

    @property
    def batches(self) -> Batches:
        if self._batches is None:
            self._batches = Batches(Records(self.root, "batches"), self.files)
            self._batches.runner = BatchRunner(self.server, self._batches)
        return self._batches

    @property
    def edits(self):
        if self._edits is None:
            from ..edit_registry import EditRegistry
            self._edits = EditRegistry(self.server, Records(self.root, "edits"))
        return self._edits

    def start(self, at_startup: bool = False) -> None:
        """In the server's event loop (at its start, or at the first use of its state): stored edits installed,
        unfinished batches resumed."""
        if self.started or (at_startup and self.temporary):
            return       # a temporary state is made at its first use: nothing to resume before that
        self.started = True
        self.edits.load()
        self.batches.runner.start()

    async def close(self) -> None:
        if self._batches is not None:
            await self._batches.runner.stop()
        if self.temporary and self.state_dir is not None:
            shutil.rmtree(self.state_dir, ignore_errors=True)
