"""RL through the agent harness (synthetic:1 tasks, bubblewrap sandbox, multi-turn prefix
reuse in the sampler): step-0 invariants on a random tiny model with the byte codec, and the
opt-in learning test from a CPT+SFT checkpoint:

    C2JAX_RL_INIT_FROM=runs/demo/sft pytest tests/rl/test_rl_harness.py -k learning
"""
import os

import pytest

from c2jax.agent.sandbox import unavailable_reason
from c2jax.config import load_config
from c2jax.rl.loop import run_rl
from c2jax.train.metrics import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NO_SANDBOX = unavailable_reason()


@pytest.mark.skipif(bool(NO_SANDBOX), reason=NO_SANDBOX or "")
def test_harness_rl_step0_invariants_and_reward_terms(tmp_path):
    cfg = load_config(os.path.join(ROOT, "configs/rl_tiny.py"), [
        "--config.model.vocab_size=320", "--config.model.hidden_size=32", "--config.model.num_layers=2",
        "--config.model.intermediate_size=64", "--config.model.moe_intermediate_size=32", "--config.model.head_dim=8",
        "--config.rl.steps=1", "--config.rl.group_size=2", "--config.rl.prompts_per_step=1",
        "--config.rl.max_new_tokens=24", "--config.rl.max_turns=2", "--config.rl.max_total_tokens=256",
        "--config.rl.system_prompt=Fix the bug with the tools.", "--config.rl.constant_normalizer_len=256",
        "--config.rl.eval_every=-1", "--config.rl.staleness=0"])
    s = run_rl(cfg, str(tmp_path / "run"))  # no tokenizer.json: the harness's byte codec
    assert s["final_step"] == 1
    (m,) = [r for r in read_metrics(str(tmp_path / "run")) if "reward" in r]
    assert m["logprob_mismatch_p99"] <= 1e-4 and m["logprob_mismatch_noreplay_p99"] <= 1e-4
    assert abs(m["importance_ratio_mean"] - 1) <= 1e-4 and m["kl_ref_k1"] == 0.0
    for k in ("reward/verifier", "reward/length_penalty", "reward/behaviour/malformed_calls",
              "reward/behaviour/unfinished_todos", "reward/behaviour/comment_reasoning_lines",
              "reward/behaviour/terminal_only", "reward/effort_x"):
        assert k in m


@pytest.mark.skipif(not os.environ.get("C2JAX_RL_INIT_FROM"), reason="set C2JAX_RL_INIT_FROM to a CPT+SFT run dir")
def test_harness_rl_learning_from_sft_checkpoint(tmp_path):
    """Held-out pass@1 on synthetic:1 rises over a short RL run from the demo's SFT model."""
    steps = int(os.environ.get("C2JAX_RL_STEPS", "30"))
    cfg = load_config(os.path.join(ROOT, "configs/rl_tiny.py"), [
        f"--config.train.init_from={os.environ['C2JAX_RL_INIT_FROM']}", f"--config.rl.steps={steps}",
        "--config.rl.eval_every=0", "--config.rl.eval_tasks=16", "--config.rl.eval_k=4"])
    s = run_rl(cfg, str(tmp_path / "run"))
    first, last = s["evals"][0], s["evals"][-1]
    print(s["evals"])
    assert last["eval/pass_at_1"] > first["eval/pass_at_1"], s["evals"]
