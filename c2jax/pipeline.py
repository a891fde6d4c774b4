"""End-to-end stages wired together: CPT -> SFT (oracle transcripts in the harness's own token
format) -> RL -> evaluation on held-out tasks, plus helpers the CLI's `eval` command uses."""
from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time

from c2jax.agent import chat_format as cf
from c2jax.agent.policy import OraclePolicy, SamplerPolicy, TextPolicy
from c2jax.agent.runner import EpisodeConfig, run_episodes
from c2jax.agent.sandbox import Sandbox
import c2jax.sections  # noqa: F401  (the data / eval / rl config sections)
from c2jax.config import load_config
from c2jax.data.pipeline import token_record
from c2jax.data.tokenizer import Tokenizer
from c2jax.progress import Heartbeat

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


def miscopied(old: str, text: str, seed: int) -> str | None:
    """`old` with one visible character replaced, deleted or doubled, such that it no longer occurs
    in `text` (a realistic miscopy of the line to replace); None if no such change exists."""
    import random
    rng = random.Random(seed)
    spots = [i for i, ch in enumerate(old) if not ch.isspace()]
    rng.shuffle(spots)
    for i in spots[:16]:
        kind = rng.choice(("replace", "delete", "double"))
        if kind == "replace":
            cand = old[:i] + rng.choice("abcdefghijklmnopqrstuvwxyz+-*<>=01") + old[i + 1:]
        elif kind == "delete":
            cand = old[:i] + old[i + 1:]
        else:
            cand = old[:i] + old[i] + old[i:]
        if cand.strip() and cand not in text:
            return cand
    return None


class ReadMissRetryPolicy(ReadThenFixPolicy):
    """ReadThenFixPolicy whose first edit miscopies its `old` text; after the harness's error (which
    quotes the file's closest text) it sends the reference edit. The transcript writer drops the
    miss turn from the loss, so the model learns the recovery, never the miscopy."""

    def __init__(self, task, seed: int = 0):
        super().__init__(task)
        self.miss_text = ""
        steps = self.oracle.steps
        first = steps[0] if steps else []
        if len(first) == 1 and first[0].get("name") == "edit_file":
            args = first[0]["arguments"]
            bad = miscopied(args["old"], task.files.get(args["path"], ""), seed)
            if bad is not None:
                self.miss_text = cf.render_assistant(calls=[{"name": "edit_file",
                                                             "arguments": {**args, "old": bad}}])
        self.missed = not self.miss_text

    def next_message(self, context, codec) -> str:
        if self.did_read and not self.missed:
            self.missed = True
            return self.miss_text
        return super().next_message(context, codec)


def _mask_span(tokens_T, mask_T, span) -> bool:
    """Zero mask_T over the one occurrence of `span` in tokens_T; False unless exactly one."""
    import numpy as np
    n, m = len(tokens_T), len(span)
    hits = [i for i in range(n - m + 1) if tokens_T[i] == span[0] and list(tokens_T[i:i + m]) == span]
    if len(hits) != 1:
        return False
    mask_T = np.asarray(mask_T)
    mask_T[hits[0]:hits[0] + m] = False
    return True


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
                    seed: int = 0, recovery_fraction: float = 0.0) -> tuple[list, list]:
    """The oracle's episodes (c2jax.agent.runner results) on a split's tasks and the policy of each:
    ReadThenFixPolicy, or for about `recovery_fraction` of the tasks (chosen by task id)
    ReadMissRetryPolicy."""
    from c2jax.tasks import load_suite
    from c2jax.tasks.base import stable_hash
    tasks = [t for s in suites for t in load_suite(s, split, n=n_per_suite, seed=seed)]
    policies: dict = {}

    def policy(task):
        h = stable_hash("recovery", task.task_id, seed)
        p = (ReadMissRetryPolicy(task, seed=h) if (h % 10_000) < recovery_fraction * 10_000
             else ReadThenFixPolicy(task))
        policies[task.task_id] = p
        return p

    with Heartbeat("oracle transcripts", len(tasks)) as beat:
        results = run_episodes(tasks, policy, tokenizer, Sandbox(), episode_config(), concurrency=4,
                               on_result=lambda i, r: beat.add())
    return results, [policies[t.task_id] for t in tasks]


def write_oracle_transcripts(tokenizer, out_path: str, suites=("synthetic:1",), n_per_suite: int = 256,
                             seed: int = 0, max_tokens: int = 768, recovery_fraction: float = 0.0) -> dict:
    """Run the oracle over train-split tasks in the sandbox; write the passing episodes' exact
    tokens and model-token masks as JSONL for SFT. With recovery_fraction > 0 that share of the
    episodes first miscopies its edit and recovers from the harness's error; the miss turn is
    masked out of the loss (a miss that cannot be located drops the episode: `unmasked`)."""
    import numpy as np
    results, policies = oracle_episodes(tokenizer, suites, "train", n_per_suite, seed, recovery_fraction)
    codec = cf.as_codec(tokenizer)
    kept = too_long = failed = recovery = unmasked = 0
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with open(out_path, "w") as f:
        for r, pol in zip(results, policies):
            traj = r.trajectory
            if not (r.grade and r.grade.passed):
                failed += 1
                continue
            if len(traj.tokens_T) > max_tokens:
                too_long += 1
                continue
            mask_T = np.array(traj.loss_mask_T, bool)
            if getattr(pol, "miss_text", ""):
                if not _mask_span(list(map(int, traj.tokens_T)), mask_T, codec.encode(pol.miss_text)):
                    unmasked += 1
                    continue
                recovery += 1
            f.write(token_record(traj.tokens_T, mask_T, task_id=traj.task_id))
            kept += 1
    return {"tasks": len(results), "kept": kept, "failed": failed, "too_long": too_long,
            "recovery": recovery, "unmasked": unmasked}


def model_policy_factory(cfg, params, tokenizer, *, max_len: int = 2048, temperature: float = 1.0,
                         seed: int = 0, max_batch: int = 4, speculative: str = "auto"):
    """A policy factory over one shared jitted sampler (token-in/token-out harness adapter);
    speculative: see Sampler."""
    from c2jax.sampling import HarnessSampler, Sampler
    sampler = Sampler(cfg, params, max_batch=max_batch, max_len=max_len, speculative=speculative)
    stops = [tokenizer.token_id(cf.st.END_TURN), tokenizer.eos_id]
    harness = HarnessSampler(sampler, temperature=temperature, stop_token_ids=stops, seed=seed)
    return (lambda task: SamplerPolicy(harness)), harness


def batched_policy_factory(cfg, params, *, max_len: int = 2048, temperature: float = 1.0, seed: int = 0,
                           slots: int = 16, speculative: str = "auto"):
    """A policy factory whose episodes share one continuous-batching sampler (the RL loop's
    SamplerService): run `slots` episodes on threads and their turns decode together. An episode's
    requests are keyed by its task id and its pass of that task, so a rerun samples the same tokens.
    speculative: see Sampler. Returns (factory, service); call service.stop() when done."""
    from c2jax.rl.rollout import EpisodeSampler, SamplerService
    service = SamplerService(cfg, params, 0, max_batch=slots, max_len=max_len, speculative=speculative)
    lock, passes_seen = threading.Lock(), {}

    def factory(task):
        with lock:
            n = passes_seen[task.task_id] = passes_seen.get(task.task_id, -1) + 1
        return SamplerPolicy(EpisodeSampler(service, f"eval/{task.task_id}/{n}", seed, temperature))
    return factory, service


def evaluate_run(run_dir: str, out_dir: str, *, suites=("synthetic:1",), n_tasks: int = 16, passes: int = 4,
                 temperature: float = 1.0, seed: int = 0, params=None, cfg=None, slots: int = 16,
                 config: EpisodeConfig | None = None) -> dict:
    """pass@1 (mean over passes) and best-of-K of a trained run's model on held-out tasks, `slots`
    episodes at a time through one batched sampler (as the RL loop's held-out eval); `config`: the
    harness settings (default episode_config()), whose context budget sizes the sampler."""
    from c2jax.evals.benchmark import run_benchmark
    from c2jax.tasks import load_suite
    from c2jax.train.loop import load_run_config, load_run_params
    if cfg is None:
        cfg = load_run_config(run_dir)
    tokenizer = Tokenizer.load(run_dir)
    if params is None:
        params = load_run_params(run_dir, cfg)
    config = config or episode_config()
    max_len = config.context_tokens + 1   # the sampler holds one generation's whole context
    factory, service = batched_policy_factory(cfg, params, max_len=max_len, temperature=temperature, seed=seed,
                                              slots=slots)
    tasks = {s: load_suite(s, "heldout", n=n_tasks, seed=seed) for s in suites}
    try:
        return run_benchmark(tasks, factory, passes, tokenizer=tokenizer, sandbox=Sandbox(), config=config,
                             out_dir=out_dir, active_params=None, concurrency=slots,
                             policy_name=os.path.basename(run_dir))
    finally:
        service.stop()


def _suite_row(report: dict, suite: str) -> dict:
    s = report["suites"][suite]
    return {k: s.get(k) for k in ("accuracy", "pass_at_k", "completion_tokens_per_task", "malformed_call_rate")}


@dataclasses.dataclass(frozen=True)
class DemoSizes:
    """One demo setting: oracle transcripts for SFT, SFT steps, RL steps, held-out eval size."""
    transcripts: int      # oracle episodes on synthetic:1 train tasks (~100 s for 4096)
    sft_steps: int        # 8 rows x 768 tokens (two ~300-token transcripts per row)
    rl_steps: int         # learner steps of rl_config
    eval_tasks: int       # held-out synthetic:1 tasks, the same ones before and after RL
    eval_passes: int      # attempts per task (pass@1 is their mean; best-of-K uses all)
    rl_config: str = "configs/rl_tiny.py"  # the RL settings (prompts per step, group size, lr, ...)


# Distinct transcripts and steps both matter: 1024 transcripts x 300 steps gave held-out pass@1
# 0.03 (32 tasks x 4, temperature 0.7); 4096 x 350 steps 0.16 (32 x 1), x 600 steps 0.35 (32 x 4).
# With less, the model miscopied the line to replace; now its errors are in the replacement line.
# "default" keeps the 600 SFT steps the model needs to learn the task and cuts RL to 8 steps of 8
# prompts (about 14 minutes on 2 idle cores, setup included). "full" runs the RL recipe that
# measurably lifts this SFT model (configs/rl_tiny.py:learning, 24 prompts x 8 for 44 steps,
# experiments/results/rl_harness) and evaluates on 128 held-out tasks x 4: 3994 s, 2026-12-07.
DEMO_SIZES = {
    "quick": DemoSizes(transcripts=512, sft_steps=120, rl_steps=2, eval_tasks=8, eval_passes=2),
    "default": DemoSizes(transcripts=4096, sft_steps=600, rl_steps=8, eval_tasks=32, eval_passes=4),
    "full": DemoSizes(transcripts=4096, sft_steps=600, rl_steps=44, eval_tasks=128, eval_passes=4,
                      rl_config="configs/rl_tiny.py:learning"),
}
DEMO_STAGES = 5
# Share of the demo's SFT transcripts whose first edit miscopies its `old` text and recovers from
# the harness's error (ReadMissRetryPolicy). Without them the SFT model answers "Done." after a
# failed edit and rarely retries, so RL has no recovery to reinforce.
RECOVERY_FRACTION = 0.25


def _stage(i: int, title: str) -> None:
    print(f"== {i}/{DEMO_STAGES} {title} ==", flush=True)


def sft_overrides(cpt_dir: str, sft_path: str, steps: int) -> list:
    """The demo's SFT settings on top of configs/stages/sft.py:tiny."""
    return [f"--config.train.init_from={cpt_dir}", f"--config.data.sft_path={sft_path}",
            "--config.train.seq_len=768", "--config.train.batch_size=8", f"--config.train.steps={steps}",
            "--config.train.lr=2e-3", "--config.train.eval_every=0", "--config.train.log_every=5"]


def build_sft_model(workdir: str, overrides=(), mode: str = "full", timings: dict | None = None) -> dict:
    """CPT (configs/stages/cpt.py:tiny) -> SFT on read-then-fix oracle transcripts, into
    workdir/cpt and workdir/sft, at DEMO_SIZES[mode]. Returns {"cpt", "sft": run summaries,
    "transcripts", "sft_dir", "commands"}; `timings` receives each stage's seconds."""
    from c2jax.train.loop import run_training
    sizes = DEMO_SIZES[mode]
    timings = {} if timings is None else timings
    os.makedirs(workdir, exist_ok=True)
    cpt_dir, sft_dir = os.path.join(workdir, "cpt"), os.path.join(workdir, "sft")
    sft_path = os.path.join(workdir, "sft_transcripts.jsonl")
    overrides = list(overrides)
    extra = "".join(f" {o}" for o in overrides)
    commands = {"cpt": f"python -m c2jax pretrain --config configs/stages/cpt.py:tiny --workdir {cpt_dir}{extra}",
                "sft": "python -m c2jax sft --config configs/stages/sft.py:tiny --workdir "
                       f"{sft_dir} {' '.join(sft_overrides(cpt_dir, sft_path, sizes.sft_steps))}{extra}"}
    _stage(1, "continued pretraining (stdlib code corpus)")
    t = time.time()
    cpt = run_training(load_config("configs/stages/cpt.py:tiny", overrides), cpt_dir)
    timings["cpt"] = time.time() - t
    tokenizer = Tokenizer.load(cpt_dir)
    _stage(2, f"oracle transcripts for SFT ({sizes.transcripts} synthetic train tasks, harness token format)")
    t = time.time()
    tstats = write_oracle_transcripts(tokenizer, sft_path, n_per_suite=sizes.transcripts,
                                      recovery_fraction=RECOVERY_FRACTION)
    timings["transcripts"] = time.time() - t
    print(f"transcripts: {tstats}", flush=True)
    _stage(3, f"SFT on the oracle transcripts ({sizes.sft_steps} steps)")
    t = time.time()
    sft_cfg = load_config("configs/stages/sft.py:tiny",
                          [*sft_overrides(cpt_dir, sft_path, sizes.sft_steps), *overrides])
    sft = run_training(sft_cfg, sft_dir)
    timings["sft"] = time.time() - t
    return {"cpt": cpt, "sft": sft, "transcripts": tstats, "sft_dir": sft_dir, "commands": commands}


def sft_model(root: str) -> str:
    """root/sft, the demo's CPT+SFT run: built by build_sft_model(root) unless root already holds a
    finished one (summary.json). Run from the checkout (the stage configs are relative paths)."""
    sft_dir = os.path.join(root, "sft")
    if not os.path.exists(os.path.join(sft_dir, "summary.json")):
        build_sft_model(root)
    return sft_dir


def run_demo(workdir: str, overrides=(), mode: str = "default") -> int:
    """The quick start: CPT -> SFT -> RL -> held-out eval of the tiny model at DEMO_SIZES[mode];
    prints the tables and writes workdir/report.md, report.json and the plots."""
    from c2jax.demo_report import write_demo_report
    t0 = time.time()
    sizes = DEMO_SIZES[mode]
    timings: dict = {}
    built = build_sft_model(workdir, overrides, mode, timings)
    cpt, sft, sft_dir, commands = built["cpt"], built["sft"], built["sft_dir"], built["commands"]
    n_tasks, passes = sizes.eval_tasks, sizes.eval_passes

    # The demo's own held-out eval below compares SFT and RL on the same tasks; RL's built-in
    # evals (rl.eval_every) would repeat it on fewer tasks.
    rl_over = [f"--config.train.init_from={sft_dir}", f"--config.rl.steps={sizes.rl_steps}",
               "--config.rl.eval_every=-1", *overrides]
    _stage(4, f"RL (async, Dr. GRPO, router replay; {sizes.rl_steps} steps of {sizes.rl_config})")
    rl_dir, rl_shape = None, {"config": sizes.rl_config}
    eval_config = episode_config()
    t = time.time()
    try:
        from c2jax.rl.loop import run_rl
        from c2jax.rl.rollout import rl_episode_config
        rl_cfg = load_config(sizes.rl_config, rl_over)
        # Both models are scored under the harness settings RL trains with (turns, token budgets).
        eval_config = rl_episode_config(rl_cfg.rl, keep_workspace=False)
        rl_shape.update(prompts_per_step=rl_cfg.rl.prompts_per_step, group_size=rl_cfg.rl.group_size)
        rl_dir = os.path.join(workdir, "rl")
        run_rl(rl_cfg, rl_dir)
        commands["rl"] = f"python -m c2jax rl --config {sizes.rl_config} --workdir {rl_dir} {' '.join(rl_over)}"
    except ImportError as e:
        print(f"RL stage not available in this build ({e}); evaluating the SFT model only", flush=True)
    timings["rl"] = time.time() - t

    _stage(5, f"held-out evaluation (pass@1 and best-of-K; {n_tasks} tasks x {passes}, "
              f"temperature {TEMPERATURE})")
    t = time.time()
    evals = {"n_tasks": n_tasks, "passes": passes, "temperature": TEMPERATURE, "config": eval_config}
    rows = [("CPT -> SFT", evaluate_run(sft_dir, os.path.join(workdir, "eval_sft"), **evals))]
    if rl_dir:
        rows.append(("CPT -> SFT -> RL", evaluate_run(rl_dir, os.path.join(workdir, "eval_rl"), **evals)))
    timings["eval"] = time.time() - t
    timings["total"] = time.time() - t0
    print("\n" + stage_table(cpt, sft) + "\n\n" + eval_table(rows), flush=True)
    report = write_demo_report(workdir, {
        "mode": mode, "sizes": dataclasses.asdict(sizes), "rl_shape": rl_shape, "overrides": list(overrides), "commands": commands,
        "wall_s": timings, "transcripts": built["transcripts"], "temperature": TEMPERATURE,
        "eval_episode": {k: getattr(eval_config, k) for k in ("max_turns", "max_new_tokens", "max_total_tokens")}})
    print(f"\n{report['rl_summary_line']}", flush=True)
    print(f"\ndemo finished in {timings['total']:.0f} s; report: {os.path.join(workdir, 'report.md')} "
          f"(plots next to it); runs in {workdir}", flush=True)
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
