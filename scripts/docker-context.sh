#!/usr/bin/env bash
# Fills docker/context/ (git-ignored, read by the images' build stage only) with what the registry cannot give:
#   cpu:  the CPU build of torch (torch-2.13.0+cpu), from the local wheel folder that pip's find-links names
#         (our machines: /opt/wheels) or TORCH_CPU_WHEEL=path;
#   both: the CA bundle pip is configured with, when the registries are reached through a TLS-intercepting
#         proxy (our machines); elsewhere nothing is needed.
# Usage: scripts/docker-context.sh cpu|cuda
set -euo pipefail
cd "$(dirname "$0")/.."
device=${1:?usage: scripts/docker-context.sh cpu|cuda}
context=docker/context
mkdir -p "$context"

# pip's setting $1, or nothing (also where the host's python3 has no pip: a GPU machine needs none of it)
pip_config() {
    { python3 -m pip config list 2>/dev/null || true; } | sed -n "s/^[a-z:]*\.$1='\(.*\)'$/\1/p" | head -1
}

cert=${SWIFTKV_DOCKER_CA:-$(pip_config cert)}
if [ -n "$cert" ] && [ -f "$cert" ]; then
    cp "$cert" "$context/ca-certificates.crt"
    echo "docker-context: CA bundle $cert (build stage only)"
else
    rm -f "$context/ca-certificates.crt"
fi

rm -f "$context"/torch-*.whl  # only the CPU images read it
if [ "$device" = cpu ]; then
    version=$(sed -n 's/^torch==\([^ ;]*\).*/\1/p' docker/requirements/serve-cpu.txt)
    wheel=${TORCH_CPU_WHEEL:-}
    if [ -z "$wheel" ]; then
        for dir in $(pip_config find-links) /opt/wheels; do
            for candidate in "$dir"/torch-"$version"-cp311-*.whl; do
                [ -f "$candidate" ] && wheel=$candidate && break 2
            done
        done
    fi
    if [ -z "$wheel" ] || [ ! -f "$wheel" ]; then
        echo "docker-context: no torch-$version wheel found (pip find-links, /opt/wheels or TORCH_CPU_WHEEL)." >&2
        echo "  Get it with: python3 -m pip download --no-deps --only-binary=:all: --python-version 3.11 --platform manylinux_2_28_x86_64 --dest /opt/wheels --index-url https://download.pytorch.org/whl/cpu torch==$version" >&2
        exit 1
    fi
    target="$context/$(basename "$wheel")"
    ln "$wheel" "$target" 2>/dev/null || cp "$wheel" "$target"
    echo "docker-context: $(basename "$wheel")"
fi
