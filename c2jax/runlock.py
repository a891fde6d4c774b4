"""One run per directory: an exclusive lock on DIR/.lock held for a job's life.

    with workdir_lock(workdir):        # raises WorkdirLocked at once if another process holds it
        ...                            # train / sample / write checkpoints

The lock is fcntl.flock on the file, so the kernel drops it when its process exits for any reason
(SIGTERM, SIGKILL, a crash): a lock left by a dead process is never in the way. The file records
the holder's pid, host and start time for the message a second launch prints. Only process 0 of
a multi-process job takes it (the others share the run).
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time

from c2jax.errors import UserError, WorkdirLocked

LOCK_NAME = ".lock"


def _holder(path: str) -> str:
    try:
        with open(path) as f:
            info = json.loads(f.read() or "{}")
    except (OSError, ValueError):
        info = {}
    if not info:
        return "another process (it has not recorded its pid yet)"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.get("time", 0)))
    who = f"pid {info.get('pid')} on host {info.get('host')} (since {since})"
    if info.get("host") == socket.gethostname() and not _alive(info.get("pid")):
        who += ", which has exited: a process it forked still holds the lock; stop that process"
    return who


def _alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except (OSError, TypeError, ValueError) as e:
        return isinstance(e, PermissionError)
    return True


def _busy(path: str) -> WorkdirLocked:
    return WorkdirLocked(f"{os.path.dirname(path)} is in use by {_holder(path)}; wait for that run to finish "
                         f"or stop it, or use another --workdir")


class WorkdirLock:
    """An exclusive, non-blocking lock on `workdir/.lock`; `acquire` raises WorkdirLocked naming
    the holder's pid and host when another process has it."""

    def __init__(self, workdir: str):
        self.path = os.path.join(os.path.abspath(workdir), LOCK_NAME)
        self._fd = None

    def acquire(self) -> "WorkdirLock":
        """Take the lock (creating the directory and lock file) or raise WorkdirLocked at once."""
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise UserError(f"cannot create the run lock {self.path}: {e.strerror}; "
                            f"choose a writable --workdir") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            raise _busy(self.path) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                  "time": time.time()}).encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        """Drop the lock (idempotent); the file stays, emptied, for the next run."""
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, 0)
        except OSError:
            pass
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None


def ensure_free(workdir: str) -> None:
    """Raise WorkdirLocked if another process holds `workdir`'s lock (a cheap check a launcher can
    make before its slow imports; it creates nothing and holds nothing)."""
    path = os.path.join(os.path.abspath(workdir), LOCK_NAME)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise _busy(path) from None
        raise
    finally:
        os.close(fd)


@contextlib.contextmanager
def workdir_lock(workdir: str, primary: bool | None = None):
    """Hold `workdir`'s lock for the block. `primary` (default: jax.process_index() == 0) says
    whether this process takes it; the other processes of a multi-process job do not."""
    if primary is None:
        import jax
        primary = jax.process_index() == 0
    lock = WorkdirLock(workdir)
    if primary:
        lock.acquire()
    try:
        yield lock
    finally:
        lock.release()
