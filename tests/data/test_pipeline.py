import json

import numpy as np
import pytest

from c2jax import special_tokens
from c2jax.data import pipeline as P
from c2jax.data.corpus import build_corpus

L, B = 64, 4


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_tokenizer, files_factory):
    root = files_factory(str(tmp_path_factory.mktemp("src") / "repo"))
    cfg = {"corpus": {"sources": [{"kind": "dir", "path": root, "glob": "**/*.py"}], "heldout_fraction": 0.0},
           "codebase_package": "", "cache_dir": str(tmp_path_factory.mktemp("cache"))}
    corpus = build_corpus(P.corpus_spec_from_config(cfg))
    split = P.tokenize_split(corpus, "train", tiny_tokenizer, cfg["cache_dir"])
    return cfg, corpus, split


def _it(setup, tok, **kw):
    cfg, corpus, _ = setup
    kw = {"seq_len": L, "batch_size": B, "seed": 0, "shard_index": 0, "shard_count": 1, **kw}
    return P.make_train_iterator(cfg, tok, corpus=corpus, **kw)


def _epoch(it):
    return list(it)


def test_batch_format_and_packing_invariants(setup, tiny_tokenizer):
    batches = _epoch(_it(setup, tiny_tokenizer, num_epochs=1))
    eos = tiny_tokenizer.eos_id
    for b in batches:
        assert set(b) == set(P.BATCH_KEYS)
        for k in P.BATCH_KEYS:
            assert b[k].shape == (B, L)
        assert b["inputs"].dtype == np.int32 and b["loss_weights"].dtype == np.float32
        seg, pos, x, y, w = (b[k] for k in ("segment_ids", "positions", "inputs", "targets", "loss_weights"))
        for r in range(B):
            s = seg[r]
            assert s[0] in (0, 1)
            # segment ids are 1..n, non-decreasing, padding (0) only at the end
            nz = s[s > 0]
            assert np.all(np.diff(nz) >= 0) and np.all(np.diff(nz) <= 1)
            assert np.all(s[len(nz):] == 0)
            for t in range(L):
                if s[t] == 0:
                    assert w[r, t] == 0 and x[r, t] == tiny_tokenizer.pad_id
                    continue
                new_seg = t == 0 or s[t] != s[t - 1]
                assert pos[r, t] == (0 if new_seg else pos[r, t - 1] + 1)
                # within the row, the target is the next input of the same segment
                if t + 1 < L and s[t + 1] == s[t]:
                    assert y[r, t] == x[r, t + 1] and w[r, t] == 1
                # a segment that ends inside the row ends with EOS, unweighted
                if t + 1 < L and s[t + 1] != s[t]:
                    assert x[r, t] == eos and w[r, t] == 0
                if x[r, t] == eos:
                    assert w[r, t] == 0


def test_every_token_exactly_once_per_epoch(setup, tiny_tokenizer):
    _, corpus, split = setup
    stream = np.asarray(split.tokens(), np.int64)
    for epochs in (1, 2):
        batches = _epoch(_it(setup, tiny_tokenizer, num_epochs=epochs))
        x = np.concatenate([b["inputs"] for b in batches])
        seg = np.concatenate([b["segment_ids"] for b in batches])
        w = np.concatenate([b["loss_weights"] for b in batches])
        seen = x[seg > 0]
        assert len(seen) == epochs * split.num_tokens
        np.testing.assert_array_equal(np.bincount(seen, minlength=tiny_tokenizer.vocab_size),
                                      epochs * np.bincount(stream, minlength=tiny_tokenizer.vocab_size))
        # every token but a document's last (its EOS) is a weighted target once
        assert w.sum() == epochs * (split.num_tokens - split.num_docs)
        assert len(batches) == -(-epochs * -(-split.num_tokens // L) // B)
    # document texts come back intact: rows in index order, concatenated, equal the stream
    rows = P.PackedRows(split, L, tiny_tokenizer.pad_id)
    joined = np.concatenate([rows[i]["inputs"][rows[i]["segment_ids"] > 0] for i in range(len(rows))])
    np.testing.assert_array_equal(joined, stream)
    text = tiny_tokenizer.decode(joined.tolist())
    assert text == "".join(d.text + special_tokens.EOS for d in corpus.train)


def test_shuffle_deterministic_by_seed_and_reshuffled_per_epoch(setup, tiny_tokenizer):
    def first_inputs(seed, n=6):
        it = _it(setup, tiny_tokenizer, seed=seed)
        return np.stack([next(it)["inputs"] for _ in range(n)])

    np.testing.assert_array_equal(first_inputs(3), first_inputs(3))
    assert not np.array_equal(first_inputs(3), first_inputs(4))
    n_rows = len(P.PackedRows(setup[2], L, 0))
    b = np.concatenate([x["inputs"] for x in _epoch(_it(setup, tiny_tokenizer, batch_size=1, num_epochs=2))])
    assert not np.array_equal(b[:n_rows], b[n_rows:])  # epoch 2 has another order
    assert sorted(map(bytes, b[:n_rows])) == sorted(map(bytes, b[n_rows:]))  # of the same rows


def test_state_restores_same_next_batch(setup, tiny_tokenizer):
    it = _it(setup, tiny_tokenizer, seed=7)
    for _ in range(5):
        next(it)
    state = it.get_state()
    state = json.loads(json.dumps(state))  # survives a JSON round trip (orbax JsonSave)
    expected = [next(it) for _ in range(3)]
    fresh = _it(setup, tiny_tokenizer, seed=7)  # as after a restart: a new iterator
    fresh.set_state(state)
    for e in expected:
        got = next(fresh)
        for k in P.BATCH_KEYS:
            np.testing.assert_array_equal(got[k], e[k])
    it.set_state(state)  # and rewinding the same iterator
    np.testing.assert_array_equal(next(it)["inputs"], expected[0]["inputs"])


def test_sharding_disjoint_and_complete(setup, tiny_tokenizer):
    full = _epoch(_it(setup, tiny_tokenizer, num_epochs=1, seed=1))
    shards = [_epoch(_it(setup, tiny_tokenizer, num_epochs=1, seed=1, shard_index=p, shard_count=2))
              for p in range(2)]
    assert len(shards[0]) == len(shards[1]) == len(full)
    for k, fb in enumerate(full):
        assert shards[0][k]["inputs"].shape == (B // 2, L)
        # global batch k = the shards' k-th batches interleaved (process p holds global rows p, p+2, ..)
        glob = np.empty_like(fb["inputs"])
        glob[0::2], glob[1::2] = shards[0][k]["inputs"], shards[1][k]["inputs"]
        np.testing.assert_array_equal(glob, fb["inputs"])
    with pytest.raises(P.PipelineError, match="multiple"):
        _it(setup, tiny_tokenizer, batch_size=3, shard_count=2, shard_index=0)


def test_tokenization_is_cached(setup, tiny_tokenizer, monkeypatch):
    cfg, corpus, split = setup
    monkeypatch.setattr(type(tiny_tokenizer), "encode_batch",
                        lambda *a, **k: pytest.fail("re-tokenized a cached split"))
    again = P.tokenize_split(corpus, "train", tiny_tokenizer, cfg["cache_dir"])
    assert again == split


CHATS = [
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                  {"role": "assistant", "content": "hello"}, {"role": "tool", "content": "ok"},
                  {"role": "assistant", "content": "done"}]},
    {"messages": [{"role": "user", "content": "x = 1?"}, {"role": "assistant", "content": "yes"}]},
    {"messages": [{"role": "user", "content": "no answer"}]},
    {"messages": [{"role": "user", "content": "long " * 60}, {"role": "assistant", "content": "ok " * 30}]},
]


def test_render_chat_trains_only_assistant_tokens(tiny_tokenizer):
    tok = tiny_tokenizer
    ids, trained = P.render_chat(CHATS[0]["messages"], tok)
    text = tok.decode([i for i, t in zip(ids, trained) if t])
    end = special_tokens.END_TURN
    assert text == f"hello{end}done{end}"
    assert tok.decode(ids).startswith(f"{special_tokens.BOS}{special_tokens.SYSTEM}Be brief.{end}{special_tokens.USER}hi")


def test_sft_iterator(tmp_path, tiny_tokenizer):
    path = tmp_path / "chats.jsonl"
    path.write_text("\n".join(json.dumps(c) for c in CHATS * 5) + "\n")
    it = P.make_sft_iterator(str(path), tiny_tokenizer, seq_len=L, batch_size=2, seed=0, num_epochs=1,
                             shard_index=0, shard_count=1)
    batches = list(it)
    x = np.concatenate([b["inputs"] for b in batches])
    y = np.concatenate([b["targets"] for b in batches])
    w = np.concatenate([b["loss_weights"] for b in batches])
    seg = np.concatenate([b["segment_ids"] for b in batches])
    # chats 0 and 1 fit whole (5 copies each); chat 3 is truncated to L; chat 2 has nothing to learn
    assert (seg[:, 0] == 1).sum() >= 1
    learned = tiny_tokenizer.decode(y[w > 0].tolist())
    end = special_tokens.END_TURN
    assert learned.count(f"hello{end}done{end}") == 5 and learned.count(f"yes{end}") == 5
    asst = tiny_tokenizer.token_id(special_tokens.ASSISTANT)
    assert np.all(y[w > 0] != asst)
    for r in range(len(x)):  # positions restart per chat, targets stay inside the chat
        for s in set(seg[r][seg[r] > 0]):
            m = seg[r] == s
            assert x[r][m][0] == tiny_tokenizer.bos_id
            assert w[r][m][-1] == 0


_CHILD = r"""
import json, sys, hashlib
from absl import flags
flags.FLAGS.mark_as_parsed()
from c2jax.data import pipeline as P
from c2jax.data.tokenizer import Tokenizer
cfg, state = json.loads(sys.argv[1]), json.loads(sys.argv[2])
it = P.make_train_iterator(cfg, Tokenizer.load(cfg["run_dir"]), seq_len=cfg["L"], batch_size=cfg["B"],
                           seed=7, shard_index=0, shard_count=1)
it.set_state(state)
b = next(it)
print(hashlib.sha256(b"".join(b[k].tobytes() for k in P.BATCH_KEYS)).hexdigest())
"""


def test_state_restores_in_a_fresh_process(setup, tiny_tokenizer, tmp_path):
    import hashlib
    import os
    import subprocess
    import sys

    cfg, _, _ = setup
    tiny_tokenizer.save(str(tmp_path))
    it = _it(setup, tiny_tokenizer, seed=7)
    for _ in range(4):
        next(it)
    state = it.get_state()
    b = next(it)
    want = hashlib.sha256(b"".join(b[k].tobytes() for k in P.BATCH_KEYS)).hexdigest()
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "JAX_PLATFORMS": "cpu"}
    child_cfg = {**cfg, "run_dir": str(tmp_path), "L": L, "B": B}
    out = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(child_cfg), json.dumps(state)],
                         check=True, capture_output=True, text=True, env=env, timeout=120)
    assert out.stdout.strip().splitlines()[-1] == want


def test_load_corpus_and_tokenizer_trains_once(tmp_path, files_factory):
    root = files_factory(str(tmp_path / "repo"), n=6)
    cfg = {"corpus": {"sources": [{"kind": "dir", "path": root}], "heldout_fraction": 0.0},
           "vocab_size": 300, "tokenizer_sample_mb": 1}
    corpus, tok = P.load_corpus_and_tokenizer(cfg, str(tmp_path / "run"))
    assert (tmp_path / "run" / "tokenizer.json").is_file() and tok.vocab_size <= 300
    assert len(corpus.train) == 6
    _, again = P.load_corpus_and_tokenizer({**cfg, "vocab_size": 999}, str(tmp_path / "run"))
    assert again.fingerprint() == tok.fingerprint()  # reloaded, not retrained


def test_reader_threads_do_not_change_the_stream(setup, tiny_tokenizer):
    cfg, corpus, _ = setup
    outs = []
    for threads in (1, 3):
        it = P.make_train_iterator({**cfg, "read_threads": threads}, tiny_tokenizer, L, B, 5,
                                   corpus=corpus, shard_index=0, shard_count=1)
        outs.append(np.stack([next(it)["targets"] for _ in range(8)]))
    np.testing.assert_array_equal(outs[0], outs[1])


def test_token_record_round_trips_through_the_sft_reader(tmp_path):
    rng = np.random.default_rng(7)
    recs = [(rng.integers(0, 500, n).tolist(), (rng.random(n) < 0.5).tolist()) for n in (5, 9, 13)]
    path = tmp_path / "recs.jsonl"
    with open(path, "w") as f:
        for i, (ids, mask) in enumerate(recs):
            f.write(P.token_record(np.asarray(ids), np.asarray(mask), task_id=f"t{i}"))
    assert P.read_chats_jsonl(str(path)) == [(ids, [int(m) for m in mask]) for ids, mask in recs]
    assert json.loads(path.read_text().splitlines()[1])["task_id"] == "t1"
    with pytest.raises(ValueError, match="differ in length"):
        P.token_record([1, 2, 3], [1, 0])
