# The two promises of the README: `make quickstart` (main job) and `make test` (tests), each doing its own set-up.
.PHONY: setup quickstart test test-fast lint bench

setup:
	@scripts/setup.sh

quickstart: setup
	.venv/bin/swiftkv quickstart

test: setup
	.venv/bin/python -m pytest

test-fast: setup
	.venv/bin/python -m pytest -m "not slow and not vllm and not distributed"

lint: setup
	.venv/bin/ruff check . && .venv/bin/ruff format --check .
