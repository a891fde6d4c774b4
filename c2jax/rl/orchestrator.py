"""The asynchronous orchestrator (threads backend): a reconciler admits groups under the
staleness bound, environment workers run episodes against the sampler service, finished groups
are checkpointed (GroupStore) and handed to the learner.

Staleness bound S: a group's start version is the policy version published when it was
admitted; group index i is admitted only while i < (published_version + S + 1) * P, so the
learner (which trains P groups per version) sees groups at most S versions old in order.
S = 0 is the synchronous algorithm: the P groups of step k are sampled entirely by version k
and the learner waits for all of them. Groups that are older than S when the learner takes
them (after restarts / requeues) are dropped, reweighted or kept (rl.stale_policy).

Prompts: the stream of group indices maps to tasks through `PromptSource` (each task used
once; with several suites the suite of each new prompt is drawn by weight, and later in
training harder suites, measured by turns and thinking tokens of their finished groups, are
upsampled by (1 + curriculum_strength * progress * relative hardness)). The assignment of
every admitted index is written to the admissions ledger so a resumed run maps it the same.

Failures: an environment worker that dies is restarted by the supervisor and its episode is
requeued; an episode whose sampler engine died (SamplerDied) is requeued with a new attempt
number; the sampler service restarts its own engine.
"""
from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time

import numpy as np

from c2jax.rl.rollout import SamplerDied, WorkerKilled
from c2jax.rl.store import FinishedGroup, GroupStore

log = logging.getLogger(__name__)


class PromptSource:
    """index -> task, each task used at most once; suites drawn by (curriculum) weight."""

    def __init__(self, env, rl, seed: int, total: int, store: GroupStore):
        self.rl, self.seed, self.store = rl, seed, store
        self.suites = list(rl.suites)
        n_per = max(total, 1)
        self.pools = {s: env.load_tasks(s, "train", n_per, seed) for s in self.suites}
        self.base_w = np.asarray(rl.suite_weights or [1.0] * len(self.suites), np.float64)
        self.cursor = {s: 0 for s in self.suites}
        self.hard_sum = {s: 0.0 for s in self.suites}
        self.hard_n = {s: 0 for s in self.suites}
        self.assigned: dict[int, tuple[str, int]] = store.admissions()
        for s, pos in self.assigned.values():
            self.cursor[s] = max(self.cursor[s], pos + 1)
        self.progress = 0.0
        self._lock = threading.Lock()

    def observe(self, suite: str, hardness: float):
        with self._lock:
            self.hard_sum[suite] += hardness
            self.hard_n[suite] += 1

    def weights(self) -> np.ndarray:
        w = self.base_w.copy()
        if self.rl.curriculum_strength > 0 and len(self.suites) > 1:
            h = np.asarray([self.hard_sum[s] / self.hard_n[s] if self.hard_n[s] else np.nan for s in self.suites])
            if np.isfinite(h).any():
                h = np.where(np.isfinite(h), h, np.nanmean(h))
                rel = h / max(np.mean(h), 1e-9)
                w = w * (1.0 + self.rl.curriculum_strength * self.progress * rel)
        avail = np.asarray([self.cursor[s] < len(self.pools[s]) for s in self.suites], np.float64)
        w = w * avail
        return w / w.sum() if w.sum() > 0 else w

    def task_for(self, index: int):
        with self._lock:
            if index in self.assigned:
                s, pos = self.assigned[index]
                return self.pools[s][pos]
            w = self.weights()
            if w.sum() == 0:
                raise RuntimeError("out of training prompts: raise rl.num_train_tasks")
            rng = np.random.default_rng([self.seed, index, 7])
            s = self.suites[int(rng.choice(len(self.suites), p=w))]
            pos = self.cursor[s]
            self.cursor[s] += 1
            self.assigned[index] = (s, pos)
            self.store.record_admission(index, s, pos)
            return self.pools[s][pos]


@dataclasses.dataclass
class GroupJob:
    index: int
    task: object
    suite: str
    start_version: int
    size: int
    results: list = dataclasses.field(default_factory=list)
    attempts: list = dataclasses.field(default_factory=list)
    done: int = 0

    def __post_init__(self):
        self.results = [None] * self.size
        self.attempts = [0] * self.size


class Orchestrator:
    """Reconciler + environment workers + supervisor around a SamplerService."""

    def __init__(self, rl, env, service, store: GroupStore, source: PromptSource, *, version: int,
                 consumed: set[int], seed: int, total_groups: int):
        self.rl, self.env, self.service, self.store, self.source = rl, env, service, store, source
        self.seed = seed
        self.version = int(version)
        self.consumed = set(consumed)
        self.total_groups = int(total_groups)
        self.cond = threading.Condition()
        self.ready: dict[int, FinishedGroup] = {}
        self.jobs: queue.Queue = queue.Queue()
        self.inflight: dict[int, GroupJob] = {}
        self.requeue: list[int] = []
        self.env_restarts = 0
        self._stop = threading.Event()
        self._kill_worker = threading.Event()
        self.error: BaseException | None = None
        # resume: finished groups from the store, admitted-but-unfinished ones requeued
        admitted = set(source.assigned)
        for i in store.indices():
            if i not in self.consumed:
                g = store.get(i)
                if g is not None:
                    self.ready[i] = g
        self.requeue = sorted(i for i in admitted if i not in self.consumed and i not in self.ready)
        self.next_index = max(admitted, default=-1) + 1
        self.workers: list[threading.Thread] = []
        self.threads: list[threading.Thread] = []

    # -- lifecycle
    def start(self):
        for w in range(self.rl.env_workers):
            self.workers.append(self._spawn_worker(w))
        for fn, name in ((self._reconcile, "c2jax-reconciler"), (self._supervise, "c2jax-supervisor")):
            t = threading.Thread(target=fn, name=name, daemon=True)
            t.start()
            self.threads.append(t)
        return self

    def stop(self):
        self._stop.set()
        with self.cond:
            self.cond.notify_all()
        for t in self.threads + self.workers:
            t.join(timeout=30)

    def kill_env_worker(self):
        """The next worker to take a job dies (its episode is requeued) (tests)."""
        self._kill_worker.set()

    def set_version(self, version: int):
        with self.cond:
            self.version = int(version)
            self.source.progress = min(1.0, version / max(self.rl.steps, 1))
            self.cond.notify_all()

    def extend_total(self, n: int = 1):
        with self.cond:
            self.total_groups += n
            self.cond.notify_all()

    # -- reconciler
    def _admit_limit(self) -> int:
        return min(self.total_groups, (self.version + self.rl.staleness + 1) * self.rl.prompts_per_step)

    def _reconcile(self):
        try:
            while not self._stop.is_set():
                with self.cond:
                    while not self._stop.is_set():
                        limit = self._admit_limit()
                        if self.requeue:  # admitted before a restart, unfinished: same bound as new ones
                            if self.requeue[0] >= limit:
                                break
                            idx = self.requeue.pop(0)
                        elif self.next_index < limit:
                            idx = self.next_index
                            self.next_index += 1
                            if idx in self.consumed or idx in self.ready:
                                continue
                        else:
                            break
                        self._admit(idx)
                    self.cond.wait(0.05)
        except BaseException as e:  # noqa: BLE001
            self.error = e
            with self.cond:
                self.cond.notify_all()

    def _admit(self, idx: int):
        task = self.source.task_for(idx)
        suite = self.source.assigned[idx][0]
        job = GroupJob(idx, task, suite, self.version, self.rl.group_size)
        self.inflight[idx] = job
        for j in range(job.size):
            self.jobs.put((job, j))

    # -- environment workers
    def _spawn_worker(self, w: int) -> threading.Thread:
        t = threading.Thread(target=self._work_guarded, args=(w,), name=f"c2jax-env-{w}", daemon=True)
        t.start()
        return t

    def _supervise(self):
        while not self._stop.is_set():
            time.sleep(0.05)
            for w, t in enumerate(self.workers):
                if not t.is_alive() and not self._stop.is_set():
                    self.env_restarts += 1
                    log.warning("environment worker %d died; restarting (restart %d)", w, self.env_restarts)
                    if self.env_restarts > self.rl.worker_restarts:
                        self.error = RuntimeError(f"environment workers died {self.env_restarts} times; giving up")
                        with self.cond:
                            self.cond.notify_all()
                        return
                    self.workers[w] = self._spawn_worker(w)

    def _work_guarded(self, w: int):
        try:
            self._work(w)
        except Exception as e:  # noqa: BLE001 - the thread ends; the supervisor restarts it
            log.warning("environment worker %d died: %s: %s", w, type(e).__name__, e)

    def _work(self, w: int):
        while not self._stop.is_set():
            try:
                job, j = self.jobs.get(timeout=0.05)
            except queue.Empty:
                continue
            if self._kill_worker.is_set():
                self._kill_worker.clear()
                self.jobs.put((job, j))  # requeue the in-flight episode, then die
                raise WorkerKilled(f"env worker {w} killed")
            key = f"{job.index}/{j}/{job.attempts[j]}"
            seed = self.seed + 1_000_003 * job.attempts[j]
            try:
                traj, passed = self.env.episode(job.task, self.service, key, seed, self.rl.temperature,
                                                group_id=str(job.index))
            except SamplerDied:
                job.attempts[j] += 1
                self.jobs.put((job, j))
                continue
            except Exception as e:  # noqa: BLE001 - an env failure requeues the episode; the worker restarts
                job.attempts[j] += 1
                self.jobs.put((job, j))
                log.warning("episode %s failed (%s: %s); requeued", key, type(e).__name__, e)
                raise
            job.results[j] = (traj, passed)
            with self.cond:
                job.done += 1
                finished = job.done == job.size
            if finished:
                self._finish(job)

    def _finish(self, job: GroupJob):
        # an attempt is a Trajectory, or a chain (list of segments, summaries on): the group stores
        # every segment in order (stats chain_length says where a chain ends) and one reward per attempt
        chains = [r[0] if isinstance(r[0], list) else [r[0]] for r in job.results]
        trajs = [t for c in chains for t in c]
        vers = [int(t.versions_T.max()) for t in trajs if len(t.versions_T)]
        g = FinishedGroup(index=job.index, task_id=str(getattr(job.task, "task_id", job.index)), suite=job.suite,
                          start_version=job.start_version, trajectories=trajs,
                          rewards=[float(c[-1].reward) for c in chains], passed=[r[1] for r in job.results],
                          attempt=max(job.attempts), end_version=max(vers, default=job.start_version))
        self.store.put(g)  # durable before the learner can use it
        self.source.observe(job.suite, g.hardness)
        with self.cond:
            self.inflight.pop(job.index, None)
            self.ready[job.index] = g
            self.cond.notify_all()

    # -- learner side
    def take(self, n: int, learner_version: int, timeout: float | None = None) -> list[FinishedGroup]:
        """n finished groups, oldest start version first (blocks). Groups that would exceed the
        staleness bound after this step (start_version <= learner_version - S) are mandatory:
        while one of them is still running the learner waits for it, so the bound holds even when
        groups finish out of order (with S = 0 this is exactly the synchronous batch).
        Raises if a background thread failed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        due = learner_version - self.rl.staleness
        with self.cond:
            while True:
                if self.error is not None:
                    raise RuntimeError(f"orchestrator failed: {self.error!r}") from self.error
                waiting_on_due = any(j.start_version <= due for j in self.inflight.values())
                if len(self.ready) >= n and not waiting_on_due:
                    break
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"only {len(self.ready)} of {n} groups finished in {timeout}s")
                self.cond.wait(0.1)
            picked = sorted(self.ready.values(), key=lambda g: (g.start_version, g.index))[:n]
            for g in picked:
                del self.ready[g.index]
            return picked

    def mark_consumed(self, indices):
        with self.cond:
            self.consumed.update(indices)
