"""Serving measurement, the engine side: one vLLM engine on one model, a short warm-up, then one burst of requests
per workload, in a process of its own (``run_in_child``: ``python -m swiftkv_serve.bench``).

A burst submits ``num_requests`` requests at once to vLLM's async engine (``AsyncLLM``, the engine behind ``vllm
serve``), streamed, with the same prompts for every model (random token ids, or given ones) and exact output
lengths (greedy, ``ignore_eos``). Per request: the time to first token (TTFT), the time per output token after
the first (TPOT) and a digest of its output ids; per burst: the combined throughput (prompt + output tokens / wall
time). ``comparison.py`` compares two models with it, ``features.py`` adds vLLM's features.

vLLM is imported only inside the functions that run an engine (in the child).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from swiftkv_core.runtime import device_description

from .child import child_main, run_module_in_child
from .cli import NO_CUDA_GRAPHS_CONFIG, on_vllm_cpu

STOCK_LABEL = "stock vLLM (base)"
COMPILE_UNIT_TAGS = ("swiftkv_self_decoder", "swiftkv_cross_decoder")
MAX_NUM_BATCHED_TOKENS = 2048  # chunked prefill: tokens per engine step
WARMUP = (2, 64, 4)  # requests, prompt tokens, output tokens: one short burst before the measured ones


RANDOM_ID_MARGIN = 100  # random prompts avoid both ends of the vocabulary, where special and byte tokens sit


def make_prompts(num_requests: int, prompt_len: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Random prompt token ids, the same for every model with the same arguments."""
    rng = random.Random(seed + prompt_len)
    low, high = RANDOM_ID_MARGIN, vocab_size - RANDOM_ID_MARGIN
    return [[rng.randrange(low, high) for _ in range(prompt_len)] for _ in range(num_requests)]


async def _burst(engine, prompts: list[list[int]], max_tokens: int) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    async def one(i: int, prompt: list[int]) -> dict:
        start = time.perf_counter()
        first = None
        token_ids = []
        async for out in engine.generate(
            TokensPrompt(prompt_token_ids=prompt), params, request_id=f"r{i}-{start}"
        ):
            token_ids = out.outputs[0].token_ids
            if first is None and token_ids:
                first = time.perf_counter()
        end = time.perf_counter()
        n_out = len(token_ids)
        return {
            "ttft": first - start,
            "tpot": (end - first) / max(n_out - 1, 1),
            "n_in": len(prompt),
            "n_out": n_out,
            "digest": hashlib.sha1(json.dumps(list(token_ids)).encode()).hexdigest()[:16],
        }

    start = time.perf_counter()
    per_request = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    wall = time.perf_counter() - start
    tokens = sum(r["n_in"] + r["n_out"] for r in per_request)
    return {
        "num_requests": len(prompts),
        "wall_s": wall,
        "combined_tok_s": tokens / wall,
        "output_tok_s": sum(r["n_out"] for r in per_request) / wall,
        "output_tokens": sum(r["n_out"] for r in per_request),
        "ttft_mean_s": statistics.mean(r["ttft"] for r in per_request),
        "ttft_median_s": statistics.median(r["ttft"] for r in per_request),
        "tpot_mean_s": statistics.mean(r["tpot"] for r in per_request),
        "tpot_median_s": statistics.median(r["tpot"] for r in per_request),
        # One per request: which runs of the burst wrote the same text.
        "output_digests": [r["digest"] for r in per_request],
    }


SPEC_DECODE_COUNTERS = {
    "drafts": "vllm:spec_decode_num_drafts",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
}


def engine_counters() -> dict[str, float]:
    """This process's vLLM speculative-decoding counters (``SPEC_DECODE_COUNTERS``) and engine steps (the
    number of steps that gave outputs: the count of ``vllm:iteration_tokens_total``), summed over engines.
    The async engine records them in this process (its output handler), from each step's scheduler stats."""
    from vllm.v1.metrics.reader import Counter, Histogram, get_metrics_snapshot

    names = {name: key for key, name in SPEC_DECODE_COUNTERS.items()}
    values = dict.fromkeys([*SPEC_DECODE_COUNTERS, "engine_steps"], 0.0)
    for metric in get_metrics_snapshot():
        if isinstance(metric, Counter) and metric.name in names:
            values[names[metric.name]] += metric.value
        elif isinstance(metric, Histogram) and metric.name == "vllm:iteration_tokens_total":
            values["engine_steps"] += metric.count
    return values


def spec_decode_stats(before: dict[str, float], after: dict[str, float], burst: dict) -> dict:
    """Speculative decoding over one burst, from ``engine_counters`` before and after it.

    Each decode step of a request emits one sampled token plus the drafts it accepted; a request's first token
    comes from its prefill. So the burst's decode tokens (output tokens after each request's first) took
    ``decode_steps = decode_tokens - accepted_tokens`` request-steps, ``tokens_per_step`` on average (1.0 without
    speculation). ``acceptance_rate``: accepted / proposed draft tokens; ``mean_acceptance_length``: vLLM's
    1 + accepted / drafts, over the steps that had a draft (steps without an n-gram match have none).
    """
    delta = {key: int(after[key] - before[key]) for key in after}
    drafts, draft_tokens, accepted = delta["drafts"], delta["draft_tokens"], delta["accepted_tokens"]
    decode_tokens = burst["output_tokens"] - burst["num_requests"]
    # A request's last step may accept drafts beyond max_tokens that are cut off: at least one step remains.
    decode_steps = max(decode_tokens - accepted, 1)
    return {
        **delta,
        "decode_tokens": decode_tokens,
        "decode_steps": decode_steps,
        "tokens_per_step": decode_tokens / decode_steps,
        "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
    }


def default_max_model_len(workloads: dict[str, tuple[int, int]]) -> int:
    """The longest workload (prompt + output, and the warm-up), rounded up to a multiple of 256."""
    longest = max([p + o for p, o in workloads.values()] + [WARMUP[1] + WARMUP[2]])
    return 256 * math.ceil(longest / 256)


def default_dtype() -> str:
    """fp32 on CPU (vLLM's CPU kernels, and what our CPU results use), bf16 on a GPU."""
    import torch

    return "bfloat16" if torch.cuda.is_available() else "float32"


def device_name(dtype: str) -> str:
    """The device an engine runs on, and the weights' dtype: ``"CPU (x86_64, 2 cores), fp32"``."""
    short = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(dtype, dtype)
    return f"{device_description()}, {short}"


def engine_settings(compile: bool, engine_options: dict | None, on_cpu: bool) -> dict:
    """``engine_options`` with the benchmarks' defaults: prefix caching off; compiled on a GPU, vLLM's CUDA graphs
    off (its torch.compile kept), as ``swiftkv serve`` serves there (``cli.gpu_graph_options``), for both models
    alike, unless the options give a ``compilation_config`` of their own."""
    options = {"enable_prefix_caching": False, **(engine_options or {})}
    if compile and not on_cpu and "compilation_config" not in options:
        options["compilation_config"] = dict(NO_CUDA_GRAPHS_CONFIG)
    return options


def run_one_model(
    model: str,
    workloads: dict[str, tuple[int, int]],
    num_requests: int,
    max_num_seqs: int,
    compile: bool,
    kv_cache_gib: float = 4,
    max_model_len: int | None = None,
    dtype: str | None = None,
    engine_options: dict | None = None,
    prompts: dict[str, list[list[int]]] | None = None,
    prefill_only: bool = False,
) -> dict:
    """One engine on ``model``, a short warm-up, then one burst per workload, in THIS process.

    ``engine_options``: more engine arguments (``enable_prefix_caching``, ``speculative_config``); with prefix
    caching each burst starts from an empty cache, so only the requests of one burst share blocks.
    ``prompts``: a workload's prompts (its ``num_requests`` first ones), instead of random token ids.
    ``prefill_only``: also time each burst with one output token (``results["prefill_only"]``), the prefill
    share of the workload that bounds what a faster prefill can gain.
    With a ``speculative_config``, each timed burst also gets ``spec_decode`` (``spec_decode_stats``: drafts,
    accepted tokens, acceptance rate, tokens per decode step), from the engine's counters.

    ``compare_serving`` runs it in a child process per model; call it directly only in a process of its own.
    """
    import torch
    import vllm
    from vllm import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    workloads = {name: (int(p), int(o)) for name, (p, o) in workloads.items()}
    args = AsyncEngineArgs(
        model=model,
        dtype=dtype or default_dtype(),
        enforce_eager=not compile,
        max_model_len=max_model_len or default_max_model_len(workloads),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        # A fixed KV cache space for both models: without it vLLM's CPU backend reserves 92% of memory.
        kv_cache_memory_bytes=int(kv_cache_gib * 2**30),
        seed=0,
        **engine_settings(compile, engine_options, on_cpu=on_vllm_cpu()),
    )
    start = time.perf_counter()
    engine = AsyncLLM.from_engine_args(args)
    startup = time.perf_counter() - start
    config = engine.vllm_config
    vocab_size = config.model_config.get_vocab_size()
    results = {
        "startup_s": startup,
        "kv_cache_tokens": getattr(config.cache_config, "kv_cache_size_tokens", None),
        "kv_sharing_fast_prefill": config.cache_config.kv_sharing_fast_prefill,
        "cudagraph_mode": str(config.compilation_config.cudagraph_mode),
        "max_model_len": config.model_config.max_model_len,
        "vllm_version": vllm.__version__,
        "torch_version": torch.__version__,
        "workloads": {},
        **({"prefill_only": {}} if prefill_only else {}),
    }

    async def burst(burst_prompts: list[list[int]], out_len: int) -> dict:
        if config.cache_config.enable_prefix_caching:
            await engine.reset_prefix_cache()
        return await _burst(engine, burst_prompts, out_len)

    async def bursts():
        requests, prompt_len, out_len = WARMUP
        await burst(make_prompts(requests, prompt_len, vocab_size, seed=99), out_len)
        for name, (prompt_len, out_len) in workloads.items():
            print(f"PROGRESS burst {name}: {num_requests} requests", flush=True)
            if prompts and name in prompts:
                burst_prompts = prompts[name][:num_requests]
            else:
                burst_prompts = make_prompts(num_requests, prompt_len, vocab_size)
            if prefill_only:
                results["prefill_only"][name] = await burst(burst_prompts, 1)
            before = engine_counters()
            results["workloads"][name] = result = await burst(burst_prompts, out_len)
            if config.speculative_config is not None:
                result["spec_decode"] = spec_decode_stats(before, engine_counters(), result)
            print(
                f"PROGRESS burst {name}: {result['combined_tok_s']:.0f} tok/s combined, "
                f"mean TTFT {result['ttft_mean_s']:.2f} s, mean TPOT {1000 * result['tpot_mean_s']:.1f} ms",
                flush=True,
            )

    try:
        asyncio.run(bursts())
    finally:
        engine.shutdown()
        # vLLM keeps the traceback of an optional import that failed (torchcodec) on the first import of its
        # multimodal modules, made from this frame: the frame, and the engine with it, would live until the
        # interpreter's teardown, where AsyncLLM.__del__ shuts it down again and fails ("TypeError: 'NoneType'
        # object is not callable", a line a failing child's error report would show beside the real error).
        engine = None
    return results


def run_in_child(
    model: Path,
    label: str,
    workloads: dict[str, tuple[int, int]],
    num_requests: int,
    max_num_seqs: int,
    compile: bool,
    kv_cache_gib: float = 4,
    max_model_len: int | None = None,
    dtype: str | None = None,
    progress: Callable[[str], None] | None = None,
    timeout_s: float | None = None,
    engine_options: dict | None = None,
    prompts: dict[str, list[list[int]]] | None = None,
    prefill_only: bool = False,
) -> dict:
    """``run_one_model`` in a child process (``python -m swiftkv_serve.bench``); raises ``ChildProcessFailed``
    with the child's error lines if it fails or runs past ``timeout_s``."""
    progress = progress or (lambda message: None)

    def on_line(line: str) -> None:
        if line.startswith("PROGRESS "):
            progress(f"{label}: {line[len('PROGRESS ') :]}")

    spec = dict(
        model=str(model),
        workloads={name: list(w) for name, w in workloads.items()},
        num_requests=num_requests,
        max_num_seqs=max_num_seqs,
        compile=compile,
        kv_cache_gib=kv_cache_gib,
        max_model_len=max_model_len,
        dtype=dtype,
        engine_options=engine_options,
        prompts=prompts,
        prefill_only=prefill_only,
    )
    run, log = run_module_in_child(
        "swiftkv_serve.bench", spec, f"benchmark of {label} ({model})", on_line, timeout_s=timeout_s
    )
    # Evidence of what was torch.compiled: vLLM tags the log lines of the SwiftKV model's compile units.
    run["swiftkv_compile_units_in_log"] = sorted(tag for tag in COMPILE_UNIT_TAGS if f"[{tag}]" in log)
    return run


if __name__ == "__main__":
    child_main(run_one_model, *sys.argv[1:])
