"""Pre-quantized inference weights: stored experts give logits bit-identical to the model's
on-the-fly quantized experts; stored dense projections equal quantizing inside the step; both
stay close to float; storage shrinks by the format's factor; the Sampler stores weights
quantized once (also on swap_params) and decodes exactly like the on-the-fly path."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import c2jax
from c2jax.sampling import Sampler, generate
from c2jax.sampling.quantized import is_quantized, param_bytes, quantize_params

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]
KW = {"max_batch": 3, "max_len": 32, "chunk": 4}
# float32 bytes / stored bytes of the MoE subtree, lower bounds: ideal 4 / (1 + 4/K) for int8 (f32
# channel scale), 4 / (1 + 1/32) for MXFP8, 4 / (0.5 + 1/16 + 4/K) for NVFP4 (K = 32 or 64 here);
# the float router sits in the same subtree
EXPERT_RATIO = {"int8": 3.5, "mxfp8": 3.5, "nvfp4": 5.5}


def make_cfg(quant="none"):
    cfg = c2jax.config.default_config()
    cfg.model.moe_dispatch = "dropless"
    cfg.model.init_std = 0.2
    cfg.model.quant = quant
    return cfg


@functools.cache
def float_params():
    return c2jax.models.init_params(make_cfg(), jax.random.key(0))


def tokens():
    return jax.random.randint(jax.random.key(1), (2, 16), 0, 512)


def experts_of(tree):
    """The MoE subtree: of the float params, or of the quantized containers (Weights.prepared)."""
    tree = tree.prepared if isinstance(tree, c2jax.models.Weights) else tree
    return tree["moe_layers"]["block"]["moe"]


@pytest.mark.parametrize("quant", ["int8", "mxfp8", "nvfp4"])
def test_stored_experts_equal_on_the_fly(quant):
    params, cfg = float_params(), make_cfg(quant)
    fwd = jax.jit(lambda p, t: c2jax.models.forward(cfg, p, t))
    on_the_fly = fwd(params, tokens())                      # model.quant: quantized every call
    stored = quantize_params(params, quant, "experts")
    np.testing.assert_array_equal(fwd(stored, tokens()), on_the_fly)
    gap = float(jnp.max(jnp.abs(on_the_fly - c2jax.models.forward(make_cfg(), params, tokens()))))
    print(f"{quant}: max |logit - float logit| = {gap:.3f}")
    assert gap < 6.0
    ratio = param_bytes(experts_of(params)) / param_bytes(experts_of(stored))
    print(f"{quant}: expert bytes / {ratio:.2f}, all params / {param_bytes(params) / param_bytes(stored):.2f}")
    assert ratio > EXPERT_RATIO[quant]


@pytest.mark.parametrize("quant", ["int8", "nvfp4"])
def test_stored_dense_equal_quantizing_in_step(quant):
    params, cfg = float_params(), make_cfg(quant)
    stored = quantize_params(params, quant, "all")
    attn = stored.prepared["moe_layers"]["block"]["attn"]
    assert is_quantized(attn["q_proj"]) and "kernel" not in stored.params["moe_layers"]["block"]["attn"]["q_proj"]
    assert "kernel" in stored.params["lm_head"] and not is_quantized(stored.prepared["lm_head"])
    assert "embed" in stored.params and "router" in stored.params["moe_layers"]["block"]["moe"]
    assert not is_quantized(stored.params)
    fwd = jax.jit(lambda p, t: c2jax.models.forward(cfg, p, t))
    in_step = jax.jit(lambda p, t: c2jax.models.forward(cfg, quantize_params(p, quant, "all"), t))
    np.testing.assert_array_equal(fwd(stored, tokens()), in_step(params, tokens()))
    gap = float(jnp.max(jnp.abs(fwd(stored, tokens()) - c2jax.models.forward(make_cfg(), params, tokens()))))
    print(f"{quant} (all): max |logit - float logit| = {gap:.3f}, "
          f"params / {param_bytes(params) / param_bytes(stored):.2f}")
    assert gap < 8.0


def test_sampler_stores_quantized_and_swaps():
    cfg = make_cfg("int8")
    params = float_params()
    params2 = jax.tree.map(lambda x: x * 1.1, params)
    s = Sampler(cfg, params, **KW)
    w = s.weights
    assert w.layout == "quantized" and w.split is None and not is_quantized(w.model.params)
    assert param_bytes(experts_of(w.model)) * 3.5 < param_bytes(experts_of(params))
    stored = generate(cfg, params, PROMPTS, max_new_tokens=6, temperature=0.0, sampler=s)
    on_the_fly = generate(cfg, params, PROMPTS, max_new_tokens=6, temperature=0.0, quant_scope="none", **KW)
    assert stored.tokens == on_the_fly.tokens
    for a, b in zip(stored.completions, on_the_fly.completions):
        np.testing.assert_array_equal(a[0].raw_logprobs, b[0].raw_logprobs)
        np.testing.assert_array_equal(a[0].expert_ids, b[0].expert_ids)
    s.swap_params(params2, 1)
    assert s.weights.layout == "quantized" and is_quantized(s.weights.model)
    swapped = generate(cfg, params2, PROMPTS, max_new_tokens=6, temperature=0.0, sampler=s)
    fresh = generate(cfg, params2, PROMPTS, max_new_tokens=6, temperature=0.0, quant_scope="none", **KW)
    assert swapped.tokens == fresh.tokens and swapped.tokens != stored.tokens
    assert all(v == 1 for vs in swapped.versions for v in vs[0])


def test_bad_input():
    with pytest.raises(ValueError, match="quant"):
        quantize_params(float_params(), "fp8")
    with pytest.raises(ValueError, match="scope"):
        quantize_params(float_params(), "int8", "dense")
    with pytest.raises(ValueError, match="already quantized"):
        quantize_params(quantize_params(float_params(), "int8"), "int8")
    with pytest.raises(ValueError, match="quant_scope"):
        Sampler(make_cfg("int8"), float_params(), quant_scope="dense", **KW)
