import json
import os

from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers, trainers

from c2jax import special_tokens
from c2jax.data.tokenizer import Tokenizer, load_or_train_tokenizer


def test_special_tokens_have_fixed_ids(tiny_tokenizer):
    tok = tiny_tokenizer
    for i, t in enumerate(special_tokens.ALL):
        assert tok.token_id(t) == i
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert 256 + len(special_tokens.ALL) < tok.vocab_size <= 512  # small data: fewer merges


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_round_trip_any_text(tiny_tokenizer, s):
    ids = tiny_tokenizer.encode(s)
    assert tiny_tokenizer.decode(ids) == s


def test_raw_text_never_yields_special_tokens(tiny_tokenizer):
    s = "".join(special_tokens.ALL) + " x <|eos|>"
    ids = tiny_tokenizer.encode(s)
    assert min(ids) >= len(special_tokens.ALL)
    assert tiny_tokenizer.decode(ids) == s
    assert tiny_tokenizer.decode([tiny_tokenizer.eos_id]) == special_tokens.EOS


def test_save_and_reload_from_run_dir(tiny_tokenizer, tmp_path):
    tiny_tokenizer.save(str(tmp_path))
    assert os.path.isfile(tmp_path / "tokenizer.json")
    again = load_or_train_tokenizer(str(tmp_path))  # no corpus needed: reloads
    assert again.fingerprint() == tiny_tokenizer.fingerprint()
    s = "def f(x):\n    return x  # ünï\n"
    assert again.encode(s) == tiny_tokenizer.encode(s)


def test_import_hf_model_dir_adds_missing_specials(tmp_path):
    hf = HFTokenizer(models.BPE(unk_token=None))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.train_from_iterator(["hello world"] * 10, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    model_dir = tmp_path / "hf_model"
    model_dir.mkdir()
    hf.save(str(model_dir / "tokenizer.json"))
    n = hf.get_vocab_size()
    run_dir = tmp_path / "run"
    tok = load_or_train_tokenizer(str(run_dir), tokenizer_path=str(model_dir))
    assert tok.vocab_size == n + len(special_tokens.ALL)
    assert tok.hf.token_to_id("<|endoftext|>") == 0  # the model's own ids are kept
    assert tok.eos_id >= n
    assert json.loads((run_dir / "tokenizer.json").read_text())["added_tokens"]
    assert Tokenizer.load(str(run_dir)).eos_id == tok.eos_id


def test_training_is_deterministic(tiny_tokenizer):
    from c2jax.data.tokenizer import train_tokenizer

    texts = ["def f(x):\n    return x * 2  # ü\n" * 30, "class A:\n    pass\n" * 20]
    a, b = (train_tokenizer(texts, vocab_size=400, min_frequency=1) for _ in range(2))
    assert a.fingerprint() == b.fingerprint()
