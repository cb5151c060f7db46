"""Operating-system confinement of the worker process that runs submitted code (seccomp-bpf).

Why: the Python sandbox (:mod:`.sandbox`) is the first line, and Python has
no real in-process sandbox: a bug in its checks, in CPython or in a torch
operator may let determined code escape it. This module is the second line.
Once a worker has been forked, has sealed what it inherited and holds its
channel to the server (:func:`~.worker_proc.prepare`), :func:`install` loads
a seccomp filter into it, so that even code that escaped the Python sandbox
reaches no file, network or process:

* **no new privileges** (``prctl(PR_SET_NO_NEW_PRIVS)``, set by libseccomp);
* **no exec, no new process**: ``execve``/``execveat``, ``fork``/``vfork``
  and ``clone`` without ``CLONE_THREAD`` fail (threads still start: torch and
  the worker use them; ``clone3``, whose flags a filter cannot read, answers
  ``ENOSYS`` so that the C library falls back to ``clone``);
* **no new network sockets**: ``socket()`` fails for every family;
  ``socketpair(AF_UNIX)`` stays (the worker's event loop wakes itself with
  one), and the channel to the server is a pipe it already holds;
* **no file writes**: ``open``/``openat`` with a write access mode,
  ``O_CREAT`` or ``O_TRUNC``, ``creat``, ``openat2`` and everything that
  changes the file system (unlink, rename, mkdir, link, chmod, chown,
  truncate, mknod) fail; reading files (torch loads kernels lazily) and
  writing to descriptors it already holds (its pipe, stderr) still work.
  torch's CPU inference needs nothing else (checked: no ``/dev/shm`` file);
* **nothing else reachable**: ``ptrace``, ``process_vm_readv/writev``,
  ``kill``/``tgkill`` of another process, ``io_uring`` (whose operations
  seccomp cannot see), ``bpf``, ``perf_event_open``, ``userfaultfd``,
  ``mount``, ``unshare``, ``setns``, ``chroot``, key management.

Denied calls fail with ``EPERM`` (the code sees a ``PermissionError``); the
process lives on and keeps serving. The filter uses libseccomp through the
``pyseccomp`` binding (ctypes over the system's ``libseccomp.so.2``).

Where this cannot be done (not Linux, no libseccomp, a kernel without
seccomp filters, in-thread isolation where submitted code runs in the server
process itself), the server says so when it starts: a log line and the
``confinement`` field of ``GET /v1/health`` (:func:`at_start`).
"""

from __future__ import annotations

import errno
import logging
import os
import sys

log = logging.getLogger("asyncinterp.serve")

# Linux constants (x86_64 and aarch64 share these values)
_CLONE_THREAD = 0x00010000
_AF_UNIX = 1
_O_ACCMODE = 0o3
_O_WRONLY = 0o1
_O_RDWR = 0o2
_O_CREAT = 0o100
_O_TRUNC = 0o1000

#: refused outright (EPERM), when the platform knows the call
DENIED = (
    "execve", "execveat", "fork", "vfork", "creat", "ptrace", "process_vm_readv", "process_vm_writev",
    "unlink", "unlinkat", "rename", "renameat", "renameat2", "mkdir", "mkdirat", "rmdir", "link", "linkat",
    "symlink", "symlinkat", "chmod", "fchmodat", "fchmodat2", "chown", "lchown", "fchownat", "truncate",
    "mknod", "mknodat", "io_uring_setup", "io_uring_enter", "io_uring_register", "bpf", "perf_event_open",
    "userfaultfd", "mount", "umount2", "unshare", "setns", "chroot", "pivot_root", "add_key", "request_key",
    "keyctl", "socket", "kexec_load", "init_module", "finit_module", "delete_module", "name_to_handle_at",
    "open_by_handle_at",
)
#: answered with ENOSYS: the C library falls back to a call the filter can read the arguments of
UNSUPPORTED = ("clone3", "openat2")


class ConfinementUnavailable(RuntimeError):
    """The platform cannot confine a process with seccomp (the reason says why)."""


def _binding():
    if not sys.platform.startswith("linux"):
        raise ConfinementUnavailable(f"seccomp exists only on Linux (this is {sys.platform})")
    try:
        import pyseccomp
    except ImportError as exc:
        raise ConfinementUnavailable(f"the libseccomp binding is missing (pip install pyseccomp: {exc})") from None
    except OSError as exc:   # the binding loads libseccomp.so.2 when imported
        raise ConfinementUnavailable(f"libseccomp cannot be loaded ({exc})") from None
    return pyseccomp


def _kernel_supports_filters() -> bool:
    try:
        with open("/proc/self/status") as f:
            return any(line.startswith("Seccomp_filters:") or line.startswith("Seccomp:") for line in f)
    except OSError:
        return False


def probe() -> str | None:
    """``None`` if this process could confine a worker; else the reason it cannot (said at start)."""
    try:
        sc = _binding()
        if not _kernel_supports_filters():
            return "the kernel does not offer seccomp filters (no Seccomp line in /proc/self/status)"
        build(sc)      # everything but loading it: unknown calls or a broken library show here
    except ConfinementUnavailable as exc:
        return str(exc)
    except Exception as exc:  # noqa: BLE001 - any failure of the library is a reason, said at start
        return f"the seccomp filter cannot be built ({type(exc).__name__}: {exc})"
    return None


def _rule(flt, action, name, *args) -> bool:
    try:
        flt.add_rule(action, name, *args)
    except Exception:  # noqa: BLE001 - a call this kernel/architecture does not have: nothing to deny
        return False
    return True


def build(sc=None):
    """The filter (a ``pyseccomp.SyscallFilter``), not yet loaded."""
    sc = sc or _binding()
    flt = sc.SyscallFilter(sc.ALLOW)
    flt.set_attr(sc.Attr.CTL_NNP, 1)          # no new privileges (set when the filter loads)
    try:
        flt.set_attr(sc.Attr.CTL_TSYNC, 1)    # every thread of the process, not only the caller
    except Exception:  # noqa: BLE001 - old libseccomp: the worker loads it before starting threads anyway
        pass
    deny = sc.ERRNO(errno.EPERM)
    for name in DENIED:
        _rule(flt, deny, name)
    for name in UNSUPPORTED:
        _rule(flt, sc.ERRNO(errno.ENOSYS), name)
    # a new process: clone without CLONE_THREAD (threads keep working)
    _rule(flt, deny, "clone", sc.Arg(0, sc.MASKED_EQ, _CLONE_THREAD, 0))
    # new sockets of any family but AF_UNIX pairs (the event loop's self-pipe)
    _rule(flt, deny, "socketpair", sc.Arg(0, sc.NE, _AF_UNIX))
    # file writes: a write access mode, O_CREAT or O_TRUNC
    for name, flags in (("open", 1), ("openat", 2)):
        _rule(flt, deny, name, sc.Arg(flags, sc.MASKED_EQ, _O_ACCMODE, _O_WRONLY))
        _rule(flt, deny, name, sc.Arg(flags, sc.MASKED_EQ, _O_ACCMODE, _O_RDWR))
        _rule(flt, deny, name, sc.Arg(flags, sc.MASKED_EQ, _O_CREAT, _O_CREAT))
        _rule(flt, deny, name, sc.Arg(flags, sc.MASKED_EQ, _O_TRUNC, _O_TRUNC))
    # signals to another process (the server, other workers); to itself and its own threads they still work
    pid = os.getpid()
    _rule(flt, deny, "kill", sc.Arg(0, sc.NE, pid))
    _rule(flt, deny, "tgkill", sc.Arg(0, sc.NE, pid))
    _rule(flt, deny, "tkill", sc.Arg(0, sc.NE, pid))
    _rule(flt, deny, "pidfd_open", sc.Arg(0, sc.NE, pid))
    _rule(flt, deny, "pidfd_send_signal")
    return flt


def install() -> None:
    """Confine this process (and its threads) for the rest of its life; raises :class:`ConfinementUnavailable`."""
    sc = _binding()
    try:
        build(sc).load()
    except Exception as exc:  # noqa: BLE001
        raise ConfinementUnavailable(f"loading the seccomp filter failed ({type(exc).__name__}: {exc})") from None


def wanted_for(pool) -> bool:
    """Whether ``pool``'s worker is to be confined: it runs submitted code (the ``code`` pool, or the one pool
    when submitted code has no worker of its own) and the server found at start that it can confine it."""
    server = pool.sup.server
    if not getattr(server, "confinement", {}).get("active"):
        return False
    return pool.name == "code" or ("code" not in pool.sup.pools and server.allow_code)


def status_of(pid: int | str = "self") -> dict:
    """What ``/proc/PID/status`` says about a process's confinement: ``{"seccomp": 2, "no_new_privs": 1}``."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("Seccomp", "NoNewPrivs"):
                    out["seccomp" if key == "Seccomp" else "no_new_privs"] = int(value.split()[0])
    except (OSError, ValueError):
        pass
    return out


def at_start(server) -> dict:
    """Decide and say (one log line) whether submitted code runs confined; the ``confinement`` health field."""
    if not server.allow_code:
        return {"active": False, "reason": "this server runs no submitted code"}
    if not server.supervised:
        reason = ("isolation='thread': submitted code runs in the server process, which cannot be confined (it "
                  "serves the network); start the server with process isolation (--isolation process) to confine it")
        log.warning("submitted code is NOT confined by the operating system: %s", reason)
        return {"active": False, "reason": reason}
    wanted = getattr(server.batcher.options, "confine", "auto")
    if not wanted:
        reason = "turned off (ProcessIsolation(confine=False))"
        log.warning("submitted code is NOT confined by the operating system: %s", reason)
        return {"active": False, "reason": reason}
    reason = probe()
    if reason is not None:
        if wanted is True:
            raise ConfinementUnavailable(f"ProcessIsolation(confine=True) but this platform cannot confine the "
                                         f"worker: {reason}")
        log.warning("submitted code is NOT confined by the operating system: %s", reason)
        return {"active": False, "reason": reason}
    log.info("submitted code runs in a worker process confined by seccomp (no exec, no new process, no new "
             "socket, no file writes, no new privileges)")
    return {"active": True, "seccomp": "no exec, no new process, no new socket, no file writes, no new privileges"}
