"""Shared model shape for the PyTorch peer benchmarks (hf_train_step.py, hf_generate.py).

The JAX benchmarks call these scripts via subprocess and read the one JSON line they print;
`config` in that line is the exact Qwen3-MoE shape, so the JAX side can build the same model.
Default shape (layers 6, hidden 512, 16 experts top-2, vocab 8192): heads 8, kv heads 4,
head_dim 64, moe_intermediate_size 512, every layer MoE, untied lm_head -> 88.7M parameters.
"""

from __future__ import annotations

import argparse
import statistics


def add_shape_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--moe-intermediate", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=1024, help="dense MLP width (unused when every layer is MoE)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--experts-impl", default=None,
                    help="transformers experts_implementation: eager | grouped_mm | batched_mm (default: transformers' choice)")
    ap.add_argument("--attn-impl", default="sdpa", help="attn_implementation: sdpa (default) | eager")


def config_dict(args) -> dict:
    """The exact Qwen3MoeConfig kwargs (also printed for the JAX side)."""
    return dict(
        model_type="qwen3_moe",
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        moe_intermediate_size=args.moe_intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        num_experts=args.experts,
        num_experts_per_tok=args.topk,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        output_router_logits=False,  # no aux loss in the loss
        attention_bias=False,
        hidden_act="silu",
    )


def build_model(args, weights: str | None = None):
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(args.seed)
    kw = {"attn_implementation": args.attn_impl}
    if args.experts_impl:
        kw["experts_implementation"] = args.experts_impl
    if weights:
        model = AutoModelForCausalLM.from_pretrained(weights, dtype=torch.float32, **kw)
    else:
        cd = config_dict(args)
        cd.pop("model_type")
        theta = cd.pop("rope_theta")
        cfg = Qwen3MoeConfig(rope_parameters={"rope_type": "default", "rope_theta": theta},
                             bos_token_id=None, eos_token_id=None, pad_token_id=None, **cd)
        for k, v in kw.items():
            setattr(cfg, "_" + k, v)
        model = Qwen3MoeForCausalLM(cfg).to(torch.float32)
    return model


def implementations(model) -> dict:
    cfg = model.config
    return {"attn": getattr(cfg, "_attn_implementation", None),
            "experts": getattr(cfg, "_experts_implementation", None)}


def median(xs):
    return statistics.median(xs) if xs else float("nan")
