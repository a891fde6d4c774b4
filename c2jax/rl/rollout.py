"""Rollout side of RL: the sampler service (one thread owns a jitted `Sampler` and batches the
requests of every concurrent episode), the per-episode sampler callable the harness drives,
and the environments (agent-harness episodes with rewards; a toy token task for tests).

Only the public sampling API is used (Sampler.submit / step_chunk / done / results /
swap_params): requests from all episode threads go through one queue, so concurrent episodes
share decode chunks (continuous batching), and `swap` changes the weights between chunks
(in-flight update: a live row continues under the new version, recorded per token).
"""
from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
import zlib
from concurrent.futures import Future

import numpy as np

from c2jax.rl.rewards import behaviour_stats, compute_reward
from c2jax.sampling import Request, Sampler
from c2jax.sampling.api import turn_request
from c2jax.trajectory import Trajectory

log = logging.getLogger(__name__)


class SamplerDied(RuntimeError):
    """The sampler service lost its engine while this request was in flight (it restarts; the
    episode is requeued)."""


class WorkerKilled(RuntimeError):
    """Injected failure of an environment worker (tests of restart / requeue)."""


def stable_rid(key: str) -> int:
    """Deterministic request id (the sampler derives the sampling key from it)."""
    return zlib.crc32(key.encode()) & 0x3FFFFFFF


class SamplerService:
    """One thread owning a Sampler; `submit(Request) -> Future[list[Completion]]`.

    A crash of the engine (or `kill()`) fails the in-flight futures with SamplerDied and
    restarts a fresh engine on the latest weights."""

    def __init__(self, cfg, params, version: int, max_batch: int, max_len: int, chunk: int = 16,
                 decode_devices: int = 1, mesh=None, speculative: str = "none"):
        self.cfg, self.max_batch, self.max_len, self.chunk = cfg, max_batch, max_len, chunk
        self.decode_devices, self.mesh, self.speculative = decode_devices, mesh, speculative
        self.params, self.version = params, int(version)
        self.sampler = self._make()
        self.inbox: queue.Queue = queue.Queue()
        self.futs: dict[int, Future] = {}
        self.idle_s = 0.0
        self.busy_s = 0.0
        self.restarts = 0
        self.generated_tokens = 0
        self.spec_drafted = self.spec_accepted = 0   # MTP drafts proposed / accepted (speculative decoding)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._kill = threading.Event()
        self.thread = threading.Thread(target=self._run, name="c2jax-sampler", daemon=True)
        self.thread.start()

    def _make(self):
        return Sampler(self.cfg, self.params, max_batch=self.max_batch, max_len=self.max_len, chunk=self.chunk,
                       version=self.version, decode_devices=self.decode_devices, mesh=self.mesh,
                       speculative=self.speculative)

    @property
    def S(self) -> int:
        return self.max_len

    def submit(self, request: Request) -> Future:
        fut: Future = Future()
        if self._stop.is_set():
            fut.set_exception(SamplerDied("sampler service stopped"))
        else:
            self.inbox.put((request, fut))
        return fut

    def swap(self, params, version: int) -> None:
        """In-flight weight update: takes effect at the next decode chunk / prefill."""
        with self._lock:
            self.params, self.version = params, int(version)
            self.sampler.swap_params(params, version)

    def kill(self) -> None:
        """Make the engine die at its next iteration (tests)."""
        self._kill.set()

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(timeout=30)

    def idle_fraction(self) -> float:
        tot = self.idle_s + self.busy_s
        return self.idle_s / tot if tot > 0 else 0.0

    def counters(self) -> tuple[float, float]:
        return self.idle_s, self.busy_s

    def spec_counts(self) -> tuple[int, int]:
        """(MTP drafts proposed, accepted) so far (speculative decoding)."""
        return self.spec_drafted, self.spec_accepted

    def _run(self):
        while not self._stop.is_set():
            try:
                self._loop()
            except Exception as e:  # noqa: BLE001 - the engine died: fail in-flight, restart
                log.warning("sampler engine died (%s: %s); restarting", type(e).__name__, e)
                self._fail_all(SamplerDied(f"{type(e).__name__}: {e}"))
                with self._lock:
                    self.restarts += 1
                    self.sampler = self._make()
        self._fail_all(SamplerDied("sampler service stopped"))

    def _fail_all(self, exc):
        futs, self.futs = self.futs, {}
        for f in futs.values():
            if not f.done():
                f.set_exception(exc)
        while True:
            try:
                _, f = self.inbox.get_nowait()
            except queue.Empty:
                break
            if not f.done():
                f.set_exception(exc)

    def _loop(self):
        s = self.sampler
        while not self._stop.is_set():
            if self._kill.is_set():
                self._kill.clear()
                raise SamplerDied("killed")
            idle = not s.pending()
            t0 = time.monotonic()
            try:
                item = self.inbox.get(timeout=0.02) if idle else self.inbox.get_nowait()
            except queue.Empty:
                item = None
            if idle:
                self.idle_s += time.monotonic() - t0
            while item is not None:
                req, fut = item
                try:
                    rid = s.submit(req)
                    self.futs[rid] = fut
                except ValueError as e:  # a bad request fails alone
                    fut.set_exception(e)
                try:
                    item = self.inbox.get_nowait()
                except queue.Empty:
                    item = None
            if s.pending():
                t0 = time.monotonic()
                g0, d0, a0 = s.generated_tokens, s.spec_drafted, s.spec_accepted
                s.step_chunk()
                self.generated_tokens += s.generated_tokens - g0
                self.spec_drafted += s.spec_drafted - d0
                self.spec_accepted += s.spec_accepted - a0
                self.busy_s += time.monotonic() - t0
                for rid in [r for r in self.futs if s.done(r)]:
                    self.futs.pop(rid).set_result(s.results(rid))


class EpisodeSampler:
    """The harness's model callable for one episode (SamplerPolicy(EpisodeSampler(...))):
    deterministic request ids from (key, turn), so a rerun samples the same tokens."""

    def __init__(self, service: SamplerService, key: str, seed: int, temperature: float):
        self.service, self.key, self.seed, self.temperature = service, key, int(seed), float(temperature)
        self.turn = 0

    @property
    def version(self) -> int:
        return self.service.version

    def __call__(self, context, max_new_tokens, stop_token_ids=None, temperature=None, **_):
        rid = stable_rid(f"{self.key}/{self.turn}")
        self.turn += 1
        req = turn_request(context, max_new_tokens, self.service.S,
                           temperature=self.temperature if temperature is None else temperature,
                           stop_token_ids=tuple(stop_token_ids or ()), seed=self.seed, request_id=rid)
        (c,) = self.service.submit(req).result()
        return c.tokens, c.logprobs.tolist(), c.versions.tolist(), c.completion_expert_ids


# ----------------------------------------------------------------------------- environments


@dataclasses.dataclass
class ToyTask:
    task_id: str
    suite: str
    prompt_ids: list[int]


class ToyEnv:
    """Single-turn token task: reward = fraction of generated tokens t with t % modulus ==
    target % modulus (chance 1/modulus); passed = reward >= 0.5. Cheap enough for CPU tests of
    learning, staleness and crash recovery; the full sampler / learner / replay path is used."""

    modulus = 4

    def __init__(self, rl, vocab_size: int):
        self.rl, self.vocab = rl, int(vocab_size)

    def load_tasks(self, suite: str, split: str, n: int, seed: int) -> list[ToyTask]:
        rng = np.random.default_rng([seed, 0 if split == "train" else 1])
        return [ToyTask(f"toy-{split}-{i}", suite, rng.integers(16, self.vocab, self.rl.toy_prompt_len).tolist())
                for i in range(n)]

    def max_len(self) -> int:
        return -(-(self.rl.toy_prompt_len + self.rl.max_new_tokens + 1) // 16) * 16

    def episode(self, task: ToyTask, service: SamplerService, key: str, seed: int, temperature: float,
                group_id: str = ""):
        rid = stable_rid(key)
        req = Request(task.prompt_ids, max_new_tokens=self.rl.max_new_tokens, n=1, temperature=temperature,
                      seed=seed, request_id=rid, reuse_prefix=False)
        (c,) = service.submit(req).result()
        if self.rl.toy_latency_s > 0:
            time.sleep(toy_latency(self.rl, key))  # the environment's share of an agent episode (tools, VM)
        P, gen = len(task.prompt_ids), list(c.tokens)
        hits = np.mean([(t % self.modulus) == (self.rl.toy_target % self.modulus) for t in gen]) if gen else 0.0
        T = P + len(gen)
        traj = Trajectory(
            tokens_T=np.asarray(task.prompt_ids + gen, np.int32),
            loss_mask_T=np.r_[np.zeros(P, bool), np.ones(len(gen), bool)],
            logprobs_T=np.r_[np.zeros(P, np.float32), np.asarray(c.logprobs, np.float32)],
            versions_T=np.r_[np.full(P, -1, np.int32), np.asarray(c.versions, np.int32)],
            expert_ids_TNK=None if c.expert_ids is None else np.asarray(c.expert_ids, np.int32)[:T],
            reward=float(hits), reward_terms={"verifier": float(hits), "total": float(hits)},
            task_id=task.task_id, group_id=group_id, finish_reason=c.finish_reason,
            stats={"turns": 1, "thinking_tokens": 0, "completion_tokens": len(gen)})
        return traj, bool(hits >= 0.5)


def toy_latency(rl, key: str) -> float:
    """Simulated remote-environment seconds of one episode: rl.toy_latency_s, or with
    rl.toy_latency_sigma > 0 a lognormal with that mean and log-std (heavy-tailed, like VM and tool
    times), drawn from the episode key so every run sees the same latencies."""
    if rl.toy_latency_sigma <= 0:
        return float(rl.toy_latency_s)
    z = np.random.default_rng(stable_rid("latency/" + key)).standard_normal()
    sigma = float(rl.toy_latency_sigma)
    return float(rl.toy_latency_s * np.exp(sigma * z - 0.5 * sigma ** 2))


def reward_stats(stats: dict, original_files: dict | None, final_files: dict | None, task=None,
                 tool_calls: list[dict] | None = None) -> dict:
    """The reward stats (c2jax.rl.rewards keys) from the harness's episode stats, end state and
    tool calls (default: one call per name counted in stats["tool_calls_by_name"])."""
    out = {k: stats.get(k, 0) for k in ("thinking_tokens", "tool_call_tokens", "tool_output_tokens",
                                         "final_message_tokens", "tool_calls", "turns", "malformed_calls")}
    out["unfinished_todos"] = int(stats.get("unfinished_todos", 0))  # open items of the `todo` tool
    by_name = stats.get("tool_calls_by_name") or {}
    names = set(by_name) - {"todo"}  # the to-do list is bookkeeping, not a way to read or edit
    out["terminal_only"] = int(bool(names) and names <= {"run", "run_tests"})
    if tool_calls is None:
        tool_calls = [{"name": n, "arguments": {}} for n, k in by_name.items() for _ in range(int(k))]
    out.update(behaviour_stats(original_files, final_files, stats.get("final_message", ""), tool_calls, task))
    return out


class HarnessEnv:
    """Agent episodes (c2jax.agent.run_episode) on task suites, graded by the task's verifier,
    rewarded by c2jax.rl.rewards.compute_reward (every term in reward_terms).

    With rl.summary_method != "none" an episode is a chain (c2jax.agent.summarize: compaction
    at rl.summary_trigger_tokens, each segment at most rl.context_window tokens) and `episode`
    returns its segments as a list of training sequences sharing the chain's reward
    (c2jax.rl.chains.chain_sequences); otherwise one Trajectory, as before."""

    def __init__(self, rl, tokenizer, sandbox=None):
        from c2jax.agent.sandbox import Sandbox
        self.rl, self.tokenizer = rl, tokenizer
        self.sandbox = sandbox or Sandbox()

    def load_tasks(self, suite: str, split: str, n: int, seed: int):
        from c2jax.tasks import load_suite
        return load_suite(suite, split, n, seed)

    def max_len(self) -> int:
        from c2jax.rl.config import context_window
        return context_window(self.rl) + 1

    def episode_config(self):
        """The EpisodeConfig of every episode (with the summary hook when summaries are on)."""
        return rl_episode_config(self.rl)

    def episode(self, task, service: SamplerService, key: str, seed: int, temperature: float, group_id: str = ""):
        from c2jax.agent.policy import SamplerPolicy
        from c2jax.agent.runner import run_episode
        from c2jax.rl.chains import chain_sequences
        from c2jax.tasks.base import snapshot_files
        r = self.rl
        res = run_episode(task, SamplerPolicy(EpisodeSampler(service, key, seed, temperature)), self.tokenizer,
                          self.sandbox, self.episode_config(), group_id)
        try:
            if (res.stats.get("finish_reason") in ("policy_error", "harness_error")  # harness: inside a summary hook
                    and "SamplerDied" in res.stats.get("error", "")):
                raise SamplerDied(res.stats["error"].splitlines()[0])
            final = snapshot_files(res.workspace.path) if res.workspace is not None else None
        finally:
            if res.workspace is not None:
                res.workspace.cleanup()
        traj = res.trajectory
        score = float(getattr(res.grade, "score", 0.0)) if res.grade is not None else 0.0
        stats = reward_stats(res.stats, dict(task.files), final, task, res.tool_calls)
        total, terms = compute_reward(score, stats, r)
        traj.reward, traj.reward_terms = total, terms
        passed = bool(getattr(res.grade, "passed", False))
        if r.summary_method == "none":
            return traj, passed
        return chain_sequences(res.segments, total, chain_id=key, reward_terms=terms), passed


def rl_episode_config(r, keep_workspace: bool = True):
    """The harness settings of an RL episode from the `rl` config section (turns, token budgets,
    system prompt, the summary hook when summaries are on); held-out evaluations of an RL run's
    models use the same (keep_workspace=False: nothing is graded after the episode)."""
    from c2jax.agent.runner import EpisodeConfig
    from c2jax.agent.summarize import SummaryConfig, summary_episode_config
    config = EpisodeConfig(max_turns=r.max_turns, max_total_tokens=r.max_total_tokens,
                           max_new_tokens=r.max_new_tokens, list_tools_in_system=r.list_tools_in_system,
                           keep_workspace=keep_workspace, max_context_tokens=int(r.context_window) or None)
    if r.system_prompt:
        config.system_prompt = r.system_prompt
    if r.summary_method != "none":
        config = summary_episode_config(config, SummaryConfig(
            method=r.summary_method, trigger_tokens=int(r.summary_trigger_tokens),
            max_summaries=int(r.max_summaries), max_summary_tokens=int(r.max_summary_tokens)))
    return config
