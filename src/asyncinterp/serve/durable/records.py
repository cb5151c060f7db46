"""Small JSON records and byte blobs under a state directory, written so that a crash never leaves half of one.

Why this module exists: files, batches and runtime edits must survive a
``kill -9`` of the server. Each record is one JSON document per id, written
to a temporary file, flushed to disk and renamed over the old one (a rename
is atomic on POSIX), so a reader sees the old record or the new one, never
a torn one. Blobs (uploaded files, batch outputs) are written the same way;
:class:`AppendLog` is the one file that grows in place (a batch's answered
lines), and it drops a torn last line when reopened.

Who owns a record is a hash of the API key that created it
(:func:`owner_of`): the key itself is never stored.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import tempfile

__all__ = ["AppendLog", "Records", "new_id", "owner_of"]

_ID = re.compile(r"^[A-Za-z0-9_\-][A-Za-z0-9_.\-]{0,127}$")      # never a hidden name, never a path
ANONYMOUS = "anonymous"      # the owner of everything on a server without API keys


def owner_of(api_key: str | None) -> str:
    """The owner id of a request made with ``api_key`` (``None``: a server without keys)."""
    if not api_key:
        return ANONYMOUS
    return "key-" + hashlib.sha256(api_key.encode("utf-8", "replace")).hexdigest()[:32]


def new_id(prefix: str) -> str:
    """An unguessable id (128 random bits) such as ``file-3f2a...`` or ``batch_9c1e...``."""
    return prefix + secrets.token_hex(16)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str, data: bytes) -> None:
    """Replace ``path`` with ``data``: the old bytes or the new, never a mix, across a crash."""
    folder = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_dir(folder)


class Records:
    """JSON records of one kind (``files``, ``batches``, ``edits``) under ``root/kind``, by id."""

    def __init__(self, root: str, kind: str):
        self.dir = os.path.join(root, kind)
        os.makedirs(self.dir, exist_ok=True)

    def path(self, rid: str, suffix: str = ".json") -> str:
        if not isinstance(rid, str) or not _ID.match(rid):
            raise KeyError(rid)
        return os.path.join(self.dir, rid + suffix)

    def put(self, rid: str, record: dict) -> None:
        write_atomic(self.path(rid), json.dumps(record, sort_keys=True).encode())

    def get(self, rid: str) -> dict | None:
        try:
            with open(self.path(rid), "rb") as f:
                return json.loads(f.read())
        except (KeyError, FileNotFoundError):
            return None

    def delete(self, rid: str, *suffixes: str, only_blobs: bool = False) -> None:
        """Remove the record and its blobs with ``suffixes`` (``only_blobs``: keep the record)."""
        for suffix in (() if only_blobs else (".json",)) + suffixes:
            try:
                os.unlink(self.path(rid, suffix))
            except FileNotFoundError:
                pass

    def all(self) -> list:
        """Every record, oldest first (by ``created_at``, then id)."""
        out = []
        for name in os.listdir(self.dir):
            if name.endswith(".json") and not name.startswith("."):
                record = self.get(name[:-5])
                if record is not None:
                    out.append(record)
        out.sort(key=lambda r: (r.get("created_at", 0), r.get("id", "")))
        return out

    def put_blob(self, rid: str, data: bytes, suffix: str = ".data") -> None:
        write_atomic(self.path(rid, suffix), data)

    def blob_path(self, rid: str, suffix: str = ".data") -> str:
        return self.path(rid, suffix)


class AppendLog:
    """A JSON-lines file that grows one line at a time; reopening it drops a torn last line (a crash mid-write)."""

    def __init__(self, path: str):
        self.path = path
        self.entries = []
        if os.path.exists(path):
            with open(path, "rb") as f:
                data = f.read()
            keep = data.rfind(b"\n") + 1
            for line in data[:keep].splitlines():
                if line.strip():
                    self.entries.append(json.loads(line))
            if keep != len(data):
                with open(path, "r+b") as f:
                    f.truncate(keep)
        self.file = open(path, "ab")

    def append(self, entry: dict) -> None:
        self.file.write(json.dumps(entry, separators=(",", ":")).encode() + b"\n")
        self.file.flush()
        os.fsync(self.file.fileno())
        self.entries.append(entry)

    def close(self) -> None:
        self.file.close()
