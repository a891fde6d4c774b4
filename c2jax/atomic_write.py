"""Write a small file so that readers see the old content or the new, never a torn one: a
temporary file beside it, then a rename; on failure (a full disk) the temporary file is removed
and the old file is left as it was."""
from __future__ import annotations

import os


def write_text_atomic(path: str, text: str) -> None:
    """Replace `path`'s content with `text` atomically (the old file stays intact on any error)."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
