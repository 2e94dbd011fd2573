#!/usr/bin/env bash
# Install LiteLLM's proxy (pyproject's `bench` extra) into bench/.litellm-venv, for bench/proxy.py.
#
# A venv of its own, not .venv: litellm[proxy] pins older huggingface_hub, rich, websockets and
# python-dateutil than the project uses, and the proxy runs as a separate process anyway.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
SPEC=$("$PY" -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["bench"][0])')
"$PY" -m venv bench/.litellm-venv
bench/.litellm-venv/bin/pip install -q "$SPEC"
bench/.litellm-venv/bin/litellm --version
