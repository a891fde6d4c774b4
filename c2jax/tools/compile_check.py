"""Prove, on a CPU machine, that a pod config compiles and fits on a TPU slice.

libtpu ships the TPU compiler: `jax.experimental.topologies.get_topology_desc` gives the
devices of a TPU topology (e.g. "v5p:4x4x4") without the hardware, and `jit(...).lower(...)
.compile()` compiles for them. We AOT-compile
  - the real train step (c2jax.train.step.train_step: forward, loss, backward, AdamW update,
    FSDP/CP/EP sharded by the config's mesh and rules, state donated), and
  - the sampler's jitted decode chunk (c2jax.sampling.engine.decode_program: pod.decode_chunk
    steps of one token per row against a full KV cache, sampling, logprobs, routed expert ids and
    cache writes; bf16 weights, stored pre-quantized as the sampler stores them when model.quant
    is set; dropless MoE; on the decode mesh),
and, for a config whose `rl` section is meant for the pod (pod.compile_rl, the pods' `:rl`
variants),
  - the RL learner step (c2jax.rl.learner.rl_train_step on the learner cfg: the reference's
    forward in the params' shardings when rl.kl_coef > 0, the no-replay forward when
    rl.noreplay_metrics, the differentiated forward with the sampler's experts forced (router
    replay), AdamW; state donated, the RL batch sharded by c2jax.rl.learner.batch_shardings), and
  - the learner -> sampler weight move (c2jax.rl.roles.reshard): the cast to rl.sync_dtype from
    the learner's param shardings to the sampler mesh's (rl.sampler_mesh_shape, the same chips),
    compiled as the one program jax.device_put runs for it,
then read per-chip HBM from memory_analysis() and FLOPs from cost_analysis(), and compare them
with the chip's HBM capacity and peak bf16 FLOP/s.

Pod configs add a `pod` section (see configs/pods/): topology, decode_batch, decode_len,
decode_mesh_shape (for RL configs: rl.sampler_mesh_shape, see `decode_mesh_shape`), hbm_headroom,
compile_rl. `main(cfg, topology)` returns the report dict; `format_report`
renders it; a config that does not fit raises ConfigError naming what to change (after the
report is printed by the CLI).
"""
from __future__ import annotations

import math
import os
import re
import time

import jax
import jax.numpy as jnp
import ml_collections
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from c2jax.config import ConfigError
from c2jax.ops.registry import record_choices

GiB = 1024 ** 3

# per-chip HBM (bytes) and peak dense bf16 FLOP/s, from the public TPU spec sheets
CHIPS = {
    "v4": (32 * GiB, 275e12),
    "v5e": (16 * GiB, 197e12),
    "v5litepod": (16 * GiB, 197e12),
    "v5p": (95 * 10 ** 9, 459e12),
    "v6e": (32 * GiB, 918e12),
}


def pod_defaults() -> ml_collections.ConfigDict:
    """Defaults of the `pod` section that pod configs set."""
    p = ml_collections.ConfigDict()
    p.topology = "v5p:2x2x1"          # TPU slice, "<chip>:<AxBxC>"
    p.decode_batch = 0                # sampler rows for the decode-step compile (0 = one per chip)
    p.decode_len = 4096               # KV cache slots per row in the decode-step compile
    p.decode_mesh_shape = ()          # mesh.shape for decoding (() = rl.sampler_mesh_shape, else the training mesh)
    p.decode_chunk = 32               # decode steps per on-device loop (the sampler's `chunk`)
    p.hbm_headroom = 0.9              # a config "fits" when peak HBM <= headroom * capacity
    p.compile_decode = True           # also compile the sampler decode step
    p.compile_rl = False              # also compile the RL learner step and the learner -> sampler reshard
    return p


def pod_cfg(cfg) -> ml_collections.ConfigDict:
    p = pod_defaults()
    if "pod" in cfg:
        for k, v in cfg.pod.items():
            with p.ignore_type():
                p[k] = v
    return p


def decode_mesh_shape(cfg) -> tuple:
    """The sampler's mesh shape: rl.sampler_mesh_shape when set (an RL config's sampler; the decode
    compile and the reshard use it), else pod.decode_mesh_shape (() = the training mesh). A config
    that sets both to different shapes is refused: one field says where the sampler runs."""
    pod = pod_cfg(cfg)
    rl_shape = tuple(cfg.rl.sampler_mesh_shape) if "rl" in cfg else ()
    pod_shape = tuple(pod.decode_mesh_shape)
    if rl_shape and pod_shape and rl_shape != pod_shape:
        raise ConfigError(f"pod.decode_mesh_shape {pod_shape} and rl.sampler_mesh_shape {rl_shape} disagree; the "
                          f"sampler's mesh is rl.sampler_mesh_shape: drop pod.decode_mesh_shape")
    return rl_shape or pod_shape


def chip_spec(topology: str) -> tuple[str, float, float]:
    chip = topology.split(":")[0].lower()
    if chip not in CHIPS:
        raise ConfigError(f"unknown TPU chip {chip!r} in topology {topology!r}; known: {sorted(CHIPS)}")
    return (chip,) + CHIPS[chip]


def _no_tpu_attached() -> bool:
    """True when this host has no TPU chips (jax's own PCI scan); False when it cannot tell."""
    try:
        from jax._src import hardware_utils
        return hardware_utils.num_available_tpu_chips_and_device_id()[0] == 0
    except Exception:
        return False


def quiet_libtpu_env(topology: str) -> dict:
    """The TPU_* variables libtpu reads at initialization that a CPU host has no values for, set
    (unless already set) so that loading libtpu for an AOT topology prints nothing. Without them
    libtpu logs "could not determine TPU accelerator type" and "unexpected worker hostname ..."
    to stderr in front of the report: on a CPU host the metadata server it asks does not exist.
    The worker is this host; the accelerator type only sets libtpu's own host bounds (the devices
    come from `topology`, whatever it says). Only on a host without TPU chips, where the values
    cannot be wrong; errors libtpu raises still show. Returns what it set."""
    if not _no_tpu_attached():
        return {}
    chip, _, dims = topology.partition(":")
    chips = math.prod(int(d) for d in dims.split("x")) if dims and all(d.isdigit() for d in dims.split("x")) else 1
    cores = 2 if chip.lower() in ("v4", "v5p") else 1   # accelerator types count TensorCores
    name = {"v5e": "v5litepod"}.get(chip.lower(), chip.lower())
    want = {"TPU_SKIP_MDS_QUERY": "1", "TPU_WORKER_HOSTNAMES": "localhost",
            "TPU_ACCELERATOR_TYPE": f"{name}-{chips * cores}"}
    set_now = {k: v for k, v in want.items() if k not in os.environ}
    os.environ.update(set_now)
    return set_now


def topology_devices(topology: str):
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other processes may hold libtpu's lockfile
    quiet_libtpu_env(topology)
    from jax.experimental import topologies
    try:
        topo = topologies.get_topology_desc(platform="tpu", topology_name=topology)
    except Exception as e:
        raise ConfigError(f"could not get TPU topology {topology!r} from libtpu ({e}); use a known one such as "
                          f"'v5p:4x4x4' and check that jax[tpu] (libtpu) is installed") from e
    return list(topo.devices)


def _abstract(tree, shardings):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def _memory(compiled) -> dict:
    ma = compiled.memory_analysis()
    args, out, alias, temp = (ma.argument_size_in_bytes, ma.output_size_in_bytes, ma.alias_size_in_bytes,
                              ma.temp_size_in_bytes)
    peak = getattr(ma, "peak_memory_in_bytes", 0) or 0
    total = args + out - alias + temp + ma.generated_code_size_in_bytes
    return {"arguments_gib": args / GiB, "outputs_gib": out / GiB, "aliased_gib": alias / GiB,
            "temp_gib": temp / GiB, "peak_gib": max(peak, total) / GiB}


_OOM = re.compile(r"required for HLO temporaries \(([\d.]+)([KMGT])\) exceeds available HBM \(([\d.]+)([KMGT])\)")
_UNITS = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}


def _compile(lowered) -> tuple:
    """(Compiled or None, memory dict or None). The TPU compiler itself refuses programs whose
    temporaries exceed HBM (CompileTimeHbmOom); that is reported as a step that does not fit."""
    try:
        compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as e:
        msg = str(e)
        if ("RESOURCE_EXHAUSTED" not in msg and "Ran out of memory" not in msg) or "VmemOom" in msg:
            raise   # only HBM refusals are a verdict on the step; a kernel past its VMEM limit is a bug
        m = _OOM.search(msg)
        temp = float(m.group(1)) * _UNITS[m.group(2)] if m else float("inf")
        return None, {"arguments_gib": float("nan"), "outputs_gib": float("nan"), "aliased_gib": float("nan"),
                      "temp_gib": temp / GiB, "peak_gib": temp / GiB, "compile_error": msg.splitlines()[0][:300]}
    return compiled, None


_KERNEL_NAME = re.compile(r'kernel_name = "([^"]+)"')


def mosaic_kernels(lowered_text: str) -> dict[str, int]:
    """{Mosaic kernel name: tpu_custom_call sites} in a lowered program's text (a loop body's
    calls, e.g. a scanned layer's, count once)."""
    names = {}
    for line in lowered_text.splitlines():
        if "tpu_custom_call" in line:
            m = _KERNEL_NAME.search(line)
            key = m.group(1) if m else "?"
            names[key] = names.get(key, 0) + 1
    return dict(sorted(names.items()))


def _flops(compiled) -> float:
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0]
    return float(cost.get("flops", 0.0)) if cost else 0.0


def abstract_train_state(cfg, mesh):
    """(optimizer, state shardings, abstract sharded train state) of `cfg` on `mesh`."""
    from c2jax.models import abstract_params
    from c2jax.models import param_shardings
    from c2jax.ops.target import target_of_mesh
    from c2jax.train.optimizer import make_optimizer
    from c2jax.train.step import init_state, state_shardings
    optimizer = make_optimizer(cfg.train, target_of_mesh(mesh))
    # shape-only work outside the TPU mesh context (the model's init helpers run a few eager ops)
    p_sh = param_shardings(cfg, mesh)
    params = _abstract(abstract_params(cfg), p_sh)
    abstract_state = jax.eval_shape(lambda p: init_state(cfg, optimizer, p, 0), params)
    st_sh = state_shardings(cfg, optimizer, mesh, p_sh, abstract_state)
    return optimizer, st_sh, _abstract(abstract_state, st_sh)


def _per_chip_bytes(tree) -> int:
    """Bytes of the largest shard of each sharded ShapeDtypeStruct leaf, summed."""
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def state_breakdown(state) -> dict:
    """Per-chip GiB of the train state's parts: params, optimizer state, and the gradients the
    step holds (one per param, in the param dtype, sharded like it; they live in temp)."""
    params = _per_chip_bytes(state["params"])
    mtp = _per_chip_bytes({k: v for k, v in state["params"].items() if k.startswith("mtp_")})
    return {"params_gib": params / GiB, "optimizer_gib": _per_chip_bytes(state["opt_state"]) / GiB,
            "grads_gib": params / GiB, "mtp_params_gib": mtp / GiB}


def compile_train_step(cfg, mesh, state=None):
    """Lower the real train step for `mesh` (compile with `.compile()`); returns the Lowered.
    `state`: the result of abstract_train_state (computed when None)."""
    from c2jax.parallel.mesh import activate, data_sharding
    from c2jax.train.step import BATCH_KEYS, make_train_step
    t = cfg.train
    optimizer, st_sh, state = state or abstract_train_state(cfg, mesh)
    dsh = data_sharding(cfg, mesh)
    with activate(cfg, mesh):
        dtypes = {"loss_weights": jnp.float32}
        batch = {k: jax.ShapeDtypeStruct((t.batch_size, t.seq_len), dtypes.get(k, jnp.int32), sharding=dsh)
                 for k in BATCH_KEYS}
        step = make_train_step(cfg, optimizer, st_sh, dsh)
        return step.lower(state, batch)


def _decode_cfg(cfg, shape, batch: int):
    d = ml_collections.ConfigDict(cfg.to_dict())
    if shape:
        d.mesh.shape = tuple(shape)
    d.train.batch_size, d.train.grad_accum = batch, 1   # the layout checks see the decode batch
    return d


def sampler_params(cfg, mesh):
    """(sampler model cfg, abstract sharded weights) as the sampler holds them on `mesh`: bf16 when
    model.dtype is, the experts pre-quantized when model.quant is set."""
    from c2jax.models import abstract_params, param_shardings
    from c2jax.sampling import quantized
    from c2jax.sampling.engine import sampler_model_cfg
    m = sampler_model_cfg(cfg)
    m.param_dtype = "bfloat16" if m.dtype == "bfloat16" else m.param_dtype
    p_sh = param_shardings(cfg, mesh)
    params = _abstract(abstract_params(m), p_sh)
    if m.quant != "none":    # the sampler's storage (quant_scope "experts")
        qparams = jax.eval_shape(lambda p: quantized.quantize_params(p, m.quant, "experts"), params)
        params = _abstract(qparams, quantized.quantized_shardings(qparams, p_sh, mesh))
    return m, params


def compile_decode_step(cfg, devices, batch: int, cache_len: int, chunk: int = 32):
    """Lower the sampler's jitted decode chunk (`chunk` steps) on the decode mesh; returns
    (Lowered, decode mesh, {op: {implementation: call sites}} traced)."""
    from c2jax.models import init_cache
    from c2jax.parallel.mesh import make_mesh
    from c2jax.sampling.decode_weights import DecodeWeights
    from c2jax.sampling.engine import MeshLayout, decode_program
    from c2jax.sampling.rows import init_row_state
    mesh = make_mesh(cfg, devices)
    m, params = sampler_params(cfg, mesh)
    weights = DecodeWeights(params, None, "quantized" if m.quant != "none" else "float")
    cache_shapes = jax.eval_shape(lambda: init_cache(m, batch, cache_len))
    layout = MeshLayout(cfg, mesh, batch)   # where the Sampler on this mesh keeps its cache and rows
    with layout.active():
        cache = _abstract(cache_shapes, layout.cache_shardings(cache_shapes))
        rows = jax.eval_shape(lambda: init_row_state(batch))
        state = _abstract(rows, layout.row_shardings(rows))
        min_live = jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, P()))
        decode = decode_program(m, cache_len, batch)
        with record_choices() as kernels:
            lowered = decode.lower(weights, cache, state, min_live, C=chunk)
        return lowered, mesh, kernels


def rl_no_grad_forwards(cfg) -> dict:
    """The forwards without gradient the RL learner step runs besides the differentiated one:
    {"reference": 1} when rl.kl_coef > 0, {"noreplay": 1} with rl.noreplay_metrics (and router
    replay on an MoE model)."""
    from c2jax.models.transformer import layer_counts, model_cfg
    r = cfg.rl
    out = {}
    if r.kl_coef > 0:
        out["reference"] = 1
    if r.router_replay and r.get("noreplay_metrics", True) and layer_counts(model_cfg(cfg))[1] > 0:
        out["noreplay"] = 1
    return out


def abstract_rl_batch(cfg, mesh, batch_size: int, seq_len: int) -> dict:
    """The learner's RL batch (c2jax.rl.learner.build_batch's keys, shapes and dtypes; forced_ids
    [N MoE layers, B, L, K] for router replay) as ShapeDtypeStructs in batch_shardings' layout.
    Under CP the model keys enter zigzag-permuted, which does not change their shapes."""
    from c2jax.models.transformer import layer_counts, model_cfg
    from c2jax.rl.learner import batch_shardings
    m = model_cfg(cfg)
    B, L = batch_size, seq_len
    shapes = {"inputs": ((B, L), jnp.int32), "targets": ((B, L), jnp.int32), "positions": ((B, L), jnp.int32),
              "segment_ids": ((B, L), jnp.int32), "loss_mask": ((B, L), jnp.bool_),
              "behaviour_logp": ((B, L), jnp.float32), "advantages": ((B,), jnp.float32),
              "truncated": ((B,), jnp.bool_), "num_sequences": ((), jnp.float32)}
    n_moe = layer_counts(m)[1]
    if n_moe:
        shapes["forced_ids"] = ((n_moe, B, L, m.num_experts_per_tok), jnp.int32)
    batch = {k: jax.ShapeDtypeStruct(shape, dt) for k, (shape, dt) in shapes.items()}
    sh = batch_shardings(cfg, mesh, batch)
    return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sh[k]) for k, v in batch.items()}


def compile_rl_step(cfg, mesh, state=None):
    """Lower the real RL learner step (c2jax.rl.learner.make_rl_step: state donated and kept in its
    shardings) for `mesh`; `cfg` is the learner's (c2jax.rl.learner.learner_cfg). The reference
    params (rl.kl_coef > 0) are a second params tree in the params' shardings and dtype, as the
    Learner holds them. Returns (Lowered, abstract batch, abstract reference or None)."""
    from c2jax.parallel.mesh import activate
    from c2jax.rl.learner import make_rl_step
    t = cfg.train
    optimizer, st_sh, state = state or abstract_train_state(cfg, mesh)
    ref = state["params"] if cfg.rl.kl_coef > 0 else None
    batch = abstract_rl_batch(cfg, mesh, t.batch_size, t.seq_len)
    with activate(cfg, mesh):
        step = make_rl_step(cfg, optimizer, st_sh)
        return step.lower(state, ref, batch), batch, ref


COLLECTIVES = ("all-gather", "all-to-all", "collective-permute", "reduce-scatter", "all-reduce")


def collectives(hlo_text: str) -> dict[str, int]:
    """{collective: instructions} in a compiled program's HLO text (an async pair counts once, by
    its -start; ragged-all-to-all is not all-to-all)."""
    return {op: len(re.findall(rf"(?<![\w-]){op}(?:-start)?\(", hlo_text)) for op in COLLECTIVES}


def _in_device_order(sharding: NamedSharding, mesh) -> NamedSharding:
    """`sharding`'s placement (same chips, same shard on each) written over `mesh`'s device order,
    as jax.device_put does before it moves an array between two meshes of the same chips (one
    jitted program needs one device order; the relabel moves no data)."""
    if [d.id for d in sharding.mesh.devices.flat] == [d.id for d in mesh.devices.flat]:
        return sharding
    new_mesh = jax.sharding.Mesh(mesh.devices.reshape(sharding.mesh.devices.shape), sharding.mesh.axis_names)
    if sharding.is_fully_replicated:
        return NamedSharding(new_mesh, sharding.spec)
    index = {d.id: i for i, d in enumerate(mesh.devices.flat)}
    ids = tuple(index[d.id] for d in sharding.mesh.devices.flat)
    return NamedSharding(new_mesh, sharding.spec, _logical_device_ids=ids)


def compile_reshard(cfg, learner_mesh, dcfg, decode_mesh):
    """Lower the learner -> sampler weight move (c2jax.rl.roles.reshard) as one program over the
    chips: the learner's params in their shardings (learner cfg on learner_mesh), cast to
    rl.sync_dtype, out in the sampler's param shardings (dcfg on decode_mesh, the same chips).
    Returns (Lowered, abstract input params, abstract output params)."""
    from c2jax.models import abstract_params, param_shardings
    from c2jax.rl.roles import cast_floating
    dtype = jnp.dtype(cfg.rl.sync_dtype)
    src = _abstract(abstract_params(cfg), param_shardings(cfg, learner_mesh))
    out_sh = param_shardings(dcfg, decode_mesh)
    src_in_order = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=_in_device_order(x.sharding, decode_mesh)), src)
    move = jax.jit(lambda p: cast_floating(p, dtype), out_shardings=out_sh)
    lowered = move.lower(src_in_order)
    out = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                       jax.eval_shape(lambda p: cast_floating(p, dtype), src), out_sh)
    return lowered, src, out


def main(cfg, topology: str | None = None) -> dict:
    """Compile the train step (and the decode step) of `cfg` for a TPU topology on this machine.
    Returns the report: per-chip HBM (GiB) vs capacity, fits, FLOPs per chip and step, the step
    time those FLOPs imply at peak, compile seconds. Raises ConfigError before compiling for a
    bad mesh request. The programs are traced on a mesh of the topology's TPU devices, so c2jax.ops
    chooses what a TPU run chooses (the Mosaic kernels), whatever the host."""
    return _main(cfg, topology)


def _main(cfg, topology: str | None) -> dict:
    from c2jax.config import validate
    from c2jax.models import flops_per_token, param_count
    from c2jax.parallel.mesh import make_mesh
    from c2jax.train.step import train_flops_per_token
    pod = pod_cfg(cfg)
    topology = topology or pod.topology
    chip, hbm, peak = chip_spec(topology)
    devices = topology_devices(topology)
    validate(cfg, num_devices=len(devices))
    mesh = make_mesh(cfg, devices)
    t = cfg.train
    report = {"config": cfg.model.name, "topology": topology, "chip": chip, "chips": len(devices),
              "mesh": dict(mesh.shape), "hbm_per_chip_gib": hbm / GiB, "peak_bf16_tflops": peak / 1e12,
              "params": param_count(cfg), "batch_size": t.batch_size, "seq_len": t.seq_len,
              "grad_accum": t.grad_accum}
    t0 = time.time()
    abstract = abstract_train_state(cfg, mesh)
    with record_choices() as kernels:
        lowered = compile_train_step(cfg, mesh, abstract)
    mosaic = mosaic_kernels(lowered.as_text())
    compiled, train = _compile(lowered)
    train = train or _memory(compiled)
    train.update(kernels=kernels, mosaic_calls=sum(mosaic.values()), mosaic_kernels=mosaic)
    train.update(state_breakdown(abstract[2]))
    # what the temp holds besides the gradients: activations, remat checkpoints, collectives'
    # buffers, per-layer workspace (XLA does not split temp further)
    train["activations_gib"] = train["temp_gib"] - train["grads_gib"]
    flops = _flops(compiled) if compiled is not None else float("nan")
    tokens = t.batch_size * t.seq_len
    model_flops = train_flops_per_token(cfg, t.seq_len) * tokens
    # XLA's cost analysis counts a loop body once (scanned layers, query chunks), so the step
    # time uses the model FLOPs (6N + causal attention, as MFU does); both are reported
    train.update(compile_s=round(time.time() - t0, 1), xla_flops_per_chip=flops,
                 flops_per_step=model_flops, flops_per_chip=model_flops / len(devices),
                 step_s_at_peak=model_flops / len(devices) / peak)
    report["train"] = train
    batch = pod.decode_batch or len(devices)
    dcfg = _decode_cfg(cfg, decode_mesh_shape(cfg), batch)
    if pod.compile_rl:
        report["rl_step"] = rl_step_section(cfg, mesh, len(devices), peak)
    if pod.compile_decode:
        t0 = time.time()
        lowered, dmesh, kernels = compile_decode_step(dcfg, devices, batch, pod.decode_len, pod.decode_chunk)
        mosaic = mosaic_kernels(lowered.as_text())
        compiled, dec = _compile(lowered)
        dec = dec or _memory(compiled)
        dec.update(kernels=kernels, mosaic_calls=sum(mosaic.values()), mosaic_kernels=mosaic)
        dec["weights_gib"] = _per_chip_bytes(sampler_params(dcfg, dmesh)[1]) / GiB   # the sampler's weights
        dflops = _flops(compiled) if compiled is not None else float("nan")
        # one token per row and step: 2N + attention over a full cache (flops_per_token halves
        # seq_len for causality); the figures are per decode step, the program runs decode_chunk
        dec_flops = flops_per_token(cfg, 2 * pod.decode_len, training=False) * batch
        dec.update(compile_s=round(time.time() - t0, 1), mesh=dict(dmesh.shape), batch=batch,
                   cache_len=pod.decode_len, chunk=pod.decode_chunk, xla_flops_per_chip=dflops, flops_per_step=dec_flops,
                   flops_per_chip=dec_flops / len(devices), step_s_at_peak=dec_flops / len(devices) / peak)
        report["decode"] = dec
    if pod.compile_rl:
        report["reshard"] = reshard_section(cfg, mesh, dcfg, devices)
    return judge(cfg, report)


def rl_step_section(cfg, mesh, chips: int, peak: float) -> dict:
    """The RL learner step's report section: HBM per chip and its breakdown (the train step's
    plus the reference params and the RL batch), kernels, Mosaic calls, FLOPs and time at peak
    (the CPT step's 6N + attention plus one 2N + attention per no-grad forward)."""
    from c2jax.models import flops_per_token
    from c2jax.rl.learner import learner_cfg, num_micro_batches
    from c2jax.train.step import train_flops_per_token
    lcfg = learner_cfg(cfg)
    t, r = lcfg.train, lcfg.rl
    t0 = time.time()
    abstract = abstract_train_state(lcfg, mesh)
    with record_choices() as kernels:
        lowered, batch, ref = compile_rl_step(lcfg, mesh, abstract)
    mosaic = mosaic_kernels(lowered.as_text())
    compiled, s = _compile(lowered)
    s = s or _memory(compiled)
    s.update(kernels=kernels, mosaic_calls=sum(mosaic.values()), mosaic_kernels=mosaic)
    s.update(state_breakdown(abstract[2]))
    s["reference_gib"] = _per_chip_bytes(ref) / GiB if ref is not None else 0.0
    s["batch_gib"] = _per_chip_bytes(batch) / GiB
    s["activations_gib"] = s["temp_gib"] - s["grads_gib"]
    fwd = rl_no_grad_forwards(lcfg)
    tokens = t.batch_size * t.seq_len
    train_flops = train_flops_per_token(lcfg, t.seq_len) * tokens
    forward_flops = flops_per_token(lcfg, t.seq_len, training=False) * tokens
    model_flops = train_flops + sum(fwd.values()) * forward_flops
    s.update(compile_s=round(time.time() - t0, 1), no_grad_forwards=fwd, kl_coef=float(r.kl_coef),
             router_replay="forced_ids" in batch and bool(r.router_replay),
             micro_batches=num_micro_batches(t.batch_size, int(r.micro_batch_rows)),
             xla_flops_per_chip=_flops(compiled) if compiled is not None else float("nan"),
             train_flops_per_step=train_flops, forward_flops_per_step=forward_flops, flops_per_step=model_flops,
             flops_per_chip=model_flops / chips, step_s_at_peak=model_flops / chips / peak)
    return s


def _overlap(a: tuple, b: tuple, shape) -> int:
    """Elements in both of two shards' index tuples (slices per dim)."""
    n = 1
    for sa, sb, size in zip(a, b, shape):
        lo = max(sa.start or 0, sb.start or 0)
        hi = min(size if sa.stop is None else sa.stop, size if sb.stop is None else sb.stop)
        n *= max(hi - lo, 0)
    return n


def received_bytes_per_chip(src, out) -> int:
    """The most bytes one chip must receive from others in a move from `src` to `out` (abstract
    sharded trees of the same shapes): each chip's output shard less what of it the chip already
    holds in its input shard, in the output's dtype, summed over leaves."""
    recv = {}
    for x, y in zip(jax.tree.leaves(src), jax.tree.leaves(out)):
        have = x.sharding.devices_indices_map(x.shape)
        for d, idx in y.sharding.devices_indices_map(y.shape).items():
            want = math.prod(len(range(*sl.indices(n))) for sl, n in zip(idx, y.shape))
            local = _overlap(idx, have[d], y.shape) if d in have else 0
            recv[d.id] = recv.get(d.id, 0) + (want - local) * y.dtype.itemsize
    return max(recv.values()) if recv else 0


def reshard_section(cfg, mesh, dcfg, devices) -> dict:
    """The learner -> sampler weight move's report section: bytes per chip in (the learner's f32
    params) and out (the sampler's copy), the most one chip receives, the program's HBM per chip
    and the collectives the compiled program runs."""
    from c2jax.parallel.mesh import make_mesh
    from c2jax.rl.learner import learner_cfg
    lcfg = learner_cfg(cfg)
    dmesh = make_mesh(dcfg, devices)
    t0 = time.time()
    lowered, src, out = compile_reshard(lcfg, mesh, dcfg, dmesh)
    compiled, s = _compile(lowered)
    s = s or _memory(compiled)
    same_order = [d.id for d in mesh.devices.flat] == [d.id for d in dmesh.devices.flat]
    s.update(compile_s=round(time.time() - t0, 1), dtype=str(jnp.dtype(lcfg.rl.sync_dtype)),
             learner_mesh=dict(mesh.shape), sampler_mesh=dict(dmesh.shape), same_device_order=same_order,
             in_gib_per_chip=_per_chip_bytes(src) / GiB, out_gib_per_chip=_per_chip_bytes(out) / GiB,
             received_gib_per_chip=received_bytes_per_chip(src, out) / GiB,
             collectives=collectives(compiled.as_text()) if compiled is not None else {})
    return s


STEPS = ("train", "rl_step", "decode", "reshard")   # the programs a report may hold


def judge(cfg, report: dict) -> dict:
    """Set `fits` per step and overall, and `advice` (what to change), from the config's
    pod.hbm_headroom and the chip's capacity."""
    pod = pod_cfg(cfg)
    usable = pod.hbm_headroom * report["hbm_per_chip_gib"]
    for k in STEPS:
        if k in report:
            report[k]["fits"] = report[k]["peak_gib"] <= usable
    report["fits"] = all(report[k]["fits"] for k in STEPS if k in report)
    report["advice"] = advice(cfg, report, pod)
    return report


def advice(cfg, report, pod) -> str:
    """What to change when a step does not fit ("" when everything fits)."""
    lines = []
    cap = report["hbm_per_chip_gib"] * pod.hbm_headroom
    tr = report.get("train")
    if tr and not tr["fits"]:
        state_gib = tr["arguments_gib"]
        hints = []
        if state_gib > 0.6 * cap:
            hints.append("shard params/optimizer state wider: a larger fsdp axis in mesh.shape (or map "
                         "'expert_embed' to fsdp in mesh.rules), or a larger topology")
        if tr["temp_gib"] > 0.4 * cap:
            if cfg.model.remat != "full":
                hints.append("set model.remat='full'")
            hints.append("lower train.batch_size per step (raise train.grad_accum) or train.seq_len, or raise "
                         "the context axis (CP) in mesh.shape, or set mesh.attention_chunk")
        lines.append(f"train step needs {tr['peak_gib']:.1f} GiB per chip > {cap:.1f} GiB usable "
                     f"({pod.hbm_headroom:.0%} of {report['hbm_per_chip_gib']:.1f}); " + "; ".join(hints))
    rl = report.get("rl_step")
    if rl and not rl["fits"]:
        hints = []
        if rl.get("reference_gib", 0) > 0:
            hints.append(f"the reference params take {rl['reference_gib']:.1f} GiB per chip (rl.kl_coef > 0)")
        hints.append("run the step in micro-batches (rl.micro_batch_rows, a multiple of the batch axes), lower "
                     "train.batch_size or train.seq_len, or set rl.noreplay_metrics=False")
        lines.append(f"RL learner step needs {rl['peak_gib']:.1f} GiB per chip > {cap:.1f} GiB usable; "
                     + "; ".join(hints))
    rs = report.get("reshard")
    if rs and not rs["fits"]:
        lines.append(f"learner -> sampler reshard needs {rs['peak_gib']:.1f} GiB per chip > {cap:.1f} GiB usable")
    dec = report.get("decode")
    if dec and not dec["fits"]:
        lines.append(f"decode step needs {dec['peak_gib']:.1f} GiB per chip > {cap:.1f} GiB usable; lower "
                     f"pod.decode_batch or pod.decode_len, or widen the decode mesh's expert/fsdp axes "
                     f"(rl.sampler_mesh_shape, else pod.decode_mesh_shape)")
    return "\n".join(lines)


def _size(gib: float) -> str:
    return f"{gib:.2f} GiB" if gib >= 0.1 else f"{gib * 1024:.2f} MiB"


def format_report(r: dict) -> str:
    """Human-readable compile-check report."""
    out = [(f"{r['config']} on {r['topology']} ({r['chips']} x {r['chip']}, {r['hbm_per_chip_gib']:.1f} GiB HBM, "
            f"{r['peak_bf16_tflops']:.0f} TFLOP/s bf16 per chip)"),
           (f"  params: {r['params']['total'] / 1e9:.2f}B total, {r['params']['active'] / 1e9:.2f}B active"
            + (f", of which MTP heads {r['params']['mtp'] / 1e9:.2f}B" if r["params"].get("mtp") else "")
            + f"; mesh {r['mesh']}")]
    for name in ("train", "rl_step", "decode"):
        s = r.get(name)
        if not s:
            continue
        if name == "train":
            what = f"batch {r['batch_size']} x {r['seq_len']} tokens (grad_accum {r['grad_accum']})"
        elif name == "rl_step":
            fwd = ", ".join(f"{k} x{n}" for k, n in s["no_grad_forwards"].items()) or "none"
            what = (f"RL learner, batch {r['batch_size']} x {r['seq_len']} tokens in {s['micro_batches']} "
                    f"micro-batch(es), no-grad forwards: {fwd}, router replay {'on' if s['router_replay'] else 'off'}")
        else:
            what = (f"sampler decode chunk of {s.get('chunk', 1)} steps, batch {s['batch']}, cache {s['cache_len']}, "
                    f"mesh {s['mesh']}; per step")
        out.append(f"  {name.replace('_step', '')} step [{what}]: compiled in {s['compile_s']} s")
        if s.get("compile_error"):
            out.append(f"    the TPU compiler ran out of HBM: {s['compile_error']}")
        out.append(f"    HBM per chip {s['peak_gib']:.2f} / {r['hbm_per_chip_gib']:.1f} GiB "
                   f"(args {s['arguments_gib']:.2f}, temp {s['temp_gib']:.2f}, out {s['outputs_gib']:.2f}, "
                   f"aliased {s['aliased_gib']:.2f}) -> {'FITS' if s['fits'] else 'DOES NOT FIT'}")
        if "reference_gib" in s:
            out.append(f"      = params {s['params_gib']:.2f} + optimizer {s['optimizer_gib']:.2f} (arguments, "
                       f"donated) + reference {s['reference_gib']:.2f} + batch {s['batch_gib']:.2f} (arguments) "
                       f"+ grads {s['grads_gib']:.2f} + activations/workspace {s['activations_gib']:.2f} (temp) GiB")
        elif "params_gib" in s:
            out.append(f"      = params {s['params_gib']:.2f} + optimizer {s['optimizer_gib']:.2f} (arguments, "
                       f"donated) + grads {s['grads_gib']:.2f} + activations/workspace {s['activations_gib']:.2f} "
                       f"(temp) GiB")
        if s.get("mtp_params_gib"):
            out.append(f"      of which the MTP heads' params: {_size(s['mtp_params_gib'])} per chip (their grads "
                       f"and optimizer state in proportion)")
        if "weights_gib" in s:
            out.append(f"      the sampler's weights: {s['weights_gib']:.2f} GiB per chip")
        if "kernels" in s:
            ops = "; ".join(f"{op} {', '.join(sorted(impls))}" for op, impls in sorted(s["kernels"].items()))
            calls = ", ".join(f"{k} x{n}" for k, n in s.get("mosaic_kernels", {}).items()) or "none"
            out.append(f"    kernels: {ops}")
            out.append(f"    Mosaic calls in the program ({s['mosaic_calls']}): {calls}")
        kind = {"train": "6N + attention", "decode": "2N + attention"}.get(name)
        if name == "rl_step":
            kind = f"6N + attention + {sum(s['no_grad_forwards'].values())} x (2N + attention)"
        out.append(f"    FLOPs per step {s['flops_per_step']:.3e} ({kind}), {s['flops_per_chip']:.3e} per chip -> "
                   f"{s['step_s_at_peak'] * 1e3:.1f} ms at peak (XLA cost analysis, loop bodies counted once: "
                   f"{s['xla_flops_per_chip']:.3e} per chip)")
    rs = r.get("reshard")
    if rs:
        out.append(f"  reshard learner {rs['learner_mesh']} -> sampler {rs['sampler_mesh']} as {rs['dtype']}: "
                   f"compiled in {rs['compile_s']} s")
        out.append(f"    per chip: in {_size(rs['in_gib_per_chip'])}, out {_size(rs['out_gib_per_chip'])}, at most "
                   f"{_size(rs['received_gib_per_chip'])} received from other chips; HBM {_size(rs['peak_gib'])} "
                   f"-> {'FITS' if rs['fits'] else 'DOES NOT FIT'}")
        coll = ", ".join(f"{k} x{n}" for k, n in rs["collectives"].items() if n) or "none"
        out.append(f"    collectives in the compiled program: {coll}")
    if r.get("advice"):
        out.append("  TO FIT: " + r["advice"])
    return "\n".join(out)


def write_report(report: dict, path: str, argv) -> None:
    """The report as JSON at `path`, with the UTC date, the command line, jax and libtpu versions."""
    import datetime
    import importlib.metadata
    import json
    import os

    def version(pkg):
        try:
            return importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            return None
    out = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "command": "python -m c2jax " + " ".join(argv), "jax": jax.__version__, "libtpu": version("libtpu"),
           **report}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1, default=str)


def check(cfg, topology: str | None = None, report: dict | None = None) -> dict:
    """main + print; raises ConfigError naming what to change when the config does not fit."""
    report = report or main(cfg, topology)
    print(format_report(report), flush=True)
    if not report["fits"]:
        raise ConfigError(report["advice"])
    return report

