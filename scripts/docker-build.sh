#!/usr/bin/env bash
# Builds our images with the classic builder (`docker build --network host`; works where BuildKit is absent) and
# prints each one's build time and size. Usage: scripts/docker-build.sh IMAGE...  with IMAGE among
#   serve-cpu serve-cuda train-cpu train-cuda ci-cuda   (`make docker`: all of them; ci-cuda needs train-cuda)
# Tags: swiftkv-serve:cpu, swiftkv-serve:cuda, swiftkv-train:cpu, swiftkv-train:cuda, swiftkv-ci:cuda.
# Extra `docker build` options: DOCKER_BUILD_ARGS="--build-arg FLASH_ATTN_WHEEL=URL --no-cache".
set -euo pipefail
cd "$(dirname "$0")/.."
export DOCKER_BUILDKIT=0  # the classic builder: no frontend image to pull
[ $# -gt 0 ] || set -- serve-cpu serve-cuda train-cpu train-cuda ci-cuda
read -r -a extra <<<"${DOCKER_BUILD_ARGS:-}"
docker image inspect debian:bookworm-slim >/dev/null 2>&1 || docker pull -q debian:bookworm-slim >/dev/null 2>&1 \
    || { echo "docker-build: no debian:bookworm-slim image and no registry: run scripts/docker-setup.sh" >&2; exit 1; }
for image in "$@"; do
    role=${image%-*} device=${image##*-}
    case $image in
        serve-cpu | serve-cuda | train-cpu | train-cuda) args=(-f "docker/Dockerfile.$role" --build-arg "DEVICE=$device") ;;
        ci-cuda) args=(-f docker/Dockerfile.ci --build-arg BASE_IMAGE=swiftkv-train:cuda) ;;
        *) echo "docker-build: unknown image $image" >&2; exit 2 ;;
    esac
    scripts/docker-context.sh "$device" >/dev/null
    tag=swiftkv-$role:$device
    log=${SWIFTKV_DOCKER_STATE:-/tmp/swiftkv-docker}/build-$image.log
    mkdir -p "$(dirname "$log")"
    echo "docker-build: $tag (docker build --network host ${args[*]} ${extra[*]} -t $tag .; log: $log)"
    start=$(date +%s)
    if ! docker build --network host "${args[@]}" "${extra[@]}" -t "$tag" . >"$log" 2>&1; then
        tail -40 "$log" >&2
        echo "docker-build: $tag FAILED (log: $log)" >&2
        exit 1
    fi
    seconds=$(($(date +%s) - start))
    grep -v '^Step ' "$log" | grep -oE '(plugin registered|torch [0-9]|vllm [0-9]).*' | sed 's/^/  build check: /' || true
    size=$(docker image inspect --format '{{.Size}}' "$tag")
    awk -v t="$tag" -v s="$seconds" -v b="$size" 'BEGIN { printf "docker-build: %-20s built in %4d s, %.2f GB\n", t, s, b / 1e9 }'
done
