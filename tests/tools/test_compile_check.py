"""compile-check: AOT-compile the real train step and a decode step for a TPU topology through
libtpu on this CPU machine (tiny pod config, 8 v5p chips), and bad requests fail early."""
import os

import pytest

from c2jax.config import ConfigError, load_config_file
from c2jax.tools import compile_check

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "configs", "pods", "tiny_v5p_8.py")

pytest.importorskip("libtpu")


@pytest.fixture(scope="module")
def tiny_report():
    return compile_check.main(load_config_file(TINY))


def test_tiny_pod_config_compiles_and_fits(tiny_report):
    report = tiny_report
    assert report["chips"] == 8 and report["chip"] == "v5p"
    assert report["mesh"] == {"data": 2, "fsdp": 2, "context": 2, "expert": 1}
    for step in ("train", "decode"):
        s = report[step]
        assert s["fits"] and 0 < s["peak_gib"] < report["hbm_per_chip_gib"]
        assert s["flops_per_chip"] > 0 and s["step_s_at_peak"] > 0 and s["xla_flops_per_chip"] > 0
    # no loops to undercount here (1 dense + 1 MoE layer, one query chunk): the compiled train
    # step's FLOPs agree with the 6N + attention estimate within 3x
    ratio = report["train"]["xla_flops_per_chip"] * report["chips"] / report["train"]["flops_per_step"]
    assert 0.5 < ratio < 3, ratio
    assert "FITS" in compile_check.format_report(report)
    # the breakdown: donated arguments = params + optimizer state, temp = grads + the rest
    tr = report["train"]
    assert abs(tr["arguments_gib"] - tr["params_gib"] - tr["optimizer_gib"]) < 0.01 * tr["arguments_gib"] + 1e-3
    assert tr["grads_gib"] == tr["params_gib"] and tr["activations_gib"] == tr["temp_gib"] - tr["grads_gib"]
    assert "activations/workspace" in compile_check.format_report(report)
    assert report["fits"] and report["advice"] == ""


def test_does_not_fit_names_the_fix(tiny_report):
    cfg = load_config_file(TINY)
    cfg.pod.hbm_headroom = 1e-7          # pretend the chips are tiny
    report = compile_check.judge(cfg, dict(tiny_report, train=dict(tiny_report["train"]),
                                           decode=dict(tiny_report["decode"])))
    assert not report["fits"]
    with pytest.raises(ConfigError, match="GiB per chip.*(remat|fsdp|batch_size)"):
        compile_check.check(cfg, report=report)


def test_bad_requests_fail_before_compiling():
    cfg = load_config_file(TINY)
    with pytest.raises(ConfigError, match="device count 4"):
        compile_check.main(cfg, "v5p:2x2x1")                     # mesh needs 8 chips, topology has 4
    cfg = load_config_file(TINY)
    cfg.train.seq_len = 250
    with pytest.raises(ConfigError, match="2\\*CP"):
        compile_check.main(cfg)
    cfg = load_config_file(TINY)
    cfg.model.num_experts, cfg.model.num_experts_per_tok = 6, 2   # EP = data 2 x context 2 = 4
    with pytest.raises(ConfigError, match="num_experts=6"):
        compile_check.main(cfg)
    with pytest.raises(ConfigError, match="unknown TPU chip"):
        compile_check.main(load_config_file(TINY), "h100:8")


def test_chunked_head_cuts_the_train_steps_temp_memory():
    # a 32K vocab makes the [tokens, V] float32 logits the largest activation: computed over the
    # sequence in 4 chunks, only one chunk's logits and gradient are live
    temp = {}
    for chunks in (1, 4):
        cfg = load_config_file(TINY + ":gqa")
        cfg.model.vocab_size = 32768
        cfg.model.head_chunks = chunks
        cfg.pod.compile_decode = False
        temp[chunks] = compile_check.main(cfg)["train"]["temp_gib"]
    assert temp[4] < 0.7 * temp[1], temp


def test_head_gradient_stays_float32_in_the_tpu_program():
    """bf16 compute: the TPU train step (auto: head_grad float32) holds no bf16 [tokens, V] array,
    the logits gradient stays in the float32 logits' shape; pinned to compute_dtype it casts the
    gradient to a bf16 [tokens, V] copy. (Which one has the smaller peak depends on the program;
    at Qwen3-30B-A3B FSDP 64 it is float32's: experiments/results/tpu_aot.)"""
    import re

    from c2jax.ops.registry import record_choices
    from c2jax.parallel.mesh import make_mesh
    seen = {}
    for choice in ("auto", "compute_dtype"):
        cfg = load_config_file(TINY + ":gqa")
        cfg.model.vocab_size = 32768
        cfg.model.kernels.head_grad = choice
        assert cfg.model.dtype == "bfloat16"
        mesh = make_mesh(cfg, compile_check.topology_devices(cfg.pod.topology))
        with record_choices() as rec:
            lowered = compile_check.compile_train_step(cfg, mesh, compile_check.abstract_train_state(cfg, mesh))
        compiled, oom = compile_check._compile(lowered)
        assert compiled is not None, oom
        shapes = set(re.findall(r"\b(bf16|f32)\[(\d+),32768\]", compiled.as_text()))
        seen[choice] = (rec["head_grad"], shapes)
    (auto_rec, auto_shapes), (cast_rec, cast_shapes) = seen["auto"], seen["compute_dtype"]
    assert auto_rec == {"float32": 1} and cast_rec == {"compute_dtype": 1}
    # the float32 logits' rows per chip: the largest [n, V] (the others are head-weight shards)
    tokens = str(max(int(n) for dt, n in cast_shapes if dt == "f32"))
    assert int(tokens) > cfg.model.hidden_size and ("bf16", tokens) in cast_shapes, cast_shapes
    assert ("f32", tokens) in auto_shapes and ("bf16", tokens) not in auto_shapes, auto_shapes
