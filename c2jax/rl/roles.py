"""The RL run's roles on devices: the learner's mesh, the samplers' mesh, and the one reshard that
moves the weights from the first to the second.

One mesh per role, as Tunix's RL cluster has: the learner (policy, optimizer state and the
reference, laid out by `mesh.shape` and `mesh.rules` as CPT is) and the sampler (its decode
layout, `rl.sampler_mesh_shape` with the same rules: batch over the data axes, experts over the
expert axes). In one process the two take disjoint device sets when both fit (the learner first),
else the sampler shares the learner's first devices. Weights move by `reshard`: cast to the
sampler's dtype where they lie, then one `jax.device_put` onto the sampler's shardings; across
processes (the Ray backend) the delta publisher carries host bytes and the sampler process puts
them on its own mesh the same way (`put_on`).
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import ml_collections

from c2jax.config import mesh_shape
from c2jax.errors import ConfigError


@dataclasses.dataclass
class Roles:
    """The devices of each role: learner_mesh / sampler_mesh (None: one device, the role's first
    device in learner_devices / sampler_devices)."""

    learner_mesh: jax.sharding.Mesh | None
    sampler_mesh: jax.sharding.Mesh | None
    learner_devices: list
    sampler_devices: list

    def describe(self) -> dict:
        """The metrics record naming each role's device ids and mesh shape (sizes in mesh.axes
        order; [1] on one device)."""
        def shape(m):
            return [1] if m is None else [int(n) for n in m.devices.shape]
        return {"learner_devices": [int(d.id) for d in self.learner_devices],
                "sampler_devices": [int(d.id) for d in self.sampler_devices],
                "learner_mesh_shape": shape(self.learner_mesh), "sampler_mesh_shape": shape(self.sampler_mesh)}


def sampler_cfg(cfg) -> ml_collections.ConfigDict:
    """cfg with the sampler's mesh shape (rl.sampler_mesh_shape) and its row count as the batch the
    layout checks see; the rules are the run's."""
    d = ml_collections.ConfigDict(cfg.to_dict())
    if tuple(cfg.rl.sampler_mesh_shape):
        d.mesh.shape = tuple(cfg.rl.sampler_mesh_shape)
    d.train.batch_size, d.train.grad_accum = int(cfg.rl.sampler_slots), 1
    return d


def _sampler_shape(cfg) -> tuple:
    s_shape = tuple(int(x) for x in cfg.rl.sampler_mesh_shape)
    if s_shape and len(s_shape) != len(cfg.mesh.axes):
        raise ConfigError(f"rl.sampler_mesh_shape {s_shape} needs one size per mesh axis {tuple(cfg.mesh.axes)}")
    if any(x < 1 for x in s_shape):
        raise ConfigError(f"rl.sampler_mesh_shape {s_shape}: sizes must be >= 1 (no -1: name the sampler's devices)")
    return s_shape


def _learner_mesh(cfg, devices):
    """mesh.shape over exactly `devices` (None for one device)."""
    from c2jax.parallel.mesh import make_mesh
    if len(devices) == 1:
        return None
    lcfg = ml_collections.ConfigDict(cfg.to_dict())
    lcfg.mesh.shape = mesh_shape(cfg.mesh, len(devices))
    return make_mesh(lcfg, devices)


def _sampler_mesh(cfg, devices):
    """rl.sampler_mesh_shape over exactly `devices` (None when unset or one device)."""
    from c2jax.parallel.mesh import make_mesh
    return make_mesh(sampler_cfg(cfg), devices) if _sampler_shape(cfg) and len(devices) > 1 else None


def rl_meshes(cfg, devices=None) -> Roles:
    """The learner's and the sampler's devices and meshes for an RL config.

    The sampler's mesh is rl.sampler_mesh_shape (() = one device, the sampler of a laptop run);
    the learner's is mesh.shape over the devices the sampler leaves (a -1 entry takes as many as
    fit). A role on one device gets no mesh (the one-device programs)."""
    devices = list(devices if devices is not None else jax.devices())
    n_all = len(devices)
    s_shape = _sampler_shape(cfg)
    n_s = math.prod(s_shape) if s_shape else 1
    fixed = math.prod(x for x in cfg.mesh.shape if x != -1)
    if -1 in tuple(cfg.mesh.shape):
        room = n_all - n_s if s_shape and n_all - n_s >= fixed else n_all
        n_l = room // fixed * fixed
    else:
        n_l = fixed
    if n_l > n_all or n_s > n_all:
        raise ConfigError(f"the learner mesh ({n_l} devices, mesh.shape {tuple(cfg.mesh.shape)}) and the sampler "
                          f"mesh ({n_s}, rl.sampler_mesh_shape {s_shape}) need more than the {n_all} devices"
                          + ("; on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N gives N host devices"
                             if devices[0].platform == "cpu" else ""))
    learner = devices[:n_l]
    sampler = devices[n_l:n_l + n_s] if n_l + n_s <= n_all else devices[:n_s]
    return Roles(_learner_mesh(cfg, learner), _sampler_mesh(cfg, sampler), learner, sampler)


def process_roles(cfg, role: str, devices=None) -> Roles:
    """The roles of a process that holds one role alone (a Ray learner or sampler actor): the
    learner's mesh.shape, or the sampler's rl.sampler_mesh_shape, over this process's devices."""
    devices = list(devices if devices is not None else jax.local_devices())
    if role == "learner":
        return Roles(_learner_mesh(cfg, devices), None, devices, [])
    s_shape = _sampler_shape(cfg)
    n_s = math.prod(s_shape) if s_shape else 1
    if n_s > len(devices):
        raise ConfigError(f"rl.sampler_mesh_shape {s_shape} needs {n_s} devices; this sampler process has "
                          f"{len(devices)}")
    return Roles(None, _sampler_mesh(cfg, devices[:n_s]), [], devices[:n_s])


def cast_floating(params, dtype):
    """params with every floating leaf cast to dtype (None: unchanged), each where it lies."""
    if dtype is None:
        return params
    dt = jnp.dtype(dtype)
    return jax.tree.map(lambda a: a.astype(dt) if jnp.issubdtype(a.dtype, jnp.floating) and a.dtype != dt else a,
                        params)


def sampler_shardings(cfg, roles: Roles, abstract_params=None):
    """Where the sampler's copy of each param lives: its mesh's param shardings (the run's rules),
    or its one device."""
    if roles.sampler_mesh is None:
        return jax.sharding.SingleDeviceSharding(roles.sampler_devices[0])
    from c2jax.models import param_shardings
    return param_shardings(sampler_cfg(cfg), roles.sampler_mesh, shapes_tree=abstract_params)


def reshard(params, shardings, dtype=None):
    """The learner's params as the sampler holds them: cast to dtype on the learner's devices
    (halving what moves for bf16), then one device_put onto `shardings` (a pytree of shardings
    or one sharding for all). New arrays: the learner's state may be donated afterwards."""
    return jax.device_put(cast_floating(params, dtype), shardings, may_alias=False)


def put_on(host_params, shardings):
    """Host arrays (a weight-sync snapshot) onto the sampler's shardings."""
    return jax.device_put(host_params, shardings)
