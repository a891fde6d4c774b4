"""The measured matmul peak: a real timing of the product, compiled once per shape."""
import math

import jax.numpy as jnp

from c2jax.train import metrics


def test_measured_matmul_peak_times_the_product_and_compiles_once():
    metrics._square_product.cache_clear()
    first = metrics.measured_matmul_peak(n=128, repeats=2)
    second = metrics.measured_matmul_peak(n=128, repeats=2)
    assert math.isfinite(first) and first > 1e6 and math.isfinite(second) and second > 1e6
    info = metrics._square_product.cache_info()
    assert (info.misses, info.hits) == (1, 1)       # the second sample reused the compiled product
    f, a = metrics._square_product(128, "float32")
    assert a.shape == (128, 128) and a.dtype == jnp.float32
    assert jnp.allclose(f(a), a @ a, rtol=1e-4, atol=1e-3)
    metrics.measured_matmul_peak(n=64, repeats=1)   # another size gets its own product
    assert metrics._square_product.cache_info().misses == 2
