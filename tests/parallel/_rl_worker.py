"""Worker for test_distributed: a few RL learner steps (Dr. GRPO, k1 KL to the reference, router
replay) of the tiny model on a (data, fsdp, context, expert) mesh, in one or several processes.
Every process builds the same trajectories and batch. Prints `LOSSES <json>` from process 0."""
import json
import os
import sys

import jax
import numpy as np


def main():
    from c2jax.parallel import distributed
    info = distributed.initialize()     # from C2JAX_* env vars (or nothing: single process)
    import c2jax
    import c2jax.sections  # noqa: F401  (the data / eval / rl config sections)
    from c2jax.config import load_config
    from c2jax.parallel import make_mesh
    from c2jax.rl.learner import Learner
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # tests/
    from small_models import random_trajectories

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
        trajs = random_trajectories(cfg, 8, seed=step, prompt_len=6, unrecorded=0)
        m = learner.step(trajs, np.linspace(-1, 1, len(trajs)).astype(np.float32))
        losses.append(m["loss"])
    if info["process_id"] == 0:
        print("LOSSES " + json.dumps({"losses": losses, **info}), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    main()
