"""Held-out quality of a SwiftKV checkpoint against its own teacher (the same weights with SwiftKV off).

The metrics are the distillation's validation metrics (``step.py``): per real token, KL(teacher || student),
top-1 agreement and both models' next-token perplexity. ``greedy_answers`` gives what a user sees: the teacher's
and the student's greedy answers to chat prompts.
"""

from __future__ import annotations

from pathlib import Path

import torch


@torch.no_grad()
def evaluate_checkpoint(
    checkpoint: str | Path, files: list[str], max_rows: int = 40, max_length: int = 256, batch_size: int = 8
) -> dict[str, float]:
    """``kl``, ``agreement``, ``student_ppl``, ``teacher_ppl`` (and ``tokens``) of a full SwiftKV checkpoint
    (teacher q/k/v kept) on held-out ``files`` (any record format of ``data.py``; every real token is scored)."""
    from .build import build_swiftkv_model
    from .data import DistillDataModule
    from .step import DistillationStep, ValidationMetrics

    model = build_swiftkv_model(str(checkpoint), *_layers(checkpoint)).eval()
    data = DistillDataModule(
        str(checkpoint),
        train_files=files,
        val_files=files,
        max_length=max_length,
        val_batch_size=batch_size,
        max_val_rows=max_rows,
    )
    data.build()
    step, metrics, tokens = DistillationStep(model), ValidationMetrics(), 0
    for batch in data.val_dataloader():
        metrics.update(step.evaluate(batch))
        tokens += int(batch["loss_mask"].sum())
    return {**metrics.compute(), "tokens": float(tokens)}


def _layers(checkpoint: str | Path) -> tuple[int, int]:
    from transformers import AutoConfig

    import swiftkv_core  # noqa: F401  (registers the SwiftKV configs)

    config = AutoConfig.from_pretrained(checkpoint)
    return config.num_key_value_layers, config.key_value_group_size


@torch.inference_mode()
def greedy_answers(
    checkpoint: str | Path, prompts: list[str], max_new_tokens: int = 48
) -> dict[str, list[str]]:
    """``{"teacher": [...], "swiftkv": [...]}``: greedy answers of the checkpoint with SwiftKV off and on."""
    from swiftkv_core.generation import load

    model, tokenizer = load(checkpoint)
    answers = {}
    for name, enabled in (("teacher", False), ("swiftkv", True)):
        with model.swiftkv_mode(enabled):
            answers[name] = [_answer(model, tokenizer, prompt, max_new_tokens) for prompt in prompts]
    return answers


def _answer(model, tokenizer, prompt: str, max_new_tokens: int) -> str:
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True).strip()
