"""Builds tiny Hugging Face MoE checkpoints whose routing is strongly IMBALANCED, + reference logits.

Companion of make_hf_fixtures.py (same configs, re-initialisation and on-disk format), for the
routing-parity tests (tests/models/test_hf_routing_parity.py): a forward through c2jax's public API
must be dropless, so it must match transformers (which never drops) even when one expert receives
most tokens. Runs in the PyTorch reference environment, never in the JAX tests:

    .venv-ref/bin/python experiments/reference/make_hf_routing_fixtures.py [--out tests/fixtures/hf]

Fixtures (2 x 64 = 128 tokens each, so a capacity of factor * T * K / E with factor 2 is 64 rows
per expert, equal to c2jax's MIN_DROPLESS_CAPACITY floor):
  deepseek_v3_tiny_biased  - DeepSeek-V3, e_score_correction_bias ~ N(0, 0.5) per layer.
  qwen3_moe_tiny_skewed    - Qwen3-MoE whose router rows for expert 0 are pushed along the mean
                             direction of that router's inputs (a "trained" skewed router).
  deepseek_v3_tiny_skewed  - DeepSeek-V3, 16 experts top-4, the same skew on expert 0.

Each `<out>/<name>/` holds what make_hf_fixtures.py writes (config.json, model.safetensors,
keys.txt) and `reference.npz` with `input_ids` int32 [2, 64], `logits` float32 [2, 64, 256],
`moe_layers` int32 [N] (decoder layer index of each MoE layer), `expert_ids` int32 [N, 2, 64, K]
(transformers' top-k choice, sorted ascending per token) and `expert_counts` int32 [N, E]
(assignments per expert). It prints per layer the assignments per expert and the fraction of
assignments a capacity of ceil(factor * T * K / E) (factor 2) would drop, and exits 1 if a fixture
is not imbalanced enough (no layer with max/mean count > 3 or nothing dropped), if the reload does
not reproduce the logits, or if a top-k choice is a near tie (margin < 1e-4) that a float32 port
could legitimately flip.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys

import numpy as np
import torch
import transformers
from transformers import DeepseekV3ForCausalLM, Qwen3MoeForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_hf_fixtures import SEED, VOCAB, deepseek_v3_config, dump_keys, qwen3_moe_config, reinit_  # noqa: E402

BATCH, SEQ = 2, 64
CAPACITY_FACTOR = 2.0
C2JAX_MIN_CAPACITY = 64     # c2jax.models.moe.MIN_DROPLESS_CAPACITY: capacity never below min(T, 64)
BIASED_STD = 0.5            # e_score_correction_bias std of deepseek_v3_tiny_biased
SKEW_LOGIT = 4.0            # skewed routers: expert 0's router logit gains SKEW_LOGIT * (x . u) / mean(x . u)
MIN_MARGIN = 1e-4           # smallest allowed gap between the k-th and (k+1)-th choice score
ROUTER_TYPES = ("DeepseekV3TopkRouter", "Qwen3MoeTopKRouter")

FIXTURES = {
    # name: (model class, config factory, how the routing is imbalanced, description)
    "deepseek_v3_tiny_biased": (
        DeepseekV3ForCausalLM,
        lambda: deepseek_v3_config(num_hidden_layers=3, first_k_dense_replace=1),
        "bias",
        "DeepSeek-V3, 3 layers (first 1 dense), MLA q_lora 32, YaRN, 8 experts in 4 groups (topk_group 2) top-2 + 1 shared, "
        "e_score_correction_bias ~ N(0, 0.5) per layer.",
    ),
    "qwen3_moe_tiny_skewed": (
        Qwen3MoeForCausalLM,
        lambda: qwen3_moe_config(),
        "skew",
        "Qwen3-MoE, 3 layers (layer 0 dense), 8 experts top-2, norm_topk_prob=True, router row of expert 0 skewed "
        "along the mean direction of the router inputs.",
    ),
    "deepseek_v3_tiny_skewed": (
        DeepseekV3ForCausalLM,
        lambda: deepseek_v3_config(num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=16,
                                   num_experts_per_tok=4, n_group=4, topk_group=2, moe_intermediate_size=16),
        "skew",
        "DeepSeek-V3, 3 layers (first 1 dense), 16 experts (width 16) in 4 groups (topk_group 2) top-4 + 1 shared, "
        "bias ~ N(0, 0.1), router row of expert 0 skewed along the mean direction of the router inputs.",
    ),
}


def routers(model) -> list[tuple[int, torch.nn.Module]]:
    """(decoder layer index, router module) of every MoE layer, in layer order."""
    out = []
    for i, layer in enumerate(model.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if type(gate).__name__ in ROUTER_TYPES:
            out.append((i, gate))
    return out


def run_and_capture(model, ids_t) -> tuple[np.ndarray, list[np.ndarray], list[np.ndarray], list[float]]:
    """Forward; returns logits, each router's input [T, H], its top-k ids [T, K] and choice margin."""
    rs = routers(model)
    cap: dict[int, tuple] = {}
    hooks = [g.register_forward_hook(lambda m, i, o, k=li: cap.__setitem__(k, (i[0].detach().clone(), o[2].detach())))
             for li, g in rs]
    with torch.no_grad():
        logits = model(ids_t).logits.float().numpy()
    for h in hooks:
        h.remove()
    xs = [cap[li][0].reshape(-1, cap[li][0].shape[-1]) for li, _ in rs]
    ids = [cap[li][1].numpy().astype(np.int32) for li, _ in rs]
    margins = [choice_margin(g, x) for (_, g), x in zip(rs, xs)]
    return logits, [x.numpy() for x in xs], ids, margins


def choice_margin(gate, x: torch.Tensor) -> float:
    """Smallest gap, over tokens, between the k-th and (k+1)-th router logit (Qwen3-MoE) or biased
    sigmoid score (DeepSeek-V3, after group masking; also the gap between the last chosen and the
    first unchosen group): how far the routing is from a tie a float32 port could flip."""
    with torch.no_grad():
        if type(gate).__name__ == "Qwen3MoeTopKRouter":
            s = torch.nn.functional.linear(x, gate.weight)  # softmax is monotone: compare the logits
            groups_margin = math.inf
        else:
            s = torch.sigmoid(torch.nn.functional.linear(x.float(), gate.weight.float())) + gate.e_score_correction_bias
            g = s.view(-1, gate.num_group, gate.num_experts // gate.num_group).topk(2, dim=-1)[0].sum(-1)
            gs = g.sort(dim=-1, descending=True).values
            groups_margin = float((gs[:, gate.topk_group - 1] - gs[:, gate.topk_group]).min()) \
                if gate.topk_group < gate.num_group else math.inf
            keep = torch.zeros_like(g).scatter_(1, g.topk(gate.topk_group, dim=-1)[1], 1.0)
            mask = keep.repeat_interleave(gate.num_experts // gate.num_group, dim=1).bool()
            s = s.masked_fill(~mask, float("-inf"))
        ss = s.sort(dim=-1, descending=True).values
        k = gate.top_k
        return min(float((ss[:, k - 1] - ss[:, k]).min()), groups_margin)


def skew_routers_(model, ids_t) -> list[float]:
    """Make expert 0 the favourite of every router, layer by layer (a later router sees the inputs
    the earlier skews produce): add to its weight row SKEW_LOGIT * u / mean(x . u), u the unit mean
    of the router's inputs x over the batch. Returns the fraction of tokens with x . u > 0 per layer."""
    fracs = []
    for n, (_, gate) in enumerate(routers(model)):
        _, xs, _, _ = run_and_capture(model, ids_t)
        x = torch.from_numpy(xs[n]).to(torch.float32)
        u = x.mean(0)
        u = u / u.norm()
        proj = x @ u
        with torch.no_grad():
            gate.weight[0] += (SKEW_LOGIT / proj.mean()) * u.to(gate.weight.dtype)
        fracs.append(float((proj > 0).float().mean()))
    return fracs


def drop_report(ids_TK: np.ndarray, num_experts: int, factor: float = CAPACITY_FACTOR) -> dict:
    """Assignments per expert and the fraction a per-expert capacity would drop: the plain
    ceil(factor * T * K / E) and c2jax's min(T, max(that, 64))."""
    T, K = ids_TK.shape
    counts = np.bincount(ids_TK.reshape(-1), minlength=num_experts)
    cap = int(math.ceil(factor * T * K / num_experts))
    cap_c2jax = min(T, max(cap, C2JAX_MIN_CAPACITY))
    return {
        "counts": counts.tolist(),
        "max_over_mean": float(counts.max() / counts.mean()),
        "frac_tokens_to_expert0": float((ids_TK == 0).any(-1).mean()),
        "capacity": cap,
        "dropped_frac": float(np.maximum(counts - cap, 0).sum() / (T * K)),
        "capacity_c2jax": cap_c2jax,
        "dropped_frac_c2jax": float(np.maximum(counts - cap_c2jax, 0).sum() / (T * K)),
    }


def build(name: str, out_root: str) -> dict:
    """Writes fixture `name` under out_root and returns its summary (routing stats included)."""
    cls, make_cfg, kind, _ = FIXTURES[name]
    torch.manual_seed(SEED)
    gen = torch.Generator().manual_seed(SEED)
    cfg = make_cfg()
    model = cls(cfg).to(torch.float32).eval()
    reinit_(model, gen)
    rng = np.random.default_rng(SEED)
    input_ids = rng.integers(0, VOCAB, size=(BATCH, SEQ)).astype(np.int32)
    ids_t = torch.from_numpy(input_ids.astype(np.int64))

    info: dict = {"name": name, "kind": kind}
    if kind == "bias":
        with torch.no_grad():
            for _, gate in routers(model):
                gate.e_score_correction_bias.copy_(torch.randn(gate.e_score_correction_bias.shape, generator=gen)
                                                   * BIASED_STD)
    else:
        info["frac_tokens_along_skew"] = skew_routers_(model, ids_t)

    logits, _, ids, margins = run_and_capture(model, ids_t)
    E = routers(model)[0][1].num_experts
    moe_layers = np.array([li for li, _ in routers(model)], np.int32)
    ids_sorted = np.stack([np.sort(i, axis=-1).reshape(BATCH, SEQ, -1) for i in ids]).astype(np.int32)
    counts = np.stack([np.bincount(i.reshape(-1), minlength=E) for i in ids]).astype(np.int32)

    d = os.path.join(out_root, name)
    if os.path.isdir(d):
        shutil.rmtree(d)
    model.save_pretrained(d, safe_serialization=True)
    np.savez(os.path.join(d, "reference.npz"), input_ids=input_ids, logits=logits.astype(np.float32),
             moe_layers=moe_layers, expert_ids=ids_sorted, expert_counts=counts)
    keys = dump_keys(d)

    re = cls.from_pretrained(d, dtype=torch.float32).eval()
    logits2, _, ids2, _ = run_and_capture(re, ids_t)
    info.update({
        "experts": E,
        "top_k": ids[0].shape[-1],
        "tokens": BATCH * SEQ,
        "moe_layers": moe_layers.tolist(),
        "layers": [drop_report(i, E) for i in ids],
        "min_choice_margin": min(margins),
        "logits_std": float(logits.std()),
        "reload_max_abs_diff": float(np.abs(logits - logits2).max()),
        "reload_same_routing": all(np.array_equal(a, b) for a, b in zip(ids, ids2)),
        "n_disk_tensors": len(keys),
        "bytes": sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d)),
    })
    if kind == "bias":
        info["bias_std"] = [float(g.e_score_correction_bias.std()) for _, g in routers(re)]
    return info


def main() -> int:
    """Builds every fixture (or --only ones), prints one JSON line each, exit 1 on a failed check."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "..", "tests", "fixtures", "hf"))
    ap.add_argument("--only", nargs="*", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    ok = True
    for name in args.only or FIXTURES:
        info = build(name, out)
        print(json.dumps(info))
        checks = {
            "reload": info["reload_max_abs_diff"] <= 1e-5 and info["reload_same_routing"],
            "imbalanced": max(layer["max_over_mean"] for layer in info["layers"]) > 3,
            "drops": max(layer["dropped_frac_c2jax"] for layer in info["layers"]) > 0,
            "no_near_tie": info["min_choice_margin"] >= MIN_MARGIN,
            "small": info["bytes"] < 1 << 20,
        }
        failed = [k for k, v in checks.items() if not v]
        if failed:
            print(f"{name}: FAILED {failed}", file=sys.stderr)
            ok = False
    print(json.dumps({"torch": torch.__version__, "transformers": transformers.__version__, "ok": ok}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
