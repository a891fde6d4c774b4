"""Multi-host (multi-controller SPMD): one Python process per host, all running the same program.

`initialize()` starts JAX's distributed runtime:
- TPU pod slices: no arguments; JAX reads the coordinator, process count and id from the TPU
  environment (run the same command on every worker, e.g. `gcloud ... ssh --worker=all`).
- GPU clusters / CPU: explicit coordinator flags, or the environment variables
  C2JAX_COORDINATOR (host:port of process 0), C2JAX_NUM_PROCESSES, C2JAX_PROCESS_ID and
  optionally C2JAX_LOCAL_DEVICE_IDS ("0,1,2,3"). Under SLURM or Open MPI, JAX's own cluster
  detection also works with no arguments.

Per-process data: every process loads only the rows of the global batch that land on its own
devices (`local_rows`), and `global_batch` assembles the global jax.Arrays from those rows,
after the 2*CP zigzag reorder of the length dim when context parallelism is on.
"""
from __future__ import annotations

import os

import jax
import numpy as np

from c2jax.config import ConfigError

ENV_COORDINATOR = "C2JAX_COORDINATOR"
ENV_NUM_PROCESSES = "C2JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "C2JAX_PROCESS_ID"
ENV_LOCAL_DEVICES = "C2JAX_LOCAL_DEVICE_IDS"


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, local_device_ids=None) -> dict:
    """Start jax.distributed (once). Explicit arguments win over C2JAX_* environment variables;
    with neither, JAX auto-detects the cluster (TPU pod, SLURM, Open MPI). A single process
    without any cluster is left alone. Returns {"process_id", "num_processes", "devices",
    "local_devices"}."""
    env = os.environ
    coordinator_address = coordinator_address or env.get(ENV_COORDINATOR) or None
    if num_processes is None and env.get(ENV_NUM_PROCESSES):
        num_processes = int(env[ENV_NUM_PROCESSES])
    if process_id is None and env.get(ENV_PROCESS_ID):
        process_id = int(env[ENV_PROCESS_ID])
    if local_device_ids is None and env.get(ENV_LOCAL_DEVICES):
        local_device_ids = [int(i) for i in env[ENV_LOCAL_DEVICES].split(",")]
    explicit = coordinator_address is not None
    if explicit and (num_processes is None or process_id is None):
        raise ConfigError(f"a coordinator address was given ({coordinator_address}) but not the process count "
                          f"and id: pass num_processes/process_id or set {ENV_NUM_PROCESSES} and {ENV_PROCESS_ID}")
    if explicit and not 0 <= process_id < num_processes:
        raise ConfigError(f"process_id={process_id} must be in [0, num_processes={num_processes})")
    if not is_initialized():
        if explicit:
            jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                                       process_id=process_id, local_device_ids=local_device_ids)
        elif _cluster_detected():
            jax.distributed.initialize()
    return {"process_id": jax.process_index(), "num_processes": jax.process_count(),
            "devices": jax.device_count(), "local_devices": jax.local_device_count()}


def _cluster_detected() -> bool:
    env = os.environ
    return any(k in env for k in ("TPU_WORKER_HOSTNAMES", "MEGASCALE_COORDINATOR_ADDRESS", "SLURM_JOB_ID",
                                  "OMPI_COMM_WORLD_SIZE")) and int(env.get("SLURM_NTASKS", "2")) > 1


def is_initialized() -> bool:
    try:
        return jax.distributed.is_initialized()
    except AttributeError:  # older jax
        from jax._src import distributed
        return distributed.global_state.client is not None


def local_rows(sharding, global_shape) -> np.ndarray:
    """Sorted global row indices (dim 0) of `global_shape` that this process's devices hold."""
    rows = set()
    for index in sharding.addressable_devices_indices_map(tuple(global_shape)).values():
        rows.update(range(global_shape[0])[index[0]])
    return np.asarray(sorted(rows), dtype=np.int64)


def global_batch(cfg, mesh, local_batch: dict, global_batch_size: int) -> dict:
    """Global jax.Arrays [global_batch_size, L, ...] from this process's rows (`local_rows` of
    the data sharding, in order), zigzag-reordered along the length dim when CP > 1."""
    from c2jax.parallel.context import zigzag_order
    from c2jax.parallel.mesh import data_sharding
    cp = mesh.shape.get("context", 1)
    out = {}
    for key, value in local_batch.items():
        value = np.asarray(value)
        if value.ndim >= 2 and cp > 1:
            value = np.take(value, zigzag_order(value.shape[1], cp), axis=1)  # host-side: no device round trip
        sharding = data_sharding(cfg, mesh, value.ndim)
        global_shape = (global_batch_size,) + value.shape[1:]
        want = len(local_rows(sharding, global_shape))
        if value.shape[0] != want:
            raise ConfigError(f"batch[{key!r}] has {value.shape[0]} local rows; this process holds {want} rows "
                              f"of the global batch {global_batch_size} (see c2jax.parallel.distributed.local_rows)")
        out[key] = jax.make_array_from_process_local_data(sharding, value, global_shape)
    return out
