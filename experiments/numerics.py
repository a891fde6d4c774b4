"""Numerics (report section 6 and 3): MXFP8 vs BF16 training loss; per-token vs per-tensor NVFP4
batch invariance; sampler/trainer logprob mismatch with and without MoE router replay.

Three parts (all on the tiny Qwen3-MoE-shaped model, configs/tiny.py):

1. training   two short CPT runs (c2jax.train.loop.run_training on the stdlib corpus) with
              bf16 compute and the dropless grouped MoE path: model.quant="none" vs "mxfp8"
              (MXFP8 expert matmuls forward, straight-through MXFP8 backward). Report: the
              per-step train-loss gap and the final held-out loss of each run.
2. invariance NVFP4 with an FP32 scale per token (the report's variant) vs per tensor:
              (a) the quantizers alone: a sequence's dequantized activations when quantized alone
                  vs inside a batch whose other rows have larger activations, and a prefix
                  quantized alone vs inside the full sequence (does a future token change
                  the past?);
              (b) a quantized MoE forward of the whole model: logits of a sequence run alone vs
                  batched with other sequences, and a prefix's logits vs the same positions in
                  the full sequence. The per-tensor variant swaps the model's expert matmul for
                  one that quantizes the gmm input with a single FP32 scale (everything else,
                  including the per-channel weight quantization, is the same).
3. mismatch   the sampler (c2jax.sampling.generate, KV-cached decode, records expert ids) and
              the learner (full forward, c2jax.models.forward) score the same sampled tokens;
              |logp_learner - logp_sampler| over generated tokens, mean and p99, without replay,
              with replay (forced_expert_ids = the sampler's recorded experts) and with replay
              plus the plausibility threshold (model.replay_threshold). Sampler variants: BF16
              weights and compute (inference engine) vs an FP32 learner; and a one-step-stale
              FP32 sampler (weights perturbed by one Adam-sized step, lr 1e-4 on every weight).
              Part "mismatch" uses the params of part 1's BF16 run when it exists (a trained
              router), else a random init; part "mismatch_random" always uses a random init
              (near-uniform router scores: many near-ties, so routing flips are common).

Run (from the repository root):
    JAX_PLATFORMS=cpu .venv/bin/python experiments/numerics.py [--parts training,invariance,mismatch,mismatch_random]
        [--train-steps 60] [--seed 0] [--out experiments/results/numerics] [--workdir runs/numerics]
Writes OUT/{numerics.png, table.md, results.json}; parts not run keep their results from an
earlier OUT/results.json. The training runs are reused from WORKDIR when they have finished.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "experiments"))

import c2jax.sections  # noqa: E402,F401  (the data / eval / rl config sections)
from c2jax.config import load_config  # noqa: E402

TINY = os.path.join(ROOT, "configs", "tiny.py")


def tiny_cfg(overrides=()):
    return load_config(TINY, list(overrides))


# ----------------------------------------------------------------------------- part 1: training

def run_training_variant(name, workdir, steps, seed, quant):
    from c2jax.train.loop import run_training
    out = os.path.join(workdir, name)
    cfg = tiny_cfg([f"--config.model.quant={quant}", "--config.model.dtype=bfloat16",
                    "--config.model.moe_dispatch=dropless", f"--config.train.steps={steps}",
                    "--config.train.log_every=1", "--config.train.eval_every=0",
                    f"--config.train.checkpoint_every={steps}", f"--config.seed={seed}",
                    "--config.train.batch_size=8", "--config.train.seq_len=128"])
    done = os.path.join(out, "summary.json")
    t0 = time.time()
    if not os.path.exists(done):
        run_training(cfg, out)
    with open(done) as f:
        summary = json.load(f)
    losses = {}
    with open(os.path.join(out, "metrics.jsonl")) as f:
        for line in f:
            rec = json.loads(line)
            if "loss" in rec:
                losses[int(rec["step"])] = float(rec["loss"])
    return {"name": name, "quant": quant, "dir": out, "wall_s": time.time() - t0, "losses": losses,
            "final_heldout_loss": summary["final_eval"].get("heldout_loss"),
            "final_codebase_loss": summary["final_eval"].get("codebase_loss")}


def part_training(workdir, steps, seed):
    runs = [run_training_variant("bf16", workdir, steps, seed, "none"),
            run_training_variant("mxfp8", workdir, steps, seed, "mxfp8")]
    a, b = runs
    common = sorted(set(a["losses"]) & set(b["losses"]))
    gap = np.array([b["losses"][s] - a["losses"][s] for s in common])
    la = np.array([a["losses"][s] for s in common])
    tail = slice(len(common) // 2, None)
    res = {"runs": runs, "steps": common,
           "gap_mean_all": float(gap.mean()), "gap_abs_max": float(np.abs(gap).max()),
           "gap_mean_second_half": float(gap[tail].mean()),
           "rel_gap_second_half": float((gap[tail] / la[tail]).mean()),
           "loss_drop_bf16": float(la[0] - la[-1]),
           # step-to-step noise of the bf16 curve in its second half, for scale
           "bf16_step_noise_second_half": float(np.std(np.diff(la[tail])) / np.sqrt(2))}
    return res


# ----------------------------------------------------------------------------- part 2: invariance

def fake_nvfp4(x, per_token):
    from pallas_kernels.quant import dequantize_nvfp4, quantize_nvfp4
    v, b, t = quantize_nvfp4(x, per_token=per_token)
    return dequantize_nvfp4(v, b, t)


def quantizer_invariance(seed):
    rng = np.random.default_rng(seed)
    L, D = 64, 128
    x = rng.standard_normal((L, D)).astype(np.float32)
    rows = []
    for per_token in (True, False):
        alone = np.asarray(fake_nvfp4(jnp.asarray(x), per_token))
        for scale in (1.0, 4.0, 16.0, 64.0):
            mate = (scale * rng.standard_normal((3 * L, D))).astype(np.float32)
            batched = np.asarray(fake_nvfp4(jnp.asarray(np.concatenate([x, mate])), per_token))[:L]
            d = np.abs(batched - alone)
            rows.append({"variant": "per-token" if per_token else "per-tensor", "test": f"batch mates x{scale:g}",
                         "max_abs_diff": float(d.max()), "frac_values_changed": float((d > 0).mean()),
                         "rel_err_vs_alone": float(np.linalg.norm(batched - alone) / np.linalg.norm(alone))})
        # future leakage: one late token carries an activation spike (x 30)
        xs = x.copy()
        xs[L - 1] *= 30.0
        full = np.asarray(fake_nvfp4(jnp.asarray(xs), per_token))
        t = L // 2
        prefix = np.asarray(fake_nvfp4(jnp.asarray(xs[:t]), per_token))
        d = np.abs(full[:t] - prefix)
        rows.append({"variant": "per-token" if per_token else "per-tensor",
                     "test": f"prefix [:{t}] alone vs in full seq (spike at {L - 1})",
                     "max_abs_diff": float(d.max()), "frac_values_changed": float((d > 0).mean()),
                     "rel_err_vs_alone": float(np.linalg.norm(full[:t] - prefix) / np.linalg.norm(prefix))})
    return rows


def _per_tensor_gmm_factory(per_token):
    """The model's expert matmul with NVFP4 inputs quantized per token or per tensor; weights
    quantized per expert and output channel (blocks along K) in both cases."""
    def factory(quant):
        def gmm(lhs, rhs, gs):
            lq = fake_nvfp4(lhs.astype(jnp.float32), per_token)
            wq = jnp.swapaxes(fake_nvfp4(jnp.swapaxes(rhs.astype(jnp.float32), 1, 2), True), 1, 2)
            return jax.lax.ragged_dot(lq, wq, gs.astype(jnp.int32), preferred_element_type=jnp.float32
                                      ).astype(lhs.dtype)
        return gmm
    return factory


def moe_layer_invariance(seed):
    """One MoE block (c2jax.models.moe.MoE, random init) on fixed input activations: a sequence's
    output alone vs in a batch whose other rows are larger (bit-identical inputs, so only the
    MoE block itself can break invariance)."""
    from c2jax.models import moe as moe_mod
    from c2jax.models.transformer import model_cfg
    rng = np.random.default_rng(seed + 3)
    L, rows, orig = 48, [], moe_mod._ragged_gmm
    variants = [("f32, no quant", "none", None), ("NVFP4 per-token (library gmm)", "nvfp4", None),
                ("NVFP4 per-token (this script's gmm)", "nvfp4", _per_tensor_gmm_factory(True)),
                ("NVFP4 per-tensor", "nvfp4", _per_tensor_gmm_factory(False))]
    D = tiny_cfg().model.hidden_size
    x = jnp.asarray(rng.standard_normal((1, L, D)).astype(np.float32))
    mates = jnp.asarray(4.0 * rng.standard_normal((3, L, D)).astype(np.float32))
    params = None
    for name, quant, factory in variants:
        m = model_cfg(tiny_cfg(["--config.model.moe_dispatch=dropless", f"--config.model.quant={quant}"]))
        if params is None:
            params = moe_mod.MoE(m).init(jax.random.key(seed), x)
        try:
            if factory is not None:
                moe_mod._ragged_gmm = factory
            f = jax.jit(lambda p, xx, m=m: moe_mod.MoE(m).apply(p, xx)[0])
            alone = np.asarray(f(params, x))[0]
            batched = np.asarray(f(params, jnp.concatenate([x, mates])))[0]
            t = L // 2
            prefix = np.asarray(f(params, x[:, :t]))[0]
            db, dp = np.abs(batched - alone), np.abs(alone[:t] - prefix)
            scale = float(np.sqrt(np.mean(alone ** 2)))
            rows.append({"variant": name, "batch_max_abs_diff": float(db.max()),
                         "batch_rel_err": float(np.linalg.norm(db) / np.linalg.norm(alone)),
                         "batch_rows_changed": float((db.max(-1) > 0).mean()),
                         "prefix_max_abs_diff": float(dp.max()),
                         "prefix_rows_changed": float((dp.max(-1) > 0).mean()), "output_rms": scale})
        finally:
            moe_mod._ragged_gmm = orig
    return rows


def model_invariance(seed, params=None):
    from c2jax.models import forward, init_params
    from c2jax.models import moe as moe_mod
    base = tiny_cfg(["--config.model.moe_dispatch=dropless"])
    if params is None:
        params = init_params(base, jax.random.key(seed))
    rng = np.random.default_rng(seed + 7)
    V, L = base.model.vocab_size, 48
    seq = rng.integers(0, V, (1, L)).astype(np.int32)
    mates = rng.integers(0, V, (3, L)).astype(np.int32)
    variants = [("f32, no quant", "none", None), ("NVFP4 per-token (library gmm)", "nvfp4", None),
                ("NVFP4 per-token (this script's gmm)", "nvfp4", _per_tensor_gmm_factory(True)),
                ("NVFP4 per-tensor", "nvfp4", _per_tensor_gmm_factory(False))]
    rows = []
    orig = moe_mod._ragged_gmm
    for name, quant, factory in variants:
        cfg = tiny_cfg(["--config.model.moe_dispatch=dropless", f"--config.model.quant={quant}"])
        try:
            if factory is not None:
                moe_mod._ragged_gmm = factory
            f = jax.jit(lambda p, t, cfg=cfg: jax.nn.log_softmax(forward(cfg, p, t), -1))
            alone = np.asarray(f(params, seq))[0]
            batched = np.asarray(f(params, np.concatenate([seq, mates])))[0]
            t = L // 2
            prefix = np.asarray(f(params, seq[:, :t]))[0]
            d_batch = np.abs(batched - alone)
            d_prefix = np.abs(alone[:t] - prefix)
            rows.append({"variant": name, "batch_max_abs_dlogp": float(d_batch.max()),
                         "batch_mean_abs_dlogp": float(d_batch.mean()),
                         "batch_positions_changed": float((d_batch.max(-1) > 0).mean()),
                         "prefix_max_abs_dlogp": float(d_prefix.max()),
                         "prefix_positions_changed": float((d_prefix.max(-1) > 0).mean())})
        finally:
            moe_mod._ragged_gmm = orig
    return rows


# ----------------------------------------------------------------------------- part 3: mismatch

def _p99(x):
    return float(np.percentile(x, 99)) if len(x) else float("nan")


def mismatch(seed, params, n_prompts=8, n=4, new_tokens=48):
    from c2jax.models import forward
    from c2jax.sampling import generate
    cfg32 = tiny_cfg(["--config.model.moe_dispatch=dropless"])
    V = cfg32.model.vocab_size
    rng = np.random.default_rng(seed + 11)
    prompts = [rng.integers(0, V, 16).tolist() for _ in range(n_prompts)]
    cast = lambda tree, dt: jax.tree.map(lambda a: a.astype(dt), tree)  # noqa: E731
    noise_key = jax.random.key(seed + 13)
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(noise_key, len(leaves))
    stale = jax.tree.unflatten(treedef, [a + 1e-4 * jnp.sign(jax.random.normal(k, a.shape))
                                         for a, k in zip(leaves, keys)])
    samplers = {
        "bf16 sampler vs f32 learner": (tiny_cfg(["--config.model.moe_dispatch=dropless",
                                                  "--config.model.dtype=bfloat16"]), cast(params, jnp.bfloat16)),
        "one-step-stale f32 sampler": (cfg32, stale),
        "same f32 weights (decode vs full forward)": (cfg32, params),
    }
    thr_cfg = tiny_cfg(["--config.model.moe_dispatch=dropless", "--config.model.replay_threshold=0.5"])
    score = {name: jax.jit(lambda p, t, f, c=c: jax.nn.log_softmax(
        forward(c, p, t, forced_expert_ids=f, return_aux=True).logits, -1))
        for name, c in (("plain", cfg32), ("thr", thr_cfg))}
    own = jax.jit(lambda p, t: forward(cfg32, p, t, return_aux=True).aux["expert_ids"])
    score_noreplay = jax.jit(lambda p, t: jax.nn.log_softmax(forward(cfg32, p, t), -1))
    rows = []
    for sname, (scfg, sparams) in samplers.items():
        out = generate(scfg, sparams, prompts, max_new_tokens=new_tokens, temperature=1.0, n=n, seed=seed)
        d = {"no replay": [], "router replay": [], "replay + threshold 0.5": []}
        agree = []
        for i, p in enumerate(prompts):
            for j in range(n):
                toks = list(out.tokens[i][j])
                beh = np.asarray(out.raw_logprobs[i][j], np.float32)
                ex = out.expert_ids[i][j]
                G = len(toks)
                if G < 2:
                    continue
                full = np.asarray(p + toks, np.int32)
                inp = full[:-1][None]
                Lin = inp.shape[1]
                tgt = full[1:]
                pos = np.arange(len(p) - 1, Lin)  # positions predicting the generated tokens
                own_ids = np.asarray(own(params, inp))  # [N, 1, L, K]
                forced = own_ids.copy()
                exn = np.asarray(ex)[:Lin]  # [L, N, K]
                rec = np.all(exn >= 0, axis=-1)  # [L, N]
                fr = np.transpose(exn, (1, 0, 2))[:, None]  # [N, 1, L, K]
                forced = np.where(np.transpose(rec, (1, 0))[:, None, :, None], fr, own_ids).astype(np.int32)
                same = np.all(np.sort(own_ids, -1) == np.sort(forced, -1), -1)[:, 0, pos]
                agree.append(same.mean())
                for key, lp in (("no replay", score_noreplay(params, inp)),
                                ("router replay", score["plain"](params, inp, forced)),
                                ("replay + threshold 0.5", score["thr"](params, inp, forced))):
                    lp = np.asarray(lp)[0]
                    learner = lp[pos, tgt[pos]]
                    d[key].append(np.abs(learner - beh[: len(pos)]))
        for key, v in d.items():
            v = np.concatenate(v)
            rows.append({"sampler": sname, "learner": key, "tokens": int(v.size), "mean_abs": float(v.mean()),
                         "p99_abs": _p99(v), "max_abs": float(v.max()),
                         "route_agreement": float(np.mean(agree))})
    return rows


# ----------------------------------------------------------------------------- report

def _md_table(rows, cols):
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        out.append("| " + " | ".join(f"{r[c]:.4g}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |")
    return "\n".join(out)


def write_report(res, out):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = [k for k in ("training", "invariance", "mismatch", "mismatch_random") if k in res]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.2), squeeze=False)
    lines = ["# Numerics: MXFP8 vs BF16, per-token vs per-tensor NVFP4, router replay", ""]
    for ax, key in zip(axes[0], panels):
        if key == "training":
            tr = res["training"]
            for r in tr["runs"]:
                s = sorted(r["losses"])
                ax.plot(s, [r["losses"][i] for i in s], label=f"{r['name']} (final held-out {r['final_heldout_loss']:.3f})")
            ax.set(xlabel="step", ylabel="train loss", title="tiny MoE CPT: MXFP8 experts vs BF16")
            ax.legend(fontsize=8)
            lines += ["## MXFP8 vs BF16 training loss", "",
                      "| run | quant | final held-out loss | final codebase loss | last train loss |",
                      "|---|---|---|---|---|"]
            for r in tr["runs"]:
                last = r["losses"][max(r["losses"])]
                lines.append(f"| {r['name']} | {r['quant']} | {r['final_heldout_loss']:.4f} | "
                             f"{r['final_codebase_loss']:.4f} | {last:.4f} |")
            lines += ["", f"Train-loss gap (mxfp8 - bf16), {len(tr['steps'])} steps: mean {tr['gap_mean_all']:+.4f}, "
                      f"second half mean {tr['gap_mean_second_half']:+.4f} ({100 * tr['rel_gap_second_half']:+.2f}% "
                      f"relative), max |gap| {tr['gap_abs_max']:.4f}; for scale: the BF16 loss fell by "
                      f"{tr['loss_drop_bf16']:.3f} over the run and its per-step noise in the second half is "
                      f"~{tr['bf16_step_noise_second_half']:.4f}.", ""]
        elif key == "invariance":
            inv = res["invariance"]
            q = [r for r in inv["quantizer"] if r["test"].startswith("batch")]
            for v, c in (("per-token", "C0"), ("per-tensor", "C3")):
                rr = [r for r in q if r["variant"] == v]
                ax.plot([float(r["test"].split("x")[-1]) for r in rr], [max(r["rel_err_vs_alone"], 1e-9) for r in rr],
                        "o-", color=c, label=f"NVFP4 {v}")
            ax.set(xscale="log", yscale="log", xlabel="batch mates' activation scale",
                   ylabel="rel. change of a row's dequantized values", title="NVFP4 batch invariance (1e-9 = exact)")
            ax.legend(fontsize=8)
            lines += ["## NVFP4 batch invariance: quantizers", "",
                      _md_table(inv["quantizer"], ["variant", "test", "max_abs_diff", "frac_values_changed",
                                                   "rel_err_vs_alone"]), "",
                      "## NVFP4 batch invariance: one MoE block (bit-identical inputs)", "",
                      "A sequence of 48 tokens alone vs in a batch with 3 sequences of 4x larger activations; "
                      "'prefix' = its first 24 rows alone vs in the full sequence.", "",
                      _md_table(inv["moe_layer"], ["variant", "batch_max_abs_diff", "batch_rel_err",
                                                   "batch_rows_changed", "prefix_max_abs_diff",
                                                   "prefix_rows_changed", "output_rms"]), "",
                      "## NVFP4 batch invariance: whole-model quantized MoE forward (log-probs of one sequence)", "",
                      f"Params: {inv['params']}. 'batch' = the sequence alone vs in a batch of 4 random sequences; "
                      "'prefix' = the first half alone vs the same positions of the full sequence.", "",
                      _md_table(inv["model"], ["variant", "batch_max_abs_dlogp", "batch_mean_abs_dlogp",
                                               "batch_positions_changed", "prefix_max_abs_dlogp",
                                               "prefix_positions_changed"]), ""]
        else:
            mm = res[key]
            samplers = list(dict.fromkeys(r["sampler"] for r in mm["rows"]))
            learners = list(dict.fromkeys(r["learner"] for r in mm["rows"]))
            w = 0.8 / len(learners)
            for j, lname in enumerate(learners):
                vals = [next(r for r in mm["rows"] if r["sampler"] == s and r["learner"] == lname) for s in samplers]
                ax.bar(np.arange(len(samplers)) + j * w, [v["mean_abs"] for v in vals], w, label=f"{lname} mean",
                       color=f"C{j}")
                ax.plot(np.arange(len(samplers)) + j * w, [v["p99_abs"] for v in vals], "k^", ms=5)
            ax.set_xticks(np.arange(len(samplers)) + 0.4 - w / 2, [s.replace(" vs ", "\nvs ").replace(" (", "\n(")
                                                                   for s in samplers], fontsize=7)
            ax.set(yscale="log", ylabel="|logp learner - logp sampler| (bars mean, ^ p99)",
                   title=f"logprob mismatch, router replay\n({mm['params']})")
            ax.legend(fontsize=7)
            lines += [f"## Logprob mismatch with and without router replay ({mm['params']})", "",
                      f"Params: {mm['params']}. {mm['n_prompts']} prompts x {mm['n']} samples x up to "
                      f"{mm['new_tokens']} tokens, temperature 1. route_agreement = fraction of (token, layer) "
                      "where the learner's own top-k equals the sampler's recorded experts.", "",
                      _md_table(mm["rows"], ["sampler", "learner", "tokens", "mean_abs", "p99_abs", "max_abs",
                                             "route_agreement"]), ""]
    fig.tight_layout()
    fig.savefig(os.path.join(out, "numerics.png"), dpi=110)
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="training,invariance,mismatch,mismatch_random")
    ap.add_argument("--train-steps", type=int, default=60)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(ROOT, "experiments", "results", "numerics"))
    ap.add_argument("--workdir", default=os.path.join("runs", "numerics"))
    args = ap.parse_args(argv)
    from absl import flags
    flags.FLAGS.mark_as_parsed()
    os.makedirs(args.out, exist_ok=True)
    parts = args.parts.split(",")
    rpath = os.path.join(args.out, "results.json")
    res = {}
    if os.path.exists(rpath):
        with open(rpath) as f:
            res = json.load(f)
    res["meta"] = {"seed": args.seed, "train_steps": args.train_steps, "jax": jax.__version__,
                   "backend": jax.default_backend()}

    def save():
        with open(rpath, "w") as f:
            json.dump(res, f, indent=1, default=float)

    if "training" in parts:
        t0 = time.time()
        res["training"] = part_training(args.workdir, args.train_steps, args.seed)
        print(f"training part: {time.time() - t0:.0f} s", flush=True)
        save()
    trained = None
    bf16_dir = os.path.join(args.workdir, "bf16")
    if os.path.exists(os.path.join(bf16_dir, "summary.json")):
        from c2jax.train.loop import load_run_params
        trained = load_run_params(bf16_dir, tiny_cfg())
        trained = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), trained)
    pdesc = (f"trained tiny model ({bf16_dir}, {args.train_steps} CPT steps)" if trained is not None
             else f"random init (seed {args.seed})")
    if "invariance" in parts:
        t0 = time.time()
        res["invariance"] = {"quantizer": quantizer_invariance(args.seed), "moe_layer": moe_layer_invariance(args.seed),
                             "model": model_invariance(args.seed, trained), "params": pdesc}
        print(f"invariance part: {time.time() - t0:.0f} s", flush=True)
        save()
    if "mismatch" in parts:
        t0 = time.time()
        from c2jax.models import init_params
        p = trained if trained is not None else init_params(tiny_cfg(), jax.random.key(args.seed))
        res["mismatch"] = {"rows": mismatch(args.seed, p), "params": pdesc, "n_prompts": 8, "n": 4,
                           "new_tokens": 48}
        print(f"mismatch part: {time.time() - t0:.0f} s", flush=True)
        save()
    if "mismatch_random" in parts:  # near-uniform router of a random init: many near-ties, routing flips
        t0 = time.time()
        from c2jax.models import init_params
        p = init_params(tiny_cfg(), jax.random.key(args.seed))
        res["mismatch_random"] = {"rows": mismatch(args.seed, p), "params": f"random init (seed {args.seed})",
                                  "n_prompts": 8, "n": 4, "new_tokens": 48}
        print(f"mismatch_random part: {time.time() - t0:.0f} s", flush=True)
        save()
    # json round trip turns int step keys into strings
    if "training" in res:
        for r in res["training"]["runs"]:
            r["losses"] = {int(k): v for k, v in r["losses"].items()}
    write_report(res, args.out)


if __name__ == "__main__":
    main()
