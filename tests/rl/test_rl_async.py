"""The asynchronous RL loop on the token toy task (real sampler, learner, replay, store):
staleness=0 reproduces a plain synchronous loop exactly; RL raises held-out pass@1; a killed
sampler engine and a killed environment worker are replaced while training continues; a
SIGKILLed run resumes without losing or repeating a group."""
import json
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from c2jax.config import load_config
from c2jax.models import init_params
from c2jax.rl.advantages import group_advantages
from c2jax.rl.learner import Learner
from c2jax.rl.loop import run_rl
from c2jax.rl.rollout import SamplerService, ToyEnv
from c2jax.train.metrics import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JIT_CACHE = os.path.join("/tmp", f"c2jax_rl_test_jit_cache_{os.getuid()}")


@pytest.fixture(scope="module", autouse=True)
def persistent_jit_cache():
    """Share compiles with the SIGKILL test's child process (a fresh process otherwise
    recompiles the sampler and learner)."""
    old = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", JIT_CACHE)
    yield
    jax.config.update("jax_compilation_cache_dir", old)


def toy_cfg(*extra, **over):
    ov = [f"--config.rl.{k}={v}" for k, v in over.items()]
    return load_config(os.path.join(ROOT, "configs/rl_tiny.py:toy"), [*ov, *extra])


def synchronous_reference(cfg):
    """The textbook synchronous loop: sample P groups with version k, train, publish k+1."""
    r = cfg.rl
    env = ToyEnv(r, cfg.model.vocab_size)
    tasks = env.load_tasks(r.suites[0], "train", 2 * r.steps * r.prompts_per_step, cfg.seed)
    learner = Learner(cfg, init_params(cfg, jax.random.key(cfg.seed)), seed=cfg.seed)
    svc = SamplerService(learner.cfg, jax.tree.map(jnp.copy, learner.params), 0, r.sampler_slots, env.max_len(),
                         r.sampler_chunk)
    rewards = []
    try:
        for step in range(r.steps):
            groups = []
            for gi in range(step * r.prompts_per_step, (step + 1) * r.prompts_per_step):
                groups.append([env.episode(tasks[gi], svc, f"{gi}/{j}/0", cfg.seed, r.temperature, str(gi))[0]
                               for j in range(r.group_size)])
            rw = np.asarray([[t.reward for t in g] for g in groups], np.float32)
            adv = np.asarray(group_advantages(rw)).reshape(-1)
            learner.step([t for g in groups for t in g], adv)
            svc.swap(jax.tree.map(jnp.copy, learner.params), step + 1)
            rewards.append(float(rw.mean()))
    finally:
        svc.stop()
    return rewards, jax.device_get(learner.params)


def test_staleness_zero_is_the_synchronous_algorithm(tmp_path):
    cfg = toy_cfg(staleness=0, steps=3, eval_every=-1)
    final = {}
    summary = run_rl(cfg, str(tmp_path / "run"),
                     hooks={"after_step": lambda s, o, svc: final.update(params=jax.device_get(svc.params))})
    rows = [m for m in read_metrics(str(tmp_path / "run")) if "reward" in m]
    assert summary["final_step"] == 3 and [m["staleness_hist"][0] for m in rows] == [2, 2, 2]
    assert all(m["token_version_lag_mean"] == 0 for m in rows)
    ref_rewards, ref_params = synchronous_reference(toy_cfg(staleness=0, steps=3, eval_every=-1))
    assert [m["reward"] for m in rows] == ref_rewards
    for a, b in zip(jax.tree.leaves(final["params"]), jax.tree.leaves(ref_params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_async_rl_raises_heldout_pass_at_1(tmp_path):
    """Learning test (toy task: ~1/4 of tokens are rewarded at init; pass = half of them), with the
    preset's MTP head distilled in the same step (rl.mtp_into_policy off: it trains the head only)."""
    cfg = toy_cfg(staleness=1, steps=14, eval_every=0)
    s = run_rl(cfg, str(tmp_path / "run"))
    first, last = s["evals"][0], s["evals"][-1]
    assert last["eval/pass_at_1"] > first["eval/pass_at_1"] + 0.1, s["evals"]
    for ev in (first, last):  # per-task pass fractions (for paired comparisons) and pass@1's standard error
        per_task = np.asarray(ev["eval/task_pass"])
        assert per_task.shape == (cfg.rl.eval_tasks,) and per_task.mean() == pytest.approx(ev["eval/pass_at_1"])
        assert ev["eval/pass_at_1_se"] == pytest.approx(per_task.std(ddof=1) / np.sqrt(len(per_task)))
    rows = [m for m in read_metrics(str(tmp_path / "run")) if "reward" in m]
    assert max(m["staleness_hist"][1] for m in rows) > 0  # off-policy groups were used
    assert all(m["staleness_mean"] <= 1 for m in rows)


def test_killed_sampler_and_env_worker_are_replaced(tmp_path):
    cfg = toy_cfg(staleness=1, steps=4, eval_every=-1)

    def chaos(step, orch, svc):
        if step == 1:
            svc.kill()
            orch.kill_env_worker()
    s = run_rl(cfg, str(tmp_path / "run"), hooks={"after_step": chaos})
    assert s["final_step"] == 4 and s["sampler_restarts"] >= 1 and s["env_worker_restarts"] >= 1
    assert s["groups_consumed"] == 8 and s["groups_dropped"] == 0


CHILD = """
import sys
from absl import flags; flags.FLAGS.mark_as_parsed()
import c2jax.sections
from c2jax.config import load_config
from c2jax.rl.loop import run_rl
cfg = load_config(sys.argv[1], ["--config.rl.steps=6", "--config.rl.eval_every=-1"])
run_rl(cfg, sys.argv[2])
"""


def test_sigkill_learner_and_resume(tmp_path):
    run = str(tmp_path / "run")
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=JIT_CACHE)
    p = subprocess.Popen([sys.executable, "-c", CHILD, os.path.join(ROOT, "configs/rl_tiny.py:toy"), run], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 400
    try:
        while time.time() < deadline and p.poll() is None:
            if len([m for m in read_metrics(run) if "reward" in m]) >= 2:
                break
            time.sleep(0.2)
        assert p.poll() is None, "the child finished or died before it could be killed"
        p.send_signal(signal.SIGKILL)
        p.wait()
    finally:
        if p.poll() is None:
            p.kill()
    before = [m for m in read_metrics(run) if "reward" in m]
    cfg = toy_cfg(steps=6, eval_every=-1)
    s = run_rl(cfg, run)
    k0 = s["start_step"]
    assert 1 <= k0 < 6 and s["final_step"] == 6
    rows = [m for m in read_metrics(run) if "reward" in m]
    resumed = rows[len(before):]
    assert [m["step"] for m in resumed] == list(range(k0 + 1, 7))
    restored = s["resumed_consumed"]            # the groups the restored checkpoint had trained
    assert len(restored) == 2 * k0
    assert {g for m in before if m["step"] <= k0 for g in m["trained_groups"]} <= set(restored)
    trained_after = [g for m in resumed for g in m["trained_groups"]]
    assert not set(restored) & set(trained_after)  # nothing trained twice
    assert sorted(restored + trained_after) == list(range(12))  # nothing lost
    with open(os.path.join(run, "summary.json")) as f:
        assert json.load(f)["groups_consumed"] == 12
