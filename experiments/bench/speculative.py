"""The sampler's inference options: MTP speculative decoding (acceptance, tokens/s vs plain
decoding) and pre-quantized weights (storage bytes, tokens/s vs quantizing every step).

    JAX_PLATFORMS=cpu python experiments/bench/speculative.py                 # tiny, batch 1 and 8
    JAX_PLATFORMS=cpu python experiments/bench/speculative.py --batches 8 --new-tokens 128 --json out.json
    JAX_PLATFORMS=cpu python experiments/bench/speculative.py --model 100m --only mtp --depths 1 --batches 8
    JAX_PLATFORMS=cpu python experiments/bench/speculative.py --run runs/demo/sft --batches 1,8 --json out.json

All runs greedy, float32, random prompts of `prompt_len` tokens, `new_tokens` new tokens, the
whole decode in as few chunks as the sampler allows; decode tok/s = batch * new_tokens / decode
time (best of `repeats` after a compile run); cpu_tok_s uses the process CPU time instead
(all threads), steadier than wall time on a shared host. MTP heads: "random" (init weights: drafts almost
always rejected, the overhead case) and "bigram a=X" (speculative.bigram_mtp_params: heads that
predict the constructed model well, a = the perturbation the drafts can miss). Plain decoding
runs the sampler's default (on CPU the unrolled split-layer decode) and, as "scanned", the
model's scanned forward that the speculative step also uses. Speculative
outputs are checked equal to plain outputs token for token in every row.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import numpy as np

import c2jax
from c2jax.sampling import Request, Sampler
from c2jax.sampling.quantized import param_bytes
from c2jax.sampling.speculative import bigram_mtp_params

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sampler import MODELS  # noqa: E402  (tiny = defaults, 100m = the HF peer's shape)


def make_cfg(depth: int, quant: str = "none", model: str = "tiny"):
    cfg = c2jax.config.default_config()
    for k, v in MODELS[model].items():
        cfg.model[k] = v
    cfg.model.num_mtp_layers = depth
    cfg.model.quant = quant
    cfg.model.init_std = 0.2
    return cfg


def run(cfg, params, batch, prompt_len, new_tokens, repeats, prompts=None, temperature=0.0, **opts):
    """(timings of the fastest run, MTP acceptance over all timed runs, tokens of every run) for one
    sampler configuration; prompts: an iterator of token lists (default: random tokens)."""
    max_len = -(-(prompt_len + new_tokens + 8) // 16) * 16
    s = Sampler(cfg, params, max_batch=batch, max_len=max_len, chunk=new_tokens, **opts)
    rng = np.random.default_rng(0)

    def once():
        rows = ([list(next(prompts)) for _ in range(batch)] if prompts is not None
                else rng.integers(0, cfg.model.vocab_size, (batch, prompt_len)).tolist())
        rids = [s.submit(Request(p, max_new_tokens=new_tokens, temperature=temperature, seed=i, reuse_prefix=False))
                for i, p in enumerate(rows)]
        s._admit()
        jax.block_until_ready(s.state.cur)
        d0, a0, st0 = s.spec_drafted, s.spec_accepted, s.decode_steps
        t0, c0 = time.perf_counter(), time.process_time()
        s.run_until_done()
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        toks = [s.results(r)[0].tokens for r in rids]
        return dt, toks, s.spec_drafted - d0, s.spec_accepted - a0, s.decode_steps - st0, dc

    runs = [once() for _ in range(1 + max(repeats, 1))]   # the first one compiles
    dt, _, _, _, steps, _ = min(runs[1:], key=lambda r: r[0])
    dc = min(r[5] for r in runs[1:])
    # acceptance over every timed run (each its own prompts), not only the fastest one's
    drafted, accepted = sum(r[2] for r in runs[1:]), sum(r[3] for r in runs[1:])
    return {"tok_s": batch * new_tokens / dt, "cpu_tok_s": batch * new_tokens / dc, "decode_s": dt, "steps": steps,
            "acceptance": accepted / drafted if drafted else None,
            "acceptance_runs": [r[3] / r[2] if r[2] else None for r in runs[1:]]}, [r[1] for r in runs]


def bench_speculative(args, rows):
    for depth in args.depths:
        cfg = make_cfg(depth, model=args.model)
        base = c2jax.models.init_params(cfg, jax.random.key(0))
        models = [("random", base)] + [(f"bigram a={a}", bigram_mtp_params(cfg, base, alpha=a)) for a in args.alphas]
        for name, params in models:
            for batch in args.batches:
                plain, want = run(cfg, params, batch, args.prompt_len, args.new_tokens, args.repeats)
                scanned, _ = run(cfg, params, batch, args.prompt_len, args.new_tokens, args.repeats,
                                 split_decode=False)
                spec, got = run(cfg, params, batch, args.prompt_len, args.new_tokens, args.repeats,
                                speculative="mtp")
                assert got == want, "speculative output differs from plain decoding"
                row = {"bench": "mtp", "model": args.model, "depth": depth, "heads": name, "batch": batch,
                       "plain_tok_s": plain["tok_s"], "spec_tok_s": spec["tok_s"], "speedup": spec["tok_s"] / plain["tok_s"],
                       "plain_scanned_tok_s": scanned["tok_s"], "plain_cpu_tok_s": plain["cpu_tok_s"], "spec_cpu_tok_s": spec["cpu_tok_s"],
                       "cpu_speedup": spec["cpu_tok_s"] / plain["cpu_tok_s"],
                       "acceptance": spec["acceptance"], "plain_steps": plain["steps"], "spec_steps": spec["steps"]}
                rows.append(row)
                print(f"mtp d={depth} {name:12s} batch {batch:3d}: plain {plain['tok_s']:8.1f} tok/s "
                      f"({plain['steps']} steps; scanned layers {scanned['tok_s']:8.1f}), mtp {spec['tok_s']:8.1f} tok/s ({spec['steps']} steps), "
                      f"x{row['speedup']:.2f} wall, x{row['cpu_speedup']:.2f} cpu time, "
                      f"acceptance {spec['acceptance']:.2f}", flush=True)


def heldout_prompts(cfg, run_dir: str, n: int, prompt_len: int) -> list[list[int]]:
    """n prompts of prompt_len tokens from the run's held-out corpus documents (its tokenizer)."""
    from c2jax.data.corpus import build_corpus
    from c2jax.data.pipeline import corpus_spec_from_config
    from c2jax.data.tokenizer import Tokenizer
    tok = Tokenizer.load(run_dir)
    out = []
    for doc in build_corpus(corpus_spec_from_config(cfg.data)).heldout:
        ids = tok.encode(doc.text)
        for i in range(0, len(ids) - prompt_len, 4 * prompt_len):
            out.append(ids[i:i + prompt_len])
            if len(out) == n:
                return out
    if not out:
        raise SystemExit(f"{run_dir}: no held-out document has {prompt_len} tokens")
    return out


def bench_trained(args, rows):
    """A trained run's own MTP heads on held-out text: greedy acceptance, tokens/s of speculative
    decoding against plain decoding (the CPU's split step and the scanned step speculation
    verifies with), and the speedup acceptance predicts: (1 + accepted per step) / (spec step
    cost / scanned step cost). Sampled (T = 1) acceptance from the same prompts."""
    import c2jax.sections  # noqa: F401  (the data / eval / rl config sections)
    from c2jax.train.loop import load_run_config, load_run_params
    cfg = load_run_config(args.run)
    if not cfg.model.num_mtp_layers:
        raise SystemExit(f"{args.run}: the model has no MTP heads (model.num_mtp_layers = 0)")
    params = load_run_params(args.run, cfg)
    d = int(cfg.model.num_mtp_layers)
    for batch in args.batches:
        prompts = heldout_prompts(cfg, args.run, batch * (1 + max(args.repeats, 1)), args.prompt_len)
        same = lambda **o: run(cfg, params, batch, args.prompt_len, args.new_tokens, args.repeats,  # noqa: E731
                               prompts=iter(prompts * 2), **o)        # every configuration: the same prompts
        plain, want = same()
        scanned, _ = same(split_decode=False)
        spec, got = same(speculative="mtp")
        assert got == want, "speculative output differs from plain decoding"
        sampled, drawn = same(speculative="mtp", temperature=1.0)
        step_cost = (spec["decode_s"] / spec["steps"]) / (scanned["decode_s"] / scanned["steps"])
        predicted = (1 + spec["acceptance"] * d) / step_cost
        row = {"bench": "mtp_trained", "run": os.path.relpath(os.path.abspath(args.run)), "model": cfg.model.name,
               "depth": d, "batch": batch, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
               "acceptance_greedy": spec["acceptance"], "acceptance_t1": sampled["acceptance"],
               "acceptance_greedy_runs": spec["acceptance_runs"], "acceptance_t1_runs": sampled["acceptance_runs"],
               "plain_tok_s": plain["tok_s"], "plain_scanned_tok_s": scanned["tok_s"], "spec_tok_s": spec["tok_s"],
               "speedup_vs_scanned": spec["tok_s"] / scanned["tok_s"], "speedup_vs_plain": spec["tok_s"] / plain["tok_s"],
               "spec_step_cost_vs_scanned": step_cost, "predicted_speedup_vs_scanned": predicted,
               "tokens_per_spec_step": args.new_tokens / spec["steps"], "plain_steps": scanned["steps"], "spec_steps": spec["steps"],
               # a model that loops on a few tokens makes drafting easy: how varied the text is
               "distinct_fraction_greedy": distinct_fraction(want), "distinct_fraction_t1": distinct_fraction(drawn)}
        rows.append(row)
        row["acceptance_greedy_se"] = standard_error(spec["acceptance_runs"])
        row["acceptance_t1_se"] = standard_error(sampled["acceptance_runs"])
        print(f"trained {cfg.model.name} d={d} batch {batch}: acceptance greedy {spec['acceptance']:.3f} "
              f"(+- {row['acceptance_greedy_se']:.3f} over {len(spec['acceptance_runs'])} runs), "
              f"T=1 {sampled['acceptance']:.3f} (+- {row['acceptance_t1_se']:.3f}); plain {plain['tok_s']:.1f} tok/s (scanned {scanned['tok_s']:.1f}), "
              f"mtp {spec['tok_s']:.1f} tok/s: x{row['speedup_vs_scanned']:.2f} vs scanned (predicted "
              f"x{predicted:.2f}: a spec step costs x{step_cost:.2f} a scanned step), x{row['speedup_vs_plain']:.2f} "
              f"vs plain; distinct tokens per row greedy {row['distinct_fraction_greedy']:.2f}, T=1 "
              f"{row['distinct_fraction_t1']:.2f}", flush=True)


def standard_error(xs) -> float:
    """Standard error of the mean of xs (None entries, runs that drafted nothing, left out)."""
    xs = [x for x in xs if x is not None]
    return float(np.std(xs, ddof=1) / np.sqrt(len(xs))) if len(xs) > 1 else float("nan")


def distinct_fraction(runs) -> float:
    """Mean over generated rows (of every run) of distinct tokens / tokens."""
    fr = [len(set(t)) / len(t) for toks in runs for t in toks if len(t)]
    return sum(fr) / len(fr) if fr else float("nan")


def bench_tasks(args, rows):
    """A trained run's MTP head drafting where the model runs: held-out agent episodes of the
    harness (args.suite, e.g. the demo's synthetic:1) at T = 1 with speculative decoding on, one
    episode at a time; first-position acceptance from the sampler's counters, per episode and
    over all, and the pass rate."""
    import tempfile

    import c2jax.sections  # noqa: F401  (the data / eval / rl config sections)
    from c2jax.data.tokenizer import Tokenizer
    from c2jax.evals.benchmark import run_benchmark
    from c2jax.pipeline import Sandbox, episode_config, model_policy_factory
    from c2jax.tasks import load_suite
    from c2jax.train.loop import load_run_config, load_run_params
    cfg = load_run_config(args.run)
    if not cfg.model.num_mtp_layers:
        raise SystemExit(f"{args.run}: the model has no MTP heads (model.num_mtp_layers = 0)")
    params = load_run_params(args.run, cfg)
    tok = Tokenizer.load(args.run)
    tasks = {args.suite: load_suite(args.suite, "heldout", n=args.tasks, seed=0)}
    factory, harness = model_policy_factory(cfg, params, tok, temperature=1.0, speculative="mtp")
    s = harness.sampler
    marks = []     # (drafted, accepted) when each episode's policy is made: episodes run one at a time

    def policy(task):
        marks.append((s.spec_drafted, s.spec_accepted))
        return factory(task)

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        rep = run_benchmark(tasks, policy, 1, tokenizer=tok, sandbox=Sandbox(), config=episode_config(),
                            out_dir=out, concurrency=1, policy_name=os.path.basename(args.run))
    marks.append((s.spec_drafted, s.spec_accepted))
    per = [(a1 - a0) / (d1 - d0) for (d0, a0), (d1, a1) in zip(marks, marks[1:]) if d1 > d0]
    acc = (marks[-1][1] - marks[0][1]) / max(marks[-1][0] - marks[0][0], 1)
    se = standard_error(per)
    row = {"bench": "mtp_trained_tasks", "run": os.path.relpath(os.path.abspath(args.run)), "model": cfg.model.name,
           "suite": args.suite, "episodes": len(marks) - 1, "temperature": 1.0, "acceptance_t1": acc,
           "acceptance_t1_episodes": per, "acceptance_t1_se": se, "drafted": marks[-1][0] - marks[0][0],
           "pass_rate": rep["suites"][args.suite]["accuracy"], "wall_s": time.perf_counter() - t0}
    rows.append(row)
    print(f"trained {cfg.model.name} on {len(marks) - 1} held-out {args.suite} episodes at T=1: acceptance "
          f"{acc:.3f} (+- {se:.3f} over episodes, {row['drafted']} drafts), pass rate {row['pass_rate']:.3f}",
          flush=True)


def bench_quantized(args, rows):
    for quant in args.quants:
        cfg = make_cfg(0, quant, model=args.model)
        params = c2jax.models.init_params(cfg, jax.random.key(0))
        for batch in args.batches:
            res = {}
            for scope in ("none", "experts", "all"):
                r, toks = run(cfg, params, batch, args.prompt_len, args.new_tokens, args.repeats, quant_scope=scope)
                s = Sampler(cfg, params, max_batch=1, max_len=16, quant_scope=scope)
                res[scope] = (r["tok_s"], param_bytes(s.weights.model), toks)
            assert res["experts"][2] == res["none"][2], "stored experts decode differently from on-the-fly"
            fb = param_bytes(params)
            row = {"bench": "quant", "model": args.model, "quant": quant, "batch": batch, "float_bytes": fb,
                   **{f"{k}_tok_s": v[0] for k, v in res.items()}, **{f"{k}_bytes": v[1] for k, v in res.items()}}
            rows.append(row)
            print(f"quant {quant:5s} batch {batch:3d}: on-the-fly {res['none'][0]:8.1f} tok/s ({fb} B), "
                  f"stored experts {res['experts'][0]:8.1f} tok/s ({res['experts'][1]} B), "
                  f"stored all {res['all'][0]:8.1f} tok/s ({res['all'][1]} B)", flush=True)


def main() -> int:
    c2jax.hostmem.retain_freed_memory()  # first: host malloc keeps freed memory before XLA's threads start
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="tiny")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--depths", default="1,2")
    ap.add_argument("--alphas", default="0.3,0.8")
    ap.add_argument("--quants", default="int8,mxfp8,nvfp4")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--only", choices=("mtp", "quant"), default=None)
    ap.add_argument("--json", default=None, help="also write all rows to this file")
    ap.add_argument("--run", default=None, help="a trained run directory: benchmark its own MTP heads on "
                    "held-out text (only this bench runs)")
    ap.add_argument("--tasks", type=int, default=0, help="with --run: instead, draft in this many held-out agent "
                    "episodes of --suite at T = 1")
    ap.add_argument("--suite", default="synthetic:1", help="with --tasks: the task suite")
    args = ap.parse_args()
    args.batches = [int(x) for x in args.batches.split(",")]
    args.depths = [int(x) for x in args.depths.split(",")]
    args.alphas = [float(x) for x in args.alphas.split(",") if x]
    args.quants = [x for x in args.quants.split(",") if x]
    print(f"backend {jax.default_backend()}", flush=True)
    rows: list[dict] = []
    if args.run and args.tasks:
        bench_tasks(args, rows)
    elif args.run:
        bench_trained(args, rows)
    elif args.only in (None, "mtp"):
        bench_speculative(args, rows)
    if args.only in (None, "quant") and not args.run:
        bench_quantized(args, rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
