"""Kernel registries: for each op, named implementations with a `supported(target, **spec)` check,
and one choice per call site: a pinned name (an error with its reason when it cannot run) or
"auto" (the first supported name in the op's AUTO order for the target's platform).

Every choice made while tracing is recorded (`record_choices`), so tests and compile-check can
say which implementation each program contains.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Callable

from c2jax.ops.target import Target


class KernelUnavailable(ValueError):
    """A pinned implementation cannot run these operands on this target (the message says why)."""


@dataclasses.dataclass(frozen=True)
class Impl:
    """One implementation of an op: `fn` computes it, `supported(target, **spec)` returns why it
    cannot run (None when it can)."""

    name: str
    fn: Callable
    supported: Callable[..., str | None]
    doc: str = ""
    # why "auto" passes over it although it can run (a measured rule: slower here); a pinned name still runs
    auto_skip: Callable[..., str | None] | None = None


class Op:
    """A registry of implementations of one op, with its auto order per platform."""

    def __init__(self, name: str, auto: dict[str, tuple[str, ...]], field: str):
        self.name, self.auto, self.field, self.impls = name, auto, field, {}
        self.paths: dict[str, str] = {}   # how the op runs across a mesh around an implementation: name -> doc

    def path(self, name: str, doc: str) -> None:
        """Declare a mesh path `name` (recorded as "name(implementation)", see record)."""
        self.paths[name] = doc

    def register(self, name: str, supported: Callable[..., str | None] | None = None, doc: str = "",
                 auto_skip: Callable[..., str | None] | None = None):
        """Decorator: register `fn` under `name` (supported=None: runs everywhere; auto_skip: why
        "auto" should pass over it where it runs, see Impl)."""
        def deco(fn):
            if name in self.impls:
                raise ValueError(f"op {self.name!r} already has an implementation named {name!r}")
            self.impls[name] = Impl(name, fn, supported or (lambda target, **spec: None), doc or (fn.__doc__ or ""),
                                    auto_skip)
            return fn
        return deco

    def names(self) -> tuple[str, ...]:
        """The registered implementation names."""
        return tuple(self.impls)

    def select(self, choice: str, target: Target, *, record: bool = True, **spec) -> Impl:
        """The implementation for `choice` ("auto" or a name) on `target` for operands `spec`;
        recorded (record_choices) unless record=False."""
        done = (lambda impl: _record(self.name, impl)) if record else (lambda impl: impl)
        if choice != "auto":
            impl = self.impls.get(choice)
            if impl is None:
                raise KernelUnavailable(f"{self.field}={choice!r} is not an implementation of "
                                        f"{self.name}; choose 'auto' or one of {sorted(self.impls)}")
            why = impl.supported(target, **spec)
            if why:
                raise KernelUnavailable(f"{self.field}={choice!r} cannot run here ({target}): {why}; "
                                        f"set {self.field}='auto' or another of {sorted(self.impls)}")
            return done(impl)
        reasons = []
        for name in self.auto.get(target.platform, ()) + self.auto.get("*", ()):
            impl = self.impls[name]
            why = impl.supported(target, **spec) or (impl.auto_skip and impl.auto_skip(target, **spec))
            if not why:
                return done(impl)
            reasons.append(f"{name}: {why}")
        raise KernelUnavailable(f"no implementation of {self.name} runs here ({target}): " + "; ".join(reasons))

    def why_not(self, name: str, target: Target, **spec) -> str | None:
        """Why implementation `name` cannot run (None when it can); no choice is recorded."""
        return self.impls[name].supported(target, **spec)


OPS: dict[str, Op] = {}


def define_op(name: str, auto: dict[str, tuple[str, ...]], field: str | None = None) -> Op:
    """Create the registry of op `name` with its auto order ({platform or "*": names}); `field`:
    the config field that chooses it (default model.kernels.<name>), named in errors."""
    if name in OPS:
        raise ValueError(f"op {name!r} is defined twice")
    OPS[name] = Op(name, auto, field or f"model.kernels.{name}")
    return OPS[name]


# ----------------------------------------------------------------------------- choice records

_RECORDS: contextvars.ContextVar = contextvars.ContextVar("c2jax_kernel_choices", default=None)


def _record(op: str, impl: Impl) -> Impl:
    record(op, impl.name)
    return impl


def record(op: str, name: str) -> None:
    """Count one traced call site of `op` running `name` (an implementation, or a mesh path around
    one: "ep_all_to_all(pallas_gmm)") in the active record_choices block."""
    rec = _RECORDS.get()
    if rec is not None:
        rec.setdefault(op, {})
        rec[op][name] = rec[op].get(name, 0) + 1


@contextlib.contextmanager
def record_choices():
    """Collect {op: {implementation: call sites traced}} of the choices made inside the block
    (trace a program inside it: jit(...).lower(...))."""
    rec: dict[str, dict[str, int]] = {}
    token = _RECORDS.set(rec)
    try:
        yield rec
    finally:
        _RECORDS.reset(token)


def kernels_choice(kernels: Any, op: str) -> str:
    """The configured choice of `op` in a model config's `kernels` section ("auto" when unset)."""
    if kernels is None:
        return "auto"
    value = kernels.get(op, "auto") if hasattr(kernels, "get") else getattr(kernels, op, "auto")
    return value or "auto"
