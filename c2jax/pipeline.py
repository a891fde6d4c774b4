"""End-to-end stages wired together: CPT -> SFT (oracle transcripts in the harness's own token
format) -> RL -> evaluation on held-out tasks, plus helpers the CLI's `eval` command uses."""
from __future__ import annotations

import logging
import os
import time


from c2jax.agent import chat_format as cf
from c2jax.agent.policy import OraclePolicy, SamplerPolicy, TextPolicy
from c2jax.agent.runner import EpisodeConfig, run_episodes
from c2jax.agent.sandbox import Sandbox
from c2jax.config import load_config
from c2jax.data.pipeline import token_record
from c2jax.data.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class ReadThenFixPolicy(TextPolicy):
    """Oracle that first reads every file its fix touches, then applies the reference fix, then
    answers: transcripts a small model can imitate (the fix's text is visible in the context)."""

    def __init__(self, task):
        self.oracle = OraclePolicy(task)
        paths = []
        for item in task.reference_solution:
            for call in (item if isinstance(item, (list, tuple)) else [item]):
                p = call.get("arguments", {}).get("path")
                if p and p not in paths and p in task.files:
                    paths.append(p)
        self.reads = [{"name": "read_file", "arguments": {"path": p}} for p in paths]
        self.did_read = not self.reads

    def next_message(self, context, codec) -> str:
        if not self.did_read:
            self.did_read = True
            return cf.render_assistant(calls=self.reads)
        return self.oracle.next_message(context, codec)


# The tiny pipeline's system prompt (configs/rl_tiny.py uses the same one): the harness default
# is ~140 tokens of the tiny tokenizer, more than the model's whole answer.
SYSTEM_PROMPT = "Fix the bug with the tools: read the file the task names, then edit it."
# Sampling temperature of the demo's RL rollouts and held-out evals (configs/rl_tiny.py too).
TEMPERATURE = 0.7


def episode_config(max_turns: int = 6, max_new_tokens: int = 256, max_total_tokens: int = 2048) -> EpisodeConfig:
    """The harness settings used by the tiny pipeline (short system prompt, few turns)."""
    return EpisodeConfig(max_turns=max_turns, max_new_tokens=max_new_tokens, max_total_tokens=max_total_tokens,
                         list_tools_in_system=False, max_tool_output_chars=2000, system_prompt=SYSTEM_PROMPT)


def oracle_episodes(tokenizer, suites=("synthetic:1",), split: str = "train", n_per_suite: int = 256,
                    seed: int = 0) -> list:
    """The read-then-fix oracle's episodes (c2jax.agent.runner results) on a split's tasks."""
    from c2jax.tasks import load_suite
    tasks = [t for s in suites for t in load_suite(s, split, n=n_per_suite, seed=seed)]
    return run_episodes(tasks, ReadThenFixPolicy, tokenizer, Sandbox(), episode_config(), concurrency=4)


def write_oracle_transcripts(tokenizer, out_path: str, suites=("synthetic:1",), n_per_suite: int = 256,
                             seed: int = 0, max_tokens: int = 768) -> dict:
    """Run the read-then-fix oracle over train-split tasks in the sandbox; write the passing
    episodes' exact tokens and model-token masks as JSONL for SFT."""
    results = oracle_episodes(tokenizer, suites, "train", n_per_suite, seed)
    kept = too_long = failed = 0
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with open(out_path, "w") as f:
        for r in results:
            traj = r.trajectory
            if not (r.grade and r.grade.passed):
                failed += 1
                continue
            if len(traj.tokens_T) > max_tokens:
                too_long += 1
                continue
            f.write(token_record(traj.tokens_T, traj.loss_mask_T, task_id=traj.task_id))
            kept += 1
    return {"tasks": len(results), "kept": kept, "failed": failed, "too_long": too_long}


def model_policy_factory(cfg, params, tokenizer, *, max_len: int = 2048, temperature: float = 1.0,
                         seed: int = 0, max_batch: int = 4):
    """A policy factory over one shared jitted sampler (token-in/token-out harness adapter)."""
    from c2jax.sampling import HarnessSampler, Sampler
    sampler = Sampler(cfg, params, max_batch=max_batch, max_len=max_len)
    stops = [tokenizer.token_id(cf.st.END_TURN), tokenizer.eos_id]
    harness = HarnessSampler(sampler, temperature=temperature, stop_token_ids=stops, seed=seed)
    return (lambda task: SamplerPolicy(harness)), harness


def evaluate_run(run_dir: str, out_dir: str, *, suites=("synthetic:1",), n_tasks: int = 16, passes: int = 4,
                 temperature: float = 1.0, seed: int = 0, params=None, cfg=None) -> dict:
    """pass@1 (mean over passes) and best-of-K of a trained run's model on held-out tasks."""
    from c2jax.evals.benchmark import run_benchmark
    from c2jax.tasks import load_suite
    from c2jax.train.loop import load_run_config, load_run_params
    if cfg is None:
        cfg = load_run_config(run_dir)
    tokenizer = Tokenizer.load(run_dir)
    if params is None:
        params = load_run_params(run_dir, cfg)
    factory, _ = model_policy_factory(cfg, params, tokenizer, temperature=temperature, seed=seed)
    tasks = {s: load_suite(s, "heldout", n=n_tasks, seed=seed) for s in suites}
    return run_benchmark(tasks, factory, passes, tokenizer=tokenizer, sandbox=Sandbox(), config=episode_config(),
                         out_dir=out_dir, active_params=None, concurrency=1, policy_name=os.path.basename(run_dir))


def _suite_row(report: dict, suite: str) -> dict:
    s = report["suites"][suite]
    return {k: s.get(k) for k in ("accuracy", "pass_at_k", "completion_tokens_per_task", "malformed_call_rate")}


# The demo's stage sizes: (full, --quick).
# Distinct transcripts and steps both matter: 1024 transcripts x 300 steps gave held-out pass@1
# 0.03 (32 tasks x 4, temperature 0.7); 4096 x 350 steps 0.16 (32 x 1), x 600 steps 0.35 (32 x 4).
# With less, the model miscopied the line to replace; now its errors are in the replacement line.
DEMO_TRANSCRIPTS = (4096, 512)    # oracle episodes on synthetic:1 train tasks (~100 s for 4096)
DEMO_SFT_STEPS = (600, 120)       # 8 rows x 768 tokens (two ~300-token transcripts per row)
DEMO_EVAL = ((32, 4), (8, 2))     # held-out tasks, attempts per task


def build_sft_model(workdir: str, overrides=(), quick: bool = False) -> dict:
    """CPT (configs/stages/cpt.py:tiny) -> SFT on read-then-fix oracle transcripts, into
    workdir/cpt and workdir/sft. Returns {"cpt", "sft": run summaries, "transcripts", "sft_dir"}."""
    from c2jax.train.loop import run_training
    q = int(bool(quick))
    os.makedirs(workdir, exist_ok=True)
    cpt_dir, sft_dir = os.path.join(workdir, "cpt"), os.path.join(workdir, "sft")
    overrides = list(overrides)
    print("== 1/4 continued pretraining (stdlib code corpus) ==", flush=True)
    cpt = run_training(load_config("configs/stages/cpt.py:tiny", overrides), cpt_dir)
    tokenizer = Tokenizer.load(cpt_dir)
    print("== 2/4 SFT on oracle transcripts (synthetic train tasks, harness token format) ==", flush=True)
    sft_path = os.path.join(workdir, "sft_transcripts.jsonl")
    tstats = write_oracle_transcripts(tokenizer, sft_path, n_per_suite=DEMO_TRANSCRIPTS[q])
    print(f"transcripts: {tstats}", flush=True)
    sft_cfg = load_config("configs/stages/sft.py:tiny", [
        f"--config.train.init_from={cpt_dir}", f"--config.data.sft_path={sft_path}",
        "--config.train.seq_len=768", "--config.train.batch_size=8",
        f"--config.train.steps={DEMO_SFT_STEPS[q]}", "--config.train.lr=2e-3",
        "--config.train.eval_every=0", *overrides])
    sft = run_training(sft_cfg, sft_dir)
    return {"cpt": cpt, "sft": sft, "transcripts": tstats, "sft_dir": sft_dir}


def run_demo(workdir: str, overrides=(), quick: bool = False) -> int:
    """The quick start: CPT -> SFT -> RL -> held-out eval of the tiny model, printing a table."""
    t0 = time.time()
    built = build_sft_model(workdir, overrides, quick)
    cpt, sft, sft_dir = built["cpt"], built["sft"], built["sft_dir"]
    n_tasks, passes = DEMO_EVAL[int(bool(quick))]

    print("== 3/4 RL (async, Dr. GRPO, router replay) ==", flush=True)
    rl_dir = None
    try:
        from c2jax.rl.loop import run_rl
        rl_cfg = load_config("configs/rl_tiny.py", [f"--config.train.init_from={sft_dir}", *overrides])
        rl_dir = os.path.join(workdir, "rl")
        run_rl(rl_cfg, rl_dir)
    except ImportError as e:
        print(f"RL stage not available in this build ({e}); evaluating the SFT model only", flush=True)

    print(f"== 4/4 held-out evaluation (pass@1 and best-of-K; {n_tasks} tasks x {passes}, "
          f"temperature {TEMPERATURE}) ==", flush=True)
    rows = [("CPT -> SFT", evaluate_run(sft_dir, os.path.join(workdir, "eval_sft"), n_tasks=n_tasks,
                                        passes=passes, temperature=TEMPERATURE))]
    if rl_dir:
        rows.append(("CPT -> SFT -> RL", evaluate_run(rl_dir, os.path.join(workdir, "eval_rl"), n_tasks=n_tasks,
                                                     passes=passes, temperature=TEMPERATURE)))
    print("\n" + stage_table(cpt, sft) + "\n\n" + eval_table(rows), flush=True)
    print(f"\ndemo finished in {time.time() - t0:.0f} s; runs in {workdir}", flush=True)
    return 0


def stage_table(cpt: dict, sft: dict) -> str:
    """Markdown: CPT held-out loss and codebase perplexity before/after, SFT's after."""
    nan = float("nan")
    return "\n".join([
        "| stage | held-out loss (first -> last) | codebase ppl |", "|---|---|---|",
        f"| CPT | {cpt['initial_eval'].get('heldout_loss', nan):.3f} -> {cpt['final_eval'].get('heldout_loss', nan):.3f} | "
        f"{cpt['initial_eval']['codebase_ppl']:.1f} -> {cpt['final_eval']['codebase_ppl']:.1f} |",
        f"| SFT | -> {sft['final_eval'].get('heldout_loss', nan):.3f} | {sft['final_eval']['codebase_ppl']:.1f} |"])


def eval_table(rows) -> str:
    """Markdown: per (model name, benchmark report) and suite, pass@1, best-of-K (K = the
    number of attempts per task), mean completion tokens per attempt and malformed-call rate."""
    out = ["| model | suite | pass@1 | best-of-K | completion tokens | malformed calls |", "|---|---|---|---|---|---|"]
    for name, report in rows:
        for suite in report["suites"]:
            r = _suite_row(report, suite)
            pk = r["pass_at_k"] or {}
            kmax = max(pk, key=int) if pk else None
            best = f"{pk[kmax]:.3f} (K={kmax})" if kmax else "n/a"
            out.append(f"| {name} | {suite} | {r['accuracy']:.3f} | {best} | "
                       f"{r['completion_tokens_per_task']:.0f} | {r['malformed_call_rate']:.3f} |")
    return "\n".join(out)
