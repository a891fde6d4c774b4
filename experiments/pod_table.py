"""The README's pod tables from compile-check reports (`python -m c2jax compile-check --config C
--report experiments/results/pods/NAME.json`): one row per report, with the kernels each program
contains; `--rl`: one row per report of an RL pod config (the RL learner step, the learner ->
sampler reshard, the sampler's decode chunk); `--rl-compare`: for each RL report, the learner
step against the CPT step plus its no-grad forwards, and the reshard's bytes per chip against the
sampler's weights per chip.

    python experiments/pod_table.py experiments/results/pods/*.json > experiments/results/pods/table.md
    python experiments/pod_table.py --rl experiments/results/pods/*.json > experiments/results/pods/rl_table.md
    python experiments/pod_table.py --rl-compare experiments/results/pods/*.json > experiments/results/pods/rl.md
"""
from __future__ import annotations

import json
import sys


def _kernels(step: dict) -> str:
    mosaic = ", ".join(f"{k.strip('_')} x{n}" for k, n in step.get("mosaic_kernels", {}).items()) or "none"
    ops = "; ".join(f"{op} {'/'.join(sorted(impls))}" for op, impls in sorted(step.get("kernels", {}).items())
                    if op in ("attention", "decode_attention", "mla_cache_attention", "experts"))
    return f"{ops} (Mosaic: {mosaic})"


def row(report: dict) -> str:
    """One Markdown table row of a compile-check report."""
    tr, dec = report["train"], report.get("decode")
    mesh = " x ".join(f"{a}{n}" for a, n in report["mesh"].items() if n > 1)
    cfg = report["command"].split("--config ")[1].split()[0]
    fits = "yes" if report["fits"] else "**no**"
    cells = [f"`{cfg}` ({mesh}, {report['batch_size']}x{report['seq_len'] // 1024}K)", report["topology"],
             f"{tr['peak_gib']:.1f} GiB", fits,
             f"{tr['flops_per_step']:.2e} -> {tr['step_s_at_peak']:.2f} s", _kernels(tr)]
    if dec:
        cells += [f"{dec['peak_gib']:.1f} GiB", _kernels(dec)]
    else:
        cells += ["-", "-"]
    cells.append(report["date"])
    return "| " + " | ".join(cells) + " |"


def _cfg(report: dict) -> str:
    return report["command"].split("--config ")[1].split()[0]


def _collectives(rs: dict) -> str:
    return ", ".join(f"{k} x{n}" for k, n in rs["collectives"].items() if n) or "none"


def rl_row(report: dict) -> str:
    """One Markdown table row of an RL pod config's report."""
    rl, rs, dec = report["rl_step"], report["reshard"], report.get("decode")
    mesh = " x ".join(f"{a}{n}" for a, n in report["mesh"].items() if n > 1)
    fwd = sum(rl["no_grad_forwards"].values())
    cells = [f"`{_cfg(report)}` ({mesh}, {report['batch_size']}x{report['seq_len'] // 1024}K)", report["topology"],
             f"{rl['peak_gib']:.1f} GiB (params {rl['params_gib']:.1f} + Adam {rl['optimizer_gib']:.1f} + reference "
             f"{rl['reference_gib']:.1f} + grads {rl['grads_gib']:.1f} + activations {rl['activations_gib']:.1f})",
             "yes" if rl["fits"] else "**no**",
             f"{rl['flops_per_step']:.2e} (6N+attn + {fwd} x 2N+attn) -> {rl['step_s_at_peak']:.2f} s",
             _kernels(rl),
             f"{rs['dtype']}, {rs['out_gib_per_chip']:.2f} GiB out / {rs['in_gib_per_chip']:.2f} in / "
             f"{rs['received_gib_per_chip']:.2f} received per chip, HBM {rs['peak_gib']:.1f} GiB; {_collectives(rs)}",
             f"{dec['peak_gib']:.1f} GiB (weights {dec['weights_gib']:.2f})" if dec else "-",
             f"{rl['compile_s']:.0f} / {rs['compile_s']:.0f} s", report["date"]]
    return "| " + " | ".join(cells) + " |"


def rl_table(paths) -> str:
    """The RL pod table for the reports at `paths` that hold an RL learner step."""
    head = ("| config | topology | RL step HBM / chip | fits | RL step FLOPs -> time at peak | RL step kernels "
            "| learner -> sampler reshard | sampler decode HBM / chip | compile (RL step / reshard) | compiled |\n"
            "|---|---|---|---|---|---|---|---|---|---|")
    reports = [json.load(open(p)) for p in paths if "rl_step" in json.load(open(p))]
    cmds = [f"- `{_cfg(r)}`: `{r['command']}` (jax {r['jax']}, libtpu {r['libtpu']})" for r in reports]
    return "\n".join([head] + [rl_row(r) for r in reports] + ["", "Written by:", ""] + cmds)


def rl_compare(paths) -> str:
    """Per RL report: the learner step against the CPT step plus its no-grad forwards (time at
    peak from model FLOPs; HBM; XLA's own FLOP count, whose loop bodies count once in both
    programs alike), and the reshard's bytes per chip against the sampler's weights per chip."""
    out = []
    for r in (json.load(open(p)) for p in paths):
        if "rl_step" not in r:
            continue
        tr, rl, rs, dec = r["train"], r["rl_step"], r["reshard"], r.get("decode", {})
        chips, peak = r["chips"], r["peak_bf16_tflops"] * 1e12
        fwd_n = sum(rl["no_grad_forwards"].values())
        fwd_s = rl["forward_flops_per_step"] / chips / peak
        want_s = tr["step_s_at_peak"] + fwd_n * fwd_s
        xla_want = (tr["flops_per_step"] + fwd_n * rl["forward_flops_per_step"]) / tr["flops_per_step"]
        fwds = ", ".join(f"{k} x{n}" for k, n in rl["no_grad_forwards"].items()) or "none"
        out += [f"### `{_cfg(r)}` on {r['topology']} ({r['date']})", "",
                f"`{r['command']}`", "",
                "| learner step | CPT step | + no-grad forwards | = expected | RL step |",
                "|---|---|---|---|---|",
                f"| time at peak (model FLOPs) | {tr['step_s_at_peak']:.3f} s | {fwd_n} x {fwd_s:.3f} s ({fwds}) | "
                f"{want_s:.3f} s | {rl['step_s_at_peak']:.3f} s |",
                f"| XLA FLOPs per chip (loop bodies once) | {tr['xla_flops_per_chip']:.3e} | x{xla_want:.3f} by model "
                f"FLOPs | {tr['xla_flops_per_chip'] * xla_want:.3e} | {rl['xla_flops_per_chip']:.3e} "
                f"(x{rl['xla_flops_per_chip'] / tr['xla_flops_per_chip']:.3f}) |",
                f"| HBM per chip | {tr['peak_gib']:.2f} GiB | reference {rl['reference_gib']:.2f} + batch "
                f"{rl['batch_gib']:.2f} GiB | {tr['peak_gib'] + rl['reference_gib'] + rl['batch_gib']:.2f} GiB | "
                f"{rl['peak_gib']:.2f} GiB (activations/workspace {rl['activations_gib']:.2f} vs "
                f"{tr['activations_gib']:.2f}) |",
                f"| Mosaic calls | {tr['mosaic_calls']} | | | {rl['mosaic_calls']} |",
                f"| compile | {tr['compile_s']:.0f} s | | | {rl['compile_s']:.0f} s |", "",
                f"Reshard learner {rs['learner_mesh']} -> sampler {rs['sampler_mesh']} ({rs['dtype']}, one program, "
                f"compiled in {rs['compile_s']:.0f} s):", "",
                "| per chip | GiB |", "|---|---|",
                f"| the sampler's weights (decode step's) | {dec.get('weights_gib', float('nan')):.2f} |",
                f"| reshard out (the sampler's copy) | {rs['out_gib_per_chip']:.2f} |",
                f"| reshard in (the learner's f32 params) | {rs['in_gib_per_chip']:.2f} |",
                f"| received from other chips (at most, over chips) | {rs['received_gib_per_chip']:.2f} |",
                f"| the program's HBM | {rs['peak_gib']:.2f} |", "",
                f"Collectives in the compiled reshard: {_collectives(rs)}.", ""]
    return "\n".join(out)


def main(paths) -> str:
    """The table for the reports at `paths`."""
    head = ("| config | topology | train HBM / chip | fits | train FLOPs/step -> time at peak | train kernels "
            "| decode HBM / chip | decode kernels | compiled |\n|---|---|---|---|---|---|---|---|---|")
    reports = [json.load(open(p)) for p in paths]
    return "\n".join([head] + [row(r) for r in reports])


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rl"]:
        print(rl_table(sys.argv[2:]))
    elif sys.argv[1:2] == ["--rl-compare"]:
        print(rl_compare(sys.argv[2:]))
    else:
        print(main(sys.argv[1:]))
