"""The demo pipeline's pieces: oracle transcripts in the harness's exact token format (special
tokens as single ids, the tiny system prompt), the RL config in the same format, and the
before/after tables. The end-to-end run is `make demo`; RL learning from the demo's SFT model
is tests/rl/test_rl_harness.py (opt-in)."""
import json
import os

import pytest

from c2jax import pipeline
from c2jax import special_tokens as st
from c2jax.agent.sandbox import unavailable_reason
from c2jax.config import load_config
from c2jax.data.tokenizer import sample_texts, train_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NO_SANDBOX = unavailable_reason()


@pytest.mark.skipif(bool(NO_SANDBOX), reason=NO_SANDBOX or "")
def test_oracle_transcripts_use_special_ids_and_mask_only_model_tokens(tmp_path):
    tok = train_tokenizer(sample_texts(enumerate(["def add(a, b):\n    return a + b\n" * 20]), 1.0),
                          vocab_size=300, min_frequency=1)
    path = str(tmp_path / "t.jsonl")
    stats = pipeline.write_oracle_transcripts(tok, path, n_per_suite=4)
    assert stats == {"tasks": 4, "kept": 4, "failed": 0, "too_long": 0, "recovery": 0, "unmasked": 0}
    rows = [json.loads(line) for line in open(path)]
    end, call, asst = (tok.token_id(t) for t in (st.END_TURN, st.TOOL_CALL, st.ASSISTANT))
    for r in rows:
        ids, mask = r["tokens"], r["loss_mask"]
        assert ids[0] == tok.token_id(st.SYSTEM)
        assert tok.decode(ids).startswith(st.SYSTEM + pipeline.SYSTEM_PROMPT + st.END_TURN)
        # three model turns (read, edit, final), each ending in the END_TURN id, which the model
        # must emit itself (it is the sampler's stop token)
        model = [i for i, m in zip(ids, mask) if m]
        assert model.count(end) == 3 and model[-1] == end and model[0] == call
        starts = [k for k in range(1, len(ids)) if mask[k] and not mask[k - 1]]
        assert len(starts) == 3 and all(ids[k - 1] == asst for k in starts)


@pytest.mark.skipif(bool(NO_SANDBOX), reason=NO_SANDBOX or "")
def test_recovery_transcripts_train_the_retry_not_the_miss(tmp_path):
    """Every recovery transcript misses its first edit (the harness quotes the closest text), then
    sends the reference edit and passes; only the read, the retry and the final message are model
    tokens, so the miscopied call never enters the loss."""
    tok = train_tokenizer(sample_texts(enumerate(["def add(a, b):\n    return a + b\n" * 20]), 1.0),
                          vocab_size=300, min_frequency=1)
    path = str(tmp_path / "t.jsonl")
    stats = pipeline.write_oracle_transcripts(tok, path, n_per_suite=6, recovery_fraction=1.0, max_tokens=8192)
    assert stats["kept"] == stats["recovery"] == 6 and stats["unmasked"] == 0, stats
    for r in (json.loads(line) for line in open(path)):
        ids, mask = r["tokens"], r["loss_mask"]
        text = tok.decode(ids)
        assert text.count('"name": "edit_file", "arguments"') == 2 and "the closest text in the file" in text
        model = tok.decode([i for i, m in zip(ids, mask) if m])
        assert model.count('"name": "edit_file", "arguments"') == 1 and model.count('"name": "read_file"') == 1
        starts = [k for k in range(1, len(ids)) if mask[k] and not mask[k - 1]]
        assert len(starts) == 3  # read, retry, final: the miss between them is context only
    rng = __import__("random").Random(3)
    for _ in range(20):
        line = "    return x " + rng.choice("+-*<>") + " y\n"
        bad = pipeline.miscopied(line, "def f(x, y):\n" + line, rng.randrange(1000))
        assert bad is not None and bad != line and bad not in "def f(x, y):\n" + line


def test_rl_tiny_uses_the_demo_episode_format():
    cfg = load_config(os.path.join(ROOT, "configs/rl_tiny.py"))
    assert cfg.rl.system_prompt == pipeline.episode_config().system_prompt == pipeline.SYSTEM_PROMPT
    assert cfg.rl.temperature == cfg.rl.eval_temperature == pipeline.TEMPERATURE
    assert not cfg.rl.list_tools_in_system and not pipeline.episode_config().list_tools_in_system
    # RL prompts come from another task seed than the SFT transcripts (write_oracle_transcripts: seed 0)
    import inspect
    sft_seed = inspect.signature(pipeline.write_oracle_transcripts).parameters["seed"].default
    assert cfg.rl.task_seed >= 0 and cfg.rl.task_seed != sft_seed
    toy = load_config(os.path.join(ROOT, "configs/rl_tiny.py:toy"))
    assert toy.rl.temperature == 1.0


def _report(passed, tokens):
    """A run_benchmark-shaped report from passed[task][attempt] (via its own summarizer)."""
    from c2jax.evals.benchmark import default_ks, summarize_suite

    class R:
        def __init__(self, ok, n):
            self.grade = type("G", (), {"passed": ok, "score": float(ok)})()
            self.stats = {"tool_calls": 2, "malformed_calls": 1, "completion_tokens": n, "turns": 3, "wall_s": 0.1,
                          "finish_reason": "final"}
            self.trajectory = type("T", (), {"tokens_T": [0] * (n + 10)})()

    tasks = [type("Task", (), {"prompt": "p", "reference_solution": [], "files": {}})() for _ in passed]
    grid = [[R(ok, n) for ok, n in zip(ps, ts)] for ps, ts in zip(passed, tokens)]
    k = len(passed[0])
    return {"suites": {"synthetic:1": summarize_suite(tasks, grid, k, None, default_ks(k))}}


def test_eval_table_reports_pass1_best_of_k_and_tokens():
    before = _report([[1, 0, 0, 0], [0, 0, 0, 0]], [[10, 20, 30, 40]] * 2)   # pass@1 1/8, best-of-4 1/2
    after = _report([[1, 1, 0, 1], [0, 1, 0, 0]], [[10, 10, 10, 10]] * 2)    # 4/8, 2/2
    lines = pipeline.eval_table([("SFT", before), ("SFT -> RL", after)]).splitlines()
    assert lines[2] == "| SFT | synthetic:1 | 0.125 | 0.500 (K=4) | 25 | 0.500 |"
    assert lines[3] == "| SFT -> RL | synthetic:1 | 0.500 | 1.000 (K=4) | 10 | 0.500 |"


def test_stage_table():
    cpt = {"initial_eval": {"heldout_loss": 6.9, "codebase_ppl": 1000.0},
           "final_eval": {"heldout_loss": 5.5, "codebase_ppl": 280.0}}
    sft = {"final_eval": {"heldout_loss": 8.0, "codebase_ppl": 3000.0}}
    t = pipeline.stage_table(cpt, sft)
    assert "| CPT | 6.900 -> 5.500 | 1000.0 -> 280.0 |" in t and "| SFT | -> 8.000 | 3000.0 |" in t


def test_demo_settings_nest_and_the_cli_picks_one():
    import dataclasses

    from c2jax.cli import _parse
    sizes = pipeline.DEMO_SIZES
    assert set(sizes) == {"quick", "default", "full"}
    counts = [f.name for f in dataclasses.fields(pipeline.DemoSizes) if f.type in (int, "int")]
    assert set(counts) == {"transcripts", "sft_steps", "rl_steps", "eval_tasks", "eval_passes"}
    for small, big in (("quick", "default"), ("default", "full")):
        for name in counts:
            assert getattr(sizes[small], name) <= getattr(sizes[big], name), (small, big, name)
    # --full runs the committed learning recipe on the held-out size its goal is measured on
    full = sizes["full"]
    assert full.rl_config == "configs/rl_tiny.py:learning" and full.eval_tasks >= 128 and full.eval_passes >= 4
    learning = load_config(full.rl_config)
    assert full.rl_steps == learning.rl.steps
    for mode in sizes.values():
        load_config(mode.rl_config)  # each names a config that loads
    # the default's SFT model must solve some held-out tasks (pass@1 0.16 at 350 steps, 32 x 1)
    assert sizes["default"].sft_steps >= 350 and sizes["default"].transcripts >= 4096
    assert _parse(["demo", "--full"])[0].full and _parse(["demo", "--quick"])[0].quick

