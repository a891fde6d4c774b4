"""Ahead-of-time compile of every Mosaic kernel for real TPU topologies (v5p, v6e) through libtpu on
this CPU machine, at production shapes and default block sizes; checks HBM use from
memory_analysis() and the kernels' scoped VMEM against the chip's capacity."""
# Dim letters: M rows, K contraction, N output, G local experts, B batch, H q heads, Hk kv heads,
# L length, D q/k head dim, Dv v head dim, S cache length.
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import SingleDeviceSharding

from pallas_kernels.decode_attention.tpu import decode_attention_tpu, mla_decode_attention_tpu
from pallas_kernels.flash_attention import tpu as fa
from pallas_kernels.gmm import tpu as gmm_tpu
from pallas_kernels.qmatmul.reference import QuantizedWeight
from pallas_kernels.qmatmul.tpu import qmatmul_tpu

topologies = pytest.importorskip("jax.experimental.topologies")
BF = jnp.bfloat16
MiB = 2**20
VMEM_CAPACITY = {"v5p": 64 * MiB, "v6e": 128 * MiB}  # per TensorCore (jax._src.tpu_info)
HBM_CAPACITY = {"v5p": 95 * 2**30, "v6e": 32 * 2**30}
TOPOLOGY = {"v5p": "v5p:2x2x1", "v6e": "v6e:2x2"}


pytestmark = pytest.mark.usefixtures("no_persistent_cache")


def _device(chip):
    try:
        return topologies.get_topology_desc(platform="tpu", topology_name=TOPOLOGY[chip]).devices[0]
    except (RuntimeError, ValueError, ImportError) as e:  # libtpu missing or too old
        pytest.skip(f"no TPU topology for {chip}: {e}")


def _compile(chip, fn, *shapes):
    s = SingleDeviceSharding(_device(chip))
    args = [None if sh is None else jax.ShapeDtypeStruct(sh[0], sh[1], sharding=s) for sh in shapes]
    compiled = jax.jit(fn).lower(*args).compile()
    ma = compiled.memory_analysis()
    vmem = [int(x) for x in re.findall(r'"scoped_memory_configs":\[\{"memory_space":"1","offset":"0","size":"(\d+)"',
                                        compiled.as_text())]
    assert vmem, "no Mosaic custom call found"
    assert max(vmem) <= VMEM_CAPACITY[chip]
    bits = lambda dt: 4 if jnp.dtype(dt) == jnp.float4_e2m1fn else 8 * jnp.dtype(dt).itemsize
    nbytes = sum(int(jnp.prod(jnp.array(sh[0]))) * bits(sh[1]) // 8 for sh in shapes if sh is not None)
    assert ma.argument_size_in_bytes >= nbytes
    total = ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes
    assert total < HBM_CAPACITY[chip]
    return ma, max(vmem)


# Kimi-K2.5-like expert shapes: hidden 7168, expert width 2048, 384/8 = 48 local experts.
M, K, N, G = 8192, 7168, 2048, 48


@pytest.mark.parametrize("chip", ["v5p", "v6e"])
def test_gmm_and_tgmm_compile(chip):
    ma, vmem = _compile(chip, lambda a, b, g: gmm_tpu.gmm_tpu(a, b, g), ((M, K), BF), ((G, K, N), BF), ((G,), jnp.int32))
    assert ma.output_size_in_bytes == M * N * 4
    assert ma.temp_size_in_bytes < 16 * MiB   # nothing dense materialized (ragged_dot would be G x)
    assert gmm_tpu.gmm_vmem_bytes(gmm_tpu.DEFAULT_TILING, BF, BF, jnp.float32) <= vmem
    ma, _ = _compile(chip, lambda a, b, g: gmm_tpu.gmm_tpu(a, b, g, transpose_rhs=True),
                     ((M, N), BF), ((G, K, N), BF), ((G,), jnp.int32))
    assert ma.temp_size_in_bytes < 16 * MiB
    ma, _ = _compile(chip, lambda a, d, g: gmm_tpu.tgmm_tpu(a, d, g), ((M, K), BF), ((M, N), BF), ((G,), jnp.int32))
    assert ma.output_size_in_bytes == G * K * N * 4
    assert ma.temp_size_in_bytes < 16 * MiB  # empty groups: zeros aliased into the output, no copy


@pytest.mark.parametrize("chip,quant", [("v5p", "mxfp8"), ("v5p", "nvfp4"), ("v6e", "int8"), ("v6e", "nvfp4")])
def test_quantized_gmm_compiles(chip, quant):
    blk = {"mxfp8": 32, "nvfp4": 16, "int8": 1}[quant]
    vdt = jnp.float8_e4m3fn if quant == "mxfp8" else jnp.int8  # E2M1 travels as int8 codes
    sdt = jnp.float8_e8m0fnu if quant == "mxfp8" else jnp.float8_e4m3fn
    if blk > 1:
        fn = lambda lv, ls, rv, rs, g: gmm_tpu.gmm_quantized_tpu(lv, ls, rv, rs, g, blk=blk)
        shapes = (((M, K), vdt), ((K // blk, M), sdt), ((G, K, N), vdt), ((G, K // blk, N), sdt), ((G,), jnp.int32))
    else:
        fn = lambda lv, rv, g: gmm_tpu.gmm_quantized_tpu(lv, None, rv, None, g, blk=1)
        shapes = (((M, K), vdt), ((G, K, N), vdt), ((G,), jnp.int32))
    ma, _ = _compile(chip, fn, *shapes)
    assert ma.argument_size_in_bytes < 0.6 * (M * K + G * K * N) * 2  # about half the bf16 operands
    assert ma.temp_size_in_bytes < 64 * MiB  # no dequantized copy of the weights


def test_mxfp8_tgmm_compiles():
    e4, e8 = jnp.float8_e4m3fn, jnp.float8_e8m0fnu
    ma, _ = _compile("v5p", lambda a, b, c, d, g: gmm_tpu.tgmm_mxfp8_tpu(a, b, c, d, g),
                     ((M, K), e4), ((M // 32, K), e8), ((M, N), e4), ((M // 32, N), e8), ((G,), jnp.int32))
    assert ma.output_size_in_bytes == G * K * N * 4
    assert ma.temp_size_in_bytes < 64 * MiB


@pytest.mark.parametrize("chip,kind", [("v5p", "gqa"), ("v5p", "mla"), ("v6e", "mla")])  # kept short
def test_flash_attention_compiles(chip, kind):
    B, H, L = 1, 16, 8192
    D, Dv, Hk = (128, 128, 4) if kind == "gqa" else (192, 128, 16)
    q, k, v = ((B, H, L, D), BF), ((B, Hk, L, D), BF), ((B, Hk, L, Dv), BF)
    seg = ((B, L), jnp.int32)
    ma, _ = _compile(chip, lambda q, k, v, s: fa.flash_fwd_tpu(q, k, v, s, causal=True, sm_scale=0.1), q, k, v, seg)
    # No L x L scores; lse/delta/segment ids are stored as rows. D=192 (MLA) is not a multiple of 128
    # lanes: XLA relayouts q and k to 256-wide tiles before the kernel (q, k, dq, dk: up to four padded copies).
    limit = 16 * MiB + (0 if D % 128 == 0 else 4 * B * H * L * 256 * 2)
    assert ma.temp_size_in_bytes < limit
    ma, _ = _compile(chip, lambda q, k, v, s, o, lse, do: fa.flash_bwd_tpu(q, k, v, s, o, lse, do, causal=True, sm_scale=0.1),
                     q, k, v, seg, ((B, H, L, Dv), BF), ((B, H, 1, L), jnp.float32), ((B, H, L, Dv), BF))
    assert ma.temp_size_in_bytes < limit
    assert ma.output_size_in_bytes >= 2 * (B * H * L * D + B * Hk * L * (D + Dv))


def test_flash_attention_positions_compiles():
    """Context parallelism: 8192 local queries against 16384 all-gathered keys, causal by explicit
    positions with separate query / key segment ids; the block-skip schedule sits in SMEM."""
    B, H, Hk, L, S, D = 1, 16, 4, 8192, 16384, 128
    q, k, v = ((B, H, L, D), BF), ((B, Hk, S, D), BF), ((B, Hk, S, D), BF)
    ql, ks = ((B, L), jnp.int32), ((B, S), jnp.int32)
    fwd = lambda q, k, v, qs, kvs, qp, kp: fa.flash_fwd_tpu(q, k, v, qs, kvs, qp, kp, causal=True, sm_scale=0.1)
    ma, _ = _compile("v5p", fwd, q, k, v, ql, ks, ql, ks)
    assert ma.temp_size_in_bytes < 16 * MiB
    bwd = lambda q, k, v, qs, kvs, qp, kp, o, lse, do: fa.flash_bwd_tpu(
        q, k, v, qs, o, lse, do, kv_seg_BS=kvs, q_pos_BL=qp, kv_pos_BS=kp, causal=True, sm_scale=0.1)
    ma, _ = _compile("v5p", bwd, q, k, v, ql, ks, ql, ks, ((B, H, L, D), BF), ((B, H, 1, L), jnp.float32),
                     ((B, H, L, D), BF))
    assert ma.temp_size_in_bytes < 16 * MiB


@pytest.mark.parametrize("chip", ["v5p", "v6e"])
def test_decode_attention_compiles(chip):
    B, H, Hk, S, D = 32, 64, 8, 8192, 128
    ma, _ = _compile(chip, lambda q, k, v, l: decode_attention_tpu(q, k, v, l, sm_scale=0.1),
                     ((B, H, D), BF), ((B, Hk, S, D), BF), ((B, Hk, S, D), BF), ((B,), jnp.int32))
    assert ma.temp_size_in_bytes < 16 * MiB   # the cache is read in place, never copied
    # the model's [B, S, Hk, D] cache: read in place too (each head a 128-lane window of a row)
    ma, _ = _compile(chip, lambda q, k, v, l: decode_attention_tpu(q, k, v, l, sm_scale=0.1, cache_layout="BSKD"),
                     ((B, H, D), BF), ((B, S, Hk, D), BF), ((B, S, Hk, D), BF), ((B,), jnp.int32))
    assert ma.temp_size_in_bytes < 16 * MiB


@pytest.mark.parametrize("chip", ["v5p", "v6e"])
def test_mla_decode_attention_compiles(chip):
    B, H, S, C, R = 32, 64, 32768, 512, 64    # Kimi K2: 64 heads over a 512 + 64 latent cache
    fn = lambda qa, qr, c, r, l: mla_decode_attention_tpu(qa, qr, c, r, l, sm_scale=0.1)  # noqa: E731
    shapes = ((B, H, C), BF), ((B, H, R), BF), ((B, S, C), BF), ((B, S, R), BF), ((B,), jnp.int32)
    ma, _ = _compile(chip, fn, *shapes)
    # the latent cache is read in place; the 64-wide rope cache's default TPU layout puts S minor,
    # so a program argument is relaid out once (inside a decode loop the carry takes the kernel's)
    assert ma.temp_size_in_bytes <= 16 * MiB + B * S * 128 * 2
    s = SingleDeviceSharding(_device(chip))
    hlo = jax.jit(fn).lower(*[jax.ShapeDtypeStruct(a, b, sharding=s) for a, b in shapes]).compile().as_text()
    assert not re.search(rf"= bf16\[{B},{S},{C}\]\S* copy", hlo)


@pytest.mark.parametrize("chip,quant,mode", [
    ("v5p", "mxfp8", "weight_only"), ("v5p", "nvfp4", "weight_only"), ("v6e", "int8", "weight_only"),
    ("v6e", "int8", "weight_act"),
])
def test_qmatmul_compiles(chip, quant, mode):
    m = 4096 if mode == "weight_only" else 512
    vdt = {"int8": jnp.int8, "mxfp8": jnp.float8_e4m3fn, "nvfp4": jnp.float4_e2m1fn}[quant]
    bs = {"int8": None, "mxfp8": ((K // 32, N), jnp.float8_e8m0fnu), "nvfp4": ((K // 16, N), jnp.float8_e4m3fn)}[quant]
    cs = None if quant == "mxfp8" else ((N,), jnp.float32)
    ma, _ = _compile(chip, lambda x, v, b, c: qmatmul_tpu(x, QuantizedWeight(v, b, c, quant), mode),
                     ((m, K), BF), ((K, N), vdt), bs, cs)
    assert ma.output_size_in_bytes == m * N * 4
    if mode == "weight_only":
        # the weight stays 1 byte/value in HBM (E2M1 is widened to int8 codes once): no bf16 copy
        assert ma.temp_size_in_bytes < K * N * 2


def _cost(chip, fn, *shapes):
    s = SingleDeviceSharding(_device(chip))
    args = [jax.ShapeDtypeStruct(sh[0], sh[1], sharding=s) for sh in shapes]
    ca = jax.jit(fn).lower(*args).compile().cost_analysis()
    return ca[0] if isinstance(ca, list) else ca


def test_kernel_cost_estimates_reach_the_compiled_program():
    """Each training kernel hands XLA its matmul FLOPs (without them the compiled program counts a
    Mosaic call as free): the compiled FLOPs cover the kernel's and add only the few elementwise
    ops around it (padding, slicing, the backward's delta)."""
    from pallas_kernels.cost import attention_pairs
    m, k, n, g = 2048, 1024, 512, 8
    from pallas_kernels.cost import gmm_traffic, tgmm_traffic
    ca = _cost("v5p", lambda a, b, gs: gmm_tpu.gmm_tpu(a, b, gs, preferred_element_type=BF),
               ((m, k), BF), ((g, k, n), BF), ((g,), jnp.int32))
    tiles = gmm_tpu.choose_tiling("gmm", m, k, n, g, jnp.dtype(BF), jnp.dtype(BF), jnp.dtype(BF))
    mxu = gmm_traffic(m, k, n, g, tiles, BF, BF, BF)["flops"]   # whole tiles per visit (straddles included)
    assert 2 * m * k * n <= mxu <= ca["flops"] < mxu + 0.05 * 2 * m * k * n
    assert ca["bytes accessed"] >= (m * k + g * k * n + m * n) * 2
    ca = _cost("v5p", lambda a, d, gs: gmm_tpu.tgmm_tpu(a, d, gs), ((m, k), BF), ((m, n), BF), ((g,), jnp.int32))
    tiles = gmm_tpu.choose_tiling("tgmm", m, k, n, g, jnp.dtype(BF), jnp.dtype(BF), jnp.dtype(jnp.float32))
    mxu = tgmm_traffic(m, k, n, g, tiles, BF, BF, jnp.float32)["flops"]
    assert 2 * m * k * n <= mxu <= ca["flops"] < mxu + 0.05 * 2 * m * k * n

    B, H, Hk, L, D = 1, 8, 2, 2048, 128
    p = attention_pairs(B, H, L, L, causal=True, by_position=False)
    assert p == B * H * L * (L + 1) // 2
    q, kv, seg = ((B, H, L, D), BF), ((B, Hk, L, D), BF), ((B, L), jnp.int32)
    ca = _cost("v5p", lambda q, k, v, s: fa.flash_fwd_tpu(q, k, v, s, causal=True, sm_scale=0.1), q, kv, kv, seg)
    assert 4 * p * D <= ca["flops"] < 1.05 * 4 * p * D
    assert ca["transcendentals"] >= p
    ca = _cost("v5p", lambda q, k, v, s, o, lse, do: fa.flash_bwd_tpu(q, k, v, s, o, lse, do, causal=True,
                                                                        sm_scale=0.1),
               q, kv, kv, seg, q, ((B, H, 1, L), jnp.float32), q)
    bwd = 8 * p * D + 6 * p * D   # dK/dV kernel 4 p (D + E), dQ kernel p (4 D + 2 E); E = D
    assert bwd <= ca["flops"] < 1.05 * bwd
    assert ca["transcendentals"] >= 2 * p


def test_decode_and_qmatmul_cost_estimates_reach_the_compiled_program():
    """The sampler's kernels count too: decode attention over the whole cache (lengths are data),
    MLA decode in the latent space, and the quantized matmul."""
    B, H, Hk, S, D = 4, 16, 4, 2048, 128
    ca = _cost("v5p", lambda q, k, v, l: decode_attention_tpu(q, k, v, l, sm_scale=0.1),
               ((B, H, D), BF), ((B, Hk, S, D), BF), ((B, Hk, S, D), BF), ((B,), jnp.int32))
    assert ca["flops"] >= 2 * B * H * S * 2 * D and ca["transcendentals"] >= B * H * S
    assert ca["bytes accessed"] >= 2 * B * Hk * S * D * 2
    C, R = 512, 64
    ca = _cost("v5p", lambda qa, qr, c, r, l: mla_decode_attention_tpu(qa, qr, c, r, l, sm_scale=0.1),
               ((B, H, C), BF), ((B, H, R), BF), ((B, S, C), BF), ((B, S, R), BF), ((B,), jnp.int32))
    assert ca["flops"] >= 2 * B * H * S * (2 * C + R)
    m, k, n = 256, 1024, 512
    ca = _cost("v5p", lambda x, v, c: qmatmul_tpu(x, QuantizedWeight(v, None, c, "int8"), "weight_only"),
               ((m, k), BF), ((k, n), jnp.int8), ((n,), jnp.float32))
    assert 2 * m * k * n <= ca["flops"] < 1.1 * 2 * m * k * n
