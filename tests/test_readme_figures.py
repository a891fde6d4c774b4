"""Every figure in the README's benchmark table is in the artifact its row names.

Each row of the table under `## Benchmarks` names its artifacts (JSON, Markdown or the log a
benchmark command writes) in its `artifact` column and the command in its `command` column. Every
number in the measured columns (c2jax, the reference measured in the same run, the ratio, the
spread over runs) must appear in one of the row's artifacts, either as written or as a number
there that rounds to it at the README's precision (JSON holds unrounded values).
"""
from __future__ import annotations

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")

MEASURED_COLUMNS = ("c2jax", "reference, same run", "ratio", "spread over runs")
# A number: not part of a word (f32, bf16, v5p) or of a longer number; thousands may be comma-grouped.
NUMBER = re.compile(r"(?<![\w.])\d{1,3}(?:,\d{3})+(?:\.\d+)?(?!\d|\.\d)|(?<![\w.,])\d+(?:\.\d+)?(?!\d|,\d|\.\d)")


def numbers(text: str) -> list[str]:
    """The numbers in `text`, as written (commas kept)."""
    return NUMBER.findall(text)


def _value(token: str) -> tuple[float, int]:
    """(value, decimals) of a number as written."""
    plain = token.replace(",", "")
    return float(plain), len(plain.split(".")[1]) if "." in plain else 0


def matches(figure: str, candidates: list[float]) -> bool:
    """Whether some artifact number, rounded to the figure's decimals, is the figure."""
    value, decimals = _value(figure)
    tol = 0.5 * 10 ** -decimals + 1e-9
    return any(abs(c - value) <= tol for c in candidates)


def benchmark_table(text: str) -> list[dict]:
    """The rows of the first table after `## Benchmarks`, as {column: cell}."""
    section = text.split("\n## Benchmarks", 1)[1]
    lines = [ln for ln in section.splitlines() if ln.startswith("|")]
    if not lines:
        return []
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = []
    for ln in lines[2:]:
        cells = [c.strip() for c in ln.strip().strip("|").split("|")]
        assert len(cells) == len(header), f"malformed benchmark row: {ln}"
        rows.append(dict(zip(header, cells)))
    return rows


def _artifact_numbers(path: str) -> list[float]:
    with open(path) as f:
        return [_value(t)[0] for t in numbers(f.read())]


def _rows():
    with open(README) as f:
        return benchmark_table(f.read())


def test_number_parsing():
    assert numbers("1462 tok/s (median step 2802 ms); MFU 62.4% (280.8 GFLOP/s)") == ["1462", "2802", "62.4", "280.8"]
    assert numbers("410,413 tok/s, f32 master, bf16") == ["410,413"]
    assert numbers("1.53x-1.61x over three runs") == ["1.53", "1.61"]
    assert matches("2.02", [2.024124260611168]) and not matches("2.03", [2.024124260611168])
    assert matches("410,413", [410413.0]) and not matches("1462", [1460.0])


def test_benchmark_table_is_there():
    rows = _rows()
    assert len(rows) >= 3, "the README's benchmark table is missing"
    for col in MEASURED_COLUMNS + ("benchmark", "command", "artifact"):
        assert col in rows[0], f"benchmark table has no '{col}' column"


@pytest.mark.parametrize("row", _rows(), ids=lambda r: r["benchmark"][:60])
def test_benchmark_figures_are_in_their_artifacts(row):
    paths = re.findall(r"`([^`]+)`", row["artifact"])
    assert paths, f"row names no artifact: {row['benchmark']}"
    candidates = []
    for p in paths:
        full = os.path.join(ROOT, p)
        assert os.path.isfile(full), f"artifact {p} is not in the repository"
        candidates += _artifact_numbers(full)
    script = re.search(r"(experiments/\S+\.(?:py|sh))", row["command"])
    assert script and os.path.isfile(os.path.join(ROOT, script.group(1))), f"command names no script: {row['command']}"
    missing = [f"{col}: {fig}" for col in MEASURED_COLUMNS for fig in numbers(row[col]) if not matches(fig, candidates)]
    assert not missing, f"figures not in {', '.join(paths)}: {missing}"


DEMO_ARTIFACT = "experiments/results/demo/report.json"
DEMO_TIME = "experiments/results/demo/make_demo_time.txt"


def _quick_start() -> str:
    with open(README) as f:
        return f.read().split("\n## Quick start", 1)[1].split("\n## ", 1)[0]


def test_quick_start_has_the_two_commands():
    section = _quick_start()
    commands = [ln.strip() for ln in section.split("```bash", 1)[1].split("```", 1)[0].splitlines() if ln.strip()]
    assert commands == ["make demo", "make test"], commands


def test_demo_figures_are_in_the_demo_report():
    """Every number in the quick start's demo table is in the committed report of a fresh run."""
    section = _quick_start()
    assert DEMO_ARTIFACT in section
    lines = [ln for ln in section.splitlines() if ln.startswith("|")][2:]
    assert len(lines) >= 5, "the quick start's demo table is missing"
    candidates = _artifact_numbers(os.path.join(ROOT, DEMO_ARTIFACT))
    missing = [fig for ln in lines for fig in numbers(ln) if not matches(fig, candidates)]
    assert not missing, f"demo figures not in {DEMO_ARTIFACT}: {missing}"
    with open(os.path.join(ROOT, DEMO_TIME)) as f:
        elapsed = re.search(r"Elapsed .*: (\d+):(\d+)", f.read())
    m = re.search(r"(\d+) min (\d+) s in all", section)
    assert elapsed and m and elapsed.groups() == (m.group(1), m.group(2)), "the demo's total time is not its artifact's"


TPU_AOT_DIR = "experiments/results/tpu_aot"
TPU_AOT_COLUMNS = ("c2jax HBM / chip", "MaxText HBM / chip", "c2jax step (s)", "MaxText step (s)")


def _readme_table(heading: str, index: int = 0) -> tuple[list, list]:
    """(header, rows as dicts) of the index-th table in the README section under `heading`."""
    with open(README) as f:
        section = f.read().split(heading, 1)[1].split("\n### ", 1)[0]
    tables, prev = [], False
    for ln in section.splitlines():
        is_row = ln.startswith("|")
        if is_row and not prev:
            tables.append([])
        if is_row:
            tables[-1].append(ln)
        prev = is_row
    lines = tables[index]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    return header, [dict(zip(header, (c.strip() for c in ln.strip().strip("|").split("|")))) for ln in lines[2:]]


def _reports_numbers(directory: str) -> list:
    d = os.path.join(ROOT, directory)
    return [x for name in sorted(os.listdir(d)) if name.endswith(".json") for x in _artifact_numbers(os.path.join(d, name))]


def test_maxtext_side_by_side_figures_are_in_the_tpu_aot_reports():
    """The pod section's MaxText table: every HBM and step-time figure is in a committed report."""
    header, rows = _readme_table("### Side by side with MaxText")
    assert len(rows) >= 4 and all(c in header for c in TPU_AOT_COLUMNS)
    candidates = _reports_numbers(TPU_AOT_DIR)
    # numbers inside code spans are settings (`model.head_chunks=8`), not figures
    missing = [f"{r['point']}: {fig}" for r in rows for col in TPU_AOT_COLUMNS
               for fig in numbers(re.sub(r"`[^`]*`", "", r[col])) if not matches(fig, candidates)]
    assert not missing, f"figures not in {TPU_AOT_DIR}/*.json: {missing}"


def test_maxtext_best_vs_best_figures_are_in_the_best_vs_best_report():
    """The MaxText section's second table (each side at its best remat policy): every step, HBM
    and ratio figure is in experiments/results/tpu_aot/best_vs_best.json, which `tpu_aot.py --best` wrote."""
    header, rows = _readme_table("### Side by side with MaxText", 1)
    assert len(rows) >= 2 and header[-1] == "MaxText / c2jax step"
    candidates = _artifact_numbers(os.path.join(ROOT, TPU_AOT_DIR, "best_vs_best.json"))
    missing = [f"{r['point']}: {fig}" for r in rows for col in header[1:]
               for fig in numbers(re.sub(r"`[^`]*`", "", r[col])) if not matches(fig, candidates)]
    assert not missing, f"figures not in {TPU_AOT_DIR}/best_vs_best.json: {missing}"


TUNIX_DIR = "experiments/results/tunix"
TUNIX_COLUMNS = ("c2jax HBM / chip", "Tunix HBM / chip", "c2jax step (s)", "Tunix step (s): update + reference")


def test_tunix_side_by_side_figures_are_in_the_tunix_reports():
    """The README's Tunix table: every HBM and step figure is in a committed report of
    experiments/bench/tunix_rl_aot.py (the step's parts in the one-cost-model figures it records)."""
    header, rows = _readme_table("### RL learner side by side with Tunix")
    assert len(rows) >= 2 and all(c in header for c in TUNIX_COLUMNS)
    candidates = _reports_numbers(TUNIX_DIR)
    with open(os.path.join(ROOT, TUNIX_DIR, "table.md")) as f:   # sums the table command wrote (12.089 = 9.514 + 2.574)
        candidates += [float(x) for x in re.findall(r"\d+\.\d+", f.read())]
    missing = [f"{r['layout']}: {fig}" for r in rows for col in TUNIX_COLUMNS
               for fig in numbers(re.sub(r"`[^`]*`", "", r[col])) if not matches(fig, candidates)]
    assert not missing, f"figures not in {TUNIX_DIR}: {missing}"
