"""experiments/bench/tpu_aot.py's tiny point, c2jax side: the real train step of a 4-layer toy
Qwen3-MoE (FSDP 2 x EP 2 on v5p:2x2x1) compiled ahead of time for TPU from this CPU machine,
2- and 4-layer unrolled and full-depth scanned, through the same code path as the pod points;
the JSON report holds positive compiler figures, the per-layer extrapolation's arithmetic, the
Mosaic kernels of each program, and the MaxText side is never a crash."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "experiments", "bench", "tpu_aot.py")


def _have_topology() -> bool:
    code = ("import os; os.environ['ALLOW_MULTIPLE_LIBTPU_LOAD']='1'\n"
            "from jax.experimental import topologies\n"
            "topologies.get_topology_desc(platform='tpu', topology_name='v5p:2x2x1')")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120).returncode == 0


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    if not _have_topology():
        pytest.skip("libtpu cannot give a v5p topology here")
    out = tmp_path_factory.mktemp("aot")
    env = dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, SCRIPT, "--tiny", "--out-dir", str(out), "--stem", "tiny"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out / "tiny.json") as f:
        r = json.load(f)
    r["_md"] = (out / "tiny.md").read_text()
    return r


def _module():
    import importlib.util
    spec = importlib.util.spec_from_file_location("tpu_aot", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_point_fields(report):
    assert report["point"] == "tiny" and report["topology"] == "v5p:2x2x1" and report["chips"] == 4
    assert report["model_flops_per_step"] > 0 and report["model_flops_per_chip"] > 0
    assert report["params_active"] <= report["params_total"]
    assert set(report["sides"]) == {"c2jax"}
    assert "| c2jax |" in report["_md"]


def test_compiles_have_positive_figures_and_kernels(report):
    c = report["sides"]["c2jax"]
    assert c["status"] == "ok"
    assert set(c["compiles"]) == {"L2", "L4", "full"}
    for key, comp in c["compiles"].items():
        assert comp["status"] == "ok", key
        for k in ("flops", "bytes_accessed", "optimal_seconds"):
            assert comp["cost"][k] > 0, (key, k)
        for k in ("arguments_gib", "temp_gib", "outputs_gib", "peak_gib"):
            assert comp["memory"][k] > 0, (key, k)
        assert comp["compile_s"] > 0 and comp["lower_s"] > 0
        # the Mosaic kernels c2jax chooses for TPU: grouped matmuls and flash attention
        assert isinstance(comp["mosaic_kernels"], dict) and comp["mosaic_kernels"], key
        assert any("gmm" in k for k in comp["mosaic_kernels"]), comp["mosaic_kernels"]
        # every kernel hands XLA a cost estimate, so the program's FLOPs and optimal_seconds count it
        assert comp["kernels_without_cost_estimate"] == {}, key
    assert c["uncounted_kernels"]["families"] == []
    assert c["optimal_seconds_plus_uncounted"] == c["whole"]["optimal_seconds"]
    assert not c["compiles"]["L2"]["scan"] and c["compiles"]["full"]["scan"]
    # two more unrolled layers hold twice as many kernel calls per layer
    k2, k4 = (sum(c["compiles"][k]["mosaic_kernels"].values()) for k in ("L2", "L4"))
    assert k4 > k2
    # full remat holds in the unrolled programs the step time comes from: the optimized program runs
    # the flash forward twice per layer (forward, rematerialized forward), not merged by XLA's CSE
    for key, layers in (("L2", 2), ("L4", 4)):
        fwd = sum(m.get("count", 1) for m in c["compiles"][key]["mosaic_calls"] if m["kernel"] == "_fwd_kernel")
        assert fwd == 2 * layers, (key, fwd)


def test_extrapolation_arithmetic(report):
    c = report["sides"]["c2jax"]
    lo, hi = c["compiles"]["L2"]["cost"], c["compiles"]["L4"]["cost"]
    n = report["layers"]
    assert n == 4 and report["extrapolation"]["lo"] == 2 and report["extrapolation"]["hi"] == 4
    for k in ("flops", "bytes_accessed", "optimal_seconds"):
        per = (hi[k] - lo[k]) / 2
        assert c["per_layer"][k] == pytest.approx(per)
        assert c["whole"][k] == pytest.approx(lo[k] + (n - 2) * per)
        assert c["per_layer"][k] > 0
    mfu = report["model_flops_per_chip"] / (c["whole"]["optimal_seconds"] * report["peak_bf16_tflops"] * 1e12)
    assert c["mfu_at_optimal_seconds"] == pytest.approx(mfu) and c["mfu_at_optimal_seconds"] > 0
    assert c["peak_hbm_gib"] == c["compiles"]["full"]["memory"]["peak_gib"] > 0
    assert "scanned" in c["hbm_source"]


def test_missing_maxtext_venv_is_recorded_not_raised(monkeypatch, tmp_path):
    mod = _module()
    monkeypatch.setattr(mod, "MAXTEXT_PY", str(tmp_path / "no-venv" / "python"))
    p = mod.point_spec("tiny")
    side = mod.maxtext_side(p, [("L2", 2, True)], str(tmp_path), "x", 10)
    assert side["status"] == "not run: .venv-maxtext missing (experiments/reference/setup_maxtext_env.sh creates it)"
    side = mod.summarize(side, p, 4, 459e12, 1e12)
    assert side["status"].startswith("not run")
    # MaxText's overrides state the same batch, sequence, precision, remat and mesh as c2jax's config
    ov = dict(o.split("=", 1) for o in mod.maxtext_overrides(p, 2, True))
    assert ov["per_device_batch_size"] == "2" and ov["max_target_length"] == "256"
    assert ov["ici_fsdp_parallelism"] == "2" and ov["ici_expert_parallelism"] == "2"
    assert (ov["remat_policy"], ov["weight_dtype"], ov["dtype"], ov["scan_layers"]) == (
        "full", "float32", "bfloat16", "false")


def test_maxtext_side_reused_only_from_the_same_programs(tmp_path):
    mod = _module()
    p = mod.point_spec("tiny")
    old = {"point": "tiny", "date": "2026-01-01 00:00 UTC", "command": "x", "model": p["model"],
           "topology": p["topology"], "global_batch": p["batch"], "seq_len": p["seq"],
           "layout": {"fsdp": p["fsdp"], "ep": p["ep"]},
           "sides": {"maxtext": {"side": "maxtext", "status": "ok", "peak_hbm_gib": 1.5}}}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    side = mod.reused_maxtext_side(str(path), p)
    assert side["peak_hbm_gib"] == 1.5 and "compiled 2026-01-01 00:00 UTC" in side["note"]
    old["seq_len"] = p["seq"] * 2
    path.write_text(json.dumps(old))
    with pytest.raises(SystemExit, match="not the same MaxText programs"):
        mod.reused_maxtext_side(str(path), p)
    old["seq_len"] = p["seq"]
    old["sides"]["maxtext"]["status"] = "incomplete"
    path.write_text(json.dumps(old))
    with pytest.raises(SystemExit, match="no complete MaxText side"):
        mod.reused_maxtext_side(str(path), p)


def test_cp_layout_is_the_same_mesh_on_both_sides():
    """The CP point: c2jax's mesh (fsdp, context, expert) and rules against MaxText's ici_* axes
    and a fractional per-device batch (each row split over the context axis)."""
    mod = _module()
    p = mod.point_spec("qwen3_30b_a3b-fsdp4_cp2_ep8")
    assert p["c2jax_mesh"] == (1, 4, 2, 8)
    rules = p["c2jax_rules"]
    assert rules["length"] == "context" and rules["embed"] == ("fsdp", "context", "expert")
    assert rules["expert_embed"] == ("fsdp", "context") and rules["experts"] == "expert"
    ov = dict(o.split("=", 1) for o in mod.maxtext_overrides(p, 2, True))
    assert (ov["ici_fsdp_parallelism"], ov["ici_context_parallelism"], ov["ici_expert_parallelism"]) == ("4", "2", "8")
    assert float(ov["per_device_batch_size"]) * 64 == p["batch"] == 32
    assert mod.point_layout(p) == {"fsdp": 4, "ep": 8, "cp": 2}
    cfg = mod.c2jax_config(p, 2, True)
    from c2jax.config import validate
    validate(cfg, num_devices=64)
    assert dict(cfg.mesh.rules)["length"] == "context" and tuple(cfg.mesh.shape) == (1, 4, 2, 8)
    # a layout without CP keeps MaxText's context axis unset and the report's layout without "cp"
    q = mod.point_spec("qwen3_30b_a3b-fsdp8_ep8")
    assert "ici_context_parallelism" not in q["maxtext_mesh"] and mod.point_layout(q) == {"fsdp": 8, "ep": 8}


def test_fsdp_layout_splits_the_expert_weights_on_their_expert_dim():
    """The FSDP point stores whole experts per chip (mesh rule expert_fsdp -> fsdp): every expert
    weight's [E, ., .] dim over the 64 chips, the others whole, so no block's minor dim is split."""
    import jax
    mod = _module()
    p = mod.point_spec("qwen3_30b_a3b-fsdp64")
    cfg = mod.c2jax_config(p, 2, True)
    from c2jax.models.transformer import logical_axes
    from c2jax.parallel.mesh import logical_to_mesh_spec
    mesh = jax.sharding.AbstractMesh((1, 64, 1, 1), tuple(cfg.mesh.axes))
    moe = logical_axes(cfg)["moe_layers"]["block"]["moe"]
    for name in ("w_gate", "w_up", "w_down"):
        assert tuple(logical_to_mesh_spec(moe[name], cfg, mesh)) == (None, "fsdp", None, None), name


def test_remat_policies_reach_each_side_and_name_the_report():
    """--c2jax-remat / --maxtext-remat: each side's program states its policy (c2jax's
    model.remat, MaxText's remat_policy), a policy neither side documents is refused, and the
    report's stem names every policy other than full."""
    mod = _module()
    p = mod.with_remat(mod.point_spec("tiny"), "save_matmuls_attention", "minimal_with_context")
    assert mod.c2jax_config(p, 2, True).model.remat == "save_matmuls_attention"
    ov = dict(o.split("=", 1) for o in mod.maxtext_overrides(p, 2, True))
    assert ov["remat_policy"] == "minimal_with_context"
    assert mod.remat_suffix(p, ["c2jax", "maxtext"]) == "-c2jax_remat_save_matmuls_attention-maxtext_remat_minimal_with_context"
    assert mod.remat_suffix(mod.with_remat(p, maxtext="full"), ["maxtext"]) == ""
    ov = dict(o.split("=", 1) for o in mod.maxtext_overrides(mod.with_remat(p, maxtext="custom_all_device"), 2, True))
    assert ov["remat_policy"] == "custom" and ov["moe_mlpwo"] == ov["query_proj"] == ov["context"] == "device"
    with pytest.raises(SystemExit, match="--c2jax-remat"):
        mod.with_remat(p, c2jax="minimal")
    with pytest.raises(SystemExit, match="--maxtext-remat"):
        mod.with_remat(p, maxtext="save_matmuls")


def test_best_vs_best_takes_the_fastest_candidate_that_fits(tmp_path):
    """Per side: a faster candidate past 90% of HBM loses to a slower one that fits; a policy in two
    reports counts once (the later report's); the ratio is MaxText's best over c2jax's."""
    mod = _module()

    def write(name, date, side, remat, step, hbm, oom=False, tiles=None):
        compiles = {"L2": {"status": "ok"}, "L4": {"status": "ok"}, "full": {"status": "hbm_oom" if oom else "ok"}}
        r = {"point": "pt", "date": date, "hbm_per_chip_gib": 88.5, **({f"{side}_tiles": tiles} if tiles else {}),
             "sides": {side: {"status": "incomplete" if oom else "ok", "remat": remat, "peak_hbm_gib": hbm,
                              "compiles": compiles, "one_model": {"whole": {"optimal_seconds": step}, "mfu": 0.3}}}}
        (tmp_path / name).write_text(json.dumps(r))
        return str(tmp_path / name)
    paths = [write("a.json", "2026-01-01 00:00 UTC", "c2jax", "full", 1.0, 20.0),
             write("b.json", "2026-01-01 00:00 UTC", "c2jax", "none", 0.7, 85.0),          # over 79.65 GiB
             write("c.json", "2026-01-01 00:00 UTC", "c2jax", "save_matmuls", 0.8, 60.0),
             write("d.json", "2026-01-02 00:00 UTC", "c2jax", "save_matmuls", 0.85, 61.0),  # the later one
             write("e.json", "2026-01-01 00:00 UTC", "maxtext", "minimal", 0.9, 70.0),
             write("f.json", "2026-01-01 00:00 UTC", "maxtext", "full", 1.1, 20.0),
             write("g.json", "2026-01-01 00:00 UTC", "maxtext", "save_qkv_proj", 0.5, 60.0, oom=True),
             # the same policy at other tiles is a candidate of its own, not a later compile of f.json's
             write("h.json", "2026-01-03 00:00 UTC", "maxtext", "full", 1.05, 20.0, tiles="chosen")]
    b = mod.best_vs_best(paths)
    pt = b["points"]["pt"]
    assert [c["remat"] for c in pt["sides"]["c2jax"]] == ["none", "save_matmuls", "full"]
    assert pt["best"]["c2jax"]["remat"] == "save_matmuls" and pt["best"]["c2jax"]["step_s"] == 0.85
    assert pt["best"]["maxtext"]["remat"] == "minimal"   # not save_qkv_proj: its full depth did not compile
    assert [(c["remat"], c["tiles"]) for c in pt["sides"]["maxtext"]] == [
        ("save_qkv_proj", "base.yml 512x1024x1024"), ("minimal", "base.yml 512x1024x1024"),
        ("full", "per-shape rule"), ("full", "base.yml 512x1024x1024")]
    assert pt["maxtext_over_c2jax_step"] == pytest.approx(0.9 / 0.85)
    md = mod.best_markdown(b)
    assert ("| pt | save_matmuls, fixed 256x512x1024 | 0.850 (30.0%) | 61.00 | minimal, base.yml 512x1024x1024 | "
            "0.900 (30.0%) | 70.00 | 1.059 |") in md


def test_reports_name_no_path_of_this_machine(monkeypatch):
    """A report's command and a driver traceback name files as any checkout has them."""
    import site
    mod = _module()
    monkeypatch.setattr(sys, "argv", [SCRIPT, "--best", os.path.join(ROOT, "experiments", "x.json"), "/elsewhere/y.json"])
    assert mod.command_line() == ".venv/bin/python experiments/bench/tpu_aot.py --best experiments/x.json /elsewhere/y.json"
    sys.path.insert(0, os.path.join(ROOT, "experiments", "reference"))
    from maxtext_aot_driver import portable_paths
    pkg = site.getsitepackages()[0]
    text = f'File "{ROOT}/experiments/reference/maxtext_aot_driver.py", line 1\nFile "{pkg}/jax/x.py", line 2'
    assert portable_paths(text) == 'File "experiments/reference/maxtext_aot_driver.py", line 1\nFile "jax/x.py", line 2'


def test_resummarize_states_the_maxtext_settings_a_report_was_compiled_with():
    """A written report's MaxText settings are the ones it recorded, in its matching keys and its
    notes, whatever today's rule would give (Kimi K2's rule tiles now come with a VMEM flag)."""
    mod = _module()
    p = mod.point_spec("kimi_k2_1t-fsdp8_cp8_ep8")
    p["maxtext_tiles"] = "chosen"
    assert "compile_xla_flags" in mod.maxtext_matching(p)
    recorded = {k: v for k, v in mod.maxtext_matching(p).items() if k != "compile_xla_flags"}
    p = mod.point_spec("kimi_k2_1t-fsdp8_cp8_ep8")
    mod.take_maxtext_settings(p, {"maxtext_tiles": "chosen", "maxtext_matching": recorded})
    assert mod.maxtext_matching(p) == recorded
    assert not any("compile_xla_flags" in n for n in mod.layout_notes(p))
    old = mod.point_spec("kimi_k2_1t-fsdp8_cp8_ep8")
    mod.take_maxtext_settings(old, {})             # a report from before the tile rule
    assert not any("_tile_" in k for k in mod.maxtext_matching(old))
