import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from c2jax.data.codebase import (
    CodebaseError,
    codebase_eval_arrays,
    iter_batches,
    load_codebase,
    rolling_windows,
)
from c2jax.data.pipeline import corpus_spec_from_config


@settings(max_examples=300, deadline=None)
@given(T=st.integers(0, 200), L=st.integers(1, 40), data=st.data())
def test_rolling_windows_score_every_token_once(T, L, data):
    S = data.draw(st.integers(1, L))
    tokens = np.arange(100, 100 + T, dtype=np.int32)  # token value = 100 + index
    x, y, w = rolling_windows(tokens, L, S, pad_id=0)
    assert x.shape == y.shape == w.shape and x.shape[1:] == (L,)
    if T < 2:
        assert len(x) == 0
        return
    scored = y[w > 0]
    # every token after the first is scored exactly once, in order
    np.testing.assert_array_equal(np.sort(scored), tokens[1:])
    assert len(scored) == T - 1
    # targets are the next token of the inputs; context of a scored position >= L - S + 1
    real = x > 0
    np.testing.assert_array_equal(y[real & (y > 0)] - 1, x[real & (y > 0)])
    for n, t in zip(*np.nonzero(w)):
        assert t + 1 >= min(L - S + 1, y[n, t] - 100)  # left context (t + 1 inputs) or all there is
    assert w[:, :][w > 0].sum() == T - 1
    assert np.all(x[~real] == 0)


def test_rolling_windows_rejects_bad_stride():
    with pytest.raises(CodebaseError):
        rolling_windows(np.arange(10), 4, 5)


def test_codebase_is_json_and_never_trained_on(tiny_tokenizer):
    files = load_codebase("json")
    assert [n for n, _ in files] == sorted(n for n, _ in files)
    assert "json/decoder.py" in [n for n, _ in files]
    cfg = {"codebase_package": "json", "corpus": {"sources": [{"kind": "stdlib"}], "heldout_fraction": 0.0}}
    assert "json" in corpus_spec_from_config(cfg).exclude_packages
    arr = codebase_eval_arrays({**cfg, "codebase_max_tokens": 3000}, tiny_tokenizer, window=256, stride=128)
    assert arr["num_tokens"] == 3000 and arr["num_scored"] == 2999
    assert arr["inputs"].dtype == np.int32 and arr["loss_weights"].dtype == np.float32
    batches = list(iter_batches(arr, 8))
    assert all(b["inputs"].shape == (8, 256) for b in batches)
    assert sum(b["loss_weights"].sum() for b in batches) == 2999
    assert np.all(batches[-1]["segment_ids"][batches[-1]["loss_weights"] > 0] == 1)
