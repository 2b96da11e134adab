"""A prompt posed to a chat model: one user turn in the tokenizer's chat template, then the assistant's generation
prompt, exactly as ``transformers`` renders it. The one renderer the data, the answers, the evaluations, the
benchmarks and the images use."""

from __future__ import annotations

import math

# The entry-point group of the packages that answer chat prompts for the distillation's data (a backend:
# (checkpoint folder, prompts, max_new_tokens, temperature, top_p, seed) -> one answer per prompt). Named here, below
# both: swiftkv-distill reads it, swiftkv-serve provides "vllm" (its pyproject.toml).
ANSWER_BACKENDS = "swiftkv_core.answer_backends"


def require_chat_template(tokenizer, what: str = "prompts") -> None:
    """Raise ``ValueError`` (with the fix) when ``tokenizer`` has no chat template, so ``what`` cannot be posed."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"{tokenizer.name_or_path}: the tokenizer has no chat template, so {what} cannot be posed to the model "
            "as chat. Use a chat (instruct) model, set tokenizer.chat_template, or give plain text."
        )


def check_sampling(max_new_tokens: int, temperature: float, top_p: float) -> None:
    """Raise ``ValueError`` (with the valid range) for sampling settings no generator takes: checked before a
    model is loaded or an engine started, where the generator would refuse them only after."""
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}.")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a number >= 0 (0: greedy), got {temperature!r}.")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}.")


def user_turn(prompt: str) -> list[dict]:
    return [{"role": "user", "content": prompt}]


def chat_ids(tokenizer, messages: list[dict], generation_prompt: bool = False) -> list[int]:
    """Token ids of ``messages`` in the chat template (with the assistant's generation prompt if asked)."""
    if not messages:
        return []
    ids = tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=generation_prompt, return_dict=False
    )
    return list(ids)


def chat_prompt_ids(tokenizer, prompts: list[str]) -> list[list[int]]:
    """Token ids of each prompt as one user turn followed by the generation prompt."""
    require_chat_template(tokenizer)
    return [chat_ids(tokenizer, user_turn(prompt), generation_prompt=True) for prompt in prompts]


def chat_prompt_batch(tokenizer, prompts: list[str]) -> dict:
    """``prompts`` as ``chat_prompt_ids``, left-padded into one batch (``input_ids``, ``attention_mask``): the
    inputs of ``generate``, whose answers then start right after every prompt."""
    require_chat_template(tokenizer)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer.apply_chat_template(
        [user_turn(p) for p in prompts],
        add_generation_prompt=True,
        padding=True,
        return_tensors="pt",
        return_dict=True,
    )
