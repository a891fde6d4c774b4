"""CPU kernels as XLA FFI calls. Decode (cpu_kernels.cc): kernels that stream each weight once for
up to 8 rows: the MoE layer (every chosen expert read once), the output head and the other Linear
layers. Training (cpu_attention.cc / cpu_moe.cc / cpu_loss.cc / cpu_norm.cc / cpu_adamw.cc, wrapped by
cpu_attention.py / cpu_moe.py / c2jax.train.head_loss / cpu_norm.py / c2jax.backends.cpu.adamw): causal
attention, the routed experts, the per-token NLL and RMSNorm (with the q/k RoPE), forward and
backward, and the AdamW step. All build
into one library.

Why: XLA CPU runs a product of 2-8 rows at 5-9 GB/s on one core against 11-14 GB/s for a
one-row product, so split_dispatch runs few-row windows row by row, and an expert picked by r
rows is streamed r times (batch 8, 16 experts top-2: 16 expert reads a layer for ~10 distinct
experts). The kernel streams each chosen expert's packed weights once for up to 8 rows at the
one-row rate (measured in experiments/bench/README.md).

Built at first use with the host's g++ (-O3 -march=native) into C2JAX_KERNEL_CACHE
(default ~/.cache/c2jax), keyed by the source, the flags, the jaxlib version and the CPU's
feature flags. Off with C2JAX_CPU_KERNELS=0; where it cannot build, `unavailable()` says why,
the decode step keeps split_dispatch and training XLA's attention and MoE paths.

Letters: T tokens, K experts per token, E experts, D width, F expert width, n devices.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import subprocess
import tempfile
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib

PANEL = 16   # output columns per packed panel (cpu_kernels.cc kPanel)
TARGET = "c2jax_moe_ffn"
MATMUL = "c2jax_packed_matmul"
# one library; the header is listed so that its edits change the cache key
SOURCES = tuple(Path(__file__).with_name(n) for n in ("cpu_kernels.cc", "cpu_attention.cc", "cpu_moe.cc",
                                                      "cpu_loss.cc", "cpu_adamw.cc", "cpu_norm.cc"))
HEADERS = (Path(__file__).with_name("cpu_simd.h"),)
ATTENTION_FWD, ATTENTION_BWD = "c2jax_causal_attention_fwd", "c2jax_causal_attention_bwd"
EXPERT_FWD, EXPERT_BWD = "c2jax_expert_ffn_fwd", "c2jax_expert_ffn_bwd"
TOKEN_NLL_FWD, TOKEN_NLL_BWD = "c2jax_token_nll_fwd", "c2jax_token_nll_bwd"
ADAMW = "c2jax_adamw"
RMS_NORM_FWD, RMS_NORM_BWD = "c2jax_rms_norm_fwd", "c2jax_rms_norm_bwd"
NORM_ROPE_FWD, NORM_ROPE_BWD = "c2jax_rms_norm_rope_fwd", "c2jax_rms_norm_rope_bwd"
_HANDLERS = {TARGET: "C2jaxMoeFfn", MATMUL: "C2jaxPackedMatmul",        # FFI target -> exported symbol
             ATTENTION_FWD: "C2jaxCausalAttentionFwd", ATTENTION_BWD: "C2jaxCausalAttentionBwd",
             EXPERT_FWD: "C2jaxExpertFfnFwd", EXPERT_BWD: "C2jaxExpertFfnBwd",
             TOKEN_NLL_FWD: "C2jaxTokenNllFwd", TOKEN_NLL_BWD: "C2jaxTokenNllBwd", ADAMW: "C2jaxAdamW",
             RMS_NORM_FWD: "C2jaxRmsNormFwd", RMS_NORM_BWD: "C2jaxRmsNormBwd",
             NORM_ROPE_FWD: "C2jaxRmsNormRopeFwd", NORM_ROPE_BWD: "C2jaxRmsNormRopeBwd"}
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return os.uname().machine


@functools.lru_cache(maxsize=1)
def _build() -> tuple[ctypes.CDLL | None, str | None]:
    dll, why = _build_and_load()
    if why and why != "C2JAX_CPU_KERNELS=0":  # once a process: XLA's slower paths from here on
        warnings.warn(f"c2jax CPU kernels off, decoding and training run through XLA: {why}",
                      RuntimeWarning, stacklevel=2)
    return dll, why


def _build_and_load() -> tuple[ctypes.CDLL | None, str | None]:
    if os.environ.get("C2JAX_CPU_KERNELS", "1") == "0":
        return None, "C2JAX_CPU_KERNELS=0"
    key = hashlib.sha256(b"\0".join([*(f.read_bytes() for f in SOURCES + HEADERS), " ".join(FLAGS).encode(),
                                     jaxlib.__version__.encode(),
                                     _cpu_flags().encode()])).hexdigest()[:16]
    cache = Path(os.environ.get("C2JAX_KERNEL_CACHE", Path.home() / ".cache" / "c2jax"))
    lib = cache / f"cpu_kernels_{key}.so"
    if not lib.exists():
        try:
            cache.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
            os.close(fd)
            cmd = [os.environ.get("CXX", "g++"), *FLAGS, f"-I{jax.ffi.include_dir()}", *map(str, SOURCES), "-o", tmp]
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.SubprocessError) as e:
            return None, f"cannot build cpu_kernels.cc: {e}"
        if res.returncode:
            os.unlink(tmp)
            return None, f"cannot build cpu_kernels.cc: {' '.join(cmd)}\n{res.stderr[-2000:]}"
        os.replace(tmp, lib)  # atomic: processes building at once each leave a whole library
    try:
        dll = ctypes.cdll.LoadLibrary(str(lib))
        for target, symbol in _HANDLERS.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(dll, symbol)), platform="cpu")
    except (OSError, AttributeError) as e:
        return None, f"cannot load {lib}: {e}"
    return dll, None


def unavailable() -> str | None:
    """Why the kernel cannot run in this process (None when it can); builds it on first call."""
    if jax.default_backend() != "cpu":
        return f"backend is {jax.default_backend()}, the kernel is CPU-only"
    return _build()[1]


@functools.lru_cache(maxsize=1)
def narrow_vectors() -> str | None:
    """Why the product kernels (attention, experts, packed matmuls) run slower than XLA's paths
    on this host, or None where they are the fast choice: they are written in 16-float vectors,
    which a host without AVX-512 splits in two and spills out of its 16 registers (on an AVX2
    EPYC host: train step 46 s vs 5.2 s, decode step 76 ms vs 23 ms, experiments/bench).
    C2JAX_CPU_KERNELS=wide treats the host as wide (for measuring)."""
    if os.environ.get("C2JAX_CPU_KERNELS", "1") == "wide":
        return None
    flags = _cpu_flags().split()
    return None if "avx512f" in flags else "this host has no AVX-512 (the CPU kernels' 16-float vectors)"


def packable(w_gate_EDF, n: int = 1) -> str | None:
    """Why experts of this shape cannot be packed over n devices (None when they can)."""
    E, D, F = w_gate_EDF.shape
    if w_gate_EDF.dtype != jnp.float32:
        return f"expert weights are {w_gate_EDF.dtype}, the kernel is float32"
    if F % n:
        return f"{n} devices do not divide expert width {F}"
    if D % (2 * PANEL) or (F // n) % PANEL:
        return f"width {D} must be a multiple of {2 * PANEL} and expert width per device {F // n} of {PANEL}"
    return None


def _panels(w_EKN):
    """[E, K, N] -> packed panels [E, N/16, K, 16]."""
    E, K, N = w_EKN.shape
    return w_EKN.reshape(E, K, N // PANEL, PANEL).transpose(0, 2, 1, 3)


@jax.tree_util.register_pytree_node_class
class PackedExperts:
    """Expert weights packed for moe_ffn, device d (of a 1-D mesh of n, or one device) holding
    hidden columns [d f, (d + 1) f) of every expert, f = F / n:
      w_gate_up [n, E, 2f/16, D, 16]  (gate columns then up columns, in panels of 16)
      w_down    [n, E, D/16, f, 16]
    With a mesh, put both on it sharded on axis 0."""

    def __init__(self, w_gate_up, w_down, mesh=None):
        self.w_gate_up, self.w_down, self.mesh = w_gate_up, w_down, mesh

    def tree_flatten(self):
        return (self.w_gate_up, self.w_down), self.mesh

    @classmethod
    def tree_unflatten(cls, mesh, children):
        return cls(*children, mesh)


def ffn_column_split(w_gate_EDF, w_up_EDF, w_down_EFD, n: int):
    """Every expert's hidden columns split n ways (n | F, f = F / n): (w_gate_up [n, E, D, 2f],
    device d's gate columns [d f, (d + 1) f) then its up columns; w_down [n, E, f, D], the same
    rows)."""
    E, D, F = w_gate_EDF.shape
    f = F // n
    gate_nEDf, up_nEDf = (w.reshape(E, D, n, f).transpose(2, 0, 1, 3) for w in (w_gate_EDF, w_up_EDF))
    return jnp.concatenate([gate_nEDf, up_nEDf], axis=3), w_down_EFD.reshape(E, n, f, D).transpose(1, 0, 2, 3)


def pack_experts(w_gate_EDF, w_up_EDF, w_down_EFD, mesh=None) -> PackedExperts:
    """Stacked expert weights -> PackedExperts (hidden columns split over mesh's n devices).
    Jit-friendly; raises ValueError when packable() says no."""
    n = 1 if mesh is None else mesh.size
    why = packable(w_gate_EDF, n)
    if why:
        raise ValueError(f"cannot pack experts for the CPU kernel: {why}")
    wgu_nED2f, wd_nEfD = ffn_column_split(w_gate_EDF, w_up_EDF, w_down_EFD, n)
    wgu = jax.vmap(_panels)(wgu_nED2f)
    wd = jax.vmap(_panels)(wd_nEfD)
    return PackedExperts(wgu, wd, mesh)


def _call(x_TD, ids_TK, weights_TK, w_gate_up, w_down):
    out = jax.ShapeDtypeStruct(x_TD.shape, jnp.float32)
    return jax.ffi.ffi_call(TARGET, out)(x_TD.astype(jnp.float32), ids_TK.astype(jnp.int32),
                                         weights_TK.astype(jnp.float32), w_gate_up, w_down)


def moe_ffn(x_TD, ids_TK, weights_TK, experts: PackedExperts):
    """f32 [T, D]: sum over k of weights[t, k] * SwiGLU expert ids[t, k] of x[t], each chosen
    expert's weights read once (per device: its hidden columns, then a psum)."""
    why = unavailable()
    if why:
        raise RuntimeError(f"the CPU MoE kernel is unavailable: {why}")
    if experts.mesh is None or experts.mesh.size == 1:
        return _call(x_TD, ids_TK, weights_TK, experts.w_gate_up, experts.w_down)
    from jax.sharding import PartitionSpec as P
    axis = experts.mesh.axis_names[0]

    def local(x_TD, ids_TK, weights_TK, wgu, wd):
        return jax.lax.psum(_call(x_TD, ids_TK, weights_TK, wgu, wd), axis)

    return jax.shard_map(local, mesh=experts.mesh, in_specs=(P(), P(), P(), P(axis), P(axis)), out_specs=P(),
                         check_vma=False)(x_TD, ids_TK, weights_TK, experts.w_gate_up, experts.w_down)


@jax.tree_util.register_pytree_node_class
class PackedMatrix:
    """A [K, N] weight for matmul, in panels of 16 columns, over a 1-D mesh of n devices (or one):
      split "columns": w [n, N/n/16, K, 16], device d holds output columns [d N/n, (d + 1) N/n)
                       (the result is sharded by columns);
      split "rows":    w [n, N/16, K/n, 16], device d holds input rows [d K/n, (d + 1) K/n)
                       (partial products, summed over the devices).
    With a mesh, put w on it sharded on axis 0."""

    def __init__(self, w, mesh=None, split: str = "columns"):
        self.w, self.mesh, self.split = w, mesh, split

    def tree_flatten(self):
        return (self.w,), (self.mesh, self.split)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children, *aux)


def matrix_packable(w_KN, n: int = 1, split: str = "columns") -> str | None:
    """Why a [K, N] weight cannot be packed split over n devices (None when it can)."""
    K, N = w_KN.shape
    if w_KN.dtype != jnp.float32:
        return f"weight is {w_KN.dtype}, the kernel is float32"
    per = N // n if split == "columns" else N
    if (split == "columns" and N % n) or per % (2 * PANEL):
        return f"columns per device {N}/{n if split == 'columns' else 1} must be a whole multiple of {2 * PANEL}"
    if split == "rows" and K % n:
        return f"{n} devices do not divide the {K} rows"
    return None


def pack_matrix(w_KN, mesh=None, split: str = "columns") -> PackedMatrix:
    """[K, N] -> PackedMatrix (columns or rows split over mesh's n devices); raises ValueError
    when matrix_packable says no. Jit-friendly."""
    n = 1 if mesh is None else mesh.size
    why = matrix_packable(w_KN, n, split)
    if why:
        raise ValueError(f"cannot pack a {tuple(w_KN.shape)} weight for the CPU kernel: {why}")
    K, N = w_KN.shape
    if split == "columns":
        return PackedMatrix(_panels(w_KN.reshape(K, n, N // n).transpose(1, 0, 2)), mesh, split)
    return PackedMatrix(_panels(w_KN.reshape(n, K // n, N)), mesh, split)


def _call_matmul(x_MK, w):
    out = jax.ShapeDtypeStruct((x_MK.shape[0], w.shape[-3] * PANEL), jnp.float32)
    return jax.ffi.ffi_call(MATMUL, out)(x_MK.astype(jnp.float32), w)


def matmul(x_MK, w: PackedMatrix):
    """f32 [M, N] = x_MK @ W, each device streaming its part of W once per 8 rows; with a mesh the
    result is sharded by columns ("columns") or summed over the devices ("rows")."""
    why = unavailable()
    if why:
        raise RuntimeError(f"the CPU kernels are unavailable: {why}")
    if w.mesh is None or w.mesh.size == 1:
        return _call_matmul(x_MK, w.w)
    from jax.sharding import PartitionSpec as P
    axis = w.mesh.axis_names[0]
    if w.split == "columns":
        return jax.shard_map(_call_matmul, mesh=w.mesh, in_specs=(P(), P(axis)), out_specs=P(None, axis),
                             check_vma=False)(x_MK, w.w)
    return jax.shard_map(lambda x, w: jax.lax.psum(_call_matmul(x, w), axis), mesh=w.mesh,
                         in_specs=(P(None, axis), P(axis)), out_specs=P(), check_vma=False)(x_MK, w.w)
