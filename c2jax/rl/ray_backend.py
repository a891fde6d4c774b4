"""`rl.backend = "ray"`: the learner, the samplers and the environment workers as Ray actors.

    run_rl(cfg, workdir)   # with cfg.rl.backend = "ray" (c2jax.rl.loop builds a RayRuntime)

The driver (c2jax.rl.loop.run_rl) is the threads backend's, unchanged: its Orchestrator admits
groups under the staleness bound, its worker threads run episodes, GroupStore makes finished
groups durable before the learner takes them, and the learner loop, eval and metrics are the
same. What moves into actors:
  - LearnerActor:  a LearnerHost (Learner, checkpoints, WeightPublisher into workdir/weights).
                   Every version is published as a lossless delta (a full snapshot every
                   rl.delta_full_every) and the blob travels to the samplers through the object
                   store; sync/blob_bytes vs sync/full_bytes are logged as in the threads backend.
  - SamplerActor:  a SamplerService (continuous batching, in-flight swaps at chunk boundaries);
                   it applies each delta onto its copy and swaps. Restarted by Ray (max_restarts
                   = rl.worker_restarts), it fetches a full snapshot of the last published
                   version from the learner; requests lost with it are resubmitted once it is up.
  - EnvActor:      runs env.episode against a sampler actor (a group is pinned to one sampler).
                   When it dies, its in-flight episodes fail on the driver (EnvActorDied); the
                   orchestrator requeues them (new attempt) and restarts the worker thread
                   (env_worker_restarts), and Ray restarts the actor (max_restarts =
                   rl.worker_restarts) while new episodes wait for it.
The learner actor is not restarted: a learner failure ends the run, and rerunning on the same
workdir resumes from the checkpoint and the group store, as with the threads backend.

Ray is imported only here, and only when a RayRuntime is built.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import zlib

import jax
import numpy as np

from c2jax.errors import ConfigError
from c2jax.rl.runtime import LearnerHost, make_env

log = logging.getLogger(__name__)


def import_ray():
    """The ray module, or a ConfigError saying how to get it."""
    try:
        import ray
    except ImportError:
        raise ConfigError("rl.backend='ray' needs Ray (`pip install ray==2.60.0` or `pip install -e .[ray]`); "
                          "or use rl.backend='threads'") from None
    return ray


def check_address(address: str, timeout_s: float = 10.0) -> None:
    """Fail fast (ray.init retries for minutes) when rl.ray_address names a host:port that does
    not accept connections ("auto" / "local" are left to Ray)."""
    if address in ("auto", "local") or ":" not in address:
        return
    host, _, port = address.split("://", 1)[-1].rstrip("/").rpartition(":")
    if not port.isdigit():
        raise ConfigError(f"rl.ray_address={address!r}: expected host:port, ray://host:port or 'auto'")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise RuntimeError(f"cannot reach the Ray cluster at rl.ray_address={address!r}: {e}") from e


def init_ray(r):
    """Join rl.ray_address, or start a local cluster of rl.ray_num_cpus CPUs (reused when this
    process already has one). Returns (ray, started_here)."""
    ray = import_ray()
    if ray.is_initialized():
        return ray, False
    if r.ray_address:
        check_address(r.ray_address)
    try:
        if r.ray_address:
            ray.init(address=r.ray_address, log_to_driver=False)
        else:
            ray.init(num_cpus=int(r.ray_num_cpus), include_dashboard=False, log_to_driver=False)
    except Exception as e:  # noqa: BLE001 - ConnectionError, RuntimeError, ValueError, ... from ray.init
        where = f"the Ray cluster at rl.ray_address={r.ray_address!r}" if r.ray_address else "a local Ray cluster"
        raise RuntimeError(f"could not start or join {where}: {type(e).__name__}: {e}") from e
    return ray, True


def check_resources(ray, r) -> None:
    """Fail fast (instead of actors pending forever) when the cluster cannot hold the actors."""
    have = ray.cluster_resources()
    need = {"CPU": 1.0 + r.ray_samplers, "GPU": float(r.ray_learner_gpus) + r.ray_samplers * float(r.ray_sampler_gpus)}
    short = {k: (v, have.get(k, 0.0)) for k, v in need.items() if v > have.get(k, 0.0)}
    if short:
        raise RuntimeError("the Ray cluster cannot hold the learner and rl.ray_samplers sampler actors: "
                           + ", ".join(f"{k}: need {n:g}, cluster has {h:g}" for k, (n, h) in short.items()))


RESTART_WAIT_S = 600.0  # how long a call waits for a restarting actor (a sampler recompiles)


def call_actor(method, *args, ref=None, wait_s: float = RESTART_WAIT_S):
    """ray.get(method.remote(*args)) (or of `ref`, already submitted), resubmitted while the actor
    is restarting (ActorUnavailableError) for up to wait_s; an actor that died with the call in
    flight raises ActorDiedError (the caller requeues the work)."""
    import ray
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return ray.get(method.remote(*args) if ref is None else ref)
        except ray.exceptions.ActorUnavailableError:
            if time.monotonic() > deadline:
                raise
            ref = None
            time.sleep(0.2)


def blob_header(blob: bytes) -> dict:
    """The JSON header of a weight_sync blob (kind, version) without decoding the arrays."""
    n = int.from_bytes(blob[:4], "little")
    return json.loads(blob[4:4 + n])


# ----------------------------------------------------------------------------- actors (plain
# classes; ray.remote is applied in RayRuntime so that importing this module never needs ray)


class LearnerActor:
    """Owns a LearnerHost; publishes every version into workdir/weights and returns its blob."""

    def __init__(self, cfg, workdir: str):
        from c2jax.rl.roles import process_roles
        self.dir = os.path.join(workdir, "weights")
        self.roles = process_roles(cfg, "learner")   # mesh.shape over this actor's devices
        self.host = LearnerHost(cfg, workdir, publish_dir=self.dir, roles=self.roles)
        self.version = self.host.start_step
        self.stats = self.host.publish(self.version)

    def start(self) -> tuple[int, list, list]:
        h = self.host
        return h.start_step, list(h.consumed), list(h.dropped)

    def devices(self) -> dict:
        return self.roles.describe()

    def template(self):
        """The params tree with int leaves (the samplers rebuild the pytree from flat blobs)."""
        return jax.tree.map(lambda _: 0, self.host.learner.params)

    def step(self, trajs, adv_B, w_B) -> dict:
        return self.host.step(trajs, adv_B, w_B)

    def save(self, step: int, data: dict, meta: dict, force: bool = False) -> None:
        self.host.save(step, data, meta, force)

    def _blob(self, version: int, full: bool) -> bytes:
        with open(os.path.join(self.dir, f"v{version:08d}.{'full' if full else 'delta'}"), "rb") as f:
            return f.read()

    def latest(self) -> bytes:
        """The blob of the current version (published at start or by the last `publish`)."""
        return self._blob(self.version, bool(self.stats["sync/full"]))

    def publish(self, version: int) -> tuple[dict, bytes]:
        """Publish the current params as `version`: (size stats, delta or full blob)."""
        self.stats = self.host.publish(version)
        self.version = version
        return self.stats, self.latest()

    def full_blob(self) -> bytes:
        """A full snapshot of the last published version (for a restarted sampler)."""
        from c2jax.rl.weight_sync import encode_full
        return encode_full(self.host.publisher.prev, self.version)

    def params(self):
        return jax.device_get(self.host.learner.params)

    def close(self) -> None:
        self.host.close()


class SamplerActor:
    """A SamplerService fed by weight blobs: `submit` blocks on one request's completions (the
    actor is threaded, so concurrent episodes batch together), `load` applies a blob in flight."""

    def __init__(self, cfg, template, blob: bytes, max_batch: int, max_len: int, chunk: int, learner=None,
                 decode_devices: int = 1):
        import ray

        from c2jax.rl.roles import process_roles, sampler_cfg, sampler_shardings
        from c2jax.rl.rollout import SamplerService
        self.template = template
        self._lock = threading.Lock()
        if learner is not None and ray.get_runtime_context().was_current_actor_reconstructed:
            blob = ray.get(learner.full_blob.remote())  # restarted: the newest weights, not the constructor's
        from c2jax.rl.weight_sync import apply_blob
        version, self.flat = apply_blob(None, blob)
        self.roles = process_roles(cfg, "sampler")   # rl.sampler_mesh_shape over this actor's devices
        self.shardings = sampler_shardings(cfg, self.roles)
        self.service = SamplerService(sampler_cfg(cfg), self._params(), version, max_batch, max_len, chunk,
                                      decode_devices, mesh=self.roles.sampler_mesh,
                                      speculative=cfg.rl.speculative)

    def _params(self):
        """The published host arrays on this sampler's devices (its mesh's shardings)."""
        from c2jax.rl.roles import put_on
        from c2jax.rl.weight_sync import unflatten_like
        return put_on(unflatten_like(self.template, self.flat), self.shardings)

    def devices(self) -> dict:
        return self.roles.describe()

    def submit(self, request):
        return self.service.submit(request).result()

    def load(self, blob: bytes) -> bool:
        """Apply a full blob, or the delta to the next version; False when a delta does not
        follow this sampler's version (the driver then sends a full snapshot)."""
        from c2jax.rl.weight_sync import apply_blob
        head = blob_header(blob)
        with self._lock:
            if head["kind"] == "delta":
                if head["version"] <= self.service.version:
                    return True  # already there (a restart fetched a newer full snapshot)
                if head["version"] != self.service.version + 1:
                    return False
            version, self.flat = apply_blob(self.flat, blob)
            self.service.swap(self._params(), version)
            return True

    def stats(self) -> tuple:
        """(idle_s, busy_s, generated tokens, engine restarts, pid, MTP drafts proposed, accepted)
        of this incarnation."""
        idle, busy = self.service.counters()
        return (idle, busy, self.service.generated_tokens, self.service.restarts, os.getpid(),
                self.service.spec_drafted, self.service.spec_accepted)

    def version(self) -> int:
        return self.service.version

    def params(self):
        return jax.device_get(self.service.params)

    def call(self, name: str, *args, **kwargs):
        """Any other SamplerService method (so episode code written against the service works)."""
        return getattr(self.service, name)(*args, **kwargs)

    def kill_engine(self) -> None:
        self.service.kill()

    def stop(self) -> None:
        self.service.stop()


class _Pending:
    """Future-like result of a remote submit; a dead sampler actor reads as SamplerDied."""

    def __init__(self, handle, request):
        self.handle, self.request = handle, request
        self.ref = handle.submit.remote(request)

    def result(self):
        import ray

        from c2jax.rl.rollout import SamplerDied
        try:
            return call_actor(self.handle.submit, self.request, ref=self.ref)
        except ray.exceptions.RayActorError as e:
            raise SamplerDied(f"sampler actor died: {type(e).__name__}") from e


class RemoteSampler:
    """What an episode sees as its `service`, inside an env actor: one sampler actor."""

    def __init__(self, handle, max_len: int):
        self.handle, self.S = handle, int(max_len)

    @property
    def version(self) -> int:
        return call_actor(self.handle.version)

    def submit(self, request) -> _Pending:
        return _Pending(self.handle, request)

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return lambda *a: call_actor(self.handle.call, name, *a)


class EnvActor:
    """Runs episodes of the configured env against the sampler actors (threaded actor: several
    episodes at once)."""

    def __init__(self, cfg, workdir: str, samplers: list, max_len: int):
        self.env = make_env(cfg, workdir)
        self.samplers, self.max_len = list(samplers), int(max_len)

    def episode(self, task, key: str, seed: int, temperature: float, group_id: str = ""):
        h = self.samplers[zlib.crc32(group_id.encode()) % len(self.samplers)]  # a group shares one sampler's prefix
        return self.env.episode(task, RemoteSampler(h, self.max_len), key, seed, temperature, group_id=group_id)

    def pid(self) -> int:
        return os.getpid()


# ----------------------------------------------------------------------------- driver side


class EnvActorDied(RuntimeError):
    """An env actor died with the episode in flight (the orchestrator requeues it and restarts
    the worker thread; Ray restarts the actor)."""


class RemoteEnv:
    """The driver's env: tasks load locally, `episode` runs on the least busy env actor."""

    def __init__(self, env, actors: list):
        self.local, self.actors = env, list(actors)
        self.busy = [0] * len(self.actors)
        self._lock = threading.Lock()

    def load_tasks(self, *args, **kwargs):
        return self.local.load_tasks(*args, **kwargs)

    def max_len(self) -> int:
        return self.local.max_len()

    def episode(self, task, service, key: str, seed: int, temperature: float, group_id: str = ""):
        with self._lock:
            i = int(np.argmin(self.busy))
            self.busy[i] += 1
        import ray
        actor = self.actors[i]
        try:
            call_actor(actor.pid)  # waits while the actor is restarting
            return ray.get(actor.episode.remote(task, key, seed, temperature, group_id))
        except ray.exceptions.RayActorError as e:  # died / restarted with the episode in flight
            raise EnvActorDied(f"env actor {i} lost episode {key}: {type(e).__name__}") from e
        finally:
            with self._lock:
                self.busy[i] -= 1

    def kill_worker(self, i: int = 0) -> None:
        """Kill env actor i (Ray restarts it; its in-flight episodes are requeued) (tests)."""
        import ray
        ray.kill(self.actors[i], no_restart=False)


class RemoteSamplers:
    """The driver's view of the sampler actors, with the SamplerService counters the loop logs
    (cumulative over actor restarts: a restarted actor, seen by its new pid, starts from zero)."""

    def __init__(self, actors: list, learner):
        self.actors, self.learner = list(actors), learner
        self.version = None
        self.actor_restarts = 0
        self._last: list = [None] * len(self.actors)
        self._base = [(0.0, 0.0, 0, 0, 0, 0)] * len(self.actors)
        self._lock = threading.Lock()

    def _stats(self) -> list[tuple]:
        refs = [a.stats.remote() for a in self.actors]
        polled = [call_actor(a.stats, ref=ref) for a, ref in zip(self.actors, refs)]
        out = []
        with self._lock:
            for i, st in enumerate(polled):
                last = self._last[i]
                if last is not None and st[4] != last[4]:
                    self._base[i] = tuple(b + v for b, v in zip(self._base[i], last[:4] + last[5:]))
                    self.actor_restarts += 1
                self._last[i] = st
                out.append(tuple(b + v for b, v in zip(self._base[i], st[:4] + st[5:])))
        return out

    def counters(self) -> tuple[float, float]:
        st = self._stats()
        return sum(s[0] for s in st), sum(s[1] for s in st)

    @property
    def generated_tokens(self) -> int:
        return sum(s[2] for s in self._stats())

    def spec_counts(self) -> tuple[int, int]:
        """(MTP drafts proposed, accepted) over the actors, from one poll."""
        st = self._stats()
        return sum(s[4] for s in st), sum(s[5] for s in st)

    @property
    def restarts(self) -> int:
        """Engine restarts inside the actors plus restarts of the actors themselves."""
        engine = sum(s[3] for s in self._stats())
        return engine + self.actor_restarts

    def idle_fraction(self) -> float:
        idle, busy = self.counters()
        return idle / (idle + busy) if idle + busy > 0 else 0.0

    @property
    def params(self):
        return call_actor(self.actors[0].params)

    def load(self, blob_ref, version: int) -> None:
        """Every sampler applies the blob (a full snapshot for one that missed a version)."""
        refs = [a.load.remote(blob_ref) for a in self.actors]
        ok = [call_actor(a.load, blob_ref, ref=ref) for a, ref in zip(self.actors, refs)]
        behind = [a for a, good in zip(self.actors, ok) if not good]
        if behind:
            full = self.learner.full_blob.remote()
            for a in behind:
                call_actor(a.load, full)
        self.version = version

    def kill(self) -> None:
        """Make every sampler engine die once (SamplerService restarts it) (tests)."""
        for a in self.actors:
            call_actor(a.kill_engine)

    def stop(self) -> None:
        import ray
        try:
            ray.get([a.stop.remote() for a in self.actors], timeout=60)
        except Exception as e:  # noqa: BLE001 - a dead sampler has nothing to stop
            log.warning("stopping the sampler actors: %s: %s", type(e).__name__, e)


class RayRuntime:
    """The learner / sampler / env-worker side of run_rl as Ray actors (LocalRuntime's interface)."""

    def __init__(self, cfg, workdir: str):
        from c2jax.rl.learner import learner_cfg
        r = cfg.rl
        ray, self.owns_cluster = init_ray(r)
        self.ray = ray
        self.actors = []
        try:
            check_resources(ray, r)
            workdir = os.path.abspath(workdir)
            env = make_env(cfg, workdir)  # also copies the tokenizer into workdir before the actors read it
            restarts = int(r.worker_restarts)
            devs = {}
            if int(r.ray_host_devices):   # CPU hosts: each learner / sampler actor gets this many XLA devices
                flags = f"--xla_force_host_platform_device_count={int(r.ray_host_devices)}"
                devs = {"runtime_env": {"env_vars": {"XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}}}
            self.learner = ray.remote(LearnerActor).options(num_cpus=1, num_gpus=float(r.ray_learner_gpus),
                                                            max_restarts=0, **devs).remote(cfg, workdir)
            self.actors.append(self.learner)
            self.start_step, self.consumed, self.dropped = ray.get(self.learner.start.remote())
            template, blob0 = self.learner.template.remote(), self.learner.latest.remote()
            self._ctor_refs = (template, blob0)  # kept alive: Ray re-runs a restarted sampler's constructor
            per_env = -(-r.env_workers // r.ray_env_actors)
            samplers = [ray.remote(SamplerActor).options(
                num_cpus=1, num_gpus=float(r.ray_sampler_gpus), max_restarts=restarts,
                max_concurrency=2 * r.env_workers + 4,  # training + eval episodes block a thread each
                **devs).remote(learner_cfg(cfg), template, blob0, r.sampler_slots, env.max_len(), r.sampler_chunk, self.learner,
                      r.sampler_decode_devices)
                for _ in range(r.ray_samplers)]
            self.actors += samplers
            envs = [ray.remote(EnvActor).options(num_cpus=0, max_restarts=restarts, max_concurrency=2 * per_env + 2)
                    .remote(cfg, workdir, samplers, env.max_len()) for _ in range(r.ray_env_actors)]
            self.actors += envs
            ray.get([a.pid.remote() for a in envs] + [a.version.remote() for a in samplers])  # all up
            self.env = RemoteEnv(env, envs)
            self.service = RemoteSamplers(samplers, self.learner)
            learner_dev = ray.get(self.learner.devices.remote())
            sampler_dev = ray.get([a.devices.remote() for a in samplers])
            # device ids are each actor's own (every process numbers its devices from 0)
            self._devices = {**{k: v for k, v in learner_dev.items() if k.startswith("learner")},
                             "sampler_devices": [i for d in sampler_dev for i in d["sampler_devices"]],
                             "sampler_mesh_shape": sampler_dev[0]["sampler_mesh_shape"]}
            self._stats, self._swap_s = None, 0.0
            log.info("ray backend: learner + %d sampler + %d env actors on %s", len(samplers), len(envs),
                     r.ray_address or "a local cluster")
        except BaseException:
            self._teardown()
            raise

    def describe(self) -> dict:
        """Each role's devices (ids within its actor's process) and mesh shape."""
        return dict(self._devices)

    def learn(self, trajs, adv_B, w_B) -> dict:
        return self.ray.get(self.learner.step.remote(trajs, adv_B, w_B))

    def save(self, step: int, data: dict, meta: dict, force: bool = False) -> None:
        self.ray.get(self.learner.save.remote(step, data, meta, force))

    def swap(self, step: int) -> None:
        """Publish version `step` (delta / full blob in the object store) and swap it into every
        sampler in flight."""
        t0 = time.monotonic()
        stats_ref, blob_ref = self.learner.publish.options(num_returns=2).remote(step)
        self.service.load(blob_ref, step)
        self._stats, self._swap_s = stats_ref, time.monotonic() - t0

    def publish_stats(self, step: int) -> dict:
        st = dict(self.ray.get(self._stats)) if self._stats is not None else {}
        st["sync/swap_s"] = self._swap_s
        return st

    def close(self) -> None:
        try:
            self.service.stop()
            self.ray.get(self.learner.close.remote())  # waits for the last checkpoint
        finally:
            self._teardown()

    def _teardown(self) -> None:
        for a in self.actors:
            try:
                self.ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001, S110 - already gone
                pass
        self.actors = []
        if self.owns_cluster:
            self.ray.shutdown()
