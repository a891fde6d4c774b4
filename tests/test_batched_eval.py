"""The held-out eval's batched policy (c2jax.pipeline.batched_policy_factory): episodes on threads
share one continuous-batching sampler, give the same tokens as the serial sampler path, and each
attempt of a task keeps its own sampling key from run to run."""
import jax
import numpy as np
import pytest

import c2jax
from c2jax.agent import chat_format as cf
from c2jax.agent.policy import SamplerPolicy
from c2jax.agent.runner import EpisodeConfig, run_episodes
from c2jax.pipeline import batched_policy_factory
from c2jax.sampling import HarnessSampler, Sampler
from c2jax.tasks import load_suite

TOK = cf.ByteTokenizer()


@pytest.fixture(scope="module")
def model():
    cfg = c2jax.config.default_config()
    cfg.model.moe_dispatch = "dropless"
    return cfg, c2jax.models.init_params(cfg, jax.random.key(int(np.random.default_rng().integers(1 << 30))))


def _tokens(results):
    return [list(map(int, r.trajectory.tokens_T)) for r in results]


def _run(cfg, params, jobs, config, *, temperature, seed=0, slots=4):
    factory, service = batched_policy_factory(cfg, params, max_len=3100, temperature=temperature, seed=seed,
                                              slots=slots)
    try:
        return run_episodes(jobs, factory, TOK, config=config, concurrency=slots)
    finally:
        service.stop()


def test_batched_eval_matches_serial_greedy(model):
    """Greedy decoding: 4 tasks x 2 attempts through the batched service on 4 threads give every
    episode token for token as the one-at-a-time sampler does."""
    cfg, params = model
    jobs = [t for t in load_suite("synthetic:1", "heldout", n=4, seed=5) for _ in range(2)]
    config = EpisodeConfig(max_turns=3, max_new_tokens=12, max_total_tokens=3000)
    harness = HarnessSampler(Sampler(cfg, params, max_batch=1, max_len=3100), temperature=0.0)
    want = run_episodes(jobs, lambda task: SamplerPolicy(harness), TOK, config=config, concurrency=1)
    got = _run(cfg, params, jobs, config, temperature=0.0)
    assert _tokens(got) == _tokens(want)
    assert sum(r.stats["completion_tokens"] for r in got) > 0  # the model did generate


def test_batched_eval_keys_each_attempt_and_reruns_identically(model):
    """At temperature 1 the two attempts of a task sample different tokens (each its own key), and a
    rerun on another thread count gives every job, in its position, the same tokens."""
    cfg, params = model
    jobs = [t for t in load_suite("synthetic:1", "heldout", n=3, seed=6) for _ in range(2)]
    config = EpisodeConfig(max_turns=1, max_new_tokens=24, max_total_tokens=3000)
    a = _tokens(_run(cfg, params, jobs, config, temperature=1.0, seed=11, slots=3))
    b = _tokens(_run(cfg, params, jobs, config, temperature=1.0, seed=11, slots=2))
    assert a == b
    assert all(a[2 * i] != a[2 * i + 1] for i in range(3))


def test_each_attempt_of_a_task_has_its_own_key(model):
    """The factory numbers a task's attempts in the order it is called: distinct keys per attempt,
    the same keys from a fresh factory."""
    cfg, params = model
    jobs = [t for t in load_suite("synthetic:1", "heldout", n=3, seed=7) for _ in range(3)]
    keys = []
    for _ in range(2):
        factory, service = batched_policy_factory(cfg, params, max_len=64, slots=1)
        keys.append([factory(t).sampler.key for t in jobs])
        service.stop()
    assert keys[0] == keys[1] and len(set(keys[0])) == len(jobs)
