"""The platform programs are being built for. Usually jax.default_backend(); compile-check builds
TPU programs on a CPU host, so the choices c2jax makes per platform (CPU-only dispatch and decode
layouts) must follow the compile target, not the host."""
from __future__ import annotations

import contextlib
import threading

import jax

_local = threading.local()


def target_backend() -> str:
    """'cpu', 'gpu' or 'tpu': the compile target set by `compile_target`, else the default backend."""
    return getattr(_local, "target", None) or jax.default_backend()


@contextlib.contextmanager
def compile_target(backend: str):
    """Trace programs inside this block as if for `backend` (e.g. 'tpu' for an AOT compile)."""
    if backend not in ("cpu", "gpu", "tpu"):
        raise ValueError(f"compile target must be 'cpu', 'gpu' or 'tpu', got {backend!r}")
    prev = getattr(_local, "target", None)
    _local.target = backend
    try:
        yield
    finally:
        _local.target = prev
