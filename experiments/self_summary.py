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
               c2jax.pipeline.model_policy_factory (one sampler, max_len = full window + 1; the
               window of each method is the runner's max_context_tokens). Tokens are that
               tokenizer's.
  --train      trains the tiny model with self-summarization, then evaluates it (outputs under
               OUT/trained, checkpoints under --workdir, default runs/self_summary):
                 1. CPT of configs/tiny.py on the stdlib corpus (or --init-from a CPT run dir)
                 2. SFT (train.stage="sft") on the scripted agent's self-summarizing chains on
                    train-split long_horizon_small tasks, half at each trigger, one JSONL record
                    per segment (c2jax.agent.summarize.write_chain_transcripts); --sft-full N of
                    them in full context instead (the reference's behaviour, window --full-window)
                 3. RL (c2jax.rl.loop.run_rl) with rl.summary_method="self" at the small trigger
                 4. the eight-method comparison on held-out tasks with the RL model
               --copy-steps N: before SFT, N steps on random-token repeats (an induction
               circuit; c2jax.data.copy_curriculum). --recall-steps N: then N steps on verbatim
               recall records (copying by name). --copy-mix R I: mix R verbatim recall and
               I induction records into the SFT data so the copying skill is kept. See
               results/self_summary/README.md for what each did.
               Sizes (BPE tokens of the CPT tokenizer): 5 modules x 200 chars (full episode
               ~1.9k tokens), window 1536, triggers 896 / 448 (a restart prefix plus the
               re-listing is ~400 tokens, so 448 still leaves room for one read per segment), full
               reference 2047 (the model's positions). --quick: a few-minute version (fewer steps and tasks).

Metrics add "value recall": the fraction of LEGACY values right in the final registry.py, from the
hidden test's per-constant report (the verifier's partial credit, uncapped; 1.0 when an episode passes).

Run: JAX_PLATFORMS=cpu python experiments/self_summary.py [--n-tasks 20] [--triggers 4096 2048]
     [--window 8192] [--model-run runs/demo/sft | --train [--quick]] [--out DIR]
Writes OUT/table.md, OUT/results.json (per episode rows too) and OUT/self_summary.png.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from c2jax.agent import summarize as sm  # noqa: E402
from c2jax.agent.runner import EpisodeConfig, run_episode  # noqa: E402
from c2jax.agent.long_horizon_policy import make_long_horizon_policy  # noqa: E402
from c2jax.tasks import long_horizon as lh  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "self_summary")


def methods(triggers, window, full_window=None):
    rows = [("full", "none", None, full_window), (f"full@{window}", "none", None, window)]
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
        recall = value_recall(res.grade)
        s = res.stats
        rows.append({"task_id": task.task_id, "passed": bool(res.grade and res.grade.passed), "recall": recall,
                     "finish_reason": s["finish_reason"], "turns": s["turns"], "segments": len(res.segments),
                     "summaries": s.get("summaries", 0), "truncations": s.get("truncations", 0),
                     "summary_tokens": s.get("summary_tokens", 0),
                     "summary_prefill_tokens": s.get("summary_prefill_tokens", 0),
                     "prefill_tokens": meter.prefill_tokens, "completion_tokens": s["completion_tokens"],
                     "max_segment_tokens": max(len(x.tokens_T) for x in res.segments),
                     "wall_s": time.monotonic() - t0, "error": s.get("error", "")[:300]})
    return rows


def value_recall(grade) -> float:
    """Fraction of the task's LEGACY constants the hidden test found right in registry.py (its
    per-constant report; 1.0 when the episode passes, 0.0 without a grade)."""
    if grade is None:
        return 0.0
    if grade.passed:
        return 1.0
    tests = grade.details.get("tests") or {}
    return sum(v == "pass" for v in tests.values()) / len(tests) if tests else 0.0


def aggregate(rows: list[dict]) -> dict:
    n = len(rows)
    summ = sum(r["summaries"] for r in rows)
    return {"n": n, "success": sum(r["passed"] for r in rows) / n,
            "recall": sum(r.get("recall", 0.0) for r in rows) / n,
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
    lines = ["| method | success | compaction error | value recall | compactions / ep | summary tokens / summary | "
             "summary tokens / ep | prefill tokens / ep | prefill per summary call | turns | max segment | "
             "finish reasons |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, a in results.items():
        lines.append(f"| {name} | {a['success']:.2f} | {ref - a['success']:+.2f} | {a.get('recall', 0.0):.2f} | "
                     f"{a['compactions_per_episode']:.1f} | "
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


SYSTEM_PROMPT = "You are a coding agent. Use the tools; answer briefly when done."


def train_pipeline(args) -> dict:
    """CPT (or --init-from) -> copy curriculum (--copy-steps, --recall-steps) -> SFT on scripted
    self-summarizing transcripts (--copy-mix adds copy records) -> RL with rl.summary_method="self";
    --sft-from skips to RL.
    Returns {"sft": dir, "rl": dir or None, "stats": {...}}."""
    out = args.workdir
    os.makedirs(out, exist_ok=True)
    stats, t0 = {}, time.time()
    sft_dir = args.sft_from or _cpt_and_sft(args, out, stats, t0)
    stats["sft_dir"] = sft_dir
    rl_dir = _rl(args, out, sft_dir, stats, t0)
    stats["train_s"] = time.time() - t0
    return {"sft": sft_dir, "rl": rl_dir, "stats": stats}


def _write_transcripts(args, tokenizer, path, stats) -> None:
    """The scripted agent's chains: --sft-full of the train tasks in full context (window
    --full-window, no trigger: the reference the compaction error is measured against), the rest
    self-summarizing, half at each trigger."""
    from c2jax.agent.sandbox import Sandbox
    tasks = lh.load("train", args.sft_tasks or (24 if args.quick else 96), args.seed, n_files=args.n_files,
                    file_chars=args.file_chars)
    base = EpisodeConfig(max_turns=args.max_turns, max_new_tokens=args.max_summary_tokens, max_total_tokens=20_000,
                         list_tools_in_system=False, system_prompt=SYSTEM_PROMPT, max_context_tokens=args.window)
    stats["transcripts"] = {}

    def self_cfg(trig):
        return sm.summary_episode_config(base, sm.SummaryConfig("self", trigger_tokens=trig, max_summaries=args.max_summaries,
                                                                max_summary_tokens=args.max_summary_tokens))
    n_full = min(args.sft_full, len(tasks))
    rest = tasks[n_full:]
    half = len(rest) // 2
    parts = [(args.triggers[0], self_cfg(args.triggers[0]), rest[:half]),
             (args.triggers[1], self_cfg(args.triggers[1]), rest[half:])]
    if n_full:
        full = dataclasses.replace(base, max_context_tokens=args.full_window)
        parts.append(("full", sm.summary_episode_config(full, sm.SummaryConfig("none")), tasks[:n_full]))
    with open(path, "w"):
        pass
    for trig, cfg, part in parts:
        tmp = path + f".{trig}"
        stats["transcripts"][trig] = sm.write_chain_transcripts(part, make_long_horizon_policy, tokenizer, tmp, cfg,
                                                                Sandbox())
        with open(path, "a") as f, open(tmp) as g:
            f.write(g.read())
        os.remove(tmp)


def _sft_seq_len(args) -> int:
    """Rows long enough for every transcript: the window, or the full-context reference's."""
    if args.sft_full:
        return max(args.window, args.full_window + 1)
    return args.window


def _cpt_and_sft(args, out, stats, t0) -> str:
    import c2jax.sections  # noqa: F401  (the data / eval / rl config sections)
    from c2jax.config import load_config
    from c2jax.data import copy_curriculum as cc
    from c2jax.data.tokenizer import Tokenizer
    from c2jax.train.loop import run_training
    q = args.quick
    start_dir = args.init_from  # a CPT run, or any run to continue from (e.g. a copy-curriculum run)
    if not start_dir:
        start_dir = os.path.join(out, "cpt")
        run_training(load_config("configs/stages/cpt.py:tiny", [f"--config.train.steps={40 if q else 150}",
                                                                "--config.train.eval_every=0"]), start_dir)
    stats["cpt_s"] = time.time() - t0
    tokenizer = Tokenizer.load(start_dir)
    path = transcripts = args.sft_data or os.path.join(out, "sft_transcripts.jsonl")
    if not args.sft_data:
        _write_transcripts(args, tokenizer, path, stats)
    stats["transcripts_s"] = time.time() - t0
    n_recall, n_induction = args.copy_mix
    if args.copy_steps or n_induction:
        # the warm-up's ~40 records fill a 16 x 256 step: one pass over 40,000 is ~1,000 steps
        induction = os.path.join(out, "copy_induction.jsonl")
        n = max(40_000, n_induction) if args.copy_steps else n_induction
        cc.write_records(induction, cc.induction_records(n, args.seed, *cc.copyable_token_range(tokenizer)))
    if args.copy_steps:
        # The copy curriculum's warm-up (c2jax.data.copy_curriculum): random-token repeats until an
        # induction circuit forms.
        warm_dir = os.path.join(out, "copy")
        run_training(load_config("configs/stages/sft.py:tiny", [
            f"--config.train.init_from={start_dir}", f"--config.data.sft_path={induction}",
            "--config.train.seq_len=256", "--config.train.batch_size=16", f"--config.train.steps={args.copy_steps}",
            f"--config.train.lr={args.copy_lr}", "--config.train.eval_every=0",
            "--config.train.checkpoint_every=1000"]), warm_dir)
        stats["copy_s"] = time.time() - t0
        start_dir = warm_dir
    if args.recall_steps:
        # Verbatim recall records (module sources, then their `LEGACY_X = v` lines again): where
        # copying by name formed (results README, "2026-12-01: why the model cannot copy"); ~12 records fill a 4 x 1024 step.
        recall = os.path.join(out, "copy_recall.jsonl")
        cc.write_records(recall, cc.recall_records(12 * args.recall_steps, args.seed + 2, tokenizer, verbatim=True))
        recall_dir = os.path.join(out, "recall")
        run_training(load_config("configs/stages/sft.py:tiny", [
            f"--config.train.init_from={start_dir}", f"--config.data.sft_path={recall}",
            "--config.train.seq_len=1024", "--config.train.batch_size=4", f"--config.train.steps={args.recall_steps}",
            "--config.train.lr=1e-3", "--config.train.eval_every=0", "--config.train.checkpoint_every=1000"]),
            recall_dir)
        stats["recall_s"] = time.time() - t0
        start_dir = recall_dir
    if n_recall or n_induction:
        # Copy records mixed into the chains so SFT keeps the copying skill: verbatim recall records
        # (the chains' `LEGACY_X = v` lines) and random-token repeats.
        mixed = os.path.join(out, "sft_mix.jsonl")
        cc.write_records(mixed, cc.recall_records(n_recall, args.seed + 1, tokenizer, verbatim=True))
        with open(mixed, "a") as f, open(path) as h:
            if n_induction:
                with open(induction) as g:
                    f.writelines(itertools.islice(g, n_induction))
            f.write(h.read())
        stats["sft_mix"] = {"recall": n_recall, "induction": n_induction, "transcripts": path}
        path = mixed
    sft_dir = os.path.join(out, "sft")
    run_training(load_config("configs/stages/sft.py:tiny", [
        f"--config.train.init_from={start_dir}", f"--config.data.sft_path={path}",
        f"--config.train.seq_len={_sft_seq_len(args)}", "--config.train.batch_size=4",
        f"--config.train.steps={args.sft_steps or (40 if q else 160)}",
        f"--config.train.lr={args.sft_lr or (1e-3 if path != transcripts else 2e-3)}",
        "--config.train.eval_every=0", "--config.train.checkpoint_every=1000"]), sft_dir)
    stats["sft_s"] = time.time() - t0
    return sft_dir


def _rl(args, out, sft_dir, stats, t0):
    import c2jax.sections  # noqa: F401  (the data / eval / rl config sections)
    from c2jax.config import load_config
    q = args.quick
    rl_dir = None
    rl_steps = args.rl_steps if args.rl_steps is not None else (2 if q else 6)
    if rl_steps > 0:
        from c2jax.rl.loop import run_rl
        rl_dir = os.path.join(out, "rl")
        cfg = load_config("configs/rl_tiny.py", [
            f"--config.train.init_from={sft_dir}", "--config.rl.suites=('long_horizon_small',)",
            "--config.rl.suite_weights=()",
            f"--config.rl.steps={rl_steps}", "--config.rl.group_size=4", f"--config.rl.prompts_per_step={1 if q else 2}",
            f"--config.rl.system_prompt={SYSTEM_PROMPT}", "--config.rl.summary_method=self",
            f"--config.rl.summary_trigger_tokens={args.triggers[1]}", f"--config.rl.context_window={args.window}",
            f"--config.rl.max_total_tokens={4 * args.window}", f"--config.rl.max_turns={args.max_turns}",
            f"--config.rl.max_new_tokens={args.max_new_tokens}", f"--config.rl.max_summaries={args.max_summaries}",
            f"--config.rl.max_summary_tokens={args.max_summary_tokens}", "--config.rl.env_workers=4",
            "--config.rl.sampler_slots=4", f"--config.rl.constant_normalizer_len={args.window}",
            "--config.rl.eval_every=-1", "--config.rl.staleness=0", "--config.rl.length_bucket=256",
            "--config.rl.micro_batch_rows=8",  # ~8 segments a chain: a whole step at once ran out of memory
            *args.rl_override])
        stats["rl_summary"] = run_rl(cfg, rl_dir)
        from c2jax.train.metrics import read_metrics
        stats["rl_metrics"] = [{k: v for k, v in m.items() if not isinstance(v, list)}
                               for m in read_metrics(rl_dir) if "reward" in m]
    return rl_dir


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
    ap.add_argument("--train", action="store_true", help="train the tiny model (CPT/SFT/RL) and evaluate it")
    ap.add_argument("--quick", action="store_true", help="with --train: a few-minute version")
    ap.add_argument("--init-from", default=None, help="with --train: a CPT run dir to start from (skips CPT)")
    ap.add_argument("--sft-from", default=None, help="with --train: an SFT run dir (skips CPT and SFT)")
    ap.add_argument("--sft-tasks", type=int, default=0)
    ap.add_argument("--sft-full", type=int, default=0,
                    help="with --train: this many of the --sft-tasks transcribed in full context (needs --full-window)")
    ap.add_argument("--sft-data", default=None, help="with --train: reuse this transcripts JSONL (skip writing it)")
    ap.add_argument("--copy-steps", type=int, default=0,
                    help="with --train: steps of the copy curriculum before SFT (0: none; c2jax.data.copy_curriculum)")
    ap.add_argument("--copy-lr", type=float, default=2e-3)
    ap.add_argument("--recall-steps", type=int, default=0,
                    help="with --train: steps on verbatim recall records after the warm-up, before SFT")
    ap.add_argument("--copy-mix", type=int, nargs=2, default=[0, 0], metavar=("RECALL", "INDUCTION"),
                    help="with --train: verbatim recall and induction records mixed into the SFT data")
    ap.add_argument("--sft-lr", type=float, default=0.0, help="with --train: SFT lr (0: 1e-3 with a mix, else 2e-3)")
    ap.add_argument("--sft-steps", type=int, default=0)
    ap.add_argument("--rl-steps", type=int, default=None)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--full-window", type=int, default=None, help="context of the 'full' reference (None: unbounded)")
    ap.add_argument("--workdir", default="runs/self_summary", help="with --train: checkpoints and SFT data")
    ap.add_argument("--rl-override", nargs="*", default=[])
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args(argv)
    if args.train:  # the tiny model's sizes (BPE tokens): full episodes ~1.9k tokens, window 1536
        for k, v in {"n_files": (10, 5), "file_chars": (900, 200), "triggers": ([4096, 2048], [896, 448]),
                     "window": (8192, 1536), "max_summaries": (16, 8), "max_summary_tokens": (2048, 256),
                     "max_turns": (60, 16), "full_window": (None, 2047),
                     "n_tasks": (20, 6 if args.quick else 16)}.items():
            if getattr(args, k) == v[0]:
                setattr(args, k, v[1])
        if args.out == OUT:
            args.out = os.path.join(OUT, "trained")
    if args.sft_full and not args.full_window:
        ap.error("--sft-full needs --full-window (the full-context reference's window)")
    if args.triggers[0] != 2 * args.triggers[1]:
        print(f"note: triggers {args.triggers} are not in a 2:1 ratio")
    os.makedirs(args.out, exist_ok=True)
    from c2jax.agent.sandbox import Sandbox
    sandbox = Sandbox()
    tasks = lh.load("heldout", args.n_tasks, args.seed, n_files=args.n_files, file_chars=args.file_chars)
    base = EpisodeConfig(max_turns=args.max_turns, max_new_tokens=args.max_summary_tokens, max_total_tokens=400_000,
                         list_tools_in_system=False, max_tool_output_chars=4000)
    tokenizer, policy_name = None, "scripted LongHorizonPolicy (byte tokens)"
    factory = make_long_horizon_policy
    trained = train_pipeline(args) if args.train else None
    model_run = (trained["rl"] or trained["sft"]) if trained else args.model_run
    if trained:
        base = dataclasses.replace(base, system_prompt=SYSTEM_PROMPT)
    if model_run:
        from c2jax.data.tokenizer import Tokenizer
        from c2jax.pipeline import model_policy_factory
        import c2jax.sections  # noqa: F401  (the data / eval / rl config sections)
        from c2jax.train.loop import load_run_config, load_run_params
        cfg = load_run_config(model_run)
        tokenizer = Tokenizer.load(model_run)
        params = load_run_params(model_run, cfg)
        factory, _ = model_policy_factory(cfg, params, tokenizer, max_len=(args.full_window or args.window) + 1,
                                          temperature=args.temperature, seed=args.seed, max_batch=2)
        base = dataclasses.replace(base, max_new_tokens=args.max_new_tokens)
        policy_name = f"model {model_run} (temperature {args.temperature})"
    results, per_episode = {}, {}
    t0 = time.time()
    for name, method, trig, window in methods(args.triggers, args.window, args.full_window):
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
        json.dump({"args": vars(args), "policy": policy_name, "aggregate": results, "episodes": per_episode,
                   "training": trained and trained["stats"]}, f,
                  indent=1, default=str)
    plot(results, os.path.join(args.out, "self_summary.png"),
         f"{policy_name}; {len(tasks)} held-out long_horizon tasks; window {args.window}; triggers {args.triggers}")
    print("\n" + md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
