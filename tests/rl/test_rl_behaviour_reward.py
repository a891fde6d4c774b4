"""The report's reward as the learner receives it: a scripted policy drives HarnessEnv episodes
(the RL loop's own episode -> trajectory reward path) on a behaviour-suite question task, and
each bad behaviour (to-dos left open, edits on a question-only task, a debug print) lowers
trajectory.reward by exactly its weighted term."""
import types
from concurrent.futures import Future

import numpy as np
import pytest

from c2jax.agent import chat_format as cf
from c2jax.agent.sandbox import unavailable_reason
from c2jax.config import load_config
from c2jax.rl.config import validate_rl
from c2jax.rl.rollout import HarnessEnv
from c2jax.tasks import load_suite

NO_SANDBOX = unavailable_reason()
TOK = cf.ByteTokenizer()


class ScriptedService:
    """Stands in for the SamplerService: answers each turn request with the next scripted message."""

    version = 3
    S = 16384

    def __init__(self, messages):
        self.messages = list(messages)

    def submit(self, req):
        text = self.messages.pop(0) if self.messages else cf.render_assistant("Done.")
        ids = TOK.encode(text)[:req.max_new_tokens]
        n = len(ids)
        fut = Future()
        fut.set_result([types.SimpleNamespace(tokens=ids, logprobs=np.full(n, -0.5, np.float32),
                                              versions=np.full(n, self.version, np.int32),
                                              completion_expert_ids=None)])
        return fut


def rl_config(**weights):
    cfg = load_config("configs/rl_tiny.py", ["--config.rl.max_new_tokens=1024", "--config.rl.max_turns=6",
                                             "--config.rl.max_total_tokens=2040"])
    for k, v in weights.items():
        cfg.rl.behaviour_weights[k] = v
    validate_rl(cfg.rl)
    return cfg.rl


def episode(task, messages, rl, sandbox):
    env = HarnessEnv(rl, TOK, sandbox)
    traj, passed = env.episode(task, ScriptedService(messages), key="k/0", seed=0, temperature=1.0)
    return traj


@pytest.fixture(scope="module")
def question_task():
    (task,) = [t for t in load_suite("behaviour", "train", n=8, seed=0) if t.grader == "question"][:1]
    return task


def bad_script(task):
    """Two to-dos never completed, then a debug print written into the question's file."""
    path, src = next(iter(task.files.items()))
    todo = [{"name": "todo", "arguments": {"action": "add", "text": t}} for t in ("find the bug", "check it")]
    edit = {"name": "write_file", "arguments": {"path": path, "content": src + "\nprint('DEBUG')\n"}}
    return [cf.render_assistant(calls=todo), cf.render_assistant(calls=[edit]),
            cf.render_assistant(task.reference_message)]


@pytest.mark.skipif(bool(NO_SANDBOX), reason=NO_SANDBOX or "")
def test_behaviour_terms_lower_the_trajectory_reward(question_task):
    from c2jax.agent.sandbox import Sandbox
    sandbox = Sandbox()
    task = question_task
    rl = rl_config()
    clean = episode(task, [cf.render_assistant(task.reference_message)], rl, sandbox)
    assert clean.reward_terms["verifier"] == 1.0 and clean.stats["finish_reason"] == "final"
    assert all(v == 0.0 for k, v in clean.reward_terms.items() if k.startswith("behaviour/")), clean.reward_terms

    bad = episode(task, bad_script(task), rl, sandbox)
    t = bad.reward_terms
    w = rl.behaviour_weights
    assert bad.stats["unfinished_todos"] == 2 and bad.stats["finish_reason"] == "final"
    assert t["behaviour/unfinished_todos"] == pytest.approx(-2 * w.unfinished_todos)
    assert t["behaviour/eager_edits"] == pytest.approx(-w.eager_edits)
    assert t["behaviour/debug_prints"] == pytest.approx(-w.debug_prints)
    for k in ("protected_paths", "new_lint", "missing_final_message", "malformed_calls", "terminal_only"):
        assert t[f"behaviour/{k}"] == 0.0, k
    assert t["verifier"] < 1.0    # the question's grader also fails the edit
    # what the learner gets: the trajectory's reward is the sum of the logged terms
    parts = t["verifier"] + t["length_penalty"] + sum(v for k, v in t.items() if k.startswith("behaviour/"))
    assert bad.reward == pytest.approx(parts) == pytest.approx(t["total"])
    assert bad.reward < clean.reward
    # each term on its own lowers the reward: switching its weight off raises it by that term exactly
    for key in ("unfinished_todos", "eager_edits", "debug_prints"):
        off = episode(task, bad_script(task), rl_config(**{key: 0.0}), sandbox)
        assert off.reward_terms[f"behaviour/{key}"] == 0.0
        assert off.reward - bad.reward == pytest.approx(-t[f"behaviour/{key}"], abs=1e-9), key


@pytest.mark.skipif(bool(NO_SANDBOX), reason=NO_SANDBOX or "")
def test_no_final_message_and_protected_paths_are_penalized():
    from c2jax.agent.sandbox import Sandbox
    sandbox = Sandbox()
    task = next(t for t in load_suite("behaviour", "train", n=16, seed=0)
                if t.grader == "rules" and t.metadata["behaviour"].get("protected"))
    test_path = next(p for p in task.files if p.startswith("tests/test_"))
    weaken = {"name": "write_file", "arguments": {"path": test_path, "content": "def test_nothing():\n    pass\n"}}
    rl = rl_config()
    traj = episode(task, [cf.render_assistant(calls=[weaken])] * 6, rl, sandbox)   # never answers
    t = traj.reward_terms
    assert traj.stats["finish_reason"] == "max_turns"
    assert t["behaviour/missing_final_message"] == pytest.approx(-rl.behaviour_weights.missing_final_message)
    assert t["behaviour/protected_paths"] == pytest.approx(-rl.behaviour_weights.protected_paths)
    assert t["behaviour/eager_edits"] == 0.0   # not a question-only task


def test_behaviour_weights_are_validated():
    from c2jax.errors import ConfigError
    rl = rl_config()
    rl.behaviour_weights.eager_edits = -1.0
    with pytest.raises(ConfigError, match="behaviour_weights.eager_edits"):
        validate_rl(rl)
    rl = rl_config()
    rl.behaviour_weights.politeness = 0.1
    with pytest.raises(ConfigError, match="behaviour_weights.politeness"):
        validate_rl(rl)


@pytest.mark.skipif(bool(NO_SANDBOX), reason=NO_SANDBOX or "")
def test_reference_solutions_of_the_rl_mix_earn_no_behaviour_penalty():
    """Every behaviour category (and a synthetic:1 fix) loads and runs in the RL harness env; its
    reference solution passes and no behaviour term fires."""
    from c2jax.agent.policy import OraclePolicy
    from c2jax.agent.sandbox import Sandbox
    sandbox = Sandbox()
    rl = rl_config()
    assert tuple(rl.suites) == ("synthetic:1", "behaviour")
    beh = load_suite("behaviour", "train", n=8, seed=1)
    tasks = [next(t for t in beh if t.grader == c) for c in ("question", "rules", "quality", "interruption")]
    tasks.append(HarnessEnv(rl, TOK, sandbox).load_tasks("synthetic:1", "train", 1, 1)[0])
    for task in tasks:
        oracle = OraclePolicy(task)
        script = [oracle.next_message(None, None) for _ in range(len(oracle.steps) + 1)]
        traj = episode(task, script, rl, sandbox)
        t = traj.reward_terms
        assert t["verifier"] == 1.0, (task.task_id, traj.stats["finish_reason"])
        assert all(v == 0.0 for k, v in t.items() if k.startswith("behaviour/")), (task.task_id, t)
