"""`rl.backend = "ray"`: samplers, environment workers and the learner as Ray actors.

Not implemented yet. The pieces it needs are already process-safe and shared with the threads
backend:
  - weights:  WeightPublisher(directory, full_every) in the learner writes lossless deltas /
              full snapshots; each sampler actor runs a WeightSubscriber on the same directory
              (or receives the blobs through the object store) and calls SamplerService.swap.
  - groups:   env-worker actors return FinishedGroup objects; the driver's GroupStore makes
              them durable before the learner consumes them, exactly as now.
  - control:  the Orchestrator's reconciler / staleness bound / requeue logic is unchanged;
              only `service.submit` becomes a remote call (a sampler actor with
              max_concurrency > 1 wrapping SamplerService), and env workers become actors
              restarted by Ray (max_restarts) with their in-flight episodes requeued by the
              driver when the actor's ObjectRef fails.
"""
from __future__ import annotations


def run_rl_ray(cfg, workdir: str) -> dict:
    try:
        import ray  # noqa: F401
    except ImportError:
        from c2jax.config import ConfigError
        raise ConfigError("rl.backend='ray' needs Ray (`pip install ray==2.60.0`); or use rl.backend='threads'") from None
    raise NotImplementedError("rl.backend='ray' is not implemented yet; use rl.backend='threads' (the default)")
