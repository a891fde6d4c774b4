"""Benchmark every pallas_kernels op against its XLA/jnp reference on the current backend.

Prints achieved TFLOP/s (or GB/s for memory-bound ops) and the fraction of the device's
*measured* peak (a large dense matmul for FLOP/s, a large reduction for GB/s).

    JAX_PLATFORMS=cpu python experiments/bench/kernels.py --size small
    python experiments/bench/kernels.py --size large --json results.json   # on TPU / GPU
"""
# Dim letters: M rows, K contraction, N output, G groups, B batch, H heads, Hk kv heads, L length,
# D q/k head dim, Dv v head dim, S cache length.
from __future__ import annotations

import argparse
import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from pallas_kernels.decode_attention.reference import decode_attention_reference
from pallas_kernels.flash_attention.reference import attention_reference
from pallas_kernels.gmm.reference import gmm_reference

SIZES = {
    # CPU-sized problems (seconds per op); "large" is for accelerators.
    "small": {"M": 2048, "K": 512, "N": 512, "G": 8, "B": 1, "H": 8, "Hk": 2, "L": 1024, "D": 128, "Dv": 128, "S": 4096, "dec_B": 8,
                  "qm_M": 512, "qm_K": 1024, "qm_N": 1024, "mat": 1024, "vec": 2**24},
    "large": {"M": 16384, "K": 7168, "N": 2048, "G": 48, "B": 1, "H": 16, "Hk": 4, "L": 8192, "D": 128, "Dv": 128, "S": 32768,
                  "dec_B": 32, "qm_M": 8192, "qm_K": 7168, "qm_N": 2048, "mat": 8192, "vec": 2**28},
}


def timeit(fn, *args, iters=5):
    """Best wall time (s) of a jitted call after one warm-up (compile) call (min: robust to a shared host)."""
    out = fn(*args)
    jax.block_until_ready(out)
    ts = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t)
    return float(np.min(ts))


def measured_peaks(sz, dtype):
    """(FLOP/s, bytes/s) measured with a dense matmul and a full reduction (read bandwidth)."""
    n = sz["mat"]
    a = jnp.ones((n, n), dtype)
    t = timeit(jax.jit(lambda a: a @ a), a, iters=30)
    flops = 2 * n ** 3 / t
    v = jnp.ones((sz["vec"],), jnp.float32)
    t = timeit(jax.jit(jnp.sum), v, iters=20)  # read bandwidth (a copy also pays page faults on CPU)
    bw = v.nbytes / t
    return flops, bw


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=SIZES, default="small" if jax.default_backend() == "cpu" else "large")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--json", default=None, help="also write the rows to this file")
    args = p.parse_args()
    sz = SIZES[args.size]
    backend = jax.default_backend()
    dt = jnp.float32 if backend == "cpu" else jnp.bfloat16  # CPU: bf16 is not faster (DESIGN.md)
    from c2jax.ops import current_target
    # the kernels' own path on the devices this bench runs on: Mosaic on TPU, else the XLA path
    impl = "pallas" if current_target().platform == "tpu" else "xla"
    peak_flops, peak_bw = measured_peaks(sz, dt)
    print(f"backend={backend} device={jax.devices()[0].device_kind} dtype={jnp.dtype(dt).name} "
          f"size={args.size} impl={impl}")
    print(f"measured peak at start: {peak_flops / 1e12:.3f} TFLOP/s (dense matmul), {peak_bw / 1e9:.1f} GB/s (reduction)")
    rng = np.random.default_rng(0)
    rows = []

    def add(name, fn, ref_fn, args_, flops=None, nbytes=None):
        t = timeit(jax.jit(fn), *args_, iters=args.iters)
        tr = timeit(jax.jit(ref_fn), *args_, iters=args.iters) if ref_fn is not None else float("nan")
        rows.append({"op": name, "ms": t * 1e3, "ref_ms": tr * 1e3, "flops": flops, "bytes": nbytes})
        print(f"  {name:34s} {t * 1e3:9.2f} ms  (ref {tr * 1e3:9.2f} ms)", flush=True)

    # --- grouped matmul (MoE experts): ragged sizes with one empty group ---
    M, K, N, G = sz["M"], sz["K"], sz["N"], sz["G"]
    sizes = rng.multinomial(M, np.ones(G) / G)
    sizes[1] += sizes[0]
    sizes[0] = 0
    gs = jnp.asarray(sizes, jnp.int32)
    lhs = jnp.asarray(rng.standard_normal((M, K)), dt)
    rhs = jnp.asarray(rng.standard_normal((G, K, N)) / np.sqrt(K), dt)
    dy = jnp.asarray(rng.standard_normal((M, N)), dt)
    gflops = 2 * M * K * N
    ref = lambda a, b, g: gmm_reference(a, b, g)
    add("gmm fwd", functools.partial(pk.gmm, impl=impl), ref, (lhs, rhs, gs), flops=gflops)
    for q in ["mxfp8", "nvfp4", "int8"]:
        add(f"gmm fwd quant={q}", functools.partial(pk.gmm, quant=q, impl=impl), None, (lhs, rhs, gs), flops=gflops)
    add("tgmm", functools.partial(pk.tgmm, impl=impl),
        lambda a, d, g: jax.vjp(lambda w: gmm_reference(a, w, g), jnp.zeros((G, K, N), a.dtype))[1](d)[0],
        (lhs, dy, gs), flops=gflops)
    # arrays are passed as arguments (closed-over arrays would be constant-folded by XLA)
    loss = lambda f: jax.grad(lambda a, b, g, d: jnp.sum(f(a, b, g) * d), argnums=(0, 1))
    add("gmm fwd+bwd", loss(functools.partial(pk.gmm, impl=impl)), loss(ref), (lhs, rhs, gs, dy), flops=3 * gflops)
    add("gmm fwd+bwd quant=mxfp8", loss(functools.partial(pk.gmm, quant="mxfp8", impl=impl)), None,
        (lhs, rhs, gs, dy), flops=3 * gflops)

    # --- flash attention (causal, GQA) ---
    B, H, Hk, L, D, Dv = sz["B"], sz["H"], sz["Hk"], sz["L"], sz["D"], sz["Dv"]
    q = jnp.asarray(rng.standard_normal((B, H, L, D)), dt)
    k = jnp.asarray(rng.standard_normal((B, Hk, L, D)), dt)
    v = jnp.asarray(rng.standard_normal((B, Hk, L, Dv)), dt)
    aflops = 2 * B * H * L * L * (D + Dv) // 2  # causal: half the score matrix
    add("flash_attention fwd (causal GQA)", functools.partial(pk.flash_attention, impl=impl),
        attention_reference, (q, k, v), flops=aflops)
    gq = lambda f: jax.grad(lambda q, k, v: jnp.sum(f(q, k, v)), argnums=(0, 1, 2))
    add("flash_attention fwd+bwd", gq(functools.partial(pk.flash_attention, impl=impl)), gq(attention_reference),
        (q, k, v), flops=aflops * 7 // 2)

    # --- decode attention (memory bound: the KV cache is read once) ---
    Bd, S = sz["dec_B"], sz["S"]
    qd = jnp.asarray(rng.standard_normal((Bd, H, D)), dt)
    kc = jnp.asarray(rng.standard_normal((Bd, Hk, S, D)), dt)
    vc = jnp.asarray(rng.standard_normal((Bd, Hk, S, Dv)), dt)
    lens = jnp.asarray(rng.integers(S // 2, S + 1, Bd), jnp.int32)
    kv_bytes = int(jnp.sum(lens)) * Hk * (D + Dv) * jnp.dtype(dt).itemsize
    add("decode_attention", functools.partial(pk.decode_attention, impl=impl), decode_attention_reference,
        (qd, kc, vc, lens), nbytes=kv_bytes)

    # --- quantized matmul (weights pre-quantized) ---
    qm, qk, qn = sz["qm_M"], sz["qm_K"], sz["qm_N"]
    x = jnp.asarray(rng.standard_normal((qm, qk)), dt)
    w = jnp.asarray(rng.standard_normal((qk, qn)) * 0.05, dt)
    add("dense matmul (unquantized baseline)", jnp.dot, None, (x, w), flops=2 * qm * qk * qn)
    for qt in ["int8", "mxfp8", "nvfp4"]:
        qw = pk.quantize_weight(w, qt)
        for mode in ["weight_only", "weight_act"]:
            add(f"qmatmul {qt} {mode}", functools.partial(pk.qmatmul, mode=mode, impl=impl),
                functools.partial(pk.qmatmul, mode=mode, impl="reference"), (x, qw), flops=2 * qm * qk * qn)

    # --- quantizers (memory bound: read f32, write 1 byte + scales) ---
    xq = jnp.asarray(rng.standard_normal((M, K)), jnp.float32)
    add("quantize_mxfp8", pk.quantize_mxfp8, None, (xq,), nbytes=xq.size * 5)
    add("quantize_nvfp4 (per token)", pk.quantize_nvfp4, None, (xq,), nbytes=xq.size * 5)
    add("quantize_int8", pk.quantize_int8, None, (xq,), nbytes=xq.size * 5)
    # Peaks are measured again at the end and the best kept: on a shared host the first
    # measurement can land in a busy moment.
    pf2, pb2 = measured_peaks(sz, dt)
    peak_flops, peak_bw = max(peak_flops, pf2), max(peak_bw, pb2)
    print(f"\nmeasured peak (best of start/end): {peak_flops / 1e12:.3f} TFLOP/s, {peak_bw / 1e9:.1f} GB/s")
    print("| op | ms | XLA/jnp reference ms | achieved | fraction of measured peak |\n|---|---|---|---|---|")
    for r in rows:
        sec = r["ms"] / 1e3
        if r["flops"] is not None:
            r.update(rate=r["flops"] / sec / 1e12, unit="TFLOP/s", frac_peak=r["flops"] / sec / peak_flops)
        else:
            r.update(rate=r["bytes"] / sec / 1e9, unit="GB/s", frac_peak=r["bytes"] / sec / peak_bw)
        ref = "" if np.isnan(r["ref_ms"]) else f"{r['ref_ms']:.1f}"
        print(f"| {r['op']} | {r['ms']:.1f} | {ref} | {r['rate']:.3f} {r['unit']} | {r['frac_peak']:.0%} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"backend": backend, "size": args.size, "peak_flops": peak_flops, "peak_bw": peak_bw, "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
