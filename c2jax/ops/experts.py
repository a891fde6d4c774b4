"""The routed-expert FFN op: sum_k weights[t, k] * SwiGLU_{ids[t, k]}(x[t]).

One call site (c2jax.models.moe.MoE). `capacity_factor=None` asks for dropless dispatch (every
forward outside an opted-in training choice); a factor lets each expert drop assignments past its
capacity (the dropped fraction is returned). Under an expert-parallel mesh the tokens travel to
their experts' devices (c2jax.ops.experts_ep) and the chosen grouped kernel runs there; on
other multi-device meshes a Pallas kernel runs inside a shard_map over the token axes.

Letters: T tokens, D width, E experts, K experts per token, F expert width, B batch, L length.
"""
from __future__ import annotations

from c2jax.ops import experts_ep as ep
from c2jax.ops import experts_xla as xla
from c2jax.ops.registry import define_op, kernels_choice
from c2jax.ops.target import Target, current_target, narrow_vectors, one_cpu_device

EXPERTS = define_op("experts", {
    "tpu": ("pallas_gmm",),
    # CPU: per-token gathers when few tokens touch fewer than all experts (decode), else the FFI
    # kernel (float32, one device), else expert-aligned blocks; the grouped scan under EP
    "cpu": ("xla_gather", "cpu_ffi", "xla_blocks", "xla_grouped"),
    # GPU (experiments/results/gpu_h200): the capacity einsum trained the 89M bench at 410k tokens/s
    # where the row-tiled grouped scan ran 78k; dropless forwards use XLA's ragged_dot
    "gpu": ("xla_gather", "xla_capacity", "xla_ragged"),
})

# grouped implementations -> pallas_kernels.gmm's impl (the one kind that runs under expert parallelism)
GROUPED = {"pallas_gmm": "pallas", "pallas_gmm_interpret": "interpret", "xla_grouped": "xla", "xla_ragged": "ragged"}


def _spec_reason(spec, *, grouped: bool = False):
    if spec["ep"] and not grouped:
        return "expert parallelism runs sorted grouped matmuls on each device's experts"
    if spec["quant"] != "none" and not grouped:
        return f"model.quant={spec['quant']!r} needs a grouped kernel with quantized operands"
    return None


def _pallas_ok(target: Target, **spec):
    if target.platform != "tpu":
        return f"Mosaic kernels run on TPU (target is {target.platform})"
    return _spec_reason(spec, grouped=True)


def _gather_ok(target: Target, **spec):
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
    if not spec.get("capacity", False) and spec["E"] > spec["K"]:
        return "dropless dispatch asked: the capacity einsum would compute E x T rows"
    return _spec_reason(spec)


def _grouped(impl: str):
    def run(x_TD, ids_TK, weights_TK, ws, cap, quant, stacked):
        return xla.grouped_dispatch(x_TD, ids_TK, weights_TK, *ws, quant, xla.grouped_matmul(quant, impl))
    return run


EXPERTS.register("pallas_gmm", _pallas_ok, "Mosaic grouped matmuls (gmm / tgmm), dropless")(_grouped("pallas"))
EXPERTS.register("pallas_gmm_interpret", lambda target, **spec: _spec_reason(spec, grouped=True),
                 "the Mosaic grouped matmuls run by the Pallas interpreter (tests on CPU)")(_grouped("interpret"))
EXPERTS.register("xla_grouped", lambda target, **spec: _spec_reason(spec, grouped=True),
                 "sorted assignments through pallas_kernels' row-tiled XLA grouped matmul, dropless")(_grouped("xla"))
EXPERTS.register("xla_ragged", lambda target, **spec: _spec_reason(spec, grouped=True),
                 "sorted assignments through jax.lax.ragged_dot (a grouped GEMM on GPU), dropless")(_grouped("ragged"))


@EXPERTS.register("xla_gather", _gather_ok, "each token reads its chosen experts' weights, dropless")
def _xla_gather(x_TD, ids_TK, weights_TK, ws, cap, quant, stacked):
    return xla.gather_dispatch(x_TD, ids_TK, weights_TK, *ws)


@EXPERTS.register("xla_capacity", _capacity_ok, "[E, cap, D] buffers and batched einsums (drops past cap)")
def _xla_capacity(x_TD, ids_TK, weights_TK, ws, cap, quant, stacked):
    return xla.capacity_dispatch(x_TD, ids_TK, weights_TK, *ws, cap)


@EXPERTS.register("xla_blocks", _blocks_ok, "expert-aligned row blocks, only occupied blocks computed (drops past cap)")
def _xla_blocks(x_TD, ids_TK, weights_TK, ws, cap, quant, stacked):
    return xla.block_dispatch(x_TD, ids_TK, weights_TK, *ws, cap)


@EXPERTS.register("cpu_ffi", _cpu_ffi_ok, "c2jax/backends/cpu/cpu_moe.cc: forward and backward FFI calls (drops past cap)",
                  auto_skip=narrow_vectors)
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
    impl = EXPERTS.select(kernels_choice(kernels, "experts"), target, T=T, K=K, E=E, D=D, F=F,
                          capacity=capacity_factor is not None, quant=quant, ep=plan is not None,
                          x_dtype=x_BLD.dtype, w_dtype=getattr(w_gate, "dtype", None))
    ws = (w_gate, w_up, w_down)
    if plan is not None:
        gmm = xla.grouped_matmul(quant, GROUPED[impl.name])
        return ep.expert_parallel_dispatch(x_BLD, ids_BLK, weights_BLK, *ws, quant, plan, gmm)
    if impl.name.startswith("pallas") and target.devices > 1:
        def local_fn(x_TD, ids_TK, weights_TK, wg, wu, wd):
            return impl.fn(x_TD, ids_TK, weights_TK, (wg, wu, wd), cap, quant, None)
        return ep.token_parallel_dispatch(x_BLD, ids_BLK, weights_BLK, *ws, local_fn)
    y_TD, dropped = impl.fn(x_BLD.reshape(T, D), ids_BLK.reshape(T, K), weights_BLK.reshape(T, K), ws, cap, quant,
                            stacked)
    return y_TD.reshape(B, L, D).astype(x_BLD.dtype), dropped


def decode_layout_experts(x_TD, ids_TK, weights_TK, experts):
    """Routed experts over the sampler's decode layout of one layer's experts (per-expert buffers,
    a ShardedExperts, or the CPU kernel's PackedExperts) -> (y_TD, 0.0): dropless."""
    from c2jax.backends.cpu import kernels as cpu_kernels
    if isinstance(experts, cpu_kernels.PackedExperts):
        return xla.split_dispatch(x_TD, ids_TK, weights_TK, experts, packed_ffn=cpu_kernels.moe_ffn)
    return xla.split_dispatch(x_TD, ids_TK, weights_TK, experts)
