"""Worker for test_distributed: a few RL learner steps (Dr. GRPO, k1 KL to the reference, router
replay) of the tiny model on a (data, fsdp, context, expert) mesh, in one or several processes.
Every process builds the same trajectories and batch. Prints `LOSSES <json>` from process 0."""
import json
import os
import sys

import jax
import numpy as np


def trajectories(cfg, n, seed=0):
    from c2jax.models.transformer import layer_counts
    from c2jax.trajectory import Trajectory
    rng = np.random.default_rng(seed)
    m = cfg.model
    _, N = layer_counts(m)
    out = []
    for _ in range(n):
        T = int(rng.integers(10, 30))
        mask = np.zeros(T, bool)
        mask[6:] = True
        ex = np.stack([np.stack([rng.permutation(m.num_experts)[:m.num_experts_per_tok] for _ in range(N)])
                       for _ in range(T)]).astype(np.int32)
        out.append(Trajectory(rng.integers(0, m.vocab_size, T).astype(np.int32), mask,
                              np.where(mask, -3 * rng.random(T), 0).astype(np.float32), np.zeros(T, np.int32), ex,
                              finish_reason="stop"))
    return out


def main():
    from c2jax.parallel import distributed
    info = distributed.initialize()     # from C2JAX_* env vars (or nothing: single process)
    import c2jax
    from c2jax.config import load_config
    from c2jax.parallel import make_mesh
    from c2jax.rl.learner import Learner

    cfg = load_config("configs/rl_tiny.py:toy", [])
    cfg.model.attention = sys.argv[1]
    cfg.model.max_position_embeddings = 256
    cfg.mesh.shape = tuple(int(s) for s in sys.argv[2].split(","))
    cfg.mesh.rules = tuple((n, ("fsdp", "context")) if n == "embed" else (n, t) for n, t in cfg.mesh.rules)
    cfg.rl.kl_coef = 0.05
    params = c2jax.models.init_params(cfg, jax.random.key(0))
    mesh = make_mesh(cfg) if jax.device_count() > 1 else None
    learner = Learner(cfg, params, mesh=mesh)
    losses = []
    for step in range(3):
        trajs = trajectories(cfg, 8, seed=step)
        m = learner.step(trajs, np.linspace(-1, 1, len(trajs)).astype(np.float32))
        losses.append(m["loss"])
    if info["process_id"] == 0:
        print("LOSSES " + json.dumps({"losses": losses, **info}), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    main()
