"""The GPU benchmark's CPU-testable parts: the study config's size, the profile summary on a real
jax.profiler trace, and the summary's per-model pairing of c2jax and HF rows."""
import importlib.util
import json
import os
import sys

import jax
import jax.numpy as jnp

from c2jax.config import load_config_file, validate
from c2jax.models import param_count

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU = os.path.join(ROOT, "experiments", "bench", "gpu")


def _module(name):
    sys.path.insert(0, GPU)
    spec = importlib.util.spec_from_file_location(name, os.path.join(GPU, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_study_config_is_a_1_to_2b_qwen3_moe():
    cfg = load_config_file(os.path.join(ROOT, "configs", "gpu_study.py"))
    validate(cfg)
    counts = param_count(cfg)
    assert 1.0e9 < counts["total"] < 2.0e9 and counts["active"] < counts["total"] / 3
    assert cfg.model.head_dim == 128 and cfg.model.dtype == "bfloat16" and cfg.model.moe_dispatch == "dropless"


def test_profile_summary_reads_a_trace(tmp_path):
    ps = _module("profile_summary")
    f = jax.jit(lambda a: jnp.tanh(a @ a).sum())
    a = jax.random.normal(jax.random.key(0), (384, 384))
    f(a).block_until_ready()
    jax.profiler.start_trace(str(tmp_path))
    for _ in range(3):
        f(a).block_until_ready()
    jax.profiler.stop_trace()
    top = ps.top_ops(ps.newest_trace(str(tmp_path)), 5)
    assert top["total_ms"] > 0 and 0 < len(top["ops"]) <= 5
    ms = [o["ms"] for o in top["ops"]]
    assert ms == sorted(ms, reverse=True) and sum(o["share"] for o in top["ops"]) <= 1.0 + 1e-6


def test_summary_pairs_each_model_with_its_own_peer(tmp_path, monkeypatch):
    rows = [{"part": "train", "impl": "c2jax", "model": "l", "variant": "bf16", "tokens_per_s": 200.0,
             "step_s_median": 1.0, "flops_per_token": 1e6, "batch": 2, "seq": 4, "params": 10},
            {"part": "train", "impl": "hf", "model": "l", "variant": "bf16", "tokens_per_s": 100.0,
             "step_s_median": 2.0, "batch": 2, "seq": 4, "params": 10},
            {"part": "train", "impl": "c2jax", "model": "study", "variant": "bf16_grouped", "tokens_per_s": 30.0,
             "step_s_median": 1.0, "flops_per_token": 1e7, "batch": 2, "seq": 4, "params": 100,
             "profile": {"total_ms": 2.0, "ops": [{"name": "ragged-dot", "ms": 1.5, "count": 2, "share": 0.75}]}},
            {"part": "train", "impl": "hf", "model": "study", "variant": "bf16", "tokens_per_s": 20.0,
             "step_s_median": 1.5, "batch": 2, "seq": 4, "params": 100}]
    path = tmp_path / "results.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setattr(sys, "argv", ["summarize.py", str(path), "--md", str(tmp_path / "s.md")])
    assert _module("summarize").main() == 0
    summary = json.loads(path.read_text().splitlines()[-1])
    assert summary["train_bf16_x_hf_bf16"] == 2.0 and summary["train_study_bf16_grouped_x_hf_bf16"] == 1.5
    assert "ragged-dot" in (tmp_path / "s.md").read_text()
