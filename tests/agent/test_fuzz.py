"""Fuzz: random and adversarial model output never makes an exception escape the runner."""
import json

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs

from c2jax import special_tokens as st
from c2jax.agent import chat_format as cf
from c2jax.agent import tools as tl
from c2jax.agent.policy import SamplerPolicy, ScriptedPolicy
from c2jax.agent.runner import EpisodeConfig, run_episode

OK_FINISH = {"final", "max_turns", "max_tokens", "max_new_tokens"}
FRAGMENTS = [st.TOOL_CALL, st.END_TOOL_CALL, st.THINK, st.END_THINK, st.END_TURN, st.EOS, st.SUMMARY,
             st.END_SUMMARY, st.TOOL_RESULT, st.ASSISTANT, st.USER, "{", "}", "[", "]", '"', "\\", ":", ",",
             '{"name": "read_file", "arguments": {"path": "calc.py"}}', '{"name": ', '"arguments": ',
             '"path": "../../etc/shadow"', '"\\ud800"', "NaN", "1e999", "9" * 5000, "\x00", "ñ€𝄞",
             '{"name": "run", "arguments": {"command": "yes | head -c 100000000"}}',
             '{"name": "edit_file", "arguments": {"path": "calc.py", "old": "a", "new": "b"}}',
             '{"name": "write_file", "arguments": {"path": "/etc/x", "content": "x"}}',
             '{"name": "grep", "arguments": {"pattern": "(a+)+$", "path": "."}}']

json_leaf = hs.one_of(hs.none(), hs.booleans(), hs.integers(-10**6, 10**6), hs.floats(allow_nan=True),
                      hs.text(max_size=30), hs.sampled_from(["calc.py", ".", "..", "/task", "a" * 5000, "/etc/shadow"]))
json_val = hs.recursive(json_leaf, lambda c: hs.lists(c, max_size=3) | hs.dictionaries(hs.text(max_size=8), c, max_size=3),
                        max_leaves=8)
arg_names = hs.sampled_from(["path", "start_line", "end_line", "pattern", "include", "old", "new", "content",
                             "command", "timeout_s", "recursive", "bogus"])
random_call = hs.builds(lambda name, args: st.TOOL_CALL + json.dumps({"name": name, "arguments": args})
                        + st.END_TOOL_CALL,
                        hs.sampled_from(list(tl.ALL_TOOLS) + ["nope", ""]),
                        hs.dictionaries(arg_names, json_val, max_size=4))
message = hs.lists(hs.one_of(hs.text(max_size=40), hs.sampled_from(FRAGMENTS), random_call),
                   max_size=8).map("".join)


@settings(max_examples=400, deadline=None)
@given(message)
def test_parser_never_raises(text):
    p = cf.parse_assistant(text, max_calls=4, max_call_chars=2000)
    assert [*sorted([c.index for c in p.calls] + [e.index for e in p.errors])] == list(range(p.num_calls))


FUZZ_CFG = EpisodeConfig(max_turns=4, max_total_tokens=20_000, max_new_tokens=3000, run_timeout_s=2,
                         max_tool_output_chars=2000)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(hs.lists(message, min_size=1, max_size=4))
def test_runner_survives_adversarial_text(sandbox, fake_task, messages):
    res = run_episode(fake_task, ScriptedPolicy(messages, final="x"), None, sandbox, FUZZ_CFG)
    assert res.stats["finish_reason"] in OK_FINISH, res.stats["error"]
    assert res.stats["internal_tool_errors"] == 0
    assert len(res.trajectory.tokens_T) == len(res.trajectory.loss_mask_T)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(hs.lists(hs.lists(hs.integers(-5, 400), max_size=300), min_size=1, max_size=4))
def test_runner_survives_random_token_ids(sandbox, fake_task, turns):
    """Raw token ids (including special and out-of-vocabulary ones) straight from a 'sampler'."""
    turns = list(turns)

    def sampler(context, max_new_tokens):
        ids = turns.pop(0) if turns else [0]
        return ids, np.zeros(len(ids)), 3, None

    res = run_episode(fake_task, SamplerPolicy(sampler), None, sandbox, FUZZ_CFG)
    assert res.stats["finish_reason"] in OK_FINISH, res.stats["error"]
    assert res.stats["internal_tool_errors"] == 0
