#!/usr/bin/env bash
# `make docker-test`: builds the CPU images and checks them for real (docker/check_images.py):
#   serving:  the server on a SwiftKV export of the default model answers completions and chat exactly as
#             swiftkv_core's HF greedy decoding does, turns malformed requests away with a 4xx and keeps serving,
#             passes its HEALTHCHECK and stops cleanly on `docker stop`;
#   training: a few-step `swiftkv-distill fit` and a 2-process `fabric run` inside the image, exports loaded outside.
# Sets up what it needs first (scripts/docker-setup.sh: the engine, the base image) or says what is missing.
# On a shared machine run it under the heavy-work lock: flock -o /tmp/swiftkv-heavy.lock make docker-test
# (-o: the lock is not handed down, so the dockerd this may start does not hold it after the test ends).
set -euo pipefail
cd "$(dirname "$0")/.."
work=${SWIFTKV_DOCKER_WORK:-/tmp/swiftkv-docker/test}
start=$(date +%s)
scripts/docker-setup.sh
scripts/docker-build.sh serve-cpu train-cpu
.venv/bin/python docker/check_images.py serve "$work"
.venv/bin/python docker/check_images.py train "$work"
echo "docker-test: passed in $(($(date +%s) - start)) s (logs in $work)"
