"""CI pod config: the tiny MLA MoE model on a v5p:2x2x2 slice (8 chips) with every parallelism on:
FSDP over fsdp x context, CP 2 (zigzag, MLA latent all-gather), EP 4 from data x context.
`python -m c2jax compile-check --config configs/pods/tiny_v5p_8.py` runs in about a minute on a CPU;
`configs/pods/tiny_v5p_8.py:gqa` is the same with grouped-query attention (CP all-gather)."""
import ml_collections

from c2jax.config import default_config, merge_into_defaults


def get_config(arg=None):
    if arg not in (None, "", "mla", "gqa"):
        raise ValueError(f"tiny_v5p_8 variants: 'mla' (default) or 'gqa', got {arg!r}")
    attention = arg or "mla"
    cfg = merge_into_defaults({
        "model.name": f"tiny_{attention}", "model.attention": attention, "model.moe_dispatch": "dropless",
        "model.dtype": "bfloat16", "model.num_layers": 2, "model.first_k_dense": 1,
        "mesh.shape": (2, 2, 2, 1),
        "train.batch_size": 8, "train.seq_len": 256,
    }, default_config())
    cfg.mesh.rules = tuple((n, {"embed": ("fsdp", "context"), "experts": ("data", "context"),
                                "batch": ("data", "fsdp", "expert")}.get(n, t)) for n, t in cfg.mesh.rules)
    cfg.pod = ml_collections.ConfigDict({"topology": "v5p:2x2x2", "decode_batch": 8, "decode_len": 512,
                                         "decode_mesh_shape": (2, 1, 1, 4), "hbm_headroom": 0.9,
                                         "compile_decode": True})
    return cfg
