"""Tooling for the documentation under `docs/`: the module map generated from the docstrings
(`modmap.py`).
"""
