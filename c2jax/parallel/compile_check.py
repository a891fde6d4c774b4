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
then read per-chip HBM from memory_analysis() and FLOPs from cost_analysis(), and compare them
with the chip's HBM capacity and peak bf16 FLOP/s.

Pod configs add a `pod` section (see configs/pods/): topology, decode_batch, decode_len,
decode_mesh_shape, hbm_headroom. `main(cfg, topology)` returns the report dict; `format_report`
renders it; a config that does not fit raises ConfigError naming what to change (after the
report is printed by the CLI).
"""
from __future__ import annotations

import math
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
    p.decode_mesh_shape = ()          # mesh.shape for decoding (() = the training mesh)
    p.decode_chunk = 32               # decode steps per on-device loop (the sampler's `chunk`)
    p.hbm_headroom = 0.9              # a config "fits" when peak HBM <= headroom * capacity
    p.compile_decode = True           # also compile the sampler decode step
    return p


def pod_cfg(cfg) -> ml_collections.ConfigDict:
    p = pod_defaults()
    if "pod" in cfg:
        for k, v in cfg.pod.items():
            with p.ignore_type():
                p[k] = v
    return p


def chip_spec(topology: str) -> tuple[str, float, float]:
    chip = topology.split(":")[0].lower()
    if chip not in CHIPS:
        raise ConfigError(f"unknown TPU chip {chip!r} in topology {topology!r}; known: {sorted(CHIPS)}")
    return (chip,) + CHIPS[chip]


def topology_devices(topology: str):
    import os
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other processes may hold libtpu's lockfile
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
        if "RESOURCE_EXHAUSTED" not in msg and "Ran out of memory" not in msg:
            raise
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
    return {"params_gib": params / GiB, "optimizer_gib": _per_chip_bytes(state["opt_state"]) / GiB,
            "grads_gib": params / GiB}


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


def compile_decode_step(cfg, devices, batch: int, cache_len: int, chunk: int = 32):
    """Lower the sampler's jitted decode chunk (`chunk` steps) on the decode mesh; returns
    (Lowered, decode mesh, {op: {implementation: call sites}} traced)."""
    from c2jax.models import abstract_params, init_cache, param_shardings
    from c2jax.parallel.mesh import activate, logical_to_mesh_spec, make_mesh
    from c2jax.sampling import quantized
    from c2jax.sampling.decode_weights import DecodeWeights
    from c2jax.sampling.engine import decode_program, sampler_model_cfg
    from c2jax.sampling.rows import init_row_state
    mesh = make_mesh(cfg, devices)
    m = sampler_model_cfg(cfg)
    m.param_dtype = "bfloat16" if m.dtype == "bfloat16" else m.param_dtype
    p_sh = param_shardings(cfg, mesh)
    params = _abstract(abstract_params(m), p_sh)
    if m.quant != "none":    # the sampler's storage (quant_scope "experts")
        qparams = jax.eval_shape(lambda p: quantized.quantize_params(p, m.quant, "experts"), params)
        params = _abstract(qparams, quantized.quantized_shardings(qparams, p_sh, mesh))
    weights = DecodeWeights(params, None, "quantized" if m.quant != "none" else "float")
    cache_shapes = jax.eval_shape(lambda: init_cache(m, batch, cache_len))
    with activate(cfg, mesh):
        b_spec = logical_to_mesh_spec(P("batch"), cfg, mesh)[0]
        if b_spec is not None:
            names = b_spec if isinstance(b_spec, tuple) else (b_spec,)
            if batch % math.prod(mesh.shape[a] for a in names):
                b_spec = None
        cache = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=NamedSharding(mesh, P(None, b_spec))), cache_shapes)
        state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=NamedSharding(mesh, P(b_spec, *[None] * (x.ndim - 1)))),
            jax.eval_shape(lambda: init_row_state(batch)))
        min_live = jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, P()))
        decode = decode_program(m, cache_len, batch)
        with record_choices() as kernels:
            lowered = decode.lower(weights, cache, state, min_live, C=chunk)
        return lowered, mesh, kernels


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
    pod = pod_cfg(cfg)
    topology = topology or pod.topology
    chip, hbm, peak = chip_spec(topology)
    devices = topology_devices(topology)
    validate(cfg, num_devices=len(devices))
    mesh = make_mesh(cfg, devices)
    if mesh.shape.get("context", 1) > 1 and cfg.model.num_mtp_layers:
        # the trainer (c2jax.train.loop) refuses this combination; do not prove a layout it cannot run
        raise ConfigError("MTP heads with context parallelism (mesh context > 1) are not supported in training "
                          "(the MTP shift assumes in-order tokens); set model.num_mtp_layers=0 or drop the "
                          "context axis")
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
    model_flops = flops_per_token(cfg, t.seq_len) * tokens
    # XLA's cost analysis counts a loop body once (scanned layers, query chunks), so the step
    # time uses the model FLOPs (6N + causal attention, as MFU does); both are reported
    train.update(compile_s=round(time.time() - t0, 1), xla_flops_per_chip=flops,
                 flops_per_step=model_flops, flops_per_chip=model_flops / len(devices),
                 step_s_at_peak=model_flops / len(devices) / peak)
    report["train"] = train
    if pod.compile_decode:
        batch = pod.decode_batch or len(devices)
        dcfg = _decode_cfg(cfg, pod.decode_mesh_shape, batch)
        t0 = time.time()
        lowered, dmesh, kernels = compile_decode_step(dcfg, devices, batch, pod.decode_len, pod.decode_chunk)
        mosaic = mosaic_kernels(lowered.as_text())
        compiled, dec = _compile(lowered)
        dec = dec or _memory(compiled)
        dec.update(kernels=kernels, mosaic_calls=sum(mosaic.values()), mosaic_kernels=mosaic)
        dflops = _flops(compiled) if compiled is not None else float("nan")
        # one token per row and step: 2N + attention over a full cache (flops_per_token halves
        # seq_len for causality); the figures are per decode step, the program runs decode_chunk
        dec_flops = flops_per_token(cfg, 2 * pod.decode_len, training=False) * batch
        dec.update(compile_s=round(time.time() - t0, 1), mesh=dict(dmesh.shape), batch=batch,
                   cache_len=pod.decode_len, chunk=pod.decode_chunk, xla_flops_per_chip=dflops, flops_per_step=dec_flops,
                   flops_per_chip=dec_flops / len(devices), step_s_at_peak=dec_flops / len(devices) / peak)
        report["decode"] = dec
    return judge(cfg, report)


def judge(cfg, report: dict) -> dict:
    """Set `fits` per step and overall, and `advice` (what to change), from the config's
    pod.hbm_headroom and the chip's capacity."""
    pod = pod_cfg(cfg)
    usable = pod.hbm_headroom * report["hbm_per_chip_gib"]
    for k in ("train", "decode"):
        if k in report:
            report[k]["fits"] = report[k]["peak_gib"] <= usable
    report["fits"] = all(report[k]["fits"] for k in ("train", "decode") if k in report)
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
    dec = report.get("decode")
    if dec and not dec["fits"]:
        lines.append(f"decode step needs {dec['peak_gib']:.1f} GiB per chip > {cap:.1f} GiB usable; lower "
                     f"pod.decode_batch or pod.decode_len, or widen pod.decode_mesh_shape's expert/fsdp axes")
    return "\n".join(lines)


def format_report(r: dict) -> str:
    """Human-readable compile-check report."""
    out = [(f"{r['config']} on {r['topology']} ({r['chips']} x {r['chip']}, {r['hbm_per_chip_gib']:.1f} GiB HBM, "
            f"{r['peak_bf16_tflops']:.0f} TFLOP/s bf16 per chip)"),
           (f"  params: {r['params']['total'] / 1e9:.2f}B total, {r['params']['active'] / 1e9:.2f}B active; "
            f"mesh {r['mesh']}")]
    for name in ("train", "decode"):
        s = r.get(name)
        if not s:
            continue
        what = (f"batch {r['batch_size']} x {r['seq_len']} tokens (grad_accum {r['grad_accum']})" if name == "train"
                else f"sampler decode chunk of {s.get('chunk', 1)} steps, batch {s['batch']}, cache {s['cache_len']}, "
                     f"mesh {s['mesh']}; per step")
        out.append(f"  {name} step [{what}]: compiled in {s['compile_s']} s")
        if s.get("compile_error"):
            out.append(f"    the TPU compiler ran out of HBM: {s['compile_error']}")
        out.append(f"    HBM per chip {s['peak_gib']:.2f} / {r['hbm_per_chip_gib']:.1f} GiB "
                   f"(args {s['arguments_gib']:.2f}, temp {s['temp_gib']:.2f}, out {s['outputs_gib']:.2f}, "
                   f"aliased {s['aliased_gib']:.2f}) -> {'FITS' if s['fits'] else 'DOES NOT FIT'}")
        if "params_gib" in s:
            out.append(f"      = params {s['params_gib']:.2f} + optimizer {s['optimizer_gib']:.2f} (arguments, "
                       f"donated) + grads {s['grads_gib']:.2f} + activations/workspace {s['activations_gib']:.2f} "
                       f"(temp) GiB")
        if "kernels" in s:
            ops = "; ".join(f"{op} {', '.join(sorted(impls))}" for op, impls in sorted(s["kernels"].items()))
            calls = ", ".join(f"{k} x{n}" for k, n in s.get("mosaic_kernels", {}).items()) or "none"
            out.append(f"    kernels: {ops}")
            out.append(f"    Mosaic calls in the program ({s['mosaic_calls']}): {calls}")
        kind = "6N + attention" if name == "train" else "2N + attention"
        out.append(f"    FLOPs per step {s['flops_per_step']:.3e} ({kind}), {s['flops_per_chip']:.3e} per chip -> "
                   f"{s['step_s_at_peak'] * 1e3:.1f} ms at peak (XLA cost analysis, loop bodies counted once: "
                   f"{s['xla_flops_per_chip']:.3e} per chip)")
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

