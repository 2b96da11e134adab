"""The same checks on a CUDA machine (vLLM's CUDA attention backends). Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from tests.serve.checkpoints import hf_greedy
from tests.serve.conftest import greedy, random_prompts, vllm_engine

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_gpu_acrosskv_matches_hf(tiny_swiftkv):
    prompts = random_prompts()
    with vllm_engine(tiny_swiftkv, dtype="bfloat16", gpu_memory_utilization=0.3) as llm:
        assert llm.llm_engine.vllm_config.cache_config.kv_sharing_fast_prefill
        got = greedy(llm, prompts, 4)
    assert got == hf_greedy(tiny_swiftkv, prompts, 4, device="cuda", dtype=torch.bfloat16)
