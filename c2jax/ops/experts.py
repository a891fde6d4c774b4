"""The routed-expert FFN op: sum_k weights[t, k] * SwiGLU_{ids[t, k]}(x[t]).

One call site (c2jax.models.moe.MoE). `capacity_factor=None` asks for dropless dispatch (every
forward outside an opted-in training choice); a factor lets each expert drop assignments past its
capacity (the dropped fraction is returned). Under an expert-parallel mesh the tokens travel to
their experts' devices (c2jax.parallel.experts) and the chosen grouped kernel runs there; on
other multi-device meshes a Pallas kernel runs inside a shard_map over the token axes.

Letters: T tokens, D width, E experts, K experts per token, F expert width, B batch, L length.
"""
from __future__ import annotations

import jax.numpy as jnp

from c2jax.ops import experts_xla as xla
from c2jax.ops.registry import define_op, kernels_choice
from c2jax.ops.target import Target, current_target
from c2jax.parallel import experts as ep

EXPERTS = define_op("experts", {
    "tpu": ("pallas_gmm",),
    # CPU: per-token gathers when few tokens touch fewer than all experts (decode), else the FFI
    # kernel (float32, one device), else expert-aligned blocks; the grouped scan under EP
    "cpu": ("xla_gather", "cpu_ffi", "xla_blocks", "xla_grouped"),
    # GPU (experiments/results/gpu_h200): the capacity einsum trained the 89M bench at 410k tokens/s
    # where the grouped scan ran 78k; dropless forwards use the grouped scan
    "gpu": ("xla_gather", "xla_capacity", "xla_grouped"),
})

GROUPED = ("pallas_gmm", "pallas_gmm_interpret", "xla_grouped")


def _spec_reason(spec, *, grouped: bool = False, quant_ok: bool = False, gather: bool = False):
    if spec["ep"] and not grouped:
        return "expert parallelism runs sorted grouped matmuls on each device's experts"
    if spec["quant"] != "none" and not quant_ok:
        return f"model.quant={spec['quant']!r} needs a grouped kernel with quantized operands"
    return None


def _pallas_ok(target: Target, **spec):
    if target.platform != "tpu":
        return f"Mosaic kernels run on TPU (target is {target.platform})"
    return _spec_reason(spec, grouped=True, quant_ok=True)


def _gather_ok(target: Target, **spec):
    T, K, E = spec["T"], spec["K"], spec["E"]
    if T * K >= E:
        return f"{T} tokens x top-{K} >= {E} experts: a gather would read more than the expert weights"
    return _spec_reason(spec)


def _cpu_ffi_ok(target: Target, **spec):
    if target.platform != "cpu":
        return f"an XLA:CPU FFI kernel (target is {target.platform})"
    if target.devices > 1:
        return "an FFI call has no sharding rule (a multi-device mesh is active)"
    why = _spec_reason(spec)
    if why:
        return why
    from c2jax.backends.cpu import moe as cpu_moe
    return cpu_moe.usable_operands(spec["x_dtype"], spec["w_dtype"], spec["D"], spec["F"])


def _blocks_ok(target: Target, **spec):
    return _spec_reason(spec)


def _capacity_ok(target: Target, **spec):
    if not spec.get("capacity", False) and spec["E"] > spec["K"]:
        return "dropless dispatch asked: the capacity einsum would compute E x T rows"
    return _spec_reason(spec)


@EXPERTS.register("pallas_gmm", _pallas_ok, "Mosaic grouped matmuls (gmm / tgmm), dropless")
def _pallas_gmm(x_TD, ids_TK, weights_TK, ws, cap, quant, stacked):
    return xla.grouped_dispatch(x_TD, ids_TK, weights_TK, *ws, quant, xla.grouped_matmul(quant, "pallas"))


@EXPERTS.register("pallas_gmm_interpret", lambda target, **spec: _spec_reason(spec, grouped=True, quant_ok=True),
                  "the Mosaic grouped matmuls run by the Pallas interpreter (tests on CPU)")
def _pallas_gmm_interpret(x_TD, ids_TK, weights_TK, ws, cap, quant, stacked):
    return xla.grouped_dispatch(x_TD, ids_TK, weights_TK, *ws, quant, xla.grouped_matmul(quant, "interpret"))


@EXPERTS.register("xla_grouped", lambda target, **spec: _spec_reason(spec, grouped=True, quant_ok=True),
                  "sorted assignments through pallas_kernels' row-tiled XLA grouped matmul, dropless")
def _xla_grouped(x_TD, ids_TK, weights_TK, ws, cap, quant, stacked):
    return xla.grouped_dispatch(x_TD, ids_TK, weights_TK, *ws, quant, xla.grouped_matmul(quant, "xla"))


@EXPERTS.register("xla_gather", _gather_ok, "each token reads its chosen experts' weights, dropless")
def _xla_gather(x_TD, ids_TK, weights_TK, ws, cap, quant, stacked):
    return xla.gather_dispatch(x_TD, ids_TK, weights_TK, *ws)


@EXPERTS.register("xla_capacity", _capacity_ok, "[E, cap, D] buffers and batched einsums (drops past cap)")
def _xla_capacity(x_TD, ids_TK, weights_TK, ws, cap, quant, stacked):
    return xla.capacity_dispatch(x_TD, ids_TK, weights_TK, *ws, cap)


@EXPERTS.register("xla_blocks", _blocks_ok, "expert-aligned row blocks, only occupied blocks computed (drops past cap)")
def _xla_blocks(x_TD, ids_TK, weights_TK, ws, cap, quant, stacked):
    return xla.block_dispatch(x_TD, ids_TK, weights_TK, *ws, cap)


@EXPERTS.register("cpu_ffi", _cpu_ffi_ok, "c2jax/backends/cpu/cpu_moe.cc: forward and backward FFI calls (drops past cap)")
def _cpu_ffi(x_TD, ids_TK, weights_TK, ws, cap, quant, stacked):
    from c2jax.backends.cpu import moe as cpu_moe
    E = ws[0].shape[0]
    out = cpu_moe.expert_ffn(x_TD, ids_TK, weights_TK, *ws, cap, stacked=stacked)
    return out.astype(x_TD.dtype), xla.dropped_fraction(ids_TK, E, cap)


def experts(kernels, x_BLD, ids_BLK, weights_BLK, w_gate, w_up, w_down, *, quant: str = "none",
            capacity_factor: float | None = None, stacked=None):
    """Routed experts of tokens x_BLD -> (y_BLD in x's dtype, dropped fraction). kernels: the model
    config's `kernels` section (its `experts` choice); capacity_factor None = dropless; stacked: the
    weights as a layer of the scanned model's stacks (read in place by the CPU kernel)."""
    B, L, D = x_BLD.shape
    w_shape = getattr(w_gate, "values_GKN", w_gate).shape   # float, or pre-quantized QuantizedExperts
    E, F = w_shape[0], w_shape[-1]
    K = ids_BLK.shape[-1]
    T = B * L
    plan = ep.ep_plan(B, L, E)
    cap = xla.capacity(T, K, E, capacity_factor)
    target = current_target()
    impl = EXPERTS.select(kernels_choice(kernels, "experts"), target, T=T, K=K, E=E, D=D, F=F, cap=cap,
                          capacity=capacity_factor is not None, quant=quant, ep=plan is not None, x_dtype=x_BLD.dtype, w_dtype=getattr(w_gate, "dtype", None))
    ws = (w_gate, w_up, w_down)
    if plan is not None:
        local = lambda x_RD, eid_R, wg, wu, wd: ep.sorted_local_experts(  # noqa: E731
            x_RD, eid_R, wg, wu, wd, _grouped_matmul_of(impl.name, quant))
        return ep.expert_parallel_dispatch(x_BLD, ids_BLK, weights_BLK, *ws, quant, plan, local)
    if impl.name.startswith("pallas") and target.devices > 1:
        def local_fn(x_TD, ids_TK, weights_TK, wg, wu, wd):
            return impl.fn(x_TD, ids_TK, weights_TK, (wg, wu, wd), cap, quant, None)
        return ep.token_parallel_dispatch(x_BLD, ids_BLK, weights_BLK, *ws, local_fn)
    y_TD, dropped = impl.fn(x_BLD.reshape(T, D), ids_BLK.reshape(T, K), weights_BLK.reshape(T, K), ws, cap, quant,
                            stacked)
    return y_TD.reshape(B, L, D).astype(x_BLD.dtype), dropped


def _grouped_matmul_of(name: str, quant: str):
    impl = {"pallas_gmm": "pallas", "pallas_gmm_interpret": "interpret", "xla_grouped": "xla"}[name]
    return xla.grouped_matmul(quant, impl)


def experts_dropless_reference(x_TD, ids_TK, weights_TK, w_gate, w_up, w_down):
    """float32 dense reference: every expert on every token, masked by the routing (tests)."""
    f32 = jnp.float32
    x = x_TD.astype(f32)
    g = jnp.einsum("td,edf->etf", x, w_gate.astype(f32))
    u = jnp.einsum("td,edf->etf", x, w_up.astype(f32))
    y_ETD = jnp.einsum("etf,efd->etd", g * (1 / (1 + jnp.exp(-g))) * u, w_down.astype(f32))
    onehot_TKE = (ids_TK[..., None] == jnp.arange(w_gate.shape[0])).astype(f32)
    return jnp.einsum("tke,etd,tk->td", onehot_TKE, y_ETD, weights_TK.astype(f32))


def decode_layout_experts(x_TD, ids_TK, weights_TK, experts):
    """Routed experts over the sampler's decode layout of one layer's experts (per-expert buffers,
    a ShardedExperts, or the CPU kernel's PackedExperts) -> (y_TD, 0.0): dropless."""
    if type(experts).__name__ == "PackedExperts":
        from c2jax.backends.cpu import kernels as cpu_kernels
        return xla.split_dispatch(x_TD, ids_TK, weights_TK, experts, packed_ffn=cpu_kernels.moe_ffn)
    return xla.split_dispatch(x_TD, ids_TK, weights_TK, experts)
