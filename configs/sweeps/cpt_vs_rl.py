"""CPT budget vs RL reward (report Fig. 2): three log-spaced CPT budgets (x3 steps each) of the
tiny model, each followed by the same SFT and the same RL run (experiments/cpt_vs_rl.py is the
point command: CPT -> SFT -> RL -> results.json).

    python experiments/cpt_vs_rl.py --parallel 3     # runs this sweep, then the figure and table
    python -m c2jax sweep --config configs/sweeps/cpt_vs_rl.py --workdir runs/sweeps/cpt_vs_rl
      (the shared tokenizer and SFT transcripts are prepared by the first point)
"""
import ml_collections


def get_config():
    c = ml_collections.ConfigDict()
    c.base = "configs/stages/cpt.py:tiny"
    c.command = "experiments/cpt_vs_rl.py"
    c.points = [{"train.steps": n, "train.eval_every": 0, "train.checkpoint_every": n} for n in (15, 45, 135)]
    c.metrics = ["cpt_steps", "cpt_tokens", "cpt_codebase_loss", "post_sft_codebase_loss", "rl_reward_mean",
                 "rl_verifier_mean", "rl_pass_rate_mean", "pre_rl_pass_at_1", "post_rl_pass_at_1",
                 "post_rl_best_of_k"]
    return c
