"""RL coverage (report Fig. 5): held-out pass@1 and best-of-K every 10 steps of an RL run with the
report's objective, over seeds, on the variable-length token toy (experiments/rl_toy.py). The
seed-0 point is the same run as the report-objective point of objective_ablations.py (same
overrides, same name), which experiments/rl_coverage.py reuses when that sweep has run it.

    python experiments/rl_coverage.py        # runs (or reuses) this sweep, then the figure and table
"""
import ml_collections

TOY = {"rl.steps": 40, "rl.max_new_tokens": 16, "rl.constant_normalizer_len": 16, "rl.eval_every": 10,
       "rl.eval_tasks": 16, "rl.eval_k": 4}


def get_config():
    c = ml_collections.ConfigDict()
    c.base = "configs/rl_tiny.py:toy"
    c.command = "experiments/rl_toy.py"
    c.points = [{"rl.std_normalize": False, "rl.normalizer": "constant", "rl.mask_overlong": False, **TOY}]
    c.seeds = [0, 1, 2]
    c.metrics = ["eval/first_pass_at_1", "eval/pass_at_1", "eval/best_of_k", "first/reward", "last/reward"]
    return c
