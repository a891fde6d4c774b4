"""The `todo` tool: create / update / complete / remove items, the list shown back to the model,
bad calls answered with tool errors, counted in the episode stats, restated after a summary."""
import types

import pytest

from c2jax import special_tokens as st
from c2jax.agent import chat_format as cf
from c2jax.agent import summarize as sm
from c2jax.agent import tools as tl
from c2jax.agent.chat_format import ToolCall
from c2jax.agent.policy import ScriptedPolicy
from c2jax.agent.runner import EpisodeConfig, EpisodeState, _new_stats, run_episode
from c2jax.agent.todos import MAX_ITEMS, TodoError, TodoList

TOK = cf.ByteTokenizer()


def todo(**args):
    return {"name": "todo", "arguments": args}


def test_create_update_complete_remove():
    t = TodoList()
    assert t.render() == "" and t.unfinished() == 0
    t.apply("add", text="read calc.py")
    t.apply("add", text="  fix   add()\n")          # whitespace is normalized
    out = t.apply("add", text="run the tests")
    assert out.splitlines() == ["to-do list (3 open, 0 done):", "[ ] 1. read calc.py", "[ ] 2. fix add()",
                                "[ ] 3. run the tests"]
    assert "[ ] 2. fix add() in calc.py" in t.apply("update", item_id=2, text="fix add() in calc.py")
    out = t.apply("complete", item_id=1)
    assert "(2 open, 1 done)" in out and "[x] 1. read calc.py" in out
    out = t.apply("remove", item_id=3)
    assert "3." not in out and t.unfinished() == 1
    assert "[ ] 4. answer" in t.apply("add", text="answer")   # ids are never reused
    assert t.apply("list") == t.render()
    assert (t.created, t.completed, t.unfinished()) == (4, 1, 2)


@pytest.mark.parametrize("action, kw, match", [
    ("delete", {}, "unknown action"),
    ("add", {}, "non-empty 'text'"),
    ("add", {"text": "   "}, "non-empty 'text'"),
    ("add", {"text": "x" * 201}, "limit is 200"),
    ("add", {"text": "a", "item_id": 1}, "takes no 'id'"),
    ("update", {"text": "a"}, "needs 'id'"),
    ("update", {"item_id": 1}, "non-empty 'text'"),
    ("complete", {"item_id": 7}, "no item 7; the items are: 1"),
    ("complete", {"item_id": 1, "text": "a"}, "takes only 'id'"),
    ("remove", {}, "needs 'id'"),
    ("list", {"item_id": 1}, "takes no 'id'"),
])
def test_bad_requests_raise_todo_errors(action, kw, match):
    t = TodoList()
    t.apply("add", text="one")
    with pytest.raises(TodoError, match=match):
        t.apply(action, **kw)
    assert [it.text for it in t.items] == ["one"] and not t.items[0].done   # nothing changed


def test_complete_twice_and_the_item_cap():
    t = TodoList()
    t.apply("add", text="one")
    t.apply("complete", item_id=1)
    with pytest.raises(TodoError, match="already complete"):
        t.apply("complete", item_id=1)
    for i in range(MAX_ITEMS - 1):
        t.apply("add", text=f"item {i}")
    with pytest.raises(TodoError, match=f"at most {MAX_ITEMS}"):
        t.apply("add", text="one too many")


def test_tool_calls_give_tool_errors_never_a_crash(tmp_path):
    ctx = tl.ToolContext(root=tmp_path, sandbox=None)

    def call(**args):
        return tl.execute_one(ToolCall(0, "todo", args), tl.ALL_TOOLS, ctx)

    r = call(action="add", text="fix the bug")
    assert r.ok and "[ ] 1. fix the bug" in r.output
    for args in ({}, {"action": 3}, {"action": "add", "text": ["a"]}, {"action": "add", "id": "1"},
                 {"action": "add", "text": "a", "priority": 1}):
        r = call(**args)
        assert not r.ok and r.malformed and not r.internal_error and r.output.startswith("todo:"), args
    for args, words in (({"action": "finish", "id": 1}, "unknown action"), ({"action": "complete", "id": 9},
                                                                            "no item 9")):
        r = call(**args)
        assert not r.ok and not r.malformed and not r.internal_error and words in r.output, args
    assert ctx.todos.unfinished() == 1
    # one turn's todo calls apply in the order written (the tool is a barrier)
    calls = [ToolCall(i, "todo", {"action": "add", "text": f"step {i}"}) for i in range(5)]
    res = tl.execute_calls(calls, [], tl.ALL_TOOLS, ctx)
    assert [it.text for it in ctx.todos.items[1:]] == [f"step {i}" for i in range(5)]
    assert "[ ] 6. step 4" in res[-1].output


def test_episode_counts_todos_and_shows_the_list(sandbox, fake_task):
    msgs = [cf.render_assistant(calls=[todo(action="add", text="read calc.py"), todo(action="add", text="fix add"),
                                       todo(action="add", text="write docs")]),
            cf.render_assistant(calls=[todo(action="complete", id=1), todo(action="complete", id=42),
                                       {"name": "todo", "arguments": {"action": "add", "txt": "typo"}}]),
            cf.render_assistant(calls=fake_task.reference_solution + [todo(action="complete", id=2)])]
    res = run_episode(fake_task, ScriptedPolicy(msgs, final=cf.render_assistant("Fixed add.")), TOK, sandbox)
    s = res.stats
    assert res.grade.passed and s["finish_reason"] == "final"
    assert (s["todos_created"], s["todos_completed"], s["unfinished_todos"]) == (3, 2, 1)
    assert s["tool_calls_by_name"]["todo"] == 7 and s["malformed_calls"] == 1 and s["tool_errors"] == 1
    assert s["internal_tool_errors"] == 0
    text = TOK.decode(res.trajectory.tokens_T)
    assert "no item 42" in text and "unknown argument(s) ['txt']" in text
    assert "[x] 2. fix add" in text and "[ ] 3. write docs" in text   # the list after the last change
    assert res.tool_calls[-1] == todo(action="complete", id=2)


def _state(policy):
    task = types.SimpleNamespace(task_id="t", prompt="Fix add() in calc.py.")
    state = EpisodeState(task, policy, cf.as_codec(TOK), EpisodeConfig(), _new_stats())
    state.system_text = "S"
    state.append_env(cf.render_system("S") + cf.render_user(task.prompt) + cf.assistant_prefix())
    return state


@pytest.mark.parametrize("method", ["self", "prompt", "truncate"])
def test_todo_list_survives_a_restart(method):
    summary = f"{st.SUMMARY}found the bug in add{st.END_SUMMARY}{st.END_TURN}"
    state = _state(ScriptedPolicy([summary, summary]))
    state.todos.apply("add", text="fix add")
    state.todos.apply("add", text="run the tests")
    state.todos.apply("complete", item_id=1)
    state.append_env("x" * 200)
    hook = sm.ContextHook(sm.SummaryConfig(method, trigger_tokens=10, keep_tokens=20))
    hook(state)
    assert len(state.segments) == 1
    text = TOK.decode(state.tokens)
    assert "x" * 200 not in text
    want = "Your to-do list (1 open, 1 done):\n[x] 1. fix add\n[ ] 2. run the tests"
    assert want in text and text.endswith(cf.assistant_prefix())
    assert not any(state.mask)


def test_no_todo_note_when_the_tool_was_not_used():
    state = _state(ScriptedPolicy([f"{st.SUMMARY}s{st.END_SUMMARY}{st.END_TURN}"]))
    state.append_env("x" * 100)
    sm.ContextHook(sm.SummaryConfig("self", trigger_tokens=10))(state)
    assert "to-do list" not in TOK.decode(state.tokens)


class SummarizingPolicy(ScriptedPolicy):
    """Scripted turns; answers the harness's summarize query with a fixed summary."""

    def next_message(self, context, codec):
        if codec.decode(context).endswith(cf.render_user(sm.SUMMARIZE_QUERY) + cf.assistant_prefix()):
            return f"{st.SUMMARY}add() subtracts{st.END_SUMMARY}{st.END_TURN}"
        return super().next_message(context, codec)


def test_episode_todos_survive_self_summary(sandbox, fake_task):
    """A to-do added before a self-summary is in the restarted context; completing it after
    the restart counts (the list is harness state, not context)."""
    msgs = [cf.render_assistant(calls=[todo(action="add", text="fix add"), todo(action="add", text="say done")]),
            cf.render_assistant(calls=[{"name": "read_file", "arguments": {"path": "README.md"}}]),
            cf.render_assistant(calls=fake_task.reference_solution + [todo(action="complete", id=1)])]
    base = EpisodeConfig(max_turns=8, max_new_tokens=512, list_tools_in_system=False)
    cfg = sm.summary_episode_config(base, sm.SummaryConfig("self", trigger_tokens=500, max_summaries=1))
    policy = SummarizingPolicy(msgs, final=cf.render_assistant("Fixed add."))
    res = run_episode(fake_task, policy, TOK, sandbox, cfg)
    assert res.stats["summaries"] == 1 and len(res.segments) == 2 and res.grade.passed
    after = TOK.decode(res.segments[1].tokens_T)
    assert "Your to-do list (2 open, 0 done):\n[ ] 1. fix add\n[ ] 2. say done" in after
    assert "[x] 1. fix add" in after and res.stats["unfinished_todos"] == 1
