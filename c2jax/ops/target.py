"""The target a program is traced for: the platform and size of the mesh it runs on.

The platform comes from the devices of the active mesh (`jax.set_mesh`; an AOT compile for a TPU
topology sets a mesh of TPU devices, so it chooses what a run on TPU chooses), else from the
devices this process computes on. Never from the host's default backend alone.
"""
from __future__ import annotations

import dataclasses
import math

import jax

PLATFORMS = ("cpu", "gpu", "tpu")


@dataclasses.dataclass(frozen=True)
class Target:
    """Where a traced program runs: platform ("cpu" | "gpu" | "tpu") and mesh axis sizes."""

    platform: str
    axis_sizes: tuple[tuple[str, int], ...] = ()

    @property
    def devices(self) -> int:
        """Devices in the mesh (1 outside a mesh)."""
        return math.prod(n for _, n in self.axis_sizes) if self.axis_sizes else 1

    def __str__(self) -> str:
        mesh = ", ".join(f"{a}={n}" for a, n in self.axis_sizes if n > 1)
        return f"{self.platform}" + (f" mesh {mesh}" if mesh else ", one device")


def one_cpu_device(target: Target) -> str | None:
    """Why a CPU-only implementation (an XLA:CPU FFI kernel, or XLA code tuned for one CPU
    device) cannot run on `target`; None on one CPU device. Over a mesh the XLA paths keep the
    partitioner's layout (an FFI call has no sharding rule)."""
    if target.platform != "cpu":
        return f"CPU only (target is {target.platform})"
    if target.devices > 1:
        return "one device only (a multi-device mesh is active)"
    return None


def narrow_vectors(target: Target, **spec) -> str | None:
    """Why "auto" passes over the CPU product kernels (attention, experts) on this host: they are
    slower than XLA's paths without AVX-512 (c2jax.backends.cpu.kernels.narrow_vectors)."""
    if target.platform != "cpu":
        return None
    from c2jax.backends.cpu import kernels as cpu_kernels
    return cpu_kernels.narrow_vectors()


def _platform_of(device) -> str:
    p = getattr(device, "platform", None) or "cpu"
    return "gpu" if p in ("cuda", "rocm", "gpu") else p


def current_target() -> Target:
    """The target of the program being traced: the active mesh's devices, else jax.devices()."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is not None and not mesh.empty:
        dev = getattr(mesh, "abstract_device", None)
        platform = _platform_of(dev) if dev is not None else _platform_of(jax.devices()[0])
        return Target(platform, tuple((a, int(n)) for a, n in mesh.shape.items()))
    return Target(_platform_of(jax.devices()[0]))


def target_of_mesh(mesh) -> Target:
    """The target of a concrete jax.sharding.Mesh."""
    return Target(_platform_of(mesh.devices.flat[0]), tuple((a, int(n)) for a, n in mesh.shape.items()))
