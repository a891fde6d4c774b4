"""The README's pod table from compile-check reports (`python -m c2jax compile-check --config C
--report experiments/results/pods/NAME.json`): one row per report, with the kernels each program
contains.

    python experiments/pod_table.py experiments/results/pods/*.json > experiments/results/pods/table.md
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


def main(paths) -> str:
    """The table for the reports at `paths`."""
    head = ("| config | topology | train HBM / chip | fits | train FLOPs/step -> time at peak | train kernels "
            "| decode HBM / chip | decode kernels | compiled |\n|---|---|---|---|---|---|---|---|---|")
    reports = [json.load(open(p)) for p in paths]
    return "\n".join([head] + [row(r) for r in reports])


if __name__ == "__main__":
    print(main(sys.argv[1:]))
