"""A self-summarized rollout split into training sequences: each segment has its own context and
loss mask, every model token of every segment carries the chain's advantage, versions and
expert ids survive the split and the packing, and packing keeps segments apart."""
import types

import numpy as np
import pytest

from c2jax import special_tokens as st
from c2jax.agent import chat_format as cf
from c2jax.agent import summarize as sm
from c2jax.agent.policy import PolicyOutput
from c2jax.agent.runner import EpisodeConfig, EpisodeState, _new_stats
from c2jax.rl import chains as ch

TOK = cf.ByteTokenizer()
CODEC = cf.as_codec(TOK)
N, K = 2, 3


class VersionedPolicy:
    """Scripted messages as a sampler would return them: logprobs, a version that advances
    every call (in-flight weight updates), and expert ids that encode (call, position)."""

    def __init__(self, messages):
        self.messages = list(messages)
        self.calls = 0
        self.version = 0

    def act(self, context, max_new_tokens, codec):
        ids = codec.encode(self.messages.pop(0))[:max_new_tokens]
        self.calls += 1
        n = len(ids)
        experts = np.full((n, N, K), self.calls, np.int32)
        experts[:, 0, 0] = np.arange(n)
        return PolicyOutput(ids, [-0.1 * self.calls] * n, [10 + self.calls] * n, experts)


SUMMARY_1 = f"{st.SUMMARY}found a=1\nTODO: fix b{st.END_SUMMARY}{st.END_TURN}"
SUMMARY_2 = f"{st.SUMMARY}found a=1 b=2{st.END_SUMMARY}{st.END_TURN}"
TURN = cf.render_assistant(calls=[{"name": "read_file", "arguments": {"path": "x.py"}}])


def make_chain(prompt="do the thing"):
    """segments: [turn, turn, summary] [turn, summary] [final]."""
    pol = VersionedPolicy([TURN, TURN, SUMMARY_1, TURN, SUMMARY_2, cf.render_assistant("done")])
    task = types.SimpleNamespace(task_id="task-7", prompt=prompt)
    state = EpisodeState(task, pol, CODEC, EpisodeConfig(), _new_stats())
    state.system_text = "SYS"
    state.append_env(cf.render_system("SYS") + cf.render_user(prompt) + cf.assistant_prefix())
    hook = sm.ContextHook(sm.SummaryConfig("self", trigger_tokens=1, query="Summarize."))
    tool_out = cf.render_tool_result(0, "read_file", True, "a = 1\n") + cf.assistant_prefix()
    for script in (["g", "e", "g", "e", "h"], ["g", "e", "h"], ["g"]):
        for step in script:
            if step == "g":
                state.generate()
            elif step == "e":
                state.append_env(tool_out)
            else:
                hook(state)
    final = state.to_trajectory("final")
    final.reward = 1.0
    final.reward_terms = {"verifier": 1.0}
    final.group_id = "g0"
    return state.segments + [final]


def test_chain_split_context_and_mask():
    segs = make_chain()
    seqs = ch.chain_sequences(segs)
    assert len(seqs) == 3
    head = cf.render_system("SYS") + cf.render_user("do the thing")
    texts = [TOK.decode(s.tokens_T) for s in seqs]
    model = [TOK.decode(s.tokens_T[s.loss_mask_T]) for s in seqs]
    # segment 0: the original context; its model tokens are two turns and the first summary
    assert texts[0].startswith(head + cf.assistant_prefix())
    assert model[0] == TURN + TURN + SUMMARY_1
    assert texts[0].endswith(cf.render_user("Summarize.") + cf.assistant_prefix() + SUMMARY_1)
    # segment 1: restart prefix (system + task + summary + carried state), all environment
    prefix1 = sm.restart_prefix(types.SimpleNamespace(system_text="SYS", task=types.SimpleNamespace(
        prompt="do the thing")), "found a=1\nTODO: fix b", sm.CarriedState("", ["fix b"], 1), 8)
    n1 = len(TOK.encode(prefix1))
    assert texts[1].startswith(prefix1) and not seqs[1].loss_mask_T[:n1].any()
    assert model[1] == TURN + SUMMARY_2
    assert "Summaries so far: 1 of at most 8" in texts[1] and "TODO: fix b" in texts[1]
    # segment 2: restarted from the second summary; earlier tool output is gone
    assert texts[2].startswith(head + cf.render_summary("found a=1 b=2"))
    assert model[2] == cf.render_assistant("done") and "a = 1\n" not in texts[2]
    # chain bookkeeping
    assert [s.stats["chain_index"] for s in seqs] == [0, 1, 2]
    assert {s.stats["chain_length"] for s in seqs} == {3}
    assert all(s.reward == 1.0 and s.reward_terms == {"verifier": 1.0} and s.group_id == "g0" for s in seqs)
    assert [s.finish_reason for s in seqs] == ["summarized", "summarized", "final"]


def test_versions_and_experts_survive_the_split():
    seqs = ch.chain_sequences(make_chain())
    call = 0
    for s in seqs:
        assert np.all(s.versions_T[~s.loss_mask_T] == -1) and np.all(s.expert_ids_TNK[~s.loss_mask_T] == -1)
        # model chunks appear in call order; each chunk's version / experts are its call's
        idx = np.flatnonzero(s.loss_mask_T)
        chunks = np.split(idx, np.flatnonzero(np.diff(idx) > 1) + 1)
        for c in chunks:
            call += 1
            assert np.all(s.versions_T[c] == 10 + call)
            np.testing.assert_allclose(s.logprobs_T[c], -0.1 * call, rtol=1e-6)
            assert np.all(s.expert_ids_TNK[c][:, 1:] == call)
            np.testing.assert_array_equal(s.expert_ids_TNK[c][:, 0, 0], np.arange(len(c)))
    assert call == 6


def test_chain_advantage_on_every_model_token_and_packing():
    chains = [make_chain(), make_chain(), make_chain("other task")]
    rewards = [1.0, 0.0, 0.5]
    groups = ["p", "p", "q"]
    adv = ch.chain_advantages(rewards, groups)
    np.testing.assert_allclose(adv, [0.5, -0.5, 0.0])           # per chain, not per segment
    batch = ch.chains_to_batch(chains, rewards, groups, seq_len=4096)
    seqs = [s for c in chains for s in c]
    assert batch["num_sequences"] == 9
    B, L = batch["inputs"].shape
    seen = np.zeros(9, int)
    for r in range(B):
        for seg_id in set(batch["segment_ids"][r]) - {0}:
            sel = batch["segment_ids"][r] == seg_id
            (i,) = set(batch["seq_index"][r][sel])
            s = seqs[i]
            seen[i] += 1
            c = i // 3
            np.testing.assert_array_equal(batch["inputs"][r][sel], s.tokens_T)
            np.testing.assert_array_equal(batch["positions"][r][sel], np.arange(len(s.tokens_T)))
            np.testing.assert_array_equal(batch["targets"][r][sel][:-1], s.tokens_T[1:])
            w = batch["loss_weights"][r][sel]
            np.testing.assert_array_equal(w[:-1], s.loss_mask_T[1:].astype(np.float32))
            assert w[-1] == 0
            a = batch["advantages"][r][sel]
            assert np.all(a[w > 0] == np.float32(adv[c])) and np.all(a[w == 0] == 0)
            np.testing.assert_array_equal(batch["versions"][r][sel][:-1][w[:-1] > 0], s.versions_T[1:][s.loss_mask_T[1:]])
            np.testing.assert_array_equal(batch["behaviour_logprobs"][r][sel][:-1], np.where(
                s.loss_mask_T[1:], s.logprobs_T[1:], 0).astype(np.float32))
            np.testing.assert_array_equal(batch["expert_ids"][r][sel], s.expert_ids_TNK)
    assert np.all(seen == 1)
    # every model token of every segment of a chain: the same advantage
    for i, s in enumerate(seqs):
        ta = ch.token_advantages(s, adv[i // 3])
        assert set(ta[s.loss_mask_T].tolist()) == {np.float32(adv[i // 3])} and not ta[~s.loss_mask_T].any()
    # weighted sum of model tokens equals sum over chains of adv * (model tokens - first-token edge)
    total = sum(adv[i // 3] * s.loss_mask_T[1:].sum() for i, s in enumerate(seqs))
    assert np.isclose(batch["advantages"].sum(), total)


def test_pack_rejects_too_long_and_too_few_rows():
    seqs = ch.chain_sequences(make_chain())
    with pytest.raises(ValueError, match="seq_len"):
        ch.pack_sequences(seqs, [0.0] * 3, seq_len=16)
    longest = max(len(s.tokens_T) for s in seqs)
    with pytest.raises(ValueError, match="num_rows"):
        ch.pack_sequences(seqs, [0.0] * 3, seq_len=longest, num_rows=1)
    b = ch.pack_sequences(seqs, [0.0] * 3, seq_len=longest, num_rows=4)
    assert b["inputs"].shape == (4, longest) and (b["segment_ids"][3] == 0).all()
