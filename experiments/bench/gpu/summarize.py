"""Tables and c2jax / HF ratios from the JSON lines of the GPU run (stdlib only).

    python3 experiments/bench/gpu/summarize.py OUT/results.jsonl --md OUT/summary.md

Train: tokens/s, step ms, MFU (vs 790 TFLOP/s, vs the datasheet 989.5, vs the bf16 matmul
measured in the run) and the ratio to the HF peer's bf16 row (and its amp row). Decode: per batch
c2jax vs HF ms/step, x HF (decode tokens/s ratio), the bytes-moved bound and c2jax / bound.
Appends one {"part": "summary", ...} line with the headline ratios to the JSONL.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_common import H200_BF16_MEASURED, H200_BF16_SPEC  # noqa: E402


def fmt(x, spec=".1f", na="n/a"):
    return na if x is None else format(x, spec)


def train_table(train, model, measured, torch_peak, summary) -> list:
    """Markdown lines of one model's train rows (ratios against that model's HF rows); fills summary."""
    ok = [r for r in train if "tokens_per_s" in r]
    fpt = next((r["flops_per_token"] for r in ok if r.get("flops_per_token")), None)
    hf = {r["variant"]: r for r in ok if r["impl"] == "hf"}
    prefix = "train_" if model == "l" else f"train_{model}_"
    out = []
    B = next((r["batch"] for r in ok), None)
    L = next((r["seq"] for r in ok), None)
    P = next((r["params"] for r in ok if r.get("params")), None)
    out += [f"## Train step ({model}: Qwen3-MoE, {fmt(P and P / 1e6)}M params, batch {B} x {L})", "",
            f"bf16 matmul peak measured: jnp {fmt(measured)} TFLOP/s, torch {fmt(torch_peak)} TFLOP/s; "
            f"MFU columns: vs 790 (H200 bf16, measured earlier), vs 989.5 (datasheet), vs jnp measured here. "
            f"FLOPs/token {fmt(fpt and fpt / 1e6)} M (c2jax.models.flops_per_token, used for both).", "",
            "| impl | variant | dtype / params | dispatch | tokens/s | step ms | MFU 790 | MFU 989 | MFU meas | "
            "x HF bf16 | x HF amp | compile s | dropped |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in train:
        if "tokens_per_s" not in r:
            out.append(f"| {r.get('impl')} | {r.get('variant')} | {r.get('error') or r.get('skipped')} "
                       "| | | | | | | | | | |")
            continue
        tps = r["tokens_per_s"]
        f = r.get("flops_per_token") or fpt
        mfu = (lambda p: f * tps / p) if f else (lambda p: None)
        x_bf16 = tps / hf["bf16"]["tokens_per_s"] if "bf16" in hf else None
        x_amp = tps / hf["amp"]["tokens_per_s"] if "amp" in hf else None
        out.append(
            f"| {r['impl']} | {r['variant']} | {r.get('dtype')} / {r.get('param_dtype')} | "
            f"{r.get('dispatch', (r.get('impl_detail') or {}).get('experts'))} "
            f"{'cf ' + str(r['capacity_factor']) if r.get('dispatch') == 'capacity' else ''} | {tps:,.0f} | "
            f"{1e3 * r['step_s_median']:.1f} | {fmt(mfu(H200_BF16_MEASURED) and 100 * mfu(H200_BF16_MEASURED))}% | "
            f"{fmt(mfu(H200_BF16_SPEC) and 100 * mfu(H200_BF16_SPEC))}% | "
            f"{fmt(measured and f and 100 * f * tps / (measured * 1e12))}% | "
            f"{fmt(x_bf16, '.2f')} | {fmt(x_amp, '.2f')} | {fmt(r.get('compile_s'))} | "
            f"{fmt(r.get('max_dropped_fraction'), '.4f')} |")
        if r["impl"] == "c2jax":
            summary[f"{prefix}{r['variant']}_tokens_per_s"] = tps
            summary[f"{prefix}{r['variant']}_mfu_vs_790"] = mfu(H200_BF16_MEASURED)
            if measured and f:
                summary[f"{prefix}{r['variant']}_mfu_vs_measured"] = f * tps / (measured * 1e12)
            if x_bf16:
                summary[f"{prefix}{r['variant']}_x_hf_bf16"] = x_bf16
            if x_amp:
                summary[f"{prefix}{r['variant']}_x_hf_amp"] = x_amp
    for name, r in hf.items():
        summary[f"{prefix}hf_{name}_tokens_per_s"] = r["tokens_per_s"]
    for r in ok:
        prof = r.get("profile")
        if prof and prof.get("ops"):
            out += ["", f"Top device ops, {r['variant']} (two traced steps, {prof['total_ms']:.1f} ms of ops):", "",
                    "| op | ms | calls | share |", "|---|---|---|---|"]
            out += [f"| `{o['name'][:80]}` | {o['ms']:.2f} | {o['count']} | {100 * o['share']:.1f}% |"
                    for o in prof["ops"][:10]]
    return out + [""]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("jsonl")
    ap.add_argument("--md", default=None)
    args = ap.parse_args()
    rows = []
    with open(args.jsonl) as f:
        for ln in f:
            ln = ln.strip()
            if ln.startswith("{"):
                try:
                    rows.append(json.loads(ln))
                except json.JSONDecodeError:
                    pass
    env = {}
    for r in rows:   # the first env row per (impl, part): the later parts' rows repeat them without peaks
        if r.get("part", "").endswith("_env"):
            env.setdefault((r.get("impl"), r["part"]), r)
    train = [r for r in rows if r.get("part") == "train"]
    decode = [r for r in rows if r.get("part") == "decode"]
    measured = env.get(("c2jax", "train_env"), {}).get("matmul_peak_bf16_tflops")
    torch_peak = env.get(("hf", "train_env"), {}).get("torch_matmul_peak_bf16_tflops")
    summary = {"part": "summary"}
    out = []
    models = []
    for r in train:
        if r.get("model", "l") not in models:
            models.append(r.get("model", "l"))
    for model in models:
        out += train_table([r for r in train if r.get("model", "l") == model], model, measured, torch_peak, summary)

    bw = env.get(("c2jax", "decode_env"), {}).get("bandwidth_GB_s")
    bw = bw.get("read") if isinstance(bw, dict) else bw   # rows written before the read / read_write split
    hf_dec = {r["batch"]: r for r in decode if r.get("impl") == "hf" and "ms_per_step" in r}
    d0 = next((r for r in decode if r.get("impl") == "c2jax" and "ms_per_step" in r), {})
    out += ["", f"## Decode ({d0.get('model')}, {fmt(d0.get('params') and d0['params'] / 1e6)}M params, "
            f"{d0.get('dtype')}, greedy, prompt {d0.get('prompt_len')}, {d0.get('new_tokens')} new tokens); "
            f"bandwidth {fmt(bw)} GB/s", "",
            "| variant | batch | path | c2jax ms/step | c2jax decode tok/s | HF ms/step | HF decode tok/s | x HF | "
            "bound ms/step | c2jax / bound | prefill s |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in decode:
        if r.get("impl") != "c2jax":
            continue
        if "ms_per_step" not in r:
            out.append(f"| {r.get('variant')} | {r.get('batch')} | {r.get('error') or r.get('skipped')} "
                       "| | | | | | | | |")
            continue
        h = hf_dec.get(r["batch"])
        x = r["decode_tokens_per_s"] / h["decode_tokens_per_s"] if h else None
        out.append(f"| {r['variant']} | {r['batch']} | {r.get('path')} | {r['ms_per_step']:.3f} | "
                   f"{r['decode_tokens_per_s']:,.0f} | {fmt(h and h['ms_per_step'], '.3f')} | "
                   f"{fmt(h and h['decode_tokens_per_s'], ',.0f')} | {fmt(x, '.2f')} | "
                   f"{fmt(r.get('bound_ms_per_step'), '.4f')} | {fmt(r.get('c2jax_over_bound'), '.1f')} | "
                   f"{fmt(r.get('prefill_s'), '.3f')} |")
        key = f"decode_{r['variant']}_b{r['batch']}"
        summary[key + "_ms"] = r["ms_per_step"]
        summary[key + "_x_hf"] = x
        summary[key + "_over_bound"] = r.get("c2jax_over_bound")
    for b, h in sorted(hf_dec.items()):
        summary[f"decode_hf_b{b}_ms"] = h["ms_per_step"]
    errs = [r for r in rows if r.get("error")]
    if errs:
        out += ["", "## Errors", ""] + [f"- {r.get('part')} {r.get('impl')} {r.get('variant', r.get('batch'))}: "
                                         f"{str(r['error'])[-300:]}" for r in errs]
    text = "\n".join(out) + "\n"
    print(text)
    if args.md:
        with open(args.md, "w") as f:
            f.write(text)
    with open(args.jsonl, "a") as f:
        f.write(json.dumps(summary) + "\n")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
