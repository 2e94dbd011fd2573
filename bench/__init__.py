"""Benchmarks of molt-proxy and its trainer against baselines measured in the same run.

Not tests: nothing here asserts a speed. `python -m bench` regenerates bench/RESULTS.md.
"""
