"""HF parity (fixtures made by experiments/reference/make_hf_fixtures.py with transformers),
save -> load round trips and checkpoint errors."""
import json
import os
import shutil

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import c2jax
from c2jax.hf import CheckpointError

FIX = os.path.join(os.path.dirname(__file__), "..", "fixtures", "hf")
NAMES = ["qwen3_moe_tiny", "qwen3_moe_tiny_nonorm", "deepseek_v3_tiny", "deepseek_v3_tiny_noqlora"]


def _keys_and_shapes(path):
    out = {}
    for fname in os.listdir(path):
        if fname.endswith(".safetensors"):
            out.update({k: v.shape for k, v in load_file(os.path.join(path, fname)).items()})
    return out


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dispatch", ["grouped", "capacity"])
def test_logits_match_transformers(name, dispatch):
    m, params = c2jax.hf.load(os.path.join(FIX, name))
    m.moe_dispatch = dispatch
    m.capacity_factor = float(m.num_experts)  # enough capacity that nothing is dropped
    ref = np.load(os.path.join(FIX, name, "reference.npz"))
    logits = c2jax.models.forward(m, params, ref["input_ids"])
    assert logits.dtype == np.float32 and logits.shape == ref["logits"].shape
    np.testing.assert_allclose(np.asarray(logits), ref["logits"], atol=1e-4, rtol=0)


def test_fixture_features_are_covered():
    m, _ = c2jax.hf.load(os.path.join(FIX, "deepseek_v3_tiny"))
    assert m.rope_scaling == "yarn" and m.n_group > 1 and m.topk_group < m.n_group
    assert m.num_shared_experts == 1 and m.first_k_dense > 1 and m.router_bias and m.q_lora_rank > 0
    q, _ = c2jax.hf.load(os.path.join(FIX, "qwen3_moe_tiny"))
    assert q.qk_norm and q.first_k_dense == 1 and q.num_kv_heads < q.num_heads
    assert os.path.exists(os.path.join(FIX, "qwen3_moe_tiny_nonorm", "model.safetensors.index.json"))


@pytest.mark.parametrize("name", NAMES)
def test_save_load_round_trip_bit_exact(name, tmp_path):
    src = os.path.join(FIX, name)
    m, params = c2jax.hf.load(src)
    out = tmp_path / "out"
    c2jax.hf.save(m, params, str(out), max_shard_bytes=64 << 10)
    assert os.path.exists(out / "model.safetensors.index.json")  # sharded at this shard size
    m2, params2 = c2jax.hf.load(str(out))
    assert m2.to_dict() == m.to_dict()
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, params2)
    # Same tensor names and shapes as the transformers-written checkpoint: what transformers loads.
    assert _keys_and_shapes(str(out)) == _keys_and_shapes(src)
    hf_cfg = json.load(open(out / "config.json"))
    ref_cfg = json.load(open(os.path.join(src, "config.json")))
    for key in ("model_type", "hidden_size", "num_hidden_layers", "vocab_size", "num_experts_per_tok",
                "tie_word_embeddings", "moe_intermediate_size"):
        assert hf_cfg[key] == ref_cfg[key], key


def test_unsupported_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(CheckpointError, match="unsupported model_type 'llama'"):
        c2jax.hf.load(str(tmp_path))


def _copy(name, tmp_path):
    dst = tmp_path / name
    shutil.copytree(os.path.join(FIX, name), dst)
    return dst


def test_missing_tensor_is_named(tmp_path):
    dst = _copy("deepseek_v3_tiny", tmp_path)
    tensors = load_file(str(dst / "model.safetensors"))
    del tensors["model.layers.3.mlp.experts.5.up_proj.weight"]
    save_file(tensors, str(dst / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.3\.mlp\.experts\.5\.up_proj\.weight.*missing"):
        c2jax.hf.load(str(dst))


def test_misshaped_tensor_is_named(tmp_path):
    dst = _copy("qwen3_moe_tiny", tmp_path)
    tensors = load_file(str(dst / "model.safetensors"))
    tensors["model.layers.1.self_attn.k_proj.weight"] = np.zeros((48, 64), np.float32)
    save_file(tensors, str(dst / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"k_proj\.weight' has shape \[48, 64\], expected \[32, 64\]"):
        c2jax.hf.load(str(dst))


def test_missing_shard_file_is_named(tmp_path):
    dst = _copy("qwen3_moe_tiny_nonorm", tmp_path)
    os.remove(dst / "model-00002-of-00003.safetensors")
    with pytest.raises(CheckpointError, match="shard model-00002-of-00003.safetensors"):
        c2jax.hf.load(str(dst))


def test_load_onto_a_sharding():
    m, params = c2jax.hf.load(os.path.join(FIX, "qwen3_moe_tiny"))
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    _, params2 = c2jax.hf.load(os.path.join(FIX, "qwen3_moe_tiny"),
                               shardings=jax.tree.map(lambda _: dev, params), dtype="bfloat16")
    assert all(x.dtype == np.dtype("bfloat16") for x in jax.tree.leaves(params2))


def test_gqa_model_with_mtp_heads_round_trips(tmp_path):
    """A qwen3_moe-layout model with MTP heads exports them as layers num_hidden_layers + d - 1
    (num_nextn_predict_layers in config.json) and imports them back bit for bit."""
    from c2jax.config import load_config
    cfg = load_config("configs/tiny.py", ["--config.model.num_mtp_layers=1", "--config.model.num_layers=2",
                                          "--config.model.vocab_size=64"])
    params = c2jax.models.init_params(cfg, jax.random.key(3))
    c2jax.hf.save(cfg, params, str(tmp_path))
    hf_cfg = json.load(open(tmp_path / "config.json"))
    assert hf_cfg["model_type"] == "qwen3_moe" and hf_cfg["num_nextn_predict_layers"] == 1
    assert "model.layers.2.eh_proj.weight" in _keys_and_shapes(str(tmp_path))
    m2, params2 = c2jax.hf.load(str(tmp_path))
    assert m2.num_mtp_layers == 1
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, params2)
    _, no_heads = c2jax.hf.load(str(tmp_path), mtp=False)
    assert not any(k.startswith("mtp_") for k in no_heads)
