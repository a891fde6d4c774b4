"""compile-check of an RL pod config (configs/pods/tiny_v5p_8.py:rl, 8 v5p chips through libtpu on
this CPU machine): besides the CPT train step and the sampler's decode chunk, the report holds the
real RL learner step (the reference's forward, router replay, AdamW; state donated) and the
learner -> sampler weight move compiled as one program, and says what they contain."""
import os

import pytest

from c2jax.config import ConfigError, load_config_file
from c2jax.tools import compile_check

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "configs", "pods", "tiny_v5p_8.py")

pytest.importorskip("libtpu")


@pytest.fixture(scope="module")
def rl_report():
    return compile_check.main(load_config_file(TINY + ":rl"))


def test_rl_step_runs_the_train_steps_kernels_plus_the_reference_forward(rl_report):
    tr, rl = rl_report["train"], rl_report["rl_step"]
    assert rl["no_grad_forwards"] == {"reference": 1} and rl["router_replay"] and rl["micro_batches"] == 1
    assert set(rl["kernels"]["attention"]) == {"pallas_flash"} and set(rl["kernels"]["experts"]) == {"ep_all_to_all(pallas_gmm)"}
    # every Mosaic kernel of the CPT step, and the reference's forward adds one flash forward and
    # one joined gate/up + one down grouped matmul per layer (1 dense + 1 MoE layer)
    for name, n in tr["mosaic_kernels"].items():
        assert rl["mosaic_kernels"].get(name, 0) >= n, (name, rl["mosaic_kernels"])
    want = dict(tr["mosaic_kernels"])
    want["_fwd_kernel"] += 2
    want["_gmm_kernel"] += 2
    assert rl["mosaic_kernels"] == want and rl["mosaic_calls"] == sum(want.values())
    # the breakdown: the reference is a second params tree in the params' shardings (f32), an
    # argument beside the donated state and the batch
    assert rl["reference_gib"] == rl["params_gib"] == tr["params_gib"] and rl["batch_gib"] > 0
    parts = rl["params_gib"] + rl["optimizer_gib"] + rl["reference_gib"] + rl["batch_gib"]
    assert abs(rl["arguments_gib"] - parts) < 0.01 * rl["arguments_gib"] + 1e-3     # (tiles pad tiny arrays)
    assert rl["arguments_gib"] - tr["arguments_gib"] >= 0.95 * (rl["reference_gib"] + rl["batch_gib"])  # (padding)
    assert rl["activations_gib"] == rl["temp_gib"] - rl["grads_gib"]
    # model FLOPs: the CPT step's 6N + attention (its MTP head included) plus one 2N + attention
    # forward (the reference's, which runs no MTP head: less than a third of the training step)
    assert rl["train_flops_per_step"] == tr["flops_per_step"]
    assert rl["flops_per_step"] == pytest.approx(rl["train_flops_per_step"] + rl["forward_flops_per_step"])
    assert rl_report["params"]["mtp"] > 0 and 0 < rl["forward_flops_per_step"] < tr["flops_per_step"] / 3
    assert rl["step_s_at_peak"] > tr["step_s_at_peak"] and rl["xla_flops_per_chip"] > tr["xla_flops_per_chip"]
    assert rl["fits"] and rl_report["fits"] and rl_report["advice"] == ""
    text = compile_check.format_report(rl_report)
    assert "rl step [RL learner" in text and "reference x1" in text and "1 x (2N + attention)" in text
    # the MTP head trains in both programs (under CP 2): its params in the report and the breakdown
    assert rl_report["params"]["mtp"] > 0 and rl["mtp_params_gib"] > 0 and tr["mtp_params_gib"] > 0
    assert "of which MTP heads" in text and "of which the MTP heads' params" in text


def test_sampler_runs_on_rl_sampler_mesh_shape(rl_report):
    cfg = load_config_file(TINY + ":rl")
    assert tuple(cfg.pod.decode_mesh_shape) == () and cfg.rl.sampler_mesh_shape == (2, 1, 1, 4)
    mesh = dict(zip(cfg.mesh.axes, cfg.rl.sampler_mesh_shape))
    assert rl_report["decode"]["mesh"] == mesh and rl_report["reshard"]["sampler_mesh"] == mesh
    assert rl_report["decode"]["mosaic_kernels"] == {"_gmm_kernel": 2, "_mla_decode_kernel": 2}
    cfg.pod.decode_mesh_shape = (8, 1, 1, 1)      # two fields that disagree on where the sampler runs
    with pytest.raises(ConfigError, match="rl.sampler_mesh_shape"):
        compile_check.decode_mesh_shape(cfg)


def test_reshard_moves_bf16_weights_from_the_learner_layout_to_the_samplers(rl_report):
    rs, tr, dec = rl_report["reshard"], rl_report["train"], rl_report["decode"]
    assert rs["dtype"] == "bfloat16" and rs["fits"] and rs["peak_gib"] > 0
    assert rs["learner_mesh"] == rl_report["mesh"]
    # in: the learner's f32 params in their shardings; out: the sampler's bf16 copy, as the decode
    # step holds it
    assert rs["in_gib_per_chip"] == pytest.approx(tr["params_gib"])
    assert rs["out_gib_per_chip"] == pytest.approx(dec["weights_gib"])
    # FSDP over fsdp x context (8-way on the learner) -> replicated dense weights and experts over
    # data (2-way) on the sampler: each chip holds more than it had (in bf16) and receives most of it
    assert rs["out_gib_per_chip"] > rs["in_gib_per_chip"] / 2
    assert 0.5 * rs["out_gib_per_chip"] < rs["received_gib_per_chip"] < rs["out_gib_per_chip"]
    # gathering FSDP shards is all-gathers (the norm scales' as one all-reduce of zero-padded
    # pieces); nothing is reduced, moved point to point or exchanged all-to-all
    coll = rs["collectives"]
    assert set(coll) == set(compile_check.COLLECTIVES)
    assert coll["all-gather"] >= 10 and coll["reduce-scatter"] == 0 and coll["all-to-all"] == 0
    assert "reshard learner" in compile_check.format_report(rl_report)


def test_collectives_counts_instructions_once():
    text = """
  %all-gather-start = (f32[8]) all-gather-start(%p), replica_groups={}
  %all-gather-done = f32[64] all-gather-done(%all-gather-start)
  %all-reduce.1 = f32[64] all-reduce(%x), to_apply=%add
  %ragged-all-to-all = bf16[8] ragged-all-to-all(%a, %b, %c, %d, %e, %f)
  %cp = f32[8] collective-permute(%y), source_target_pairs={{0,1}}
"""
    assert compile_check.collectives(text) == {"all-gather": 1, "all-to-all": 0, "collective-permute": 1,
                                               "reduce-scatter": 0, "all-reduce": 1}


def test_no_grad_forwards_follow_the_rl_section():
    cfg = load_config_file(TINY + ":rl")
    assert compile_check.rl_no_grad_forwards(cfg) == {"reference": 1}
    cfg.rl.noreplay_metrics = True
    assert compile_check.rl_no_grad_forwards(cfg) == {"reference": 1, "noreplay": 1}
    cfg.rl.kl_coef = 0.0
    assert compile_check.rl_no_grad_forwards(cfg) == {"noreplay": 1}


def test_rl_step_that_does_not_fit_names_the_fix(rl_report):
    cfg = load_config_file(TINY + ":rl")
    cfg.pod.hbm_headroom = 1e-7          # pretend the chips are tiny
    report = compile_check.judge(cfg, {k: dict(v) if isinstance(v, dict) else v for k, v in rl_report.items()})
    assert not report["fits"] and not report["rl_step"]["fits"] and not report["reshard"]["fits"]
    with pytest.raises(ConfigError, match="RL learner step needs .*reference params.*rl.micro_batch_rows"):
        compile_check.check(cfg, report=report)


def test_committed_kimi_rl_report_holds_both_rl_programs_and_the_readme_shows_it():
    """experiments/results/pods/kimi_k2_1t_rl.json (Kimi K2 :rl on v5p:8x8x8, written by its
    `command`): the RL learner step runs every kernel of the CPT step plus the reference's forward
    and fits; the reshard delivers the decode step's weights; the README's RL row is rendered
    from it (experiments/pod_table.py --rl)."""
    import json
    import sys
    path = os.path.join(ROOT, "experiments", "results", "pods", "kimi_k2_1t_rl.json")
    r = json.load(open(path))
    assert r["command"].endswith("--config configs/pods/kimi_k2_1t.py:rl --report "
                                 "experiments/results/pods/kimi_k2_1t_rl.json")
    tr, rl, rs, dec = r["train"], r["rl_step"], r["reshard"], r["decode"]
    assert r["params"]["mtp"] > 0 and tr["mtp_params_gib"] > 0 and rl["mtp_params_gib"] > 0   # the MTP head
    assert r["fits"] and rl["fits"] and rl["peak_gib"] <= 0.9 * r["hbm_per_chip_gib"]
    assert rl["no_grad_forwards"] == {"reference": 1} and rl["router_replay"]
    for name, n in tr["mosaic_kernels"].items():
        assert rl["mosaic_kernels"][name] >= n
    assert rl["mosaic_calls"] > tr["mosaic_calls"]
    assert rl["step_s_at_peak"] == pytest.approx(
        tr["step_s_at_peak"] + rl["forward_flops_per_step"] / r["chips"] / (r["peak_bf16_tflops"] * 1e12))
    assert rs["dtype"] == "bfloat16" and rs["out_gib_per_chip"] == pytest.approx(dec["weights_gib"], rel=1e-3)
    assert rs["in_gib_per_chip"] == pytest.approx(tr["params_gib"]) and rs["collectives"]["all-gather"] > 0
    sys.path.insert(0, os.path.join(ROOT, "experiments"))
    try:
        import pod_table
    finally:
        sys.path.pop(0)
    readme = open(os.path.join(ROOT, "README.md")).read()
    assert pod_table.rl_row(r) in readme
