"""The `eval` config section (c2jax.evals.benchmark reads it), registered with c2jax.config."""
from __future__ import annotations

import ml_collections

from c2jax.config import register_section


def eval_defaults():
    """Defaults of `config.eval`."""
    e = ml_collections.ConfigDict()
    e.suites = ("synthetic:1",)        # c2jax.tasks.load_suite names
    e.split = "heldout"                # task split to evaluate
    e.n_per_suite = 20                 # tasks per suite (0: the suite's default size)
    e.seed = 0                         # task order / selection seed
    e.passes = 2                       # attempts per task (accuracy mean, pass@k)
    e.policy = "oracle"                # "oracle" | "do_nothing" | "model" (needs a policy_factory)
    e.concurrency = 8                  # episodes in flight
    e.max_turns = 32                   # assistant messages per episode
    e.max_total_tokens = 262_144       # context budget per episode
    e.max_new_tokens = 32_768          # per assistant message (a 16 KB write_file fits)
    e.run_timeout_s = 30.0             # cap on run / run_tests tool calls
    e.active_params = 0.0              # active parameters for the FLOPs estimate (0: omit)
    e.model_run = ""                   # run directory whose model is evaluated when policy == "model"
    e.temperature = 1.0                # sampling temperature of the model policy
    e.sampler_max_len = 2048           # the model policy's KV-cache length per episode; caps max_total_tokens
    e.speculative = "auto"             # MTP speculative decoding of the model policy: "auto" | "mtp" | "none" (Sampler)
    return e


register_section("eval", eval_defaults)
