"""A private, throw-away copy of a task's repository (no git history)."""
from __future__ import annotations

import difflib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

# Never part of the repository state (caches, the hidden-test dir tasks write at grading).
IGNORED_PARTS = frozenset({"__pycache__", ".git", ".pytest_cache", ".ruff_cache", ".c2jax_hidden"})
MAX_SNAPSHOT_FILE_BYTES = 1 << 20


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
        root = Path(tempfile.mkdtemp(prefix=f"c2jax-ws-{_safe(task.task_id)}-", dir=base_dir))
        path = root / "repo"
        path.mkdir()
        mounted = sandbox.mount_quota(path) if sandbox is not None and hasattr(sandbox, "mount_quota") else False
        for rel, content in task.files.items():
            p = path / _check_rel(rel)
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(content)
        uid = sandbox.prepare_dir(path) if sandbox is not None else None
        return cls(root, path, task.files, uid, mounted)

    def install_hidden_tests(self, task: Any) -> list[str]:
        """Copies task.hidden_tests in (grading time only); returns the paths written.

        c2jax.tasks' Task.grade does this itself; this is for graders that do not.
        """
        for rel, content in task.hidden_tests.items():
            p = self.path / _check_rel(rel)
            if p.is_symlink() or p.is_dir():
                _remove(p)
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(content)
            self.hidden_installed.append(rel)
            if self.uid is not None:
                os.chown(p.parent, self.uid, self.uid, follow_symlinks=False)
        return list(self.hidden_installed)

    def snapshot(self) -> dict[str, str]:
        """Current text of every regular file (symlinks are reported, never followed)."""
        out: dict[str, str] = {}
        for dirpath, dirnames, filenames in os.walk(self.path):
            dirnames[:] = sorted(d for d in dirnames if d not in IGNORED_PARTS)
            for name in sorted(filenames):
                p = Path(dirpath) / name
                rel = p.relative_to(self.path).as_posix()
                if rel in self.hidden_installed or name.endswith(".pyc"):
                    continue
                if p.is_symlink():
                    out[rel] = f"<symlink to {os.readlink(p)}>"
                    continue
                try:
                    if p.stat().st_size > MAX_SNAPSHOT_FILE_BYTES:
                        out[rel] = "<large file>"
                    else:
                        out[rel] = p.read_text()
                except (UnicodeDecodeError, OSError):
                    out[rel] = "<binary>"
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


def _safe(s: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in s)[:40]


def _check_rel(rel: str) -> str:
    if rel.startswith("/") or ".." in Path(rel).parts or not rel:
        raise ValueError(f"task file path {rel!r} must be relative and inside the repository")
    return rel


def _remove(p: Path):
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)
    else:
        p.unlink()
