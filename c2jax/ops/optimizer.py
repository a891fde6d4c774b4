"""The optimizer op: AdamW (a learning-rate schedule, global-norm clip, masked weight decay, frozen
leaves) as an optax transformation, one implementation per name, chosen by the config's
`train.optimizer = "auto" | name` for the target the train step runs on.

- optax_adamw: optax's chain (runs everywhere).
- cpu_fused_adamw: the same arithmetic on the same state tree as one in-place FFI pass per leaf
  (c2jax/backends/cpu/adamw.py): XLA:CPU, one device, float32 params, the kernels built. A real
  optax transformation (init / update, then optax.apply_updates), with a fast path besides:
  `apply_in_place`, which the train step calls (c2jax.train.step.apply_if_finite) to write the
  donated params and moments in place with the finiteness gate inside.

The choice is made once, when the optimizer is made (`make`; c2jax.train.optimizer.make_optimizer),
and shows in the optimizer (`impl`, `target`). Where a step is traced, the optimizer checks that its
implementation runs there (a KernelUnavailable saying why and what to do, never a silent swap) and
records the choice (c2jax.ops.record_choices).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import optax

from c2jax.backends.cpu import adamw as cpu_adamw
from c2jax.ops.registry import Impl, KernelUnavailable, define_op
from c2jax.ops.target import Target, current_target, one_cpu_device

OPTIMIZER = define_op("optimizer", {"cpu": ("cpu_fused_adamw", "optax_adamw"), "*": ("optax_adamw",)},
                      field="train.optimizer")


@dataclasses.dataclass(frozen=True)
class AdamW:
    """AdamW's definition, the same for every implementation (c2jax.train.optimizer.adamw_of builds
    the trainer's from its `train` section)."""

    learning_rate: Callable      # optax.Schedule: step count -> learning rate
    b1: float
    b2: float
    eps: float
    weight_decay: float
    grad_clip: float             # global-norm clip (0 = off)
    decay_mask: Callable         # params -> tree of bool: where weight decay applies
    frozen_labels: Callable      # params -> tree of "train" | "frozen" (frozen: never updated)


def optax_adamw(a: AdamW) -> optax.GradientTransformationExtraArgs:
    """AdamW `a` as optax's chain: clip -> adamw (masked decay) on trained leaves, zero updates on frozen ones."""
    chain = []
    if a.grad_clip > 0:
        chain.append(optax.clip_by_global_norm(a.grad_clip))
    chain.append(optax.adamw(a.learning_rate, b1=a.b1, b2=a.b2, eps=a.eps, weight_decay=a.weight_decay,
                             mask=a.decay_mask))
    return optax.multi_transform({"train": optax.chain(*chain), "frozen": optax.set_to_zero()}, a.frozen_labels)


class TrainOptimizer(optax.GradientTransformationExtraArgs):
    """An optimizer made by `make`: an optax transformation, with `impl` (its implementation's
    name), `target` (the target it was chosen for) and `adamw` (its AdamW definition)."""

    impl: str
    target: Target
    adamw: AdamW

    def check(self, params) -> None:
        """Raise KernelUnavailable when `impl` cannot step `params` on the target being traced; else
        record the choice (c2jax.ops.record_choices)."""
        target = current_target()
        try:
            OPTIMIZER.select(self.impl, target, params=params)
        except KernelUnavailable as e:
            raise KernelUnavailable(
                f"the optimizer was chosen for {self.target}, not the program traced here: {e}; make the "
                f"optimizer for the step's mesh and params, make_optimizer(cfg.train, target_of_mesh(mesh), params)"
            ) from None


class FusedAdamW(TrainOptimizer):
    """cpu_fused_adamw: init is optax_adamw's (the same state tree); update runs the kernel and
    returns new params - params as the updates (optax's to within one rounding of the params);
    `apply_in_place` is the train step's fast path."""

    def global_norm(self, grads, unrolled=()):
        """optax.global_norm(grads), the leaves of `unrolled` stacks summed layer by layer (cpu_adamw.layers_of)."""
        return cpu_adamw.global_norm(grads, unrolled)

    def apply_in_place(self, params, opt_state, grads, finite, grad_norm=None, unrolled=()):
        """(new params, new state) of one step, in place (donate params and state), or the old ones
        where `finite` is False; `grad_norm`: global_norm(grads, unrolled) if already computed."""
        self.check(params)
        return cpu_adamw.apply(self.adamw, params, opt_state, grads, finite, grad_norm, unrolled)


def _fused_ok(target: Target, params=None, **spec) -> str | None:
    why = one_cpu_device(target)
    if why:
        return why
    if params is not None:
        other = sorted({str(x.dtype) for x in jax.tree.leaves(params) if x.dtype != jnp.float32})
        if other:
            return f"params must all be float32 (some are {', '.join(other)})"
    from c2jax.backends.cpu import kernels as cpu_kernels
    return cpu_kernels.unavailable()


def _finish(out: TrainOptimizer, name: str, a: AdamW, target: Target) -> TrainOptimizer:
    out.impl, out.adamw, out.target = name, a, target
    return out


@OPTIMIZER.register("optax_adamw", doc="optax's clip -> adamw chain (three fusions per leaf on XLA:CPU)")
def _make_optax(a: AdamW, target: Target) -> TrainOptimizer:
    tx = optax_adamw(a)

    def update(updates, state, params=None, **extra):
        out.check(params)
        return tx.update(updates, state, params, **extra)
    out = TrainOptimizer(tx.init, update)
    return _finish(out, "optax_adamw", a, target)


@OPTIMIZER.register("cpu_fused_adamw", _fused_ok,
                    doc="c2jax/backends/cpu/cpu_adamw.cc: one in-place pass per leaf, the finiteness gate inside")
def _make_fused(a: AdamW, target: Target) -> TrainOptimizer:
    tx = optax_adamw(a)

    def update(grads, state, params=None, **extra):
        if params is None:
            raise ValueError("cpu_fused_adamw's update needs the params (weight decay reads them, the step "
                             "writes them): call update(grads, state, params)")
        new_params, new_state = out.apply_in_place(params, state, grads, jnp.bool_(True))
        return jax.tree.map(lambda new, old: new - old, new_params, params), new_state
    out = FusedAdamW(tx.init, update)
    return _finish(out, "cpu_fused_adamw", a, target)


def choose(choice: str, target: Target, params=None) -> Impl:
    """The implementation `choice` ("auto" or a name) names for `target` (and `params`' dtypes,
    when given), not recorded (a step records it where it is traced: TrainOptimizer.check); a
    pinned name that cannot run raises KernelUnavailable."""
    return OPTIMIZER.select(choice, target, record=False, params=params)


def make(choice: str, a: AdamW, target: Target | None = None, params=None) -> TrainOptimizer:
    """AdamW `a` as the implementation `choice` names for `target` (default: current_target())
    and `params` (a tree of arrays or ShapeDtypeStructs; None: their dtypes are checked when a
    step is traced)."""
    target = current_target() if target is None else target
    return choose(choice, target, params).fn(a, target)
