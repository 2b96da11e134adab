"""Loading a model by name or path, and timing a prefill (eager or compiled): shared by the CLI, the main job and the
benchmarks."""

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
    in eval mode on ``device`` (``load_weights``). The tokenizer is ``None`` when the folder has none and
    ``need_tokenizer`` is off."""
    tokenizer = load_tokenizer(model, need_tokenizer)
    return load_weights(resolve_model_path(model), dtype, device).eval(), tokenizer


def load_weights(path: str | Path, dtype: torch.dtype | str, device: torch.device | str):
    """``AutoModelForCausalLM.from_pretrained(path)`` in ``dtype`` (or ``"auto"``: the stored one) on ``device``, its
    weights read straight onto a GPU (no whole copy in host memory first) where ``accelerate`` is installed:
    transformers needs it for that."""
    from transformers.utils import is_accelerate_available

    device = torch.device(device)
    direct = device.type != "cpu" and is_accelerate_available()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map=device if direct else None)
    return model.to(device)


def load_tokenizer(model: str | Path | None = None, need: bool = True):
    """The checkpoint's tokenizer, or ``None`` when its folder has none and ``need`` is off."""
    path = resolve_model_path(model)
    has_tokenizer = any(
        (path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    )
    if need and not has_tokenizer:
        raise FileNotFoundError(
            f"{path} has no tokenizer files; save the tokenizer into the checkpoint folder."
        )
    return AutoTokenizer.from_pretrained(path) if has_tokenizer else None


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


def compile_prefill(model, mode: str = "reduce-overhead"):
    """The whole forward ``torch.compile``d, for ``time_prefill``'s ``forward``: one graph per prompt shape and
    SwiftKV side (``dynamic=False``; room for 64 of them, never a silent eager fallback), ``fullgraph`` (a graph
    break fails, never splits the forward or its CUDA graph silently). ``reduce-overhead`` replays each graph as a
    CUDA graph: on a GPU, a small model's eager prefill is bound by kernel launches, not by the FLOPs SwiftKV saves.
    Warm it up with three calls per shape and side (compile, record, replay); check it with
    ``check_compiled_prefill`` before timing it."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    return torch.compile(model, mode=mode, dynamic=False, fullgraph=True)


@torch.inference_mode()
def check_compiled_prefill(model, forward, ids: torch.Tensor) -> float:
    """Refuse (``RuntimeError``) to time a compiled forward whose last-position logits (SwiftKV off and on, from its
    third call: with CUDA graphs, the first replay) are not the eager ones up to the dtype's rounding, or that
    compiled one graph for both sides of a new prompt shape (a missed guard on the SwiftKV switch: one side would
    run the other's forward). Call it as the timed prefill runs, so the graphs it compiles are the ones timed.
    Returns the larger relative error, ||compiled - eager|| / ||eager||.

    The bf16 tolerance (fp16's by the ratio of their rounding) is above that dtype's rounding at a real depth, where
    eager bf16 itself is several percent from an fp32 copy (benchmarks/results/gpu-llama-3.1-8b-compiled-prefill.md).
    It catches a broken graph, not the other side's: with random weights the two sides' logits are too close to tell
    apart, hence the graph count."""
    from torch._dynamo.utils import counters

    # fp16 (a GPU without bf16) rounds 8x finer than bf16: 3 more mantissa bits
    tolerance = {torch.bfloat16: 0.15, torch.float16: 0.15 / 8}.get(model.dtype, 1e-3)
    errors, graphs = [], counters["stats"]["unique_graphs"]

    def logits(f):
        cache = make_kv_cache(model.config, "auto")
        # a copy: a CUDA graph's next replay overwrites its output
        return f(ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits.to(
            torch.float32, copy=True
        )

    for on in (False, True):
        model.swiftkv(on)
        eager = logits(model)
        # compile (a CUDA graph's first call runs eagerly), record, replay: the replay is checked
        for _ in range(3):
            compiled = logits(forward)
        errors.append(((compiled - eager).norm() / eager.norm()).item())
        if not errors[-1] <= tolerance:  # NaN fails too
            model.swiftkv(True)
            raise RuntimeError(
                f"the compiled forward's logits are {errors[-1]:.2%} (relative) from the eager ones with "
                f"swiftkv({on}), over the {tolerance:.2%} that {model.dtype}'s rounding explains: not timing it."
            )
    model.swiftkv(True)
    graphs = counters["stats"]["unique_graphs"] - graphs
    if graphs not in (0, 2):  # 0: this shape was compiled (and checked) before
        raise RuntimeError(f"a new prompt shape compiled {graphs} graph(s), not one per side: not timing it.")
    return max(errors)
