"""Qwen3-Coder-30B-A3B (the report's small-study model: GQA + QK-norm, 128 experts top-8) on a
TPU v5p-128 slice (topology v5p:4x4x4 = 64 chips). Why 64 chips: 30.5B params x 16 B of
training state = 0.5 TB, ~8 GB per chip, which leaves most of the 95 GB for 32K-token rows
(RL rollouts are long); it is the smallest v5p slice with a 3-D torus on every axis.

Layout: FSDP 8 x data 4 x CP 2, EP 8 = data 4 x context 2, 32K-token rows, 32 rows (1M tokens)
per step. CP all-gathers K/V and each rank runs the Pallas flash kernel on its zigzag queries
(O(L) memory); `:ring` rotates K/V blocks around the ring with XLA's online softmax instead.

    python -m c2jax compile-check --config configs/pods/qwen3_moe_30b_a3b.py --topology v5p:4x4x4
"""
import os

import ml_collections

from c2jax.config import default_config, load_config_file

_HERE = os.path.dirname(os.path.abspath(__file__))


def get_config(arg=None):
    cfg = default_config()
    cfg.model = load_config_file(os.path.join(_HERE, "..", "qwen3_moe_30b_a3b.py")).model
    cfg.model.moe_dispatch = "dropless"
    cfg.model.remat = "full"
    # output head + loss over the sequence in 8 rematerialized chunks: one chunk's f32 logits
    # (2048 of a chip's 16384 tokens x 151936) live at a time instead of all 16384 tokens'
    cfg.model.head_chunks = 8
    cfg.mesh.shape = (4, 8, 2, 1)
    if arg not in (None, "", "allgather", "ring"):
        raise ValueError(f"qwen3_moe_30b_a3b pod variants: 'allgather' (default) or 'ring', got {arg!r}")
    cfg.mesh.cp_impl = arg or "allgather"
    cfg.mesh.attention_chunk = 2048
    cfg.mesh.ep_capacity_factor = 2.0
    cfg.mesh.rules = tuple((n, {"embed": ("fsdp", "context"), "experts": ("data", "context"),
                                "expert_embed": "fsdp", "batch": ("data", "fsdp", "expert")}.get(n, t))
                           for n, t in cfg.mesh.rules)
    cfg.train.batch_size, cfg.train.seq_len = 32, 32768
    cfg.pod = ml_collections.ConfigDict({
        "topology": "v5p:4x4x4", "decode_batch": 256, "decode_len": 32768,
        "decode_mesh_shape": (8, 8, 1, 1), "hbm_headroom": 0.9, "compile_decode": True})
    return cfg
