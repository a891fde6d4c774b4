"""Benchmark runner and reports: c2jax.evals.benchmark.run_benchmark / main_eval."""
