"""experiments/bench/tunix_rl_aot.py's figures without compiling anything: on two small fake
reports (one per side) the summary takes peak HBM from the full-depth compile, the whole-step cost
directly from an unrolled full compile (Tunix) or extrapolated from the L2 / L4 compiles (c2jax,
scanned full), adds the FLOPs of attention kernels without a cost estimate at the chip's peak, and
the markdown table has one row per side; a side whose full compile failed shows its status."""
import importlib.util
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "experiments", "bench", "tunix_rl_aot.py")

POINT = {"name": "fake", "topology": "v5p:4x4x4", "batch": 64, "seq": 4096, "prompt_len": 1024, "layers": 48}
MEM = {"arguments_gib": 5.0, "temp_gib": 6.0, "outputs_gib": 5.0, "aliased_gib": 5.0, "generated_code_gib": 0.0,
       "peak_gib": 11.0}


def _module():
    spec = importlib.util.spec_from_file_location("tunix_rl_aot", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _cost(flops, seconds):
    return {"flops": flops, "bytes_accessed": 2 * flops, "optimal_seconds": seconds, "transcendentals": 0.0}


def _tunix():
    return {"side": "tunix", "point": POINT, "compiles": {
        "L2": {"status": "ok", "scan": False, "cost": _cost(10.0, 1.0), "memory": MEM},
        "L4": {"status": "ok", "scan": False, "cost": _cost(14.0, 1.5), "memory": MEM},
        "full": {"status": "ok", "scan": False, "cost": _cost(100.0, 12.0), "memory": dict(MEM, peak_gib=20.0),
                 "mosaic_kernels": {"splash_mha_fwd": 2, "gmm": 3},
                 "kernels_without_cost_estimate": {"splash_mha_fwd": 2}}}}


def _c2jax():
    return {"side": "c2jax", "point": POINT, "compiles": {
        "L2": {"status": "ok", "scan": False, "cost": _cost(10.0, 1.0), "memory": MEM},
        "L4": {"status": "ok", "scan": False, "cost": _cost(14.0, 1.5), "memory": MEM},
        "full": {"status": "ok", "scan": True, "cost": _cost(3.0, 0.2), "memory": MEM,
                 "mosaic_kernels": {"_gmm_kernel": 4}, "kernels_without_cost_estimate": {}}}}


def test_summary_sources():
    mod = _module()
    t = mod.summarize(_tunix())
    assert t["peak_hbm_gib"] == 20.0
    assert t["whole"]["flops"] == 100.0 and t["whole_source"].startswith("full-depth")
    # the extrapolation check beside it: 10 + (48 - 2) * 2
    assert t["extrapolated"]["flops"] == pytest.approx(10 + 46 * 2)
    assert t["uncounted_families"] == ["attention"]
    attn = mod.attention_flops_per_layer(64, 4096, 64, 32, 128)
    assert attn == pytest.approx(0.618e12, rel=1e-3)   # experiments/results/tpu_aot: 0.618 TFLOPs per layer
    assert t["optimal_seconds_plus_uncounted"] == pytest.approx(12.0 + attn * 48 / 459e12)
    c = mod.summarize(_c2jax())
    assert c["whole"]["optimal_seconds"] == pytest.approx(1.0 + 46 * 0.25)   # scanned full is not read
    assert c["uncounted_families"] == [] and c["optimal_seconds_plus_uncounted"] == c["whole"]["optimal_seconds"]


def test_table_rows_and_failures(tmp_path):
    mod = _module()
    bad = _tunix()
    bad["compiles"]["full"] = {"status": "compile_error", "error": "XlaRuntimeError: boom"}
    paths = []
    for name, r in (("a_tunix.json", bad), ("b_c2jax.json", _c2jax())):
        (tmp_path / name).write_text(json.dumps(r))
        paths.append(str(tmp_path / name))
    md, sums = mod.table(paths)
    rows = [line for line in md.splitlines() if line.startswith("| tunix") or line.startswith("| c2jax")]
    assert len(rows) == 2
    assert "extrapolated" in rows[0] and "compile_error" in rows[0]   # the failed full compile is named
    assert sums["tunix"]["whole_source"].startswith("extrapolated")   # falls back to L2 / L4
    assert "11.00 (5.00, 6.00, 5.00)" in rows[1]


def _om(seconds):
    return {"optimal_seconds": seconds, "flops": 1e12, "bytes_accessed": 1e9, "kernel_seconds_self": 0.0,
            "kernel_seconds_model": seconds / 2, "unmodeled_kernels": 0}


def test_one_cost_model_step_adds_tunix_reference_program_and_verdict(tmp_path):
    """Under the one cost model Tunix's step is its update plus its separate reference-forward
    program (read from the unrolled full compile), c2jax's is its step (reference inside),
    extrapolated from L2 / L4; the verdict line names both ratios and whether each is met."""
    mod = _module()
    t = _tunix()
    t["compiles"]["full"]["one_model"] = _om(8.0)
    t["compiles"]["full"]["ref_forward"] = {"status": "ok", "memory": MEM, "cost": _cost(5.0, 2.5),
                                           "one_model": _om(2.0)}
    c = _c2jax()
    c["compiles"]["L2"]["one_model"] = _om(0.1)
    c["compiles"]["L4"]["one_model"] = _om(0.14)
    c["compiles"]["full"]["one_model"] = _om(0.02)    # a scanned program: loop body once, not read
    c["point"] = dict(POINT, c2jax_point="qwen3_30b_a3b-ep64-ragged")
    st = mod.summarize(t)["one_model"]
    assert st["step_s"] == pytest.approx(10.0) and st["update_source"] == "full-depth compile"
    sc = mod.summarize(c)["one_model"]
    assert sc["step_s"] == pytest.approx(0.1 + 46 * 0.02) and sc["reference_in_step"]
    assert sc["update_source"] == "extrapolated from L2 and L4"
    paths = []
    for name, r in (("a_tunix.json", t), ("b_c2jax.json", c)):
        (tmp_path / name).write_text(json.dumps(r))
        paths.append(str(tmp_path / name))
    md, sums = mod.table(paths)
    assert set(sums) == {"tunix", "c2jax qwen3_30b_a3b-ep64-ragged"}   # a layout of its own row
    assert "10.000 = 8.000 + 2.000" in md
    line = [x for x in md.splitlines() if x.startswith("- c2jax qwen3_30b_a3b-ep64-ragged vs tunix")][0]
    assert "HBM 11.00 vs 20.00 GiB (1.82x less: met)" in line
    assert f"{10.0 / 1.02:.2f}x: met" in line
    # without Tunix's reference program its step is not given, and the verdict says so
    del t["compiles"]["full"]["ref_forward"]
    assert mod.summarize(t)["one_model"]["step_s"] is None
