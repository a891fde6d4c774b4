"""A private, throw-away copy of a task's repository (no git history).

Model-written code owns the tree, so every host-side access (snapshots, diffs, installing hidden
tests) goes through c2jax.filetree (`read_tree` / `write_tree_files` / `remove_tree_path`, which
this module re-exports): no link is followed, only regular files are read, and as root the
access runs with the filesystem uid of the tree's owner.
"""
from __future__ import annotations

import difflib
import functools
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from c2jax.filetree import check_rel, read_tree, remove_tree_path, write_tree_files  # noqa: F401 (re-exported)


class Workspace:
    def __init__(self, root: Path, path: Path, original: dict[str, str], uid: int | None,
                 quota_mounted: bool = False):
        self.root = root          # private temp dir (0700, root-owned when running as root)
        self.path = path          # the repository; mounted at /task in the sandbox
        self.original = dict(original)
        self.uid = uid            # the sandbox uid that owns `path` (None: the current user)
        self.hidden_installed: list[str] = []
        self.quota_mounted = quota_mounted   # `path` is a size-capped tmpfs (see Sandbox.mount_quota)

    @classmethod
    def create(cls, task: Any, base_dir: Path | None = None, sandbox: Any = None) -> Workspace:
        _sweep_once(str(base_dir or tempfile.gettempdir()))
        root = Path(tempfile.mkdtemp(prefix=f"{_owner_prefix()}{_safe(task.task_id)}-", dir=base_dir))
        path = root / "repo"
        path.mkdir()
        mounted = sandbox.mount_quota(path) if sandbox is not None and hasattr(sandbox, "mount_quota") else False
        for rel, content in task.files.items():
            p = path / check_rel(rel)
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(content)
        uid = sandbox.prepare_dir(path) if sandbox is not None else None
        return cls(root, path, task.files, uid, mounted)

    def install_hidden_tests(self, task: Any) -> list[str]:
        """Copies task.hidden_tests in (grading time only); returns the paths written.

        c2jax.tasks' Task.grade does this itself; this is for graders that do not.
        """
        write_tree_files(self.path, task.hidden_tests)
        self.hidden_installed.extend(task.hidden_tests)
        return list(self.hidden_installed)

    def snapshot(self) -> dict[str, str]:
        """Current text of every regular file (links are reported, never followed)."""
        out = read_tree(self.path)
        for rel in self.hidden_installed:
            out.pop(rel, None)
        return out

    def diff(self) -> str:
        """Unified diff of the repository against the task's original files."""
        now = self.snapshot()
        chunks = []
        for rel in sorted(set(self.original) | set(now)):
            a, b = self.original.get(rel), now.get(rel)
            if a == b:
                continue
            chunks.extend(difflib.unified_diff(
                (a or "").splitlines(keepends=True), (b or "").splitlines(keepends=True),
                fromfile=f"a/{rel}" if a is not None else "/dev/null",
                tofile=f"b/{rel}" if b is not None else "/dev/null"))
        return "".join(chunks)

    def lines_changed(self) -> int:
        return count_changed_lines(self.diff())

    def cleanup(self):
        if self.quota_mounted:
            from c2jax.agent.sandbox import Sandbox
            Sandbox.unmount_quota(self.path)
            self.quota_mounted = False
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.cleanup()


def count_changed_lines(diff: str) -> int:
    """Lines added plus lines removed in a unified diff (file headers not counted)."""
    return sum(1 for line in diff.splitlines()
               if line[:1] in "+-" and not line.startswith(("+++", "---")))


# A workspace's name carries its process (pid namespace and pid), so a later process can remove
# what a killed one (SIGKILL, the OOM killer: no atexit) left behind, tmpfs quota mounts included.
_OWNED = re.compile(r"^c2jax-ws-(\d+)-(\d+)-")


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _owner_prefix() -> str:
    return f"c2jax-ws-{_pid_namespace()}-{os.getpid()}-"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale_workspaces(base_dir: str) -> int:
    """Removes the workspaces under base_dir whose process (in this pid namespace) is gone,
    unmounting a quota tmpfs left on one first; returns how many were removed."""
    ns, removed = _pid_namespace(), 0
    try:
        names = os.listdir(base_dir)
    except OSError:
        return 0
    for name in names:
        m = _OWNED.match(name)
        if not m or int(m.group(1)) != ns or _alive(int(m.group(2))):
            continue
        root = os.path.join(base_dir, name)
        repo = os.path.join(root, "repo")
        if os.path.ismount(repo):
            from c2jax.agent.sandbox import Sandbox
            Sandbox.unmount_quota(Path(repo))
        shutil.rmtree(root, ignore_errors=True)
        removed += not os.path.exists(root)
    return removed


@functools.lru_cache(maxsize=None)
def _sweep_once(base_dir: str) -> int:
    return sweep_stale_workspaces(base_dir)


def _safe(s: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in s)[:40]
