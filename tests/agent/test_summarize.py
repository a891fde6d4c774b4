"""Self-summarization hooks: the summary decode reuses the live cache, restarts keep what the
summary carries, baselines (prompt compaction, truncation, full context) behave as described."""
import types

import pytest

from c2jax import special_tokens as st
from c2jax.agent import chat_format as cf
from c2jax.agent import summarize as sm
from c2jax.agent.policy import PolicyOutput, SamplerPolicy, ScriptedPolicy
from c2jax.agent.runner import EpisodeConfig, EpisodeState, _new_stats, run_episode
from c2jax.agent.long_horizon_policy import make_long_horizon_policy
from c2jax.tasks import long_horizon as lh

TOK = cf.ByteTokenizer()
CODEC = cf.as_codec(TOK)


def _state(policy, prompt="Fix add() in calc.py.", system="S", **cfg):
    task = types.SimpleNamespace(task_id="t", prompt=prompt)
    state = EpisodeState(task, policy, CODEC, EpisodeConfig(**cfg), _new_stats())
    state.system_text = system
    state.append_env(cf.render_system(system) + cf.render_user(prompt) + cf.assistant_prefix())
    return state


# ------------------------------------------------------------------- cache reuse (real sampler)
def test_summary_decode_reuses_live_cache():
    """Summary decoded on top of the live KV cache: only the query (and the tool output since the
    last turn) is prefilled; after the restart only what follows system + task is prefilled."""
    import jax

    import c2jax
    from c2jax.sampling import HarnessSampler, Sampler

    cfg = c2jax.config.default_config()
    cfg.model.moe_dispatch = "dropless"
    params = c2jax.models.init_params(cfg, jax.random.key(0))
    harness = HarnessSampler(Sampler(cfg, params, max_batch=2, max_len=192, chunk=4), temperature=0.0)
    meter = sm.PrefillMeter(SamplerPolicy(harness), slots=2)
    state = _state(meter)
    n0 = len(state.tokens)
    state.generate(5)
    assert harness.prefill_tokens == n0
    history_before_tool = len(state.tokens)
    state.append_env(cf.render_tool_result(0, "read_file", True, "def add(a, b):\n    return a - b\n")
                     + cf.assistant_prefix())
    p0 = harness.prefill_tokens
    n1 = len(state.tokens)
    state.generate(4)
    assert harness.prefill_tokens - p0 == n1 - history_before_tool  # only the tool output
    # the summary call: history + query; the history is already cached
    hook = sm.ContextHook(sm.SummaryConfig("self", trigger_tokens=1, max_summary_tokens=6, query="Summarize."))
    n_history = len(state.tokens)
    n_query = len(TOK.encode(cf.render_user("Summarize.") + cf.assistant_prefix()))
    p0 = harness.prefill_tokens
    hook(state)
    assert state.stats["summaries"] == 1 and len(state.segments) == 1
    summary_prefill = harness.prefill_tokens - p0
    assert summary_prefill == state.stats["summary_prefill_tokens"] == n_query
    assert summary_prefill < n_history // 4
    # after the restart: the new short context shares system + task with the cached slot
    new_ctx = list(state.tokens)
    shared = len(TOK.encode(cf.render_system("S") + cf.render_user(state.task.prompt)))
    assert new_ctx[:shared] == list(state.segments[0].tokens_T[:shared])
    p0 = harness.prefill_tokens
    state.generate(3)
    assert harness.prefill_tokens - p0 == len(new_ctx) - shared
    # the policy-side meter used for scripted runs counts exactly as the sampler does
    assert meter.prefill_tokens == harness.prefill_tokens
    # the summary tokens are model tokens of the closed segment, with the sampler's versions
    seg0 = state.segments[0]
    assert seg0.finish_reason == "summarized" and seg0.loss_mask_T[-1]
    assert seg0.expert_ids_TNK is not None and seg0.expert_ids_TNK.shape[0] == len(seg0.tokens_T)


# ------------------------------------------------------------------- restart / carried state
def test_self_summary_restart_context_and_carried_state():
    summary = "found: x=3\nPLAN: fix add\nTODO: edit calc.py\nTODO: answer"
    msgs = [f"{st.THINK}short{st.END_THINK}{st.SUMMARY}{summary}{st.END_SUMMARY}{st.END_TURN}",
            f"{st.SUMMARY}found: x=3, y=4{st.END_SUMMARY}{st.END_TURN}"]
    state = _state(ScriptedPolicy(msgs))
    state.append_env("x" * 50)
    hook = sm.ContextHook(sm.SummaryConfig("self", trigger_tokens=10, max_summaries=3))
    hook(state)
    text = TOK.decode(state.tokens)
    assert text.startswith(cf.render_system("S") + cf.render_user(state.task.prompt) + cf.render_summary(summary))
    assert "Summaries so far: 1 of at most 3." in text and text.endswith(cf.assistant_prefix())
    assert "Plan:" not in text and "Remaining to-dos" not in text   # the summary states them already
    assert not state.mask.count(True)                      # the new context is all environment
    seg0 = state.segments[0]
    assert TOK.decode(seg0.tokens_T[seg0.loss_mask_T]) == msgs[0]
    assert sm.SUMMARIZE_QUERY in sm.escape_free(TOK.decode(seg0.tokens_T))
    assert state.stats["summary_tokens"] == len(TOK.encode(msgs[0]))
    assert state.stats["summary_thinking_tokens"] == len(TOK.encode("short"))
    c = state.extra["carried"]
    assert (c.plan, c.todos, c.num_summaries) == ("fix add", ["edit calc.py", "answer"], 1)
    state.append_env("y" * 50)
    hook(state)   # a summary without PLAN:/TODO: lines: the earlier ones are carried into the restart
    text = TOK.decode(state.tokens)
    assert "Summaries so far: 2 of at most 3." in text and "Plan: fix add" in text
    assert "- edit calc.py\n- answer" in text and text.endswith(cf.assistant_prefix())


def test_summary_budget_and_plain_text_fallback():
    state = _state(ScriptedPolicy(["plain summary text", "second", "third"]))
    hook = sm.ContextHook(sm.SummaryConfig("self", trigger_tokens=10, max_summaries=2))
    for _ in range(4):
        hook(state)
    assert state.stats["summaries"] == 2 and len(state.segments) == 2
    assert cf.render_summary("second") in TOK.decode(state.tokens)   # no markers: visible text is used


def test_prompt_compaction_is_a_separate_uncached_call():
    calls = []

    class Recorder:
        version = 0

        def act(self, context, max_new_tokens, codec):
            calls.append(list(context))
            return PolicyOutput(codec.encode(f"{st.SUMMARY}compact{st.END_SUMMARY}{st.END_TURN}"))

    state = _state(Recorder())
    state.append_env("y" * 300)
    n_before = len(state.tokens)
    hook = sm.ContextHook(sm.SummaryConfig("prompt", trigger_tokens=10))
    hook(state)
    (ctx,) = calls
    text = TOK.decode(ctx)
    assert text.startswith(cf.render_system(sm.COMPACTION_SYSTEM)) and "y" * 300 in text
    assert state.stats["summary_prefill_tokens"] == len(ctx) > n_before      # the transcript, re-prefilled
    assert state.segments[0].num_model_tokens == 0                            # not a training token
    assert cf.render_summary("compact") in TOK.decode(state.tokens)


def test_truncation_keeps_recent_whole_turns():
    state = _state(ScriptedPolicy([cf.render_assistant("one"), cf.render_assistant("two"),
                                   cf.render_assistant("three")]))
    for _ in range(3):
        state.generate()
        state.append_env("o" * 100 + cf.assistant_prefix())
    hook = sm.ContextHook(sm.SummaryConfig("truncate", trigger_tokens=10, keep_tokens=260))
    hook(state)
    text = TOK.decode(state.tokens)
    head = cf.render_system("S") + cf.render_user(state.task.prompt) + cf.assistant_prefix()
    assert text.startswith(head + cf.render_assistant("two")) and "one" not in text
    assert text.endswith("o" * 100 + cf.assistant_prefix()) and not any(state.mask)
    assert state.segments[0].finish_reason == "truncated" and state.stats["truncations"] == 1


def test_config_validation():
    with pytest.raises(ValueError, match="method"):
        sm.SummaryConfig("magic")
    with pytest.raises(ValueError, match="max_context_tokens"):
        EpisodeConfig(max_context_tokens=0)
    base = EpisodeConfig()
    assert sm.summary_episode_config(base, sm.SummaryConfig("none")).context_hook is None
    c = sm.summary_episode_config(base, sm.SummaryConfig("self", trigger_tokens=99))
    assert c.context_trigger_tokens == 99 and isinstance(c.context_hook, sm.ContextHook)


# ------------------------------------------------------------------- end to end (sandbox)
def _run(task, method, trigger, window, sandbox):
    base = EpisodeConfig(max_turns=40, max_new_tokens=1024, max_total_tokens=100_000, list_tools_in_system=False,
                         max_tool_output_chars=4000, max_context_tokens=window)
    cfg = sm.summary_episode_config(base, sm.SummaryConfig(method, trigger_tokens=trigger, max_summaries=12,
                                                           max_summary_tokens=1024))
    pol = sm.PrefillMeter(make_long_horizon_policy(task))
    return run_episode(task, pol, None, sandbox, cfg), pol


def test_scripted_self_summary_solves_task_needing_pre_summary_information(sandbox):
    task = lh.load("train", 1, seed=3, n_files=4, file_chars=600)[0]
    res, meter = _run(task, "self", 1400, 4096, sandbox)
    assert res.grade.passed, (res.stats["finish_reason"], res.grade.details)
    assert res.stats["summaries"] >= 2 and len(res.segments) == res.stats["summaries"] + 1
    assert all(len(s.tokens_T) < 1400 + 1600 for s in res.segments)  # trigger + one read + query + summary
    # the first module's contents are gone from the final context; its value came through summaries
    first = task.metadata["modules"][0]
    name, value = next(iter(task.metadata["facts"].items()))
    final_text = TOK.decode(res.trajectory.tokens_T)
    assert first + " (lines" not in final_text and f"{name} = {value}" in final_text
    # every summary is a model-token span of the segment it closes
    for seg in res.segments[:-1]:
        assert seg.finish_reason == "summarized"
        assert st.SUMMARY in TOK.decode(seg.tokens_T[seg.loss_mask_T])
    # baselines on the same task: truncation loses the early reads, a capped full context overflows
    trunc, _ = _run(task, "truncate", 1400, 4096, sandbox)
    full_capped, _ = _run(task, "none", 1400, 2000, sandbox)
    full, full_meter = _run(task, "none", 1400, None, sandbox)
    assert not trunc.grade.passed and not full_capped.grade.passed
    assert full_capped.stats["finish_reason"] == "context_full"
    assert full.grade.passed and len(full.segments) == 1
    assert meter.prefill_tokens < 2 * full_meter.prefill_tokens
    # prompt-based compaction: separate calls over the whole transcript, longer summaries
    comp, comp_meter = _run(task, "prompt", 2000, 4096, sandbox)
    per = lambda r, k: r.stats[k] / max(r.stats["summaries"], 1)
    assert comp.stats["compaction_calls"] == comp.stats["summaries"] >= 1
    assert per(comp, "summary_tokens") > per(res, "summary_tokens")
    assert per(comp, "summary_prefill_tokens") > 2 * per(res, "summary_prefill_tokens")
