"""config.json and summary.json are replaced atomically: a full disk mid-write leaves the old
file whole and no temporary file behind."""
import errno
import os

import pytest

from c2jax.atomic_write import write_text_atomic
from c2jax.failures import one_line


def test_full_disk_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "config.json"
    write_text_atomic(str(path), '{"old": 1}')

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path) + ".tmp")
    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError) as e:
        write_text_atomic(str(path), '{"new": 2}')
    assert one_line(e.value).startswith(f"error (ENOSPC) at {path}.tmp: disk full")
    assert path.read_text() == '{"old": 1}' and os.listdir(tmp_path) == ["config.json"]
    monkeypatch.undo()
    write_text_atomic(str(path), '{"new": 2}')
    assert path.read_text() == '{"new": 2}' and os.listdir(tmp_path) == ["config.json"]
