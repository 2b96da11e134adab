"""What a chat user sees of a SwiftKV checkpoint against its own teacher (the same weights with SwiftKV off).

The teacher-forced metrics (KL, top-1 agreement, perplexity on held-out text and chat answers) are the
distillation's validation metrics (``swiftkv_distill.step``). Here: ``greedy_answers``, the teacher's and the
student's greedy answers to chat prompts side by side, and ``greedy_prefix_agreement``, how often they start
with the same tokens.
"""

from __future__ import annotations

import gc
from pathlib import Path

import torch


@torch.inference_mode()
def greedy_answers(
    checkpoint: str | Path,
    prompts: list[str],
    max_new_tokens: int = 48,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> dict[str, list[str]]:
    """``{"teacher": [...], "swiftkv": [...]}``: greedy answers of the checkpoint with SwiftKV off and on."""
    from swiftkv_core.generation import load

    model, tokenizer = load(checkpoint, dtype=dtype, device=device)
    answers = {}
    for name, enabled in (("teacher", False), ("swiftkv", True)):
        with model.swiftkv_mode(enabled):
            answers[name] = [_answer(model, tokenizer, prompt, max_new_tokens) for prompt in prompts]
    # freed before the caller loads the next model (cycles included), not when garbage is next collected
    del model
    gc.collect()
    return answers


@torch.inference_mode()
def greedy_prefix_agreement(
    checkpoints: dict[str, str | Path],
    prompts: list[str],
    tokens: int = 8,
    batch_size: int = 16,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> dict:
    """Per checkpoint, the share of ``prompts`` whose greedy answer (SwiftKV on) starts with the same ``tokens``
    tokens as the teacher's: what a chat user sees first. The teacher is the first checkpoint with SwiftKV off
    (the checkpoints of one run share the teacher's weights). An answer that ends sooner counts as equal when
    it ends at the same token (the rest is padding in both)."""
    from swiftkv_core.generation import load

    reference, results = None, {}
    for name, checkpoint in checkpoints.items():
        model, tokenizer = load(checkpoint, dtype=dtype, device=device)
        if reference is None:
            with model.swiftkv_mode(False):
                reference = _greedy_ids(model, tokenizer, prompts, tokens, batch_size)
        with model.swiftkv_mode(True):
            ids = _greedy_ids(model, tokenizer, prompts, tokens, batch_size)
        results[name] = sum(a == b for a, b in zip(ids, reference, strict=True)) / len(prompts)
        del model  # before the next checkpoint loads: one model on the device at a time (cycles included)
        gc.collect()
    return {"tokens": tokens, "prompts": len(prompts), "share": results}


def _greedy_ids(model, tokenizer, prompts: list[str], tokens: int, batch_size: int) -> list[list[int]]:
    """The first ``tokens`` greedy tokens of each answer (left-padded batches; EOS and what follows cut off)."""
    from swiftkv_core.chat import chat_prompt_batch

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out = []
    for start in range(0, len(prompts), batch_size):
        inputs = chat_prompt_batch(tokenizer, prompts[start : start + batch_size]).to(model.device)
        generated = model.generate(**inputs, max_new_tokens=tokens, do_sample=False, pad_token_id=pad)
        for row in generated[:, inputs["input_ids"].shape[1] :].tolist():
            ends = [i for i, t in enumerate(row) if t in (tokenizer.eos_token_id, pad)]
            out.append(row[: ends[0] + 1] if ends else row)
    return out


def _answer(model, tokenizer, prompt: str, max_new_tokens: int) -> str:
    from swiftkv_core.chat import chat_prompt_batch

    inputs = chat_prompt_batch(tokenizer, [prompt]).to(model.device)
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True).strip()
