"""Kimi K2.5 (1.04T total / 32B active, Composer 2's backbone) on a TPU v5p-1024 slice
(topology v5p:8x8x8 = 512 chips, 95 GB HBM each). Why 512 chips: AdamW training keeps
f32 params + two f32 moments (12 B/param = 12.5 TB) plus f32 gradients (4.2 TB): ~16.6 TB, so
at least ~190 chips for state alone; 512 leaves room for activations.

Layouts (arg "cpt" or "rl", default "cpt"), after the report (section 6), with CP folded into
FSDP and EP built from data x context devices:
  cpt: CP 2; 8K-token rows, 256 rows (2M tokens) per step.
  rl:  CP 8; 32K-token rows, 64 rows (2M tokens) per step.
The report runs EP 8 on GPUs with ~2x the memory of a v5p chip; EP 8 here means 48 experts
(4.2 GB of bf16 expert weights per layer) gathered on each chip per layer, so both layouts use
EP 64 = data x context x expert (6 experts per chip and layer). Dense weights are FSDP-sharded
over fsdp x context x expert, expert weights over the EP axes (experts) x fsdp (expert_embed):
two shardings of the same chips. MLA's up-projections (no `embed` dim) are FSDP-sharded by
`heads`. Memory per chip (see the compile-check breakdown): f32 params 8.1 GiB + Adam moments
16.1 GiB (donated arguments) + f32 grads 8.1 GiB + activations: 61 bf16 residual checkpoints
(3.3 GiB for 4096 tokens per chip), one layer's rematerialized workspace (attention query
chunks, EP dispatch chunks), the output head ([7168, 163840] bf16 gathered; f32 logits one
chunk of the sequence at a time, model.head_chunks).

    python -m c2jax compile-check --config configs/pods/kimi_k2_1t.py:cpt --topology v5p:8x8x8

`:rl` also compiles the RL learner step (the CPT step plus the reference's forward, router replay)
and the learner -> sampler weight move onto the sampler's mesh (rl.sampler_mesh_shape). The step
holds the CPT step's memory plus the reference params in f32 (7.5 GiB per chip as an argument; the
reference's forward runs before the differentiated one and adds no workspace at the peak):
53.2 GiB per chip against the CPT step's 46.1 (experiments/results/pods/kimi_k2_1t_rl.json).
"""
import os

import ml_collections

from c2jax.config import default_config, load_config_file

_HERE = os.path.dirname(os.path.abspath(__file__))

LAYOUTS = {
    #       mesh (data, fsdp, context, expert), batch, seq, query chunk
    "cpt": ((8, 8, 2, 4), 256, 8192, 512),
    "rl": ((1, 8, 8, 8), 64, 32768, 256),
}


SAMPLER_MESH = (64, 8, 1, 1)   # decode: EP 64 over data (experts -> data), fsdp 8


def get_config(arg=None):
    layout = arg or "cpt"
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r}: choose one of {sorted(LAYOUTS)}")
    shape, batch, seq, chunk = LAYOUTS[layout]
    cfg = default_config()
    cfg.model = load_config_file(os.path.join(_HERE, "..", "kimi_k2_1t.py")).model
    cfg.model.name = f"kimi_k2_1t_{layout}"
    cfg.model.moe_dispatch = "dropless"
    cfg.model.remat = "full"
    # The MTP head (model.num_mtp_layers = 1, as the model has it) trains in every layout: under CP
    # its shifted tokens are gathered by position (transformer.mtp_shift), and its distillation
    # applies the output head in the same head_chunks pieces as the main loss.
    # output head + loss over the sequence in 8 rematerialized chunks: one chunk's f32 logits
    # (512 tokens x 163840 per chip) live at a time instead of 4096 tokens' (2.5 GiB)
    cfg.model.head_chunks = 8
    cfg.mesh.shape = shape
    cfg.mesh.attention_chunk = chunk
    cfg.mesh.ep_capacity_factor = 2.0
    # 4096 tokens x 8 experts per chip and layer: the EP send/receive rows at capacity 2.0 are
    # [64 peers x 1024, 7168] bf16 (0.9 GiB each, several live in the backward pass); dispatching
    # them in 4 chunks of 1024 tokens cuts that 4-fold (messages stay 0.2 GiB per all-to-all)
    cfg.mesh.ep_token_chunks = 4
    # `heads` too: MLA's q_b_proj [1536, 64*192] and kv_b_proj [512, 64*256] have no `embed` dim,
    # so without it they (and their f32 moments and grads) were replicated on every chip: 24 GiB
    cfg.mesh.rules = tuple((n, {"embed": ("fsdp", "context", "expert"), "heads": ("fsdp", "context", "expert"),
                                "experts": ("data", "context", "expert"), "expert_embed": "fsdp",
                                "batch": ("data", "fsdp", "expert")}.get(n, t)) for n, t in cfg.mesh.rules)
    cfg.train.batch_size, cfg.train.seq_len = batch, seq
    cfg.pod = ml_collections.ConfigDict({
        "topology": "v5p:8x8x8", "decode_batch": 512, "decode_len": 32768,
        "decode_mesh_shape": SAMPLER_MESH, "hbm_headroom": 0.9, "compile_decode": True, "compile_rl": False})
    if layout == "rl":
        # the RL pod: the learner step with the reference's forward (kl_coef > 0) and router
        # replay, no metrics-only no-replay forward; the sampler on SAMPLER_MESH over the same
        # chips, receiving bf16 weights (compile-check also compiles the learner -> sampler reshard)
        cfg.pod.decode_mesh_shape = ()        # the sampler's mesh is rl.sampler_mesh_shape
        cfg.rl.kl_coef = 1e-3
        cfg.rl.noreplay_metrics = False
        cfg.rl.router_replay = True
        cfg.rl.sampler_mesh_shape = SAMPLER_MESH
        cfg.rl.sampler_slots = cfg.pod.decode_batch
        cfg.rl.sync_dtype = "bfloat16"
        cfg.pod.compile_rl = True
    return cfg
