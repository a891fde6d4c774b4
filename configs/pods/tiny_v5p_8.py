"""CI pod config: the tiny MLA MoE model on a v5p:2x2x2 slice (8 chips) with every parallelism on:
FSDP over fsdp x context, CP 2 (zigzag, MLA latent all-gather), EP 4 from data x context.
`python -m c2jax compile-check --config configs/pods/tiny_v5p_8.py` runs in about a minute on a CPU;
`configs/pods/tiny_v5p_8.py:gqa` is the same with grouped-query attention (CP all-gather);
`configs/pods/tiny_v5p_8.py:rl` is the MLA model as an RL pod: compile-check also compiles the RL
learner step (reference forward, router replay) and the learner -> sampler reshard onto the
sampler's mesh (rl.sampler_mesh_shape, the same 8 chips)."""
import ml_collections

from c2jax.config import default_config, merge_into_defaults

SAMPLER_MESH = (2, 1, 1, 4)     # decode: data 2 x expert 4 (rows over both, experts over data)


def pod_rl(cfg, sampler_mesh, sampler_slots: int) -> None:
    """The `rl` fields an RL pod config sets: the reference forward on (kl_coef > 0), no
    metrics-only no-replay forward, the sampler on its own mesh of the same chips, receiving bf16
    weights; compile-check compiles the learner step and the reshard (pod.compile_rl)."""
    cfg.rl.kl_coef = 1e-3
    cfg.rl.noreplay_metrics = False
    cfg.rl.router_replay = True
    cfg.rl.sampler_mesh_shape = tuple(sampler_mesh)
    cfg.rl.sampler_slots = sampler_slots
    cfg.rl.sync_dtype = "bfloat16"
    cfg.pod.compile_rl = True
    cfg.model.num_mtp_layers = 1        # the report's RL learner distils an MTP head (under CP here)


def get_config(arg=None):
    if arg not in (None, "", "mla", "gqa", "rl"):
        raise ValueError(f"tiny_v5p_8 variants: 'mla' (default), 'gqa' or 'rl', got {arg!r}")
    attention = "mla" if arg in (None, "", "rl") else arg
    cfg = merge_into_defaults({
        "model.name": f"tiny_{attention}" + ("_rl" if arg == "rl" else ""), "model.attention": attention,
        "model.moe_dispatch": "dropless",
        "model.dtype": "bfloat16", "model.num_layers": 2, "model.first_k_dense": 1,
        "mesh.shape": (2, 2, 2, 1),
        "train.batch_size": 8, "train.seq_len": 256,
    }, default_config())
    cfg.mesh.rules = tuple((n, {"embed": ("fsdp", "context"), "experts": ("data", "context"),
                                "batch": ("data", "fsdp", "expert")}.get(n, t)) for n, t in cfg.mesh.rules)
    cfg.pod = ml_collections.ConfigDict({"topology": "v5p:2x2x2", "decode_batch": 8, "decode_len": 512,
                                         "decode_mesh_shape": SAMPLER_MESH, "hbm_headroom": 0.9,
                                         "compile_decode": True, "compile_rl": False})
    if arg == "rl":
        cfg.pod.decode_mesh_shape = ()      # the sampler's mesh is rl.sampler_mesh_shape
        pod_rl(cfg, SAMPLER_MESH, cfg.pod.decode_batch)
    return cfg
