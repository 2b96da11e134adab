"""vLLM's own features with SwiftKV: RAG, extraction, decode-heavy and long-answer workloads, each with none /
prefix caching / n-gram speculative decoding / both, stock vs SwiftKV (``compare_features``).

SwiftKV only makes prefill cheaper, so per workload and feature set a stock run with one output token measures the
prefill time ``T_prefill`` of the stock run's time ``T``, and the best SwiftKV can do is
``bound = T / (T - T_prefill * (1 - 1/R))``, with ``R`` the prefill FLOPs ratio (``swiftkv_core.flops``).

With n-gram speculation speed also depends on the weights: drafts are accepted when the model's greedy text copies
its prompt, so an engine whose model writes other text takes another number of decode steps, and the bound above
(which assumes the same decode work) bounds nothing. So each feature set with speculation also runs the SwiftKV
checkpoint with fast prefill off (``swiftkv_fast_prefill: false``): every layer for every prompt token, the stock
prefill FLOPs, and the same text as SwiftKV (checked per request by output digests). Against that baseline (the
"same text" rows) the bound holds again. ``features_report.py`` writes the report.
"""

from __future__ import annotations

import random
from pathlib import Path

from .bench import STOCK_LABEL, default_dtype, device_name, make_prompts, run_in_child
from .cli import describe
from .comparison import KV_CACHE_GIB

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
FEATURES = {
    "none": {},
    "prefix caching": {"enable_prefix_caching": True},
    "n-gram": {"speculative_config": NGRAM},
    "both": {"enable_prefix_caching": True, "speculative_config": NGRAM},
}
FAST_PREFILL_OFF = {"additional_config": {"swiftkv_fast_prefill": False}}  # the same-text baseline's engine
SAME_TEXT_LABEL = "SwiftKV, fast prefill off"


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
    from swiftkv_core.chat import chat_prompt_ids

    return chat_prompt_ids(
        tokenizer,
        [
            f"Write a long, detailed article about {_TOPICS[i % len(_TOPICS)]} for a general audience: an "
            "introduction, five sections with a heading each, and a conclusion."
            for i in range(num_requests)
        ],
    )


FEATURE_WORKLOADS = ("RAG", "extraction", "decode-heavy", "long answers")


def feature_workloads(tokenizer, num_requests: int) -> dict[str, tuple[list[list[int]], int]]:
    """name -> (prompts, output tokens): RAG (4 documents of ~1500 tokens, one question each request),
    extraction (a ~1000-token document per request, the answer copies its lines), decode-heavy (random ids,
    100 / 500) and long answers (chat requests for an article, ~65 / 500)."""
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
        "decode-heavy": (make_prompts(num_requests, 100, len(tokenizer)), 500),
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

    base, swiftkv = Path(base), Path(swiftkv)
    describe(swiftkv)  # a SwiftKV checkpoint vLLM serves, before any engine starts
    unknown = sorted(set(workload_names or []) - set(FEATURE_WORKLOADS))
    if unknown or num_requests < 1 or max_num_seqs < 1:
        raise ValueError(
            f"workload_names {unknown or workload_names} (known: {list(FEATURE_WORKLOADS)}), num_requests "
            f"{num_requests}, max_num_seqs {max_num_seqs}: name known workloads, and >= 1 request and sequence."
        )
    config = AutoConfig.from_pretrained(swiftkv)
    l, g = config.num_key_value_layers, config.key_value_group_size
    tokenizer = AutoTokenizer.from_pretrained(base)
    workloads = feature_workloads(tokenizer, num_requests)
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
