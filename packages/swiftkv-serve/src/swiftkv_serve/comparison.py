"""A base model in stock vLLM against its SwiftKV version, on the same bursts of requests (``bench.py``), and the
report of that comparison: ``compare_serving``, ``plot_serving``, ``write_serving_report``.

    results = compare_serving(base, swiftkv, {"2000/200": (2000, 200)}, num_requests=16, max_num_seqs=16,
                              compile=False)
    plot_serving(results, Path("serve.png"))
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

from swiftkv_core.atomic import atomic_write_text, made_once

from .bench import (
    MAX_NUM_BATCHED_TOKENS,
    STOCK_LABEL,
    default_dtype,
    default_max_model_len,
    device_name,
    run_in_child,
)
from .cli import describe

KV_CACHE_GIB = 4  # each engine's KV cache space: the same for both models (vLLM's CPU backend would take 92%)
_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def engines_max_model_len(workloads: dict[str, tuple[int, int]], config) -> int:
    """The engines' length by default: the longest workload and the warm-up rounded up to 256 tokens
    (``default_max_model_len``), never past the model's context, which vLLM refuses to exceed (a model shorter than
    256 tokens, as the main job serves one its 10:1 split)."""
    return min(default_max_model_len(workloads), getattr(config, "max_position_embeddings", None) or math.inf)


def converted_export(base: str | Path, num_key_value_layers: int) -> Path:
    """``base`` converted at ``l`` (published init, not distilled: serving speed does not depend on the weights)
    and exported for serving, made once into the cache (``$SWIFTKV_CACHE_DIR/bench``) and reused."""
    from transformers import AutoTokenizer

    from swiftkv_core.convert import convert, export_for_serving
    from swiftkv_core.default_model import cache_dir, resolve_model_path

    base = resolve_model_path(base)
    out = cache_dir() / "bench" / f"{base.name}-swiftkv-l{num_key_value_layers}"

    def make(staging: Path) -> None:
        export_for_serving(
            convert(base, num_key_value_layers), staging, tokenizer=AutoTokenizer.from_pretrained(base)
        )

    return made_once(out, lambda folder: (folder / "config.json").is_file(), make)


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
    kv_cache_gib: float = KV_CACHE_GIB,
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
    bad = {name: w for name, w in workloads.items() if min(w) < 1}
    if bad or num_requests < 1 or max_num_seqs < 1:
        raise ValueError(
            f"workloads {bad or workloads}, num_requests {num_requests}, max_num_seqs {max_num_seqs}: each must be "
            ">= 1 (a workload: prompt and output tokens)."
        )
    describe(swiftkv)  # a SwiftKV checkpoint vLLM serves (not one with adapters apart): before the stock run
    swiftkv_config = AutoConfig.from_pretrained(swiftkv)
    l = swiftkv_config.num_key_value_layers
    max_model_len = max_model_len or engines_max_model_len(workloads, swiftkv_config)
    too_long = [name for name, (p, o) in workloads.items() if p + o > max_model_len]
    if too_long:
        raise ValueError(
            f"max_model_len={max_model_len} is shorter than workloads {too_long} (prompt + output)."
        )
    dtype = dtype or default_dtype()

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


def swiftkv_origin(results: dict) -> str:
    """One sentence: which SwiftKV checkpoint was served."""
    if results.get("swiftkv_export"):
        return f"The SwiftKV model is the given serving export `{results['swiftkv_export']}`."
    return (
        "The SwiftKV model is the base converted at l=L/2 (published init, not distilled: speed does not depend "
        "on the weights, except through speculative decoding's acceptance) and exported for serving."
    )


def write_serving_report(results: dict, out: Path) -> None:
    """``out``.json, .png and .md from the results."""
    runs, ratios = results["runs"], results["ratios_swiftkv_over_stock"]
    l, num_layers, n = results["num_key_value_layers"], results["num_hidden_layers"], results["num_requests"]
    atomic_write_text(out.with_suffix(".json"), json.dumps(results, indent=2))
    plot_serving(results, out.with_suffix(".png"))
    lines = [
        f"# Serving benchmark: {results['model']} in stock vLLM vs SwiftKV (l={l} of {num_layers})",
        "",
        f"vLLM {results['vllm_version']}, {results['device']}, eager={results['enforce_eager']}, bursts of "
        f"{n} requests (max_num_seqs={results['max_num_seqs']}), greedy, ignore_eos.",
        "",
        "| workload (prompt/output) | model | combined tok/s | mean TTFT (s) | mean TPOT (ms) |",
        "|---|---|---|---|---|",
    ]
    for w in results["workloads"]:
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
        f"{n} requests per workload.",
        "- TTFT includes queueing behind the other requests' prefill (chunked prefill, 2048 tokens per step); "
        "TPOT is (last token - first token) / (output tokens - 1) per request, so it includes the decode steps "
        "slowed down by other requests' prefill chunks.",
        (
            "- Both models eager (no torch.compile), "
            if results["enforce_eager"]
            else "- vLLM's default compile mode, both models torch.compiled (dynamo + inductor) without CUDA "
            "graphs (none on CPU; off on a GPU, as `swiftkv serve` serves there); the SwiftKV model as two compile "
            "units, layers < l with the K/V projection and cache writes for all tokens, and layers >= l for the "
            "gathered tokens whose logits are sampled; "
        )
        + f"{_DTYPES.get(results.get('dtype', 'float32'))}, prefix caching off, the same KV cache space "
        f"({results.get('kv_cache_gib', KV_CACHE_GIB):g} GiB). " + swiftkv_origin(results),
        "",
        "Command:",
        "",
        f"    {results.get('command', '(a library call: compare_serving)')}",  # benchmarks/serve.py records its own
        "",
    ]
    atomic_write_text(out.with_suffix(".md"), "\n".join(lines))
    print("\n".join(lines))
