"""Decode attention against a ragged KV cache."""
