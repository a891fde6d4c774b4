"""SFT data for self-summarization (scripted chains written one segment per JSONL record, the
harness token format) and the prompt-compaction call fitted to a context window."""
import json

import pytest

from c2jax import special_tokens as st
from c2jax.agent import chat_format as cf
from c2jax.agent import summarize as sm
from c2jax.agent.runner import EpisodeConfig
from c2jax.agent.sandbox import unavailable_reason
from c2jax.data.pipeline import read_chats_jsonl
from c2jax.agent.long_horizon_policy import make_long_horizon_policy
from c2jax.tasks import long_horizon as lh

TOK = cf.ByteTokenizer()
CODEC = cf.as_codec(TOK)
NO_SANDBOX = unavailable_reason()


@pytest.mark.skipif(bool(NO_SANDBOX), reason=NO_SANDBOX or "")
def test_write_chain_transcripts_one_record_per_segment(tmp_path):
    tasks = lh.load("train", 2, 0, n_files=3, file_chars=300)
    base = EpisodeConfig(max_turns=20, max_new_tokens=1024, max_total_tokens=50_000, list_tools_in_system=False,
                         system_prompt="Use the tools.", max_context_tokens=2400)
    cfg = sm.summary_episode_config(base, sm.SummaryConfig("self", trigger_tokens=1200, max_summary_tokens=1024))
    path = str(tmp_path / "sft.jsonl")
    stats = sm.write_chain_transcripts(tasks, make_long_horizon_policy, TOK, path, cfg)
    assert stats["kept"] == 2 and stats["summaries"] >= 2 and stats["segments"] == stats["kept"] + stats["summaries"]
    recs = [json.loads(line) for line in open(path)]
    assert len(recs) == stats["segments"] and max(len(r["tokens"]) for r in recs) <= 2400
    # the SFT reader takes them as (ids, mask); the summary is trained (model tokens) in every
    # segment but the last of a chain, and the next segment starts from the restart prefix
    chats = read_chats_jsonl(path)
    for rec, (ids, mask) in zip(recs, chats):
        model_text = TOK.decode([t for t, m in zip(ids, mask) if m])
        if rec["chain_index"] < rec["chain_length"] - 1:
            assert st.SUMMARY in model_text and "TODO:" in model_text
            assert TOK.decode(ids).endswith(st.END_SUMMARY + st.END_TURN)
        if rec["chain_index"] > 0:
            assert not mask[0] and st.SUMMARY in TOK.decode([t for t, m in zip(ids, mask) if not m])


def test_compaction_context_fits_the_window():
    transcript = "".join(f"line {i}: LEGACY_X = {i}\n" for i in range(400))
    full = sm.compaction_context(CODEC, transcript)
    assert len(full) > 2000
    ctx = sm.compaction_context(CODEC, transcript, window=1000, room=100)
    assert len(ctx) + 100 <= 1000
    text = TOK.decode(ctx)
    assert text.startswith(cf.render_system(sm.COMPACTION_SYSTEM)) and "line 399: LEGACY_X = 399" in text
    assert "line 0:" not in text   # the oldest text is dropped first
    with pytest.raises(ValueError, match="does not fit the context window of 50"):
        sm.compaction_context(CODEC, transcript, window=50, room=10)


@pytest.mark.skipif(bool(NO_SANDBOX), reason=NO_SANDBOX or "")
def test_self_summary_experiment_sft_data_has_full_context_chains(tmp_path):
    """experiments/self_summary.py --sft-full: that many train tasks transcribed in full context (one
    segment, no summary, longer than the summarized chains' window), the rest summarized at both
    triggers; SFT rows then fit the full window."""
    import types

    from experiments import self_summary as ss
    args = types.SimpleNamespace(sft_tasks=6, sft_full=2, quick=False, seed=0, n_files=4, file_chars=300, max_turns=20,
                                 max_summary_tokens=1024, window=3200, triggers=[1600, 800], max_summaries=8,
                                 full_window=8000)
    stats, path = {}, str(tmp_path / "sft.jsonl")
    ss._write_transcripts(args, TOK, path, stats)
    t = stats["transcripts"]
    assert {k: v["kept"] for k, v in t.items()} == {1600: 2, 800: 2, "full": 2}
    assert t["full"]["segments"] == 2 and t["full"]["summaries"] == 0 and t["full"]["max_segment_tokens"] > 3200
    assert t[800]["summaries"] > t[1600]["summaries"] > 0
    assert len(open(path).readlines()) == sum(v["segments"] for v in t.values())
    assert ss._sft_seq_len(args) == 8001 and ss._sft_seq_len(types.SimpleNamespace(**{**vars(args), "sft_full": 0})) == 3200
