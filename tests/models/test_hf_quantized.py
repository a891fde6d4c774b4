"""Quantized HF checkpoints (fixtures made by experiments/reference/make_hf_quant_fixtures.py):
fp8 128x128-block DeepSeek-V3 weights with an MTP layer, Kimi K2.5's wrapper with pack-quantized
int4 experts. Logits match transformers on the same quantized weights; save in the same format
writes the quantized tensors back bit for bit; unknown formats are refused by name."""
import json
import os
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import c2jax
from c2jax.hf import CheckpointError, quant
from c2jax.hf.safetensors_io import SafetensorsFile, write_file

FIX = os.path.join(os.path.dirname(__file__), "..", "fixtures", "hf")
FP8, INT4 = "deepseek_v3_tiny_fp8_mtp", "kimi_k25_tiny_int4"


def _ref(name):
    with np.load(os.path.join(FIX, name, "reference.npz")) as z:
        return dict(z)


def _tensors(path):
    f = SafetensorsFile(os.path.join(path, "model.safetensors"))
    out = {k: f.read(k) for k in f.keys()}
    f.close()
    return out


@pytest.mark.parametrize("name", [FP8, INT4])
def test_logits_match_transformers(name):
    m, params = c2jax.hf.load(os.path.join(FIX, name))
    ref = _ref(name)
    out = c2jax.models.forward(m, params, ref["input_ids"], return_aux=True)
    np.testing.assert_allclose(np.asarray(out.logits), ref["logits"], atol=1e-4, rtol=0)
    if name == FP8:
        assert m.num_mtp_layers == 1
        # c2jax's depth-1 logits at t are the prediction made at t - 1 (aligned with the main head)
        np.testing.assert_allclose(np.asarray(out.aux["mtp_logits"])[:, :, 1:], ref["mtp_logits"][:, :, :-1],
                                   atol=1e-4, rtol=0)


def test_fixture_formats_are_what_they_claim():
    t = _tensors(os.path.join(FIX, FP8))
    w = t["model.layers.0.mlp.gate_proj.weight"]            # [160, 64]: two row blocks, the second partial
    assert w.dtype == quant.FP8 and t["model.layers.0.mlp.gate_proj.weight_scale_inv"].shape == (2, 1)
    assert t["model.layers.3.eh_proj.weight"].dtype == np.dtype(ml_dtypes.bfloat16)
    assert t["model.layers.3.mlp.experts.7.down_proj.weight"].dtype == quant.FP8   # the MTP layer's experts
    stats = {}
    m, _ = c2jax.hf.load(os.path.join(FIX, INT4), stats=stats)
    assert stats["wrapper"] == "kimi_k25" and stats["quant"] == "int4"
    assert stats["skipped"] == {"vision_tower": 2, "mm_projector": 2} and stats["unused"] == []
    t = _tensors(os.path.join(FIX, INT4))
    assert t["language_model.model.layers.1.mlp.experts.0.gate_proj.weight_packed"].dtype == np.int32
    assert t["language_model.model.layers.1.mlp.shared_experts.up_proj.weight"].dtype == np.dtype(ml_dtypes.bfloat16)


def test_int4_bf16_load_equals_compressed_tensors_decompression():
    """Loaded as bfloat16, an int4 expert is exactly compressed-tensors' own bf16 dequantize."""
    ref = _ref(INT4)
    m, params = c2jax.hf.load(os.path.join(FIX, INT4), dtype="bfloat16")
    # ct_name: model.layers.1.mlp.experts.0.gate_proj.weight = moe layer 0, expert 0, w_gate (transposed)
    ours = np.asarray(params["moe_layers"]["block"]["moe"]["w_gate"][0, 0]).astype(np.float32).T
    np.testing.assert_array_equal(ours, ref["ct_dequant_bf16"])


@pytest.mark.parametrize("name,fmt", [(FP8, "fp8"), (INT4, "int4")])
def test_save_in_same_format_is_bit_exact(name, fmt, tmp_path):
    src = os.path.join(FIX, name)
    m, params = c2jax.hf.load(src)
    c2jax.hf.save(m, params, str(tmp_path), quantize=fmt, dtype="bfloat16")
    prefix = "language_model." if name == INT4 else ""
    orig = {k[len(prefix):]: v for k, v in _tensors(src).items() if k.startswith(prefix)}
    ours = _tensors(str(tmp_path))
    assert sorted(ours) == sorted(orig)
    for k, v in orig.items():
        assert ours[k].dtype == v.dtype, k
        np.testing.assert_array_equal(ours[k].view(np.uint8), v.view(np.uint8), err_msg=k)
    m2, params2 = c2jax.hf.load(str(tmp_path))
    assert m2.num_mtp_layers == m.num_mtp_layers
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, params2)
    q = json.load(open(tmp_path / "config.json"))["quantization_config"]
    assert q["quant_method"] == ("fp8" if fmt == "fp8" else "compressed-tensors")


def test_fresh_params_quantize_and_reload(tmp_path):
    """Random float params -> fp8 / int4 files -> load: within the formats' error, and a second
    save of what was loaded reproduces the first files bit for bit."""
    m, params = c2jax.hf.load(os.path.join(FIX, FP8))
    rng = np.random.default_rng()
    params = jax.tree.map(lambda a: np.asarray(rng.normal(0, 0.05, a.shape), np.float32), params)
    for fmt, rel in (("fp8", 2 ** -3), ("int4", 1 / 7.5)):
        a, b = tmp_path / f"{fmt}_a", tmp_path / f"{fmt}_b"
        c2jax.hf.save(m, params, str(a), quantize=fmt)
        _, loaded = c2jax.hf.load(str(a))
        w, w2 = params["moe_layers"]["block"]["moe"]["w_up"], np.asarray(loaded["moe_layers"]["block"]["moe"]["w_up"])
        assert np.abs(w2 - w).max() <= rel * np.abs(w).max()
        c2jax.hf.save(m, loaded, str(b), quantize=fmt)
        ta, tb = _tensors(str(a)), _tensors(str(b))
        for k in ta:
            np.testing.assert_array_equal(ta[k].view(np.uint8), tb[k].view(np.uint8), err_msg=k)


def _copy_with_config(name, tmp_path, edit):
    dst = tmp_path / name
    shutil.copytree(os.path.join(FIX, name), dst)
    cfg = json.load(open(dst / "config.json"))
    edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


@pytest.mark.parametrize("edit,match", [
    (lambda c: c["quantization_config"].update(quant_method="gptq"), "unsupported quant_method 'gptq'"),
    (lambda c: c["quantization_config"].update(quant_method="awq"), "unsupported quant_method 'awq'"),
    (lambda c: c["quantization_config"].update(weight_block_size=None), "weight_block_size"),
    (lambda c: c["quantization_config"].update(fmt="e5m2"), "fmt 'e5m2'"),
    (lambda c: c.pop("quantization_config"), "no fp8 quantization_config"),
])
def test_bad_fp8_configs_are_named(edit, match, tmp_path):
    with pytest.raises(CheckpointError, match=match):
        c2jax.hf.load(_copy_with_config(FP8, tmp_path, edit))


@pytest.mark.parametrize("edit,match", [
    (lambda c: c["quantization_config"].update(format="float-quantized"), "format 'float-quantized'"),
    (lambda c: c["quantization_config"]["config_groups"]["group_0"]["weights"].update(symmetric=False),
     "symmetric"),
    (lambda c: c["quantization_config"]["config_groups"]["group_0"].update(format="marlin-24"), "marlin-24"),
    (lambda c: c["text_config"].update(model_type="llama"), "unsupported model_type 'llama'"),
])
def test_bad_int4_configs_are_named(edit, match, tmp_path):
    with pytest.raises(CheckpointError, match=match):
        c2jax.hf.load(_copy_with_config(INT4, tmp_path, edit))


def test_misshaped_scale_is_named(tmp_path):
    dst = tmp_path / "x"
    shutil.copytree(os.path.join(FIX, FP8), dst)
    t = _tensors(str(dst))
    t["model.layers.0.mlp.gate_proj.weight_scale_inv"] = np.ones((1, 1), np.float32)
    write_file(t, str(dst / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"gate_proj\.weight_scale_inv' has shape \[1, 1\], expected \[2, 1\]"):
        c2jax.hf.load(str(dst))


def test_mtp_head_keeps_its_own_output_norm(tmp_path):
    """DeepSeek-V3's shared_head.norm is the MTP head's own output norm: a value that differs from
    model.norm is imported into mtp_1/norm, changes only the MTP logits, and saves back."""
    dst = tmp_path / "x"
    shutil.copytree(os.path.join(FIX, FP8), dst)
    t = _tensors(str(dst))
    norm = (t["model.norm.weight"].astype(np.float32) * 1.5).astype(t["model.norm.weight"].dtype)
    t["model.layers.3.shared_head.norm.weight"] = norm
    write_file(t, str(dst / "model.safetensors"))
    m, params = c2jax.hf.load(str(dst), mtp=True)
    np.testing.assert_array_equal(np.asarray(params["mtp_1"]["norm"]["scale"]), norm.astype(np.float32))
    m0, params0 = c2jax.hf.load(os.path.join(FIX, FP8), mtp=True)
    tokens = jax.random.randint(jax.random.key(3), (2, 8), 0, m.vocab_size)
    out = c2jax.models.forward(m, params, tokens, return_aux=True)
    out0 = c2jax.models.forward(m0, params0, tokens, return_aux=True)
    np.testing.assert_array_equal(np.asarray(out.logits), np.asarray(out0.logits))
    assert float(jnp.max(jnp.abs(out.aux["mtp_logits"] - out0.aux["mtp_logits"]))) > 1e-3
    c2jax.hf.save(m, params, str(tmp_path / "back"))
    np.testing.assert_array_equal(_tensors(str(tmp_path / "back"))["model.layers.3.shared_head.norm.weight"]
                                  .astype(np.float32), norm.astype(np.float32))
    m, params = c2jax.hf.load(os.path.join(FIX, FP8), mtp=False)
    assert m.num_mtp_layers == 0 and "mtp_1" not in params


def test_mtp_round_trip_plain(tmp_path):
    m, params = c2jax.hf.load(os.path.join(FIX, FP8))
    c2jax.hf.save(m, params, str(tmp_path))
    assert json.load(open(tmp_path / "config.json"))["num_nextn_predict_layers"] == 1
    m2, params2 = c2jax.hf.load(str(tmp_path), mtp=True)
    assert m2.num_mtp_layers == 1
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, params2)
