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
    flock /tmp/swiftkv-heavy.lock .venv/bin/python benchmarks/serve.py --suite features \
        --swiftkv_model runs/qs/distilled-serving --features '[n-gram, both]'   # a given export, 2 feature sets

Writes ``benchmarks/results/serve.{json,png,md}`` (``serve-features.{json,png,md}`` with ``--suite features``).
By default the SwiftKV model is the base converted at l (published init, not distilled: speed does not depend on
the weights); ``--swiftkv_model`` serves a given SwiftKV serving export of the same base instead (a distilled one).

``--suite features`` runs workloads where vLLM's own features matter, each stock vs SwiftKV with none / prefix
caching / n-gram speculative decoding / both: RAG (a few long documents shared by many questions), extraction
(answers that copy lines of their own prompt: what n-gram speculation accepts), a decode-heavy control
(random ids, 100 in / 500 out) and long answers (chat requests for an article, ~65 in / 500 out: decode-heavy
traffic in real text). SwiftKV only makes prefill cheaper, so per workload and feature set a stock run with one
output token measures the prefill time ``T_prefill`` of the stock run's time ``T``, and the best SwiftKV can do is
``bound = T / (T - T_prefill * (1 - 1/R))``, with ``R`` the prefill FLOPs ratio (``swiftkv_core.flops``); the
report gives the measured speed-up against it.

With n-gram speculation speed DOES depend on the weights: the drafts are accepted when the model's greedy text
copies its prompt, so an engine whose model writes other text takes another number of decode steps, and the bound
above (which assumes the same decode work) no longer bounds anything. So each feature set with speculation also
runs the SwiftKV checkpoint with fast prefill off (``swiftkv_fast_prefill: false``): every layer for every prompt
token, the stock prefill FLOPs, and the same text as SwiftKV (the report counts the requests whose output token
ids are identical). Against that baseline (the "same text" rows) the bound holds again. Each burst with
speculation also records the engine's counters (drafts, accepted tokens; ``swiftkv_serve.bench.spec_decode_stats``).
"""

from __future__ import annotations

import json
import random
import sys
from dataclasses import asdict
from pathlib import Path

from jsonargparse import auto_cli

from swiftkv_serve.bench import STOCK_LABEL, ChildProcessFailed, compare_serving, plot_serving

RESULTS = Path(__file__).parent / "results"
WORKLOADS = {"2000/200": (2000, 200), "500/500": (500, 500)}
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
FEATURES = {
    "none": {},
    "prefix caching": {"enable_prefix_caching": True},
    "n-gram": {"speculative_config": NGRAM},
    "both": {"enable_prefix_caching": True, "speculative_config": NGRAM},
}
FAST_PREFILL_OFF = {"additional_config": {"swiftkv_fast_prefill": False}}  # the same-text baseline's engine
SAME_TEXT_LABEL = "SwiftKV, fast prefill off"
KV_CACHE_GIB = 4
_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def check_swiftkv_export(base: Path, swiftkv: Path) -> int:
    """Refuse (``SystemExit``, before any engine starts) a ``--swiftkv_model`` that is not a SwiftKV checkpoint
    of ``base``'s family and shape; returns its l."""
    from transformers import AutoConfig

    import swiftkv_core  # noqa: F401  (registers the SwiftKV configs with AutoConfig)
    from swiftkv_core.flops import ModelShape

    if not (swiftkv / "config.json").is_file():
        raise SystemExit(
            f"--swiftkv_model {swiftkv}: no config.json there (a SwiftKV serving export folder)."
        )
    config, base_config = AutoConfig.from_pretrained(swiftkv), AutoConfig.from_pretrained(base)
    if getattr(config, "num_key_value_layers", None) is None:
        raise SystemExit(f"--swiftkv_model {swiftkv} is not a SwiftKV checkpoint (no num_key_value_layers).")
    if config.model_type != f"{base_config.model_type}_swiftkv":
        raise SystemExit(
            f"--swiftkv_model {swiftkv} is a {config.model_type} checkpoint; the base {base} is "
            f"{base_config.model_type} (expected {base_config.model_type}_swiftkv)."
        )
    shape, base_shape = asdict(ModelShape.from_config(config)), asdict(ModelShape.from_config(base_config))
    differ = [
        f"{key} {shape[key]} (base {base_shape[key]})" for key in shape if shape[key] != base_shape[key]
    ]
    if differ:
        raise SystemExit(
            f"--swiftkv_model {swiftkv} is not a SwiftKV version of {base}: {', '.join(differ)}."
        )
    return config.num_key_value_layers


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
    swiftkv_model: Path | None = None,
    features: list[str] | None = None,
    workloads: list[str] | None = None,
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
        swiftkv_model: a SwiftKV serving export of ``model`` to serve (e.g. a distilled one), instead of the
            base converted at l (undistilled); its family and shape must match the base's.
        features: with ``--suite features``, only these feature sets (names of ``FEATURES``), in this order.
        workloads: with ``--suite features``, only these workloads (names of ``FEATURE_WORKLOADS``).
    """
    if suite not in ("lengths", "features"):
        raise SystemExit(f"--suite {suite!r}: use 'lengths' or 'features'.")
    for flag, names, known in (("features", features, FEATURES), ("workloads", workloads, FEATURE_WORKLOADS)):
        if names is not None and (suite != "features" or not names or not set(names) <= set(known)):
            raise SystemExit(f"--{flag} {names}: with --suite features, a non-empty list of {list(known)}.")
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
    if swiftkv_model is not None:
        swiftkv = Path(swiftkv_model).expanduser().resolve()
        l = check_swiftkv_export(base, swiftkv)
        if num_key_value_layers not in (None, l):
            raise SystemExit(f"--num_key_value_layers {num_key_value_layers}, but --swiftkv_model has l={l}.")
    else:
        num_layers = AutoConfig.from_pretrained(base).num_hidden_layers
        l = num_key_value_layers or num_layers // 2
        swiftkv = prepare_swiftkv(
            base, l, Path.home() / ".cache" / "swiftkv" / "bench" / f"{base.name}-swiftkv-l{l}"
        )
    swiftkv_source = str(swiftkv_model) if swiftkv_model is not None else None  # as given (not resolved)
    if suite == "features":
        selected = {name: FEATURES[name] for name in features or FEATURES}
        try:
            results = compare_features(
                base, swiftkv, num_requests, max_num_seqs, compile, selected, workloads
            )
        except ChildProcessFailed as error:
            raise SystemExit(str(error)) from None
        results["swiftkv_export"] = swiftkv_source
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
    results["swiftkv_export"] = swiftkv_source
    results["command"] = " ".join(
        ["flock /tmp/swiftkv-heavy.lock .venv/bin/python benchmarks/serve.py", *sys.argv[1:]]
    )
    write_report(results, out)


def swiftkv_origin(results: dict) -> str:
    """One sentence: which SwiftKV checkpoint was served."""
    if results.get("swiftkv_export"):
        return f"The SwiftKV model is the given serving export `{results['swiftkv_export']}`."
    return (
        "The SwiftKV model is the base converted at l=L/2 (published init, not distilled: speed does not depend "
        "on the weights, except through speculative decoding's acceptance) and exported for serving."
    )


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
        f"({results.get('kv_cache_gib', KV_CACHE_GIB):g} GiB). " + swiftkv_origin(results),
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


_TOPICS = (
    "starting a vegetable garden on a small balcony",
    "the history of the bicycle",
    "how a refrigerator works",
    "planning a week of cheap, healthy dinners",
    "learning a second language as an adult",
    "why the sky is blue and sunsets are red",
    "training for a first 10 km run",
    "how bread rises",
)


def long_answer_prompts(tokenizer, num_requests: int) -> list[list[int]]:
    """Chat requests for a long answer, in the model's own chat template (~65 tokens for SmolLM2): the decode-heavy
    traffic of a chat model, real text where random ids make both models fall into loops at once."""
    return [
        tokenizer.apply_chat_template(
            [
                {
                    "role": "user",
                    "content": f"Write a long, detailed article about {_TOPICS[i % len(_TOPICS)]} for a general "
                    "audience: an introduction, five sections with a heading each, and a conclusion.",
                }
            ],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        for i in range(num_requests)
    ]


FEATURE_WORKLOADS = ("RAG", "extraction", "decode-heavy", "long answers")


def feature_workloads(
    tokenizer, num_requests: int, vocab_high: int
) -> dict[str, tuple[list[list[int]], int]]:
    """name -> (prompts, output tokens): RAG (4 documents of ~1500 tokens, one question each request),
    extraction (a ~1000-token document per request, the answer copies its lines), decode-heavy (random ids,
    100 / 500) and long answers (chat requests for an article, ~65 / 500)."""
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
    workloads = {
        "RAG": ([tokenizer(text)["input_ids"] for text in rag], 100),
        "extraction": ([tokenizer(text)["input_ids"] for text in extraction], 200),
        "decode-heavy": (make_prompts(num_requests, 100, vocab_high=vocab_high), 500),
        "long answers": (long_answer_prompts(tokenizer, num_requests), 500),
    }
    assert tuple(workloads) == FEATURE_WORKLOADS  # the names --workloads checks before any model loads
    return workloads


def prefill_bound(total_s: float, prefill_s: float, flops_ratio: float) -> float:
    """The most a prefill ``flops_ratio`` times cheaper can speed up a run of ``total_s`` of which ``prefill_s``
    is prefill, with the same decode work (Amdahl): ``T / (T - T_prefill * (1 - 1/R))``."""
    prefill_s = min(prefill_s, total_s)
    return total_s / (total_s - prefill_s * (1 - 1 / flops_ratio))


def compare_features(
    base: Path,
    swiftkv: Path,
    num_requests: int,
    max_num_seqs: int,
    compile: bool,
    features: dict[str, dict] | None = None,
    workload_names: list[str] | None = None,
) -> dict:
    """Every feature set of ``features`` (default ``FEATURES``) on the workloads of ``feature_workloads`` (those
    named in ``workload_names``, default all), stock and SwiftKV, and with speculation also the same-text
    baseline (SwiftKV with fast prefill off), each (engine, feature set) in its own child process; the baselines
    also time each burst prefill-only. ``summary``: per workload and feature set the speed-up, the bound and the
    efficiency against each baseline, and with speculation each engine's acceptance (``feature_summary``)."""
    import torch
    from transformers import AutoConfig, AutoTokenizer

    import swiftkv_core  # noqa: F401  (registers the SwiftKV configs with AutoConfig)
    from swiftkv_core.flops import ModelShape, prefill_flops_total
    from swiftkv_serve.bench import default_dtype, device_name, run_in_child

    config = AutoConfig.from_pretrained(swiftkv)
    l, g = config.num_key_value_layers, config.key_value_group_size
    tokenizer = AutoTokenizer.from_pretrained(base)
    workloads = feature_workloads(tokenizer, num_requests, min(49000, len(tokenizer)))
    workloads = {name: workloads[name] for name in workload_names or workloads}
    shapes = {name: (max(map(len, prompts)), out) for name, (prompts, out) in workloads.items()}
    prompts = {name: prompts for name, (prompts, _) in workloads.items()}
    max_model_len = 256 * -(-max(p + o for p, o in shapes.values()) // 256)
    dtype = default_dtype()
    shape = ModelShape.from_config(config)
    flops_ratio, same_text_ratio = {}, {}
    for name, (p, _) in shapes.items():
        stock, swift = prefill_flops_total(shape, p), prefill_flops_total(shape, p, l, g)
        # Fast prefill off: every prompt token through every layer, AcrossKV's shared K/V still once per group.
        same_text = stock - (prefill_flops_total(shape, p, l) - swift)
        flops_ratio[name], same_text_ratio[name] = stock / swift, same_text / swift
    swift_label = f"SwiftKV l={l}"
    features = FEATURES if features is None else features
    runs: dict[str, dict[str, dict]] = {}
    for feature, options in features.items():
        engines = [(STOCK_LABEL, base, options), (swift_label, swiftkv, options)]
        if "speculative_config" in options:
            engines.append((SAME_TEXT_LABEL, swiftkv, options | FAST_PREFILL_OFF))
        for label, path, engine_options in engines:
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
                engine_options=engine_options,
                prompts=prompts,
                prefill_only=label != swift_label,
            )
    summary = {
        name: {
            feature: feature_summary(
                by_label[STOCK_LABEL],
                by_label[swift_label],
                name,
                flops_ratio[name],
                by_label.get(SAME_TEXT_LABEL),
                same_text_ratio[name],
            )
            for feature, by_label in runs.items()
        }
        for name in shapes
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
        "features": features,
        "workloads": {name: {"max_prompt_tokens": p, "output_tokens": o} for name, (p, o) in shapes.items()},
        "prefill_flops_ratio": flops_ratio,
        "same_text_prefill_flops_ratio": same_text_ratio,
        "runs": runs,
        "summary": summary,
    }


def same_outputs(a: dict, b: dict) -> float:
    """The share of requests of two runs of one burst whose output token ids are identical."""
    pairs = list(zip(a["output_digests"], b["output_digests"], strict=True))
    return sum(x == y for x, y in pairs) / len(pairs)


def versus(baseline: dict, swiftkv: dict, workload: str, flops_ratio: float) -> dict:
    """SwiftKV's run of ``workload`` against a baseline run that timed it prefill-only too: ``speedup_x``,
    ``bound_x`` (``prefill_bound``), ``efficiency`` (speed-up / bound), ``prefill_share`` and
    ``identical_outputs`` (``same_outputs``)."""
    total, swift_total = baseline["workloads"][workload]["wall_s"], swiftkv["workloads"][workload]["wall_s"]
    prefill = baseline["prefill_only"][workload]["wall_s"]
    speedup, bound = total / swift_total, prefill_bound(total, prefill, flops_ratio)
    return {
        "speedup_x": speedup,
        "bound_x": bound,
        "efficiency": speedup / bound,
        "prefill_share": prefill / total,
        "identical_outputs": same_outputs(baseline["workloads"][workload], swiftkv["workloads"][workload]),
    }


def feature_summary(
    stock: dict,
    swiftkv: dict,
    workload: str,
    flops_ratio: float,
    same_text: dict | None = None,
    same_text_ratio: float | None = None,
) -> dict:
    """One row of the features report: SwiftKV ``versus`` stock; with a same-text baseline run (SwiftKV with
    fast prefill off) also ``same_text``, SwiftKV ``versus`` it; with speculation each engine's ``spec_decode``
    stats."""
    row = versus(stock, swiftkv, workload, flops_ratio)
    if same_text is not None:
        row["same_text"] = versus(same_text, swiftkv, workload, same_text_ratio)
    runs = {"stock": stock, "swiftkv": swiftkv, "same_text": same_text}
    spec = {key: run["workloads"][workload].get("spec_decode") for key, run in runs.items() if run}
    if all(spec.values()):
        row["spec_decode"] = spec
    return row


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


SPEC_DECODE_NOTES = [
    "- With n-gram speculation the decode work depends on the text: a decode step emits one token plus the drafts "
    "it accepts, and drafts are accepted where the model copies its prompt. Stock and SwiftKV write different text "
    "(column 'same text as stock': the requests whose output token ids are identical), so their decode work "
    "differs and the stock row's bound, which assumes the same decode work, can be beaten or missed for reasons "
    "that are not the serving's. The same-text baseline is the SwiftKV checkpoint served with "
    f"`--additional-config '{json.dumps(FAST_PREFILL_OFF['additional_config'])}'`: every layer runs for every "
    "prompt token (its R: the bound line above), and its outputs are SwiftKV's (column 'same text'), so "
    "both decode the same tokens and its bound holds.",
    "- Counters, from vLLM over each timed burst (`vllm:spec_decode_num_draft_tokens`, "
    "`vllm:spec_decode_num_accepted_tokens`): acceptance = accepted / proposed draft tokens; decode steps = "
    "output tokens after each request's first - accepted tokens (request-steps); tokens / step = those tokens / "
    "steps.",
]
ENGINES = {"stock": "stock", "swiftkv": "SwiftKV", "same_text": "fast prefill off"}


def _row(cells: list) -> str:
    return "| " + " | ".join(map(str, cells)) + " |"


def _versus_row(name: str, feature: str, baseline_s: float, swiftkv_s: float, v: dict) -> str:
    """A table row of ``versus``'s result: wall times, speed-up, prefill share, bound, efficiency, same text."""
    return _row(
        [
            name,
            feature,
            f"{baseline_s:.1f}",
            f"{swiftkv_s:.1f}",
            f"{v['speedup_x']:.2f}x",
            _percent(v["prefill_share"]),
            f"{v['bound_x']:.2f}x",
            _percent(v["efficiency"]),
            _percent(v.get("identical_outputs")),
        ]
    )


def write_features_report(results: dict, out: Path) -> None:
    """``out``.json, .png (``plot_features``) and .md from ``compare_features``'s results."""
    l, num_layers = results["num_key_value_layers"], results["num_hidden_layers"]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=2))
    plot_features(results, out.with_suffix(".png"))
    swift_label = f"SwiftKV l={l}"
    lines = [
        f"# Serving with vLLM features: {results['model']} stock vs SwiftKV (l={l} of {num_layers})",
        "",
        f"vLLM {results['vllm_version']}, {results['device']}, eager={results['enforce_eager']}, bursts of "
        f"{results['num_requests']} requests (max_num_seqs={results['max_num_seqs']}), greedy, ignore_eos. "
        + swiftkv_origin(results),
        "",
        "| workload | features | stock s | SwiftKV s | speed-up | prefill share (stock) | bound | efficiency | "
        "same text as stock |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    same_text_lines, spec_lines, engines = [], [], ""
    for name, by_feature in results["summary"].items():
        for feature, r in by_feature.items():
            runs = results["runs"][feature]
            wall = {label: run["workloads"][name]["wall_s"] for label, run in runs.items()}
            lines.append(_versus_row(name, feature, wall[STOCK_LABEL], wall[swift_label], r))
            if "same_text" in r:
                same_text_lines.append(
                    _versus_row(name, feature, wall[SAME_TEXT_LABEL], wall[swift_label], r["same_text"])
                )
            if "spec_decode" in r:
                spec = r["spec_decode"]
                engines = " / ".join(ENGINES[key] for key in spec)
                spec_lines.append(
                    _row(
                        [
                            name,
                            feature,
                            " / ".join(_percent(spec[key]["acceptance_rate"]) for key in spec),
                            " / ".join(f"{spec[key]['tokens_per_step']:.2f}" for key in spec),
                            " / ".join(str(spec[key]["decode_steps"]) for key in spec),
                        ]
                    )
                )
    if same_text_lines:
        lines += [
            "",
            "With n-gram speculation, SwiftKV against the same checkpoint with fast prefill off (the same text, "
            "the stock prefill FLOPs; see below):",
            "",
            "| workload | features | fast prefill off s | SwiftKV s | speed-up | prefill share (off) | bound | "
            "efficiency | same text |",
            "|---|---|---|---|---|---|---|---|---|",
            *same_text_lines,
        ]
    if spec_lines:
        lines += [
            "",
            f"Speculative decoding in the timed bursts (the engines' counters; {engines}):",
            "",
            "| workload | features | acceptance | tokens / decode step | decode steps |",
            "|---|---|---|---|---|",
            *spec_lines,
        ]
    ratios = ", ".join(f"{name} {r:.2f}" for name, r in results["prefill_flops_ratio"].items())
    same_ratios = ", ".join(
        f"{name} {r:.2f}" for name, r in results.get("same_text_prefill_flops_ratio", {}).items()
    )
    lines += [
        "",
        "How it was measured:",
        "",
        "- One burst per workload, submitted at once to vLLM's async engine, streamed; each (engine, features) "
        "in its own process; with prefix caching the cache is emptied before each burst.",
        "- RAG: 4 shipping-log documents (~1500 tokens) shared by the questions; extraction: a document per "
        "request, the answer copies its lines; decode-heavy: random ids, 100 in / 500 out; long answers: chat "
        "requests for a long article in the model's chat template, ~65 in / 500 out.",
        f"- n-gram: `{json.dumps(NGRAM)}`.",
        "- bound = T / (T - T_prefill * (1 - 1/R)): T the baseline burst's wall time, T_prefill the same burst "
        f"with one output token, R the prefill FLOPs ratio at the workload's longest prompt ({ratios}; same-text "
        f"baseline: {same_ratios or '-'}); efficiency = speed-up / bound.",
        *(SPEC_DECODE_NOTES if spec_lines else []),
        "",
        "Command:",
        "",
        f"    {results['command']}",
        "",
    ]
    out.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))


def plot_features(results: dict, path: Path) -> None:
    """Per workload, the SwiftKV speed-up of each feature set over stock (blue bars) and, with speculation, over
    the same-text baseline (orange bars), each against its bound (black marks); efficiencies written on the
    bars. PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    summary = results["summary"]
    width = max(4.6 * len(summary), 10)  # room for the legend with one workload
    fig, axes = plt.subplots(1, len(summary), figsize=(width, 4.4), sharey=True, squeeze=False)
    bars = [
        (r, colour)
        for by_feature in summary.values()
        for row in by_feature.values()
        for r, colour in ((row, "tab:blue"), (row.get("same_text"), "tab:orange"))
        if r
    ]
    top = max(max(r["speedup_x"], r["bound_x"]) for r, _ in bars)
    for ax, (name, by_feature) in zip(axes[0], summary.items(), strict=True):
        features = list(by_feature)
        for i, feature in enumerate(features):
            row = by_feature[feature]
            pair = [(row, "tab:blue")] + ([(row["same_text"], "tab:orange")] if "same_text" in row else [])
            width = 0.7 / len(pair)
            for j, (r, colour) in enumerate(pair):
                x = i + (j - (len(pair) - 1) / 2) * width
                ax.bar(x, r["speedup_x"], 0.9 * width, color=colour)
                ax.plot([x - width / 2, x + width / 2], [r["bound_x"]] * 2, color="black", linewidth=2.5)
                ax.text(
                    x,
                    r["speedup_x"] / 2,
                    f"{100 * r['efficiency']:.0f}%",
                    ha="center",
                    va="center",
                    fontsize=8,
                    color="white",
                    rotation=90 if len(pair) > 1 else 0,
                )
        ax.axhline(1.0, color="gray", linewidth=0.8, linestyle="--")
        ax.set_xticks(range(len(features)), features, fontsize=9)
        workload = results["workloads"][name]
        ax.set_title(
            f"{name} (prompt <= {workload['max_prompt_tokens']}, {workload['output_tokens']} out)",
            fontsize=10,
        )
        ax.set_ylim(0, 1.15 * top)
    axes[0][0].set_ylabel("SwiftKV speed-up (x)")
    legend = [
        (Patch(color="tab:blue"), "over stock"),
        (Patch(color="tab:orange"), "over itself with fast prefill off (same text; n-gram rows)"),
        (Line2D([], [], color="black", linewidth=2.5), "bound (prefill R times cheaper, same decode work)"),
    ]
    fig.legend(*zip(*legend, strict=True), loc="lower center", ncol=len(legend), fontsize=8, frameon=False)
    fig.suptitle(
        f"vLLM {results['vllm_version']} on {results['device']}: {results['model']} stock vs SwiftKV "
        f"(l={results['num_key_value_layers']}), {results['num_requests']} requests per burst; "
        "efficiency = speed-up / bound",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    auto_cli(main, as_positional=False)
