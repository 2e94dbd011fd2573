"""Tooling for the documentation under `docs/`: the module map generated from the docstrings
(`modmap.py`). A folder of its own because the tiny models' build key hashes `devtools/*.py`
(`tinymodel.py`): editing these files does not rebuild a taught model.
"""
