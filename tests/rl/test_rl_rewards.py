"""Length penalty C(x) and compute_reward."""
import math

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from c2jax.rl.losses import default_rl_loss_config
from c2jax.rl.rewards import BEHAVIOUR_KEYS, EFFORT_KEYS, compute_reward, length_penalty


def closed_form(x, k, q):
    if q == 1.0:
        return math.log1p(k * x) / k
    return ((1 + k * x) ** (1 - q) - 1) / (k * (1 - q))


@pytest.mark.parametrize("q", [0.0, 0.25, 0.5, 0.75, 1.0, 1.5])
@pytest.mark.parametrize("k", [0.1, 1.0, 3.0])
def test_matches_closed_form(q, k):
    xs = np.array([0.0, 0.01, 0.5, 1.0, 7.0, 100.0])
    got = np.asarray(length_penalty(xs, k, q))
    want = np.array([closed_form(x, k, q) for x in xs])
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-7)


def test_q0_is_linear_and_q1_limit_is_continuous():
    xs = np.linspace(0, 50, 11)
    np.testing.assert_allclose(length_penalty(xs, 0.7, 0.0), xs, rtol=1e-6, atol=1e-6)
    log_form = np.log1p(0.7 * xs) / 0.7
    for q in (1.0 - 1e-4, 1.0 - 1e-7, 1.0, 1.0 + 1e-7, 1.0 + 1e-4):
        np.testing.assert_allclose(length_penalty(xs, 0.7, q), log_form, rtol=3e-4, atol=1e-6)


def test_traced_q_and_gradient_at_q1():
    f = jax.jit(lambda x, q: length_penalty(x, 2.0, q))
    np.testing.assert_allclose(f(3.0, 1.0), math.log1p(6.0) / 2.0, rtol=1e-6)
    # C'(x) = (1 + k x)^(-q); at q = 1 that is 1 / (1 + k x), finite through the where branch.
    g = jax.grad(lambda x: length_penalty(x, 2.0, 1.0))(3.0)
    np.testing.assert_allclose(g, 1.0 / 7.0, rtol=1e-5)
    g = jax.grad(lambda x: length_penalty(x, 2.0, 0.5))(3.0)
    np.testing.assert_allclose(g, 7.0 ** -0.5, rtol=1e-5)


@settings(max_examples=40, deadline=None)
@given(k=st.floats(0.05, 5.0), q=st.floats(0.05, 2.0), x=st.floats(0.0, 200.0), dx=st.floats(0.01, 10.0))
def test_monotone_and_concave(k, q, x, dx):
    c0, c1, c2 = (float(length_penalty(v, k, q)) for v in (x, x + dx, x + 2 * dx))
    assert c1 >= c0 - 1e-5 * max(1.0, abs(c0))
    # concavity: the midpoint lies above the chord
    assert c1 >= 0.5 * (c0 + c2) - 1e-5 * max(1.0, abs(c2))
    assert float(length_penalty(x, k, q)) <= x + 1e-4 * max(1.0, x)  # C(x) <= x since C' <= 1


def full_stats(**overrides):
    s = {k: 0 for k in EFFORT_KEYS + BEHAVIOUR_KEYS}
    s.update(overrides)
    return s


def test_compute_reward_terms_add_up():
    cfg = default_rl_loss_config()
    stats = full_stats(thinking_tokens=2000, tool_call_tokens=300, tool_output_tokens=4000,
                       final_message_tokens=200, tool_calls=6, turns=3, malformed_calls=2,
                       unfinished_todos=1, comment_reasoning_lines=5, terminal_only=True)
    total, terms = compute_reward(1.0, stats, cfg)
    ew = cfg.effort_weights
    x = (2000 * ew.thinking_tokens + 300 * ew.tool_call_tokens + 4000 * ew.tool_output_tokens
         + 200 * ew.final_message_tokens + 6 * ew.tool_calls + 3 * ew.turns)
    assert terms["effort_x"] == pytest.approx(x)
    assert terms["length_penalty"] == pytest.approx(-cfg.length_coef * closed_form(x, cfg.length_k, cfg.length_q), rel=1e-5)
    bw = cfg.behaviour_weights
    assert terms["behaviour/malformed_calls"] == pytest.approx(-2 * bw.malformed_calls)
    assert terms["behaviour/terminal_only"] == pytest.approx(-bw.terminal_only)
    summed = terms["verifier"] + terms["length_penalty"] + sum(v for k, v in terms.items() if k.startswith("behaviour/"))
    assert total == pytest.approx(summed) and terms["total"] == total
    assert all(isinstance(v, float) for v in terms.values())


def test_parallel_calls_cost_less_than_sequential():
    cfg = default_rl_loss_config()
    parallel, _ = compute_reward(1.0, full_stats(tool_calls=8, turns=2), cfg)
    sequential, _ = compute_reward(1.0, full_stats(tool_calls=8, turns=8), cfg)
    assert parallel > sequential


def test_missing_stat_raises_unless_weight_zero():
    cfg = default_rl_loss_config()
    stats = full_stats()
    del stats["unfinished_todos"]
    with pytest.raises(KeyError, match="unfinished_todos"):
        compute_reward(0.0, stats, cfg)
    cfg.behaviour_weights.unfinished_todos = 0.0
    total, terms = compute_reward(0.0, stats, cfg)
    assert total == 0.0 and terms["behaviour/unfinished_todos"] == 0.0


def test_behaviour_stats_from_the_graders():
    import types

    from c2jax.rl.rewards import GRADED_KEYS, behaviour_stats
    orig = {"calc.py": "def add(a, b):\n    return a - b\n", "tests/test_calc.py": "assert True\n"}
    clean = {**orig, "calc.py": "def add(a, b):\n    return a + b\n"}
    s = behaviour_stats(orig, clean, "Fixed add.", [{"name": "edit_file"}])
    assert set(GRADED_KEYS) <= set(s) and all(s[k] == 0 for k in s)
    messy = {"calc.py": "import os\nimport sys\ndef add(a, b):\n    print(a)\n    return a + b\n",
             "tests/test_calc.py": "pass\n"}
    s = behaviour_stats(orig, messy, "", [{"name": "write_file"}])
    assert s["debug_prints"] == 1.0 and s["protected_paths"] == 1.0 and s["missing_final_message"] == 1.0
    assert s["new_lint"] == pytest.approx(2 / 3)      # two unused imports: n / (1 + n)
    assert s["eager_edits"] == 0.0                   # only question-only tasks must not edit
    question = types.SimpleNamespace(metadata={"behaviour": {"category": "question"}})
    assert behaviour_stats(orig, orig, "It is line 2.", [{"name": "edit_file"}], question)["eager_edits"] == 1.0
    assert behaviour_stats(orig, orig, "It is line 2.", [{"name": "read_file"}], question)["eager_edits"] == 0.0
    rules = types.SimpleNamespace(metadata={"behaviour": {"protected": ["calc.py"]}})
    s = behaviour_stats(orig, clean, "Fixed.", [], rules)
    assert s["protected_paths"] == 1.0
    s = behaviour_stats(None, None, "", [])                # no end state: only the final message is known
    assert s["missing_final_message"] == 1.0 and s["eager_edits"] == s["debug_prints"] == 0.0
