"""Self-summarization vs prompt-based compaction vs truncation vs full context (report section 4)
on held-out long-horizon tasks (c2jax.tasks.long_horizon: more tool output than the context).

Methods (same episode runner, c2jax.agent.summarize):
  full        no trigger, unbounded context: the reference ("compaction error" = its success minus
              a method's success)
  full@W      no trigger, context window W: what happens without any compaction
  self@T      the policy's own summary at trigger T, decoded on the live cache, window W
  prompt@T    a separate compaction prompt over the full transcript at trigger T, window W
  truncate@T  drop the oldest turns at trigger T (keep T/2 tokens of recent turns), window W
Two triggers in a 2:1 ratio (like the report's 80k / 40k). Metrics per method: success, compaction
error, summaries per episode, summary tokens (per summary and per episode), tokens prefilled per
episode (a prefix cache per episode: HarnessSampler's accounting, see PrefillMeter), turns.

Policies:
  default      LongHorizonPolicy: deterministic scripted agent that decides only from its
               current context and writes real summaries (byte tokenizer: tokens = bytes).
  --model-run  a trained run dir (e.g. runs/demo/sft): its tokenizer + params through
               c2jax.pipeline.model_policy_factory (sampler max_len = window + 1). Triggers and
               window are then in that tokenizer's tokens.
  --rl         before evaluating, an RL phase with self-summarization (c2jax.rl.loop.run_rl on
               configs/rl_tiny.py, init from --model-run); runs only when the RL config has the
               self-summary fields (rl.summary_trigger_tokens), otherwise says so and skips.

Run: JAX_PLATFORMS=cpu python experiments/self_summary.py [--n-tasks 20] [--triggers 4096 2048]
     [--window 8192] [--model-run runs/demo/sft] [--out experiments/results/self_summary]
Writes OUT/table.md, OUT/results.json (per episode rows too) and OUT/self_summary.png.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from c2jax.agent import summarize as sm  # noqa: E402
from c2jax.agent.runner import EpisodeConfig, run_episode  # noqa: E402
from c2jax.tasks import long_horizon as lh  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "self_summary")


def methods(triggers, window):
    rows = [("full", "none", None, None), (f"full@{window}", "none", None, window)]
    for t in triggers:
        for m in ("self", "prompt", "truncate"):
            rows.append((f"{m}@{t}", m, t, window))
    return rows


def run_method(tasks, policy_factory, tokenizer, sandbox, base: EpisodeConfig, method: str, trigger, window,
               max_summaries: int, max_summary_tokens: int) -> list[dict]:
    cfg = sm.summary_episode_config(dataclasses.replace(base, max_context_tokens=window),
                                    sm.SummaryConfig(method, trigger_tokens=trigger or 1, max_summaries=max_summaries,
                                                     max_summary_tokens=max_summary_tokens))
    rows = []
    for task in tasks:
        meter = sm.PrefillMeter(policy_factory(task), slots=2)
        t0 = time.monotonic()
        res = run_episode(task, meter, tokenizer, sandbox, cfg)
        s = res.stats
        rows.append({"task_id": task.task_id, "passed": bool(res.grade and res.grade.passed),
                     "finish_reason": s["finish_reason"], "turns": s["turns"], "segments": len(res.segments),
                     "summaries": s.get("summaries", 0), "truncations": s.get("truncations", 0),
                     "summary_tokens": s.get("summary_tokens", 0),
                     "summary_prefill_tokens": s.get("summary_prefill_tokens", 0),
                     "prefill_tokens": meter.prefill_tokens, "completion_tokens": s["completion_tokens"],
                     "max_segment_tokens": max(len(x.tokens_T) for x in res.segments),
                     "wall_s": time.monotonic() - t0, "error": s.get("error", "")[:300]})
    return rows


def aggregate(rows: list[dict]) -> dict:
    n = len(rows)
    summ = sum(r["summaries"] for r in rows)
    return {"n": n, "success": sum(r["passed"] for r in rows) / n,
            "summaries_per_episode": summ / n,
            "compactions_per_episode": sum(r["summaries"] + r["truncations"] for r in rows) / n,
            "summary_tokens_per_summary": (sum(r["summary_tokens"] for r in rows) / summ) if summ else 0.0,
            "summary_tokens_per_episode": sum(r["summary_tokens"] for r in rows) / n,
            "prefill_tokens_per_episode": statistics.mean(r["prefill_tokens"] for r in rows),
            "summary_prefill_per_summary": (sum(r["summary_prefill_tokens"] for r in rows) / summ) if summ else 0.0,
            "completion_tokens_per_episode": statistics.mean(r["completion_tokens"] for r in rows),
            "turns": statistics.mean(r["turns"] for r in rows),
            "max_segment_tokens": max(r["max_segment_tokens"] for r in rows),
            "finish_reasons": dict(sorted({r["finish_reason"]: sum(x["finish_reason"] == r["finish_reason"]
                                                                   for x in rows) for r in rows}.items()))}


def table(results: dict) -> str:
    ref = results["full"]["success"]
    lines = ["| method | success | compaction error | compactions / ep | summary tokens / summary | "
             "summary tokens / ep | prefill tokens / ep | prefill per summary call | turns | max segment | "
             "finish reasons |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, a in results.items():
        lines.append(f"| {name} | {a['success']:.2f} | {ref - a['success']:+.2f} | {a['compactions_per_episode']:.1f} | "
                     f"{a['summary_tokens_per_summary']:.0f} | {a['summary_tokens_per_episode']:.0f} | "
                     f"{a['prefill_tokens_per_episode']:.0f} | {a['summary_prefill_per_summary']:.0f} | "
                     f"{a['turns']:.1f} | {a['max_segment_tokens']} | "
                     f"{', '.join(f'{k} {v}' for k, v in a['finish_reasons'].items())} |")
    return "\n".join(lines)


def plot(results: dict, path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(results)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    colors = ["#777777" if n.startswith("full") else {"self": "#1f77b4", "prompt": "#ff7f0e",
                                                       "truncate": "#2ca02c"}[n.split("@")[0]] for n in names]
    for ax, key, label in ((axes[0], "success", "success (held-out)"),
                           (axes[1], "summary_tokens_per_summary", "summary tokens per summary"),
                           (axes[2], "prefill_tokens_per_episode", "tokens prefilled per episode")):
        ax.bar(range(len(names)), [results[n][key] for n in names], color=colors)
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, rotation=45, ha="right", fontsize=8)
        ax.set_title(label)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def maybe_rl(args) -> str | None:
    """Optional RL phase; returns the RL run dir to evaluate, or None (skipped, with the reason)."""
    try:
        from c2jax.config import load_config
        from c2jax.rl.config import rl_defaults
        from c2jax.rl.loop import run_rl
    except ImportError as e:
        print(f"RL phase skipped: c2jax.rl.loop.run_rl is not importable ({e})")
        return None
    if "summary_trigger_tokens" not in rl_defaults():
        print("RL phase skipped: the RL config has no self-summary fields yet (rl.summary_trigger_tokens, "
              "rl.summary_method, rl.context_window); see c2jax/rl/chains.py for what the RL side must call")
        return None
    if not args.model_run:
        print("RL phase skipped: --rl needs --model-run (the SFT run to start from)")
        return None
    workdir = os.path.join(args.out, "rl_run")
    cfg = load_config("configs/rl_tiny.py", [f"--config.train.init_from={args.model_run}",
                                             "--config.rl.suites=('long_horizon',)",
                                             "--config.rl.summary_method=self",
                                             f"--config.rl.summary_trigger_tokens={args.triggers[0]}",
                                             f"--config.rl.context_window={args.window}", *args.rl_override])
    run_rl(cfg, workdir)
    return workdir


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-tasks", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n-files", type=int, default=10)
    ap.add_argument("--file-chars", type=int, default=900)
    ap.add_argument("--triggers", type=int, nargs=2, default=[4096, 2048])
    ap.add_argument("--window", type=int, default=8192)
    ap.add_argument("--max-summaries", type=int, default=16)
    ap.add_argument("--max-summary-tokens", type=int, default=2048)
    ap.add_argument("--max-turns", type=int, default=60)
    ap.add_argument("--model-run", default=None)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--rl", action="store_true")
    ap.add_argument("--rl-override", nargs="*", default=[])
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args(argv)
    if args.triggers[0] != 2 * args.triggers[1]:
        print(f"note: triggers {args.triggers} are not in a 2:1 ratio")
    os.makedirs(args.out, exist_ok=True)
    from c2jax.agent.sandbox import Sandbox
    sandbox = Sandbox()
    tasks = lh.load("heldout", args.n_tasks, args.seed, n_files=args.n_files, file_chars=args.file_chars)
    base = EpisodeConfig(max_turns=args.max_turns, max_new_tokens=args.max_summary_tokens, max_total_tokens=400_000,
                         list_tools_in_system=False, max_tool_output_chars=4000)
    tokenizer, policy_name = None, "scripted LongHorizonPolicy (byte tokens)"
    factory = lh.make_long_horizon_policy
    run_dir = maybe_rl(args) if args.rl else None
    model_run = run_dir or args.model_run
    if model_run:
        from c2jax.data.tokenizer import Tokenizer
        from c2jax.pipeline import model_policy_factory
        from c2jax.train.loop import load_run_config, load_run_params
        cfg = load_run_config(model_run)
        tokenizer = Tokenizer.load(model_run)
        params = load_run_params(model_run, cfg)
        factory, _ = model_policy_factory(cfg, params, tokenizer, max_len=args.window + 1,
                                          temperature=args.temperature, seed=args.seed, max_batch=2)
        base = dataclasses.replace(base, max_new_tokens=256)
        policy_name = f"model {model_run} (temperature {args.temperature})"
    results, per_episode = {}, {}
    t0 = time.time()
    for name, method, trig, window in methods(args.triggers, args.window):
        rows = run_method(tasks, factory, tokenizer, sandbox, base, method, trig, window, args.max_summaries,
                          args.max_summary_tokens)
        per_episode[name] = rows
        results[name] = aggregate(rows)
        print(f"{name:>16}: success {results[name]['success']:.2f}  compactions/ep "
              f"{results[name]['compactions_per_episode']:.1f}  prefill/ep {results[name]['prefill_tokens_per_episode']:.0f}"
              f"  ({time.time() - t0:.0f} s)", flush=True)
    tool_chars = statistics.mean(t.metadata["tool_output_chars"] for t in tasks)
    header = (f"Policy: {policy_name}. {len(tasks)} held-out long_horizon tasks ({args.n_files} modules x "
              f"~{args.file_chars} chars; mean tool output {tool_chars:.0f} chars), window {args.window}, "
              f"triggers {args.triggers}, at most {args.max_summaries} summaries of {args.max_summary_tokens} "
              f"tokens. Compaction error = success(full) - success(method).")
    md = header + "\n\n" + table(results) + "\n"
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(md)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"args": vars(args), "policy": policy_name, "aggregate": results, "episodes": per_episode}, f,
                  indent=1, default=str)
    plot(results, os.path.join(args.out, "self_summary.png"),
         f"{policy_name}; {len(tasks)} held-out long_horizon tasks; window {args.window}; triggers {args.triggers}")
    print("\n" + md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
