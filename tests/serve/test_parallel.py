"""Tensor parallelism 2 through vLLM's CPU backend (two worker processes, one core each)."""

from __future__ import annotations

import pytest

from tests.serve.checkpoints import hf_greedy
from tests.serve.conftest import greedy, random_prompts, vllm_engine

pytestmark = [pytest.mark.vllm, pytest.mark.distributed, pytest.mark.slow]


def test_tensor_parallel_2_matches_hf(tiny_swiftkv, monkeypatch):
    # Without an explicit binding vLLM's CPU backend refuses: "Not enough allowed NUMA nodes to bind threads of
    # 2 local CPUWorkers" (one NUMA node here); one core per worker works.
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    prompts = random_prompts(seed=11)
    with vllm_engine(tiny_swiftkv, tensor_parallel_size=2) as llm:
        got = greedy(llm, prompts, 12)
    assert got == hf_greedy(tiny_swiftkv, prompts, 12)
