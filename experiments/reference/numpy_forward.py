"""Pure-numpy forward of the HF fixtures, written only from tests/fixtures/hf/NOTES.md.

It proves the notes are complete: reading config.json + the on-disk safetensors (legacy
per-expert keys) and following the notes reproduces reference.npz. No torch; needs numpy and
safetensors only, so it also runs in the JAX environment and can serve as a readable oracle.

    python experiments/reference/numpy_forward.py tests/fixtures/hf/*/

Prints one JSON line per directory with the max abs diff to reference.npz (exit 1 if > 1e-4).
Shape letters: B batch, L length, D model dim, H heads, K head dim, E experts, V vocab.
"""

from __future__ import annotations

import json
import math
import os
import sys

import numpy as np
from safetensors.numpy import load_file


def load_weights(d: str) -> dict[str, np.ndarray]:
    w = {}
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors"):
            w.update(load_file(os.path.join(d, f)))
    return {k: v.astype(np.float64) for k, v in w.items()}  # f64 oracle


def rope_params(cfg: dict) -> dict:
    """Accepts both the 5.x `rope_parameters` form and the legacy rope_theta + rope_scaling form."""
    rp = dict(cfg.get("rope_parameters") or {})
    if not rp:
        rp = dict(cfg.get("rope_scaling") or {})
        rp["rope_theta"] = cfg.get("rope_theta", 10000.0)
    rp.setdefault("rope_type", rp.get("type", "default"))
    return rp


def inv_freq_and_factor(rp: dict, dim: int, max_pos: int) -> tuple[np.ndarray, float]:
    base = rp["rope_theta"]
    idx = np.arange(0, dim, 2, dtype=np.float64) / dim
    if rp["rope_type"] == "default":
        return 1.0 / base**idx, 1.0
    assert rp["rope_type"] == "yarn", rp
    factor = rp.get("factor") or max_pos / rp["original_max_position_embeddings"]
    orig = rp["original_max_position_embeddings"]

    def get_mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    att = rp.get("attention_factor")
    if att is None:
        m, mad = rp.get("mscale"), rp.get("mscale_all_dim")
        att = get_mscale(factor, m) / get_mscale(factor, mad) if (m and mad) else get_mscale(factor)
    beta_fast = rp.get("beta_fast") or 32
    beta_slow = rp.get("beta_slow") or 1

    def corr_dim(rot):
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if rp.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extra = 1 - ramp
    pos = base**idx
    inv = (1.0 / (factor * pos)) * (1 - extra) + (1.0 / pos) * extra
    return inv, float(att)


def rms(x, w, eps):
    return w * (x / np.sqrt((x * x).mean(-1, keepdims=True) + eps))


def silu(x):
    return x / (1 + np.exp(-x))


def lin(x, w):  # torch Linear: weight [out, in]
    return x @ w.T


def rope_rotate_half(x, cos, sin):  # x [..., L, K], cos/sin [L, K/2]
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def rope_interleaved(x, cos, sin):  # pairs (2i, 2i+1); output de-interleaved like HF
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def causal_attention(q_BHLK, k_BHLK, v_BHLK, scale):
    s = np.einsum("bhqk,bhsk->bhqs", q_BHLK, k_BHLK) * scale
    L = s.shape[-1]
    s = np.where(np.tril(np.ones((L, L), bool)), s, -np.inf)
    s = np.exp(s - s.max(-1, keepdims=True))
    p = s / s.sum(-1, keepdims=True)
    return np.einsum("bhqs,bhsk->bhqk", p, v_BHLK)


def swiglu(x, w, p):
    return lin(silu(lin(x, w[p + "gate_proj.weight"])) * lin(x, w[p + "up_proj.weight"]), w[p + "down_proj.weight"])


def experts(x_TD, w, p, idx_TK, wt_TK):
    out = np.zeros_like(x_TD)
    for t in range(x_TD.shape[0]):
        for j in range(idx_TK.shape[1]):
            out[t] += wt_TK[t, j] * swiglu(x_TD[t : t + 1], w, f"{p}experts.{idx_TK[t, j]}.")[0]
    return out


def topk_idx(s, k):  # indices of the k largest per row (set semantics; order irrelevant)
    return np.argsort(-s, axis=-1, kind="stable")[:, :k]


def qwen3_moe(cfg, w, ids):
    D, H, KV = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    K = cfg.get("head_dim") or D // H
    E = cfg.get("num_experts") or cfg.get("num_local_experts")
    eps = cfg["rms_norm_eps"]
    B, L = ids.shape
    inv, att = inv_freq_and_factor(rope_params(cfg), K, cfg["max_position_embeddings"])
    ang = np.arange(L)[:, None] * inv[None]
    cos, sin = np.cos(ang) * att, np.sin(ang) * att
    x = w["model.embed_tokens.weight"][ids]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms(x, w[p + "input_layernorm.weight"], eps)
        q = lin(h, w[p + "self_attn.q_proj.weight"]).reshape(B, L, H, K)
        k = lin(h, w[p + "self_attn.k_proj.weight"]).reshape(B, L, KV, K)
        v = lin(h, w[p + "self_attn.v_proj.weight"]).reshape(B, L, KV, K)
        q = rms(q, w[p + "self_attn.q_norm.weight"], eps).transpose(0, 2, 1, 3)
        k = rms(k, w[p + "self_attn.k_norm.weight"], eps).transpose(0, 2, 1, 3)
        v = v.transpose(0, 2, 1, 3)
        q, k = rope_rotate_half(q, cos, sin), rope_rotate_half(k, cos, sin)
        rep = H // KV
        k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)  # head h -> kv head h // rep
        o = causal_attention(q, k, v, K**-0.5).transpose(0, 2, 1, 3).reshape(B, L, H * K)
        x = x + lin(o, w[p + "self_attn.o_proj.weight"])
        h = rms(x, w[p + "post_attention_layernorm.weight"], eps)
        is_moe = i not in cfg.get("mlp_only_layers", []) and E > 0 and (i + 1) % cfg.get("decoder_sparse_step", 1) == 0
        if is_moe:
            t = h.reshape(-1, D)
            logits = lin(t, w[p + "mlp.gate.weight"])
            pr = np.exp(logits - logits.max(-1, keepdims=True))
            pr /= pr.sum(-1, keepdims=True)
            idx = topk_idx(pr, cfg["num_experts_per_tok"])
            wt = np.take_along_axis(pr, idx, -1)
            if cfg.get("norm_topk_prob"):
                wt = wt / wt.sum(-1, keepdims=True)
            x = x + experts(t, w, p + "mlp.", idx, wt).reshape(B, L, D)
        else:
            x = x + swiglu(h, w, p + "mlp.")
    x = rms(x, w["model.norm.weight"], eps)
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return lin(x, head)


def deepseek_v3(cfg, w, ids):
    D, H, eps = cfg["hidden_size"], cfg["num_attention_heads"], cfg["rms_norm_eps"]
    nope, rd, vd, C = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"], cfg["kv_lora_rank"]
    E, k_top, G, TG = cfg["n_routed_experts"], cfg["num_experts_per_tok"], cfg["n_group"], cfg["topk_group"]
    B, L = ids.shape
    rp = rope_params(cfg)
    inv, att = inv_freq_and_factor(rp, rd, cfg["max_position_embeddings"])
    ang = np.arange(L)[:, None] * inv[None]
    cos, sin = np.cos(ang) * att, np.sin(ang) * att
    scale = (nope + rd) ** -0.5
    if rp["rope_type"] != "default" and rp.get("mscale_all_dim"):
        m = 1.0 if rp["factor"] <= 1 else 0.1 * rp["mscale_all_dim"] * math.log(rp["factor"]) + 1.0
        scale *= m * m
    rope = rope_interleaved if cfg.get("rope_interleave", True) else rope_rotate_half
    x = w["model.embed_tokens.weight"][ids]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        h = rms(x, w[p + "input_layernorm.weight"], eps)
        if cfg.get("q_lora_rank") is None:
            q = lin(h, w[a + "q_proj.weight"])
        else:  # q_a_layernorm eps is the RMSNorm default 1e-6, not rms_norm_eps
            q = lin(rms(lin(h, w[a + "q_a_proj.weight"]), w[a + "q_a_layernorm.weight"], 1e-6), w[a + "q_b_proj.weight"])
        q = q.reshape(B, L, H, nope + rd).transpose(0, 2, 1, 3)
        q_pass, q_rot = q[..., :nope], q[..., nope:]
        ckv = lin(h, w[a + "kv_a_proj_with_mqa.weight"])
        lat, k_rot = rms(ckv[..., :C], w[a + "kv_a_layernorm.weight"], 1e-6), ckv[..., C:]
        q_rot = rope(q_rot, cos, sin)
        k_rot = rope(k_rot[:, None], cos, sin)  # [B, 1, L, rd]
        kv = lin(lat, w[a + "kv_b_proj.weight"]).reshape(B, L, H, nope + vd).transpose(0, 2, 1, 3)
        k_nope, v = kv[..., :nope], kv[..., nope:]
        qf = np.concatenate([q_pass, q_rot], -1)
        kf = np.concatenate([k_nope, np.broadcast_to(k_rot, (B, H, L, rd))], -1)
        o = causal_attention(qf, kf, v, scale).transpose(0, 2, 1, 3).reshape(B, L, H * vd)
        x = x + lin(o, w[a + "o_proj.weight"])
        h = rms(x, w[p + "post_attention_layernorm.weight"], eps)
        if i >= cfg["first_k_dense_replace"]:
            t = h.reshape(-1, D)
            s = 1 / (1 + np.exp(-lin(t, w[p + "mlp.gate.weight"])))
            sc = s + w[p + "mlp.gate.e_score_correction_bias"]
            gs = np.sort(sc.reshape(-1, G, E // G), -1)[..., -2:].sum(-1)
            gidx = topk_idx(gs, TG)
            gmask = np.zeros_like(gs, bool)
            np.put_along_axis(gmask, gidx, True, -1)
            sc = np.where(np.repeat(gmask, E // G, -1), sc, -np.inf)
            idx = topk_idx(sc, k_top)
            wt = np.take_along_axis(s, idx, -1)
            if cfg.get("norm_topk_prob"):
                wt = wt / (wt.sum(-1, keepdims=True) + 1e-20)
            wt = wt * cfg["routed_scaling_factor"]
            y = experts(t, w, p + "mlp.", idx, wt) + swiglu(t, w, p + "mlp.shared_experts.")
            x = x + y.reshape(B, L, D)
        else:
            x = x + swiglu(h, w, p + "mlp.")
    x = rms(x, w["model.norm.weight"], eps)
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return lin(x, head)


def main(dirs) -> int:
    ok = True
    for d in dirs:
        cfg = json.load(open(os.path.join(d, "config.json")))
        ref = np.load(os.path.join(d, "reference.npz"))
        w = load_weights(d)
        fn = {"qwen3_moe": qwen3_moe, "deepseek_v3": deepseek_v3}[cfg["model_type"]]
        logits = fn(cfg, w, ref["input_ids"].astype(np.int64))
        diff = float(np.abs(logits - ref["logits"]).max())
        ok &= diff <= 1e-4
        print(json.dumps({"dir": d, "model_type": cfg["model_type"], "max_abs_diff": diff}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
