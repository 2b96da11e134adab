"""Loading a model by name or path, and timing a prefill: shared by the CLI and the benchmarks."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from .default_model import resolve_model_path
from .kv_cache import check_kv_cache_dtype, make_kv_cache
from .runtime import timed


def load(
    model: str | Path | None = None,
    dtype: torch.dtype = torch.float32,
    need_tokenizer: bool = True,
    device: torch.device | str = "cpu",
):
    """``(model, tokenizer)`` for a checkpoint path (any HF causal LM, SwiftKV or not) or ``'default'``, the model
    in eval mode on ``device``. The tokenizer is ``None`` when the folder has none and ``need_tokenizer`` is off.
    """
    path = resolve_model_path(model)
    has_tokenizer = any(
        (path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    )
    if need_tokenizer and not has_tokenizer:
        raise FileNotFoundError(
            f"{path} has no tokenizer files; save the tokenizer into the checkpoint folder."
        )
    tokenizer = AutoTokenizer.from_pretrained(path) if has_tokenizer else None
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval(), tokenizer


def sample_prompt_ids(tokenizer, num_tokens: int) -> torch.Tensor:
    """``[1, num_tokens]`` ids of real English text (the standard library's documentation), for timing prefills."""
    import argparse
    import collections
    import email
    import inspect
    import json
    import logging

    text = "\n\n".join(
        inspect.getdoc(m) or "" for m in (argparse, collections, email, json, logging, inspect)
    )
    text += "\n\n".join(inspect.getdoc(getattr(collections, n)) or "" for n in dir(collections))
    ids = tokenizer(text, return_tensors="pt").input_ids
    if ids.shape[1] < num_tokens:
        ids = ids.repeat(1, num_tokens // ids.shape[1] + 1)
    return ids[:, :num_tokens]


@torch.inference_mode()
def time_prefill(
    model,
    input_ids: torch.Tensor,
    repeats: int = 3,
    warmup: int = 1,
    kv_cache_dtype: str = "auto",
    forward=None,
) -> float:
    """Median seconds of a prefill (with KV cache, last-position logits only, as ``generate`` runs it), the device's
    queued work included (``runtime.timed``).

    ``kv_cache_dtype``: ``"auto"`` (the model's dtype) or ``"fp8"`` (``kv_cache.FP8KVCache``). ``forward``: what runs
    the prefill, default the model itself; e.g. ``torch.compile(model)`` (whose first calls compile: warm it up).
    """
    check_kv_cache_dtype(kv_cache_dtype)
    forward = model if forward is None else forward
    times = []
    for i in range(warmup + repeats):
        cache = make_kv_cache(model.config, kv_cache_dtype)
        seconds = timed(
            lambda cache=cache: forward(input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1),
            input_ids.device,
        )
        if i >= warmup:
            times.append(seconds)
    return sorted(times)[len(times) // 2]


def time_prefill_off_on(
    model, input_ids: torch.Tensor, repeats: int = 3, warmup: int = 1, forward=None
) -> dict[bool, list[float]]:
    """Seconds of ``repeats`` prefills of a SwiftKV model with SwiftKV off (``False``) and on (``True``): ``warmup``
    prefills each, then interleaved, so machine noise hits both alike. ``forward``: as in ``time_prefill``. The
    model is left with SwiftKV on."""
    times: dict[bool, list[float]] = {False: [], True: []}
    for i in range(warmup + repeats):
        for enabled in (False, True):
            seconds = time_prefill(model.swiftkv(enabled), input_ids, repeats=1, warmup=0, forward=forward)
            if i >= warmup:
                times[enabled].append(seconds)
    model.swiftkv(True)
    return times
