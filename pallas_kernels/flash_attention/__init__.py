"""Flash attention (causal, segment ids, GQA, MLA head dims)."""
