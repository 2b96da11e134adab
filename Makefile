# The two promises of the README: `make quickstart` (main job) and `make test` (tests), each doing its own set-up.
.PHONY: setup quickstart test test-fast lint

setup:
	@scripts/setup.sh

quickstart: setup
	.venv/bin/swiftkv quickstart

# two pytest-xdist workers, each running a test file at a time on its share of the cores, longest files first
# (tests/conftest.py)
test: setup
	.venv/bin/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder

test-fast: setup
	.venv/bin/python -m pytest -m "not slow and not vllm and not distributed"

lint: setup
	.venv/bin/ruff check . && .venv/bin/ruff format --check .

# Images (docker/README.md). `docker`: every image, CUDA ones included (no GPU needed to build them).
# `docker-test`: the CPU images built, served and trained for real (sets up the engine and base image first).
.PHONY: docker docker-test
docker:
	@scripts/docker-setup.sh
	@scripts/docker-build.sh serve-cpu train-cpu serve-cuda train-cuda ci-cuda

docker-test: setup
	@scripts/docker-test.sh
