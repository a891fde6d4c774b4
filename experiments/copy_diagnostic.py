"""Can a trained run copy from its context? Per-token loss on the loss-masked tokens of an SFT JSONL
(tokens + loss_mask records: SFT transcripts, c2jax.data.copy_curriculum records), split by what
the target token is: digits (copied values: ~ln 10 = 2.30 nats means the model guesses), letters
(names, words), other (punctuation, format). Prints each class's mean nll and the hardest tokens.

Run: JAX_PLATFORMS=cpu python experiments/copy_diagnostic.py RUN_DIR RECORDS.jsonl [--n 20] [--top 8]
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402


def token_class(text: str) -> str:
    """'digit' if the token holds a digit, 'alpha' if it is letters (spaces aside), else 'other'."""
    if any(c.isdigit() for c in text):
        return "digit"
    return "alpha" if text.strip().isalpha() else "other"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run")
    ap.add_argument("records")
    ap.add_argument("--n", type=int, default=20, help="records to score (from the top of the file)")
    ap.add_argument("--top", type=int, default=8, help="hardest tokens to print per record (0: none)")
    args = ap.parse_args(argv)
    import jax
    from c2jax.data.tokenizer import Tokenizer
    from c2jax.models.transformer import forward
    from c2jax.train.loop import load_run_config, load_run_params
    cfg = load_run_config(args.run)
    tok = Tokenizer.load(args.run)
    params = load_run_params(args.run, cfg)
    fwd = jax.jit(lambda p, t: jax.nn.log_softmax(forward(cfg, p, t), axis=-1))
    by_class = collections.defaultdict(list)
    with open(args.records) as f:
        for _, line in zip(range(args.n), f):
            rec = json.loads(line)
            tokens_T = np.asarray(rec["tokens"], np.int32)
            mask_T = np.asarray(rec["loss_mask"], bool)
            logp_TV = np.asarray(fwd(params, tokens_T[None]))[0]
            nll_T = -logp_TV[np.arange(len(tokens_T) - 1), tokens_T[1:]]       # nll of token t+1
            rows = []
            for i in np.nonzero(mask_T[1:])[0] + 1:
                piece = tok.decode([int(tokens_T[i])])
                by_class[token_class(piece)].append(float(nll_T[i - 1]))
                rows.append((float(nll_T[i - 1]), tok.decode([int(t) for t in tokens_T[max(0, i - 6):i]]), piece))
            if args.top:
                print(f"--- {len(rows)} loss tokens; hardest:")
                for nll, ctx, piece in sorted(rows, reverse=True)[:args.top]:
                    print(f"  {nll:6.2f}  {ctx!r} -> {piece!r}")
    print("\n| token class | tokens | mean nll (nats) | share > 1 nat |\n|---|---|---|---|")
    for name in ("digit", "alpha", "other"):
        v = np.asarray(by_class.get(name, []))
        if len(v):
            print(f"| {name} | {len(v)} | {v.mean():.2f} | {np.mean(v > 1):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
