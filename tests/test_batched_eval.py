"""The held-out eval's batched policy (c2jax.pipeline.batched_policy_factory): episodes on threads
share one continuous-batching sampler and give the same episodes as the serial sampler path."""
import jax
import pytest

import c2jax
from c2jax.agent import chat_format as cf
from c2jax.agent.runner import EpisodeConfig
from c2jax.evals.benchmark import run_benchmark
from c2jax.agent.policy import SamplerPolicy
from c2jax.pipeline import batched_policy_factory
from c2jax.sampling import HarnessSampler, Sampler
from c2jax.tasks import load_suite

TOK = cf.ByteTokenizer()


@pytest.fixture(scope="module")
def model():
    cfg = c2jax.config.default_config()
    cfg.model.moe_dispatch = "dropless"
    return cfg, c2jax.models.init_params(cfg, jax.random.key(3))


def _episodes(report):
    rows = report["tasks"]["synthetic:1"]
    return [(r["task_id"], r["completion_tokens"], r["tool_calls"], r["turns"], r["finish_reason"]) for r in rows]


def test_batched_eval_matches_serial_greedy(model):
    """Greedy decoding: 4 tasks x 2 passes through the batched service on 4 threads give each
    episode exactly as the one-at-a-time sampler does (same lengths, calls, turns, endings)."""
    cfg, params = model
    tasks = {"synthetic:1": load_suite("synthetic:1", "heldout", n=4, seed=5)}
    config = EpisodeConfig(max_turns=3, max_new_tokens=12, max_total_tokens=3000)
    harness = HarnessSampler(Sampler(cfg, params, max_batch=1, max_len=3100), temperature=0.0)
    want = run_benchmark(tasks, lambda task: SamplerPolicy(harness), 2, tokenizer=TOK, config=config, concurrency=1)
    factory, service = batched_policy_factory(cfg, params, max_len=3100, temperature=0.0, slots=4)
    try:
        got = run_benchmark(tasks, factory, 2, tokenizer=TOK, config=config, concurrency=4)
    finally:
        service.stop()
    assert _episodes(got) == _episodes(want)
    assert sum(sum(e[1]) for e in _episodes(got)) > 0  # the model did generate


def test_batched_eval_keys_each_pass_and_reruns_identically(model):
    """At temperature 1 each pass of a task samples its own tokens (its own request key), and a
    rerun of the same eval samples the same ones."""
    cfg, params = model
    tasks = {"synthetic:1": load_suite("synthetic:1", "heldout", n=3, seed=6)}
    config = EpisodeConfig(max_turns=1, max_new_tokens=24, max_total_tokens=3000)
    runs = []
    for _ in range(2):
        factory, service = batched_policy_factory(cfg, params, max_len=3100, temperature=1.0, seed=11, slots=3)
        seen = []
        orig = service.submit

        def submit(req, orig=orig, seen=seen):
            seen.append(req.request_id)
            return orig(req)
        service.submit = submit
        try:
            runs.append((run_benchmark(tasks, factory, 2, tokenizer=TOK, config=config, concurrency=3), seen))
        finally:
            service.stop()
    (rep_a, ids_a), (rep_b, ids_b) = runs
    assert len(set(ids_a)) == len(ids_a) == 6  # one turn per episode, every episode its own request id
    assert sorted(ids_a) == sorted(ids_b)
    assert _episodes(rep_a) == _episodes(rep_b)
