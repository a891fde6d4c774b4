"""Sampling: jitted KV-cache prefill/decode with continuous batching, per-token behaviour
logprobs, policy versions and routed expert ids, in-flight weight swaps.

    out = c2jax.sampling.generate(cfg, params, prompts, max_new_tokens=64, temperature=1.0, n=4, seed=0)
    out.tokens[i][j], out.logprobs[i][j], out.expert_ids[i][j], out.finish_reason[i][j]
"""
from c2jax.sampling.api import GenerateOutput, HarnessSampler, generate  # noqa: F401
from c2jax.sampling.engine import Completion, Request, Sampler, sampler_model_cfg  # noqa: F401
from c2jax.sampling.logits import filter_logits, select_tokens  # noqa: F401
