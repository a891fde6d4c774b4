"""Worker for test_distributed: a few train steps of the tiny model on a (data, context, expert)
mesh, in one or several processes. Prints `LOSSES <json>` from process 0."""
import json
import os
import sys

import jax
import numpy as np


def batches(cfg, steps):
    rng = np.random.default_rng(0)
    B, L = cfg.train.batch_size, cfg.train.seq_len
    for _ in range(steps):
        tokens = rng.integers(0, cfg.model.vocab_size, (B, L + 1))
        seg = np.ones((B, L), np.int32)
        seg[:, L // 2 + 3:] = 2
        pos = np.where(seg == 1, np.arange(L), np.arange(L) - (L // 2 + 3)).astype(np.int32)
        yield {"inputs": tokens[:, :-1].astype(np.int32), "targets": tokens[:, 1:].astype(np.int32),
               "positions": pos, "segment_ids": seg, "loss_weights": np.ones((B, L), np.float32)}


def main():
    from c2jax.parallel import distributed
    info = distributed.initialize()     # from C2JAX_* env vars (or nothing: single process)
    import c2jax
    import c2jax.sections  # noqa: F401  (the data / eval / rl config sections)
    from c2jax.config import default_config
    from c2jax.models import param_shardings
    from c2jax.parallel import activate, data_sharding, make_mesh
    from c2jax.train.optimizer import make_optimizer
    from c2jax.train.step import init_state, make_train_step, state_shardings

    cfg = default_config()
    cfg.model.attention = sys.argv[1]
    cfg.model.moe_dispatch = "dropless"
    cfg.mesh.shape = tuple(int(s) for s in sys.argv[2].split(","))
    cfg.mesh.rules = tuple((n, ("fsdp", "context")) if n == "embed" else (n, t) for n, t in cfg.mesh.rules)
    cfg.train.batch_size, cfg.train.seq_len, cfg.train.steps = 4, 16, 3
    params = c2jax.models.init_params(cfg, jax.random.key(0))
    mesh = make_mesh(cfg)
    from c2jax.ops import target_of_mesh
    optimizer = make_optimizer(cfg.train, target_of_mesh(mesh))
    losses = []
    with activate(cfg, mesh):
        p_sh = param_shardings(cfg, mesh)
        params = jax.device_put(params, p_sh)
        abstract = jax.eval_shape(lambda p: init_state(cfg, optimizer, p, 0), params)
        st_sh = state_shardings(cfg, optimizer, mesh, p_sh, abstract)
        state = jax.jit(lambda p: init_state(cfg, optimizer, p, 0), out_shardings=st_sh)(params)
        step = make_train_step(cfg, optimizer, st_sh, data_sharding(cfg, mesh))
        for batch in batches(cfg, cfg.train.steps):
            rows = distributed.local_rows(data_sharding(cfg, mesh), batch["inputs"].shape)
            local = {k: v[rows] for k, v in batch.items()}
            state, metrics = step(state, distributed.global_batch(cfg, mesh, local, cfg.train.batch_size))
            losses.append(float(np.asarray(metrics["loss"])))
    if info["process_id"] == 0:
        print("LOSSES " + json.dumps({"losses": losses, **info}), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    main()
