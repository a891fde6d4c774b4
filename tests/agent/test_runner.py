import dataclasses

import numpy as np

from c2jax import special_tokens as st
from c2jax.agent import chat_format as cf
from c2jax.agent.policy import (
    DoNothingPolicy,
    OraclePolicy,
    SamplerPolicy,
    ScriptedPolicy,
)
from c2jax.agent.runner import EpisodeConfig, run_episode, run_episodes

TOK = cf.ByteTokenizer()


def check_trajectory_invariants(res):
    tr = res.trajectory
    T = len(tr.tokens_T)
    assert tr.loss_mask_T.shape == (T,) and tr.versions_T.shape == (T,)
    assert np.all(tr.versions_T[~tr.loss_mask_T] == -1)
    assert np.all(tr.logprobs_T[~tr.loss_mask_T] == 0)
    assert tr.num_model_tokens == res.stats["completion_tokens"]
    assert tr.stats["finish_reason"] == tr.finish_reason


def test_oracle_solves_fake_task(sandbox, fake_task):
    res = run_episode(fake_task, OraclePolicy(fake_task), None, sandbox)
    assert res.grade.passed, res.grade.details
    assert res.stats["finish_reason"] == "final" and res.final_message == "Fixed add."
    assert res.stats["turns"] == 2 and res.stats["tool_calls_by_name"] == {"edit_file": 1}
    assert res.stats["malformed_calls"] == 0 and res.stats["lines_changed"] == 2
    assert "+    return a + b" in res.diff
    ep = res.grade.details["episode"]
    assert ep["tool_calls"] == fake_task.reference_solution and ep["final_message"] == "Fixed add."
    check_trajectory_invariants(res)
    text = TOK.decode(res.trajectory.tokens_T)
    assert text.startswith(st.SYSTEM) and fake_task.prompt in text and text.endswith(st.END_TURN)
    # model tokens are exactly the policy's messages
    model_text = TOK.decode(res.trajectory.tokens_T[res.trajectory.loss_mask_T])
    assert model_text == cf.render_assistant(calls=fake_task.reference_solution) + cf.render_assistant("Fixed add.")


def test_do_nothing_fails(sandbox, fake_task):
    res = run_episode(fake_task, DoNothingPolicy(), None, sandbox)
    assert not res.grade.passed and res.stats["turns"] == 1 and res.stats["tool_calls"] == 0
    assert res.diff == ""


class FakeSampler:
    """Emits scripted messages as tokens, with logprobs, versions and expert ids; records contexts."""

    def __init__(self, messages, n_layers=2, k=3, tail_garbage=False):
        self.messages = list(messages)
        self.contexts = []
        self.n_layers, self.k, self.tail = n_layers, k, tail_garbage

    def __call__(self, context, max_new_tokens, temperature=1.0, stop_token_ids=()):
        self.contexts.append(list(context))
        self.stop_token_ids = stop_token_ids
        msg = self.messages.pop(0) if self.messages else f"done{st.END_TURN}"
        ids = TOK.encode(msg) + (TOK.encode("GARBAGE AFTER STOP") if self.tail else [])
        ids = ids[:max_new_tokens]
        n = len(ids)
        experts = (np.arange(n * self.n_layers * self.k) % 7).reshape(n, self.n_layers, self.k)
        return ids, [-0.5] * n, [7] * n, experts


def test_model_policy_token_in_token_out(sandbox, fake_task):
    msgs = [cf.render_assistant("let me look", [{"name": "read_file", "arguments": {"path": "calc.py"}},
                                                {"name": "list_dir", "arguments": {}}]),
            cf.render_assistant(calls=fake_task.reference_solution),
            cf.render_assistant("fixed")]
    sampler = FakeSampler(msgs, tail_garbage=True)
    res = run_episode(fake_task, SamplerPolicy(sampler, temperature=0.7), TOK, sandbox)
    tr = res.trajectory
    assert res.grade.passed and res.stats["turns"] == 3
    assert res.stats["parallel_calls_per_turn"] == [2, 1] and res.stats["max_parallel_calls"] == 2
    check_trajectory_invariants(res)
    # every context the sampler saw is a prefix of the final token list (append-only)
    toks = tr.tokens_T.tolist()
    for c in sampler.contexts:
        assert toks[:len(c)] == c
    # model tokens are exactly the sampled ones, cut at the stop token
    assert TOK.decode(tr.tokens_T[tr.loss_mask_T]) == "".join(msgs)
    assert np.all(tr.logprobs_T[tr.loss_mask_T] == -0.5) and np.all(tr.versions_T[tr.loss_mask_T] == 7)
    assert tr.expert_ids_TNK.shape == (len(toks), 2, 3)
    assert np.all(tr.expert_ids_TNK[~tr.loss_mask_T] == -1)
    assert np.all(tr.expert_ids_TNK[tr.loss_mask_T] >= 0)
    assert sorted(sampler.stop_token_ids) == sorted([TOK.special_to_id[st.END_TURN], TOK.special_to_id[st.EOS]])


def test_errors_never_escape(sandbox, fake_task):
    msgs = [(f"{st.TOOL_CALL}{{broken{st.END_TOOL_CALL}{st.TOOL_CALL}{{\"name\": \"teleport\"}}{st.END_TOOL_CALL}"
            f"{st.TOOL_CALL}{{\"name\": \"read_file\", \"arguments\": {{\"path\": \"../../etc/shadow\"}}}}"
            f"{st.END_TOOL_CALL}{st.END_TURN}"),
            "no end turn and an unterminated call " + st.TOOL_CALL + '{"name": "run"']
    res = run_episode(fake_task, ScriptedPolicy(msgs), None, sandbox)
    assert res.stats["malformed_calls"] == 3 and res.stats["tool_errors"] == 1
    assert res.stats["finish_reason"] == "final" and res.stats["turns"] == 3
    text = TOK.decode(res.trajectory.tokens_T)
    assert "not valid JSON" in text and "unknown tool 'teleport'" in text and "unterminated" in text

    def broken_sampler(context, max_new_tokens):
        raise RuntimeError("sampler died")

    res = run_episode(fake_task, SamplerPolicy(broken_sampler), None, sandbox)
    assert res.stats["finish_reason"] == "policy_error" and "sampler died" in res.stats["error"]
    assert not res.grade.passed


def test_budgets(sandbox, fake_task):
    loop = [cf.render_assistant(calls=[{"name": "list_dir", "arguments": {}}])] * 50
    res = run_episode(fake_task, ScriptedPolicy(loop), None, sandbox, EpisodeConfig(max_turns=3))
    assert res.stats["finish_reason"] == "max_turns" and res.stats["turns"] == 3
    res = run_episode(fake_task, ScriptedPolicy(loop), None, sandbox, EpisodeConfig(max_total_tokens=3000))
    assert res.stats["finish_reason"] == "max_tokens"
    assert len(res.trajectory.tokens_T) <= 3000 + 400  # at most one env segment past the budget
    res = run_episode(fake_task, ScriptedPolicy(["x" * 100]), None, sandbox, EpisodeConfig(max_new_tokens=10))
    assert res.stats["finish_reason"] == "max_new_tokens"
    assert res.trajectory.num_model_tokens == 10


def test_interruption_and_rules(sandbox, fake_task):
    task = dataclasses.replace(fake_task, interruption=(1, "Also add a docstring."),
                               system_rules="Never delete files.", tools=["read_file", "edit_file"])
    res = run_episode(task, OraclePolicy(task), None, sandbox)
    text = TOK.decode(res.trajectory.tokens_T)
    assert res.stats["interrupted"] and "Also add a docstring." in text and "Never delete files." in text
    assert '"name": "run"' not in text.split(st.END_TURN)[0]  # tool set restricted in the spec
    assert text.index("Also add a docstring.") > text.index(st.END_TOOL_RESULT)
    # the interruption turn was not the last one: the policy got another turn
    assert res.stats["turns"] == 2 and res.stats["finish_reason"] == "final"
    t2 = dataclasses.replace(fake_task, interruption=(1, "Wait, also X."))
    res = run_episode(t2, DoNothingPolicy(), None, sandbox)
    assert res.stats["turns"] == 2 and "Wait, also X." in TOK.decode(res.trajectory.tokens_T)


def test_context_hook_can_restart_segments(sandbox, fake_task):
    calls = []

    def hook(state):  # fires before the first turn (the system prompt alone passes the trigger)
        if calls:
            return
        calls.append(len(state.tokens))
        state.append_env(cf.render_user("Summarize the conversation.") + cf.assistant_prefix())
        state.generate()
        state.restart(cf.render_system("sys") + cf.render_user(fake_task.prompt)
                      + cf.render_summary("edited calc.py") + cf.assistant_prefix())

    pol = ScriptedPolicy(["summary text" + st.END_TURN,
                          cf.render_assistant(calls=[{"name": "read_file", "arguments": {"path": "calc.py"}}]),
                          "final answer"])
    cfg = EpisodeConfig(context_trigger_tokens=1000, context_hook=hook)
    res = run_episode(fake_task, pol, None, sandbox, cfg)
    assert len(calls) == 1 and len(res.segments) == 2 and res.stats["segments"] == 2
    assert res.segments[0].finish_reason == "summarized"
    assert "Summarize the conversation." in TOK.decode(res.segments[0].tokens_T)
    assert TOK.decode(res.trajectory.tokens_T).count("edited calc.py") == 1
    assert res.final_message == "final answer" and res.stats["turns"] == 2
    assert TOK.decode(res.segments[0].tokens_T[res.segments[0].loss_mask_T]) == "summary text" + st.END_TURN


def test_run_episodes_concurrent_in_order(sandbox, fake_task):
    tasks = [dataclasses.replace(fake_task, task_id=f"t{i}") for i in range(6)]
    res = run_episodes(tasks, lambda t: OraclePolicy(t) if t.task_id != "t3" else DoNothingPolicy(),
                       sandbox=sandbox, concurrency=4)
    assert [r.trajectory.task_id for r in res] == [t.task_id for t in tasks]
    assert [r.grade.passed for r in res] == [True, True, True, False, True, True]


def test_concurrent_episodes_overlap(sandbox, fake_task):
    """8 episodes on 8 threads are in flight together: every policy reaches one barrier, and
    the commands they run in the sandbox overlap in time, as stamped from inside the sandbox
    (the throughput ratio is measured by experiments/bench/episodes.py, not in a test)."""
    import threading
    n = 8
    tasks = [dataclasses.replace(fake_task, task_id=f"c{i}") for i in range(n)]
    barrier = threading.Barrier(n, timeout=120)
    spans = []

    class StampingSandbox:
        def __getattr__(self, name):
            return getattr(sandbox, name)

        def run(self, *args, **kwargs):
            r = sandbox.run(*args, **kwargs)
            if r.stdout.startswith("STAMP"):
                spans.append(tuple(float(x) for x in r.stdout.split()[1:3]))
            return r

    class BarrierPolicy(ScriptedPolicy):
        def next_message(self, context, codec):
            if self.i == 0:
                barrier.wait()  # BrokenBarrierError if the episodes ran one by one
            return super().next_message(context, codec)

    stamp = "echo STAMP $(date +%s.%N) $(sleep 2; date +%s.%N)"

    def policy(t):
        return BarrierPolicy([cf.render_assistant(calls=[{"name": "run", "arguments": {"command": stamp}}]),
                              cf.render_assistant(calls=t.reference_solution)])

    res = run_episodes(tasks, policy, sandbox=StampingSandbox(), concurrency=n)
    assert [r.trajectory.task_id for r in res] == [t.task_id for t in tasks]
    assert all(r.grade.passed for r in res)
    assert len(spans) == n
    # most commands share one instant: a sandbox that ran them one at a time gives 1
    most_at_once = max(sum(s <= t < e for s, e in spans) for t, _ in spans)
    assert most_at_once >= n // 2, sorted(spans)


def test_visible_test_command(sandbox, fake_task):
    task = dataclasses.replace(fake_task)
    task.visible_test_command = ["python3", "-c", "import calc; print('VISIBLE', calc.add(2, 3))"]
    res = run_episode(task, ScriptedPolicy([cf.render_assistant(calls=[{"name": "run_tests", "arguments": {}}])]),
                      None, sandbox)
    assert "VISIBLE -1" in TOK.decode(res.trajectory.tokens_T)


def _big_write_task(fake_task, size):
    big = "".join(f"LINE_{i:06d} = {i}\n" for i in range(size // 20 + 1))[:size]
    task = dataclasses.replace(fake_task)
    task.reference_solution = [{"name": "write_file", "arguments": {"path": "big.py", "content": big}},
                               *fake_task.reference_solution]
    return task, big


def test_default_config_lets_a_16kb_edit_through(sandbox, fake_task):
    task, big = _big_write_task(fake_task, 16 * 1024)
    res = run_episode(task, OraclePolicy(task), None, sandbox, EpisodeConfig(keep_workspace=True))
    try:
        assert (res.workspace.path / "big.py").read_text() == big
    finally:
        res.workspace.cleanup()
    assert res.grade.passed and res.stats["truncated_turns"] == 0 and res.stats["malformed_calls"] == 0


def test_a_turn_cut_at_the_token_limit_is_counted_and_shown(sandbox, fake_task):
    task, _ = _big_write_task(fake_task, 2000)
    res = run_episode(task, OraclePolicy(task), None, sandbox, EpisodeConfig(max_new_tokens=500))
    assert res.stats["truncated_turns"] >= 1 and res.stats["truncated_calls"] >= 1
    text = TOK.decode(res.trajectory.tokens_T)
    assert "reached the limit of 500 tokens per turn" in text


def test_a_grader_exception_is_counted(sandbox, fake_task):
    class Boom(RuntimeError):
        pass

    def grade(*a, **k):
        raise Boom("broken grader")

    task = dataclasses.replace(fake_task)
    task.grade = grade
    res = run_episode(task, DoNothingPolicy(), None, sandbox)
    assert res.stats["grader_exceptions"] == 1 and res.stats["grader_exception_type"] == "Boom"
    assert res.trajectory.stats["grader_exceptions"] == 1 and res.grade.score == 0.0


def test_exception_metrics_count_per_type():
    from c2jax.agent.runner import exception_metrics
    stats = [{"grader_exceptions": 1, "grader_exception_type": "KeyError", "truncated_turns": 2},
             {"grader_exceptions": 1, "grader_exception_type": "KeyError", "harness_exceptions": 1,
              "harness_exception_type": "OSError"}, {}]
    m = exception_metrics(stats)
    assert m == {"grader_exceptions": 2, "grader_exception_types": {"KeyError": 2}, "harness_exceptions": 1,
                 "harness_exception_types": {"OSError": 1}, "truncated_turns": 2}
    assert exception_metrics(stats, flat=True) == {
        "grader_exceptions": 2, "grader_exceptions/KeyError": 2, "harness_exceptions": 1,
        "harness_exceptions/OSError": 1, "truncated_turns": 2}
