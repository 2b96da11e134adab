"""The same checks on a CUDA machine (vLLM's CUDA attention backends). Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from tests.serve.conftest import greedy, random_prompts, vllm_engine

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@torch.inference_mode()
def _hf_greedy_cuda(path, prompts, max_new_tokens, dtype):
    from swiftkv_core.generation import load

    model, _ = load(path, dtype=dtype)
    model = model.cuda()
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device="cuda")
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
        )
        outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def test_gpu_acrosskv_matches_hf(tiny_swiftkv):
    prompts = random_prompts()
    with vllm_engine(tiny_swiftkv, dtype="bfloat16", gpu_memory_utilization=0.3) as llm:
        assert llm.llm_engine.vllm_config.cache_config.kv_sharing_fast_prefill
        got = greedy(llm, prompts, 4)
    assert got == _hf_greedy_cuda(tiny_swiftkv, prompts, 4, torch.bfloat16)
