"""Shared helpers for pallas_kernels: backend/impl selection and argument checks."""
# Dim letters: none (helpers only).
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

IMPLS = ("auto", "xla", "pallas", "interpret", "reference")
QUANTS = ("none", "mxfp8", "nvfp4", "int8")


def resolve_impl(impl: str, *, has_pallas_gpu: bool = False) -> str:
    """Map impl="auto" to the concrete path for the default backend; validate names."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got impl={impl!r}")
    backend = jax.default_backend()
    if impl == "pallas" and backend != "tpu" and not (backend == "gpu" and has_pallas_gpu):
        raise ValueError(f"impl='pallas' needs a backend with these kernels (tpu); the backend is {backend!r}: "
                         "use impl='interpret' to run the Pallas kernels in the interpreter, or impl='xla'")
    if impl != "auto":
        return impl
    if backend == "tpu":
        return "pallas"
    if backend == "gpu" and has_pallas_gpu:
        return "pallas"
    return "xla"


def check_quant(quant: str) -> str:
    """Validate a quant name."""
    if quant not in QUANTS:
        raise ValueError(f"quant must be one of {QUANTS}, got quant={quant!r}")
    return quant


def check_ndim(name: str, x, ndim: int, letters: str) -> None:
    """Raise ValueError naming `name` if x does not have `ndim` dims."""
    if jnp.ndim(x) != ndim:
        raise ValueError(f"{name} must have {ndim} dims [{letters}], got shape {jnp.shape(x)}")


def is_concrete(x) -> bool:
    """True if x holds a concrete value (not a tracer under jit/grad)."""
    try:
        np.asarray(x)
        return True
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError, TypeError):
        return False


def round_up(x: int, m: int) -> int:
    """Smallest multiple of m that is >= x."""
    return (x + m - 1) // m * m


def pad_axis(x, axis: int, size: int, value=0):
    """Pad x along axis up to size with value (no-op when already that size)."""
    cur = x.shape[axis]
    if cur == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - cur)
    return jnp.pad(x, widths, constant_values=value)


def interpret_params(impl: str):
    """Value for pallas_call(interpret=...) given the concrete impl name."""
    # generic Pallas interpreter: several times faster than pltpu.InterpretParams on CPU
    return impl == "interpret"
