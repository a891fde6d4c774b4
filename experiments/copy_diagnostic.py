"""Can a trained run copy from its context? Per-token loss on the loss-masked tokens of an SFT JSONL
(tokens + loss_mask records: SFT transcripts, c2jax.data.copy_curriculum records), split by what
the target token is: digits (copied values: ~ln 10 = 2.30 nats means the model guesses), letters
(names, words), other (punctuation, format). Prints each class's mean nll and the hardest tokens.

Run: JAX_PLATFORMS=cpu python experiments/copy_diagnostic.py RUN_DIR RECORDS.jsonl [--n 20] [--top 8]
"""
from __future__ import annotations

import argparse
import collections
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
    from c2jax.data.pipeline import read_chats_jsonl
    from c2jax.data.tokenizer import Tokenizer
    from c2jax.models.transformer import forward
    import c2jax.sections  # noqa: F401  (the data / eval / rl config sections)
    from c2jax.train.loop import load_run_config, load_run_params
    from c2jax.train.step import token_nll
    cfg = load_run_config(args.run)
    tok = Tokenizer.load(args.run)
    params = load_run_params(args.run, cfg)
    # nll_BL[:, t] is the loss of token t+1; rows are padded to a multiple of 256 (one compile per bucket)
    nll_fn = jax.jit(lambda p, t: token_nll(forward(cfg, p, t[:, :-1]), t[:, 1:])[0])
    records = [r for r in read_chats_jsonl(args.records) if isinstance(r, tuple)][:args.n]
    if not records:
        ap.error(f"{args.records}: no token + loss_mask records")
    by_class = collections.defaultdict(list)
    for ids, mask in records:
        tokens_T, mask_T = np.asarray(ids, np.int32), np.asarray(mask, bool)
        T = len(tokens_T)
        padded_T = np.full(-(-T // 256) * 256 + 1, tok.pad_id, np.int32)
        padded_T[:T] = tokens_T
        nll_T = np.asarray(nll_fn(params, padded_T[None]))[0, :T - 1]
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
