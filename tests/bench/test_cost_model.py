"""The one analytic cost model of Mosaic calls (pallas_kernels/cost.py's formulas, applied by
experiments/bench/tpu_aot.py to each call of each side's optimized HLO): FLOPs and HBM bytes of a
tiny point of each kernel family against hand-computed figures, the HLO reader on a hand-built
custom-call line, and the swap of self-reported kernel time for the model's. CPU only: no
compile, no libtpu."""
import importlib.util
import json
import os

import pytest

from pallas_kernels.cost import (XLA_ROOFLINE, attention_block_visits, flash_traffic, gmm_cost, gmm_traffic,
                                 tgmm_cost, tgmm_traffic)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _aot():
    spec = importlib.util.spec_from_file_location("tpu_aot", os.path.join(ROOT, "experiments", "bench", "tpu_aot.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_gmm_reads_lhs_per_n_tile_and_rhs_per_visit_when_k_is_tiled():
    m, k, n, g = 512, 256, 384, 4
    # tiles: m 4, k 2, n 3; visits 4 + 4 - 1 = 7; K tiled, so rhs's [K, N] block is fetched per visit
    t = gmm_traffic(m, k, n, g, (128, 128, 128), "bfloat16", "bfloat16", "float32")
    # every visit multiplies a whole [128, 256] x [256, 384] tile: 7 visits of 128 rows, not 512 rows
    assert t["flops"] == 2 * 7 * 128 * 256 * 384 > 2 * 512 * 256 * 384   # more than the useful work
    assert t["bytes"] == 512 * 256 * 2 * 3 + 7 * 256 * 384 * 2 + 512 * 384 * 4
    # K in one tile: a group's block stays put across its visits, rhs read once
    t = gmm_traffic(m, k, n, g, (128, 256, 128), "bfloat16", "bfloat16", "float32")
    assert t["bytes"] == 512 * 256 * 2 * 3 + 4 * 256 * 384 * 2 + 512 * 384 * 4
    ce = gmm_cost(m, k, n, g, "bfloat16", "bfloat16", "float32", tiling=(128, 128, 128))
    assert (ce.flops, ce.bytes_accessed) == (2 * 7 * 128 * 256 * 384, 512 * 256 * 2 * 3 + 7 * 256 * 384 * 2
                                             + 512 * 384 * 4)
    # N = 300 padded to 3 tiles of 128: the MXU multiplies the padding too
    assert gmm_traffic(m, k, 300, g, (128, 256, 128), "bfloat16", "bfloat16", "float32")["flops"] == \
        2 * 7 * 128 * 256 * 384


def test_tgmm_reads_lhs_per_n_tile_and_dy_per_k_tile():
    m, k, n, g = 512, 256, 384, 4
    t = tgmm_traffic(m, k, n, g, (128, 128, 128), "bfloat16", "bfloat16", "float32")
    assert t["flops"] == 2 * 7 * 128 * 256 * 384
    assert t["bytes"] == 512 * 256 * 2 * 3 + 512 * 384 * 2 * 2 + 4 * 256 * 384 * 4
    ce = tgmm_cost(m, k, n, g, "bfloat16", "bfloat16", "float32", tiling=(128, 128, 128))
    assert ce.bytes_accessed == t["bytes"]


def test_flash_rereads_kv_per_query_block_over_the_causal_blocks():
    b, h, kh, L, d = 1, 4, 2, 1024, 128
    # 2 x 2 blocks of 512: causal keeps (0,0), (1,0), (1,1)
    assert attention_block_visits(L, L, 512, 512, causal=True, by_position=False) == 3
    assert attention_block_visits(L, L, 512, 512, causal=False, by_position=False) == 4
    assert attention_block_visits(L, 4 * L, 512, 512, causal=True, by_position=True) == 8
    pairs = 4 * 1024 * 1025 // 2
    q = o = 1 * 4 * 1024 * 128 * 2
    k = v = 1 * 2 * 1024 * 128 * 2
    rows = 4 * 1024 * 4
    kv_reread = 4 * 3 * 512 * 256 * 2            # per q head, 3 visited key blocks of k and v
    q_reread = 4 * 3 * 512 * (256 * 2 + 8)       # per q head, 3 visited query blocks of q, dO, lse, delta
    t = flash_traffic("fwd", b, h, kh, L, L, d, d, causal=True, by_position=False, bq=512, bk=512, dtype="bfloat16")
    assert (t["flops"], t["bytes"]) == (2 * pairs * 256, q + o + rows + kv_reread)
    t = flash_traffic("dq", b, h, kh, L, L, d, d, causal=True, by_position=False, bq=512, bk=512, dtype="bfloat16")
    assert (t["flops"], t["bytes"]) == (pairs * 6 * 128, 2 * q + o + 2 * rows + kv_reread)
    t = flash_traffic("dkv", b, h, kh, L, L, d, d, causal=True, by_position=False, bq=512, bk=512, dtype="bfloat16")
    assert (t["flops"], t["bytes"]) == (4 * pairs * 256, 2 * (k + v) + q_reread)
    t = flash_traffic("dkv", b, h, kh, L, L, d, d, causal=True, by_position=False, bq=512, bk=512, dtype="bfloat16",
                      fused_dq=True)
    assert (t["flops"], t["bytes"]) == (4 * pairs * 256 + 2 * pairs * 128, 2 * (k + v) + q_reread + q)


# An optimized-HLO Mosaic call as XLA prints it (body left out: the kernel's tiling then comes
# from the record's blocks, which the driver reads from the body).
HLO_LINE = ('  %_lambda_.1 = bf16[1024,2048]{1,0:T(8,128)(2,1)} custom-call(%a, %b, %c, %d, %e, %lhs, %rhs), '
            'custom_call_target="tpu_custom_call", operand_layout_constraints={s32[7]{0}, s32[7]{0}, s32[7]{0}, '
            's32[5]{0}, s32[5]{0}, bf16[1024,512]{1,0}, bf16[4,512,2048]{2,1,0}}, metadata={op_name="x"}, '
            'backend_config={"custom_call_config":{"body":"","cost_estimate":{"flops":"2147483648",'
            '"transcendentals":"0","bytes_accessed":"13631488"}}}')


def test_hlo_reader_takes_operands_outputs_and_the_authors_estimate():
    calls = _aot().mosaic_calls(HLO_LINE + "\n" + HLO_LINE.replace("%_lambda_.1", "%_lambda_.2") + "\n  %x = f32[2] add(%y, %z)")
    assert len(calls) == 1 and calls[0]["count"] == 2
    c = calls[0]
    assert c["outputs"] == [["bf16", [1024, 2048]]]
    assert c["operands"][5:] == [["bf16", [1024, 512]], ["bf16", [4, 512, 2048]]] and len(c["operands"]) == 7
    assert c["cost_estimate"] == {"flops": 2147483648.0, "bytes_accessed": 13631488.0, "transcendentals": 0.0}


def _gmm_record(est):
    return {"kernel": "_gmm_kernel", "count": 3, "scalar_prefetch": 5, "scratch": 1,
            "operands": [["s32", [7]]] * 3 + [["s32", [5]]] * 2 + [["bf16", [1024, 512]], ["bf16", [4, 512, 2048]]],
            "outputs": [["bf16", [1024, 2048]]],
            "blocks": [["vmem", "bf16", [256, 512]], ["vmem", "bf16", [1, 512, 1024]], ["vmem", "bf16", [256, 1024]],
                       ["vmem", "f32", [256, 1024]]],
            "cost_estimate": est}


def test_model_of_a_c2jax_gmm_call_is_what_the_kernel_now_self_reports():
    aot = _aot()
    ce = gmm_cost(1024, 512, 2048, 4, "bfloat16", "bfloat16", "bfloat16", tiling=(256, 512, 1024))
    m = aot.call_model(_gmm_record(None))
    assert m["kind"] == "gmm" and (m["flops"], m["bytes"]) == (ce.flops, ce.bytes_accessed)
    # tiles n 2, k 1: lhs twice, rhs once, out once
    assert ce.bytes_accessed == 1024 * 512 * 2 * 2 + 4 * 512 * 2048 * 2 + 1024 * 2048 * 2


def test_model_of_megablox_and_splash_calls():
    aot = _aot()
    # megablox's transposed-rhs gmm ([G, N, K]) with an aliased output input, 512 x 1024 x 1024 tiles
    rec = {"kernel": "gmm", "scalar_prefetch": 4,
           "operands": [["s32", [9]]] * 4 + [["bf16", [4096, 768]], ["bf16", [16, 2048, 768]]],
           "outputs": [["bf16", [4096, 2048]]],
           "blocks": [["vmem", "bf16", [512, 768]], ["vmem", "bf16", [1, 1024, 768]], ["vmem", "bf16", [512, 1024]]]}
    m = aot.call_model(rec)
    # 8 row tiles + 15 straddles = 23 visits of 512 rows; K = 768 in one tile, N in 2 tiles of 1024
    assert m["kind"] == "gmm" and m["flops"] == 2 * 23 * 512 * 768 * 2048
    assert m["bytes"] == 4096 * 768 * 2 * 2 + 16 * 768 * 2048 * 2 + 4096 * 2048 * 2
    # megablox tgmm: [M, K]^T x [M, N] -> [G, K, N]
    rec = {"kernel": "tgmm", "scalar_prefetch": 4,
           "operands": [["s32", [9]]] * 4 + [["bf16", [4096, 2048]], ["bf16", [4096, 768]]],
           "outputs": [["f32", [16, 2048, 768]]],
           "blocks": [["vmem", "bf16", [512, 1024]], ["vmem", "bf16", [512, 768]], ["vmem", "f32", [1, 1024, 768]]]}
    m = aot.call_model(rec)
    assert m["kind"] == "tgmm" and m["flops"] == 2 * 23 * 512 * 2048 * 768
    assert m["bytes"] == 4096 * 2048 * 2 * 1 + 4096 * 768 * 2 * 2 + 16 * 2048 * 768 * 4
    # splash forward as MaxText's optimized HLO holds it (two mask-info prefetch operands; q, k, v,
    # segment ids; out and lse; three scratch buffers), 512-blocks
    blk = lambda *s: ["vmem", "bf16", list(s)]
    rec = {"kernel": "splash_mha_fwd_segmented_residuals", "scalar_prefetch": 2, "scratch": 3,
           "operands": [["s8", [1, 1, 1]]] * 2 + [["bf16", [1, 4, 1024, 128]], ["bf16", [1, 2, 1024, 128]],
                                                  ["bf16", [1, 2, 1024, 128]], ["s32", [1, 1024, 128]]],
           "outputs": [["bf16", [1, 4, 1024, 128]], ["f32", [1, 4, 1024, 128]]],
           "blocks": [blk(1, 1, 512, 128)] * 3 + [["vmem", "i32", [1, 512, 128]], blk(1, 1, 512, 128),
                                                  ["vmem", "f32", [1, 1, 512, 128]]] + [["vmem", "f32", [512, 128]]] * 3}
    m = aot.call_model(rec)
    want = flash_traffic("fwd", 1, 4, 2, 1024, 1024, 128, 128, causal=True, by_position=False, bq=512, bk=512,
                         dtype="bfloat16")
    assert m["kind"] == "fwd" and (m["flops"], m["bytes"]) == (want["flops"], want["bytes"])
    assert aot.call_model({"kernel": "decode_heads_kernel", "operands": [], "outputs": []}) is None


def test_one_model_swaps_self_reported_kernel_time_for_the_models():
    aot = _aot()
    r = XLA_ROOFLINE["v5p"]
    est = {"flops": 1e9, "bytes_accessed": 1e7, "transcendentals": 0.0}
    comp = {"status": "ok", "cost": {"optimal_seconds": 1.0, "flops": 1e12, "bytes_accessed": 1e11},
            "mosaic_calls": [_gmm_record(est)]}
    ce = gmm_cost(1024, 512, 2048, 4, "bfloat16", "bfloat16", "bfloat16", tiling=(256, 512, 1024))
    f = aot.one_model_figures(comp, "v5p")
    self_s = 3 * max(1e9 / r["flops_per_s"], 1e7 / r["bytes_per_s"])
    model_s = 3 * max(ce.flops / r["flops_per_s"], ce.bytes_accessed / r["bytes_per_s"])
    assert f["optimal_seconds"] == pytest.approx(1.0 - self_s + model_s)
    assert f["flops"] == pytest.approx(1e12 - 3e9 + 3 * ce.flops)
    assert f["bytes_accessed"] == pytest.approx(1e11 - 3e7 + 3 * ce.bytes_accessed)
    # a call without an estimate counted nothing in XLA's figure: the model's time is added
    comp["mosaic_calls"] = [_gmm_record(None)]
    assert aot.one_model_figures(comp, "v5p")["optimal_seconds"] == pytest.approx(1.0 + model_s)


def test_maxtext_matching_settings():
    aot = _aot()
    ov = lambda name: dict(o.split("=", 1) for o in aot.maxtext_overrides(aot.point_spec(name), 2, True))
    assert ov("qwen3_30b_a3b-fsdp64")["shard_exp_on_fsdp"] == "true"
    assert "ragged_buffer_factor" not in ov("qwen3_30b_a3b-fsdp64")
    assert ov("qwen3_30b_a3b-fsdp64-head_chunks8")["num_vocab_tiling"] == "8"
    assert ov("qwen3_30b_a3b-fsdp8_ep8")["ragged_buffer_factor"] == "2.0"
    assert ov("qwen3_30b_a3b-fsdp8_ep8-ragged")["ragged_buffer_factor"] == "-1.0"
    assert "shard_exp_on_fsdp" not in ov("qwen3_30b_a3b-fsdp8_ep8")
    json.dumps(aot.point_spec("qwen3_30b_a3b-fsdp8_ep8"))


def test_maxtext_tiles_at_matching_settings_are_the_tile_rules_for_its_call_shapes():
    """--maxtext-tiles chosen hands MaxText, per megablox call (wi / wo x fwd / dlhs / drhs), the tiles
    c2jax's rule picks for that call's shape; its rows are those MaxText's compiled calls hold."""
    import jax.numpy as jnp
    from pallas_kernels.gmm.tpu import choose_tiling
    aot = _aot()
    p = aot.point_spec("qwen3_30b_a3b-fsdp8_ep8")
    rows, g = aot.maxtext_gmm_rows(p)
    # MaxText's receive buffer: 64 x 4096 tokens / 64 chips x top-8 x ragged_buffer_factor 2, over 16 local experts
    assert (rows, g) == (65536, 16)
    assert aot.maxtext_gmm_rows(aot.point_spec("qwen3_30b_a3b-fsdp64")) == (32768, 128)
    assert "wi_tile_fwd_batch_seq" not in aot.maxtext_matching(p)   # base.yml's unless asked
    p["maxtext_tiles"] = "chosen"
    ov = aot.maxtext_matching(p)
    bf = jnp.dtype(jnp.bfloat16)
    d, f = 2048, 768
    tm, tk, tn = choose_tiling("gmm", rows, f, d, g, bf, bf, bf)          # down projection [rows, F] x [F, D]
    assert (ov["wo_tile_fwd_batch_seq"], ov["wo_tile_fwd_mlp_dim"], ov["wo_tile_fwd_embed_dim"]) == (tm, tk, tn)
    tm, tk, tn = choose_tiling("tgmm", rows, d, f, g, bf, bf, bf)         # gate / up weight gradient
    assert (ov["wi_tile_drhs_batch_seq"], ov["wi_tile_drhs_embed_dim"], ov["wi_tile_drhs_mlp_dim"]) == (tm, tk, tn)
    assert len([k for k in ov if "_tile_" in k]) == 18
    # megablox sets no VMEM limit: tiles past the compiler's default scope come with MaxText's flag for
    # the limit c2jax's kernels ask for (Kimi K2's whole-K blocks), and only then
    fsdp = aot.point_spec("qwen3_30b_a3b-fsdp64")
    fsdp["maxtext_tiles"] = "chosen"
    assert "compile_xla_flags" not in aot.maxtext_matching(fsdp)
    kimi = aot.point_spec("kimi_k2_1t-fsdp8_cp8_ep8")
    kimi["maxtext_tiles"] = "chosen"
    assert aot.maxtext_matching(kimi)["compile_xla_flags"] == "--xla_tpu_scoped_vmem_limit_kib=49152"
    assert any("same rule's tiles" in n for n in aot.layout_notes(p))
