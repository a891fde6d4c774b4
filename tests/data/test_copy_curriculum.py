"""Copy-curriculum records: the loss mask covers exactly what can only be copied, and the recall
answers hold the module values."""
import random
import re

import pytest

from c2jax.data import copy_curriculum as cc
from c2jax.data.tokenizer import train_tokenizer


def test_induction_record_masks_exactly_the_repeat():
    rng = random.Random(3)
    for _ in range(50):
        r = cc.induction_record(rng, 16, 1024)
        toks, mask = r["tokens"], r["loss_mask"]
        assert len(toks) == len(mask) and all(16 <= t < 1024 for t in toks)
        k = sum(mask) + 1                                  # run length
        assert toks[:k] == toks[-k:]                       # the run is repeated at the end
        assert mask == [0] * (len(toks) - k + 1) + [1] * (k - 1)
    with pytest.raises(ValueError, match="vocab_lo"):
        cc.induction_record(rng, 10, 10)


def test_induction_records_are_seeded():
    a = list(cc.induction_records(5, 7, 16, 100))
    assert a == list(cc.induction_records(5, 7, 16, 100)) and a != list(cc.induction_records(5, 8, 16, 100))


def test_recall_record_answers_copy_the_modules(tmp_path):
    tok = train_tokenizer(["files: a.py\nLEGACY_X = 12\nread: x\nfound: LEGACY_X=12\n" * 50], vocab_size=300)
    rng = random.Random(0)
    for i in range(10):
        r = cc.recall_record(rng, tok, verbatim=i % 2 == 1)
        text = tok.decode(r["tokens"])
        answer = tok.decode([t for t, m in zip(r["tokens"], r["loss_mask"]) if m])
        assert answer.startswith("read: ") and "found:" in answer
        context = text[: len(text) - len(answer)]
        # every fact is in the context exactly as its module defines it, and in the answer
        for name, value in r["facts"].items():
            assert re.search(rf"^{name} = {value}$", context, re.M)
            assert (f"\n{name} = {value}\n" if i % 2 else f"{name}={value}") in answer
        assert sorted(re.findall(r"LEGACY_[A-Z]+", answer)) == sorted(r["facts"])
    path = tmp_path / "r.jsonl"
    assert cc.write_records(str(path), cc.recall_records(3, 1, tok)) == 3


def test_copyable_token_range_skips_special_tokens():
    from c2jax import special_tokens
    tok = train_tokenizer(["def f(x):\n    return x + 1\n" * 50], vocab_size=300)
    lo, hi = cc.copyable_token_range(tok)
    assert hi == tok.vocab_size and max(tok.token_id(t) for t in special_tokens.ALL) == lo - 1
    assert all(lo <= t < hi for r in cc.induction_records(20, 0, lo, hi) for t in r["tokens"])
