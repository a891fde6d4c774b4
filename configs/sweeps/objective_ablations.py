"""Objective ablations (report section 3, Dr. GRPO): the report's objective (no std division,
constant normalizer, overlong rollouts kept) against each switch flipped alone, on the
variable-length token toy (experiments/rl_toy.py). Effect on reward and response length.

    python -m c2jax sweep --config configs/sweeps/objective_ablations.py --workdir runs/sweeps/objective_ablations
    python experiments/objective_ablations.py        # runs this sweep, then the figure and table
"""
import ml_collections

# Shared by the toy sweeps: 40 learner steps of 2 prompts x 8 samples, up to 16 new tokens.
TOY = {"rl.steps": 40, "rl.max_new_tokens": 16, "rl.constant_normalizer_len": 16, "rl.eval_every": 10,
       "rl.eval_tasks": 16, "rl.eval_k": 4}


def get_config():
    c = ml_collections.ConfigDict()
    c.base = "configs/rl_tiny.py:toy"
    c.command = "experiments/rl_toy.py"
    base = dict(TOY)
    c.points = [
        {"rl.std_normalize": False, "rl.normalizer": "constant", "rl.mask_overlong": False, **base},  # report
        {"rl.std_normalize": True, "rl.normalizer": "constant", "rl.mask_overlong": False, **base},
        {"rl.std_normalize": False, "rl.normalizer": "seq_len", "rl.mask_overlong": False, **base},
        {"rl.std_normalize": False, "rl.normalizer": "constant", "rl.mask_overlong": True, **base},
    ]
    c.seeds = [0, 1, 2]
    c.metrics = ["first/reward", "last/reward", "first/response_len", "last/response_len", "first/truncated",
                 "last/truncated", "eval/pass_at_1", "eval/best_of_k"]
    return c
