"""Serving benchmark: the base model in stock vLLM vs its SwiftKV version (l = L/2) through the swiftkv_serve plugin.

Same run, same prompts, same engine settings. For each workload (prompt tokens / output tokens) a burst of
requests is submitted at once to vLLM's async engine (the engine behind ``vllm serve``), streaming, and we
measure per request the time to first token (TTFT) and time per output token after the first (TPOT), and the
combined throughput (prompt + output tokens / wall time of the burst). Each model runs in its own process.

    flock /tmp/swiftkv-heavy.lock .venv/bin/python benchmarks/serve.py            # default model, l=15, CPU
    flock /tmp/swiftkv-heavy.lock .venv/bin/python benchmarks/serve.py --num_requests 16 --max_num_seqs 16 \
        --compile true                                                             # both models torch.compiled

Writes ``benchmarks/results/serve.{json,png,md}``.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from jsonargparse import auto_cli

RESULTS = Path(__file__).parent / "results"
WORKLOADS = {"2000/200": (2000, 200), "500/500": (500, 500)}


def make_prompts(
    num_requests: int, prompt_len: int, vocab_low: int = 100, vocab_high: int = 49000, seed: int = 0
):
    rng = random.Random(seed + prompt_len)
    return [[rng.randrange(vocab_low, vocab_high) for _ in range(prompt_len)] for _ in range(num_requests)]


async def _burst(engine, prompts, max_tokens: int) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    async def one(i: int, prompt: list[int]) -> dict:
        start = time.perf_counter()
        first = None
        n_out = 0
        async for out in engine.generate(
            TokensPrompt(prompt_token_ids=prompt), params, request_id=f"r{i}-{start}"
        ):
            n_out = len(out.outputs[0].token_ids)
            if first is None and n_out:
                first = time.perf_counter()
        end = time.perf_counter()
        return {
            "ttft": first - start,
            "tpot": (end - first) / max(n_out - 1, 1),
            "n_in": len(prompt),
            "n_out": n_out,
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
        "ttft_mean_s": statistics.mean(r["ttft"] for r in per_request),
        "ttft_median_s": statistics.median(r["ttft"] for r in per_request),
        "tpot_mean_s": statistics.mean(r["tpot"] for r in per_request),
        "tpot_median_s": statistics.median(r["tpot"] for r in per_request),
    }


def run_one_model(model: str, num_requests: int, max_num_seqs: int, enforce_eager: bool) -> dict:
    """Runs in a child process: one engine, every workload, a short warm-up first."""
    from vllm import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    args = AsyncEngineArgs(
        model=model,
        dtype="float32",
        enforce_eager=enforce_eager,
        max_model_len=2304,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=2048,
        enable_prefix_caching=False,
        seed=0,
    )
    start = time.perf_counter()
    engine = AsyncLLM.from_engine_args(args)
    startup = time.perf_counter() - start
    config = engine.vllm_config
    results = {
        "startup_s": startup,
        "kv_cache_tokens": config.cache_config.kv_cache_size_tokens
        if hasattr(config.cache_config, "kv_cache_size_tokens")
        else None,
        "kv_sharing_fast_prefill": config.cache_config.kv_sharing_fast_prefill,
        "workloads": {},
    }

    async def main():
        await _burst(engine, make_prompts(2, 64, seed=99), 4)  # warm-up
        for name, (prompt_len, out_len) in WORKLOADS.items():
            results["workloads"][name] = await _burst(engine, make_prompts(num_requests, prompt_len), out_len)

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()
    return results


def prepare_swiftkv(base: Path, num_key_value_layers: int, out_dir: Path) -> Path:
    from transformers import AutoTokenizer

    from swiftkv_core.convert import convert, export_for_serving

    if not (out_dir / "config.json").is_file():
        export_for_serving(
            convert(base, num_key_value_layers), out_dir, tokenizer=AutoTokenizer.from_pretrained(base)
        )
    return out_dir


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [
        ("combined_tok_s", "combined throughput (tok/s), higher is better"),
        ("ttft_mean_s", "mean TTFT (s), lower is better"),
        ("tpot_mean_s", "mean TPOT (s), lower is better"),
    ]
    workloads = list(WORKLOADS)
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
    fig.savefig(path, dpi=110)


def main(
    model: str = "default",
    num_key_value_layers: int | None = None,
    num_requests: int = 16,
    max_num_seqs: int = 16,
    compile: bool = False,
    out: Path | None = None,
    report_only: bool = False,
    run_one: str | None = None,
) -> None:
    """Stock vLLM vs SwiftKV (through the swiftkv_serve plugin) on the same bursts of requests.

    Args:
        model: base HF checkpoint (default: the embedded SmolLM2-135M-Instruct).
        num_key_value_layers: l of the SwiftKV version (default: num_hidden_layers / 2).
        num_requests: requests per workload burst.
        max_num_seqs: vLLM's max_num_seqs (requests in one batch).
        compile: vLLM's default torch.compile mode for both models (default: eager).
        out: output prefix (default: benchmarks/results/serve, or serve-compile with compile).
        report_only: rewrite the .md/.png from the .json at ``out``.
        run_one: internal: benchmark this one model in this process and print its results.
    """
    if out is None:
        out = RESULTS / ("serve-compile" if compile else "serve")

    if report_only:
        write_report(json.loads(out.with_suffix(".json").read_text()), out)
        return

    if run_one:  # child process
        print("RESULT " + json.dumps(run_one_model(run_one, num_requests, max_num_seqs, not compile)))
        return

    from transformers import AutoConfig

    from swiftkv_core.default_model import resolve_model_path

    base = resolve_model_path(model)
    num_layers = AutoConfig.from_pretrained(base).num_hidden_layers
    l = num_key_value_layers or num_layers // 2
    swiftkv = prepare_swiftkv(
        base, l, Path.home() / ".cache" / "swiftkv" / "bench" / f"{base.name}-swiftkv-l{l}"
    )

    import vllm

    runs = {}
    for label, path in (("stock vLLM (base)", base), (f"SwiftKV l={l}", swiftkv)):
        print(f"== {label}: {path}", flush=True)
        command = [
            sys.executable,
            __file__,
            "--run_one",
            str(path),
            "--num_requests",
            str(num_requests),
            "--max_num_seqs",
            str(max_num_seqs),
            "--compile",
            str(compile).lower(),
        ]
        # A fixed KV cache space (GiB) for both models: without it vLLM's CPU backend reserves 92% of memory.
        env = {"VLLM_CPU_KVCACHE_SPACE": "4", **os.environ}
        proc = subprocess.run(command, capture_output=True, text=True, env=env)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode or not lines:
            sys.stderr.write("\n".join(line for line in proc.stderr.splitlines() if "ERROR" in line)[-8000:])
            raise SystemExit(f"benchmark of {label} failed (exit {proc.returncode})")
        runs[label] = json.loads(lines[-1][len("RESULT ") :])
        # Evidence of what was torch.compiled: vLLM tags the log lines of the SwiftKV model's compile units.
        runs[label]["swiftkv_compile_units_in_log"] = sorted(
            tag
            for tag in ("swiftkv_self_decoder", "swiftkv_cross_decoder")
            if f"[{tag}]" in proc.stdout + proc.stderr
        )

    (stock, stock_run), (swift, swift_run) = runs.items()
    ratios = {}
    for w in WORKLOADS:
        a, b = stock_run["workloads"][w], swift_run["workloads"][w]
        ratios[w] = {
            "combined_throughput_x": b["combined_tok_s"] / a["combined_tok_s"],
            "ttft_lower_x": a["ttft_mean_s"] / b["ttft_mean_s"],
            "tpot_lower_x": a["tpot_mean_s"] / b["tpot_mean_s"],
        }
    command = " ".join(["flock /tmp/swiftkv-heavy.lock .venv/bin/python benchmarks/serve.py", *sys.argv[1:]])
    results = {
        "model": base.name,
        "num_hidden_layers": num_layers,
        "num_key_value_layers": l,
        "vllm_version": vllm.__version__,
        "device": f"CPU ({os.cpu_count()} cores), fp32",
        "enforce_eager": not compile,
        "num_requests": num_requests,
        "max_num_seqs": max_num_seqs,
        "workloads": {w: {"prompt_tokens": p, "output_tokens": o} for w, (p, o) in WORKLOADS.items()},
        "runs": runs,
        "ratios_swiftkv_over_stock": ratios,
        "command": command,
    }

    write_report(results, out)


def write_report(results: dict, out: Path) -> None:
    """``out``.json, .png and .md from the results."""
    runs, ratios = results["runs"], results["ratios_swiftkv_over_stock"]
    l, num_layers, n = results["num_key_value_layers"], results["num_hidden_layers"], results["num_requests"]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=2))
    plot(results, out.with_suffix(".png"))
    lines = [
        f"# Serving benchmark: {results['model']} in stock vLLM vs SwiftKV (l={l} of {num_layers})",
        "",
        f"vLLM {results['vllm_version']}, {results['device']}, eager={results['enforce_eager']}, bursts of "
        f"{n} requests (max_num_seqs={results['max_num_seqs']}), greedy, ignore_eos.",
        "",
        "| workload (prompt/output) | model | combined tok/s | mean TTFT (s) | mean TPOT (ms) |",
        "|---|---|---|---|---|",
    ]
    for w in WORKLOADS:
        for label, run in runs.items():
            r = run["workloads"][w]
            lines.append(
                f"| {w} | {label} | {r['combined_tok_s']:.0f} | {r['ttft_mean_s']:.2f} | "
                f"{1000 * r['tpot_mean_s']:.1f} |"
            )
    lines += [
        "",
        "| workload | throughput (SwiftKV / stock) | TTFT (stock / SwiftKV) | TPOT (stock / SwiftKV) |",
        "|---|---|---|---|",
    ]
    for w, r in ratios.items():
        lines.append(
            f"| {w} | {r['combined_throughput_x']:.2f}x | {r['ttft_lower_x']:.2f}x | {r['tpot_lower_x']:.2f}x |"
        )
    lines += [
        "",
        "How it was measured:",
        "",
        f"- Each workload is ONE burst of {n} requests submitted at once to vLLM's async engine (the engine behind "
        "`vllm serve`), streamed; random prompt token ids (the same for both models), exact output lengths. "
        f"Scaled down to {n} requests per workload so that the whole run takes about 6 minutes on 2 cores.",
        "- TTFT includes queueing behind the other requests' prefill (chunked prefill, 2048 tokens per step); "
        "TPOT is (last token - first token) / (output tokens - 1) per request, so it includes the decode steps "
        "slowed down by other requests' prefill chunks.",
        (
            "- Both models eager (no torch.compile), "
            if results["enforce_eager"]
            else "- vLLM's default compile mode, both models torch.compiled (on CPU: dynamo + inductor, no CUDA graphs); "
            "the SwiftKV model as two compile units, layers < l with the K/V projection and cache writes for all "
            "tokens, and layers >= l for the gathered tokens whose logits are sampled; "
        )
        + "fp32, prefix caching off, the same KV cache space (4 GiB). "
        "The SwiftKV model is the base converted at l=L/2 (published init, not distilled: speed does not depend "
        "on the weights) and exported for serving.",
        "",
        "Command:",
        "",
        f"    {results['command']}",
        "",
    ]
    out.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    auto_cli(main, as_positional=False)
