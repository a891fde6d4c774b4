"""Mesh construction from config and logical-axis sharding of params and activations.

Every param and large activation carries logical axis names (batch, length, embed, heads,
kv_latent, mlp, experts, vocab, layers, ...); `config.mesh.rules` maps them to mesh axes.
"""
from __future__ import annotations

import contextlib

import flax.linen as nn
import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from c2jax.config import mesh_shape, validate_mesh


def make_mesh(cfg, devices=None) -> Mesh:
    """A Mesh with the config's axis names and sizes over `devices` (default: all devices)."""
    devices = list(devices if devices is not None else jax.devices())
    validate_mesh(cfg.mesh, cfg.model, len(devices))
    shape = mesh_shape(cfg.mesh, len(devices))
    axes = tuple(cfg.mesh.axes)
    try:
        dev_array = mesh_utils.create_device_mesh(shape, devices=devices)
    except (ValueError, NotImplementedError, AssertionError):
        dev_array = np.asarray(devices).reshape(shape)
    return Mesh(dev_array, axes, axis_types=(AxisType.Auto,) * len(axes))


def rules(cfg) -> tuple:
    """The logical->mesh rules as Flax expects them (tuples of (name, axes))."""
    return tuple((name, tuple(t) if isinstance(t, (list, tuple)) else t) for name, t in cfg.mesh.rules)


def logical_to_mesh_spec(logical_spec: PartitionSpec, cfg, mesh: Mesh) -> PartitionSpec:
    """Translate one logical PartitionSpec; mesh axes of size 1 or already used are dropped."""
    table = dict(rules(cfg))
    used, out = set(), []
    for name in logical_spec:
        targets = table.get(name) if name is not None else None
        if targets is None:
            out.append(None)
            continue
        targets = targets if isinstance(targets, tuple) else (targets,)
        keep = tuple(t for t in targets if t not in used and mesh.shape[t] > 1)
        used.update(keep)
        out.append(keep if len(keep) > 1 else (keep[0] if keep else None))
    return PartitionSpec(*out)


def _divisible(spec: PartitionSpec, shape, mesh: Mesh) -> PartitionSpec:
    out = []
    for dim, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        if axes is None:
            out.append(None)
            continue
        names = axes if isinstance(axes, tuple) else (axes,)
        size = int(np.prod([mesh.shape[a] for a in names]))
        out.append(axes if dim % size == 0 else None)
    return PartitionSpec(*out)


def param_shardings(cfg, mesh: Mesh, logical_tree=None, shapes_tree=None):
    """NamedSharding per param leaf from the model's logical axes and the config's rules.
    A dim that the mesh axes do not divide is replicated rather than failing."""
    from c2jax.models import abstract_params, logical_axes
    logical_tree = logical_tree if logical_tree is not None else logical_axes(cfg)
    shapes_tree = shapes_tree if shapes_tree is not None else abstract_params(cfg)

    def one(spec, shape):
        mesh_spec = logical_to_mesh_spec(spec, cfg, mesh)
        return NamedSharding(mesh, _divisible(mesh_spec, shape.shape, mesh))
    return jax.tree.map(one, logical_tree, shapes_tree,
                        is_leaf=lambda x: isinstance(x, PartitionSpec))


def data_sharding(cfg, mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Sharding of a [batch, length, ...] input array."""
    spec = logical_to_mesh_spec(PartitionSpec("batch", "length"), cfg, mesh)
    return NamedSharding(mesh, PartitionSpec(*(tuple(spec) + (None,) * (ndim - 2))))


@contextlib.contextmanager
def activate(cfg, mesh: Mesh):
    """Context in which logical constraints inside the model resolve against `mesh`."""
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules(cfg)):
        yield
