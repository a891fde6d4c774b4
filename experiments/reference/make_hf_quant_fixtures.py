"""Builds tiny quantized DeepSeek-V3 / Kimi-shaped checkpoints + reference logits for c2jax tests.

Runs in the PyTorch reference environment (setup_ref_env.sh, with compressed-tensors):

    .venv-ref/bin/python experiments/reference/make_hf_quant_fixtures.py [--out tests/fixtures/hf]

deepseek_v3_tiny_fp8_mtp: DeepSeek-V3 format. Every Linear `*_proj.weight` of the decoder layers
  and of the MTP layer (not the router, embeddings, head, norms or eh_proj) is float8_e4m3fn with a
  float32 `weight_scale_inv` per 128x128 block (DeepSeek's rule: scale = amax / 448, q = w / scale;
  edge blocks partial); other tensors bfloat16. One MTP layer (model.layers.<num_hidden_layers>.*)
  with copies of the embedding, head and final norm (shared_head.norm = model.norm).
kimi_k25_tiny_int4: Kimi K2.5 format. A `kimi_k25` config wrapping the DeepSeek-V3 text model
  (text_config) and a vision tower; tensors under `language_model.`, plus a few `vision_tower.` /
  `mm_projector.` tensors. Routed experts pack-quantized with compressed-tensors' own quantize and
  pack_to_int32 (int4, symmetric, group 32, bfloat16 scales); everything else bfloat16.

Reference logits: transformers' DeepseekV3ForCausalLM (float32, CPU) running on the dequantized
weights (fp8: float32(q) * scale_inv per block; int4: q * scale in float32), loaded with
from_pretrained from a float32 copy of them. transformers' own fp8 / compressed-tensors loaders are
not used: the fp8 one targets GPUs, and both would run other kernels than a float reference.
MTP reference: the hidden state after the last decoder layer (before model.norm), then
eh_proj(concat(enorm(embed(token at t+1)), hnorm(h))) -> DeepseekV3DecoderLayer(layer_idx =
num_hidden_layers) -> shared_head.norm -> lm_head; the token after the last is 0.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import sys
import tempfile

import numpy as np
import torch
import transformers
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3ForCausalLM
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

sys.path.insert(0, os.path.dirname(__file__))
from make_hf_fixtures import BATCH, SEED, SEQ, VOCAB, deepseek_v3_config, reinit_  # noqa: E402

FP8_WEIGHTS = re.compile(r"\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj|gate_proj|up_proj|down_proj)\.weight$")
INT4_WEIGHTS = re.compile(r"\.mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)\.weight$")
BLOCK = 128
INT4_ARGS = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32)


def fp8_block_quantize(w: torch.Tensor):
    """DeepSeek-V3's weight quantization: per 128x128 block, s = amax / 448, q = fp8(w / s)."""
    R, C = w.shape
    nr, nc = math.ceil(R / BLOCK), math.ceil(C / BLOCK)
    s = torch.zeros(nr, nc, dtype=torch.float32)
    q = torch.empty(R, C, dtype=torch.float8_e4m3fn)
    for i in range(nr):
        for j in range(nc):
            blk = w[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK].float()
            s[i, j] = blk.abs().max() / 448.0
            q[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] = (blk / s[i, j]).to(torch.float8_e4m3fn)
    return q, s


def fp8_block_dequantize(q, s):
    """float32(q) * s with s expanded over its 128x128 block (edge blocks cropped)."""
    R, C = q.shape
    full = s.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:R, :C]
    return q.float() * full


def int4_quantize(w: torch.Tensor):
    """compressed-tensors' min-max symmetric group quantization: bf16 scale = amax / 7.5 per group
    of 32 inputs, its quantize() to int8 values in [-8, 7], its pack_to_int32."""
    R, C = w.shape
    amax = w.float().reshape(R, C // 32, 32).abs().amax(-1)
    scale = (amax / 7.5).to(torch.bfloat16)
    zp = torch.zeros_like(scale, dtype=torch.int8)
    q = quantize(w.float(), scale, zp, INT4_ARGS, dtype=torch.int8)
    return pack_to_int32(q, 4), scale, q


def legacy_state(model_or_layer, prefix="") -> dict[str, torch.Tensor]:
    """State dict in the on-disk per-expert layout (experts.gate_up_proj split, gate first)."""
    out = {}
    for k, v in model_or_layer.state_dict().items():
        m = re.match(r"(.*mlp\.experts)\.(gate_up_proj|down_proj)$", k)
        if not m:
            out[prefix + k] = v.detach().clone()
            continue
        for e in range(v.shape[0]):
            if m.group(2) == "down_proj":
                out[f"{prefix}{m.group(1)}.{e}.down_proj.weight"] = v[e].clone()
            else:
                F = v.shape[1] // 2
                out[f"{prefix}{m.group(1)}.{e}.gate_proj.weight"] = v[e, :F].clone()
                out[f"{prefix}{m.group(1)}.{e}.up_proj.weight"] = v[e, F:].clone()
    return out


def quantize_state(state, kind):
    """(on-disk tensors, dequantized float32 tensors) for fp8 / int4."""
    disk, deq, extra = {}, {}, {}
    for k, v in state.items():
        if kind == "fp8" and FP8_WEIGHTS.search(k):
            q, s = fp8_block_quantize(v)
            disk[k], disk[k + "_scale_inv"] = q, s
            deq[k] = fp8_block_dequantize(q, s)
        elif kind == "int4" and INT4_WEIGHTS.search(k):
            packed, scale, q = int4_quantize(v)
            base = k.removesuffix("weight")
            disk[base + "weight_packed"], disk[base + "weight_scale"] = packed, scale
            disk[base + "weight_shape"] = torch.tensor(list(v.shape), dtype=torch.int32)
            deq[k] = q.float() * scale.float().repeat_interleave(32, 1)
            if not extra:  # compressed-tensors' own bf16 decompression of one expert, for the loader's bf16 path
                extra = {"ct_name": k, "ct_dequant_bf16": dequantize(q, scale, None, INT4_ARGS, dtype=torch.bfloat16)
                         .float().numpy()}
        else:
            disk[k] = v.to(torch.bfloat16)
            deq[k] = disk[k].float()
    return disk, deq, extra


def mtp_logits(model, mtp, ids_t):
    """The MTP head's logits (depth 1) from the main model's last hidden state."""
    captured = {}
    h = model.model.layers[-1].register_forward_hook(lambda m, i, o: captured.__setitem__("h", o[0] if isinstance(o, tuple) else o))
    with torch.no_grad():
        model(ids_t)
    h.remove()
    ahead = torch.cat([ids_t[:, 1:], torch.zeros_like(ids_t[:, :1])], 1)
    with torch.no_grad():
        e = model.model.embed_tokens(ahead)
        x = mtp["eh_proj"](torch.cat([mtp["enorm"](e), mtp["hnorm"](captured["h"])], -1))
        pos = torch.arange(ids_t.shape[1])[None].expand(ids_t.shape[0], -1)
        x = mtp["layer"](x, attention_mask=None, position_ids=pos,
                         position_embeddings=model.model.rotary_emb(x, pos))
        return model.lm_head(mtp["shared_norm"](x)).float().numpy()


def build(name, out_root):
    torch.manual_seed(SEED)
    gen = torch.Generator().manual_seed(SEED)
    if name == "deepseek_v3_tiny_fp8_mtp":
        # intermediate 160 and 8 heads x 24 give matrices wider than one 128 block (partial edges).
        cfg = deepseek_v3_config(num_hidden_layers=3, first_k_dense_replace=1, intermediate_size=160,
                                 num_attention_heads=8, num_key_value_heads=8, num_nextn_predict_layers=1)
        kind, prefix = "fp8", ""
    else:
        cfg = deepseek_v3_config(num_hidden_layers=3, first_k_dense_replace=1, num_experts_per_tok=4,
                                 n_routed_experts=8, n_group=1, topk_group=1)
        kind, prefix = "int4", "language_model."
    model = DeepseekV3ForCausalLM(cfg).to(torch.float32).eval()
    reinit_(model, gen)
    state = legacy_state(model)
    mtp = None
    if kind == "fp8":
        n = cfg.num_hidden_layers
        mtp = {"layer": DeepseekV3DecoderLayer(cfg, layer_idx=n).float().eval(),
               "enorm": DeepseekV3RMSNorm(cfg.hidden_size, cfg.rms_norm_eps),
               "hnorm": DeepseekV3RMSNorm(cfg.hidden_size, cfg.rms_norm_eps),
               "eh_proj": torch.nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False),
               "shared_norm": DeepseekV3RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)}
        for k in ("layer", "enorm", "hnorm", "eh_proj"):
            reinit_(mtp[k], gen)
        mtp["shared_norm"].load_state_dict({"weight": model.model.norm.weight.detach().clone()})
        state.update(legacy_state(mtp["layer"], f"model.layers.{n}."))
        for k in ("enorm", "hnorm", "eh_proj"):
            state[f"model.layers.{n}.{k}.weight"] = mtp[k].weight.detach().clone()
        state[f"model.layers.{n}.shared_head.norm.weight"] = model.model.norm.weight.detach().clone()
        state[f"model.layers.{n}.shared_head.head.weight"] = model.lm_head.weight.detach().clone()
        state[f"model.layers.{n}.embed_tokens.weight"] = model.model.embed_tokens.weight.detach().clone()
    disk, deq, extra = quantize_state(state, kind)

    # The float model on the dequantized weights: from_pretrained of a float32 legacy-layout copy.
    with tempfile.TemporaryDirectory() as tmp:
        cfg.save_pretrained(tmp)
        main = {k: v.contiguous() for k, v in deq.items() if not k.startswith(f"model.layers.{cfg.num_hidden_layers}.")}
        save_file(main, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        ref, info = DeepseekV3ForCausalLM.from_pretrained(tmp, dtype=torch.float32, output_loading_info=True)
        ref.eval()
        assert not any(info.values()), f"from_pretrained did not load every weight: {info}"
    rng = np.random.default_rng(SEED + 7)
    input_ids = rng.integers(0, VOCAB, size=(BATCH, SEQ)).astype(np.int32)
    ids_t = torch.from_numpy(input_ids.astype(np.int64))
    with torch.no_grad():
        logits = ref(ids_t).logits.float().numpy()
    arrays = {"input_ids": input_ids, "logits": logits}
    if mtp is not None:
        n = cfg.num_hidden_layers
        layer_deq = {k[len(f"model.layers.{n}."):]: v for k, v in deq.items() if k.startswith(f"model.layers.{n}.")}
        with tempfile.TemporaryDirectory() as tmp:  # fused expert layout for the layer: via a 1-layer model
            fused = {}
            for k, v in layer_deq.items():
                m = re.match(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$", k)
                if not m:
                    fused[k] = v
            E = cfg.n_routed_experts
            fused["mlp.experts.gate_up_proj"] = torch.stack(
                [torch.cat([layer_deq[f"mlp.experts.{e}.gate_proj.weight"], layer_deq[f"mlp.experts.{e}.up_proj.weight"]])
                 for e in range(E)])
            fused["mlp.experts.down_proj"] = torch.stack([layer_deq[f"mlp.experts.{e}.down_proj.weight"] for e in range(E)])
            layer_keys = set(mtp["layer"].state_dict())
            mtp["layer"].load_state_dict({k: v for k, v in fused.items() if k in layer_keys}, strict=True)
        for k in ("enorm", "hnorm", "eh_proj"):
            mtp[k].load_state_dict({"weight": layer_deq[f"{k}.weight"]})
        mtp["shared_norm"].load_state_dict({"weight": layer_deq["shared_head.norm.weight"]})
        arrays["mtp_logits"] = mtp_logits(ref, mtp, ids_t)[None]   # [depth, B, L, V]
    if extra:
        arrays["ct_dequant_bf16"] = extra["ct_dequant_bf16"]
    d = os.path.join(out_root, name)
    if os.path.isdir(d):
        shutil.rmtree(d)
    os.makedirs(d)
    hf = cfg.to_dict()
    hf["dtype"] = "bfloat16"
    if kind == "fp8":
        hf["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [BLOCK, BLOCK]}
    else:
        hf = {"model_type": "kimi_k25", "architectures": ["KimiK25ForConditionalGeneration"],
              "text_config": hf, "vision_config": {"model_type": "kimi_k25_vision", "patch_size": 14,
                                                   "hidden_size": 16},
              "quantization_config": {
                  "quant_method": "compressed-tensors", "format": "pack-quantized",
                  "quantization_status": "compressed", "kv_cache_scheme": None,
                  "config_groups": {"group_0": {"targets": ["Linear"], "format": "pack-quantized",
                                                "input_activations": None, "output_activations": None,
                                                "weights": INT4_ARGS.model_dump(mode="json")}},
                  "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|down)_proj$",
                             "re:vision_tower.*", "re:mm_projector.*"]}}
        g = torch.Generator().manual_seed(SEED + 1)
        for k, shape in (("vision_tower.patch_embed.proj.weight", (16, 3, 2, 2)),
                         ("vision_tower.encoder.blocks.0.attn.qkv.weight", (48, 16)),
                         ("mm_projector.proj.0.weight", (64, 16)), ("mm_projector.proj.0.bias", (64,))):
            disk[k] = (torch.randn(shape, generator=g) * 0.1).to(torch.bfloat16)
        disk = {(k if k.startswith(("vision_tower.", "mm_projector.")) else prefix + k): v for k, v in disk.items()}
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(hf, f, indent=2, sort_keys=True)
    save_file({k: v.contiguous() for k, v in disk.items()}, os.path.join(d, "model.safetensors"),
              metadata={"format": "pt"})
    np.savez(os.path.join(d, "reference.npz"), **arrays)
    with open(os.path.join(d, "keys.txt"), "w") as fh:
        fh.write("# on-disk tensor name <TAB> dtype <TAB> shape\n")
        fh.write("\n".join(f"{k}\t{str(v.dtype).removeprefix('torch.')}\t{list(v.shape)}" for k, v in sorted(disk.items())) + "\n")
    reread = load_file(os.path.join(d, "model.safetensors"))
    exact = all(torch.equal(reread[k].view(torch.uint8), disk[k].contiguous().view(torch.uint8))
                if disk[k].dtype == torch.float8_e4m3fn else torch.equal(reread[k], disk[k]) for k in disk)
    return {"name": name, "bytes": sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d)),
            "tensors": len(disk), "logits_std": float(logits.std()), "reread_exact": exact,
            "mtp_logits_std": float(arrays["mtp_logits"].std()) if "mtp_logits" in arrays else None}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "..", "tests", "fixtures", "hf"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    ok = True
    for name in ("deepseek_v3_tiny_fp8_mtp", "kimi_k25_tiny_int4"):
        info = build(name, os.path.abspath(args.out))
        print(json.dumps(info))
        ok &= info["reread_exact"] and info["bytes"] < 1 << 20
    import compressed_tensors
    print(json.dumps({"torch": torch.__version__, "transformers": transformers.__version__,
                      "compressed_tensors": compressed_tensors.__version__, "ok": ok}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
