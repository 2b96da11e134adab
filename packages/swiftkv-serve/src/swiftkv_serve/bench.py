"""Serving measurement: a base model in stock vLLM vs its SwiftKV version, on the same bursts of requests.

For each workload (prompt tokens, output tokens) one burst of ``num_requests`` requests is submitted at once to
vLLM's async engine (``AsyncLLM``, the engine behind ``vllm serve``), streamed, with random prompt token ids
(the same for both models) and exact output lengths (greedy, ``ignore_eos``). Per request: the time to first
token (TTFT) and the time per output token after the first (TPOT); per burst: the combined throughput
(prompt + output tokens / wall time). Each model runs in its own child process (``python -m
swiftkv_serve.bench``), so each engine's memory, threads and compile state are its own.

    from swiftkv_serve.bench import compare_serving, plot_serving
    results = compare_serving(base, swiftkv, {"2000/200": (2000, 200)}, num_requests=16, max_num_seqs=16,
                              compile=False)
    plot_serving(results, Path("serve.png"))

vLLM is imported only inside the functions that run an engine (in the child).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

STOCK_LABEL = "stock vLLM (base)"
COMPILE_UNIT_TAGS = ("swiftkv_self_decoder", "swiftkv_cross_decoder")
MAX_NUM_BATCHED_TOKENS = 2048  # chunked prefill: tokens per engine step
WARMUP = (2, 64, 4)  # requests, prompt tokens, output tokens: one short burst before the measured ones


class ChildProcessFailed(RuntimeError):
    """A child process (one model's benchmark, an answer generation) failed; the message has its error lines."""


def make_prompts(
    num_requests: int, prompt_len: int, vocab_low: int = 100, vocab_high: int = 49000, seed: int = 0
) -> list[list[int]]:
    """Random prompt token ids, the same for every model with the same arguments."""
    rng = random.Random(seed + prompt_len)
    return [[rng.randrange(vocab_low, vocab_high) for _ in range(prompt_len)] for _ in range(num_requests)]


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
    import torch

    short = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(dtype, dtype)
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()}, {short}"
    return f"CPU ({os.cpu_count()} cores), {short}"


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
        **{"enable_prefix_caching": False, **(engine_options or {})},
    )
    start = time.perf_counter()
    engine = AsyncLLM.from_engine_args(args)
    startup = time.perf_counter() - start
    config = engine.vllm_config
    vocab_high = min(49000, config.model_config.get_vocab_size())
    results = {
        "startup_s": startup,
        "kv_cache_tokens": getattr(config.cache_config, "kv_cache_size_tokens", None),
        "kv_sharing_fast_prefill": config.cache_config.kv_sharing_fast_prefill,
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
        await burst(make_prompts(requests, prompt_len, vocab_high=vocab_high, seed=99), out_len)
        for name, (prompt_len, out_len) in workloads.items():
            print(f"PROGRESS burst {name}: {num_requests} requests", flush=True)
            if prompts and name in prompts:
                burst_prompts = prompts[name][:num_requests]
            else:
                burst_prompts = make_prompts(num_requests, prompt_len, vocab_high=vocab_high)
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
    return results


def error_lines(log: str, limit: int = 8000) -> str:
    """The lines of a child's log that say what went wrong (else its last 40 lines)."""
    lines = log.splitlines()
    errors = [line for line in lines if "ERROR" in line or "Error" in line or "error:" in line]
    return "\n".join(errors or lines[-40:])[-limit:]


def _terminate_group(proc: subprocess.Popen, grace_s: float = 10) -> None:
    """End the child and whatever it started (vLLM's engine-core process), by the child's process group:
    SIGTERM, then SIGKILL for what is still there after ``grace_s``."""
    import signal

    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        proc.poll()  # reaps the child once it exits
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def run_module_in_child(
    module: str,
    spec: dict,
    what: str,
    on_line: Callable[[str], None] | None = None,
    env_overrides: dict[str, str] | None = None,
    timeout_s: float | None = None,
) -> tuple[object, str]:
    """Run ``python -m module SPEC.json RESULT.json`` in a child process (its own session) and return the
    JSON it wrote and its log (stdout + stderr). The child's engine sizes its KV cache itself
    (``kv_cache_memory_bytes``), so ``VLLM_CPU_KVCACHE_SPACE``, which would override that on CPU, is removed from
    its environment; ``env_overrides`` are added.

    ``on_line`` gets each line the child prints on stdout, while it runs. Raises ``ChildProcessFailed`` with
    the child's error lines when it exits with an error, writes no result, or runs past ``timeout_s``; the child
    and what it started are ended in every case.
    """
    on_line = on_line or (lambda line: None)
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"} | (env_overrides or {})
    with tempfile.TemporaryDirectory(prefix="swiftkv-child-") as tmp:
        spec_path, result_path = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_path.write_text(json.dumps(spec))
        # Output to files, not pipes: an engine process left behind holding a pipe open cannot block us.
        stdout_path, stderr_path = Path(tmp) / "stdout.log", Path(tmp) / "stderr.log"
        with stdout_path.open("w") as stdout, stderr_path.open("w") as stderr:
            proc = subprocess.Popen(
                [sys.executable, "-m", module, str(spec_path), str(result_path)],
                stdout=stdout,
                stderr=stderr,
                env=env,
                start_new_session=True,
            )
            start, seen = time.monotonic(), 0
            try:
                while proc.poll() is None:
                    time.sleep(1)
                    seen = _new_lines(stdout_path, seen, on_line)
                    if timeout_s is not None and time.monotonic() - start > timeout_s:
                        break
            finally:
                timed_out = proc.poll() is None
                _terminate_group(proc)
        _new_lines(stdout_path, seen, on_line)
        log = stdout_path.read_text(errors="replace") + stderr_path.read_text(errors="replace")
        if timed_out or proc.returncode or not result_path.is_file():
            why = f"ran past {timeout_s} s" if timed_out else f"exit {proc.returncode}"
            raise ChildProcessFailed(f"{what} failed ({why}):\n{error_lines(log)}")
        return json.loads(result_path.read_text()), log


def _new_lines(stdout_path: Path, seen: int, on_line: Callable[[str], None]) -> int:
    text = stdout_path.read_text(errors="replace")
    complete = text.splitlines() if text.endswith("\n") else text.splitlines()[:-1]  # whole lines only
    for line in complete[seen:]:
        on_line(line)
    return max(seen, len(complete))


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


def serving_ratios(stock: dict, swiftkv: dict) -> dict:
    """SwiftKV over stock per workload, each "x" higher-is-better for SwiftKV."""
    ratios = {}
    for w in stock["workloads"]:
        a, b = stock["workloads"][w], swiftkv["workloads"][w]
        ratios[w] = {
            "combined_throughput_x": b["combined_tok_s"] / a["combined_tok_s"],
            "ttft_lower_x": a["ttft_mean_s"] / b["ttft_mean_s"],
            "tpot_lower_x": a["tpot_mean_s"] / b["tpot_mean_s"],
        }
    return ratios


def compare_serving(
    base: Path,
    swiftkv: Path,
    workloads: dict[str, tuple[int, int]],
    num_requests: int,
    max_num_seqs: int,
    compile: bool,
    kv_cache_gib: float = 4,
    max_model_len: int | None = None,
    progress: Callable[[str], None] | None = None,
    dtype: str | None = None,
    timeout_s: float | None = None,
) -> dict:
    """Stock vLLM on ``base`` vs the SwiftKV checkpoint ``swiftkv`` (served through this plugin), same bursts.

    Args:
        base: the stock HF checkpoint folder.
        swiftkv: its SwiftKV version (a SwiftKV checkpoint folder).
        workloads: name -> (prompt tokens, output tokens); one burst each, in this order.
        num_requests: requests per burst (submitted at once).
        max_num_seqs: vLLM's max_num_seqs (requests in one batch).
        compile: vLLM's default torch.compile mode for both models (else eager).
        kv_cache_gib: the KV cache space of each engine (GiB), the same for both.
        max_model_len: vLLM's max_model_len (default: the longest workload, rounded up to 256).
        progress: called with one line per step (model started, burst started/done).
        dtype: the weights' dtype in vLLM (default: float32 on CPU, bfloat16 on a GPU).
        timeout_s: the longest one model's run may take (default: no limit).

    Returns a JSON-able dict: ``runs`` (label -> startup_s, kv_cache_tokens, per workload combined_tok_s,
    output_tok_s, ttft_mean_s, ttft_median_s, tpot_mean_s, tpot_median_s, wall_s), ``ratios_swiftkv_over_stock``
    (per workload: combined_throughput_x, ttft_lower_x, tpot_lower_x), ``kv_capacity_x``, the settings,
    versions and device.
    """
    import torch
    from transformers import AutoConfig

    import swiftkv_core  # noqa: F401  (registers the SwiftKV configs with AutoConfig)

    progress = progress or (lambda message: None)
    base, swiftkv = Path(base), Path(swiftkv)
    workloads = {name: (int(p), int(o)) for name, (p, o) in workloads.items()}
    max_model_len = max_model_len or default_max_model_len(workloads)
    too_long = [name for name, (p, o) in workloads.items() if p + o > max_model_len]
    if too_long:
        raise ValueError(
            f"max_model_len={max_model_len} is shorter than workloads {too_long} (prompt + output)."
        )
    dtype = dtype or default_dtype()
    swiftkv_config = AutoConfig.from_pretrained(swiftkv)
    l = getattr(swiftkv_config, "num_key_value_layers", None)
    if l is None:
        raise ValueError(f"{swiftkv} is not a SwiftKV checkpoint (no num_key_value_layers in its config).")

    runs = {}
    for label, path in ((STOCK_LABEL, base), (f"SwiftKV l={l}", swiftkv)):
        progress(f"== {label}: {path}")
        runs[label] = run_in_child(
            path,
            label,
            workloads,
            num_requests,
            max_num_seqs,
            compile,
            kv_cache_gib,
            max_model_len,
            dtype,
            progress,
            timeout_s,
        )
    stock_run, swift_run = runs.values()
    capacity = (
        swift_run["kv_cache_tokens"] / stock_run["kv_cache_tokens"]
        if swift_run.get("kv_cache_tokens") and stock_run.get("kv_cache_tokens")
        else None
    )
    return {
        "model": base.name,
        "swiftkv_model": swiftkv.name,
        "num_hidden_layers": swiftkv_config.num_hidden_layers,
        "num_key_value_layers": l,
        "key_value_group_size": getattr(swiftkv_config, "key_value_group_size", 1),
        "vllm_version": stock_run.get("vllm_version"),
        "torch_version": torch.__version__,
        "device": device_name(dtype),
        "dtype": dtype,
        "enforce_eager": not compile,
        "num_requests": num_requests,
        "max_num_seqs": max_num_seqs,
        "max_model_len": max_model_len,
        "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
        "kv_cache_gib": kv_cache_gib,
        "workloads": {w: {"prompt_tokens": p, "output_tokens": o} for w, (p, o) in workloads.items()},
        "runs": runs,
        "ratios_swiftkv_over_stock": serving_ratios(stock_run, swift_run),
        "kv_capacity_x": capacity,
    }


def plot_serving(results: dict, path: Path) -> None:
    """Bar charts (throughput, TTFT, TPOT per workload, both models) of ``compare_serving``'s results, as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [
        ("combined_tok_s", "combined throughput (tok/s), higher is better"),
        ("ttft_mean_s", "mean TTFT (s), lower is better"),
        ("tpot_mean_s", "mean TPOT (s), lower is better"),
    ]
    workloads = list(results["workloads"])
    fig, axes = plt.subplots(1, len(metrics), figsize=(15, 4))
    for ax, (key, title) in zip(axes, metrics, strict=True):
        width = 0.38
        for k, (label, run) in enumerate(results["runs"].items()):
            values = [run["workloads"][w][key] for w in workloads]
            bars = ax.bar([i + (k - 0.5) * width for i in range(len(workloads))], values, width, label=label)
            ax.bar_label(bars, fmt="%.3g", fontsize=8)
        ax.set_xticks(range(len(workloads)), [f"{w} (prompt/output)" for w in workloads])
        ax.set_title(title, fontsize=10)
    axes[0].legend(fontsize=8)
    fig.suptitle(
        f"vLLM {results['vllm_version']} on {results['device']}: {results['model']} stock vs SwiftKV "
        f"(l={results['num_key_value_layers']}), {results['num_requests']} requests per burst",
        fontsize=10,
    )
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def child_main(function: Callable[..., object], spec_file: str, result_file: str) -> None:
    """The child side of ``run_module_in_child``: ``function(**spec)`` with the settings in ``spec_file`` (JSON),
    its JSON-able result written to ``result_file`` (atomically: no file means it failed)."""
    from swiftkv_core.atomic import atomic_file

    result = function(**json.loads(Path(spec_file).read_text()))
    with atomic_file(Path(result_file)) as f:
        f.write(json.dumps(result, ensure_ascii=False))


if __name__ == "__main__":
    child_main(run_one_model, *sys.argv[1:])
