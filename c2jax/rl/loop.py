"""`run_rl(cfg, workdir) -> summary`: the asynchronous RL run (threads backend by default).

    cfg = load_config("configs/rl_tiny.py"); run_rl(cfg, "runs/rl")

Per learner step: take P finished groups (oldest first) from the orchestrator, drop/reweight
over-stale ones, group advantages (Dr. GRPO), one learner step (router replay, k1 KL penalty,
truncated IS), checkpoint {state, consumed group indices}, publish version+1 to the sampler
(in flight) and, measured, as a lossless delta; metrics: reward and each term, pass rates,
staleness histogram, tokens/s, sampler idle fraction, logprob mismatch (with / without
replay), KL, delta size; held-out pass@1 and best-of-K every rl.eval_every steps.

Resume: rerunning on the same workdir restores the latest learner checkpoint, reloads finished
unconsumed groups from workdir/groups and requeues admitted unfinished ones.
"""
from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import time

import numpy as np

from c2jax.progress import Heartbeat
from c2jax.rl.chains import groups_to_sequences
from c2jax.rl.config import rl_defaults, validate_rl
from c2jax.rl.orchestrator import Orchestrator, PromptSource
from c2jax.rl.ray_backend import RayRuntime
from c2jax.rl.roles import rl_meshes, sampler_cfg
from c2jax.rl.rollout import SamplerService
from c2jax.rl.runtime import LearnerHost, make_env
from c2jax.rl.store import GroupStore

log = logging.getLogger(__name__)


def evaluate(env, service, tasks, k: int, temperature: float, seed: int, workers: int, tag: str) -> dict:
    """pass@1 (mean success over all attempts) with its standard error over tasks, best-of-K
    (any success per task), and each task's pass fraction (eval/task_pass, in task order: evals of
    the same tasks at two steps compare pairwise)."""
    def one(args):
        i, j = args
        _, passed = env.episode(tasks[i], service, f"eval/{i}/{j}", seed, temperature, group_id=f"eval{i}")
        return i, j, passed
    ok = np.zeros((len(tasks), k), bool)
    with concurrent.futures.ThreadPoolExecutor(max(workers, 1)) as ex:
        for i, j, passed in ex.map(one, [(i, j) for i in range(len(tasks)) for j in range(k)]):
            ok[i, j] = passed
    per_task = ok.mean(axis=1)
    se = float(per_task.std(ddof=1) / np.sqrt(len(tasks))) if len(tasks) > 1 else float("nan")
    return {"eval/pass_at_1": float(ok.mean()), "eval/pass_at_1_se": se,
            f"eval/best_of_{k}": float(ok.any(axis=1).mean()), "eval/tasks": len(tasks),
            "eval/task_pass": per_task.tolist()}


def group_signal_metrics(groups) -> dict:
    """Where a step's learning signal is: the fraction of groups whose rewards are all equal (zero
    advantage, so only the KL term moves the policy), of groups that all passed / all failed, and
    the pass rate per suite (a suite is a task family at one difficulty, e.g. synthetic:1)."""
    if not groups:
        return {}
    spread = [float(np.ptp(np.asarray(g.rewards, np.float64))) for g in groups]
    passed = [np.asarray(g.passed, bool) for g in groups]
    out = {"groups_zero_spread": float(np.mean([s <= 1e-6 for s in spread])),
           "groups_all_pass": float(np.mean([p.all() for p in passed])),
           "groups_all_fail": float(np.mean([not p.any() for p in passed]))}
    by_suite: dict = {}
    for g, p in zip(groups, passed):
        by_suite.setdefault(g.suite, []).append(p)
    for suite, ps in sorted(by_suite.items()):
        out[f"pass_rate/{suite}"] = float(np.mean(np.concatenate(ps)))
    return out


def _stale_weights(groups, version, r):
    keep, weights, stale = [], [], []
    for g in groups:
        s = max(version - g.start_version, 0)
        stale.append(s)
        if s > r.staleness and r.stale_policy == "drop":
            continue
        w = r.stale_decay ** (s - r.staleness) if (s > r.staleness and r.stale_policy == "reweight") else 1.0
        keep.append(g)
        weights.append(w)
    return keep, weights, stale


class LocalRuntime:
    """The threads backend: a LearnerHost and a SamplerService in this process (environment
    workers are the orchestrator's threads). c2jax.rl.ray_backend.RayRuntime: the same as actors."""

    def __init__(self, cfg, workdir: str):
        r = cfg.rl
        self.env = make_env(cfg, workdir)
        self.roles = roles = rl_meshes(cfg)
        self.host = h = LearnerHost(cfg, workdir, roles=roles)
        self.start_step, self.consumed, self.dropped = h.start_step, h.consumed, h.dropped
        self.service = SamplerService(sampler_cfg(h.learner.cfg), h.sampler_params(), h.start_step, r.sampler_slots,
                                      self.env.max_len(), r.sampler_chunk, r.sampler_decode_devices,
                                      mesh=roles.sampler_mesh, speculative=r.speculative)
        if r.log_delta:
            h.publish(h.start_step)

    def describe(self) -> dict:
        """Each role's device ids and mesh shape."""
        return self.roles.describe()

    def learn(self, trajs, adv_B, w_B) -> dict:
        return self.host.step(trajs, adv_B, w_B)

    def save(self, step: int, data: dict, meta: dict, force: bool = False) -> None:
        self.host.save(step, data, meta, force)

    def swap(self, step: int) -> None:
        """In-flight update of the sampler to the learner's current params."""
        self.service.swap(self.host.sampler_params(), step)

    def publish_stats(self, step: int) -> dict:
        return self.host.publish(step)

    def close(self) -> None:
        try:
            self.service.stop()
        finally:
            self.host.close()


def run_rl(cfg, workdir: str, *, hooks=None) -> dict:
    """Run (or resume) RL into workdir. Returns the summary (also written to summary.json).

    One run per workdir (c2jax.runlock); the model is checked against the run's config.json (on
    resume) or train.init_from's before anything is written.
    hooks (tests / fault injection): {"after_step": fn(step, orchestrator, service)}."""
    from c2jax.runlock import workdir_lock
    from c2jax.train.compat import check_workdir
    if "rl" not in cfg:
        cfg.rl = rl_defaults()
    validate_rl(cfg.rl, cfg.model)
    os.makedirs(workdir, exist_ok=True)
    with workdir_lock(workdir):
        check_workdir(cfg, workdir)
        return _run_rl(cfg, workdir, hooks or {})


def _run_rl(cfg, workdir: str, hooks: dict) -> dict:
    r = cfg.rl
    with open(os.path.join(workdir, "config.json"), "w") as f:
        f.write(cfg.to_json_best_effort(indent=2))
    from c2jax.train.metrics import MetricsWriter

    if r.backend == "ray":  # learner, samplers and env workers as Ray actors; the driver below is shared
        rt = RayRuntime(cfg, workdir)
    else:
        rt = LocalRuntime(cfg, workdir)
    env, service = rt.env, rt.service
    step, consumed, dropped = rt.start_step, set(rt.consumed), list(rt.dropped)
    if step:
        log.info("resumed RL from step %d (%d groups consumed)", step, len(consumed))
    store = GroupStore(os.path.join(workdir, "groups"))
    total = r.steps * r.prompts_per_step
    n_tasks = r.num_train_tasks or 2 * total
    task_seed = int(r.get("task_seed", -1))  # run configs written before the field have none
    source = PromptSource(env, r, cfg.seed if task_seed < 0 else task_seed, n_tasks, store)
    orch = Orchestrator(r, env, service, store, source, version=step, consumed=consumed, seed=cfg.seed,
                        total_groups=total + len(dropped))
    writer = MetricsWriter(workdir)
    eval_suites = list(r.eval_suites or r.suites)
    heldout = []
    for s in eval_suites:
        heldout += env.load_tasks(s, "heldout", max(r.eval_tasks // len(eval_suites), 1), cfg.seed)
    summary = {"start_step": step, "resumed_consumed": sorted(consumed), "evals": []}
    summary["devices"] = rt.describe()   # where each role runs: the run's first record
    writer.write(step, summary["devices"])

    beat = Heartbeat("rl", r.steps, start=step)
    sampling = beat.note = lambda: f"sampling and learning ({service.generated_tokens} tokens sampled)"

    def run_eval(at):
        beat.note = f"held-out eval at step {at} ({len(heldout)} tasks x {r.eval_k})"
        t0 = time.monotonic()
        ev = evaluate(env, service, heldout, r.eval_k, r.eval_temperature, cfg.seed, r.env_workers, str(at))
        ev["eval/seconds"] = time.monotonic() - t0
        writer.write(at, ev)
        summary["evals"].append({"step": at, **ev})
        log.info("eval at step %d: %s", at, {k: v for k, v in ev.items() if k != "eval/task_pass"})
        beat.note = sampling
        return ev

    t_start = time.monotonic()
    beat.__enter__()
    try:
        if r.eval_every >= 0 and step == 0:
            run_eval(0)
        orch.start()
        idle0, busy0 = service.counters()
        gen0 = service.generated_tokens
        spec0 = service.spec_counts()
        t_last = time.monotonic()
        while step < r.steps:
            t_wait = time.monotonic()
            groups = orch.take(r.prompts_per_step, step)
            wait_s = time.monotonic() - t_wait
            keep, weights, stale = _stale_weights(groups, step, r)
            n_drop = len(groups) - len(keep)
            if n_drop:
                kept = {g.index for g in keep}
                gone = [g.index for g in groups if g.index not in kept]
                dropped += gone
                orch.extend_total(n_drop)  # admit replacements so every step still trains P groups
                orch.mark_consumed(gone)
                more = orch.take(n_drop, step)
                k2, w2, s2 = _stale_weights(more, step, r)
                keep, weights, stale = keep + k2, weights + w2, stale + s2
                groups = groups + more
            rewards = np.asarray([g.rewards for g in keep], np.float32)         # [P, G]
            # one sequence per trajectory; a self-summarized chain -> one per segment, all with
            # the chain's advantage (the group mean counts each chain once)
            trajs, adv, w_B, chains = groups_to_sequences(keep, weights, r.std_normalize, r.std_eps,
                                                          r.negative_advantage_scale)
            finals = [c[-1] for c in chains]  # one per attempt: its stats / reward terms cover the episode
            t0 = time.monotonic()
            m = rt.learn(trajs, adv, w_B)
            learn_s = time.monotonic() - t0
            step += 1
            beat.done = step
            orch.mark_consumed([g.index for g in groups])
            rt.save(step, {"consumed": sorted(orch.consumed), "dropped": dropped},
                    {"step": step, "trained_groups": [g.index for g in keep]}, force=step == r.steps)
            rt.swap(step)  # in flight
            orch.set_version(step)
            if r.log_delta:
                m.update(rt.publish_stats(step))
            # ---- metrics
            now = time.monotonic()
            idle1, busy1 = service.counters()
            gen1 = service.generated_tokens
            m["sampler_idle_fraction"] = (idle1 - idle0) / max((idle1 - idle0) + (busy1 - busy0), 1e-9)
            m["sampler_tokens_per_s"] = (gen1 - gen0) / max(now - t_last, 1e-9)
            m["learner_tokens_per_s"] = m["batch_tokens"] / max(learn_s, 1e-9)
            m["learner_wait_s"], m["learner_step_s"] = wait_s, learn_s
            idle0, busy0, gen0, t_last = idle1, busy1, gen1, now
            spec1 = service.spec_counts()
            if spec1[0] > spec0[0]:   # speculative rollouts: the MTP drafts' acceptance this step
                m["spec_acceptance"] = (spec1[1] - spec0[1]) / (spec1[0] - spec0[0])
            spec0 = spec1
            m["reward"] = float(rewards.mean())
            m["pass_rate"] = float(np.mean([p for g in keep for p in g.passed]))
            m.update(group_signal_metrics(keep))
            terms = {}
            for t in finals:
                for k, v in t.reward_terms.items():
                    terms.setdefault(k, []).append(float(v))
            for k, v in terms.items():
                m[f"reward/{k}"] = float(np.mean(v))
            m["staleness_mean"] = float(np.mean(stale))
            m["staleness_hist"] = np.bincount(np.asarray(stale, np.int64), minlength=r.staleness + 2).tolist()
            lag = [step - 1 - t.versions_T[t.loss_mask_T] for t in trajs if t.loss_mask_T.any()]
            m["token_version_lag_mean"] = float(np.mean(np.concatenate(lag))) if lag else 0.0
            m["stale_dropped"] = n_drop
            m["sampler_restarts"] = service.restarts
            m["env_worker_restarts"] = orch.env_restarts
            m["groups_trained"] = len(keep)
            m["trained_groups"] = [g.index for g in keep]
            m["turns_mean"] = float(np.mean([t.stats.get("turns", 1) for t in finals]))
            from c2jax.agent.runner import exception_metrics
            m.update(exception_metrics([t.stats for t in finals], flat=True))
            if r.summary_method != "none":
                m["sequences_per_chain"] = len(trajs) / len(chains)
                m["summaries_mean"] = float(np.mean([t.stats.get("summaries", 0) for t in finals]))
            writer.write(step, m)
            log.info("rl step %d/%d reward %.3f pass %.2f staleness %.2f idle %.2f", step, r.steps, m["reward"],
                     m["pass_rate"], m["staleness_mean"], m["sampler_idle_fraction"])
            beat.touch()
            if "after_step" in hooks:
                hooks["after_step"](step, orch, service)
            if r.eval_every > 0 and step % r.eval_every == 0 and step < r.steps:
                run_eval(step)
        summary["train_wall_s"] = time.monotonic() - t_start
        orch.stop()
        if r.eval_every >= 0:
            run_eval(step)
        summary.update(final_step=step, groups_consumed=len(orch.consumed), groups_dropped=len(dropped),
                       sampler_restarts=service.restarts, env_worker_restarts=orch.env_restarts,
                       sampler_idle_fraction=service.idle_fraction())
    finally:
        beat.__exit__()
        orch.stop()
        rt.close()
        writer.close()
    with open(os.path.join(workdir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2, default=float)
    return summary
