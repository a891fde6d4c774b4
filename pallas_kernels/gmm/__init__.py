"""Grouped matmul for MoE experts (megablox-style gmm/tgmm)."""
