"""Tokenizer: byte-level BPE trained with HF `tokenizers`, or imported from an HF model dir.

Trained tokenizers put the special tokens of c2jax.special_tokens first, in the order of
`special_tokens.ALL` (PAD=0, BOS=1, EOS=2, ...). Imported tokenizers keep their own ids and get
any missing c2jax special tokens appended (so their vocab may grow past the model's embedding
rows: pad the embedding, see `Tokenizer.vocab_size`).

Raw text never produces special tokens: `encode("<|eos|>")` spells the string out in bytes.
Special tokens enter only through `token_id(...)` (e.g. in `render_chat`). Because the model
is byte-level, `decode(encode(s)) == s` for every str `s` that is valid UTF-8.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Sequence

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from c2jax import special_tokens

TOKENIZER_FILE = "tokenizer.json"


class TokenizerError(ValueError):
    pass


class Tokenizer:
    """Thin wrapper over `tokenizers.Tokenizer` with c2jax's special tokens."""

    def __init__(self, hf: HFTokenizer):
        missing = [t for t in special_tokens.ALL if hf.token_to_id(t) is None]
        if missing:
            hf.add_special_tokens(missing)
        hf.encode_special_tokens = True  # raw text never yields special tokens
        hf.no_padding()
        hf.no_truncation()
        self._hf = hf
        self._special = {t: hf.token_to_id(t) for t in special_tokens.ALL}

    # -- construction -----------------------------------------------------------------------
    @classmethod
    def load(cls, path: str) -> Tokenizer:
        """Loads `tokenizer.json` (a file, or a directory holding one, e.g. an HF model dir)."""
        if os.path.isdir(path):
            path = os.path.join(path, TOKENIZER_FILE)
        if not os.path.isfile(path):
            raise TokenizerError(f"no tokenizer at {path!r}: train one (train_tokenizer) or point "
                                 f"tokenizer_path at an HF model directory with {TOKENIZER_FILE}")
        return cls(HFTokenizer.from_file(path))

    def save(self, path: str) -> str:
        """Saves to `path` (a directory gets `tokenizer.json` inside); returns the file path."""
        if os.path.isdir(path) or not path.endswith(".json"):
            os.makedirs(path, exist_ok=True)
            path = os.path.join(path, TOKENIZER_FILE)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.tmp.{os.getpid()}"
        self._hf.save(tmp)
        os.replace(tmp, path)
        return path

    # -- encoding ---------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return self._hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._hf.encode_batch_fast(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._hf.decode([int(i) for i in ids], skip_special_tokens=False)

    # -- vocabulary -------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Number of ids (max id + 1), special tokens included."""
        return self._hf.get_vocab_size(with_added_tokens=True)

    def token_id(self, special: str) -> int:
        if special not in self._special:
            raise TokenizerError(f"{special!r} is not one of c2jax.special_tokens.ALL")
        return self._special[special]

    @property
    def pad_id(self) -> int:
        return self._special[special_tokens.PAD]

    @property
    def bos_id(self) -> int:
        return self._special[special_tokens.BOS]

    @property
    def eos_id(self) -> int:
        return self._special[special_tokens.EOS]

    @property
    def hf(self) -> HFTokenizer:
        return self._hf

    def fingerprint(self) -> str:
        return hashlib.sha256(self._hf.to_str().encode()).hexdigest()

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, fingerprint={self.fingerprint()[:12]})"


def train_tokenizer(texts: Iterable[str], vocab_size: int, *, min_frequency: int = 2) -> Tokenizer:
    """Trains a byte-level BPE; special tokens get ids 0..len(ALL)-1 in the order of ALL."""
    n_special = len(special_tokens.ALL)
    if vocab_size < n_special + 256:
        raise TokenizerError(f"vocab_size={vocab_size}: must be at least {n_special + 256} "
                             f"(256 bytes + {n_special} special tokens)")
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, show_progress=False,
        special_tokens=list(special_tokens.ALL),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    hf.train_from_iterator(texts, trainer)
    tok = Tokenizer(hf)
    for i, t in enumerate(special_tokens.ALL):  # the fixed-ids contract
        assert tok.token_id(t) == i, (t, tok.token_id(t))
    return tok


def sample_texts(texts_with_names: Iterable[tuple[str, str]], max_mb: float) -> list[str]:
    """Deterministic sample of about `max_mb` MB: documents in order of a hash of their name."""
    items = sorted(texts_with_names, key=lambda nt: hashlib.sha256(str(nt[0]).encode()).digest())
    out, total, cap = [], 0, int(max_mb * 1e6)
    for _, text in items:
        if total >= cap:
            break
        out.append(text)
        total += len(text.encode("utf-8"))
    return out


def load_or_train_tokenizer(run_dir: str | None, corpus=None, *, vocab_size: int = 8192,
                            sample_mb: float = 16.0, tokenizer_path: str = "") -> Tokenizer:
    """The run's tokenizer.

    - `tokenizer_path` set: load it (an HF model dir or a tokenizer.json), copy to run_dir.
    - else `run_dir/tokenizer.json` exists: reload it (restarts keep the same ids).
    - else train on the corpus's train split (`corpus`: a c2jax.data.corpus.Corpus) and save.
    """
    saved = os.path.join(run_dir, TOKENIZER_FILE) if run_dir else None
    if tokenizer_path:
        tok = Tokenizer.load(tokenizer_path)
    elif saved and os.path.isfile(saved):
        return Tokenizer.load(saved)
    else:
        if corpus is None:
            raise TokenizerError("no tokenizer to load and no corpus to train one on: pass corpus= "
                                 "or set tokenizer_path")
        tok = train_tokenizer(sample_texts(((d.name, d.text) for d in corpus.train), sample_mb),
                              vocab_size)
    if saved:
        tok.save(saved)
    return tok
