"""Length penalty (report section 3): the concave penalty C(x) with several strengths, on the
variable-length token toy (experiments/rl_toy.py), x = 0.1 per generated token, k = 1, q = 0.5.
Effect on episode (response) length and reward.

    python experiments/length_penalty.py        # runs this sweep, then the figure and table
"""
import ml_collections

TOY = {"rl.steps": 40, "rl.max_new_tokens": 16, "rl.constant_normalizer_len": 16, "rl.eval_every": 10,
       "rl.eval_tasks": 16, "rl.eval_k": 4}


def get_config():
    c = ml_collections.ConfigDict()
    c.base = "configs/rl_tiny.py:toy"
    c.command = "experiments/rl_toy.py"
    base = {**TOY, "rl.effort_weights.final_message_tokens": 0.1, "rl.length_k": 1.0, "rl.length_q": 0.5}
    c.points = [{"rl.length_coef": coef, **base} for coef in (0.0, 0.1, 0.3)]
    c.seeds = [0, 1, 2]
    c.metrics = ["first/reward", "last/reward", "first/verifier", "last/verifier", "first/response_len",
                 "last/response_len", "last/length_penalty", "eval/pass_at_1"]
    return c
