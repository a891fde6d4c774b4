"""Copy curriculum: synthetic token+loss_mask records (the SFT JSONL format of
`c2jax.pipeline.write_oracle_transcripts`) that teach a small model to copy from its context.

Why: the tiny model SFT'd on long-horizon transcripts writes the right tool-call and summary
format but predicts every copied digit at ~log(10) nats: it never formed an induction circuit
(attend to the earlier occurrence of the current token, predict what followed it), so it cannot
carry a value it read into a summary or into registry.py. Random-token repeats form that circuit
in a sharp phase change after ~1-2k steps; recall records then bind it to the task's own shape.

- `induction_record`: a random token run, an optional random gap, the same run again; loss on
  the repeat (every token after its first is predictable only by copying).
- `recall_record`: `files: a.py b.py ...` then long_horizon-style module sources with procedural
  names (so names cannot be memorized), then `read: ...` / `found: LEGACY_A=v, ...` in a shuffled
  order; loss on the read/found lines only.
"""
from __future__ import annotations

import random

_CONSONANTS, _VOWELS = "bcdfghklmnprstvz", "aeiou"


def procedural_name(rng: random.Random) -> str:
    """A pronounceable lowercase identifier of 4-7 letters (e.g. 'kazob', 'lenava')."""
    return "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(rng.randint(2, 3))) + \
        rng.choice(["", "n", "r", "x"])


def induction_record(rng: random.Random, vocab_lo: int, vocab_hi: int, min_len: int = 8, max_len: int = 60,
                     max_gap: int = 60) -> dict:
    """{"tokens", "loss_mask"}: run + gap + run, tokens in [vocab_lo, vocab_hi); loss on the repeat's
    tokens after its first (the first is not predictable)."""
    if not 0 <= vocab_lo < vocab_hi:
        raise ValueError(f"induction_record: need 0 <= vocab_lo < vocab_hi, got {vocab_lo}, {vocab_hi}")
    k = rng.randint(min_len, max_len)
    run = [rng.randrange(vocab_lo, vocab_hi) for _ in range(k)]
    gap = [rng.randrange(vocab_lo, vocab_hi) for _ in range(rng.randint(0, max_gap))]
    tokens = run + gap + run
    return {"tokens": tokens, "loss_mask": [0] * (k + len(gap) + 1) + [1] * (k - 1)}


def recall_record(rng: random.Random, tokenizer, min_files: int = 2, max_files: int = 5,
                  file_chars=(150, 200, 250), verbatim: bool = False) -> dict:
    """{"tokens", "loss_mask", "facts"}: module sources to read, then the lines that copy from them:
    `found: LEGACY_A=v, ...` (the summaries' format), or with verbatim=True the source lines
    themselves (`LEGACY_A = v`, one per line: the same tokens as where they were read)."""
    from c2jax.tasks.long_horizon import module_source
    names = sorted({procedural_name(rng) for _ in range(rng.randint(min_files, max_files))})
    facts = {n: rng.randint(10, 999) for n in names}
    context = "files: " + " ".join(f"{n}.py" for n in names) + "\n"
    for n in names:
        context += f"# settings/{n}.py\n" + module_source(rng, n, facts[n], rng.choice(file_chars))
    order = list(names)
    rng.shuffle(order)
    if verbatim:
        found = "\n" + "".join(f"LEGACY_{n.upper()} = {facts[n]}\n" for n in order)
    else:
        found = " " + ", ".join(f"LEGACY_{n.upper()}={facts[n]}" for n in order) + "\n"
    answer = "read: " + " ".join(names) + "\nfound:" + found
    ctx_ids, ans_ids = tokenizer.encode(context), tokenizer.encode(answer)
    return {"tokens": ctx_ids + ans_ids, "loss_mask": [0] * len(ctx_ids) + [1] * len(ans_ids),
            "facts": {f"LEGACY_{n.upper()}": v for n, v in facts.items()}}


def write_records(path: str, records) -> int:
    """Write records as JSONL (only tokens and loss_mask); returns the count."""
    from c2jax.data.pipeline import token_record
    n = 0
    with open(path, "w") as f:
        for r in records:
            f.write(token_record(r["tokens"], r["loss_mask"]))
            n += 1
    return n


def copyable_token_range(tokenizer) -> tuple[int, int]:
    """[lo, hi) of the tokenizer's ids that are not c2jax special tokens (specials come first)."""
    from c2jax import special_tokens
    return len(special_tokens.ALL), tokenizer.vocab_size


def induction_records(n: int, seed: int, vocab_lo: int, vocab_hi: int):
    """n induction records from one seeded stream."""
    rng = random.Random(seed)
    return (induction_record(rng, vocab_lo, vocab_hi) for _ in range(n))


def recall_records(n: int, seed: int, tokenizer, verbatim: bool = False):
    """n recall records from one seeded stream."""
    rng = random.Random(seed)
    return (recall_record(rng, tokenizer, verbatim=verbatim) for _ in range(n))


def main(argv=None) -> int:
    """CLI: write induction and/or recall records as SFT JSONL (see the module docstring)."""
    import argparse
    ap = argparse.ArgumentParser(description="Write copy-curriculum SFT records (tokens + loss_mask JSONL).")
    ap.add_argument("--out", required=True)
    ap.add_argument("--induction", type=int, default=0, help="number of induction records")
    ap.add_argument("--recall", type=int, default=0, help="number of recall records (needs --tokenizer)")
    ap.add_argument("--tokenizer", default=None, help="a run dir or tokenizer.json (recall records; vocab bound)")
    ap.add_argument("--vocab-size", type=int, default=None, help="induction tokens < this (default: the tokenizer's)")
    ap.add_argument("--verbatim", action="store_true", help="recall answers repeat the source lines as they are")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    from c2jax import special_tokens
    from c2jax.data.tokenizer import Tokenizer
    tok = Tokenizer.load(args.tokenizer) if args.tokenizer else None
    if args.recall and tok is None:
        ap.error("--recall needs --tokenizer")
    vocab = args.vocab_size or (copyable_token_range(tok)[1] if tok else None)
    if args.induction and not vocab:
        ap.error("--induction needs --vocab-size or --tokenizer")
    import itertools
    records = itertools.chain(induction_records(args.induction, args.seed, len(special_tokens.ALL), vocab)
                              if args.induction else (),
                              recall_records(args.recall, args.seed + 1, tok, args.verbatim) if args.recall else ())
    n = write_records(args.out, records)
    print(f"wrote {n} records to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
