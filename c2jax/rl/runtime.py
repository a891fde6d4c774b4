"""What both RL backends build: the environment (`make_env`) and the learner side (`LearnerHost`).

c2jax.rl.loop.LocalRuntime (threads) and c2jax.rl.ray_backend's actors (Ray) both build on these;
neither backend module imports the other, and the driver (c2jax.rl.loop.run_rl) imports both.
"""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from c2jax.errors import ConfigError
from c2jax.rl.learner import Learner
from c2jax.rl.rollout import HarnessEnv, ToyEnv
from c2jax.rl.weight_sync import WeightPublisher


def _initial_params(cfg, mesh=None):
    """Random init, a run directory's latest checkpoint or a Hugging Face directory
    (train.init_from); on a mesh each device reads / makes only its slices."""
    if mesh is not None:
        from c2jax.models import param_shardings
        from c2jax.parallel.mesh import activate
        from c2jax.train.loop import initial_params
        with activate(cfg, mesh):
            return initial_params(cfg, param_shardings(cfg, mesh))
    from c2jax.models import init_params
    src = cfg.train.init_from
    if not src:
        return init_params(cfg, jax.random.key(cfg.seed))
    from c2jax.train.loop import _is_hf_dir, load_run_params
    if _is_hf_dir(src):
        from c2jax import hf
        _, params = hf.load(src, dtype=cfg.model.param_dtype)
        return params
    return load_run_params(src, cfg)


def _tokenizer(cfg, workdir):
    from c2jax.data.tokenizer import Tokenizer
    for d in (workdir, cfg.train.init_from):
        if d and os.path.exists(os.path.join(d, "tokenizer.json")):
            if d != workdir:
                import shutil
                shutil.copy(os.path.join(d, "tokenizer.json"), os.path.join(workdir, "tokenizer.json"))
            return Tokenizer.load(d)
    return None  # the harness falls back to its byte codec


def make_env(cfg, workdir):
    """The configured environment: the toy env, or the agent harness with the run's tokenizer."""
    r = cfg.rl
    if r.env == "toy":
        return ToyEnv(r, cfg.model.vocab_size)
    tok = _tokenizer(cfg, workdir)
    if tok is not None and tok.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"the tokenizer has {tok.vocab_size} tokens but model.vocab_size={cfg.model.vocab_size}")
    return HarnessEnv(r, tok)


class LearnerHost:
    """The learner side of a run (in this process, or inside the Ray learner actor): the Learner
    (on roles.learner_mesh), its checkpoints (the latest restored on start, in the mesh's
    layout) and a WeightPublisher (into publish_dir for other processes; None: sizes measured
    only). roles: c2jax.rl.roles.rl_meshes (None: one device, the sampler beside it)."""

    def __init__(self, cfg, workdir: str, publish_dir: str | None = None, roles=None):
        from c2jax.rl.learner import learner_cfg
        from c2jax.train.checkpoint import Checkpointer, abstract_like
        r = cfg.rl
        self.roles = roles
        mesh = roles.learner_mesh if roles is not None else None
        self.learner = Learner(cfg, _initial_params(learner_cfg(cfg), mesh), seed=cfg.seed, mesh=mesh)
        self.ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), r.checkpoint_every, r.keep_checkpoints,
                                 async_save=True)  # finalized atomically: a crash mid-save restores the previous step
        self.start_step, self.consumed, self.dropped = 0, [], []
        if self.ckpt.latest_step() is not None:
            shardings = getattr(self.learner, "state_shardings", None)
            state, data, _ = self.ckpt.restore(None, abstract_like(self.learner.state, shardings))
            self.learner.state = state
            self.consumed, self.dropped = sorted(data.get("consumed", [])), list(data.get("dropped", []))
            self.start_step = int(state["step"])
        self.publisher = WeightPublisher(publish_dir, r.delta_full_every, r.sync_dtype, keep=2 if publish_dir else 0)

    def sampler_params(self):
        """The sampler's copy of the params: cast to rl.sync_dtype, resharded onto the sampler's
        devices (c2jax.rl.roles.reshard; new arrays: the learner's state is donated at every step)."""
        from c2jax.rl.roles import reshard, sampler_shardings
        params = self.learner.params
        if self.roles is None:
            return self.publisher.cast(jax.tree.map(jnp.copy, params))
        if not hasattr(self, "_sampler_sh"):
            self._sampler_sh = sampler_shardings(self.learner.cfg, self.roles, params)
        return reshard(params, self._sampler_sh, self.publisher.sync_dtype)

    def step(self, trajs, adv_B, w_B) -> dict:
        return self.learner.step(trajs, adv_B, w_B)

    def save(self, step: int, data: dict, meta: dict, force: bool = False) -> None:
        self.ckpt.save(step, self.learner.state, data, meta, force=force)

    def publish(self, step: int) -> dict:
        return self.publisher.publish(step, self.learner.params)

    def close(self) -> None:
        self.ckpt.close()
