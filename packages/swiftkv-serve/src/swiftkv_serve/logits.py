"""The prompt-logprobs guard: a no-op logits processor whose admission check rejects prompt logprobs.

Under SwiftKV the layers ``>= l`` never run for most prompt tokens, so their logits (and prompt logprobs) do not
exist; vLLM would otherwise compute them from hidden states that are not the model's. vLLM calls
``validate_params`` for every request when it is admitted, in the offline ``LLM`` and in the server (where the
error becomes an HTTP 400).
"""

from __future__ import annotations

import torch
from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError
from vllm.v1.sample.logits_processor import LogitsProcessor

PROMPT_LOGPROBS_MESSAGE = (
    "prompt_logprobs are not supported by SwiftKV models: layers >= num_key_value_layers run only for the "
    "tokens whose next-token logits are sampled, so the prompt tokens' logprobs are never computed. "
    "Serve the base (non-SwiftKV) checkpoint to score prompts."
)


class SwiftKVPromptLogprobsGuard(LogitsProcessor):
    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        if getattr(sampling_params, "prompt_logprobs", None) is not None:
            raise VLLMValidationError(PROMPT_LOGPROBS_MESSAGE, parameter="prompt_logprobs")

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        pass

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update) -> None:
        pass
