"""Compute backends registered into c2jax.ops (kernels that are neither XLA nor Pallas)."""
