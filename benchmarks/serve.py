"""Serving benchmark: the base model in stock vLLM vs its SwiftKV version (l = L/2) through the swiftkv_serve plugin.

Same run, same prompts, same engine settings. For each workload (prompt tokens / output tokens) a burst of
requests is submitted at once to vLLM's async engine (the engine behind ``vllm serve``), streaming, and we
measure per request the time to first token (TTFT) and time per output token after the first (TPOT), and the
combined throughput (prompt + output tokens / wall time of the burst). Each model runs in its own process.
The measurement itself is ``swiftkv_serve.bench`` (``compare_serving``, ``plot_serving``); this script prepares
the SwiftKV checkpoint and writes the report.

    flock /tmp/swiftkv-heavy.lock .venv/bin/python benchmarks/serve.py            # default model, l=15, CPU
    flock /tmp/swiftkv-heavy.lock .venv/bin/python benchmarks/serve.py --num_requests 16 --max_num_seqs 16 \
        --compile true                                                             # both models torch.compiled

Writes ``benchmarks/results/serve.{json,png,md}``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from jsonargparse import auto_cli

from swiftkv_serve.bench import ChildProcessFailed, compare_serving, plot_serving

RESULTS = Path(__file__).parent / "results"
WORKLOADS = {"2000/200": (2000, 200), "500/500": (500, 500)}
KV_CACHE_GIB = 4
_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def prepare_swiftkv(base: Path, num_key_value_layers: int, out_dir: Path) -> Path:
    from transformers import AutoTokenizer

    from swiftkv_core.convert import convert, export_for_serving

    if not (out_dir / "config.json").is_file():
        export_for_serving(
            convert(base, num_key_value_layers), out_dir, tokenizer=AutoTokenizer.from_pretrained(base)
        )
    return out_dir


def main(
    model: str = "default",
    num_key_value_layers: int | None = None,
    num_requests: int = 16,
    max_num_seqs: int = 16,
    compile: bool = False,
    out: Path | None = None,
    report_only: bool = False,
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
    """
    if out is None:
        out = RESULTS / ("serve-compile" if compile else "serve")

    if report_only:
        write_report(json.loads(out.with_suffix(".json").read_text()), out)
        return

    from transformers import AutoConfig

    from swiftkv_core.default_model import resolve_model_path

    base = resolve_model_path(model)
    num_layers = AutoConfig.from_pretrained(base).num_hidden_layers
    l = num_key_value_layers or num_layers // 2
    swiftkv = prepare_swiftkv(
        base, l, Path.home() / ".cache" / "swiftkv" / "bench" / f"{base.name}-swiftkv-l{l}"
    )
    try:
        results = compare_serving(
            base,
            swiftkv,
            WORKLOADS,
            num_requests,
            max_num_seqs,
            compile,
            kv_cache_gib=KV_CACHE_GIB,
            progress=lambda line: print(line, flush=True),
        )
    except ChildProcessFailed as error:
        raise SystemExit(str(error)) from None
    results["command"] = " ".join(
        ["flock /tmp/swiftkv-heavy.lock .venv/bin/python benchmarks/serve.py", *sys.argv[1:]]
    )
    write_report(results, out)


def write_report(results: dict, out: Path) -> None:
    """``out``.json, .png and .md from the results."""
    runs, ratios = results["runs"], results["ratios_swiftkv_over_stock"]
    l, num_layers, n = results["num_key_value_layers"], results["num_hidden_layers"], results["num_requests"]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=2))
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
        + f"{_DTYPES.get(results.get('dtype', 'float32'))}, prefix caching off, the same KV cache space "
        f"({results.get('kv_cache_gib', KV_CACHE_GIB):g} GiB). "
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
