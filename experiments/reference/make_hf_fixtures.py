"""Builds tiny random-weight Hugging Face MoE checkpoints + reference logits for c2jax tests.

Runs in the PyTorch reference environment (see setup_ref_env.sh), never in the JAX tests:

    .venv-ref/bin/python experiments/reference/make_hf_fixtures.py [--out tests/fixtures/hf]

For each fixture it writes `<out>/<name>/` with `config.json`, safetensors weights (on-disk legacy
per-expert layout, as `save_pretrained` writes by default), `reference.npz` (`input_ids` int32
[2, 24], `logits` float32 [2, 24, V] from a plain causal forward with no attention mask) and
`keys.txt` (every tensor stored on disk: name, dtype, shape). It then reloads each directory with
`from_pretrained` and checks the logits agree.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

import numpy as np
import torch
import transformers
from safetensors import safe_open
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

SEED = 1234
VOCAB = 256
BATCH, SEQ = 2, 24
INIT_STD = 0.1
BIAS_STD = 0.1


def qwen3_moe_config(**overrides) -> Qwen3MoeConfig:
    kw = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[0],
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        max_position_embeddings=256,
        tie_word_embeddings=False,
        initializer_range=INIT_STD,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    kw.update(overrides)
    return Qwen3MoeConfig(**kw)


def deepseek_v3_config(**overrides) -> DeepseekV3Config:
    kw = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        first_k_dense_replace=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        max_position_embeddings=256,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        initializer_range=INIT_STD,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    kw.update(overrides)
    return DeepseekV3Config(**kw)


FIXTURES = {
    # name: (model class, config factory, save kwargs, description)
    "qwen3_moe_tiny": (
        Qwen3MoeForCausalLM,
        lambda: qwen3_moe_config(),
        {},
        "Qwen3-MoE, 3 layers (layer 0 dense via mlp_only_layers=[0]), 8 experts top-2, norm_topk_prob=True, untied lm_head, single file.",
    ),
    "qwen3_moe_tiny_nonorm": (
        Qwen3MoeForCausalLM,
        lambda: qwen3_moe_config(norm_topk_prob=False, mlp_only_layers=[], tie_word_embeddings=True,
                                 num_hidden_layers=2),
        {"max_shard_size": "200KB"},
        "Qwen3-MoE, 2 layers, both MoE (mlp_only_layers=[]), norm_topk_prob=False, tied embeddings (no lm_head.weight on disk), SHARDED with model.safetensors.index.json.",
    ),
    "deepseek_v3_tiny": (
        DeepseekV3ForCausalLM,
        lambda: deepseek_v3_config(),
        {},
        "DeepSeek-V3, 4 layers (first 2 dense), MLA with q_lora_rank=32, YaRN factor 4 (mscale=mscale_all_dim=1), interleaved rope, 8 experts in 4 groups (topk_group 2) top-2 + 1 shared, scale 2.5, random non-zero e_score_correction_bias.",
    ),
    "deepseek_v3_tiny_noqlora": (
        DeepseekV3ForCausalLM,
        lambda: deepseek_v3_config(
            q_lora_rank=None, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            n_group=1, topk_group=1, first_k_dense_replace=1, num_hidden_layers=2,
        ),
        {},
        "DeepSeek-V3, 2 layers (first 1 dense), direct q_proj (q_lora_rank=None), default rope (no YaRN), n_group=1, random non-zero e_score_correction_bias.",
    ),
}


def reinit_(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Re-initialise every parameter with a larger std so logits are not flat.

    Matrices/3-D expert tensors: normal * INIT_STD. Norm weights: 1 + 0.1 * normal (so a JAX port
    that forgets a norm weight fails). Router bias buffers: normal * BIAS_STD (exercise selection bias while the
    scores still matter: roughly half of the tokens change their expert set).
    """
    with torch.no_grad():
        for _name, p in model.named_parameters():
            if p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * INIT_STD)
            else:  # RMSNorm weights
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=gen) * BIAS_STD)


def routing_bias_effect(model, input_ids) -> dict:
    """Fraction of (token, layer) whose chosen expert set changes when the bias is zeroed."""
    gates = [m for n, m in model.named_modules() if type(m).__name__ == "DeepseekV3TopkRouter"]
    captured = {}
    hooks = [g.register_forward_hook(lambda m, i, o, k=id(g): captured.__setitem__(k, (i[0].detach(), o[2]))) for g in gates]  # noqa: B008 (binds each gate's id)
    with torch.no_grad():
        model(input_ids)
    for h in hooks:
        h.remove()
    changed, total = 0, 0
    for g in gates:
        x, idx_biased = captured[id(g)]
        saved = g.e_score_correction_bias.clone()
        with torch.no_grad():
            g.e_score_correction_bias.zero_()
            _, _, idx_plain = g(x)
            g.e_score_correction_bias.copy_(saved)
        a = torch.sort(idx_biased, dim=-1).values
        b = torch.sort(idx_plain, dim=-1).values
        changed += int((a != b).any(dim=-1).sum())
        total += a.shape[0]
    return {"router_layers": len(gates), "tokens": total, "frac_topk_changed_by_bias": changed / max(total, 1)}


def dump_keys(directory: str) -> list[str]:
    lines = []
    for fname in sorted(f for f in os.listdir(directory) if f.endswith(".safetensors")):
        with safe_open(os.path.join(directory, fname), framework="pt") as f:
            for k in f.keys():
                sl = f.get_slice(k)
                lines.append(f"{k}\t{sl.get_dtype()}\t{list(sl.get_shape())}\t{fname}")
    lines.sort()
    with open(os.path.join(directory, "keys.txt"), "w") as fh:
        fh.write("# on-disk tensor name <TAB> dtype <TAB> shape <TAB> file\n")
        fh.write("\n".join(lines) + "\n")
    return lines


def build(name: str, out_root: str) -> dict:
    cls, make_cfg, save_kw, desc = FIXTURES[name]
    torch.manual_seed(SEED)
    gen = torch.Generator().manual_seed(SEED)
    cfg = make_cfg()
    model = cls(cfg).to(torch.float32).eval()
    reinit_(model, gen)
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(), "tie broken"

    rng = np.random.default_rng(SEED)
    input_ids = rng.integers(0, VOCAB, size=(BATCH, SEQ)).astype(np.int32)
    ids_t = torch.from_numpy(input_ids.astype(np.int64))
    with torch.no_grad():
        logits = model(ids_t).logits.float().numpy()

    d = os.path.join(out_root, name)
    if os.path.isdir(d):
        shutil.rmtree(d)
    model.save_pretrained(d, safe_serialization=True, **save_kw)
    np.savez(os.path.join(d, "reference.npz"), input_ids=input_ids, logits=logits.astype(np.float32))
    keys = dump_keys(d)

    # Reload and compare.
    re = cls.from_pretrained(d, dtype=torch.float32).eval()
    with torch.no_grad():
        logits2 = re(ids_t).logits.float().numpy()
    info = {
        "name": name,
        "params": sum(p.numel() for p in model.parameters()),
        "files": sorted(os.listdir(d)),
        "n_disk_tensors": len(keys),
        "logits_std": float(logits.std()),
        "reload_max_abs_diff": float(np.abs(logits - logits2).max()),
        "bytes": sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d)),
    }
    if cls is DeepseekV3ForCausalLM:
        info.update(routing_bias_effect(re, ids_t))
        with safe_open(os.path.join(d, "model.safetensors"), framework="pt") as f:
            biases = [k for k in f.keys() if k.endswith("e_score_correction_bias")]
            info["bias_keys_on_disk"] = len(biases)
            info["bias_abs_mean"] = float(np.mean([f.get_tensor(k).abs().mean().item() for k in biases]))
        info["attn_scaling"] = float(re.model.layers[0].self_attn.scaling)
        info["rope_attention_scaling"] = float(re.model.rotary_emb.attention_scaling)
        info["inv_freq"] = [float(x) for x in re.model.rotary_emb.inv_freq]
    return info, desc


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "..", "tests", "fixtures", "hf"))
    ap.add_argument("--only", nargs="*", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    ok = True
    total = 0
    for name in args.only or FIXTURES:
        info, _ = build(name, out)
        total += info["bytes"]
        print(json.dumps(info))
        if info["reload_max_abs_diff"] > 1e-5:
            ok = False
        if "bias_keys_on_disk" in info and (info["bias_keys_on_disk"] == 0 or info["frac_topk_changed_by_bias"] == 0):
            ok = False
    print(json.dumps({"torch": torch.__version__, "transformers": transformers.__version__,
                      "total_bytes": total, "ok": ok}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
