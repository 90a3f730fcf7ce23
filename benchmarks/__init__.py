"""Benchmark harness for flux_jax: every AG->GEMM / GEMM->RS variant side by side on device time.

Run it with `python -m benchmarks.run --op ag|rs|all --preset NAME`; see benchmarks/README.md.
"""
