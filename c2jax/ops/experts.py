"""The routed-expert FFN op: sum_k weights[t, k] * SwiGLU_{ids[t, k]}(x[t]).

One call site (c2jax.models.moe.MoE). `capacity_factor=None` asks for dropless dispatch (every
forward outside an opted-in training choice); a factor lets each expert drop assignments past its
capacity (the dropped fraction is returned). The implementation is keyed by the weights' layout
(`weight_layout`: the float or pre-quantized stacks, or one of the sampler's decode layouts) and
by the mesh: under an expert-parallel mesh the tokens travel to their experts' devices
(c2jax.ops.experts_ep, path "ep_all_to_all" / "ep_ragged_all_to_all") and the chosen grouped
kernel runs there; on other multi-device meshes a Pallas kernel runs inside a shard_map over the
token axes (path "token_parallel"). The choice is recorded as "path(implementation)". Every
implementation is fn(x_TD, ids_TK, weights_TK, weights, capacity, quant, stacked, tiling) -> (y_TD,
dropped fraction), each reading what it needs (tiling: the grouped matmuls' (tm, tk, tn) or None).

Letters: T tokens, D width, E experts, K experts per token, F expert width, B batch, L length.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from c2jax.ops import experts_ep as ep
from c2jax.ops import experts_xla as xla
from c2jax.ops.registry import define_op, kernels_choice, record
from c2jax.ops.target import Target, current_target, narrow_vectors, one_cpu_device

EXPERTS = define_op("experts", {
    "tpu": ("pallas_gmm",),
    # CPU: per-token gathers when few tokens touch fewer than all experts (decode), else the FFI
    # kernel (float32, one device), else expert-aligned blocks; the grouped scan under EP
    "cpu": ("xla_gather", "cpu_ffi", "xla_blocks", "xla_grouped"),
    # GPU (experiments/results/gpu_h200): the capacity einsum trained the 89M bench at 410k tokens/s
    # where the row-tiled grouped scan ran 78k; dropless forwards use XLA's ragged_dot
    "gpu": ("xla_gather", "xla_capacity", "xla_ragged"),
    # the sampler's decode layouts, each read by its own implementation (the stacks' ones refuse them)
    "*": ("decode_split", "decode_sharded", "decode_cpu_packed"),
})
EXPERTS.path("ep_all_to_all", "expert parallelism: rows to their experts' devices by all-to-all (mesh.ep_exchange="
             "'capacity'), the grouped implementation on the local experts, rows back")
EXPERTS.path("ep_ragged_all_to_all", "expert parallelism by ragged all-to-all of the routed rows only "
             "(mesh.ep_exchange='ragged', c2jax.ops.ragged)")
EXPERTS.path("token_parallel", "a Pallas implementation on each device's tokens with the gathered expert weights "
             "(a multi-device mesh without EP)")
STACKED_LAYOUTS = ("float", "quantized")   # [E, ...] stacks: w_gate, w_up, w_down as arrays or QuantizedExperts
DECODE_LAYOUTS = {"split": "decode_split", "sharded": "decode_sharded", "packed": "decode_cpu_packed"}

# grouped implementations -> pallas_kernels.gmm's impl (the one kind that runs under expert parallelism)
GROUPED = {"pallas_gmm": "pallas", "pallas_gmm_interpret": "interpret", "xla_grouped": "xla", "xla_ragged": "ragged"}


def weight_layout(weights) -> str:
    """The layout of one layer's expert weights: "float" / "quantized" ((w_gate, w_up, w_down)
    stacks, arrays or pallas_kernels.QuantizedExperts), or a decode layout of the sampler's:
    "sharded" (experts_xla.ShardedExperts), "packed" (backends.cpu PackedExperts), "split"
    (experts_xla.split_experts' per-expert buffers)."""
    if isinstance(weights, xla.ShardedExperts):
        return "sharded"
    if isinstance(weights, tuple) and len(weights) == 3 and hasattr(weights[0], "values_GKN"):
        return "quantized"
    if isinstance(weights, tuple) and len(weights) == 3 and getattr(weights[0], "ndim", 0) == 3:
        return "float"
    return "split" if isinstance(weights, tuple) else "packed"


def _layout_reason(spec):
    layout = spec.get("layout", "float")
    return None if layout in STACKED_LAYOUTS else f"weights are in the {layout!r} decode layout"


def _spec_reason(spec, *, grouped: bool = False):
    if (why := _layout_reason(spec)):
        return why
    if spec["ep"] and not grouped:
        return "expert parallelism runs sorted grouped matmuls on each device's experts"
    if spec["quant"] != "none" and not grouped:
        return f"model.quant={spec['quant']!r} needs a grouped kernel with quantized operands"
    return None


def _pallas_ok(target: Target, **spec):
    if (why := _layout_reason(spec)):
        return why
    if target.platform != "tpu":
        return f"Mosaic kernels run on TPU (target is {target.platform})"
    return _spec_reason(spec, grouped=True)


def _gather_ok(target: Target, **spec):
    if (why := _layout_reason(spec)):
        return why
    T, K, E = spec["T"], spec["K"], spec["E"]
    if T * K >= E:
        return f"{T} tokens x top-{K} >= {E} experts: a gather would read more than the expert weights"
    return _spec_reason(spec)


def _cpu_ffi_ok(target: Target, **spec):
    why = one_cpu_device(target) or _spec_reason(spec)
    if why:
        return why
    from c2jax.backends.cpu import moe as cpu_moe
    return cpu_moe.usable_operands(spec["x_dtype"], spec["w_dtype"], spec["D"], spec["F"])


def _blocks_ok(target: Target, **spec):
    return _spec_reason(spec)


def _capacity_ok(target: Target, **spec):
    if (why := _layout_reason(spec)):
        return why
    if not spec.get("capacity", False) and spec["E"] > spec["K"]:
        return "dropless dispatch asked: the capacity einsum would compute E x T rows"
    return _spec_reason(spec)


def _grouped(impl: str):
    def run(x_TD, ids_TK, weights_TK, ws, cap, quant, stacked, tiling):
        return xla.grouped_dispatch(x_TD, ids_TK, weights_TK, *ws, quant, xla.grouped_matmul(quant, impl, tiling))
    return run


EXPERTS.register("pallas_gmm", _pallas_ok, "Mosaic grouped matmuls (gmm / tgmm), dropless")(_grouped("pallas"))
EXPERTS.register("pallas_gmm_interpret", lambda target, **spec: _spec_reason(spec, grouped=True),
                 "the Mosaic grouped matmuls run by the Pallas interpreter (tests on CPU)")(_grouped("interpret"))
EXPERTS.register("xla_grouped", lambda target, **spec: _spec_reason(spec, grouped=True),
                 "sorted assignments through pallas_kernels' row-tiled XLA grouped matmul, dropless")(_grouped("xla"))
EXPERTS.register("xla_ragged", lambda target, **spec: _spec_reason(spec, grouped=True),
                 "sorted assignments through jax.lax.ragged_dot (a grouped GEMM on GPU), dropless")(_grouped("ragged"))


@EXPERTS.register("xla_gather", _gather_ok, "each token reads its chosen experts' weights, dropless")
def _xla_gather(x_TD, ids_TK, weights_TK, ws, cap, quant, stacked, tiling):
    return xla.gather_dispatch(x_TD, ids_TK, weights_TK, *ws)


@EXPERTS.register("xla_capacity", _capacity_ok, "[E, cap, D] buffers and batched einsums (drops past cap)")
def _xla_capacity(x_TD, ids_TK, weights_TK, ws, cap, quant, stacked, tiling):
    return xla.capacity_dispatch(x_TD, ids_TK, weights_TK, *ws, cap)


@EXPERTS.register("xla_blocks", _blocks_ok, "expert-aligned row blocks, only occupied blocks computed (drops past cap)")
def _xla_blocks(x_TD, ids_TK, weights_TK, ws, cap, quant, stacked, tiling):
    return xla.block_dispatch(x_TD, ids_TK, weights_TK, *ws, cap)


@EXPERTS.register("cpu_ffi", _cpu_ffi_ok, "c2jax/backends/cpu/cpu_moe.cc: forward and backward FFI calls (drops past cap)",
                  auto_skip=narrow_vectors)
def _cpu_ffi(x_TD, ids_TK, weights_TK, ws, cap, quant, stacked, tiling):
    from c2jax.backends.cpu import moe as cpu_moe
    E = ws[0].shape[0]
    out = cpu_moe.expert_ffn(x_TD, ids_TK, weights_TK, *ws, cap, stacked=stacked)
    return out.astype(x_TD.dtype), xla.dropped_fraction(ids_TK, E, cap)


def _decode_layout(layout: str):
    def ok(target: Target, **spec):
        return None if spec.get("layout") == layout else f"weights are not in the {layout!r} decode layout"
    return ok


@EXPERTS.register("decode_split", _decode_layout("split"),
                  "the sampler's per-expert buffers: only the chosen experts run, each weight read in place")
@EXPERTS.register("decode_sharded", _decode_layout("sharded"),
                  "ShardedExperts over a 1-D decode mesh: each device its hidden columns or its experts")
def _decode_split(x_TD, ids_TK, weights_TK, ws, cap, quant, stacked, tiling):
    return xla.split_dispatch(x_TD, ids_TK, weights_TK, ws)


@EXPERTS.register("decode_cpu_packed", _decode_layout("packed"),
                  "c2jax/backends/cpu/cpu_kernels.cc on the sampler's PackedExperts (each chosen expert read once)")
def _decode_packed(x_TD, ids_TK, weights_TK, ws, cap, quant, stacked, tiling):
    from c2jax.backends.cpu import kernels as cpu_kernels
    return xla.split_dispatch(x_TD, ids_TK, weights_TK, ws, packed_ffn=cpu_kernels.moe_ffn)


def experts(kernels, x_BLD, ids_BLK, weights_BLK, *weights, quant: str = "none",
            capacity_factor: float | None = None, stacked=None, tiling=None):
    """Routed experts of tokens x_BLD -> (y_BLD in x's dtype, dropped fraction). weights: one
    layer's w_gate, w_up, w_down (float or pre-quantized stacks), or one decode layout of the
    sampler's (weight_layout), which its own implementation reads whatever the config pins.
    kernels: the model config's `kernels` section (its `experts` choice); capacity_factor None =
    dropless; stacked: the weights as a layer of the scanned model's stacks (read in place by the
    CPU kernel); tiling: the grouped matmuls' (tm, tk, tn), None = chosen per call shape."""
    ws = weights[0] if len(weights) == 1 else tuple(weights)
    layout = weight_layout(ws)
    B, L, D = x_BLD.shape
    K = ids_BLK.shape[-1]
    T = B * L
    target = current_target()
    flat = (x_BLD.reshape(T, D), ids_BLK.reshape(T, K), weights_BLK.reshape(T, K))
    if layout not in STACKED_LAYOUTS:
        impl = EXPERTS.select("auto", target, layout=layout, T=T, K=K)
        y_TD, dropped = impl.fn(*flat, ws, None, quant, None, tiling)
        return y_TD.reshape(B, L, D).astype(x_BLD.dtype), dropped
    w_shape = getattr(ws[0], "values_GKN", ws[0]).shape
    E, F = w_shape[0], w_shape[-1]
    plan = ep.ep_plan(B, L, E)
    cap = xla.capacity(T, K, E, capacity_factor)
    impl = EXPERTS.select(kernels_choice(kernels, "experts"), target, record=False, layout=layout, T=T, K=K, E=E,
                          D=D, F=F, capacity=capacity_factor is not None, quant=quant, ep=plan is not None,
                          x_dtype=x_BLD.dtype, w_dtype=getattr(ws[0], "dtype", None))
    if plan is not None:
        record("experts", f"{ep.exchange_name()}({impl.name})")
        gmm = xla.grouped_matmul(quant, GROUPED[impl.name], tiling)
        return ep.expert_parallel_dispatch(x_BLD, ids_BLK, weights_BLK, *ws, quant, plan, gmm)
    if impl.name.startswith("pallas") and target.devices > 1:
        record("experts", f"token_parallel({impl.name})")

        def local_fn(x_TD, ids_TK, weights_TK, wg, wu, wd):
            return impl.fn(x_TD, ids_TK, weights_TK, (wg, wu, wd), cap, quant, None, tiling)
        return ep.token_parallel_dispatch(x_BLD, ids_BLK, weights_BLK, *ws, local_fn)
    record("experts", impl.name)
    y_TD, dropped = impl.fn(*flat, ws, cap, quant, stacked, tiling)
    return y_TD.reshape(B, L, D).astype(x_BLD.dtype), dropped


def decode_layout(target: Target, m, devices: int = 1) -> str:
    """The layout a sampler decoding model config m on `target` (over `devices` host devices)
    stores the experts in: "float" off CPU (the scanned model reads the stacks and the registry
    picks a grouped kernel); on CPU the unrolled decode step's per-layer weights, "packed" for
    the CPU kernel (PackedExperts, and PackedMatrix where it runs them: float32, where the
    kernels build and are not slower than XLA's paths) or "split" (per-expert buffers, a
    ShardedExperts over several devices; C2JAX_CPU_KERNELS=0 forces it)."""
    if target.platform != "cpu":
        return "float"
    from c2jax.backends.cpu import kernels as cpu_kernels
    E, D, F = m.num_experts, m.hidden_size, m.moe_intermediate_size
    if not E or jnp.dtype(m.dtype) != jnp.float32 or cpu_kernels.unavailable() or cpu_kernels.narrow_vectors():
        return "split"
    return "split" if cpu_kernels.packable(jax.ShapeDtypeStruct((E, D, F), jnp.float32), devices) else "packed"


def decode_layout_experts(x_TD, ids_TK, weights_TK, experts_):
    """Routed experts of tokens x_TD over one decode layout of the sampler's (per-expert buffers, a
    ShardedExperts, or the CPU kernel's PackedExperts) -> (y_TD, 0.0): dropless."""
    y, dropped = experts(None, x_TD[None], ids_TK[None], weights_TK[None], experts_)
    return y[0], dropped
