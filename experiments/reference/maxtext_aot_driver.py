"""MaxText's train step, compiled ahead of time for a TPU topology, with the compiler's reports
written as JSON. Runs in `.venv-maxtext` (experiments/reference/setup_maxtext_env.sh); called by
experiments/bench/tpu_aot.py as a subprocess:

    .venv-maxtext/bin/python experiments/reference/maxtext_aot_driver.py --out OUT.json -- \
        model_name=qwen3-30b-a3b compile_topology=v5p:4x4x4 internal_compile=true ...

Everything after `--` is MaxText's own `key=value` overrides of its base.yml (as for
`python -m maxtext.trainers.pre_train.train_compile base.yml key=value ...`). The driver runs
MaxText's `train_compile.main` unchanged, with its `jit_and_compile` wrapped so that the Lowered
and Compiled objects are kept: from them it records per-chip memory_analysis(), cost_analysis()
(flops, bytes accessed, optimal_seconds), the Mosaic kernels in the lowered text
(`tpu_custom_call` sites per kernel name), and the lower / compile wall times. A compile that
the TPU compiler refuses for HBM (RESOURCE_EXHAUSTED) is recorded with the temp size it asked for.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import sys
import time
import traceback

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")   # other processes may hold libtpu's lockfile
os.environ.setdefault("JAX_PLATFORMS", "cpu")              # the TPU devices come from the topology
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

GiB = 1024 ** 3
_KERNEL_NAME = re.compile(r'kernel_name = "([^"]+)"')
_OOM = re.compile(r"required for HLO temporaries \(([\d.]+)([KMGT])\) exceeds available HBM \(([\d.]+)([KMGT])\)")
_UNITS = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}


def mosaic_kernels(text: str) -> dict:
    names = {}
    for line in text.splitlines():
        if "tpu_custom_call" in line:
            m = _KERNEL_NAME.search(line)
            key = m.group(1) if m else "?"
            names[key] = names.get(key, 0) + 1
    return dict(sorted(names.items()))


def kernels_without_cost_estimate(text: str) -> dict:
    """{Mosaic kernel name: tpu_custom_call sites with no cost estimate}: XLA's cost analysis
    counts no FLOPs for such a kernel (pallas_call(cost_estimate=...) is what it reads)."""
    names = {}
    for line in text.splitlines():
        if "tpu_custom_call" in line and "cost_estimate" not in line:
            m = _KERNEL_NAME.search(line)
            key = m.group(1) if m else "?"
            names[key] = names.get(key, 0) + 1
    return dict(sorted(names.items()))


_SHAPE = re.compile(r"\b(pred|[a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\]")
_MEMREF = re.compile(r"memref<([\dx]*?)x?([a-z]+\d*)(?:, #tpu\.memory_space<(\w+)>)?>")


def _shapes(text: str) -> list[list]:
    """[[dtype, [dims]], ...] of the HLO shapes in `text` (token types and the like skipped)."""
    return [[m.group(1), [int(x) for x in m.group(2).split(",") if x]] for m in _SHAPE.finditer(text)]


def _mosaic_body(body_b64: str) -> dict:
    """Kernel name, grid and block shapes of a serialized Mosaic module (the `body` of a
    tpu_custom_call's backend config): {"kernel", "grid", "scalar_prefetch", "scratch", "blocks":
    [[memory space, dtype, [dims]] per kernel operand after the scalar-prefetch refs, inputs then
    outputs then scratch]}; {} when it cannot be read."""
    import base64
    try:
        from jax._src.lib.mlir import ir
        ctx = ir.Context()
        ctx.allow_unregistered_dialects = True
        with ctx:
            text = str(ir.Module.parse(base64.b64decode(body_b64)))
    except Exception:  # noqa: BLE001 - an unreadable body leaves the call's tiling unknown
        return {}
    for line in text.splitlines():
        gm = re.search(r"iteration_bounds = array<i64:? ?([-\d, ]*)>", line)   # < 0: a dynamic grid dim
        if not gm or "function_type" not in line:
            continue
        grid = [int(x) for x in gm.group(1).split(",") if x.strip()]
        name = re.search(r'sym_name = "([^"]+)"', line)
        sp = re.search(r"scalar_prefetch = (\d+)", line)
        sc = re.search(r"scratch_operands = (\d+)", line)
        ft = re.search(r"function_type = \((.*?)\) -> ", line).group(1)
        refs = [[m.group(3) or "any", m.group(2), [int(x) for x in m.group(1).split("x") if x]]
                for m in _MEMREF.finditer(ft)]
        n_sp = int(sp.group(1)) if sp else 0
        return {"kernel": name.group(1) if name else "?", "grid": grid, "scalar_prefetch": n_sp,
                "scratch": int(sc.group(1)) if sc else 0, "blocks": refs[n_sp:]}
    return {}


def _braced(text: str, key: str) -> str:
    """The text inside the balanced {...} that follows `key` in `text` ('' when absent)."""
    i = text.find(key + "{")
    if i < 0:
        return ""
    i += len(key) + 1
    depth, j = 1, i
    while j < len(text) and depth:
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        j += 1
    return text[i:j - 1]


def mosaic_calls(hlo_text: str) -> list[dict]:
    """Every Mosaic kernel call (custom-call tpu_custom_call) in an optimized HLO module, grouped
    by identical calls: {"kernel", "count", "operands" / "outputs": [[dtype, [dims]], ...] (all
    operands, scalar-prefetch ones first), "grid", "scalar_prefetch", "blocks" (from the kernel's
    body: the VMEM block of each windowed operand, in HBM ("any") the whole array), "cost_estimate"
    (what the kernel's author handed XLA: {flops, bytes_accessed, transcendentals}, or None)}.
    A call inside a loop body counts once (as XLA's cost analysis counts it)."""
    out, bodies = {}, {}
    # one instruction per chunk: an attribute (frontend_attributes' kernel_metadata) may span lines
    for line in re.split(r"\n(?=\s*(?:ROOT )?%)", hlo_text):
        if 'custom_call_target="tpu_custom_call"' not in line:
            continue
        head, _, rest = line.partition(" custom-call(")
        outputs = _shapes(head.split("=", 1)[1] if "=" in head else head)
        operands = _shapes(_braced(rest, "operand_layout_constraints="))
        try:
            cfg, _ = json.JSONDecoder().raw_decode(rest[rest.index("backend_config=") + len("backend_config="):])
        except (ValueError, json.JSONDecodeError):
            cfg = {}
        ccc = cfg.get("custom_call_config", {})
        body = ccc.get("body", "")
        if body not in bodies:
            bodies[body] = _mosaic_body(body) if body else {}
        info = bodies[body]
        ce = ccc.get("cost_estimate")
        ce = {k: float(ce.get(k, 0)) for k in ("flops", "bytes_accessed", "transcendentals")} if ce else None
        call = {"kernel": info.get("kernel", "?"), "operands": operands, "outputs": outputs,
                "grid": info.get("grid"), "scalar_prefetch": info.get("scalar_prefetch", 0),
                "scratch": info.get("scratch", 0),
                "blocks": info.get("blocks"), "cost_estimate": ce}
        key = json.dumps(call, sort_keys=True)
        if key in out:
            out[key]["count"] += 1
        else:
            out[key] = dict(call, count=1)
    return sorted(out.values(), key=lambda c: (c["kernel"], -c["count"]))


def memory(compiled) -> dict:
    ma = compiled.memory_analysis()
    args, out, alias, temp = (ma.argument_size_in_bytes, ma.output_size_in_bytes, ma.alias_size_in_bytes,
                              ma.temp_size_in_bytes)
    peak = getattr(ma, "peak_memory_in_bytes", 0) or 0
    total = args + out - alias + temp + ma.generated_code_size_in_bytes
    return {"arguments_gib": args / GiB, "outputs_gib": out / GiB, "aliased_gib": alias / GiB,
            "temp_gib": temp / GiB, "generated_code_gib": ma.generated_code_size_in_bytes / GiB,
            "peak_gib": max(peak, total) / GiB}


def cost(compiled) -> dict:
    c = compiled.cost_analysis()
    if isinstance(c, (list, tuple)):
        c = c[0]
    c = c or {}
    return {"flops": float(c.get("flops", 0.0)), "bytes_accessed": float(c.get("bytes accessed", 0.0)),
            "optimal_seconds": float(c.get("optimal_seconds", 0.0)),
            "transcendentals": float(c.get("transcendentals", 0.0))}


def version(pkg):
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


def portable_paths(text: str) -> str:
    """text with this checkout's and the interpreter's install prefixes cut, so a committed report
    names files as any checkout has them (experiments/..., site-packages/...)."""
    import site
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for prefix in sorted({*site.getsitepackages(), here}, key=len, reverse=True):
        text = text.replace(prefix.rstrip("/") + "/", "")
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="JSON report path")
    ap.add_argument("--keep-text", default="", help="also write the lowered StableHLO text here")
    ap.add_argument("--keep-hlo", default="", help="also write the optimized HLO text here")
    ap.add_argument("--no-calls", action="store_true",
                    help="skip recording the Mosaic calls of the optimized HLO (shapes, tiling, cost estimates)")
    ap.add_argument("overrides", nargs="*", help="MaxText key=value overrides (after --)")
    args = ap.parse_args(argv)

    import jax
    from maxtext.configs import pyconfig
    from maxtext.trainers.pre_train import train_compile as tc

    seen = {}
    original = tc.jit_and_compile

    def jit_and_compile(func, func_input_args, func_input_kwargs, mesh, in_shardings, out_shardings,
                        static_argnums, donate_argnums, config, logical_axis_rules):
        # train_compile.jit_and_compile, keeping the Lowered object and timing both phases
        import contextlib
        from maxtext.utils import max_utils
        seen["mesh"] = {k: int(v) for k, v in mesh.shape.items() if v > 1}
        mesh_ctx = mesh if config.enable_diloco else contextlib.nullcontext()
        t0 = time.time()
        with jax.set_mesh(mesh), mesh_ctx, logical_axis_rules:
            jitted = jax.jit(func, in_shardings=in_shardings, out_shardings=out_shardings,
                             static_argnums=static_argnums, donate_argnums=donate_argnums)
            lowered = jitted.lower(*func_input_args, **func_input_kwargs)
        seen["lower_s"] = round(time.time() - t0, 1)
        text = lowered.as_text()
        seen["mosaic_kernels"] = mosaic_kernels(text)
        seen["kernels_without_cost_estimate"] = kernels_without_cost_estimate(text)
        if args.keep_text:
            with open(args.keep_text, "w") as f:
                f.write(text)
        del text
        options = max_utils.parse_libtpu_flags_to_dict(config.compile_xla_flags)
        t0 = time.time()
        try:
            compiled = lowered.compile(compiler_options=options)
        finally:
            seen["compile_s"] = round(time.time() - t0, 1)
        seen["memory"] = memory(compiled)
        seen["cost"] = cost(compiled)
        if not args.no_calls or args.keep_hlo:
            hlo = compiled.as_text()
            if not args.no_calls:
                seen["mosaic_calls"] = mosaic_calls(hlo)
            if args.keep_hlo:
                with open(args.keep_hlo, "w") as f:
                    f.write(hlo)
            del hlo
        return compiled

    assert original is not None
    tc.jit_and_compile = jit_and_compile
    mt_argv = ["train_compile", os.path.join(pyconfig.MAXTEXT_CONFIGS_DIR, "base.yml"), *args.overrides]
    report = {"side": "maxtext", "maxtext": version("maxtext"), "jax": jax.__version__, "libtpu": version("libtpu"),
              "flax": version("flax"), "overrides": args.overrides}
    t0 = time.time()
    rc = 0
    try:
        tc.main(mt_argv)
        report["status"] = "ok"
    except Exception as e:  # noqa: BLE001 - every failure is reported in the JSON
        msg = str(e)
        if "VmemOom" in msg:   # a kernel's blocks past its scoped VMEM limit: not an HBM verdict
            report["status"] = "vmem_oom"
            rc = 1
        elif "RESOURCE_EXHAUSTED" in msg or "Ran out of memory" in msg:
            m = _OOM.search(msg)
            temp = float(m.group(1)) * _UNITS[m.group(2)] if m else float("nan")
            report["status"] = "hbm_oom"
            report["memory"] = {"temp_gib": temp / GiB, "peak_gib": temp / GiB}
        else:
            report["status"] = "error"
            rc = 1
        report["error"] = msg.splitlines()[0][:500] if msg else type(e).__name__
        report["traceback"] = portable_paths(traceback.format_exc()[-3000:])
    report["wall_s"] = round(time.time() - t0, 1)
    report.update({k: v for k, v in seen.items() if k not in report})
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1, default=str)
    print(json.dumps({k: report.get(k) for k in ("status", "memory", "cost", "lower_s", "compile_s")}), flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
