"""The data section of a c2jax config (`cfg.data`), with validation that names the bad field."""

from __future__ import annotations

from typing import Any

import ml_collections

from c2jax.config import register_section
from c2jax.data.corpus import CorpusError, CorpusSpec
from c2jax.errors import ConfigError


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.corpus = ml_collections.ConfigDict()
    # Sources (list of dicts with "kind": stdlib | packages | dir | git | jsonl | array_record).
    c.corpus.sources = [{"kind": "stdlib"}]
    # Files / records over this many bytes are skipped and counted.
    c.corpus.max_file_bytes = 1_000_000
    # Fraction of documents (by hash of name) kept out of training as the held-out split.
    c.corpus.heldout_fraction = 0.02
    # Top-level packages dropped from the corpus (codebase_package is always added).
    c.corpus.exclude_packages = []
    # Salt of the name hash that splits train / held-out.
    c.corpus.split_salt = "c2jax"
    # Held-out codebase for the perplexity eval (a package under codebase_root).
    c.codebase_package = "json"
    # Directory holding codebase_package; "" = this interpreter's stdlib.
    c.codebase_root = ""
    # Files of the codebase that are read, in path order.
    c.codebase_glob = "**/*.py"
    # Cap on codebase tokens scored (0 = all).
    c.codebase_max_tokens = 0
    # Perplexity window stride (0 = seq_len // 2).
    c.codebase_stride = 0
    # BPE vocab size when training a tokenizer.
    c.vocab_size = 8192
    # MB of training text sampled to train the tokenizer.
    c.tokenizer_sample_mb = 16.0
    # Path to an HF model dir / tokenizer.json to use instead of training ("" = train).
    c.tokenizer_path = ""
    # Directory for tokenized-corpus caches ("" = ~/.cache/c2jax/tokens).
    c.cache_dir = ""
    # Prepend BOS to every document (EOS is always appended).
    c.add_bos = False
    # grain read threads per process.
    c.read_threads = 1
    # JSONL of chats for the SFT stage ("" = none).
    c.sft_path = ""
    return c


def validate(cfg: Any, *, prefix: str = "data") -> None:
    """Raises ValueError naming the bad field; call before any compile."""
    try:
        CorpusSpec.from_config(cfg.corpus, extra_exclude=[cfg.codebase_package])
    except CorpusError as e:
        raise ValueError(f"{prefix}.{e}") from None
    if cfg.vocab_size < 512:
        raise ValueError(f"{prefix}.vocab_size={cfg.vocab_size}: use at least 512")
    if cfg.tokenizer_sample_mb <= 0:
        raise ValueError(f"{prefix}.tokenizer_sample_mb={cfg.tokenizer_sample_mb}: must be positive")
    if cfg.read_threads < 1:
        raise ValueError(f"{prefix}.read_threads={cfg.read_threads}: must be >= 1")
    if cfg.codebase_stride < 0 or cfg.codebase_max_tokens < 0:
        raise ValueError(f"{prefix}.codebase_stride / codebase_max_tokens must be >= 0")


def _validate_section(data, cfg) -> None:
    try:
        validate(data)
    except ValueError as e:
        raise ConfigError(str(e)) from None


register_section("data", get_config, _validate_section)
