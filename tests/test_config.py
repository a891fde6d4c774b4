"""Config loading, CLI overrides and validation: every rule raises ConfigError naming the field."""
import glob
import os
import re

import pytest

from c2jax.config import ConfigError, apply_overrides, default_config, load_config, validate

ROOT = os.path.join(os.path.dirname(__file__), "..")


def cfg_with(overrides=(), base=None):
    cfg = load_config(base) if base else default_config()
    apply_overrides(cfg, overrides)
    return cfg


def raises_naming(field, fn, *args, **kwargs):
    with pytest.raises(ConfigError, match=re.escape(field)):
        fn(*args, **kwargs)


# ----------------------------------------------------------------------------- unknown keys, types


@pytest.mark.parametrize("override,field", [
    ("--config.bogus=1", "bogus"),                                # top-level
    ("--config.model.num_expert=4", "model.num_expert"),          # nested typo
    ("--config.train.stepz=4", "train.stepz"),
    ("--config.nosection.key=4", "nosection"),                    # unknown section
    ("config.model.num_expert=4", "model.num_expert"),            # without the dashes
])
def test_unknown_key(override, field):
    raises_naming(field, apply_overrides, default_config(), [override])


def test_unknown_key_suggests_near_names():
    with pytest.raises(ConfigError, match="num_experts"):
        apply_overrides(default_config(), ["--config.model.num_expert=4"])
    with pytest.raises(ConfigError, match=re.escape("model.not_a_field")):
        apply_overrides(default_config(), {"model.not_a_field": 1})


def test_unknown_key_added_directly_is_caught_by_validate():
    cfg = default_config()
    cfg.model.num_expert = 4  # typo'd attribute set in Python
    raises_naming("model.num_expert", validate, cfg)
    cfg = default_config()
    cfg.mesh.axis = ("data",)
    raises_naming("mesh.axis", validate, cfg)


@pytest.mark.parametrize("overrides", [
    ["--config.model.num_experts=x"],
    {"model.num_experts": "x"},
    {"model.num_experts": True},                  # bool for an int
    ["--config.model.qk_norm=maybe"],             # not a boolean
    {"model.qk_norm": 1},                         # int for a bool
    ["--config.train.lr=fast"],
    ["--config.mesh.shape=notatuple"],
])
def test_wrong_type_in_override(overrides):
    key = next(iter(overrides)) if isinstance(overrides, dict) else overrides[0][len("--config."):].split("=")[0]
    raises_naming(key, apply_overrides, default_config(), overrides)


@pytest.mark.parametrize("field,value", [("num_experts", "x"), ("num_experts", True), ("router", 3),
                                         ("qk_norm", 1), ("init_std", "big")])
def test_wrong_type_set_directly_is_caught_by_validate(field, value):
    cfg = default_config()
    with cfg.model.ignore_type():
        cfg.model[field] = value
    raises_naming(f"model.{field}", validate, cfg)


# ----------------------------------------------------------------------------- model rules


@pytest.mark.parametrize("overrides,field", [
    ({"model.num_heads": 4, "model.num_kv_heads": 3}, "model.num_kv_heads"),
    ({"model.num_experts": 8, "model.num_experts_per_tok": 9}, "model.num_experts_per_tok"),
    ({"model.attention": "gqa", "model.head_dim": 7}, "model.head_dim"),
    ({"model.attention": "mla", "model.qk_rope_head_dim": 5}, "model.qk_rope_head_dim"),
    ({"model.num_experts": 8, "model.n_group": 3}, "model.n_group"),
    ({"model.num_experts": 8, "model.n_group": 2, "model.topk_group": 3}, "model.topk_group"),
    ({"model.router": "softmax", "model.router_bias": True}, "model.router_bias"),
    ({"model.num_layers": 2, "model.first_k_dense": 3}, "model.first_k_dense"),
    ({"model.router": "topk"}, "model.router"),
    ({"model.attention": "mha"}, "model.attention"),
    ({"model.moe_dispatch": "dense"}, "model.moe_dispatch"),
    ({"model.remat": "some"}, "model.remat"),
    ({"model.hidden_size": 0}, "model.hidden_size"),
])
def test_model_rules(overrides, field):
    cfg = cfg_with(overrides)
    raises_naming(field, validate, cfg)


def test_model_rule_fixes_validate():
    """The valid neighbours of the broken configs above pass: the rules are not over-eager."""
    for overrides in ({"model.num_heads": 6, "model.num_kv_heads": 3},
                      {"model.num_experts": 8, "model.num_experts_per_tok": 8},
                      {"model.attention": "mla", "model.qk_rope_head_dim": 6},
                      {"model.num_experts": 8, "model.n_group": 4, "model.topk_group": 4},
                      {"model.router": "sigmoid", "model.router_bias": True},
                      {"model.num_layers": 2, "model.first_k_dense": 2}):
        validate(cfg_with(overrides))


# ----------------------------------------------------------------------------- mesh rules


def test_mesh_shape_must_match_device_count():
    cfg = cfg_with({"mesh.shape": (3, 1, 1, 1)})
    validate(cfg)  # without a device count only the static checks run
    raises_naming("mesh.shape", validate, cfg, num_devices=8)
    validate(cfg_with({"mesh.shape": (2, 2, 1, 2)}), num_devices=8)
    validate(cfg_with({"mesh.shape": (-1, 2, 1, 1)}), num_devices=8)
    raises_naming("mesh.shape", validate, cfg_with({"mesh.shape": (-1, 3, 1, 1)}), num_devices=8)


def test_mesh_shape_at_most_one_wildcard():
    with pytest.raises(ConfigError, match=r"mesh\.shape.*-1"):  # the rule's own message, not a mismatch
        validate(cfg_with({"mesh.shape": (-1, -1, 1, 1)}), num_devices=8)


def test_experts_divisible_by_expert_axis():
    cfg = cfg_with({"mesh.shape": (-1, 1, 1, 3), "model.num_experts": 8})
    raises_naming("model.num_experts", validate, cfg, num_devices=6)
    validate(cfg_with({"mesh.shape": (-1, 1, 1, 4), "model.num_experts": 8}), num_devices=8)


def test_unknown_mesh_axis_in_rules():
    cfg = default_config()
    apply_overrides(cfg, {"mesh.rules": tuple(cfg.mesh.rules) + (("experts", "bogus_axis"),)})
    with pytest.raises(ConfigError, match=r"mesh\.rules.*bogus_axis"):
        validate(cfg)


def test_ep_exchange_choice():
    raises_naming("mesh.ep_exchange", validate, cfg_with({"mesh.ep_exchange": "sparse"}))
    validate(cfg_with({"mesh.ep_exchange": "ragged"}))


# ----------------------------------------------------------------------------- train rules


def test_batch_size_divisible_by_grad_accum():
    raises_naming("train.grad_accum", validate, cfg_with({"train.batch_size": 8, "train.grad_accum": 3}))
    validate(cfg_with({"train.batch_size": 8, "train.grad_accum": 4}))


def test_seq_len_within_max_positions():
    cfg = cfg_with({"train.seq_len": 8192, "model.max_position_embeddings": 4096})
    raises_naming("train.seq_len", validate, cfg)


# ----------------------------------------------------------------------------- override parsing


def test_cli_override_parsing():
    cfg = default_config()
    apply_overrides(cfg, [
        "--config.model.num_experts=16",            # int
        "--config.train.lr=1e-4",                   # float
        "--config.model.capacity_factor=3",         # int text for a float field -> float
        "--config.model.qk_norm=false",             # bool
        "--config.model.tie_embeddings=True",
        "--config.model.router=sigmoid",            # str
        "--config.model.name=a=b",                  # only the first '=' splits
        "--config.mesh.shape=(2,1,1,-1)",           # tuple
        "config.mesh.axes=['a', 'b', 'c', 'd']",    # list literal -> tuple
    ])
    m = cfg.model
    assert m.num_experts == 16 and type(m.num_experts) is int
    assert cfg.train.lr == 1e-4 and type(cfg.train.lr) is float
    assert m.capacity_factor == 3.0 and type(m.capacity_factor) is float
    assert m.qk_norm is False and m.tie_embeddings is True
    assert m.router == "sigmoid" and m.name == "a=b"
    assert cfg.mesh.shape == (2, 1, 1, -1) and cfg.mesh.axes == ("a", "b", "c", "d")
    cfg2 = default_config()
    apply_overrides(cfg2, {"model.capacity_factor": 4, "model.num_experts": 4, "model.qk_norm": False})
    assert cfg2.model.capacity_factor == 4.0 and type(cfg2.model.capacity_factor) is float
    with pytest.raises(ConfigError, match="config"):
        apply_overrides(default_config(), ["--config.model.num_experts"])  # no '='


def test_load_config_applies_overrides_and_validates():
    cfg = load_config("configs/tiny.py:mla", ["--config.model.num_layers=3"])
    assert cfg.model.attention == "mla" and cfg.model.num_layers == 3
    raises_naming("model.first_k_dense", load_config, "configs/tiny.py", ["--config.model.first_k_dense=9"])
    raises_naming("mesh.shape", load_config, "configs/tiny.py", ["--config.mesh.shape=(3,1,1,1)"],
                  validate_devices=8)


def test_bad_config_specs_error():
    with pytest.raises(ValueError, match="bogus"):  # ConfigError is a ValueError
        load_config("configs/tiny.py:bogus")
    raises_naming("configs/nonexistent.py", load_config, "configs/nonexistent.py")


# ----------------------------------------------------------------------------- presets

PRESETS = ["tiny.py", "tiny.py:mla", "ablation.py:s", "ablation.py:m", "ablation.py:l",
           "qwen3_moe_30b_a3b.py", "deepseek_v3_671b.py", "kimi_k2_1t.py", "rl_tiny.py", "gpu_study.py"]


@pytest.mark.parametrize("spec", PRESETS)
def test_presets_load_and_validate(spec):
    cfg = load_config(os.path.join(ROOT, "configs", spec))
    validate(cfg, num_devices=8)
    validate(cfg, num_devices=1)
    assert cfg.model.name


def test_every_top_level_config_file_is_a_tested_preset():
    files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "configs", "*.py")))
    tested = {spec.split(":")[0] for spec in PRESETS}
    assert [f for f in files if f != "__init__.py" and f not in tested] == []
    for f in files:
        if f != "__init__.py":
            validate(load_config(os.path.join(ROOT, "configs", f)))  # the default arg loads too
