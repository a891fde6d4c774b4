"""One RL run (c2jax.rl.loop.run_rl: async sampler, Dr. GRPO learner, router replay, held-out
pass@1 / best-of-K) on a *variable-length* token toy, so that objective switches and the length
penalty can change response length. Used as the `command` of the toy sweeps in configs/sweeps/.

    python experiments/rl_toy.py --config configs/rl_tiny.py:toy --workdir DIR [--config.rl.X=V ...]

The length toy (LengthToyEnv, replaces the library's fixed-length ToyEnv for this run):
  * prompt: rl.toy_prompt_len random ids; the model writes up to rl.max_new_tokens tokens and may
    end early with the stop token STOP=1 (the sampler stops there);
  * verifier: if the answer stopped, the fraction of its content tokens t with t % 4 ==
    rl.toy_target % 4 (chance 1/4); a truncated answer (no STOP within rl.max_new_tokens) scores 0;
    passed = verifier >= 0.5;
  * reward = verifier - rl.length_coef * C(x), x = rl.effort_weights.final_message_tokens * (number
    of generated tokens), C the report's concave length penalty with rl.length_k, rl.length_q
    (c2jax.rl.rewards.length_penalty); the other effort / behaviour terms are not defined here;
  * a truncated answer has finish_reason "length", which rl.mask_overlong masks.
Writes what run_rl writes (metrics.jsonl with reward, reward terms, response_len, ...;
summary.json) plus results.json (a summary the sweep collects).
"""
from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

STOP = 1
MODULUS = 4


def make_length_env_class():
    from c2jax.rl.rewards import length_penalty
    from c2jax.rl.rollout import ToyEnv, stable_rid
    from c2jax.sampling.engine import Request
    from c2jax.trajectory import Trajectory

    class LengthToyEnv(ToyEnv):
        def episode(self, task, service, key, seed, temperature, group_id=""):
            r = self.rl
            req = Request(task.prompt_ids, max_new_tokens=r.max_new_tokens, n=1, temperature=temperature,
                          seed=seed, request_id=stable_rid(key), reuse_prefix=False, stop_token_ids=(STOP,))
            (c,) = service.submit(req).result()
            P, gen = len(task.prompt_ids), list(c.tokens)
            stopped = c.finish_reason == "stop"
            content = [t for t in gen if t != STOP]
            if stopped and content:
                verifier = float(np.mean([(t % MODULUS) == (r.toy_target % MODULUS) for t in content]))
            else:
                verifier = 0.0
            x = float(r.effort_weights.final_message_tokens) * len(gen)
            pen = -float(r.length_coef) * float(length_penalty(x, r.length_k, r.length_q)) if x > 0 else 0.0
            total = verifier + pen
            T = P + len(gen)
            traj = Trajectory(
                tokens_T=np.asarray(task.prompt_ids + gen, np.int32),
                loss_mask_T=np.r_[np.zeros(P, bool), np.ones(len(gen), bool)],
                logprobs_T=np.r_[np.zeros(P, np.float32), np.asarray(c.logprobs, np.float32)],
                versions_T=np.r_[np.full(P, -1, np.int32), np.asarray(c.versions, np.int32)],
                expert_ids_TNK=None if c.expert_ids is None else np.asarray(c.expert_ids, np.int32)[:T],
                reward=total,
                reward_terms={"verifier": verifier, "length_penalty": pen, "effort_x": x, "total": total,
                              "response_len": float(len(gen)), "truncated": float(not stopped)},
                task_id=task.task_id, group_id=group_id, finish_reason=c.finish_reason,
                stats={"turns": 1, "thinking_tokens": 0, "completion_tokens": len(gen)})
            return traj, bool(verifier >= 0.5)

    return LengthToyEnv


def enable_compile_cache():
    """Points of a sweep compile the same sampler and learner shapes: share a persistent cache
    (runs/.jax_cache, or $C2JAX_JAX_CACHE)."""
    import jax
    path = os.environ.get("C2JAX_JAX_CACHE", os.path.join("runs", ".jax_cache"))
    try:
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    except Exception:  # noqa: BLE001 - the cache is an optimization only
        pass


def parse(argv):
    spec, workdir, overrides = None, None, []
    it = iter(argv)
    for a in it:
        if a == "--config":
            spec = next(it)
        elif a.startswith("--config="):
            spec = a.split("=", 1)[1]
        elif a == "--workdir":
            workdir = next(it)
        elif a.startswith("--workdir="):
            workdir = a.split("=", 1)[1]
        elif a.startswith("--config."):
            overrides.append(a)
        else:
            raise SystemExit(f"rl_toy.py: unrecognized argument {a!r}")
    if not spec or not workdir:
        raise SystemExit("usage: python experiments/rl_toy.py --config FILE[:ARG] --workdir DIR [--config.k=v ...]")
    return spec, workdir, overrides


def summarize(workdir: str) -> dict:
    """results.json: reward / length / truncation means over the first and last quarter of
    steps, and the first and final held-out eval."""
    train, evals = load_metrics(workdir)
    n = len(train)
    q = max(n // 4, 1)

    def mean(key, rows):
        v = [r[key] for r in rows if key in r and r[key] is not None and np.isfinite(r[key])]
        return float(np.mean(v)) if v else None

    out = {"steps": n}
    for key, name in (("reward", "reward"), ("reward/verifier", "verifier"), ("reward/response_len", "response_len"),
                      ("reward/truncated", "truncated"), ("reward/length_penalty", "length_penalty"),
                      ("pass_rate", "pass_rate")):
        out[f"first/{name}"] = mean(key, train[:q])
        out[f"last/{name}"] = mean(key, train[-q:])
    if evals:
        last = evals[-1]
        out["eval/pass_at_1"] = last["eval/pass_at_1"]
        bk = [k for k in last if k.startswith("eval/best_of_")]
        if bk:
            out["eval/best_of_k"] = last[bk[0]]
        out["eval/first_pass_at_1"] = evals[0]["eval/pass_at_1"]
    with open(os.path.join(workdir, "results.json"), "w") as f:
        json.dump(out, f, indent=1)
    return out


def main(argv=None):
    import logging
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("absl", "jax._src", "orbax", "grain"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    spec, workdir, overrides = parse(sys.argv[1:] if argv is None else argv)
    from absl import flags
    flags.FLAGS.mark_as_parsed()
    enable_compile_cache()
    import c2jax.rl.loop as loop
    import c2jax.sections  # noqa: F401  (the data / eval / rl config sections)
    from c2jax.config import load_config
    cfg = load_config(spec, overrides)
    if cfg.rl.env != "toy":
        raise SystemExit("rl_toy.py runs the length toy; use a toy config (configs/rl_tiny.py:toy)")
    env_cls = make_length_env_class()
    loop.make_env = lambda cfg, workdir: env_cls(cfg.rl, cfg.model.vocab_size)
    summary = loop.run_rl(cfg, workdir)
    print(json.dumps(summarize(workdir), indent=1))
    return 0 if summary.get("final_step") == cfg.rl.steps else 1



# ----------------------------------------------------------------------------- sweep helpers
# (used by experiments/{objective_ablations,length_penalty,rl_coverage,cpt_vs_rl}.py)

def run_sweep_parallel(sweep_path: str, workdir: str, parallel: int = 1):
    """Run a sweep's points (serially through c2jax.sweep.run_sweep, or `parallel` at a time
    through its launch lines, which skip DONE points too) and collect its table."""
    import concurrent.futures
    import subprocess

    from c2jax.sweep import POINT_FILE, collect, expand, launch_commands, load_sweep, run_sweep, write_point_file
    sweep = load_sweep(sweep_path)
    points = expand(sweep)
    if parallel <= 1:
        run_sweep(sweep, workdir)
    else:
        os.makedirs(workdir, exist_ok=True)
        for p in points:  # point.json first, as run_sweep does, so collect() finds every point
            if not os.path.exists(os.path.join(workdir, p.name, POINT_FILE)):
                write_point_file(os.path.join(workdir, p.name), p, sweep.command, sweep.base)
        lines = launch_commands(sweep, workdir, path=os.path.join(workdir, "launch.sh"), python=sys.executable)
        with concurrent.futures.ThreadPoolExecutor(parallel) as ex:
            list(ex.map(lambda line: subprocess.call(["bash", "-c", line]), lines))
    return sweep, collect(workdir, list(sweep.get("metrics", [])), points)


def load_metrics(run_dir: str):
    """(train records, eval records) of one run's metrics.jsonl."""
    train, evals = [], []
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return train, evals
    with open(path) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "reward" in rec:
                train.append(rec)
            if "eval/pass_at_1" in rec:
                evals.append(rec)
    return train, evals


def smooth(y, w: int = 5):
    y = np.asarray(y, float)
    if len(y) < w:
        return y
    k = np.ones(w) / w
    pad = np.r_[np.full(w // 2, y[0]), y, np.full(w - 1 - w // 2, y[-1])]
    return np.convolve(pad, k, mode="valid")


def md_table(columns, rows) -> str:
    def cell(v):
        if v is None:
            return ""
        return f"{v:.4g}" if isinstance(v, float) else str(v)
    out = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    out += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
    return "\n".join(out)


def seed_groups(sweep, workdir: str, label_fn):
    """{label: [(train, evals) per finished (DONE) seed]} in sweep order; label_fn(overrides) -> key."""
    from c2jax.sweep import DONE, expand
    groups: dict = {}
    for p in expand(sweep):
        if not os.path.exists(os.path.join(workdir, p.name, DONE)):
            continue
        train, evals = load_metrics(os.path.join(workdir, p.name))
        if train:
            groups.setdefault(label_fn(p.overrides), []).append((train, evals))
    return groups


def quarter_means(runs, key: str, last: bool) -> float:
    """Mean of `key` over the first (or last) quarter of steps, averaged over seeds."""
    vals = []
    for train, _ in runs:
        q = max(len(train) // 4, 1)
        rows = train[-q:] if last else train[:q]
        vals.append(np.nanmean([r.get(key, np.nan) for r in rows]))
    return float(np.mean(vals))


def mean_curve(runs, key: str):
    """(steps, mean over seeds of the 5-step smoothed curve) on the steps all seeds have."""
    n = min(len(t) for t, _ in runs)
    steps = [r["step"] for r in runs[0][0][:n]]
    ys = np.mean([smooth([r.get(key, np.nan) for r in t[:n]]) for t, _ in runs], axis=0)
    return steps, ys


def final_eval(runs, key: str = "eval/pass_at_1"):
    v = [e[-1][key] for _, e in runs if e]
    return float(np.mean(v)) if v else None


if __name__ == "__main__":
    sys.exit(main())
