"""Where did an RL run move the policy? Per-token NLL of the read-then-fix oracle's passing
held-out transcripts (synthetic:1) under a base run and an RL run, split by part of the answer:
the edit's "new" text, its "old" text (a copy from the file the model read), and the other
model tokens (tool-call JSON, "Done.", turn ends).

    python experiments/rl_drift.py --base runs/demo/sft --rl runs/demo/rl [--tasks 128]
"""
from __future__ import annotations

import argparse
import json

import jax
import numpy as np

from c2jax.data.tokenizer import Tokenizer
from c2jax.models.moe import make_dropless
from c2jax.pipeline import oracle_episodes
from c2jax.rl.learner import build_batch
from c2jax.train.loop import load_run_config, load_run_params
from c2jax.train.step import forward_nll

PARTS = ((1, "new text"), (2, "old text"), (0, "other"))


def part_ids(tokenizer, tokens_T) -> np.ndarray:
    """int[T-1]: for each predicted token (targets tokens_T[1:]), 1 inside the edit's "new"
    string, 2 inside its "old" string, 0 elsewhere."""
    out = np.zeros(len(tokens_T) - 1, np.int32)
    text = ""
    for j, t in enumerate(tokens_T[1:]):
        text += tokenizer.decode([t])
        tail = text[-400:]
        new, old, close = tail.rfind('"new": "'), tail.rfind('"old": "'), tail.rfind('"}}')
        if new > close and new > old:
            out[j] = 1
        elif old > close and old > new:
            out[j] = 2
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="run dir of the starting model (e.g. the SFT run)")
    ap.add_argument("--rl", required=True, help="run dir of the RL run")
    ap.add_argument("--tasks", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--temperature", type=float, default=0.7, help="the RL run's sampling temperature")
    args = ap.parse_args(argv)
    cfg = load_run_config(args.base)
    make_dropless(cfg.model)
    tok = Tokenizer.load(args.base)
    params = {"base": load_run_params(args.base, cfg), "rl": load_run_params(args.rl, load_run_config(args.rl))}
    trajs = [r.trajectory for r in oracle_episodes(tok, split="heldout", n_per_suite=args.tasks, seed=args.seed)
             if r.grade and r.grade.passed]
    batch = build_batch(trajs, np.zeros(len(trajs), np.float32), length_bucket=64)
    B = len(trajs)
    mask_BL = batch["loss_mask"]
    part_BL = np.zeros_like(batch["inputs"])
    for i, t in enumerate(trajs):
        ids = part_ids(tok, t.tokens_T.tolist())
        part_BL[i, :len(ids)] = ids

    @jax.jit
    def nll(p):
        return forward_nll(cfg, p, batch, scale=1.0 / args.temperature)[0]   # the learner's logprobs

    nll_BL = {k: np.asarray(nll(p)) for k, p in params.items()}
    report = {"episodes": B}
    for pid, name in PARTS:
        sel = mask_BL & (part_BL == pid)
        report[name] = {"tokens": int(sel.sum()),
                        **{f"nats_per_episode_{k}": float(v[sel].sum() / B) for k, v in nll_BL.items()}}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
