"""The one way the host reads or writes a tree that model-written code owns (a task's workspace).

Paths are opened one directory at a time with O_NOFOLLOW, a link is reported (never followed),
only regular files are read, and where the harness runs as root the access runs with the
filesystem uid of the tree's owner (setfsuid, per thread), so a hard link or a bind the owner
cannot read stays unread. c2jax.agent.workspace (snapshots, diffs, hidden tests) and the task
verifiers of c2jax.tasks (grading) both go through it.
"""
from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path

# Never part of the repository state (caches, the hidden-test dir tasks write at grading).
IGNORED_PARTS = frozenset({"__pycache__", ".git", ".pytest_cache", ".ruff_cache", ".c2jax_hidden"})
MAX_SNAPSHOT_FILE_BYTES = 1 << 20


def check_rel(rel: str) -> str:
    """`rel` when it is a relative path inside the tree; else ValueError."""
    if rel.startswith("/") or ".." in Path(rel).parts or not rel:
        raise ValueError(f"task file path {rel!r} must be relative and inside the repository")
    return rel


# ----- safe access to a tree the model controls ------------------------------------------------

_LIBC: list = []


def _setfsid(uid: int, gid: int) -> None:
    if not _LIBC:
        import ctypes
        _LIBC.append(ctypes.CDLL(None, use_errno=True))
    _LIBC[0].setfsgid(gid)
    _LIBC[0].setfsuid(uid)
    if _LIBC[0].setfsuid(-1) != uid:  # an invalid id changes nothing and returns the current one
        raise PermissionError(f"setfsuid({uid}) did not take effect; refusing to read the tree as root")


@contextlib.contextmanager
def as_owner(top_fd: int):
    """Filesystem accesses of this thread run as the owner of the directory `top_fd` (when the
    harness is root and the owner is not).

    setfsuid drops the filesystem capabilities too (CAP_DAC_OVERRIDE ...); it is per thread,
    so other threads of the harness keep their rights. The caller opens `top_fd` first: the
    tree's parent may be private to root.
    """
    st = os.fstat(top_fd)
    if not hasattr(os, "geteuid") or os.geteuid() != 0 or st.st_uid == 0:
        yield
        return
    _setfsid(st.st_uid, st.st_gid)
    try:
        yield
    finally:
        _setfsid(0, 0)


def _open_root(root: Path) -> int:
    return os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)


def read_tree(root: Path, ignored: frozenset[str] = IGNORED_PARTS,
              max_bytes: int = MAX_SNAPSHOT_FILE_BYTES) -> dict[str, str]:
    """Text of every regular file under `root` (relative posix paths), never following a link.

    Links read as "<symlink to TARGET>", hard-linked files as "<hard link>", other non-regular
    files as "<special file>", undecodable ones as "<binary>", big ones as "<large file>".
    Directories named in `ignored` and *.pyc files are skipped.
    """
    out: dict[str, str] = {}
    top = _open_root(Path(root))
    try:
        with as_owner(top):
            _read_dir(top, "", ignored, max_bytes, out)
    finally:
        os.close(top)
    return dict(sorted(out.items()))


def _read_dir(dfd: int, prefix: str, ignored, max_bytes: int, out: dict[str, str]) -> None:
    try:
        names = sorted(os.listdir(dfd))
    except OSError:
        return
    for name in names:
        rel = prefix + name
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISLNK(st.st_mode):
            try:
                out[rel] = f"<symlink to {os.readlink(name, dir_fd=dfd)}>"
            except OSError:
                out[rel] = "<symlink>"
        elif stat.S_ISDIR(st.st_mode):
            if name in ignored:
                continue
            try:
                sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dfd)
            except OSError:
                out[rel + "/"] = "<unreadable directory>"
                continue
            try:
                _read_dir(sub, rel + "/", ignored, max_bytes, out)
            finally:
                os.close(sub)
        elif name.endswith(".pyc"):
            continue
        else:
            out[rel] = _read_file(dfd, name, max_bytes)


def _read_file(dfd: int, name: str, max_bytes: int) -> str:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dfd)
    except OSError:
        return "<unreadable>"
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return "<special file>"
        if st.st_nlink > 1:
            return "<hard link>"
        if st.st_size > max_bytes:
            return "<large file>"
        chunks, left = [], max_bytes + 1
        while left > 0:
            b = os.read(fd, min(left, 1 << 16))
            if not b:
                break
            chunks.append(b)
            left -= len(b)
        data = b"".join(chunks)
        if len(data) > max_bytes:
            return "<large file>"
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "<binary>"
    except OSError:
        return "<unreadable>"
    finally:
        os.close(fd)


def write_tree_files(root: Path, files: dict[str, str]) -> None:
    """Writes `files` (relative path -> text) under `root`, replacing whatever the model left at
    those paths (a link, a directory, a file) and following no link; as the tree's owner."""
    top = _open_root(Path(root))
    try:
        with as_owner(top):
            for rel, content in files.items():
                parts = Path(check_rel(rel)).parts
                dfd = os.dup(top)
                try:
                    for part in parts[:-1]:
                        dfd = _enter_dir(dfd, part)
                    _replace_file(dfd, parts[-1], content.encode())
                finally:
                    os.close(dfd)
    finally:
        os.close(top)


def _enter_dir(dfd: int, part: str) -> int:
    """fd of the real directory `part` in dfd (made if missing; a link or file there is removed)."""
    try:
        st = os.stat(part, dir_fd=dfd, follow_symlinks=False)
        if not stat.S_ISDIR(st.st_mode):
            os.unlink(part, dir_fd=dfd)
            os.mkdir(part, 0o755, dir_fd=dfd)
    except FileNotFoundError:
        os.mkdir(part, 0o755, dir_fd=dfd)
    nfd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dfd)
    os.close(dfd)
    return nfd


def _remove_at(dfd: int, name: str) -> None:
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dfd)
        try:
            for child in os.listdir(sub):
                _remove_at(sub, child)
        finally:
            os.close(sub)
        os.rmdir(name, dir_fd=dfd)
    else:
        os.unlink(name, dir_fd=dfd)


def _replace_file(dfd: int, name: str, data: bytes) -> None:
    _remove_at(dfd, name)
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=dfd)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def remove_tree_path(root: Path, rel: str) -> None:
    """Removes `rel` under `root` (file, link or directory tree), following no link."""
    parts = Path(check_rel(rel)).parts
    dfd = _open_root(Path(root))
    try:
        with as_owner(dfd):
            for part in parts[:-1]:
                try:
                    nfd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dfd)
                except OSError as e:
                    if e.errno in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR):
                        return
                    raise
                os.close(dfd)
                dfd = nfd
            _remove_at(dfd, parts[-1])
    finally:
        os.close(dfd)
