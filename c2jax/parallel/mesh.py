"""Mesh construction from config and logical-axis sharding of params and activations.

Every param and large activation carries logical axis names (batch, length, embed, heads,
kv_latent, mlp, experts, vocab, layers, ...); `config.mesh.rules` maps them to mesh axes. One
name is derived, not configured: `expert_weights`, the expert weights' E dim, over the EP group
(`experts`) and then the `expert_fsdp` axes.
"""
from __future__ import annotations

import contextlib
import contextvars

import flax.linen as nn
import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from c2jax.config import ConfigError, mesh_shape, validate_mesh


def make_mesh(cfg, devices=None) -> Mesh:
    """A Mesh with the config's axis names and sizes over `devices` (default: all devices)."""
    devices = list(devices if devices is not None else jax.devices())
    validate_mesh(cfg.mesh, cfg.model, len(devices))
    shape = mesh_shape(cfg.mesh, len(devices))
    axes = tuple(cfg.mesh.axes)
    validate_layout(cfg, dict(zip(axes, shape)))
    try:
        dev_array = mesh_utils.create_device_mesh(shape, devices=devices)
    except (ValueError, NotImplementedError, AssertionError):
        dev_array = np.asarray(devices).reshape(shape)
    return Mesh(dev_array, axes, axis_types=(AxisType.Auto,) * len(axes))


def _rule_axes(cfg, logical: str) -> tuple:
    for name, targets in cfg.mesh.rules:
        if name == logical:
            targets = targets if isinstance(targets, (tuple, list)) else (targets,)
            return tuple(t for t in targets if t is not None)
    return ()


def validate_layout(cfg, sizes: dict) -> None:
    """Checks of the parallel layout that need the mesh sizes; raise ConfigError before compiling:
    the expert-parallel group (the axes `experts` maps to) must divide model.num_experts, the
    sequence must split into 2*CP zigzag chunks, the batch must split over its axes."""
    m = cfg.model
    impl = cfg.mesh.get("cp_impl", "allgather")
    if impl not in ("allgather", "ring"):
        raise ConfigError(f"mesh.cp_impl = {impl!r}; choose 'allgather' or 'ring'")
    if m.num_experts > 0:
        ep_axes = _rule_axes(cfg, "experts")
        ep = int(np.prod([sizes.get(a, 1) for a in ep_axes]))
        if m.num_experts % ep:
            raise ConfigError(f"model.num_experts={m.num_experts} is not divisible by the expert-parallel group "
                              f"{ep_axes} of size {ep}; change mesh.shape or the 'experts' rule in mesh.rules")
        e_fsdp = _expert_weight_axes(cfg)[len(ep_axes):]
        n = int(np.prod([sizes.get(a, 1) for a in e_fsdp]))
        if (m.num_experts // ep) % n:
            raise ConfigError(f"model.num_experts={m.num_experts} over the expert-parallel group {ep_axes} "
                              f"({m.num_experts // ep} per group) is not divisible by the 'expert_fsdp' axes "
                              f"{e_fsdp} of size {n}; change mesh.shape or the 'expert_fsdp' rule in mesh.rules")
    cp = int(np.prod([sizes.get(a, 1) for a in _rule_axes(cfg, "length")]))
    if "train" in cfg:
        if cp > 1 and cfg.train.seq_len % (2 * cp):
            raise ConfigError(f"train.seq_len={cfg.train.seq_len} is not divisible by 2*CP = {2 * cp} (zigzag "
                              f"context parallelism over {cp} ranks); change train.seq_len or mesh.shape")
        batch_axes = [a for a in _rule_axes(cfg, "batch") if a not in _rule_axes(cfg, "length")]
        nb = int(np.prod([sizes.get(a, 1) for a in batch_axes]))
        micro = cfg.train.batch_size // max(cfg.train.get("grad_accum", 1), 1)
        if micro % nb:
            raise ConfigError(f"train.batch_size/grad_accum = {micro} rows is not divisible by the batch axes "
                              f"{tuple(batch_axes)} of size {nb}; change train.batch_size or mesh.shape")


def rules(cfg) -> tuple:
    """The logical->mesh rules as Flax expects them (tuples of (name, axes)), plus the derived
    `expert_weights` rule: the expert weights' E dim, over the EP group (`experts`) and then the
    `expert_fsdp` axes."""
    out = tuple((name, tuple(t) if isinstance(t, (list, tuple)) else t) for name, t in cfg.mesh.rules)
    stored = _expert_weight_axes(cfg)
    return out + (("expert_weights", stored if len(stored) > 1 else (stored[0] if stored else None)),)


def _expert_weight_axes(cfg) -> tuple:
    """The expert weights' E-dim axes: the EP group (`experts`), then the `expert_fsdp` axes not in it."""
    return tuple(dict.fromkeys(_rule_axes(cfg, "experts") + _rule_axes(cfg, "expert_fsdp")))


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


def tree_shardings(cfg, mesh: Mesh, logical_tree, shapes_tree):
    """NamedSharding per leaf of shapes_tree from its logical PartitionSpec tree and the config's
    rules (c2jax.models.param_shardings gives the model's). A dim that the mesh axes do not
    divide is replicated rather than failing."""

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
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules(cfg)), parallel_settings(cfg.mesh):
        yield


# ----------------------------------------------------------------------------- active-mesh queries
# The model code (attention, MoE) asks these at trace time whether context / expert parallelism
# is on: they read the mesh set by `jax.set_mesh` and the logical rules set by `activate`.


def active_axis_sizes() -> dict:
    """{mesh axis: size} of the mesh set by jax.set_mesh ({} outside any mesh)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return {}
    return dict(mesh.shape)


def active_logical_axes(name: str) -> tuple:
    """Mesh axes (size > 1, in rule order) that logical axis `name` maps to under the active
    rules and mesh; () when replicated or outside a mesh."""
    sizes = active_axis_sizes()
    for logical, targets in nn.get_logical_axis_rules():
        if logical == name:
            targets = targets if isinstance(targets, (tuple, list)) else (targets,)
            return tuple(t for t in targets if t is not None and sizes.get(t, 1) > 1)
    return ()


def axes_size(axes) -> int:
    """Product of the active mesh's sizes of `axes`."""
    sizes = active_axis_sizes()
    return int(np.prod([sizes.get(a, 1) for a in axes])) if axes else 1


def divisible_axes(dim: int, axes) -> tuple:
    """The longest prefix of `axes` whose size product divides dim (used to build shard_map specs
    that match what GSPMD does with a non-divisible logical constraint)."""
    out = []
    for a in axes:
        if dim % axes_size(tuple(out) + (a,)) == 0:
            out.append(a)
        else:
            break
    return tuple(out)


def row_axes(batch: int) -> tuple:
    """Mesh axes that shard `batch` rows of [batch, length, ...] activations under the active rules:
    the longest prefix of the `batch` axes (less `context`, which shards the length) dividing it."""
    return divisible_axes(batch, tuple(a for a in active_logical_axes("batch") if a != "context"))


def spec_entry(axes):
    """PartitionSpec entry for a tuple of mesh axes."""
    return None if not axes else (axes[0] if len(axes) == 1 else tuple(axes))


_PARALLEL_SETTINGS: contextvars.ContextVar = contextvars.ContextVar("c2jax_parallel", default=None)


def parallel_setting(key: str, default):
    """A `config.mesh` field of the config passed to `activate` (default outside it)."""
    settings = _PARALLEL_SETTINGS.get()
    if settings is None or key not in settings:
        return default
    return settings[key]


@contextlib.contextmanager
def parallel_settings(mesh_cfg):
    token = _PARALLEL_SETTINGS.set(mesh_cfg)
    try:
        yield
    finally:
        _PARALLEL_SETTINGS.reset(token)
