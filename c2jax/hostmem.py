"""Host memory: make glibc's malloc keep freed memory, so XLA CPU's per-step buffers are reused.

Why: XLA's CPU runtime allocates each execution's temporaries as one block (1.9 GB for the
89M bench's train step) and frees it at the end. glibc serves blocks that large with a fresh
mmap and unmaps them on free, so every step faults in and zeroes ~500k new pages: on the 2-core
bench host that is ~0.8 s of kernel time (~0.3 s of a 2.9 s step). With one malloc arena, no
per-allocation mmap and no trimming, the block is taken from and returned to the heap, and
later steps touch no new pages. The cost: the process keeps its peak heap (it needs it every
step anyway), and all threads share one arena.

It only works before the XLA backend's threads first allocate (a thread that already has its
own arena keeps it), so entry points call `retain_freed_memory()` first thing (the CLI's `main`,
the benchmarks' `main`); `import c2jax` leaves malloc alone. Set
C2JAX_HOST_MALLOC=default to leave malloc alone, =retain to force it; unset, it applies on hosts
with no accelerator device nodes (the CPU backend runs the programs there).
"""
from __future__ import annotations

import ctypes
import glob
import os
import sys

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -2, -4, -8
# trim threshold -1: SIZE_MAX to glibc, never trim. A trimmed heap went back to this VM's host and
# cost 9 s of refaults when the next step touched it again (2 GB at ~25 us a page)
_SETTINGS = ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, -1), (_M_TOP_PAD, 64 << 20))
_TUNABLE_NAMES = {_M_ARENA_MAX: "arena_max", _M_MMAP_MAX: "mmap_max", _M_TRIM_THRESHOLD: "trim_threshold",
                  _M_TOP_PAD: "top_pad"}
_ACCELERATOR_NODES = ("/dev/accel*", "/dev/vfio/[0-9]*", "/dev/nvidia[0-9]*", "/dev/kfd")

state = "not attempted"  # what retain_freed_memory() did, for logs and benchmark reports


def _why_not() -> str | None:
    mode = os.environ.get("C2JAX_HOST_MALLOC", "")
    if mode not in ("", "retain", "default"):
        return f"C2JAX_HOST_MALLOC must be 'retain' or 'default', got {mode!r}: malloc left alone"
    if mode == "default":
        return "C2JAX_HOST_MALLOC=default"
    if not sys.platform.startswith("linux"):
        return f"not glibc ({sys.platform})"
    if mode == "" and any(glob.glob(p) for p in _ACCELERATOR_NODES):
        return "accelerator host (C2JAX_HOST_MALLOC=retain forces it)"
    return None


def retain_freed_memory() -> str:
    """Set glibc malloc to one arena, no mmap per allocation and no trimming (see the module
    note); returns and records in `state` what was done."""
    global state
    if state != "not attempted":
        return state
    why = _why_not()
    if why is None:
        try:
            libc = ctypes.CDLL("libc.so.6")
            libc.gnu_get_libc_version.restype = ctypes.c_char_p
            version = libc.gnu_get_libc_version().decode()
            ok = all(libc.mallopt(k, v) == 1 for k, v in _SETTINGS)
        except (OSError, AttributeError) as e:
            why = f"not glibc ({e})"
        else:
            why = None if ok else "mallopt refused a setting"
    state = f"malloc left alone: {why}" if why else f"glibc {version}: freed memory retained"
    return state


def glibc_tunables() -> str:
    """The same settings as a GLIBC_TUNABLES value, for a child process that is not c2jax (the
    benchmarks give their PyTorch peers the same allocator)."""
    return ":".join(f"glibc.malloc.{_TUNABLE_NAMES[k]}={v if v >= 0 else 2 ** 64 - 1}" for k, v in _SETTINGS)
