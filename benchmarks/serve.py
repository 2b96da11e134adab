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
    flock /tmp/swiftkv-heavy.lock .venv/bin/python benchmarks/serve.py --suite features  # + vLLM features

Writes ``benchmarks/results/serve.{json,png,md}`` (``serve-features.{json,md}`` with ``--suite features``).

``--suite features`` runs workloads where vLLM's own features matter, each stock vs SwiftKV with none / prefix
caching / n-gram speculative decoding / both: RAG (a few long documents shared by many questions), extraction
(answers that copy lines of their own prompt: what n-gram speculation accepts) and a decode-heavy control
(100 in / 500 out). SwiftKV only makes prefill cheaper, so per workload and feature set a stock run with one
output token measures the prefill time ``T_prefill`` of the stock run's time ``T``, and the best SwiftKV can do is
``bound = T / (T - T_prefill * (1 - 1/R))``, with ``R`` the prefill FLOPs ratio (``swiftkv_core.flops``); the
report gives the measured speed-up against it.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from jsonargparse import auto_cli

from swiftkv_serve.bench import ChildProcessFailed, compare_serving, plot_serving

RESULTS = Path(__file__).parent / "results"
WORKLOADS = {"2000/200": (2000, 200), "500/500": (500, 500)}
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
FEATURES = {
    "none": {},
    "prefix caching": {"enable_prefix_caching": True},
    "n-gram": {"speculative_config": NGRAM},
    "both": {"enable_prefix_caching": True, "speculative_config": NGRAM},
}
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
    suite: str = "lengths",
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
        suite: ``lengths`` (random prompts of two lengths, no vLLM features) or ``features`` (RAG, extraction
            and decode-heavy workloads, each with none / prefix caching / n-gram / both; see above).
    """
    if suite not in ("lengths", "features"):
        raise SystemExit(f"--suite {suite!r}: use 'lengths' or 'features'.")
    if out is None:
        out = RESULTS / ("serve-compile" if compile else "serve")
        if suite == "features":
            out = out.with_name(out.name + "-features")

    if report_only:
        results = json.loads(out.with_suffix(".json").read_text())
        (write_features_report if suite == "features" else write_report)(results, out)
        return

    from transformers import AutoConfig

    from swiftkv_core.default_model import resolve_model_path

    base = resolve_model_path(model)
    num_layers = AutoConfig.from_pretrained(base).num_hidden_layers
    l = num_key_value_layers or num_layers // 2
    swiftkv = prepare_swiftkv(
        base, l, Path.home() / ".cache" / "swiftkv" / "bench" / f"{base.name}-swiftkv-l{l}"
    )
    if suite == "features":
        try:
            results = compare_features(base, swiftkv, num_requests, max_num_seqs, compile)
        except ChildProcessFailed as error:
            raise SystemExit(str(error)) from None
        results["command"] = " ".join(
            ["flock /tmp/swiftkv-heavy.lock .venv/bin/python benchmarks/serve.py", *sys.argv[1:]]
        )
        write_features_report(results, out)
        return
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


# --- the features suite ---
_NAMES = ("Ada", "Bram", "Chen", "Dara", "Elif", "Farid", "Greta", "Hugo", "Ines", "Jonas")
_GOODS = ("ceramic tiles", "copper wire", "oak planks", "glass jars", "steel bolts", "wool bales")
_CITIES = ("Rotterdam", "Antwerp", "Hamburg", "Gdansk", "Lisbon", "Genoa", "Marseille", "Bilbao")


def shipping_log(seed: int, num_records: int) -> str:
    """A document of short, regular English records (real text: a model copies its lines when asked to)."""
    rng = random.Random(seed)
    return " ".join(
        f"Record {i + 1}: {rng.choice(_NAMES)} shipped {rng.randint(2, 90)} crates of {rng.choice(_GOODS)} "
        f"from {rng.choice(_CITIES)} to {rng.choice(_CITIES)} on day {rng.randint(1, 28)}."
        for i in range(num_records)
    )


def feature_workloads(
    tokenizer, num_requests: int, vocab_high: int
) -> dict[str, tuple[list[list[int]], int]]:
    """name -> (prompts, output tokens): RAG (4 documents of ~1500 tokens, one question each request),
    extraction (a ~1000-token document per request, the answer copies its lines), decode-heavy (100 / 500)."""
    from swiftkv_serve.bench import make_prompts

    documents = [shipping_log(seed, 60) for seed in range(4)]
    rag = [
        f"{documents[i % 4]}\n\nQuestion: what did record {7 + 3 * i} ship, from where, to where? "
        "Quote the record.\nAnswer:"
        for i in range(num_requests)
    ]
    extraction = [
        f"{shipping_log(100 + i, 40)}\n\nCopy every record that mentions {_CITIES[i % len(_CITIES)]}, exactly as "
        "written, one per line:\n"
        for i in range(num_requests)
    ]
    return {
        "RAG": ([tokenizer(text)["input_ids"] for text in rag], 100),
        "extraction": ([tokenizer(text)["input_ids"] for text in extraction], 200),
        "decode-heavy": (make_prompts(num_requests, 100, vocab_high=vocab_high), 500),
    }


def prefill_bound(total_s: float, prefill_s: float, flops_ratio: float) -> float:
    """The most a prefill ``flops_ratio`` times cheaper can speed up a run of ``total_s`` of which ``prefill_s``
    is prefill (Amdahl): ``T / (T - T_prefill * (1 - 1/R))``."""
    return total_s / (total_s - min(prefill_s, total_s) * (1 - 1 / flops_ratio))


def compare_features(base: Path, swiftkv: Path, num_requests: int, max_num_seqs: int, compile: bool) -> dict:
    """Every feature set of ``FEATURES`` on every workload of ``feature_workloads``, stock and SwiftKV, each
    (model, feature set) in its own child process; stock runs also time each burst prefill-only."""
    import torch
    from transformers import AutoConfig, AutoTokenizer

    import swiftkv_core  # noqa: F401  (registers the SwiftKV configs with AutoConfig)
    from swiftkv_core.flops import ModelShape, prefill_flops_total
    from swiftkv_serve.bench import STOCK_LABEL, default_dtype, device_name, run_in_child

    config = AutoConfig.from_pretrained(swiftkv)
    l, g = config.num_key_value_layers, config.key_value_group_size
    tokenizer = AutoTokenizer.from_pretrained(base)
    workloads = feature_workloads(tokenizer, num_requests, min(49000, len(tokenizer)))
    shapes = {name: (max(map(len, prompts)), out) for name, (prompts, out) in workloads.items()}
    prompts = {name: prompts for name, (prompts, _) in workloads.items()}
    max_model_len = 256 * -(-max(p + o for p, o in shapes.values()) // 256)
    dtype = default_dtype()
    shape = ModelShape.from_config(config)
    flops_ratio = {
        name: prefill_flops_total(shape, p) / prefill_flops_total(shape, p, l, g)
        for name, (p, _) in shapes.items()
    }
    runs: dict[str, dict[str, dict]] = {}
    for feature, options in FEATURES.items():
        for label, path in ((STOCK_LABEL, base), (f"SwiftKV l={l}", swiftkv)):
            print(f"== {feature}: {label}", flush=True)
            runs.setdefault(feature, {})[label] = run_in_child(
                path,
                f"{label}, {feature}",
                shapes,
                num_requests,
                max_num_seqs,
                compile,
                KV_CACHE_GIB,
                max_model_len,
                dtype,
                lambda line: print(line, flush=True),
                engine_options=options,
                prompts=prompts,
                prefill_only=label == STOCK_LABEL,
            )
    summary = {}
    for feature, by_label in runs.items():
        stock, swift = by_label[STOCK_LABEL], by_label[f"SwiftKV l={l}"]
        for name in shapes:
            total, swift_total = stock["workloads"][name]["wall_s"], swift["workloads"][name]["wall_s"]
            bound = prefill_bound(total, stock["prefill_only"][name]["wall_s"], flops_ratio[name])
            summary.setdefault(name, {})[feature] = {
                "speedup_x": total / swift_total,
                "bound_x": bound,
                "efficiency": (total / swift_total) / bound,
                "prefill_share": stock["prefill_only"][name]["wall_s"] / total,
            }
    return {
        "model": base.name,
        "swiftkv_model": swiftkv.name,
        "num_hidden_layers": config.num_hidden_layers,
        "num_key_value_layers": l,
        "key_value_group_size": g,
        "vllm_version": next(iter(runs.values()))[STOCK_LABEL].get("vllm_version"),
        "torch_version": torch.__version__,
        "device": device_name(dtype),
        "enforce_eager": not compile,
        "num_requests": num_requests,
        "max_num_seqs": max_num_seqs,
        "max_model_len": max_model_len,
        "kv_cache_gib": KV_CACHE_GIB,
        "features": FEATURES,
        "workloads": {name: {"max_prompt_tokens": p, "output_tokens": o} for name, (p, o) in shapes.items()},
        "prefill_flops_ratio": flops_ratio,
        "runs": runs,
        "summary": summary,
    }


def write_features_report(results: dict, out: Path) -> None:
    """``out``.json and .md from ``compare_features``'s results."""
    l, num_layers = results["num_key_value_layers"], results["num_hidden_layers"]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=2))
    lines = [
        f"# Serving with vLLM features: {results['model']} stock vs SwiftKV (l={l} of {num_layers})",
        "",
        f"vLLM {results['vllm_version']}, {results['device']}, eager={results['enforce_eager']}, bursts of "
        f"{results['num_requests']} requests (max_num_seqs={results['max_num_seqs']}), greedy, ignore_eos.",
        "",
        "| workload | features | stock s | SwiftKV s | speed-up | prefill share (stock) | bound | efficiency |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, by_feature in results["summary"].items():
        for feature, r in by_feature.items():
            walls = [run["workloads"][name]["wall_s"] for run in results["runs"][feature].values()]
            lines.append(
                f"| {name} | {feature} | {walls[0]:.1f} | {walls[1]:.1f} | {r['speedup_x']:.2f}x | "
                f"{100 * r['prefill_share']:.0f}% | {r['bound_x']:.2f}x | {100 * r['efficiency']:.0f}% |"
            )
    ratios = ", ".join(f"{name} {r:.2f}" for name, r in results["prefill_flops_ratio"].items())
    lines += [
        "",
        "How it was measured:",
        "",
        "- One burst per workload, submitted at once to vLLM's async engine, streamed; each (model, features) "
        "engine in its own process; with prefix caching the cache is emptied before each burst.",
        "- RAG: 4 shipping-log documents (~1500 tokens) shared by the questions; extraction: a document per "
        "request, the answer copies its lines; decode-heavy: random ids, 100 in / 500 out.",
        f"- n-gram: `{json.dumps(NGRAM)}`.",
        "- bound = T / (T - T_prefill * (1 - 1/R)): T the stock burst's wall time, T_prefill the same burst with "
        f"one output token, R the prefill FLOPs ratio at the workload's longest prompt ({ratios}); "
        "efficiency = speed-up / bound.",
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
