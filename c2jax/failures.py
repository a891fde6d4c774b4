"""One line for a failure the user can fix: what went wrong, on which path, and what to do.

`one_line(exc)` is what the CLI prints instead of a traceback (None: a bug, keep the traceback).
I/O errors are found anywhere in the exception's cause chain, so a full disk hit inside orbax or
tensorstore still reads as "disk full ... PATH".
"""
from __future__ import annotations

import errno
import logging
import re

from c2jax.errors import ConfigError, UserError

# Exceptions (by class name) whose message already tells the user what to do.
USER_ERRORS = {"PipelineError", "CorpusError", "CheckpointError", "TrainingDiverged", "FileNotFoundError",
               "SandboxUnavailable", "TaskError"}

_IO_ADVICE = {
    errno.ENOSPC: "disk full: free space there and rerun (a run resumes from its last finished checkpoint)",
    errno.EDQUOT: "disk quota exceeded: free space there and rerun (a run resumes from its last checkpoint)",
    errno.EROFS: "read-only file system: choose a writable path (e.g. another --workdir)",
    errno.EACCES: "permission denied: choose a path you can write (e.g. another --workdir) or fix its permissions",
    errno.EPERM: "operation not permitted: choose a path you can write or fix its permissions",
    errno.ENOENT: "no such file or directory: check the path",
    errno.ENOTDIR: "a path component is not a directory: check the path",
    errno.EISDIR: "is a directory where a file was expected: check the path",
    errno.EIO: "I/O error from the device: check the disk",
}
# Errors raised by C++ libraries (tensorstore) carry the OS message only as text.
_TEXT_ERRNOS = {"No space left on device": errno.ENOSPC, "Disk quota exceeded": errno.EDQUOT,
                "Read-only file system": errno.EROFS, "Permission denied": errno.EACCES}


def cause_chain(exc):
    """exc, then each error it was raised from or during, innermost last (cycles cut)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def io_error(exc: BaseException) -> tuple[int, str | None] | None:
    """(errno, path or None) of the first OS-level error in exc's cause chain, else None."""
    for e in cause_chain(exc):
        if isinstance(e, OSError) and e.errno in _IO_ADVICE:
            return e.errno, e.filename
    for e in cause_chain(exc):
        text = str(e)
        for needle, code in _TEXT_ERRNOS.items():
            if needle in text:
                m = re.search(r"(/[^\s'\"\],:]+)", text)
                return code, m.group(1) if m else None
    return None


def one_line(exc: BaseException) -> str | None:
    """The message to print for a user-fixable failure, or None for one that deserves a traceback."""
    if isinstance(exc, ConfigError):
        return f"config error: {_flat(exc)}"
    if isinstance(exc, UserError) or type(exc).__name__ in USER_ERRORS:
        return f"error ({type(exc).__name__}): {_flat(exc)}"
    io = io_error(exc)
    if io is not None:
        code, path = io
        where = f" at {path}" if path else ""
        return f"error ({errno.errorcode.get(code, code)}){where}: {_IO_ADVICE[code]}"
    return None


def _flat(exc) -> str:
    return " ".join(str(exc).split())


class HoldSaveErrors(logging.Filter):
    """Holds back library log records about a failed write (orbax's background save threads log
    each failure, with its traceback, before the error reaches the caller): an I/O error, or any
    error inside a temporary checkpoint directory. The CLI drops them when it reports the failure
    in one line, and logs them after all (`release`) when the command ends without one."""

    def __init__(self):
        super().__init__()
        self.held: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        exc = record.exc_info[1] if record.exc_info else None
        text = record.getMessage()
        m = re.search(r"\[Errno (\d+)\]", text)
        about_a_write = ((exc is not None and io_error(exc) is not None) or ".orbax-checkpoint-tmp" in text
                         or (m is not None and int(m.group(1)) in _IO_ADVICE) or any(n in text for n in _TEXT_ERRNOS))
        if about_a_write:
            self.held.append(record)
        return not about_a_write

    def release(self) -> None:
        """Log the held records after all (the command did not end in a reported failure)."""
        held, self.held = self.held, []
        for record in held:
            for handler in logging.getLogger().handlers:
                handler.handle(record)


def hold_library_save_errors(names=("absl", "orbax")) -> HoldSaveErrors:
    """Install one HoldSaveErrors on the named loggers (the CLI does, unless --debug), and make
    the harmless "Event loop is closed" that in-flight array writes raise after a failed save's
    close quiet; returns the filter."""
    import sys
    hold = HoldSaveErrors()
    for name in names:
        logger = logging.getLogger(name)
        for f in [f for f in logger.filters if isinstance(f, HoldSaveErrors)]:
            logger.removeFilter(f)
        logger.addFilter(hold)
    default = sys.unraisablehook

    def unraisable(u):
        if not (isinstance(u.exc_value, RuntimeError) and str(u.exc_value) == "Event loop is closed"):
            default(u)
    if getattr(sys.unraisablehook, "__name__", "") != "unraisable":
        sys.unraisablehook = unraisable
    return hold
