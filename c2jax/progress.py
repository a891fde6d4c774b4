"""A heartbeat line for long stages: `label: done/total | elapsed | ETA | note`, printed from a
background thread every few seconds, so that no stage is silent while it works."""
from __future__ import annotations

import sys
import threading
import time


def _clock(seconds: float) -> str:
    s = max(int(seconds), 0)
    return f"{s // 60}m{s % 60:02d}s"


class Heartbeat:
    """Prints one status line every `every` seconds while active (a context manager).

    The caller sets `done` (counted from `start`, e.g. a resumed step) and optionally `note`
    (a string, or a callable returning one) as work finishes; `touch()` marks that the
    caller printed its own line, and the heartbeat then stays quiet for another `every` seconds."""

    def __init__(self, label: str, total: int, every: float = 10.0, stream=None, start: int = 0):
        self.label, self.total, self.every, self.start = label, total, every, start
        self.stream = stream if stream is not None else sys.stderr
        self.done, self.note = start, ""
        self.t0 = self._last = time.monotonic()
        self._stop, self._lock = threading.Event(), threading.Lock()
        self._thread = None

    def line(self) -> str:
        """The status line: done/total, elapsed, ETA from the rate so far, note."""
        elapsed = time.monotonic() - self.t0
        n = self.done - self.start
        eta = _clock(elapsed / n * (self.total - self.done)) if n > 0 else "?"
        parts = [f"{self.label}: {self.done}/{self.total}", f"elapsed {_clock(elapsed)}", f"ETA {eta}"]
        note = self.note() if callable(self.note) else self.note
        return " | ".join(parts + ([note] if note else []))

    def add(self, n: int = 1) -> None:
        """Count n more done (safe from several threads)."""
        with self._lock:
            self.done += n

    def touch(self) -> None:
        """The caller just printed progress itself."""
        self._last = time.monotonic()

    def _run(self):
        while not self._stop.wait(max(self._last + self.every - time.monotonic(), 0.05)):
            if time.monotonic() - self._last >= self.every:
                print(self.line(), file=self.stream, flush=True)
                self._last = time.monotonic()

    def __enter__(self):
        self.t0 = self._last = time.monotonic()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{self.label}", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        return False
